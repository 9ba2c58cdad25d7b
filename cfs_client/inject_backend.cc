// Latency and fault injection around any backend, for tests and benchmarks.

#include <atomic>
#include <mutex>
#include <random>

#include "cfs_client/backend.h"

namespace cubetorchfs::cfs_client {
namespace {

class InjectBackend;

// A WritableFile whose every request goes through the wrapper's injection first.
class InjectWritableFile final : public WritableFile {
 public:
  InjectWritableFile(std::unique_ptr<WritableFile> base, InjectBackend* owner, std::string path)
      : base_(std::move(base)), owner_(owner), path_(std::move(path)) {}
  Result<size_t> Write(uint64_t offset, const char* data, size_t len) override;
  Result<size_t> Read(uint64_t offset, size_t len, char* buf) override;
  Status Truncate(uint64_t size) override;
  Status Allocate(int mode, uint64_t offset, uint64_t len) override;
  Status Flush() override;
  Status Sync() override;
  Result<FileAttr> Stat() override { return base_->Stat(); }
  void Moved(const std::string& path) override { base_->Moved(path); }  // local state, not a request
  Status Close() override { return base_->Close(); }
  void Discard() override { base_->Discard(); }

 private:
  const std::unique_ptr<WritableFile> base_;
  InjectBackend* const owner_;
  const std::string path_;
};

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
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    CTFS_RETURN_IF_ERROR(Before("read " + path, true));
    return base_->StatRead(path, len, buf, check);
  }
  Result<int> OpenReadFd(const std::string& path, const FileVersion& expect) override {
    // A descriptor would let the reader skip the injected latency and errors.
    if (opts_.latency_us > 0 || opts_.error_rate > 0)
      return Status::NotSupported("fault injection is on: every byte goes through the daemon");
    return base_->OpenReadFd(path, expect);
  }

  Result<std::string> ReadLink(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Before("readlink " + path, false));
    return base_->ReadLink(path);
  }
  Result<FsStats> StatFs() override {
    CTFS_RETURN_IF_ERROR(Before("statfs", false));
    return base_->StatFs();
  }

  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& options) override {
    CTFS_RETURN_IF_ERROR(Before("open " + path, false, true));
    Result<std::unique_ptr<WritableFile>> f = base_->OpenWrite(path, options);
    if (!f.ok()) return f.status();
    return std::unique_ptr<WritableFile>(
        new InjectWritableFile(std::move(f).value(), this, path));
  }
  Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid,
                         int64_t gid) override {
    CTFS_RETURN_IF_ERROR(Before("mkdir " + path, false, true));
    return base_->Mkdir(path, mode, uid, gid);
  }
  Status Unlink(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Before("unlink " + path, false, true));
    return base_->Unlink(path);
  }
  Status Rmdir(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Before("rmdir " + path, false, true));
    return base_->Rmdir(path);
  }
  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    CTFS_RETURN_IF_ERROR(Before("rename " + from, false, true));
    return base_->Rename(from, to, noreplace);
  }
  Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t uid,
                           int64_t gid) override {
    CTFS_RETURN_IF_ERROR(Before("symlink " + path, false, true));
    return base_->Symlink(target, path, uid, gid);
  }
  Result<FileAttr> Link(const std::string& from, const std::string& to) override {
    CTFS_RETURN_IF_ERROR(Before("link " + to, false, true));
    return base_->Link(from, to);
  }
  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& change) override {
    CTFS_RETURN_IF_ERROR(Before("setattr " + path, false, true));
    return base_->SetAttr(path, change);
  }
  Status SyncDir(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Before("fsyncdir " + path, false, true));
    return base_->SyncDir(path);
  }

  // Counts a request, sleeps the configured latency, and fails it at the configured rate.
  Status Before(const std::string& what, bool is_read, bool is_write = false) {
    bool fail = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (opts_.error_rate > 0)
        fail = std::uniform_real_distribution<double>(0, 1)(rng_) < opts_.error_rate;
      if (counters_) {
        counters_->requests++;
        if (is_read) counters_->read_requests++;
        if (is_write) counters_->write_requests++;
        if (fail) counters_->injected_errors++;
      }
    }
    if (opts_.latency_us > 0) clock_->SleepMicros(opts_.latency_us);
    if (fail) return Status::IOError(what + ": injected backend error");
    return Status::OK();
  }


 private:
  const std::unique_ptr<Backend> base_;
  const conf::InjectOptions opts_;
  Clock* const clock_;
  std::mutex mu_;                   // guards rng_ and *counters_
  InjectCounters* const counters_;  // GUARDED_BY(mu_)
  std::mt19937_64 rng_;             // GUARDED_BY(mu_)
};

Result<size_t> InjectWritableFile::Write(uint64_t offset, const char* data, size_t len) {
  CTFS_RETURN_IF_ERROR(owner_->Before("write " + path_, false, true));
  return base_->Write(offset, data, len);
}
Result<size_t> InjectWritableFile::Read(uint64_t offset, size_t len, char* buf) {
  CTFS_RETURN_IF_ERROR(owner_->Before("read " + path_, true));
  return base_->Read(offset, len, buf);
}
Status InjectWritableFile::Truncate(uint64_t size) {
  CTFS_RETURN_IF_ERROR(owner_->Before("truncate " + path_, false, true));
  return base_->Truncate(size);
}
Status InjectWritableFile::Allocate(int mode, uint64_t offset, uint64_t len) {
  CTFS_RETURN_IF_ERROR(owner_->Before("fallocate " + path_, false, true));
  return base_->Allocate(mode, offset, len);
}
Status InjectWritableFile::Flush() {
  CTFS_RETURN_IF_ERROR(owner_->Before("flush " + path_, false, true));
  return base_->Flush();
}
Status InjectWritableFile::Sync() {
  CTFS_RETURN_IF_ERROR(owner_->Before("fsync " + path_, false, true));
  return base_->Sync();
}

}  // namespace

std::unique_ptr<Backend> NewInjectBackend(std::unique_ptr<Backend> base,
                                          const conf::InjectOptions& opts, Clock* clock,
                                          InjectCounters* counters) {
  return std::make_unique<InjectBackend>(std::move(base), opts, clock, counters);
}

}  // namespace cubetorchfs::cfs_client
