// The store behind the mount: stat, list, ranged read, and writes.
//
// Paths are relative to the store's root, without a leading slash; "" is the root itself.
// Every read names the version of the file it expects (size + mtime, or an ETag later), and a
// backend that can tell the file changed returns Status::Stale rather than mixing old and new
// bytes. Implementations are thread-safe: many threads call them at once.
//
// Writes: OpenWrite() gives a WritableFile, a handle on one file being written. Its bytes
// reach the store by Flush() (visible to other readers of the store) and Sync() (durable
// there); what each backend does underneath (posix: pwrite to the file and fsync; s3: a local
// staging file uploaded on Flush/Sync) is in its .cc. The namespace operations (Mkdir,
// Unlink, Rename, ...) act on the store at once. Errors keep the store's meaning: EEXIST,
// ENOTEMPTY, ENOSPC, EXDEV ... reach the caller as the store gave them (Status codes, or
// Status::Errno for the rest).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "conf/options.h"

namespace prometheus {
class Registry;
}

namespace cubetorchfs::cfs_client {

// What identifies one version of a file's contents.
struct FileVersion {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileVersion&) const = default;
};

struct FileAttr {
  mode_t mode = 0;  // type and permission bits, as in st_mode
  uint64_t size = 0;
  uint32_t nlink = 1;
  uid_t uid = 0;
  gid_t gid = 0;
  int64_t atime_ns = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  uint64_t blocks = 0;  // 512-byte blocks, as in st_blocks
  uint64_t rdev = 0;    // a character or block device's number, as in st_rdev
  // The store's own identity of the file where it has one (posix: st_dev and st_ino), else
  // 0: names with the same identity are hard links of one file and share one inode.
  uint64_t store_dev = 0;
  uint64_t store_ino = 0;

  bool IsDir() const;
  bool IsRegular() const;
  bool IsSymlink() const;
  FileVersion Version() const { return {size, mtime_ns}; }
};

struct DirEntry {
  std::string name;
  FileAttr attr;
};

struct FsStats {
  uint64_t block_size = 4096;
  uint64_t blocks = 0;
  uint64_t blocks_free = 0;
  uint64_t blocks_avail = 0;
  uint64_t files = 0;
  uint64_t files_free = 0;
  uint64_t name_max = 255;
};

// How OpenWrite opens a file.
struct OpenWriteOptions {
  bool create = false;     // create the file if it does not exist (O_CREAT)
  bool exclusive = false;  // with create: fail with Exists if it does (O_EXCL)
  bool truncate = false;   // empty it (O_TRUNC)
  mode_t mode = 0644;      // permission bits of a created file
  // Owner of a created file, where the store keeps owners and may give them away (a posix
  // store served by root). -1: the store's default.
  int64_t uid = -1;
  int64_t gid = -1;
};

// Attributes to change (SetAttr). Unset fields are left alone.
struct AttrChange {
  std::optional<mode_t> mode;  // permission bits only
  std::optional<int64_t> uid, gid;
  std::optional<int64_t> atime_ns, mtime_ns;  // kTimeNow: the store's current time
  static constexpr int64_t kTimeNow = INT64_MIN;
};

// One file open for writing. Reads see the bytes written through this handle, flushed or not.
// Thread-safe: writes and reads may come from many threads at once. It must not outlive the
// Backend that opened it.
class WritableFile {
 public:
  // Releases the handle (errors are logged, not reported: call Close to see them). Bytes not
  // yet flushed stay where the backend keeps them (s3: the staging file is kept and logged)
  // but are not in the store: call Flush or Sync first.
  virtual ~WritableFile() = default;

