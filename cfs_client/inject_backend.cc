// Latency, throughput limits and fault injection around any backend, for tests and benchmarks.
//
// One request through the wrapper: it waits for one of `max_concurrency` slots (0: none to
// wait for), sleeps `latency_us`, fails at `error_rate`, else runs on the wrapped store, and
// then pays the transfer of the bytes it moved at `bandwidth_bytes_s`. The link is one
// resource shared by all requests: each transfer reserves the next free interval of it (first
// come, first served), so N requests moving X bytes each at once take N * X / bandwidth in
// all. The slot is held from the start of the latency to the end of the transfer, so a request
// waiting for one sees the wait as latency too.

#include <algorithm>
#include <random>
#include <type_traits>

#include "cfs_client/backend.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::cfs_client {
namespace {

class InjectBackend;

// A WritableFile whose every request goes through the wrapper's injection first.
// (Stat, Moved, Close and Discard are local state, not requests: forwarded as they are.)
class InjectWritableFile final : public WritableFileWrapper {
 public:
  InjectWritableFile(std::unique_ptr<WritableFile> base, InjectBackend* owner, std::string path)
      : WritableFileWrapper(std::move(base)), owner_(owner), path_(std::move(path)) {}
  Result<size_t> Write(uint64_t offset, const char* data, size_t len) override;
  Result<size_t> Read(uint64_t offset, size_t len, char* buf) override;
  Status Truncate(uint64_t size) override;
  Status Allocate(int mode, uint64_t offset, uint64_t len) override;
  Status Flush() override;
  Status Sync() override;

 private:
  InjectBackend* const owner_;
  const std::string path_;
};

// What a request is, for the counters.
enum class Kind { kOther, kRead, kWrite };

// The bytes a request moved: the count a read or write returned, the data of a StatRead.
uint64_t BytesMoved(const Result<size_t>& r) { return r.ok() ? *r : 0; }
uint64_t BytesMoved(const Result<Backend::Fetched>& r) { return r.ok() ? r->bytes : 0; }

// Whether `opts` change anything a request sees.
bool Injecting(const conf::InjectOptions& opts) {
  return opts.latency_us > 0 || opts.error_rate > 0 || opts.max_concurrency > 0 ||
         opts.bandwidth_bytes_s > 0;
}

// Every request goes through Serve; capabilities() and OpenReadFd lose the descriptors while
// anything is injected.
class InjectBackend final : public BackendWrapper {
 public:
  InjectBackend(std::unique_ptr<Backend> base, const conf::InjectOptions& opts, Clock* clock,
                InjectCounters* counters)
      : BackendWrapper(std::move(base)),
        opts_(opts),
        clock_(clock),
        counters_(counters),
        rng_(opts.seed) {}

  Capabilities capabilities() const override {
    return InjectedCapabilities(base()->capabilities(), opts_);
  }

  Result<FileAttr> Stat(const std::string& path) override {
    return Serve("stat " + path, Kind::kOther, [&] { return base()->Stat(path); });
  }
  Result<std::vector<DirEntry>> List(const std::string& path) override {
    return Serve("list " + path, Kind::kOther, [&] { return base()->List(path); });
  }
  // Each page is a request of its own (a fault may come at any page).
  class Lister final : public DirLister {
   public:
    Lister(InjectBackend* owner, std::unique_ptr<DirLister> base, std::string what)
        : owner_(owner), base_(std::move(base)), what_(std::move(what)) {}
    Result<DirPage> Next(size_t max) override {
      return owner_->Serve(what_, Kind::kOther, [&] { return base_->Next(max); });
    }

