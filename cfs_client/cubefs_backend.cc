// The cubefs backend: a CubeFS volume through CubeFS's C SDK (libcfs.so, see cubefs_sdk.h),
// with no FUSE hop of CubeFS's own between the mount and the volume.
//
// What the SDK gives and what it does not, and how each gap is handled here:
// - Durability: the SDK has cfs_flush (the bytes are acknowledged by every replica's datanode
//   and the file's extents and size are committed to the metanode) and no fsync. Flush and
//   Sync both call cfs_flush: after a successful fsync or close the bytes survive a crash of
//   the daemon and of any one replica's host, not a power loss of all replicas at once (the
//   datanodes' own write-back). Bytes written but not flushed are lost if the daemon dies.
// - Guards the SDK lacks, checked here before a call: O_CREAT of an existing file (the SDK
//   would leak an inode) and O_EXCL (the SDK ignores it); cfs_mkdirs creates parents and
//   succeeds on an existing name; cfs_rename deletes a file renamed onto itself, moves a
//   directory into its own subtree, refuses any existing destination for a directory, and
//   counts a link on every failed attempt. A check and the call that follows are two requests:
//   another client of the volume may act between them, as with any network file system.
// - Listings: cfs_readdir then cfs_batch_get_inodes, one request each per 512 entries
//   (cfs_lsdir's entries carry the times of other files: a known bug of the SDK).
// - Symlinks: the SDK stores a target made absolute within the volume and cannot read one
//   back, so a relative target is refused (EOPNOTSUPP: it would change meaning) and readlink
//   answers EOPNOTSUPP.
// - Times are whole seconds; a file's ctime is its creation time; new entries are made with
//   the permission bits only (no set-id or sticky bits) and given to the caller by setattr.
// - statfs: the volume's size and use from the master (cfs_list_vols), asked at most every
//   30 s; no inode counts (reported as 0).
// - The SDK caches attributes for up to 120 s and paths for 5 s: a change made by another
//   client of the volume may take that long to show.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <limits>
#include <unordered_map>

#include "cfs_client/backend.h"
#include "cfs_client/cubefs_sdk.h"
#include "common/logging.h"
#include "common/thread_annotations.h"
#include "common/unique_fd.h"

namespace cubetorchfs::cfs_client {
namespace {

using cubefs::Sdk;
using cubefs::StatInfo;

// A constant device number for the volume: with the SDK's inode numbers it identifies a file
// (FileAttr::store_ino), so hard links share one inode in the mount.
constexpr uint64_t kVolumeDev = 0xcfcf;
constexpr int kListBatch = 512;
constexpr char kSdkLogDir[] = "cubefs-sdk";
constexpr char kRemoteCacheKey[] = "enableRemoteCache";  // the SDK's switch for FlashNode reads

std::string Abs(const std::string& path) { return "/" + path; }
char* C(const std::string& s) { return const_cast<char*>(s.c_str()); }

// A negative errno of the SDK as a Status. EBADFD (its "no such descriptor") is EBADF.
Status Err(int64_t rc, const std::string& what) {
  int err = static_cast<int>(-rc);
  if (err == EBADFD) err = EBADF;
  if (err <= 0) err = EIO;
  return Status::FromErrno(err, "cubefs " + what);
}

FileAttr ToAttr(const StatInfo& st) {
  FileAttr a;
  a.mode = st.mode;
  a.size = st.size;
  a.nlink = st.nlink;
  a.uid = st.uid;
  a.gid = st.gid;
  a.atime_ns = static_cast<int64_t>(st.atime) * 1'000'000'000 + st.atime_nsec;
  a.mtime_ns = static_cast<int64_t>(st.mtime) * 1'000'000'000 + st.mtime_nsec;
  a.ctime_ns = static_cast<int64_t>(st.ctime) * 1'000'000'000 + st.ctime_nsec;
  a.blocks = (st.size + 511) / 512;  // the SDK's listings round down
  a.store_dev = kVolumeDev;
  a.store_ino = st.ino;
  return a;
}

std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

// One file of the volume open for writing (and reading back) through the SDK.
class CubefsFile final : public WritableFile {
 public:
  CubefsFile(const Sdk* sdk, int64_t client, int fd, std::string path, uint64_t size)
      : sdk_(sdk), client_(client), fd_(fd), path_(std::move(path)), size_(size) {}

