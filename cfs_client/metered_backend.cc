// Prometheus metrics for every backend request: counts by op and status, and latency.

#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <string>
#include <thread>

#include "cfs_client/backend.h"
#include "common/logging.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::cfs_client {
namespace {

std::atomic<bool> g_store_down{false};

enum Op {
  kStat,
  kList,
  kRead,
  kReadLink,
  kStatFs,
  kOpenWrite,
  kWrite,
  kTruncate,
  kFlush,
  kSync,
  kMkdir,
  kUnlink,
  kRmdir,
  kRename,
  kSymlink,
  kLink,
  kSetAttr,
  kSyncDir,
  kOpenRead,
  kMknod,
  kAllocate,
  kNumOps
};
constexpr std::array<const char*, kNumOps> kOpNames = {
    "stat",     "list",  "read",    "readlink", "statfs",    "open_write", "write",
    "truncate", "flush", "fsync",   "mkdir",    "unlink",    "rmdir",      "rename",
    "symlink",  "link",  "setattr", "fsyncdir", "open_read", "mknod",      "fallocate"};
enum Outcome { kOk, kNotFound, kStaleOutcome, kError, kNumOutcomes };
constexpr std::array<const char*, kNumOutcomes> kOutcomeNames = {"ok", "not_found", "stale",
                                                                 "error"};

Outcome OutcomeOf(const Status& s) {
  if (s.ok()) return kOk;
  if (s.IsNotFound()) return kNotFound;
  if (s.IsStale()) return kStaleOutcome;
  return kError;
}

// Results without a value (Status) and with one look the same to Timed().
const Status& StatusOf(const Status& s) { return s; }
template <typename T>
const Status& StatusOf(const Result<T>& r) {
  return r.status();
}

class MeteredBackend;

// Times the requests of a file being written (Stat, Moved, Close and Discard are local or
// unmetered: forwarded as they are).
class MeteredWritableFile final : public WritableFileWrapper {
 public:
  MeteredWritableFile(std::unique_ptr<WritableFile> base, MeteredBackend* owner)
      : WritableFileWrapper(std::move(base)), owner_(owner) {}
  Result<size_t> Write(uint64_t offset, const char* data, size_t len) override;
  Result<size_t> Read(uint64_t offset, size_t len, char* buf) override;
  Status Truncate(uint64_t size) override;
  Status Allocate(int mode, uint64_t offset, uint64_t len) override;
  Status Flush() override;
  Status Sync() override;

 private:
  MeteredBackend* const owner_;
};

// How often, during an outage, the store is asked whether it answers again. Short: until the
// answer comes, held attributes are served, and a file changed in the store meanwhile is
// opened at its old version (its uncached reads then fail with ESTALE until it is opened again).
constexpr std::chrono::milliseconds kProbeEvery{100};

// Every request is timed; capabilities() is forwarded (BackendWrapper).
class MeteredBackend final : public BackendWrapper {
 public:
  MeteredBackend(std::unique_ptr<Backend> base, prometheus::Registry& registry, Clock* clock,
                 std::string store)
      : BackendWrapper(std::move(base)), clock_(clock), store_(std::move(store)) {
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
    read_bytes_ = &prometheus::BuildCounter()
                       .Name("cubetorchfs_backend_read_bytes_total")
                       .Help("Bytes of file data read from the backing store")
                       .Register(registry)
                       .Add({});
    for (int op = 0; op < kNumOps; ++op) {
      for (int o = 0; o < kNumOutcomes; ++o)
        requests_[op][o] = &requests.Add({{"op", kOpNames[op]}, {"status", kOutcomeNames[o]}});
      seconds_[op] = &seconds.Add({{"op", kOpNames[op]}}, buckets);
    }
  }

  ~MeteredBackend() override {
    {
      MutexLock l(probe_mu_);
      stopping_ = true;
    }
    probe_cv_.notify_all();
    std::thread prober;
    {
      MutexLock l(outage_mu_);
      prober = std::move(prober_);
    }
    if (prober.joinable()) prober.join();
  }

  bool InOutage() const override { return down_.load(std::memory_order_relaxed); }

  // Runs one request, recording its outcome and latency.
  template <typename Fn>
  auto Timed(Op op, Fn&& fn) {
    uint64_t start = clock_->NowNanos();
    auto r = fn();
    seconds_[op]->Observe(static_cast<double>(clock_->NowNanos() - start) / 1e9);
    requests_[op][OutcomeOf(StatusOf(r))]->Increment();
    // A file's write that fails says nothing of whether the store answers reads (a CubeFS
    // volume without a writable data partition still serves them); it is reported to its
    // writer. Its success does say the store answers.
    if (StatusOf(r).ok() || !IsFileWrite(op)) NoteReachability(StatusOf(r), start);
    return r;
  }

  static bool IsFileWrite(Op op) {
    return op == kWrite || op == kTruncate || op == kFlush || op == kSync || op == kAllocate;
  }