   private:
    InjectBackend* const owner_;
    const std::unique_ptr<DirLister> base_;
    const std::string what_;
  };
  Result<std::unique_ptr<DirLister>> ListPages(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(std::unique_ptr<DirLister> base, base()->ListPages(path));
    return std::unique_ptr<DirLister>(new Lister(this, std::move(base), "list " + path));
  }
  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    return Serve("read " + path, Kind::kRead,
                 [&] { return base()->Read(path, expect, offset, len, buf); });
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    return Serve("read " + path, Kind::kRead,
                 [&] { return base()->StatRead(path, len, buf, check); });
  }
  Result<Fetched> LookupRead(const std::string& path, size_t len, char* buf) override {
    return Serve("stat " + path, Kind::kOther, [&] { return base()->LookupRead(path, len, buf); });
  }
  // A descriptor would let the reader skip the injected latency, limits and errors.
  Result<int> OpenReadFd(const std::string& path, const FileVersion& expect,
                         const AttrCheck& check = nullptr) override {
    if (Injecting(opts_))
      return Status::NotSupported("fault injection is on: every byte goes through the daemon");
    return base()->OpenReadFd(path, expect, check);
  }

  Result<std::string> ReadLink(const std::string& path) override {
    return Serve("readlink " + path, Kind::kOther, [&] { return base()->ReadLink(path); });
  }
  Result<FsStats> StatFs() override {
    return Serve("statfs", Kind::kOther, [&] { return base()->StatFs(); });
  }

  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& options) override {
    Result<std::unique_ptr<WritableFile>> f =
        Serve("open " + path, Kind::kWrite, [&] { return base()->OpenWrite(path, options); });
    if (!f.ok()) return f.status();
    return std::unique_ptr<WritableFile>(new InjectWritableFile(std::move(f).value(), this, path));
  }
  Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid, int64_t gid) override {
    return Serve("mkdir " + path, Kind::kWrite,
                 [&] { return base()->Mkdir(path, mode, uid, gid); });
  }
  Result<FileAttr> Mknod(const std::string& path, mode_t mode, uint64_t rdev, int64_t uid,
                         int64_t gid) override {
    return Serve("mknod " + path, Kind::kWrite,
                 [&] { return base()->Mknod(path, mode, rdev, uid, gid); });
  }
  Status Unlink(const std::string& path) override {
    return Serve("unlink " + path, Kind::kWrite, [&] { return base()->Unlink(path); });
  }
  Status Rmdir(const std::string& path) override {
    return Serve("rmdir " + path, Kind::kWrite, [&] { return base()->Rmdir(path); });
  }
  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    return Serve("rename " + from, Kind::kWrite,
                 [&] { return base()->Rename(from, to, noreplace); });
  }
  Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t uid,
                           int64_t gid) override {
    return Serve("symlink " + path, Kind::kWrite,
                 [&] { return base()->Symlink(target, path, uid, gid); });
  }
  Result<FileAttr> Link(const std::string& from, const std::string& to) override {
    return Serve("link " + to, Kind::kWrite, [&] { return base()->Link(from, to); });
  }
  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& change) override {
    return Serve("setattr " + path, Kind::kWrite, [&] { return base()->SetAttr(path, change); });
  }
  Status SyncDir(const std::string& path) override {
    return Serve("fsyncdir " + path, Kind::kWrite, [&] { return base()->SyncDir(path); });
  }

  // One request: a slot, the latency, maybe an injected error, else `op` on the store, then
  // the transfer of what it read or wrote. Returns what `op` returned (or the injected error).
  template <typename Op>
  auto Serve(const std::string& what, Kind kind, Op&& op) -> decltype(op()) {
    using R = decltype(op());
    Slot slot(this);
    Status st = Before(what, kind);
    if (!st.ok()) return R(std::move(st));
    R r = op();
    if constexpr (std::is_same_v<R, Result<size_t>> || std::is_same_v<R, Result<Fetched>>)
      Transfer(BytesMoved(r));
    return r;
  }

 private:
  // Holds one of the max_concurrency slots while it lives (waiting for one first).
  class Slot {
   public:
    explicit Slot(InjectBackend* owner) : owner_(owner) { owner_->Acquire(); }
    ~Slot() { owner_->Release(); }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;

   private:
    InjectBackend* const owner_;
  };

  void Acquire() EXCLUDES(mu_) {
    MutexLock l(mu_);
    while (opts_.max_concurrency > 0 && in_flight_ >= opts_.max_concurrency) slot_free_.Wait();
    ++in_flight_;
    if (counters_) counters_->peak_in_flight = std::max(counters_->peak_in_flight, in_flight_);
  }
  void Release() EXCLUDES(mu_) {
    {
      MutexLock l(mu_);
      --in_flight_;
    }
    if (opts_.max_concurrency > 0) slot_free_.Signal();
  }

  // Counts a request, sleeps the configured latency, and fails it at the configured rate.
  Status Before(const std::string& what, Kind kind) {
    bool fail = false;
    {
      MutexLock l(mu_);
      if (opts_.error_rate > 0)
        fail = std::uniform_real_distribution<double>(0, 1)(rng_) < opts_.error_rate;
      if (counters_) {
        counters_->requests++;
        if (kind == Kind::kRead) counters_->read_requests++;
        if (kind == Kind::kWrite) counters_->write_requests++;
        if (fail) counters_->injected_errors++;
      }
    }
    if (opts_.latency_us > 0) clock_->SleepMicros(opts_.latency_us);
    if (fail) return Status::IOError(what + ": injected backend error");
    return Status::OK();
  }

  // Sleeps until `bytes` have crossed the shared link: the transfer starts when the link is
  // free (now, or when the transfers reserved before this one end) and lasts
  // bytes / bandwidth_bytes_s.
  void Transfer(uint64_t bytes) {
    if (bytes == 0 || opts_.bandwidth_bytes_s == 0) return;
    const auto duration_ns = static_cast<uint64_t>(static_cast<double>(bytes) * 1e9 /
                                                   static_cast<double>(opts_.bandwidth_bytes_s));
    const uint64_t now = clock_->NowNanos();
    uint64_t end = 0;
    {
      MutexLock l(mu_);
      end = std::max(now, link_free_ns_) + duration_ns;
      link_free_ns_ = end;
    }
    if (end > now) clock_->SleepMicros((end - now + 999) / 1000);
  }

  const conf::InjectOptions opts_;
  Clock* const clock_;
  Mutex mu_;                 // guards everything below
  CondVar slot_free_{&mu_};  // in_flight_ went down
  InjectCounters* const counters_ PT_GUARDED_BY(mu_);
  std::mt19937_64 rng_ GUARDED_BY(mu_);
  uint64_t in_flight_ GUARDED_BY(mu_) = 0;     // requests holding a slot
  uint64_t link_free_ns_ GUARDED_BY(mu_) = 0;  // when the reserved transfers end
};

