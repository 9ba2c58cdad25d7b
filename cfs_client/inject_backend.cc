// Latency and fault injection around any backend, for tests and benchmarks.

#include <atomic>
#include <mutex>
#include <random>

#include "cfs_client/backend.h"

namespace cubetorchfs::cfs_client {
namespace {

class InjectBackend final : public Backend {
 public:
  InjectBackend(std::unique_ptr<Backend> base, const conf::InjectOptions& opts, Clock* clock,
                InjectCounters* counters)
      : base_(std::move(base)), opts_(opts), clock_(clock), counters_(counters), rng_(opts.seed) {}

  Result<FileAttr> Stat(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Before("stat " + path, false));
    return base_->Stat(path);
  }
  Result<std::vector<DirEntry>> List(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Before("list " + path, false));
    return base_->List(path);
  }
  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    CTFS_RETURN_IF_ERROR(Before("read " + path, true));
    return base_->Read(path, expect, offset, len, buf);
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf) override {
    CTFS_RETURN_IF_ERROR(Before("read " + path, true));
    return base_->StatRead(path, len, buf);
  }
  Result<std::string> ReadLink(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Before("readlink " + path, false));
    return base_->ReadLink(path);
  }
  Result<FsStats> StatFs() override {
    CTFS_RETURN_IF_ERROR(Before("statfs", false));
    return base_->StatFs();
  }

 private:
  Status Before(const std::string& what, bool is_read) {
    bool fail = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (opts_.error_rate > 0)
        fail = std::uniform_real_distribution<double>(0, 1)(rng_) < opts_.error_rate;
      if (counters_) {
        counters_->requests++;
        if (is_read) counters_->read_requests++;
        if (fail) counters_->injected_errors++;
      }
    }
    if (opts_.latency_us > 0) clock_->SleepMicros(opts_.latency_us);
    if (fail) return Status::IOError(what + ": injected backend error");
    return Status::OK();
  }

  const std::unique_ptr<Backend> base_;
  const conf::InjectOptions opts_;
  Clock* const clock_;
  std::mutex mu_;                   // guards rng_ and *counters_
  InjectCounters* const counters_;  // GUARDED_BY(mu_)
  std::mt19937_64 rng_;             // GUARDED_BY(mu_)
};

}  // namespace

std::unique_ptr<Backend> NewInjectBackend(std::unique_ptr<Backend> base,
                                          const conf::InjectOptions& opts, Clock* clock,
                                          InjectCounters* counters) {
  return std::make_unique<InjectBackend>(std::move(base), opts, clock, counters);
}

}  // namespace cubetorchfs::cfs_client