  // An outage of the store is logged once when it starts (the first request that fails to
  // reach it: IOError is a connection error, a timeout or a 5xx after the retries) and once
  // when it ends (the next request that gets an answer), not at every failed request.
  // A request that began before the store last answered says nothing new when it fails: it
  // was sent during the outage that just ended (its timeout ran out after the store came
  // back).
  void NoteReachability(const Status& s, uint64_t started_ns) {
    const bool unreachable = s.code() == Status::Code::kIOError;
    if (!unreachable) {
      uint64_t seen = last_ok_ns_.load(std::memory_order_relaxed);
      while (seen < started_ns &&
             !last_ok_ns_.compare_exchange_weak(seen, started_ns, std::memory_order_relaxed)) {
      }
    } else if (started_ns < last_ok_ns_.load(std::memory_order_relaxed)) {
      return;
    }
    if (unreachable == down_.load(std::memory_order_relaxed)) {
      if (unreachable) failed_while_down_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    MutexLock l(outage_mu_);
    if (unreachable == down_.load()) return;
    down_.store(unreachable);
    g_store_down.store(unreachable);
    if (unreachable) {
      // Callers now serve what they hold instead of asking (InOutage), so something else must
      // find out when the store answers again: the prober, started at the first outage.
      if (!prober_.joinable()) prober_ = std::thread([this] { ProbeWhileDown(); });
      {
        MutexLock p(probe_mu_);  // so that the wake cannot fall between its check and its wait
      }
      probe_cv_.notify_all();
      down_since_ns_ = clock_->NowNanos();
      failed_while_down_.store(1);
      CTFS_LOG(kError) << "store " << store_ << " does not answer: " << s.ToString()
                       << "; reads of what is not cached fail with EIO until it does "
                       << "(logged once per outage)";
    } else {
      CTFS_LOG(kWarn) << "store " << store_ << " answers again after "
                      << static_cast<double>(clock_->NowNanos() - down_since_ns_) / 1e9 << " s; "
                      << failed_while_down_.load() << " requests failed meanwhile";
    }
  }

  // While the store is in an outage, asks it about its root every kProbeEvery, one request at
  // a time, until it answers (NoteReachability then ends the outage); asleep otherwise, until
  // the next outage wakes it. Takes probe_mu_ after outage_mu_, never the other way round.
  void ProbeWhileDown() {
    probe_mu_.lock();
    while (!stopping_) {
      probe_cv_.wait(probe_mu_, [this]() REQUIRES(probe_mu_) { return stopping_ || down_.load(); });
      probe_cv_.wait_for(probe_mu_, kProbeEvery,
                         [this]() REQUIRES(probe_mu_) { return stopping_; });
      if (stopping_ || !down_.load()) continue;
      probe_mu_.unlock();
      (void)Timed(kStat, [&] { return base()->Stat(""); });
      probe_mu_.lock();
    }
    probe_mu_.unlock();
  }

  Result<FileAttr> Stat(const std::string& path) override {
    return Timed(kStat, [&] { return base()->Stat(path); });
  }
  Result<std::vector<DirEntry>> List(const std::string& path) override {
    return Timed(kList, [&] { return base()->List(path); });
  }
  // Each page counts as one list request; opening the listing counts only when it fails (a
  // posix directory's open is a local system call, an object store's listing starts with its
  // first page).
  class Lister final : public DirLister {
   public:
    Lister(MeteredBackend* owner, std::unique_ptr<DirLister> base)
        : owner_(owner), base_(std::move(base)) {}
    Result<DirPage> Next(size_t max) override {
      return owner_->Timed(kList, [&] { return base_->Next(max); });
    }

   private:
    MeteredBackend* const owner_;
    const std::unique_ptr<DirLister> base_;
  };
  Result<std::unique_ptr<DirLister>> ListPages(const std::string& path) override {
    Result<std::unique_ptr<DirLister>> opened = base()->ListPages(path);
    if (!opened.ok()) return Timed(kList, [&] { return std::move(opened); });
    return std::unique_ptr<DirLister>(new Lister(this, std::move(opened).value()));
  }
  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    return Counted(Timed(kRead, [&] { return base()->Read(path, expect, offset, len, buf); }));
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    return Counted(Timed(kRead, [&] { return base()->StatRead(path, len, buf, check); }));
  }
  Result<Fetched> LookupRead(const std::string& path, size_t len, char* buf) override {
    return Counted(Timed(kStat, [&] { return base()->LookupRead(path, len, buf); }));
  }
  // Adds the bytes a read returned to cubetorchfs_backend_read_bytes_total.
  Result<size_t> Counted(Result<size_t> r) {
    if (r.ok()) read_bytes_->Increment(static_cast<double>(*r));
    return r;
  }
  Result<Fetched> Counted(Result<Fetched> r) {
    if (r.ok()) read_bytes_->Increment(static_cast<double>(r->bytes));
    return r;
  }
  Result<int> OpenReadFd(const std::string& path, const FileVersion& expect,
                         const AttrCheck& check = nullptr) override {
    uint64_t start = clock_->NowNanos();
    Result<int> r = base()->OpenReadFd(path, expect, check);
    if (r.status().code() == Status::Code::kNotSupported) return r;  // no request was made
    seconds_[kOpenRead]->Observe(static_cast<double>(clock_->NowNanos() - start) / 1e9);
    requests_[kOpenRead][OutcomeOf(r.status())]->Increment();
    return r;
  }