Result<size_t> InjectWritableFile::Write(uint64_t offset, const char* data, size_t len) {
  return owner_->Serve("write " + path_, Kind::kWrite,
                       [&] { return base()->Write(offset, data, len); });
}
Result<size_t> InjectWritableFile::Read(uint64_t offset, size_t len, char* buf) {
  return owner_->Serve("read " + path_, Kind::kRead,
                       [&] { return base()->Read(offset, len, buf); });
}
Status InjectWritableFile::Truncate(uint64_t size) {
  return owner_->Serve("truncate " + path_, Kind::kWrite, [&] { return base()->Truncate(size); });
}
Status InjectWritableFile::Allocate(int mode, uint64_t offset, uint64_t len) {
  return owner_->Serve("fallocate " + path_, Kind::kWrite,
                       [&] { return base()->Allocate(mode, offset, len); });
}
Status InjectWritableFile::Flush() {
  return owner_->Serve("flush " + path_, Kind::kWrite, [&] { return base()->Flush(); });
}
Status InjectWritableFile::Sync() {
  return owner_->Serve("fsync " + path_, Kind::kWrite, [&] { return base()->Sync(); });
}

}  // namespace

Capabilities InjectedCapabilities(Capabilities base, const conf::InjectOptions& opts) {
  if (Injecting(opts)) base.hands_out_fds = false;
  return base;
}

std::unique_ptr<Backend> NewInjectBackend(std::unique_ptr<Backend> base,
                                          const conf::InjectOptions& opts, Clock* clock,
                                          InjectCounters* counters) {
  return std::make_unique<InjectBackend>(std::move(base), opts, clock, counters);
}

}  // namespace cubetorchfs::cfs_client
