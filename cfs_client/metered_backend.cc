// Prometheus metrics for every backend request: counts by op and status, and latency.

#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>

#include "cfs_client/backend.h"

namespace cubetorchfs::cfs_client {
namespace {

enum Op { kStat, kList, kRead, kReadLink, kStatFs, kNumOps };
constexpr std::array<const char*, kNumOps> kOpNames = {"stat", "list", "read", "readlink",
                                                       "statfs"};
enum Outcome { kOk, kNotFound, kStaleOutcome, kError, kNumOutcomes };
constexpr std::array<const char*, kNumOutcomes> kOutcomeNames = {"ok", "not_found", "stale",
                                                                 "error"};

Outcome OutcomeOf(const Status& s) {
  if (s.ok()) return kOk;
  if (s.IsNotFound()) return kNotFound;
  if (s.IsStale()) return kStaleOutcome;
  return kError;
}

class MeteredBackend final : public Backend {
 public:
  MeteredBackend(std::unique_ptr<Backend> base, prometheus::Registry& registry, Clock* clock)
      : base_(std::move(base)), clock_(clock) {
    auto& requests = prometheus::BuildCounter()
                         .Name("cubetorchfs_backend_requests_total")
                         .Help("Requests to the backing store, by operation and status")
                         .Register(registry);
    auto& seconds = prometheus::BuildHistogram()
                        .Name("cubetorchfs_backend_request_seconds")
                        .Help("Latency of requests to the backing store")
                        .Register(registry);
    const prometheus::Histogram::BucketBoundaries buckets = {
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
        0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
    for (int op = 0; op < kNumOps; ++op) {
      for (int o = 0; o < kNumOutcomes; ++o)
        requests_[op][o] = &requests.Add({{"op", kOpNames[op]}, {"status", kOutcomeNames[o]}});
      seconds_[op] = &seconds.Add({{"op", kOpNames[op]}}, buckets);
    }
  }

  // Runs one request, recording its outcome and latency.
  template <typename Fn>
  auto Timed(Op op, Fn&& fn) {
    uint64_t start = clock_->NowNanos();
    auto r = fn();
    seconds_[op]->Observe(static_cast<double>(clock_->NowNanos() - start) / 1e9);
    requests_[op][OutcomeOf(r.status())]->Increment();
    return r;
  }

  Result<FileAttr> Stat(const std::string& path) override {
    return Timed(kStat, [&] { return base_->Stat(path); });
  }
  Result<std::vector<DirEntry>> List(const std::string& path) override {
    return Timed(kList, [&] { return base_->List(path); });
  }
  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    return Timed(kRead, [&] { return base_->Read(path, expect, offset, len, buf); });
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf) override {
    return Timed(kRead, [&] { return base_->StatRead(path, len, buf); });
  }
  Result<std::string> ReadLink(const std::string& path) override {
    return Timed(kReadLink, [&] { return base_->ReadLink(path); });
  }
  Result<FsStats> StatFs() override {
    return Timed(kStatFs, [&] { return base_->StatFs(); });
  }

 private:
  const std::unique_ptr<Backend> base_;
  Clock* const clock_;
  // Owned by the registry; prometheus-cpp metrics are thread-safe.
  prometheus::Counter* requests_[kNumOps][kNumOutcomes];
  prometheus::Histogram* seconds_[kNumOps];
};

}  // namespace

std::unique_ptr<Backend> NewMeteredBackend(std::unique_ptr<Backend> base,
                                           prometheus::Registry& registry, Clock* clock) {
  return std::make_unique<MeteredBackend>(std::move(base), registry, clock);
}

Result<std::unique_ptr<Backend>> NewBackend(const conf::BackendOptions& opts,
                                            prometheus::Registry& registry, Clock* clock) {
  Result<std::unique_ptr<Backend>> base = Status::InvalidArgument(
      "backend.type: unknown backend \"" + opts.type + "\" (known: posix, s3)");
  if (opts.type == "posix") base = NewPosixBackend(opts.root);
  if (opts.type == "s3") base = NewS3Backend(opts.s3);
  if (!base.ok()) return base.status();
  std::unique_ptr<Backend> b = std::move(base).value();
  if (opts.inject.enabled) b = NewInjectBackend(std::move(b), opts.inject, clock);
  return NewMeteredBackend(std::move(b), registry, clock);
}

}  // namespace cubetorchfs::cfs_client