  ~CubefsFile() override {
    WriterLock l(io_mu_);
    if (fd_ < 0) return;
    if (!discarded_) {
      if (int rc = sdk_->flush(client_, fd_); rc < 0)
        CTFS_LOG(kWarn) << Err(rc, "flush /" + Path()).message() << " (released unflushed)";
    }
    sdk_->close(client_, fd_);
  }

  Result<size_t> Write(uint64_t offset, const char* data, size_t len) override {
    ReaderLock l(io_mu_);
    CTFS_RETURN_IF_ERROR(CheckOpen());
    ssize_t n = sdk_->write(client_, fd_, const_cast<char*>(data), len, static_cast<off_t>(offset));
    if (n < 0) return Err(n, "write /" + Path());
    Grow(offset + static_cast<uint64_t>(n));
    return static_cast<size_t>(n);
  }

  Result<size_t> Read(uint64_t offset, size_t len, char* buf) override {
    ReaderLock l(io_mu_);
    CTFS_RETURN_IF_ERROR(CheckOpen());
    size_t done = 0;
    while (done < len) {
      ssize_t n =
          sdk_->read(client_, fd_, buf + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) return Err(n, "read /" + Path());
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }

  Status Truncate(uint64_t size) override {
    ReaderLock l(io_mu_);
    CTFS_RETURN_IF_ERROR(CheckOpen());
    if (int rc = sdk_->truncate(client_, fd_, size); rc < 0) return Err(rc, "truncate /" + Path());
    size_.store(size);
    return Status::OK();
  }

  Status Allocate(int mode, uint64_t offset, uint64_t len) override {
    (void)mode;
    (void)offset;
    (void)len;
    return Status::NotSupported("fallocate: the CubeFS SDK has no such call");
  }

  Status Flush() override {
    ReaderLock l(io_mu_);
    CTFS_RETURN_IF_ERROR(CheckOpen());
    if (discarded_.load()) return Status::OK();
    if (int rc = sdk_->flush(client_, fd_); rc < 0) return Err(rc, "flush /" + Path());
    return Status::OK();
  }

  // The SDK has no fsync: its flush is acknowledged by every replica (see the top of the file).
  Status Sync() override { return Flush(); }

  Result<FileAttr> Stat() override {
    StatInfo st{};
    const std::string path = Path();
    if (int rc = sdk_->getattr(client_, C(Abs(path)), &st); rc < 0) return Err(rc, "stat " + path);
    FileAttr a = ToAttr(st);
    a.size = size_.load();  // the SDK shows a size only once flushed, an old one after truncate
    a.blocks = (a.size + 511) / 512;
    return a;
  }

  void Moved(const std::string& path) override {
    MutexLock l(path_mu_);
    path_ = path;
  }

  Status Close() override {
    WriterLock l(io_mu_);
    if (fd_ < 0) return Status::OK();
    Status s;
    if (!discarded_.load()) {
      if (int rc = sdk_->flush(client_, fd_); rc < 0) s = Err(rc, "flush /" + Path());
    }
    sdk_->close(client_, fd_);  // flushes again (a no-op now) and lets go of the descriptor
    fd_ = -1;
    return s;
  }

  void Discard() override { discarded_.store(true); }

 private:
  Status CheckOpen() const REQUIRES_SHARED(io_mu_) {
    if (fd_ < 0) return Status::Errno(EBADF, "cubefs /" + Path() + ": file already closed");
    return Status::OK();
  }
  std::string Path() const EXCLUDES(path_mu_) {
    MutexLock l(path_mu_);
    return path_;
  }
  void Grow(uint64_t end) {
    uint64_t cur = size_.load();
    while (end > cur && !size_.compare_exchange_weak(cur, end)) {
    }
  }

  const Sdk* sdk_;
  const int64_t client_;
  // I/O holds it shared, across the SDK's store requests on this fd; Close holds it alone
  // and so waits for all of them (the SDK's close must not race I/O on its fd).
  mutable SharedMutex io_mu_;
  int fd_ GUARDED_BY(io_mu_);  // -1 once closed; changed under io_mu_ held alone
  mutable Mutex path_mu_;
  std::string path_ GUARDED_BY(path_mu_);
  std::atomic<uint64_t> size_;
  std::atomic<bool> discarded_{false};
};

class CubefsBackend final : public Backend {
 public:
  CubefsBackend(const Sdk* sdk, int64_t client, std::string volume)
      : sdk_(sdk), client_(client), volume_(std::move(volume)) {}

