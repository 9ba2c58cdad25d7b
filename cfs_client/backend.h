// The store behind the mount: stat, list, ranged read, and writes.
//
// Paths are relative to the store's root, without a leading slash; "" is the root itself.
// Every read names the version of the file it expects (FileVersion: size, mtime, the store's
// identity of the file and its change time), and a backend that can tell the file changed
// returns Status::Stale rather than mixing old and new bytes. Implementations are thread-safe: many
// threads call them at once.
//
// Writes: OpenWrite() gives a WritableFile, a handle on one file being written. Its bytes
// reach the store by Flush() (visible to other readers of the store) and Sync() (durable
// there); what each backend does underneath (posix: pwrite to the file and fsync; s3: a local
// staging file uploaded on Flush/Sync) is in its .cc. The namespace operations (Mkdir,
// Unlink, Rename, ...) act on the store at once. Errors keep the store's meaning: EEXIST,
// ENOTEMPTY, ENOSPC, EXDEV ... reach the caller as the store gave them (Status codes, or
// Status::Errno for the rest).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "conf/options.h"

namespace prometheus {
class Registry;
}

namespace cubetorchfs::cfs_client {

// What identifies one version of a file's contents, and which file it is. Size and mtime are
// what a user can set (utimes copies another file's mtime), so a version also carries what no
// user can: the store's identity of the file (posix: st_dev and st_ino; CubeFS: its inode; 0
// where the store has none) and its change time (posix: ctime, moved to now by every write,
// chmod, chown, utimes, link and rename of the file; CubeFS: creation; S3: as mtime, which
// holds a hash of the ETag). A cache keyed by path and version cannot serve one file's bytes
// for another file at the same path, and a read through an open handle reaches the file that
// was opened or fails with Stale (docs/security.md, "File identity").
struct FileVersion {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t id = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileVersion&) const = default;
  // Same file (identity), whatever its contents now. True where the store has no identity.
  bool SameFile(const FileVersion& o) const { return id == 0 || o.id == 0 || id == o.id; }
};

// The store objects that the calling thread's next requests must reach: the ones whose rights
// were checked (docs/security.md, "Which object a request acts on"). While a Scope lives on a
// thread, every store request of that thread that resolves `path` (as the directory a name is
// looked up, created or removed in, or as the object itself) finds there the object whose
// identity (FileAttr::StoreId) is `id`, or fails with Stale and does nothing: the kernel
// checked an inode's rights, and a directory swapped in the store since is another object.
// Paths are store paths, viewed, not copied: they must outlive the Scope. Scopes nest (the
// innermost binding of a path wins). A posix store checks on the very descriptor it acts
// through (fstat of the directory it resolved), so no swap between the check and the act can
// go unseen; a CubeFS store compares the object's identity before it acts (its SDK resolves
// paths itself); an S3 store has no identities, owners or modes to protect and ignores them.
class Expected {
 public:
  struct Object {
    std::string_view path;
    uint64_t id = 0;  // 0: not checked
  };
  class Scope {
   public:
    Scope(std::initializer_list<Object> objects);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    size_t pushed_ = 0;
  };
  // The identity `path` must have on this thread now, or 0 when no Scope names it.
  static uint64_t IdOf(std::string_view path);
  // Whether any binding is alive on this thread (a fast path skips the checks without one).
  static bool Any();
  // Stale naming `what` and `path` when `found` (a StoreId) is not the identity `path` must have.
  static Status Check(std::string_view path, uint64_t found, const char* what);
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
  // The store identity as one number (0: none): st_ino mixed with st_dev.
  uint64_t StoreId() const {
    return store_ino == 0 ? 0 : store_ino ^ (store_dev * 0x9E3779B97F4A7C15ull);
  }
  FileVersion Version() const { return {size, mtime_ns, StoreId(), ctime_ns}; }
};

// The attributes of a posix file as fstat/fstatat gave them (the posix store's own, and what a
// descriptor of the store's file is checked against).
FileAttr FromStat(const struct stat& st);

struct DirEntry {
  std::string name;
  FileAttr attr;
};

// One page of a directory's entries (Backend::ListPages).
struct DirPage {
  std::vector<DirEntry> entries;
  bool last = true;  // no entries after these
};

