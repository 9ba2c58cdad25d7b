#include "cfs_client/s3_writable_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "common/logging.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::cfs_client {
namespace {

// A file being written: a staging file uploaded on Flush/Sync (see the top of this file).
class S3WritableFile final : public WritableFile {
 public:
  S3WritableFile(S3FileHost* b, std::string path, const FileAttr& attr, bool exists, bool empty,
                 std::string staging, int fd)
      : b_(b),
        path_(std::move(path)),
        attr_(attr),
        staging_(std::move(staging)),
        fd_(fd),
        materialized_(empty || !exists || attr.size == 0),
        dirty_(empty || !exists) {}

  ~S3WritableFile() override {
    if (discarded_) {
      // unlinked at Discard
    } else if (dirty_) {
      CTFS_LOG(kError) << "s3: " << b_->ShowPath(path_) << " closed with bytes never "
                       << "uploaded; they are kept in " << staging_;
    } else {
      ::unlink(staging_.c_str());
    }
    ::close(fd_);
  }

  Result<size_t> Write(uint64_t offset, const char* data, size_t len) override {
    MutexLock l(mu_);
    CTFS_RETURN_IF_ERROR(MaterializeLocked());
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::pwrite(fd_, data + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        if (done > 0) break;
        return LocalError("write");
      }
      done += static_cast<size_t>(n);
    }
    dirty_ = true;
    return done;
  }

  Result<size_t> Read(uint64_t offset, size_t len, char* buf) override {
    MutexLock l(mu_);
    CTFS_RETURN_IF_ERROR(MaterializeLocked());
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::pread(fd_, buf + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return LocalError("read");
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }

  Status Truncate(uint64_t size) override {
    MutexLock l(mu_);
    if (size == 0) {
      materialized_ = true;  // nothing of the object is needed
    } else {
      CTFS_RETURN_IF_ERROR(MaterializeLocked());
    }
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) return LocalError("truncate");
    dirty_ = true;
    return Status::OK();
  }

  Status Allocate(int, uint64_t, uint64_t) override {
    return Status::NotSupported("fallocate: an object store has no preallocation");
  }

  Status Flush() override {
    MutexLock l(mu_);
    if (!dirty_ || discarded_) return Status::OK();
    CTFS_RETURN_IF_ERROR(b_->UploadStaged(path_, fd_));
    dirty_ = false;
    return Status::OK();
  }

  // An upload that returned is in the store: the same as Flush.
  Status Sync() override { return Flush(); }

  Result<FileAttr> Stat() override {
    MutexLock l(mu_);
    FileAttr a = attr_;
    if (materialized_) {
      struct stat st;
      if (::fstat(fd_, &st) != 0) return LocalError("fstat");
      a.size = static_cast<uint64_t>(st.st_size);
      a.blocks = (a.size + 511) / 512;
      if (dirty_) a.mtime_ns = a.ctime_ns = st.st_mtim.tv_sec * 1'000'000'000 + st.st_mtim.tv_nsec;
    }
    return a;
  }

  void Moved(const std::string& path) override {
    MutexLock l(mu_);
    path_ = path;
  }

  // The staging file's name goes now; its descriptor keeps working for reads and writes
  // until the handle is released, and its space is freed then.
  void Discard() override {
    MutexLock l(mu_);
    if (discarded_) return;
    discarded_ = true;
    dirty_ = false;
    ::unlink(staging_.c_str());
  }

 private:
  Status LocalError(const char* what) const {
    const int err = errno;
    std::string msg = std::string(what) + " staging file " + staging_ + ": " + std::strerror(err);
    if (err == ENOSPC) return Status::NoSpace(msg);
    return Status::IOError(msg);
  }

  // Fetches the object's bytes into the staging file before its first partial change.
  Status MaterializeLocked() REQUIRES(mu_) {
    if (materialized_) return Status::OK();
    const uint64_t size = attr_.size;
    constexpr size_t kPiece = 8u << 20;
    std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(size, kPiece)));
    for (uint64_t off = 0; off < size; off += kPiece) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(kPiece, size - off));
      CTFS_ASSIGN_OR_RETURN(size_t n, b_->ReadObject(path_, attr_.Version(), off, len, buf.data()));
      if (n != len) return Status::Stale("s3 GET " + path_ + ": the object changed");
      if (::pwrite(fd_, buf.data(), len, static_cast<off_t>(off)) != static_cast<ssize_t>(len))
        return LocalError("write");
    }
    materialized_ = true;
    return Status::OK();
  }

  S3FileHost* const b_;
  // Guards everything below, and serializes the staging file's uploads: held across the
  // store's PUT or multipart upload, and the GET that materializes the object.
  Mutex mu_;
  std::string path_ GUARDED_BY(mu_);
  const FileAttr attr_;  // the object's attributes when opened
  const std::string staging_;
  const int fd_;
  bool materialized_ GUARDED_BY(mu_);       // the staging file holds the object's bytes
  bool dirty_ GUARDED_BY(mu_);              // changed since the last successful upload
  bool discarded_ GUARDED_BY(mu_) = false;  // unlinked or renamed over: never uploaded again
};

}  // namespace

std::unique_ptr<WritableFile> NewS3WritableFile(S3FileHost* host, std::string path,
                                                const FileAttr& attr, bool exists, bool empty,
                                                std::string staging, int fd) {
  return std::make_unique<S3WritableFile>(host, std::move(path), attr, exists, empty,
                                          std::move(staging), fd);
}

}  // namespace cubetorchfs::cfs_client