  // Every WritableFile has been released by now (they must not outlive the backend). The
  // SDK's goroutines stay (the Go runtime cannot be unloaded), idle.
  ~CubefsBackend() override { sdk_->close_client(client_); }

  Capabilities capabilities() const override {
    return CapabilitiesOfType(conf::BackendType::kCubefs);
  }

  Result<FileAttr> Stat(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(path, "stat", /*self=*/false));
    StatInfo st{};
    if (int rc = sdk_->getattr(client_, C(Abs(path)), &st); rc < 0) return Err(rc, "stat /" + path);
    const FileAttr attr = ToAttr(st);
    if (Expected::Any()) CTFS_RETURN_IF_ERROR(Expected::Check(path, attr.StoreId(), "stat"));
    return attr;
  }

  // Expected (backend.h): the directory `path` is in, and with `self` the object `path` names,
  // are compared with what the volume holds now, before the call that acts. The SDK resolves
  // paths itself, so this is a check, not a pin: another client of the volume may swap a
  // directory between the two requests, as with any network file system.
  Status CheckExpected(const std::string& path, const char* what, bool self) {
    if (!Expected::Any()) return Status::OK();
    const size_t last = path.rfind('/');
    const std::string parent = last == std::string::npos ? std::string() : path.substr(0, last);
    for (const std::string* p : {&parent, self ? &path : nullptr}) {
      if (p == nullptr || Expected::IdOf(*p) == 0) continue;
      StatInfo st{};
      if (int rc = sdk_->getattr(client_, C(Abs(*p)), &st); rc < 0)
        return Err(rc, std::string(what) + " /" + path);
      CTFS_RETURN_IF_ERROR(Expected::Check(*p, ToAttr(st).StoreId(), what));
    }
    return Status::OK();
  }

  // One open directory of the SDK, read a batch of names at a time, their attributes asked in
  // one request a batch; what a batch brings beyond a page waits for the next page.
  class Lister final : public DirLister {
   public:
    Lister(CubefsBackend* store, int fd, std::string path)
        : store_(store), fd_(fd), path_(std::move(path)) {}
    ~Lister() override {
      if (fd_ >= 0) store_->sdk_->close(store_->client_, fd_);
    }
    Result<DirPage> Next(size_t max) override {
      DirPage page;
      max = std::max<size_t>(max, 1);
      while (page.entries.size() < max) {
        if (next_ == held_.size()) {
          if (fd_ < 0) break;
          CTFS_RETURN_IF_ERROR(ReadBatch());
          if (held_.empty()) break;
        }
        page.entries.push_back(std::move(held_[next_++]));
      }
      page.last = fd_ < 0 && next_ == held_.size();
      return page;
    }