// A directory's entries a page at a time, in the store's order: each Next is one store request
// (or a few), never the whole directory, so a listing of 100 M names holds one page. Not
// thread-safe: one user at a time.
class DirLister {
 public:
  virtual ~DirLister() = default;
  // The next entries, at most `max` (at least 1); a page may be empty without being the last.
  virtual Result<DirPage> Next(size_t max) = 0;
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

// What a store can do, for the callers whose behaviour depends on it: they ask the backend
// (Backend::capabilities), never which store it is. A wrapper reports its store's, less what it
// takes away (fault injection: descriptors). The table of each backend type is
// CapabilitiesOfType (new_backend.cc).
struct Capabilities {
  // The store keeps an owner, a group and a mode per file, and symlinks: a control request's
  // path is checked against them as the caller's open() through the mount would be
  // (prefetch::PathResolver walks it in the store). false: every object has the same owner
  // and mode and there are no symlinks, so only lexical checks (no store request). Set by
  // posix, cubefs and synthetic; not s3. Default true: an unknown store is checked.
  bool has_owners = true;
  // LookupRead brings a small file's first bytes with its attributes in one request that
  // costs what a Stat does (an object store's GET against its HEAD): the file system then
  // looks names up with it (backend.s3.lookup_read_bytes), unless an NVMe tier makes the bytes
  // moot. Set by s3.
  bool lookup_returns_data = false;
  // OpenReadFd can succeed: the store has files of its own on this host whose descriptors can
  // be handed out (the model loader's fd exchange) and streamed from to the kernel (cold
  // reads of large files, fs/store_stream.h; the daemon sizes fuse.max_read to its pipes for
  // them). Set by posix, taken away by fault injection (every byte must pass through it).
  bool hands_out_fds = false;
  // The store's client writes log files of its own under logDir, in the foreground too: the
  // daemon creates logDir whenever it is set. Set by cubefs (the SDK's logs).
  bool writes_own_logs = false;

  bool operator==(const Capabilities&) const = default;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // What this store can do (see Capabilities). Constant for the backend's life. The default
  // is Capabilities{}: owners checked, nothing else.
  virtual Capabilities capabilities() const { return {}; }

  // True while the store is in an outage: a request failed to reach it (IOError) and none has
  // been answered since. The metered wrapper tracks it (and probes the store every 100 ms, one
  // request at a time, until it answers); a bare backend never reports one. Callers that hold
  // an answer (attributes, cached bytes) serve it instead of asking a store known not to answer.
  virtual bool InOutage() const { return false; }

  // Attributes of `path` itself (a symlink is not followed).
  virtual Result<FileAttr> Stat(const std::string& path) = 0;

  // Entries of directory `path` with their attributes, without "." and "..".
  virtual Result<std::vector<DirEntry>> List(const std::string& path) = 0;
  // The same entries a page at a time (the errors of List, from here or from a Next). This
  // default lists the whole directory (List) and hands it out in pages: a store that cannot
  // page costs what List costs.
  virtual Result<std::unique_ptr<DirLister>> ListPages(const std::string& path);

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
  // daemon): where capabilities().hands_out_fds. NotSupported where the store has no such
  // file (S3) or where every byte must pass through this process (fault injection); Stale if
  // the file changed. `check`, if given, is asked about the attributes of the very file opened
  // (its fstat) before the descriptor is returned. A caller on a hot path asks
  // capabilities().hands_out_fds before trying.
  virtual Result<int> OpenReadFd(const std::string& path, const FileVersion& expect,
                                 const AttrCheck& check = nullptr) {
    (void)path;
    (void)expect;
    (void)check;
    return Status::NotSupported("this store has no file descriptors to hand out");
  }

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

// A WritableFile that forwards every call to the one it wraps: a wrapper derives from it and
// overrides only what it changes.
class WritableFileWrapper : public WritableFile {
 public:
  explicit WritableFileWrapper(std::unique_ptr<WritableFile> base) : base_(std::move(base)) {}

  Result<size_t> Write(uint64_t offset, const char* data, size_t len) override {
    return base_->Write(offset, data, len);
  }
  Result<size_t> Read(uint64_t offset, size_t len, char* buf) override {
    return base_->Read(offset, len, buf);
  }
  Status Truncate(uint64_t size) override { return base_->Truncate(size); }
  Status Allocate(int mode, uint64_t offset, uint64_t len) override {
    return base_->Allocate(mode, offset, len);
  }
  Status Flush() override { return base_->Flush(); }
  Status Sync() override { return base_->Sync(); }
  Result<FileAttr> Stat() override { return base_->Stat(); }
  void Moved(const std::string& path) override { base_->Moved(path); }
  Status Close() override { return base_->Close(); }
  void Discard() override { base_->Discard(); }