  virtual Result<size_t> Write(uint64_t offset, const char* data, size_t len) = 0;
  // Up to `len` bytes at `offset` as this handle sees the file; short only at its end.
  virtual Result<size_t> Read(uint64_t offset, size_t len, char* buf) = 0;
  virtual Status Truncate(uint64_t size) = 0;
  // fallocate(2) with `mode`; NotSupported where the store cannot.
  virtual Status Allocate(int mode, uint64_t offset, uint64_t len) = 0;
  // The bytes written so far are in the store, visible to its other readers. An error means
  // they may not be; a later Flush tries again.
  virtual Status Flush() = 0;
  // Flush, and the bytes are durable in the store (they survive a crash of the store's host
  // where the store promises that).
  virtual Status Sync() = 0;
  // Attributes of the file as written through this handle (size included, flushed or not).
  virtual Result<FileAttr> Stat() = 0;
  // The file was renamed to `path` in the store: later flushes go there. (A posix descriptor
  // follows its file by itself.)
  virtual void Moved(const std::string& path) { (void)path; }
  // Lets go of the file in the store (posix: close(2), whose error some stores, NFS among
  // them, report only then). After it only the destructor may be called. Bytes not flushed
  // are kept as by the destructor.
  virtual Status Close() { return Status::OK(); }
  // The file was unlinked or renamed over: its bytes go nowhere. Later flushes do nothing and
  // local copies (an s3 staging file) are removed; reads and writes through the handle go on
  // working until it is released.
  virtual void Discard() {}
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Attributes of `path` itself (a symlink is not followed).
  virtual Result<FileAttr> Stat(const std::string& path) = 0;

  // Entries of directory `path` with their attributes, without "." and "..".
  virtual Result<std::vector<DirEntry>> List(const std::string& path) = 0;

  // Reads up to `len` bytes at `offset` of regular file `path` into `buf`, provided the file
  // still has version `expect`; returns the byte count (short only at end of file).
  // Status::Stale when the file is no longer at `expect`.
  virtual Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                              size_t len, char* buf) = 0;

  // Reads up to `len` bytes from the start of regular file `path` into `buf` and returns them
  // with the file's attributes, in one request (posix: open, fstat, pread; an object store's
  // GET returns the size and version with the data). The bytes are of the returned version.
  struct Fetched {
    FileAttr attr;
    size_t bytes = 0;
  };
  // `check`, if given, is asked about the file's attributes before its bytes are read (a
  // store that learns them only with the bytes, S3, asks it then and drops the bytes); its
  // error is returned instead of the bytes.
  using AttrCheck = std::function<Status(const FileAttr&)>;
  virtual Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                                   const AttrCheck& check = nullptr) = 0;
  // A lookup: the attributes of `path`, whatever it is, and for a regular file its first
  // bytes (up to `len`, into `buf`, counted in Fetched::bytes) when the store gives them in the
  // same request: an object store's GET costs what its HEAD does, and a cold read then needs
  // no second request. The default is Stat, with no bytes.
  virtual Result<Fetched> LookupRead(const std::string& path, size_t len, char* buf) {
    (void)len;
    (void)buf;
    CTFS_ASSIGN_OR_RETURN(FileAttr attr, Stat(path));
    return Fetched{attr, 0};
  }

  virtual Result<std::string> ReadLink(const std::string& path) = 0;

  virtual Result<FsStats> StatFs() = 0;

  // A read-only descriptor (O_CLOEXEC) of regular file `path`, provided it is still at
  // `expect`, for a reader that may read the store's own file (the model loader, through the
  // daemon): posix only. NotSupported where the store has no such file (S3) or where every
  // byte must pass through this process (fault injection); Stale if the file changed.
  // `check`, if given, is asked about the attributes of the very file opened (its fstat)
  // before the descriptor is returned.
  virtual Result<int> OpenReadFd(const std::string& path, const FileVersion& expect,
                                 const AttrCheck& check = nullptr) {
    (void)path;
    (void)expect;
    (void)check;
    return Status::NotSupported("this store has no file descriptors to hand out");
  }
  // Whether OpenReadFd can succeed here at all (posix, without fault injection): a caller on a
  // hot path asks this before trying.
  virtual bool HandsOutFds() const { return false; }

  // --- writes ---

  // Opens regular file `path` for writing (creating or truncating it as `options` say).
  virtual Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                          const OpenWriteOptions& options) = 0;
  virtual Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid,
                                 int64_t gid) = 0;
  virtual Status Unlink(const std::string& path) = 0;
  virtual Status Rmdir(const std::string& path) = 0;
  // rename(2); `noreplace`: fail with Exists if `to` exists (RENAME_NOREPLACE).
  virtual Status Rename(const std::string& from, const std::string& to, bool noreplace) = 0;
  virtual Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t uid,
                                   int64_t gid) = 0;
  virtual Result<FileAttr> Link(const std::string& from, const std::string& to) = 0;
  // A special file at `path` (mknod(2)): a FIFO, a socket, or a character or block device
  // numbered `rdev`, owned by `uid`/`gid`. The default: EPERM (an object store has none).
  virtual Result<FileAttr> Mknod(const std::string& path, mode_t mode, uint64_t rdev, int64_t uid,
                                 int64_t gid) {
    (void)mode;
    (void)rdev;
    (void)uid;
    (void)gid;
    return Status::Errno(EPERM, "mknod " + path + ": the store has no special files");
  }
  // Changes mode, owner or times of `path` (a size change goes through a WritableFile).
  virtual Result<FileAttr> SetAttr(const std::string& path, const AttrChange& change) = 0;
  // Makes the entries of directory `path` (creates, renames, unlinks in it) durable.
  virtual Status SyncDir(const std::string& path) = 0;
};