   private:
    // The next batch of the directory into held_; the descriptor closes at its end (a read
    // of no names: a short batch is not taken for the end).
    Status ReadBatch() {
      held_.clear();
      next_ = 0;
      const Sdk* sdk = store_->sdk_;
      std::vector<cubefs::Dirent> ents(kListBatch);
      const int n =
          sdk->readdir(store_->client_, fd_, {ents.data(), kListBatch, kListBatch}, kListBatch);
      if (n <= 0) {
        sdk->close(store_->client_, fd_);
        fd_ = -1;
        return n < 0 ? Err(n, "readdir /" + path_) : Status::OK();
      }
      std::vector<uint64_t> inos(n);
      for (int i = 0; i < n; ++i) inos[i] = ents[i].ino;
      std::vector<StatInfo> stats(n);
      const int got =
          sdk->batch_get_inodes(store_->client_, fd_, inos.data(), {stats.data(), n, n}, n);
      if (got < 0) return Err(got, "stat the entries of /" + path_);
      // In no particular order, and without the entries removed meanwhile.
      std::unordered_map<uint64_t, const StatInfo*> by_ino;
      for (int i = 0; i < std::min(got, n); ++i) by_ino.emplace(stats[i].ino, &stats[i]);
      for (int i = 0; i < n; ++i) {
        auto it = by_ino.find(ents[i].ino);
        if (it == by_ino.end()) continue;
        const size_t len = std::min<size_t>(ents[i].name_len, sizeof(ents[i].name) - 1);
        std::string name(ents[i].name, strnlen(ents[i].name, len));
        if (name.empty() || name == "." || name == "..") continue;
        held_.push_back(DirEntry{std::move(name), ToAttr(*it->second)});
      }
      return Status::OK();
    }

    CubefsBackend* const store_;
    int fd_;
    const std::string path_;
    std::vector<DirEntry> held_;
    size_t next_ = 0;
  };

  Result<std::unique_ptr<DirLister>> ListPages(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(FileAttr dir, Stat(path));
    if (!dir.IsDir()) return Status::NotDirectory("cubefs list /" + path);
    const int fd = sdk_->open(client_, C(Abs(path)), O_RDONLY, 0);
    if (fd < 0) return Err(fd, "opendir /" + path);
    return std::unique_ptr<DirLister>(new Lister(this, fd, path));
  }

  Result<std::vector<DirEntry>> List(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(std::unique_ptr<DirLister> lister, ListPages(path));
    CTFS_ASSIGN_OR_RETURN(DirPage page, lister->Next(std::numeric_limits<size_t>::max()));
    return std::move(page.entries);
  }

  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    CTFS_ASSIGN_OR_RETURN(Fetched f, ReadAt(path, &expect, offset, len, buf, nullptr));
    return f.bytes;
  }

  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    return ReadAt(path, nullptr, 0, len, buf, check);
  }

  Result<std::string> ReadLink(const std::string& path) override {
    return Status::Errno(EOPNOTSUPP,
                         "readlink /" + path + ": the CubeFS SDK cannot read a symlink's target");
  }

  Result<FsStats> StatFs() override {
    // Held across the request on purpose: one asks at a time (each listing leaks a little
    // memory in the SDK), and statfs is rare.
    MutexLock l(statfs_mu_);
    const auto now = std::chrono::steady_clock::now();
    if (statfs_at_ && now - *statfs_at_ < std::chrono::seconds(30)) return statfs_;
    constexpr int kMaxVols = 1024;
    std::vector<cubefs::VolInfo> vols(kMaxVols);
    std::memset(vols.data(), 0, vols.size() * sizeof(cubefs::VolInfo));
    const int n = sdk_->list_vols(client_, {vols.data(), kMaxVols, kMaxVols}, kMaxVols);
    if (n < 0) return Err(n, "statfs (the master's list of volumes)");
    FsStats s;
    s.block_size = 4096;
    s.name_max = 255;
    for (int i = 0; i < std::min(n, kMaxVols); ++i) {
      const std::string name(vols[i].name, strnlen(vols[i].name, sizeof(vols[i].name)));
      if (name != volume_) continue;
      const uint64_t total = vols[i].total_size, used = std::min(vols[i].used_size, total);
      s.blocks = total / s.block_size;
      s.blocks_free = s.blocks_avail = (total - used) / s.block_size;
    }
    statfs_ = s;
    statfs_at_ = now;
    return s;
  }

