// The posix backend: a directory tree (a local disk, or a CubeFS/vePFS/NFS mount) as a store.

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "cfs_client/backend.h"

namespace cubetorchfs::cfs_client {

bool FileAttr::IsDir() const { return S_ISDIR(mode); }
bool FileAttr::IsRegular() const { return S_ISREG(mode); }
bool FileAttr::IsSymlink() const { return S_ISLNK(mode); }

namespace {

Status FromErrno(int err, const std::string& what) {
  std::string msg = what + ": " + std::strerror(err);
  switch (err) {
    case ENOENT:
      return Status::NotFound(msg);
    case EACCES:
    case EPERM:
      return Status::PermissionDenied(msg);
    case ENOTDIR:
      return Status::NotDirectory(msg);
    case EISDIR:
      return Status::IsDirectory(msg);
    case ENAMETOOLONG:
      return Status::NameTooLong(msg);
    case EINVAL:
      return Status::InvalidArgument(msg);
    default:
      return Status::IOError(msg);
  }
}

int64_t Nanos(const struct timespec& ts) {
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

FileAttr FromStat(const struct stat& st) {
  FileAttr a;
  a.mode = st.st_mode;
  a.size = static_cast<uint64_t>(st.st_size);
  a.nlink = static_cast<uint32_t>(st.st_nlink);
  a.uid = st.st_uid;
  a.gid = st.st_gid;
  a.atime_ns = Nanos(st.st_atim);
  a.mtime_ns = Nanos(st.st_mtim);
  a.ctime_ns = Nanos(st.st_ctim);
  a.blocks = static_cast<uint64_t>(st.st_blocks);
  return a;
}

// Owns a file descriptor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// Owns a DIR stream.
struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};

class PosixBackend final : public Backend {
 public:
  PosixBackend(std::string root, Fd root_fd)
      : root_(std::move(root)), root_fd_(std::move(root_fd)) {}

  Result<FileAttr> Stat(const std::string& path) override {
    struct stat st;
    if (::fstatat(root_fd_.get(), Rel(path), &st, AT_SYMLINK_NOFOLLOW) != 0)
      return FromErrno(errno, "stat " + Show(path));
    return FromStat(st);
  }

  Result<std::vector<DirEntry>> List(const std::string& path) override {
    int fd = ::openat(root_fd_.get(), Rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return FromErrno(errno, "opendir " + Show(path));
    std::unique_ptr<DIR, DirCloser> dir(::fdopendir(fd));
    if (!dir) {
      int err = errno;
      ::close(fd);
      return FromErrno(err, "opendir " + Show(path));
    }
    std::vector<DirEntry> out;
    for (;;) {
      errno = 0;
      struct dirent* de = ::readdir(dir.get());
      if (de == nullptr) {
        if (errno != 0) return FromErrno(errno, "readdir " + Show(path));
        break;
      }
      if (std::strcmp(de->d_name, ".") == 0 || std::strcmp(de->d_name, "..") == 0) continue;
      struct stat st;
      if (::fstatat(::dirfd(dir.get()), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;  // removed since readdir: not an entry any more
        return FromErrno(errno, "stat " + Show(path) + "/" + de->d_name);
      }
      out.push_back({de->d_name, FromStat(st)});
    }
    return out;
  }

  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    Result<Fetched> r = ReadAt(path, &expect, offset, len, buf);
    if (!r.ok()) return r.status();
    return r->bytes;
  }

  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf) override {
    Result<Fetched> r = ReadAt(path, nullptr, 0, len, buf);
    if (r.ok() && r->bytes != std::min<uint64_t>(len, r->attr.size))
      return Status::Stale("read " + Show(path) + ": file changed in the store while read");
    return r;
  }

  Result<std::string> ReadLink(const std::string& path) override {
    std::string target(4096, '\0');
    ssize_t n = ::readlinkat(root_fd_.get(), Rel(path), target.data(), target.size());
    if (n < 0) return FromErrno(errno, "readlink " + Show(path));
    target.resize(static_cast<size_t>(n));
    return target;
  }

  Result<FsStats> StatFs() override {
    struct statvfs sv;
    if (::fstatvfs(root_fd_.get(), &sv) != 0) return FromErrno(errno, "statfs " + root_);
    FsStats s;
    s.block_size = sv.f_frsize ? sv.f_frsize : sv.f_bsize;
    s.blocks = sv.f_blocks;
    s.blocks_free = sv.f_bfree;
    s.blocks_avail = sv.f_bavail;
    s.files = sv.f_files;
    s.files_free = sv.f_ffree;
    s.name_max = sv.f_namemax;
    return s;
  }

 private:
  static const char* Rel(const std::string& path) { return path.empty() ? "." : path.c_str(); }

  // Opens regular file `path`, checks it is at version `expect` (if given), reads up to `len`
  // bytes at `offset`, and checks the version did not change meanwhile (a file rewritten in
  // place keeps its size; its mtime tells the bytes may be mixed).
  Result<Fetched> ReadAt(const std::string& path, const FileVersion* expect, uint64_t offset,
                         size_t len, char* buf) const {
    Fd fd(::openat(root_fd_.get(), Rel(path), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (fd.get() < 0) return FromErrno(errno, "open " + Show(path));
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return FromErrno(errno, "fstat " + Show(path));
    if (!S_ISREG(st.st_mode))
      return Status::IsDirectory("read " + Show(path) + ": not a regular file");
    Fetched out{FromStat(st), 0};
    if (expect != nullptr && out.attr.Version() != *expect)
      return Status::Stale("read " + Show(path) + ": file changed in the store");
    Result<size_t> n = PreadFull(fd.get(), path, offset, len, buf);
    if (!n.ok()) return n.status();
    if (::fstat(fd.get(), &st) != 0) return FromErrno(errno, "fstat " + Show(path));
    if (FromStat(st).Version() != out.attr.Version())
      return Status::Stale("read " + Show(path) + ": file changed in the store while read");
    out.bytes = n.value();
    return out;
  }

  // Reads until `len` bytes or end of file.
  Result<size_t> PreadFull(int fd, const std::string& path, uint64_t offset, size_t len,
                           char* buf) const {
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::pread(fd, buf + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return FromErrno(errno, "read " + Show(path));
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }
  std::string Show(const std::string& path) const { return root_ + "/" + path; }

  const std::string root_;
  const Fd root_fd_;
};

}  // namespace

Result<std::unique_ptr<Backend>> NewPosixBackend(const std::string& root) {
  Fd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    int err = errno;
    if (err == ENOTDIR) return Status::NotDirectory(root + ": not a directory");
    return FromErrno(err, root);
  }
  if (::faccessat(fd.get(), ".", R_OK | X_OK, AT_EACCESS) != 0) return FromErrno(errno, root);
  return std::unique_ptr<Backend>(new PosixBackend(root, std::move(fd)));
}

}  // namespace cubetorchfs::cfs_client