// A backend over the directory `root`. Fails if `root` is not a readable directory.
Result<std::unique_ptr<Backend>> NewPosixBackend(const std::string& root);

// A backend over an S3 bucket (conf::S3Options says where, see s3_backend.cc for the mapping
// of keys to files). Credentials: opts.access_key/secret_key, else the environment's
// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN); with none, requests go
// unsigned. Makes no request: an unreachable store shows in the first call.
Result<std::unique_ptr<Backend>> NewS3Backend(const conf::S3Options& opts);

// A backend over a CubeFS volume through CubeFS's C SDK, libcfs.so, loaded at run time
// (conf::CubefsOptions; see cubefs_backend.cc for what the SDK gives and how its gaps are
// handled). Connects to the master: call it in the process that serves, after daemonizing,
// and fork no child without exec afterwards (the SDK embeds a Go runtime). Errors name the
// config key at fault: backend.cubefs.lib (no such library, or not a libcfs), masterAddr
// (the volume cannot be reached with these keys).
Result<std::unique_ptr<Backend>> NewCubefsBackend(const conf::CubefsOptions& opts);

// The read-only synthetic store of `opts` (benchmarks and scale tests; synthetic_backend.cc).
std::unique_ptr<Backend> NewSyntheticBackend(const conf::SyntheticOptions& opts);

// Lists one key of the bucket `opts` names, with at most one retry and a 10 s timeout, for a
// start-up check. The error names the config key at fault: backend.endpoint (no answer, not
// S3), backend.bucket (no such bucket, or access to it refused), backend.access_key or
// backend.secret_key (rejected credentials), backend.region (a region the store refuses).
Status CheckS3Backend(const conf::S3Options& opts);

// Counters of the fault-injection wrapper, for tests and benchmarks.
struct InjectCounters {
  uint64_t requests = 0;        // every call that reached the wrapper
  uint64_t read_requests = 0;   // Read calls
  uint64_t write_requests = 0;  // calls that change the store (writes, flushes, renames, ...)
  uint64_t injected_errors = 0;
  uint64_t peak_in_flight = 0;  // most requests served at once (at most opts.max_concurrency)
};

// Wraps `base` to emulate a remote store: every request waits for one of
// `opts.max_concurrency` slots (0: unlimited), then `opts.latency_us` (slept on `clock`); a
// seeded `opts.error_rate` fraction fail with IOError; the bytes a request reads or writes then
// take bytes / `opts.bandwidth_bytes_s` (0: unlimited) on a link all requests share, first come
// first served. `counters`, if not null, is updated (atomically, under the wrapper's lock) and
// must outlive the wrapper.
std::unique_ptr<Backend> NewInjectBackend(std::unique_ptr<Backend> base,
                                          const conf::InjectOptions& opts, Clock* clock,
                                          InjectCounters* counters = nullptr);

// Wraps `base` and records cubetorchfs_backend_requests_total{op,status} and
// cubetorchfs_backend_request_seconds{op} in `registry`, which must outlive the wrapper.
// Logs the start and the end of an outage of `store` (its name in the log) once each.
std::unique_ptr<Backend> NewMeteredBackend(std::unique_ptr<Backend> base,
                                           prometheus::Registry& registry, Clock* clock,
                                           const std::string& store = "the store");

// True while the store is in an outage (a metered backend's latest request failed to reach
// it): an outage is logged once there, so the errors it causes need not be, one by one.
bool StoreDown();

// The store as logs and health reports name it: the posix root, endpoint/bucket, or
// cubefs://master/volume.
std::string StoreName(const conf::BackendOptions& opts);

// Builds the backend described by `opts` (posix, s3 or cubefs), with injection if configured,
// metered.
Result<std::unique_ptr<Backend>> NewBackend(const conf::BackendOptions& opts,
                                            prometheus::Registry& registry, Clock* clock);

}  // namespace cubetorchfs::cfs_client