  // --- writes ---

  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& options) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(path, "open", !options.create || !options.exclusive));
    StatInfo st{};
    int rc = sdk_->getattr(client_, C(Abs(path)), &st);
    if (rc < 0 && rc != -ENOENT) return Err(rc, "stat /" + path);
    const bool exists = rc == 0;
    int fd = -1;
    if (exists) {
      if (options.create && options.exclusive) return Status::Exists("cubefs create /" + path);
      CTFS_RETURN_IF_ERROR(Regular(ToAttr(st), path));
      fd = sdk_->open(client_, C(Abs(path)), O_RDWR | (options.truncate ? O_TRUNC : 0), 0);
      if (fd < 0) return Err(fd, "open /" + path);
    } else {
      if (!options.create) return Status::NotFound("cubefs open /" + path);
      fd = sdk_->open(client_, C(Abs(path)), O_RDWR | O_CREAT, options.mode & 0777);
      if (fd < 0) return Err(fd, "create /" + path);
      if (Status s = GiveTo(path, options.uid, options.gid); !s.ok()) {
        sdk_->close(client_, fd);
        return s;
      }
    }
    // The name may have been replaced meanwhile: a write to anything but a regular file would
    // abort the SDK (a Go panic), so the file opened is checked once more.
    StatInfo now{};
    rc = sdk_->getattr(client_, C(Abs(path)), &now);
    Status s = rc < 0 ? Err(rc, "stat /" + path) : Regular(ToAttr(now), path);
    if (s.ok() && exists && now.ino != st.ino)
      s = Status::Stale("cubefs open /" + path + ": replaced while opened");
    if (!s.ok()) {
      sdk_->close(client_, fd);
      return s;
    }
    const uint64_t size = options.truncate || !exists ? 0 : now.size;
    return std::unique_ptr<WritableFile>(
        std::make_unique<CubefsFile>(sdk_, client_, fd, path, size));
  }

  Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid, int64_t gid) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(path, "mkdir", false));
    CTFS_RETURN_IF_ERROR(ParentIsDir(path, "mkdir"));
    StatInfo st{};
    if (sdk_->getattr(client_, C(Abs(path)), &st) == 0)
      return Status::Exists("cubefs mkdir /" + path);
    if (int rc = sdk_->mkdirs(client_, C(Abs(path)), mode & 0777); rc < 0)
      return Err(rc, "mkdir /" + path);
    CTFS_RETURN_IF_ERROR(GiveTo(path, uid, gid));
    return Stat(path);
  }

  Status Unlink(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(path, "unlink", false));
    if (int rc = sdk_->unlink(client_, C(Abs(path))); rc < 0) return Err(rc, "unlink /" + path);
    return Status::OK();
  }

  Status Rmdir(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(path, "rmdir", false));
    int rc = sdk_->rmdir(client_, C(Abs(path)));
    if (rc == -EINVAL) {  // the SDK's answer for a file
      Result<FileAttr> a = Stat(path);
      if (a.ok() && !a->IsDir()) return Status::NotDirectory("cubefs rmdir /" + path);
    }
    if (rc < 0) return Err(rc, "rmdir /" + path);
    return Status::OK();
  }

  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(from, "rename", false));
    CTFS_RETURN_IF_ERROR(CheckExpected(to, "rename", false));
    const std::string what = "rename /" + from + " to /" + to;
    CTFS_ASSIGN_OR_RETURN(FileAttr src, Stat(from));
    if (from == to) return Status::OK();  // the SDK would delete it
    if (src.IsDir() && to.size() > from.size() && to.compare(0, from.size(), from) == 0 &&
        to[from.size()] == '/')
      return Status::InvalidArgument("cubefs " + what + ": a directory into itself");
    CTFS_RETURN_IF_ERROR(ParentIsDir(to, "rename"));
    Result<FileAttr> dst = Stat(to);
    if (!dst.ok() && dst.status().code() != Status::Code::kNotFound) return dst.status();
    if (dst.ok()) {
      if (noreplace) return Status::Exists("cubefs " + what);
      if (dst->store_ino == src.store_ino) return Status::OK();  // two links of one file
      if (src.IsDir() && !dst->IsDir()) return Status::NotDirectory("cubefs " + what);
      if (!src.IsDir() && dst->IsDir()) return Status::IsDirectory("cubefs " + what);
      if (dst->IsDir()) {
        // The SDK renames no directory over another: an empty one is removed first (so the
        // replacement is two steps here, not one).
        if (int rc = sdk_->rmdir(client_, C(Abs(to))); rc < 0) return Err(rc, what);
      }
    }
    const bool overwrite = dst.ok() && !dst->IsDir();
    if (int rc = sdk_->rename(client_, C(Abs(from)), C(Abs(to)), overwrite ? 1 : 0); rc < 0)
      return Err(rc, what);
    return Status::OK();
  }

  Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t uid,
                           int64_t gid) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(path, "symlink", false));
    if (target.empty() || target[0] != '/')
      return Status::Errno(EOPNOTSUPP,
                           "cubefs symlink /" + path +
                               ": the SDK stores targets made absolute; a relative one would "
                               "change meaning");
    if (int rc = sdk_->symlink(client_, C(target), C(Abs(path))); rc < 0)
      return Err(rc, "symlink /" + path);
    CTFS_RETURN_IF_ERROR(GiveTo(path, uid, gid));
    return Stat(path);
  }

  Result<FileAttr> Link(const std::string& from, const std::string& to) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(from, "link", true));
    CTFS_RETURN_IF_ERROR(CheckExpected(to, "link", false));
    CTFS_ASSIGN_OR_RETURN(FileAttr src, Stat(from));
    if (src.IsDir()) return Status::Errno(EPERM, "cubefs link /" + from + ": a directory");
    if (!src.IsRegular())
      return Status::Errno(EPERM, "cubefs link /" + from + ": the SDK links regular files only");
    CTFS_RETURN_IF_ERROR(ParentIsDir(to, "link"));
    if (Stat(to).ok()) return Status::Exists("cubefs link /" + to);
    if (int rc = sdk_->link(client_, C(Abs(from)), C(Abs(to))); rc < 0)
      return Err(rc, "link /" + from + " to /" + to);
    return Stat(to);
  }

  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& change) override {
    CTFS_RETURN_IF_ERROR(CheckExpected(path, "setattr", true));
    StatInfo st{};
    int valid = 0;
    const auto seconds = [](int64_t ns) {
      return static_cast<uint64_t>(ns == AttrChange::kTimeNow ? std::time(nullptr)
                                                              : ns / 1'000'000'000);
    };
    if (change.mode) {
      st.mode = *change.mode & 0777;
      valid |= cubefs::kAttrMode;
    }
    if (change.uid && *change.uid >= 0) {
      st.uid = static_cast<uint32_t>(*change.uid);
      valid |= cubefs::kAttrUid;
    }
    if (change.gid && *change.gid >= 0) {
      st.gid = static_cast<uint32_t>(*change.gid);
      valid |= cubefs::kAttrGid;
    }
    if (change.mtime_ns) {
      st.mtime = seconds(*change.mtime_ns);
      valid |= cubefs::kAttrMtime;
    }
    if (change.atime_ns) {
      st.atime = seconds(*change.atime_ns);
      valid |= cubefs::kAttrAtime;
    }
    if (valid != 0) {
      if (int rc = sdk_->setattr(client_, C(Abs(path)), &st, valid); rc < 0)
        return Err(rc, "setattr /" + path);
    }
    return Stat(path);
  }

  // The metanode answers a create, rename or unlink once it is committed (raft), so there is
  // nothing more to make durable.
  Status SyncDir(const std::string& path) override {
    (void)path;
    return Status::OK();
  }

 private:
  static Status Regular(const FileAttr& a, const std::string& path) {
    if (a.IsDir()) return Status::IsDirectory("cubefs open /" + path);
    if (!a.IsRegular()) return Status::InvalidArgument("cubefs open /" + path + ": not a file");
    return Status::OK();
  }

  Status ParentIsDir(const std::string& path, const char* op) {
    const std::string parent = Parent(path);
    if (parent.empty()) return Status::OK();
    Result<FileAttr> a = Stat(parent);
    if (!a.ok()) return a.status();
    if (!a->IsDir()) return Status::NotDirectory(std::string("cubefs ") + op + " /" + path);
    return Status::OK();
  }

  // Gives a new entry to uid/gid (the SDK makes everything root's). -1: left as it is.
  Status GiveTo(const std::string& path, int64_t uid, int64_t gid) {
    StatInfo st{};
    int valid = 0;
    if (uid > 0) {
      st.uid = static_cast<uint32_t>(uid);
      valid |= cubefs::kAttrUid;
    }
    if (gid > 0) {
      st.gid = static_cast<uint32_t>(gid);
      valid |= cubefs::kAttrGid;
    }
    if (valid == 0) return Status::OK();
    if (int rc = sdk_->setattr(client_, C(Abs(path)), &st, valid); rc < 0)
      return Err(rc, "chown /" + path);
    return Status::OK();
  }

  Result<Fetched> ReadAt(const std::string& path, const FileVersion* expect, uint64_t offset,
                         size_t len, char* buf, const AttrCheck& check) {
    CTFS_ASSIGN_OR_RETURN(FileAttr attr, Stat(path));
    CTFS_RETURN_IF_ERROR(Regular(attr, path));
    if (expect != nullptr && attr.Version() != *expect)
      return Status::Stale("cubefs read /" + path + ": file changed in the store");
    if (check) CTFS_RETURN_IF_ERROR(check(attr));
    Fetched out{attr, 0};
    if (len == 0 || offset >= attr.size) return out;
    const int fd = sdk_->open(client_, C(Abs(path)), O_RDONLY, 0);
    if (fd < 0) return Err(fd, "open /" + path);
    len = static_cast<size_t>(std::min<uint64_t>(len, attr.size - offset));
    Status status;
    while (out.bytes < len) {
      ssize_t n = sdk_->read(client_, fd, buf + out.bytes, len - out.bytes,
                             static_cast<off_t>(offset + out.bytes));
      if (n < 0) {
        status = Err(n, "read /" + path);
        break;
      }
      if (n == 0) break;
      out.bytes += static_cast<size_t>(n);
    }
    sdk_->close(client_, fd);
    if (!status.ok()) return status;
    if (out.bytes < len)  // shorter than the size it had: changed while read
      return Status::Stale("cubefs read /" + path + ": file changed in the store while read");
    return out;
  }

  const Sdk* sdk_;
  const int64_t client_;
  const std::string volume_;
  // Held across the SDK's statfs (a request to the master): one at a time, the others wait
  // and take its answer, which is cached for 30 s.
  Mutex statfs_mu_;
  std::optional<std::chrono::steady_clock::time_point> statfs_at_ GUARDED_BY(statfs_mu_);
  FsStats statfs_ GUARDED_BY(statfs_mu_);
};