  Result<std::string> ReadLink(const std::string& path) override {
    return Timed(kReadLink, [&] { return base()->ReadLink(path); });
  }
  Result<FsStats> StatFs() override {
    return Timed(kStatFs, [&] { return base()->StatFs(); });
  }
  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& options) override {
    Result<std::unique_ptr<WritableFile>> f =
        Timed(kOpenWrite, [&] { return base()->OpenWrite(path, options); });
    if (!f.ok()) return f.status();
    return std::unique_ptr<WritableFile>(new MeteredWritableFile(std::move(f).value(), this));
  }
  Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid, int64_t gid) override {
    return Timed(kMkdir, [&] { return base()->Mkdir(path, mode, uid, gid); });
  }
  Result<FileAttr> Mknod(const std::string& path, mode_t mode, uint64_t rdev, int64_t uid,
                         int64_t gid) override {
    return Timed(kMknod, [&] { return base()->Mknod(path, mode, rdev, uid, gid); });
  }
  Status Unlink(const std::string& path) override {
    return Timed(kUnlink, [&] { return base()->Unlink(path); });
  }
  Status Rmdir(const std::string& path) override {
    return Timed(kRmdir, [&] { return base()->Rmdir(path); });
  }
  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    return Timed(kRename, [&] { return base()->Rename(from, to, noreplace); });
  }
  Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t uid,
                           int64_t gid) override {
    return Timed(kSymlink, [&] { return base()->Symlink(target, path, uid, gid); });
  }
  Result<FileAttr> Link(const std::string& from, const std::string& to) override {
    return Timed(kLink, [&] { return base()->Link(from, to); });
  }
  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& change) override {
    return Timed(kSetAttr, [&] { return base()->SetAttr(path, change); });
  }
  Status SyncDir(const std::string& path) override {
    return Timed(kSyncDir, [&] { return base()->SyncDir(path); });
  }

 private:
  std::atomic<bool> down_{false};
  std::atomic<uint64_t> last_ok_ns_{0};  // when the latest answered request began
  std::atomic<uint64_t> failed_while_down_{0};
  Mutex outage_mu_;  // orders the two log lines of an outage, and starts prober_
  uint64_t down_since_ns_ GUARDED_BY(outage_mu_) = 0;
  std::thread prober_ GUARDED_BY(outage_mu_);  // ProbeWhileDown, from the first outage on
  Mutex probe_mu_;
  std::condition_variable_any probe_cv_;  // wakes the prober: an outage began, or stop
  bool stopping_ GUARDED_BY(probe_mu_) = false;
  Clock* const clock_;
  const std::string store_;
  // Owned by the registry; prometheus-cpp metrics are thread-safe.
  prometheus::Counter* requests_[kNumOps][kNumOutcomes];
  prometheus::Histogram* seconds_[kNumOps];
  prometheus::Counter* read_bytes_ = nullptr;
};

Result<size_t> MeteredWritableFile::Write(uint64_t offset, const char* data, size_t len) {
  return owner_->Timed(kWrite, [&] { return base()->Write(offset, data, len); });
}
Result<size_t> MeteredWritableFile::Read(uint64_t offset, size_t len, char* buf) {
  return owner_->Counted(owner_->Timed(kRead, [&] { return base()->Read(offset, len, buf); }));
}
Status MeteredWritableFile::Truncate(uint64_t size) {
  return owner_->Timed(kTruncate, [&] { return base()->Truncate(size); });
}
Status MeteredWritableFile::Allocate(int mode, uint64_t offset, uint64_t len) {
  return owner_->Timed(kAllocate, [&] { return base()->Allocate(mode, offset, len); });
}
Status MeteredWritableFile::Flush() {
  return owner_->Timed(kFlush, [&] { return base()->Flush(); });
}
Status MeteredWritableFile::Sync() {
  return owner_->Timed(kSync, [&] { return base()->Sync(); });
}

}  // namespace

std::unique_ptr<Backend> NewMeteredBackend(std::unique_ptr<Backend> base,
                                           prometheus::Registry& registry, Clock* clock,
                                           const std::string& store) {
  return std::make_unique<MeteredBackend>(std::move(base), registry, clock, store);
}

bool StoreDown() { return g_store_down.load(std::memory_order_relaxed); }

}  // namespace cubetorchfs::cfs_client
