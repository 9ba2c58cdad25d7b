// The posix backend: a directory tree (a local disk, or a CubeFS/vePFS/NFS mount) as a store.
//
// Writes go straight through: a WritableFile is an O_RDWR descriptor of the file itself, written
// with pwrite (so every byte written is in the store's file at once, visible to its readers and
// surviving a crash of this daemon); Sync is fsync of that file. Renames are the store's own
// atomic rename(2); SyncDir fsyncs the directory, which is what makes a create, rename or
// unlink durable.
//
// Every path is resolved strictly beneath the root and never through a symlink: the parent
// directory is opened with openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) from the root's
// descriptor (a component walk with O_NOFOLLOW where openat2 is missing), and the operation
// acts on the last component with an *at call that does not follow it either. A component
// that is, or became, a symlink fails with ELOOP (ENOTDIR on the fallback walk); it is never
// followed to another file. Symlinks the users see are followed by the kernel, through
// readlink, with the caller's rights. Paths longer than PATH_MAX are walked in pieces.

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>

#include "cfs_client/backend.h"
#include "common/logging.h"
#include "common/unique_fd.h"

namespace cubetorchfs::cfs_client {

bool FileAttr::IsDir() const { return S_ISDIR(mode); }
bool FileAttr::IsRegular() const { return S_ISREG(mode); }
bool FileAttr::IsSymlink() const { return S_ISLNK(mode); }

namespace {

// A whole listing handed out in pages (Backend::ListPages' default).
class WholeLister final : public DirLister {
 public:
  explicit WholeLister(std::vector<DirEntry> entries) : entries_(std::move(entries)) {}
  Result<DirPage> Next(size_t max) override {
    DirPage page;
    const size_t n = std::min(std::max<size_t>(max, 1), entries_.size() - next_);
    page.entries.assign(std::make_move_iterator(entries_.begin() + next_),
                        std::make_move_iterator(entries_.begin() + next_ + n));
    next_ += n;
    page.last = next_ == entries_.size();
    if (page.last) std::vector<DirEntry>().swap(entries_);
    next_ = page.last ? 0 : next_;
    return page;
  }

 private:
  std::vector<DirEntry> entries_;
  size_t next_ = 0;
};

}  // namespace

Result<std::unique_ptr<DirLister>> Backend::ListPages(const std::string& path) {
  CTFS_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, List(path));
  return std::unique_ptr<DirLister>(new WholeLister(std::move(entries)));
}

namespace {

int64_t Nanos(const struct timespec& ts) {
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace

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
  a.rdev = static_cast<uint64_t>(st.st_rdev);
  a.store_dev = static_cast<uint64_t>(st.st_dev);
  a.store_ino = static_cast<uint64_t>(st.st_ino);
  return a;
}

namespace {

// openat2 is used while the kernel has it; once it is missing (ENOSYS) or filtered (EPERM
// from a seccomp profile), the component walk is used.
std::atomic<bool> g_have_openat2{true};

// openat2(`dirfd`, `path`, `flags`) strictly beneath `dirfd`, following no symlink in any
// component, the last included. -1 and errno on failure; ENOSYS once openat2 is unusable.
int OpenBeneath(int dirfd, const std::string& path, int flags) {
  if (g_have_openat2.load(std::memory_order_relaxed)) {
    struct open_how how {};
    how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    for (int attempt = 0; attempt < 16; ++attempt) {
      const long r = ::syscall(SYS_openat2, dirfd, path.c_str(), &how, sizeof(how));
      if (r >= 0) return static_cast<int>(r);
      if (errno == EAGAIN || errno == EINTR) continue;  // a rename raced the lookup
      if (errno != ENOSYS && errno != EPERM) return -1;
      g_have_openat2.store(false, std::memory_order_relaxed);
      break;
    }
    if (g_have_openat2.load(std::memory_order_relaxed)) return -1;  // EAGAIN 16 times
  }
  errno = ENOSYS;
  return -1;
}

// Opens directory `path` (relative, no "." or ".." components: Locate checks) beneath
// directory `dirfd` as an O_PATH descriptor, following no symlink. -1 and errno on failure.
int OpenDirNoFollow(int dirfd, const std::string& path) {
  constexpr int kFlags = O_PATH | O_DIRECTORY | O_CLOEXEC;
  const int direct = OpenBeneath(dirfd, path, kFlags);
  if (direct >= 0 || errno != ENOSYS) return direct;
  // Without openat2: one component at a time, each opened O_NOFOLLOW.
  int cur = dirfd;
  UniqueFd held;
  for (size_t start = 0; start <= path.size();) {
    size_t slash = path.find('/', start);
    if (slash == std::string::npos) slash = path.size();
    const int fd = ::openat(cur, path.substr(start, slash - start).c_str(), kFlags | O_NOFOLLOW);
    if (fd < 0) return -1;
    held = UniqueFd(fd);
    cur = fd;
    start = slash + 1;
  }
  return held.release();
}

// A path's place in the store: the directory it is in, opened beneath the root, and its last
// component. `dir` is the root's descriptor or `owned`'s.
struct At {
  UniqueFd owned;
  int dir = -1;
  std::string name;  // "." for the root itself
};

// The store identity (FileAttr::StoreId) of the object open at `fd`, or 0 (errno set).
uint64_t IdOfFd(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return 0;
  return FromStat(st).StoreId();
}

// The directory `path` is named in ("" for the root's entries).
std::string_view ParentOf(const std::string& path) {
  const size_t last = path.rfind('/');
  return last == std::string::npos ? std::string_view() : std::string_view(path).substr(0, last);
}

// Checks the object open at `fd` is the one Expected binds to `path` (docs/security.md).
Status CheckFd(int fd, std::string_view path, const char* what) {
  if (!Expected::Any() || Expected::IdOf(path) == 0) return Status::OK();
  const uint64_t id = IdOfFd(fd);
  if (id == 0) return Status::FromErrno(errno, std::string(what) + " " + std::string(path));
  return Expected::Check(path, id, what);
}

// What openat2 is given at once; longer directory paths are opened piece by piece.
constexpr size_t kPathPiece = 3072;

// Owns a DIR stream.
struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};

// A file open for writing: its descriptor, written through.
class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(UniqueFd fd, std::string show) : fd_(std::move(fd)), show_(std::move(show)) {}