// The SDK's log directory: logDir/cubefs-sdk, made here and private (0700, ours, not a
// symlink). The SDK creates its log files mode 0666 and exits the process when it cannot
// open them, so it is given only a directory no other user can reach or plant links in.
// Empty when there is none to give (the SDK then logs nothing).
std::string PrivateLogDir(const std::string& dir) {
  if (dir.empty()) return "";
  UniqueFd parent(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (parent.get() >= 0 && ::mkdirat(parent.get(), kSdkLogDir, 0700) != 0 && errno != EEXIST)
    parent.reset();
  UniqueFd sub(parent.get() < 0 ? -1
                                : ::openat(parent.get(), kSdkLogDir,
                                           O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (sub.get() < 0 || ::fstat(sub.get(), &st) != 0 || st.st_uid != ::geteuid() ||
      ::fchmod(sub.get(), 0700) != 0) {
    CTFS_LOG(kWarn) << "cubefs: no private directory " << dir << "/" << kSdkLogDir
                    << " for the SDK's logs (" << std::strerror(errno)
                    << " or not ours); the SDK logs nothing";
    return "";
  }
  return dir + "/" + kSdkLogDir;
}

}  // namespace

Result<std::unique_ptr<Backend>> NewCubefsBackend(const conf::CubefsOptions& opts) {
  Result<const Sdk*> loaded = cubefs::LoadSdk(opts.lib);
  if (!loaded.ok())
    return Status::InvalidArgument("backend.cubefs.lib: " + loaded.status().message());
  const Sdk* sdk = loaded.value();
  const int64_t id = sdk->new_client();
  if (id <= 0) return Status::IOError("cubefs: cfs_new_client failed");
  std::vector<std::pair<std::string, std::string>> settings = {
      {"masterAddr", opts.master_addr},
      {"volName", opts.volume},
      {"accessKey", opts.access_key},
      {"secretKey", opts.secret_key},
  };
  if (opts.follower_read) settings.emplace_back("followerRead", "true");
  if (opts.remote_cache) settings.emplace_back(kRemoteCacheKey, "true");
  const std::string log_dir = PrivateLogDir(opts.log_dir);
  if (!log_dir.empty()) {
    settings.emplace_back("logDir", log_dir);
    if (!opts.log_level.empty()) settings.emplace_back("logLevel", opts.log_level);
  }
  for (const auto& [key, value] : settings) {
    if (int rc = sdk->set_client(id, C(key), C(value)); rc < 0) {
      sdk->close_client(id);
      if (key == kRemoteCacheKey)  // never read around the cache the config asks for
        return Status::InvalidArgument(
            "backend.cubefs.remote_cache: the CubeFS SDK " +
            (opts.lib.empty() ? std::string("libcfs.so") : opts.lib) + " refuses the setting " +
            kRemoteCacheKey +
            ": it needs a libcfs.so whose cfs_set_client takes enableRemoteCache (passed on to "
            "the extent client as NeedRemoteCache); the stock SDK never reads through the "
            "FlashNode cache. Point backend.cubefs.lib at such a build, or set remote_cache to "
            "false");
      return Status::InvalidArgument("cubefs: the SDK refuses the setting " + key + " (" +
                                     std::strerror(-rc) + ")");
    }
  }
  // With a logDir the SDK points the process's stderr at logDir/output.log: it is put back,
  // so that errors still reach the terminal (the SDK's own output goes to its log files).
  const int saved_stderr = ::fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
  const int rc = sdk->start_client(id);
  if (saved_stderr >= 0) {
    ::dup2(saved_stderr, STDERR_FILENO);
    ::close(saved_stderr);
  }
  if (rc < 0) {
    sdk->close_client(id);
    return Status::IOError(
        "masterAddr: cannot reach CubeFS volume " + opts.volume + " through " + opts.master_addr +
        " (the master is down or unreachable, the volume does not exist, or accessKey/secretKey "
        "are not its owner's; the SDK's reason is " +
        (log_dir.empty() ? "on stderr above" : "in " + log_dir + "/output.log") + ")");
  }
  return std::unique_ptr<Backend>(std::make_unique<CubefsBackend>(sdk, id, opts.volume));
}

}  // namespace cubetorchfs::cfs_client