 protected:
  WritableFile* base() const { return base_.get(); }

 private:
  const std::unique_ptr<WritableFile> base_;
};

// A Backend that forwards every call, capabilities() included, to the backend it wraps (as
// leveldb's EnvWrapper does for an Env): the fault-injection and metrics wrappers derive from
// it and override only what they change, so a virtual added to Backend reaches the store
// through them unless one of them decides otherwise. OpenWrite's file is the wrapped store's
// own: a wrapper that wants its writes wraps it (WritableFileWrapper).
class BackendWrapper : public Backend {
 public:
  explicit BackendWrapper(std::unique_ptr<Backend> base) : base_(std::move(base)) {}

  Capabilities capabilities() const override { return base_->capabilities(); }
  bool InOutage() const override { return base_->InOutage(); }
  Result<FileAttr> Stat(const std::string& path) override { return base_->Stat(path); }
  Result<std::vector<DirEntry>> List(const std::string& path) override { return base_->List(path); }
  Result<std::unique_ptr<DirLister>> ListPages(const std::string& path) override {
    return base_->ListPages(path);
  }
  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    return base_->Read(path, expect, offset, len, buf);
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    return base_->StatRead(path, len, buf, check);
  }
  Result<Fetched> LookupRead(const std::string& path, size_t len, char* buf) override {
    return base_->LookupRead(path, len, buf);
  }
  Result<std::string> ReadLink(const std::string& path) override { return base_->ReadLink(path); }
  Result<FsStats> StatFs() override { return base_->StatFs(); }
  Result<int> OpenReadFd(const std::string& path, const FileVersion& expect,
                         const AttrCheck& check = nullptr) override {
    return base_->OpenReadFd(path, expect, check);
  }
  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& options) override {
    return base_->OpenWrite(path, options);
  }
  Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid, int64_t gid) override {
    return base_->Mkdir(path, mode, uid, gid);
  }
  Status Unlink(const std::string& path) override { return base_->Unlink(path); }
  Status Rmdir(const std::string& path) override { return base_->Rmdir(path); }
  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    return base_->Rename(from, to, noreplace);
  }
  Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t uid,
                           int64_t gid) override {
    return base_->Symlink(target, path, uid, gid);
  }
  Result<FileAttr> Link(const std::string& from, const std::string& to) override {
    return base_->Link(from, to);
  }
  Result<FileAttr> Mknod(const std::string& path, mode_t mode, uint64_t rdev, int64_t uid,
                         int64_t gid) override {
    return base_->Mknod(path, mode, rdev, uid, gid);
  }
  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& change) override {
    return base_->SetAttr(path, change);
  }
  Status SyncDir(const std::string& path) override { return base_->SyncDir(path); }

 protected:
  Backend* base() const { return base_.get(); }

 private:
  const std::unique_ptr<Backend> base_;
};

// What a backend of `type` can do: what its capabilities() returns (the one table of them,
// new_backend.cc).
Capabilities CapabilitiesOfType(conf::BackendType type);

// What the backend NewBackend(opts) builds will report, known before it is built: the daemon
// decides some things before it connects to the store (the supervisor never does). The
// type's, less what fault injection takes away.
Capabilities CapabilitiesOf(const conf::BackendOptions& opts);

// Checks, before the daemon detaches, that the store `opts` names can be served, so that a
// bad one is reported on the terminal, and makes `opts->root` (posix) its real path. posix:
// the root is a readable directory; s3: one key of the bucket can be listed
// (CheckS3Backend); cubefs: only that backend.cubefs.lib, when given as a path, is readable
// (the SDK's Go runtime must not be loaded before the daemon forks). Errors name the key.
Status CheckBackend(conf::BackendOptions* opts);

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
// What a store with capabilities `base` can do behind the injection wrapper of `opts`: no
// descriptors while it injects anything (a reader of one would skip the injection).
Capabilities InjectedCapabilities(Capabilities base, const conf::InjectOptions& opts);

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

// Builds the backend described by `opts` (posix, s3, cubefs or synthetic), with injection if
// configured, metered. Errors name the config key at fault (backend.root for posix).
Result<std::unique_ptr<Backend>> NewBackend(const conf::BackendOptions& opts,
                                            prometheus::Registry& registry, Clock* clock);

}  // namespace cubetorchfs::cfs_client