  Result<size_t> Write(uint64_t offset, const char* data, size_t len) override {
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::pwrite(fd_.get(), data + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        // Bytes already written stay written (as with write(2)); report them if any.
        if (done > 0) return done;
        return Status::FromErrno(errno, "write " + show_);
      }
      done += static_cast<size_t>(n);
    }
    return done;
  }

  Result<size_t> Read(uint64_t offset, size_t len, char* buf) override {
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::pread(fd_.get(), buf + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::FromErrno(errno, "read " + show_);
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }

  Status Truncate(uint64_t size) override {
    if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0)
      return Status::FromErrno(errno, "truncate " + show_);
    return Status::OK();
  }

  Status Allocate(int mode, uint64_t offset, uint64_t len) override {
    if (::fallocate(fd_.get(), mode, static_cast<off_t>(offset), static_cast<off_t>(len)) != 0)
      return Status::FromErrno(errno, "fallocate " + show_);
    return Status::OK();
  }

  // pwrite already put the bytes in the store's file. A store that writes back at close
  // (NFS and the like) reports its errors only at close(2): close a duplicate descriptor to
  // get them now, as close(2) of the writer's own descriptor would.
  Status Flush() override {
    const int d = ::dup(fd_.get());
    if (d < 0) return Status::FromErrno(errno, "flush " + show_);
    if (::close(d) != 0) return Status::FromErrno(errno, "flush (close) " + show_);
    return Status::OK();
  }

  Status Sync() override {
    if (::fsync(fd_.get()) != 0) return Status::FromErrno(errno, "fsync " + show_);
    return Status::OK();
  }

  Result<FileAttr> Stat() override {
    struct stat st;
    if (::fstat(fd_.get(), &st) != 0) return Status::FromErrno(errno, "fstat " + show_);
    return FromStat(st);
  }

  // close(2) releases the descriptor even when it fails (EINTR included): never retried.
  Status Close() override {
    if (fd_.get() < 0) return Status::OK();
    if (::close(fd_.release()) != 0) return Status::FromErrno(errno, "close " + show_);
    return Status::OK();
  }

  ~PosixWritableFile() override {
    if (Status s = Close(); !s.ok()) CTFS_LOG(kError) << s.ToString();
  }

 private:
  UniqueFd fd_;
  const std::string show_;
};

class PosixBackend final : public Backend {
 public:
  PosixBackend(std::string root, UniqueFd root_fd)
      : root_(std::move(root)), root_fd_(std::move(root_fd)) {}

  Capabilities capabilities() const override {
    return CapabilitiesOfType(conf::BackendType::kPosix);
  }

  Result<FileAttr> Stat(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "stat"));
    struct stat st;
    if (::fstatat(at.dir, at.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      return Status::FromErrno(errno, "stat " + Show(path));
    const FileAttr attr = FromStat(st);
    if (Expected::Any()) CTFS_RETURN_IF_ERROR(Expected::Check(path, attr.StoreId(), "stat"));
    return attr;
  }

  // One open directory, read as far as each page needs (one entry read ahead, so a page knows
  // whether it is the last).
  class Lister final : public DirLister {
   public:
    Lister(std::unique_ptr<DIR, DirCloser> dir, std::string shown)
        : dir_(std::move(dir)), shown_(std::move(shown)) {}
    Result<DirPage> Next(size_t max) override {
      DirPage page;
      if (!dir_) return page;
      for (;;) {
        std::string name;
        if (ahead_) {
          name = std::move(*ahead_);
          ahead_.reset();
        } else {
          CTFS_ASSIGN_OR_RETURN(std::optional<std::string> read, ReadName());
          if (!read) break;
          name = std::move(*read);
        }
        if (page.entries.size() == std::max<size_t>(max, 1)) {
          ahead_ = std::move(name);
          page.last = false;
          return page;
        }
        struct stat st;
        if (::fstatat(::dirfd(dir_.get()), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
          if (errno == ENOENT) continue;  // removed since readdir: not an entry any more
          return Status::FromErrno(errno, "stat " + shown_ + "/" + name);
        }
        page.entries.push_back({std::move(name), FromStat(st)});
      }
      dir_.reset();  // the last page: the descriptor goes now, not with the lister
      return page;
    }

   private:
    Result<std::optional<std::string>> ReadName() {
      for (;;) {
        errno = 0;
        struct dirent* de = ::readdir(dir_.get());
        if (de == nullptr) {
          if (errno != 0) return Status::FromErrno(errno, "readdir " + shown_);
          return std::optional<std::string>();
        }
        if (std::strcmp(de->d_name, ".") != 0 && std::strcmp(de->d_name, "..") != 0)
          return std::optional<std::string>(de->d_name);
      }
    }
    std::unique_ptr<DIR, DirCloser> dir_;
    const std::string shown_;
    std::optional<std::string> ahead_;
  };

  Result<std::unique_ptr<DirLister>> ListPages(const std::string& path) override {
    using DirStream = std::unique_ptr<DIR, DirCloser>;
    CTFS_ASSIGN_OR_RETURN(DirStream dir, OpenDirStream(path));
    return std::unique_ptr<DirLister>(new Lister(std::move(dir), Show(path)));
  }

  Result<std::unique_ptr<DIR, DirCloser>> OpenDirStream(const std::string& path) {  // NOLINT
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "opendir"));
    int fd = ::openat(at.dir, at.name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return Status::FromErrno(errno, "opendir " + Show(path));
    if (Status s = CheckFd(fd, path, "opendir"); !s.ok()) {
      ::close(fd);
      return s;
    }
    std::unique_ptr<DIR, DirCloser> dir(::fdopendir(fd));
    if (!dir) {
      int err = errno;
      ::close(fd);
      return Status::FromErrno(err, "opendir " + Show(path));
    }
    return dir;
  }

  Result<std::vector<DirEntry>> List(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(std::unique_ptr<DirLister> lister, ListPages(path));
    CTFS_ASSIGN_OR_RETURN(DirPage page, lister->Next(std::numeric_limits<size_t>::max()));
    return std::move(page.entries);
  }

  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    CTFS_ASSIGN_OR_RETURN(Fetched r, ReadAt(path, &expect, offset, len, buf));
    return r.bytes;
  }

  Result<int> OpenReadFd(const std::string& path, const FileVersion& expect,
                         const AttrCheck& check = nullptr) override {
    struct stat st;
    CTFS_ASSIGN_OR_RETURN(UniqueFd fd, OpenRegular(path, "open", &st));
    if (FromStat(st).Version() != expect)
      return Status::Stale("open " + Show(path) + ": file changed in the store");
    if (check) CTFS_RETURN_IF_ERROR(check(FromStat(st)));
    // The descriptor leaves the daemon: it gets ordinary blocking semantics.
    if (::fcntl(fd.get(), F_SETFL, 0) != 0) return Status::FromErrno(errno, "fcntl " + Show(path));
    return fd.release();
  }

  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    Result<Fetched> r = ReadAt(path, nullptr, 0, len, buf, check);
    if (r.ok() && r->bytes != std::min<uint64_t>(len, r->attr.size))
      return Status::Stale("read " + Show(path) + ": file changed in the store while read");
    return r;
  }

  Result<std::string> ReadLink(const std::string& path) override {
    std::string target(4096, '\0');
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "readlink"));
    CTFS_RETURN_IF_ERROR(Pin(&at, path, "readlink"));
    ssize_t n = ::readlinkat(at.dir, at.name.c_str(), target.data(), target.size());
    if (n < 0) return Status::FromErrno(errno, "readlink " + Show(path));
    target.resize(static_cast<size_t>(n));
    return target;
  }

  Result<FsStats> StatFs() override {
    struct statvfs sv;
    if (::fstatvfs(root_fd_.get(), &sv) != 0) return Status::FromErrno(errno, "statfs " + root_);
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

  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& o) override {
    // An existing file Expected names is checked before it is truncated: O_TRUNC would empty
    // whatever sits at the name.
    const bool pinned = Expected::Any() && Expected::IdOf(path) != 0;
    const int base = O_RDWR | O_NOFOLLOW | O_CLOEXEC | (o.truncate && !pinned ? O_TRUNC : 0);
    // Create with O_EXCL first, so we know whether this call made the file (only then is it
    // given to the caller); if it exists and that is allowed, open it as it is.
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "open"));
    bool created = false;
    UniqueFd fd;
    for (int attempt = 0; attempt < 8 && fd.get() < 0; ++attempt) {
      if (o.create) {
        fd = UniqueFd(::openat(at.dir, at.name.c_str(), base | O_CREAT | O_EXCL, o.mode & 07777));
        if (fd.get() >= 0) {
          created = true;
          break;
        }
        if (errno != EEXIST || o.exclusive) return Status::FromErrno(errno, "create " + Show(path));
      }
      fd = UniqueFd(::openat(at.dir, at.name.c_str(), base));
      if (fd.get() < 0 && (errno != ENOENT || !o.create))
        return Status::FromErrno(errno, "open " + Show(path));
    }
    if (fd.get() < 0) return Status::FromErrno(errno, "open " + Show(path));
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat " + Show(path));
    if (!S_ISREG(st.st_mode)) return Status::IsDirectory(Show(path) + ": not a regular file");
    if (pinned && !created) {
      CTFS_RETURN_IF_ERROR(Expected::Check(path, FromStat(st).StoreId(), "open"));
      if (o.truncate && ::ftruncate(fd.get(), 0) != 0)
        return Status::FromErrno(errno, "truncate " + Show(path));
    }
    if (created) {
      Chown(fd.get(), "", o.uid, o.gid, st);
      // The mode asked for, not narrowed by the daemon's umask (the kernel applied the
      // caller's); after the chown, which would clear set-id bits.
      ::fchmod(fd.get(), o.mode & 07777);
    }
    return std::unique_ptr<WritableFile>(new PosixWritableFile(std::move(fd), Show(path)));
  }

  Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid, int64_t gid) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "mkdir"));
    if (::mkdirat(at.dir, at.name.c_str(), mode & 07777) != 0)
      return Status::FromErrno(errno, "mkdir " + Show(path));
    return OwnedWithMode(at, path, mode, uid, gid);
  }

  Result<FileAttr> Mknod(const std::string& path, mode_t mode, uint64_t rdev, int64_t uid,
                         int64_t gid) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "mknod"));
    if (::mknodat(at.dir, at.name.c_str(), mode & (S_IFMT | 07777), static_cast<dev_t>(rdev)) != 0)
      return Status::FromErrno(errno, "mknod " + Show(path));
    return OwnedWithMode(at, path, mode, uid, gid);
  }

  Status Unlink(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "unlink"));
    if (::unlinkat(at.dir, at.name.c_str(), 0) != 0)
      return Status::FromErrno(errno, "unlink " + Show(path));
    return Status::OK();
  }

  Status Rmdir(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "rmdir"));
    if (::unlinkat(at.dir, at.name.c_str(), AT_REMOVEDIR) != 0)
      return Status::FromErrno(errno, "rmdir " + Show(path));
    return Status::OK();
  }

  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    CTFS_ASSIGN_OR_RETURN(At a, Locate(from, "rename"));
    CTFS_ASSIGN_OR_RETURN(At b, Locate(to, "rename"));
    const int r =
        ::renameat2(a.dir, a.name.c_str(), b.dir, b.name.c_str(), noreplace ? RENAME_NOREPLACE : 0);
    if (r != 0) return Status::FromErrno(errno, "rename " + Show(from) + " to " + Show(to));
    return Status::OK();
  }

  Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t uid,
                           int64_t gid) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "symlink"));
    if (::symlinkat(target.c_str(), at.dir, at.name.c_str()) != 0)
      return Status::FromErrno(errno, "symlink " + Show(path));
    return StatOwnedBy(path, uid, gid);
  }

  Result<FileAttr> Link(const std::string& from, const std::string& to) override {
    CTFS_ASSIGN_OR_RETURN(At a, Locate(from, "link"));
    CTFS_RETURN_IF_ERROR(Pin(&a, from, "link"));
    CTFS_ASSIGN_OR_RETURN(At b, Locate(to, "link"));
    if (::linkat(a.dir, a.name.c_str(), b.dir, b.name.c_str(),
                 a.name.empty() ? AT_EMPTY_PATH : 0) != 0)
      return Status::FromErrno(errno, "link " + Show(from) + " to " + Show(to));
    return Stat(to);
  }

  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& c) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "setattr"));
    // An object Expected names is changed through a descriptor of it, checked first.
    CTFS_RETURN_IF_ERROR(Pin(&at, path, "setattr"));
    const int nofollow = at.name.empty() ? AT_EMPTY_PATH : AT_SYMLINK_NOFOLLOW;
    // AT_SYMLINK_NOFOLLOW: glibc changes the file itself through an O_PATH descriptor, and
    // refuses (EOPNOTSUPP) a symlink rather than change what it points to.
    if (c.mode && Chmod(at, *c.mode & 07777) != 0)
      return Status::FromErrno(errno, "chmod " + Show(path));
    if ((c.uid || c.gid) &&
        ::fchownat(at.dir, at.name.c_str(), c.uid ? static_cast<uid_t>(*c.uid) : uid_t(-1),
                   c.gid ? static_cast<gid_t>(*c.gid) : gid_t(-1), nofollow) != 0)
      return Status::FromErrno(errno, "chown " + Show(path));
    if (c.atime_ns || c.mtime_ns) {
      auto ts = [](const std::optional<int64_t>& ns) {
        if (!ns) return timespec{0, UTIME_OMIT};
        if (*ns == AttrChange::kTimeNow) return timespec{0, UTIME_NOW};
        return timespec{static_cast<time_t>(*ns / 1'000'000'000),
                        static_cast<long>(*ns % 1'000'000'000)};
      };
      const timespec times[2] = {ts(c.atime_ns), ts(c.mtime_ns)};
      if (::utimensat(at.dir, at.name.c_str(), times, nofollow) != 0)
        return Status::FromErrno(errno, "utimens " + Show(path));
    }
    if (at.name.empty()) {  // pinned: the attributes of the object changed, not of its name
      struct stat st;
      if (::fstat(at.dir, &st) != 0) return Status::FromErrno(errno, "fstat " + Show(path));
      return FromStat(st);
    }
    return Stat(path);
  }

  Status SyncDir(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(At at, Locate(path, "open"));
    UniqueFd fd(::openat(at.dir, at.name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (fd.get() < 0) return Status::FromErrno(errno, "open " + Show(path));
    if (::fsync(fd.get()) != 0) return Status::FromErrno(errno, "fsync " + Show(path));
    return Status::OK();
  }

 private:
  // Where `path` is: its parent directory opened beneath the root without following any
  // symlink, and its last component. InvalidArgument for "." / ".." / empty components.
  Result<At> Locate(const std::string& path, const char* what) const {
    At at;
    at.dir = root_fd_.get();
    if (path.empty()) {
      at.name = ".";
      return at;
    }
    if (path.find('\0') != std::string::npos || path.front() == '/' || path.back() == '/')
      return Status::InvalidArgument(std::string(what) + " " + Show(path) + ": not a store path");
    for (size_t start = 0;;) {
      const size_t slash = path.find('/', start);
      const size_t len = (slash == std::string::npos ? path.size() : slash) - start;
      if (len == 0 || (len == 1 && path[start] == '.') ||
          (len == 2 && path[start] == '.' && path[start + 1] == '.'))
        return Status::InvalidArgument(std::string(what) + " " + Show(path) +
                                       ": \".\", \"..\" or empty component");
      if (slash == std::string::npos) break;
      start = slash + 1;
    }
    const size_t last = path.rfind('/');
    if (last == std::string::npos) {
      at.name = path;
      CTFS_RETURN_IF_ERROR(CheckFd(at.dir, std::string_view(), what));
      return at;
    }
    at.name = path.substr(last + 1);
    // The parent, opened in pieces of at most kPathPiece bytes cut at slashes.
    size_t start = 0;
    while (start < last) {
      size_t end = last;
      if (end - start > kPathPiece) end = path.rfind('/', start + kPathPiece);
      const int fd = OpenDirNoFollow(at.dir, path.substr(start, end - start));
      if (fd < 0) return Status::FromErrno(errno, std::string(what) + " " + Show(path));
      at.owned = UniqueFd(fd);
      at.dir = fd;
      start = end + 1;
    }
    CTFS_RETURN_IF_ERROR(CheckFd(at.dir, std::string_view(path).substr(0, last), what));
    return at;
  }

  // Pins `at` (of `path`) to the object itself when Expected names it: an O_PATH descriptor of
  // it, checked, becomes `at.dir` with an empty name, for an *at call with AT_EMPTY_PATH. A
  // symlink is pinned as the link (O_NOFOLLOW).
  Status Pin(At* at, const std::string& path, const char* what) const {
    if (!Expected::Any() || Expected::IdOf(path) == 0) return Status::OK();
    UniqueFd fd(::openat(at->dir, at->name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (fd.get() < 0) return Status::FromErrno(errno, std::string(what) + " " + Show(path));
    CTFS_RETURN_IF_ERROR(CheckFd(fd.get(), path, what));
    at->owned = std::move(fd);
    at->dir = at->owned.get();
    at->name.clear();
    return Status::OK();
  }

  // chmod of `at` without following a symlink: through fchmodat2(AT_EMPTY_PATH) for a pinned
  // object (through /proc where the kernel lacks it); glibc's AT_SYMLINK_NOFOLLOW otherwise.
  static int Chmod(const At& at, mode_t mode) {
    if (!at.name.empty()) return ::fchmodat(at.dir, at.name.c_str(), mode, AT_SYMLINK_NOFOLLOW);
    struct stat st;
    if (::fstat(at.dir, &st) != 0) return -1;
    if (S_ISLNK(st.st_mode)) return errno = EOPNOTSUPP, -1;
#ifdef SYS_fchmodat2
    if (::syscall(SYS_fchmodat2, at.dir, "", mode, AT_EMPTY_PATH) == 0) return 0;
    if (errno != ENOSYS && errno != EINVAL) return -1;
#endif
    return ::chmod(("/proc/self/fd/" + std::to_string(at.dir)).c_str(), mode);
  }

  // Opens regular file `path`, checks it is at version `expect` (if given), reads up to `len`
  // bytes at `offset`, and checks the version did not change meanwhile (a file rewritten in
  // place keeps its size; its mtime tells the bytes may be mixed).
  // Opens `path` read-only without following any symlink and fstats it into *st; fails
  // unless it is a regular file. O_NONBLOCK keeps a FIFO planted in the store from blocking
  // the open; reads of a regular file ignore it.
  Result<UniqueFd> OpenRegular(const std::string& path, const char* what, struct stat* st) const {
    constexpr int kFlags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    // The read path's usual case, one syscall: the whole path at once.
    const bool bound = Expected::Any() && Expected::IdOf(ParentOf(path)) != 0;
    UniqueFd fd(path.empty() || path.size() > kPathPiece || path.front() == '/' || bound
                    ? (errno = ENOSYS, -1)
                    : OpenBeneath(root_fd_.get(), path, kFlags));
    if (fd.get() < 0 && errno == ENOSYS) {  // long path or no openat2: parent, then the name
      CTFS_ASSIGN_OR_RETURN(At at, Locate(path, what));
      fd = UniqueFd(::openat(at.dir, at.name.c_str(), kFlags));
    }
    if (fd.get() < 0) return Status::FromErrno(errno, std::string(what) + " " + Show(path));
    if (::fstat(fd.get(), st) != 0) return Status::FromErrno(errno, "fstat " + Show(path));
    if (!S_ISREG(st->st_mode))
      return Status::IsDirectory(std::string(what) + " " + Show(path) + ": not a regular file");
    return fd;
  }

  Result<Fetched> ReadAt(const std::string& path, const FileVersion* expect, uint64_t offset,
                         size_t len, char* buf, const AttrCheck& check = nullptr) const {
    struct stat st;
    CTFS_ASSIGN_OR_RETURN(UniqueFd opened, OpenRegular(path, "read", &st));
    const UniqueFd& fd = opened;
    Fetched out{FromStat(st), 0};
    if (expect != nullptr && out.attr.Version() != *expect)
      return Status::Stale("read " + Show(path) + ": file changed in the store");
    if (check) CTFS_RETURN_IF_ERROR(check(out.attr));
    CTFS_ASSIGN_OR_RETURN(size_t n, PreadFull(fd.get(), path, offset, len, buf));
    if (::fstat(fd.get(), &st) != 0) return Status::FromErrno(errno, "fstat " + Show(path));
    if (const FileVersion now = FromStat(st).Version(); now != out.attr.Version())
      return Status::Stale("read " + Show(path) + ": file changed in the store while read (" +
                           Describe(out.attr.Version()) + ", then " + Describe(now) + ")");
    out.bytes = n;
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
        return Status::FromErrno(errno, "read " + Show(path));
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }
  std::string Show(const std::string& path) const { return root_ + "/" + path; }
  static std::string Describe(const FileVersion& v) {
    return std::to_string(v.size) + " bytes, mtime " + std::to_string(v.mtime_ns) + " ns, file " +
           std::to_string(v.id) + ", ctime " + std::to_string(v.ctime_ns) + " ns";
  }

  // Attributes of the new entry `path`, given to uid/gid first where asked and possible.
  // A new entry `at` (of `path`) given to uid/gid, then the exact `mode` asked for: the
  // daemon's umask must not narrow a mode the kernel already masked with the caller's, and a
  // chown after it would clear set-id bits. fchmodat with AT_SYMLINK_NOFOLLOW never follows
  // a symlink planted at the name meanwhile (glibc refuses one).
  Result<FileAttr> OwnedWithMode(const At& at, const std::string& path, mode_t mode, int64_t uid,
                                 int64_t gid) {
    CTFS_RETURN_IF_ERROR(StatOwnedBy(path, uid, gid).status());
    ::fchmodat(at.dir, at.name.c_str(), mode & 07777, AT_SYMLINK_NOFOLLOW);
    return Stat(path);
  }

  Result<FileAttr> StatOwnedBy(const std::string& path, int64_t uid, int64_t gid) {
    Result<FileAttr> a = Stat(path);
    if (!a.ok()) return a;
    struct stat st {};
    st.st_uid = a->uid;
    st.st_gid = a->gid;
    if (Chown(-1, path, uid, gid, st)) return Stat(path);
    return a;
  }

  // Gives a new entry (descriptor `fd`, else `path`) to uid/gid when asked and possible (we
  // run as root); `st` holds its present owner. Returns whether it changed anything. A failure
  // is logged nowhere and ignored: the entry exists, owned by the daemon's user.
  bool Chown(int fd, const std::string& path, int64_t uid, int64_t gid,
             const struct stat& st) const {
    if (::geteuid() != 0 || (uid < 0 && gid < 0)) return false;
    const uid_t u = uid >= 0 ? static_cast<uid_t>(uid) : st.st_uid;
    const gid_t g = gid >= 0 ? static_cast<gid_t>(gid) : st.st_gid;
    if (u == st.st_uid && g == st.st_gid) return false;
    if (fd >= 0) return ::fchown(fd, u, g) == 0;
    Result<At> at = Locate(path, "chown");
    return at.ok() && ::fchownat(at->dir, at->name.c_str(), u, g, AT_SYMLINK_NOFOLLOW) == 0;
  }

  const std::string root_;
  const UniqueFd root_fd_;
};

}  // namespace

Result<std::unique_ptr<Backend>> NewPosixBackend(const std::string& root) {
  UniqueFd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    int err = errno;
    if (err == ENOTDIR) return Status::NotDirectory(root + ": not a directory");
    return Status::FromErrno(err, root);
  }
  if (::faccessat(fd.get(), ".", R_OK | X_OK, AT_EACCESS) != 0)
    return Status::FromErrno(errno, root);
  return std::unique_ptr<Backend>(new PosixBackend(root, std::move(fd)));
}

}  // namespace cubetorchfs::cfs_client
