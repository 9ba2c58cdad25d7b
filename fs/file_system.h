// The file system's logic, free of libfuse: what each FUSE operation does, returning values
// or a Status. fuse_ops.cc turns these into kernel replies (and Status into errno).
//
// Reads look in the RAM cache first, then the prefetch window, then the NVMe tier and the
// store, in units of whole files (up to chunk_bytes) or chunks of chunk_bytes. This is the one
// read policy: the control API's batches and downloads read through StreamFile, here. A read is a
// hit if no byte waited on the backend, late if it waited on a prefetch in flight, a miss if it
// fetched (or waited on another reader's fetch); every read is reported to the prefetcher, which
// keeps the accounting and moves the streams' cursors. Attributes come from the inode table while
// younger than attr_timeout_s, so opening a file whose metadata is fresh costs no backend request.
//
// Writes (write_path.cc): a file being written has one write state per inode, shared by every
// handle that writes it, holding the backend's WritableFile. It is opened by the first write
// (or an open for writing) and closed when the last writing handle is released, or at flush
// when the kernel sends no releases (FUSE no_open). While it exists, reads of the file are
// served through it (the bytes just written, never a cached copy); when it opens and when it
// closes, the file's cached chunks are dropped from every tier and from the prefetch window.
// Flush makes the written bytes visible in the store, Fsync durable there; either fails with
// the store's error and the bytes are then not reported written.
//
// Thread safety: all methods may be called concurrently from the FUSE worker threads. No lock
// is held across a backend call, except a write state's own mutex, which serializes the
// backend calls on that one file; stat and lookup never take it (WrittenAttr reads a copy
// under the state's leaf attr_mu). Lock order: WriteState::mu, then writes_mu_, then the inode
// table's locks (never the other way; the table calls nothing out), then WriteState::attr_mu. Two
// exceptions that cannot deadlock: Rename takes two states' mu together with std::lock, and its
// walk of writes_ for files under a renamed directory takes a state's mu under writes_mu_ by
// try_lock only. write_back_mu_ is a leaf.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache/disk_cache.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/clock.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/user_budget.h"
#include "fs/inode_table.h"
#include "fs/list_ahead.h"
#include "fs/store_stream.h"
#include "fs/write_state.h"
#include "prefetch/model_fetch.h"
#include "prefetch/prefetcher.h"

namespace prometheus {
class Registry;
class Counter;
}  // namespace prometheus

namespace cubetorchfs::fs {

struct Entry {
  uint64_t ino = 0;
  cfs_client::FileAttr attr;
};

// An open regular file: the version it was opened at is the version every read serves.
struct FileHandle {
  uint64_t ino = 0;
  std::string path;
  cfs_client::FileVersion version;
  uint64_t write_gen = 0;  // the inode's write generation at open
  bool writable = false;   // counted as a writer of the inode until released
  // Set at open when cold reads of this file may be streamed from the store (store_stream.h).
  std::shared_ptr<StoreStream> stream;
  // The kernel reads this open from the store's file itself (fuse/passthrough.h).
  bool passthrough = false;
};

// The user a FUSE request comes from, as the owner of what it creates (a file, a directory, a
// node, a symlink). Not prefetch::Caller, the peer of a control request, which carries the
// groups and pid its access checks need.
struct Owner {
  int64_t uid = -1;
  int64_t gid = -1;
};

// An open directory: its listing, read a page at a time (Backend::ListPages) as the kernel
// asks for entries, of which a window is held: the page being read and up to
// kDirKeepBehind entries before it, so that a readdir resumed at the offset of the kernel's
// last reply (its buffer dropped) is served from memory. An offset before the window lists the
// directory again from its start (a rewinddir, a seekdir back).
struct DirHandle {
  uint64_t ino = 0;
  std::string path;
  uint64_t id = 0;   // the store identity of the directory opened: every listing is of it
  int64_t uid = -1;  // the opener's, charged for the window
  Mutex mu;          // the members below: one readdir of a handle at a time
  std::vector<cfs_client::DirEntry> entries GUARDED_BY(mu);  // entries first.. of the listing
  uint64_t first GUARDED_BY(mu) = 0;
  std::unique_ptr<cfs_client::DirLister> lister GUARDED_BY(mu);  // null: the window ends it
  bool restart GUARDED_BY(mu) = false;  // a window refused (ENOMEM): list again from the start
  // A listing of more than one page gathers its subdirectories as it is read (at most
  // kDirPlanNames) and plans list-ahead from them at its end, as one of a page does at once.
  bool plan GUARDED_BY(mu) = false;
  std::vector<cfs_client::DirEntry> subdirs GUARDED_BY(mu);
  // The window's charge against Options::dir_memory_bytes, given back with the handle.
  struct Charge {
    std::shared_ptr<UserBudget> budget;
    int64_t uid = -1;
    uint64_t bytes = 0;
    ~Charge();  // gives the bytes back, and a large window's heap to the system
  };
  std::unique_ptr<Charge> charge GUARDED_BY(mu);
};
constexpr uint64_t kDirKeepBehind = 8192;
constexpr uint64_t kDirPlanNames = 1u << 17;  // ListAhead::Options::max_plan_dirs

struct OpenResult {
  std::unique_ptr<FileHandle> handle;
  bool keep_cache = false;        // the kernel may keep its page cache of the file
  bool invalidate_inode = false;  // the file changed: drop the kernel's cached attrs and pages
};

// Bytes of a read, as slices of cached buffers (no copy until the kernel reply).
struct ReadResult {
  struct Slice {
    cache::BufferRef buffer;
    size_t offset = 0;
    size_t length = 0;
  };
  std::vector<Slice> slices;
  // Instead of slices: `length` bytes at `offset` of the store's file `source->Fd()`, for the
  // kernel to take straight from the store (store_stream.h). `source` keeps it open.
  struct StoreSlice {
    std::shared_ptr<StoreStream> source;
    int fd = -1;
    uint64_t offset = 0;
    size_t length = 0;
  };
  std::optional<StoreSlice> store;
  size_t size() const;
};

class FileSystem : public prefetch::AttrSource {
 public:
  struct Options {
    double attr_timeout_s = 1.0;
    bool keep_cache = false;
    uint64_t chunk_bytes = 4ull << 20;
    bool read_only = false;  // every change fails with ReadOnly (EROFS)
    // > 0: StartWriteBack() flushes and closes every write state left this long without a
    // change (the kernel sends no close: FUSE no_open without FLUSH, fuse.flush_on_close off).
    double write_back_idle_s = 0;
    // > 0: a lookup the daemon cannot answer asks the store with Backend::LookupRead for this
    // many first bytes, and a small file that fits is put in the RAM cache (an object store:
    // a cold read is then one request, not a HEAD and a GET).
    size_t lookup_read_bytes = 0;
    // > 0: cold reads of files of at least this many bytes may go from the store's file
    // straight to the kernel, not through the cache (store_stream.h; cache.stream_min_bytes).
    uint64_t stream_min_bytes = 0;
    // Chunks the ghost queue of streamed reads remembers (StreamAdmission).
    size_t stream_ghost_chunks = 8192;
    // Store descriptors streamed reads may hold open (a UserBudget): per user, and in all
    // (0: a quarter of the daemon's RLIMIT_NOFILE). A handle past them reads through the cache.
    uint64_t stream_fds_per_uid = 256;
    uint64_t stream_fds = 0;
    // Subdirectories listed ahead of the kernel's opendir (list_ahead.h); 0: none.
    uint64_t list_ahead = 0;
    unsigned list_ahead_threads = 4;
    // What the windows of open directories' listings may hold in all; one user at most half
    // (fuse.dir_memory_bytes). An opendir or readdir past it fails with ENOMEM.
    uint64_t dir_memory_bytes = 512ull << 20;
    // Entries a directory is listed in at a time (fuse.list_page_entries).
    uint64_t list_page_entries = 4096;
    // Files one user may have open for writing through the mount at once (each holds a store
    // descriptor or a staging file). An open past it fails with EMFILE.
    uint64_t max_writes_per_uid = 4096;
  };

  // `backend`, `cache`, `prefetcher`, `clock`, `registry` and `disk` (may be null) must outlive
  // the FileSystem. Fails if the store's root cannot be read.
  static Result<std::unique_ptr<FileSystem>> New(const Options& options,
                                                 cfs_client::Backend* backend,
                                                 cache::RamCache* cache,
                                                 prefetch::Prefetcher* prefetcher, Clock* clock,
                                                 prometheus::Registry& registry,
                                                 cache::DiskCache* disk = nullptr);
  ~FileSystem();

  Result<Entry> Lookup(uint64_t parent, const std::string& name);  // adds one lookup
  void Forget(uint64_t ino, uint64_t nlookup);
  Result<cfs_client::FileAttr> GetAttr(uint64_t ino);
  Result<std::string> ReadLink(uint64_t ino);
  // `uid`: the opener's (-1: unknown), whose share of dir_memory_bytes the snapshot uses.
  Result<std::unique_ptr<DirHandle>> OpenDir(uint64_t ino, int64_t uid = -1);
  // Makes `dir`'s window hold entry `index` of the listing (0: the first after "." and ".."),
  // unless the listing ends before it; false then. Errors: the store's, or ENOMEM past
  // fuse.dir_memory_bytes.
  Result<bool> DirEntryAt(DirHandle& dir, uint64_t index) REQUIRES(dir.mu);
  // Charges `dir`'s window (its size now) to its opener; ENOMEM, the window dropped, past the
  // budget.
  Status ChargeDirWindow(DirHandle& dir) REQUIRES(dir.mu);
  // A page of `dir`'s listing was read (`last`: the listing's last): its subdirectories are
  // gathered for list-ahead's plan, made at the last page.
  void GatherSubdirs(DirHandle& dir, const std::vector<cfs_client::DirEntry>& page, bool last)
      REQUIRES(dir.mu);
  uint64_t dir_memory_held() const;  // bytes the open directories' snapshots are charged
  // For readdirplus: the inode of `entry` of `dir`, with one lookup added.
  uint64_t AcquireDirEntry(const DirHandle& dir, const cfs_client::DirEntry& entry);
  // Opens for reading, or for writing (see OpenForWrite) when `flags` ask to write.
  // `uid`: the opener's (-1: unknown), whose share of streamed-read descriptors it uses.
  Result<OpenResult> Open(uint64_t ino, int flags, bool track_handle = true, int64_t uid = -1);
  // `uid`: the reader's (-1: unknown); only its own prefetch streams are moved by the read.
  Result<ReadResult> Read(const FileHandle& handle, uint64_t offset, size_t size, int64_t uid = -1);
  // Reads regular file `path` (at `attr`'s version, the attributes a check just read) through
  // the caches, handing `piece` its bytes in order, 1 MiB at a time, without copying them (for
  // /batchdownload/path). An error from `piece` stops the read and is returned.
  Status StreamFile(const std::string& path, const cfs_client::FileAttr& attr,
                    const std::function<Status(const char* data, size_t len)>& piece,
                    int64_t uid = -1);
  // The store's file of a handle the kernel may read straight from it (FUSE passthrough): one
  // whose cold reads would be streamed (StreamFor), opened for reading, with no written bytes
  // that have not reached the store. A descriptor of the file at the handle's version (opened
  // as every store file is: beneath the root, no symlink followed), or -1.
  int PassthroughFd(const FileHandle& handle);
  // A handle for reading `ino` at its current version, for reads without an open (no_open).
  // With `opened_before`, for a handle an earlier process of the mount opened (a crash or an
  // upgrade since): Stale if the file changed since its last open, whose version the inode
  // table keeps, so that such a handle never reads another version's bytes.
  Result<FileHandle> HandleFor(uint64_t ino, bool opened_before = false);
  Result<cfs_client::FsStats> StatFs();
  Status Access(uint64_t ino, int mask);

  // --- writes (write_path.cc) ---
  // `track_handle`: the kernel will send a release for the handle (false under no_open: the
  // write state then closes at flush).
  struct Created {
    Entry entry;
    std::unique_ptr<FileHandle> handle;
  };
  Result<Created> Create(uint64_t parent, const std::string& name, mode_t mode, int flags,
                         const Owner& owner, bool track_handle);
  // A regular file (as Create, closed at once), or a special file made in the store: a FIFO,
  // a socket, or a device numbered `rdev` (the kernel lets only CAP_MKNOD callers ask).
  Result<Entry> Mknod(uint64_t parent, const std::string& name, mode_t mode, uint64_t rdev,
                      const Owner& owner);
  Result<Entry> Mkdir(uint64_t parent, const std::string& name, mode_t mode, const Owner& owner);
  Result<Entry> Symlink(const std::string& target, uint64_t parent, const std::string& name,
                        const Owner& owner);
  Result<Entry> Link(uint64_t ino, uint64_t new_parent, const std::string& new_name);
  Status Unlink(uint64_t parent, const std::string& name);
  Status Rmdir(uint64_t parent, const std::string& name);
  // flags: RENAME_NOREPLACE is honoured; RENAME_EXCHANGE is NotSupported; any other bit is
  // InvalidArgument.
  Status Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                const std::string& new_name, unsigned flags);
  // Open for writing (`flags` has O_WRONLY or O_RDWR): the handle counts as a writer when
  // `track_handle`.
  Result<OpenResult> OpenForWrite(uint64_t ino, int flags, bool track_handle, int64_t uid = -1);
  Result<size_t> Write(uint64_t ino, uint64_t offset, const char* data, size_t len);
  // close(2) of a descriptor: the written bytes reach the store (visible there).
  Status Flush(uint64_t ino);
  // fsync(2): the written bytes are durable in the store.
  Status Fsync(uint64_t ino);
  Status FsyncDir(uint64_t ino);
  // The last close of a handle; `handle` may be null (fh 0).
  Status Release(uint64_t ino, const FileHandle* handle);
  struct AttrChange {
    std::optional<uint64_t> size;
    cfs_client::AttrChange meta;
  };
  Result<cfs_client::FileAttr> SetAttr(uint64_t ino, const AttrChange& change);
  Status Fallocate(uint64_t ino, int mode, uint64_t offset, uint64_t len);
  // Flushes and closes every file still being written (at unmount), newest changes first;
  // returns the first error. An orphan (a file forgotten by the kernel before its bytes
  // reached the store) is skipped if its path was written and flushed since.
  Status FlushAll();
  // `hook(ino)` runs, outside every lock, when a file written through the mount was closed
  // (flush or release): fuse_ops drops the kernel's cached pages and attributes of it then.
  // Set once, before requests are served.
  void SetWrittenHook(std::function<void(uint64_t ino)> hook);
  // Starts the background thread (after the daemon forked): it closes the write states of
  // forgotten inodes (their last upload) and, when write_back_idle_s > 0, writes back idle
  // ones. StopWriteBack joins it (before FlushAll at unmount, which takes what it left).
  // Without it, Forget uploads on the calling thread.
  void StartWriteBack();
  void StopWriteBack();

  const InodeTable& inodes() const { return inodes_; }
  InodeTable& inodes() { return inodes_; }  // for a takeover (daemon/supervisor.h)
  // Files being written (write states open): an upgrade waits until there are none.
  uint64_t open_writes() const { return open_writes_.load(); }
  // Whether inode `ino` has a write state (open for writing through the mount, or written and
  // not yet closed in the store): its bytes are those written, not the store's.
  bool BeingWritten(uint64_t ino) { return FindWriteState(ino) != nullptr; }
  // A read of the kernel's own of inode `ino` is being served (the FUSE read op, from its
  // start until its reply is sent): the page-cache store of a prefetched file skips such an
  // inode (fuse/page_probe.cc says why). Thread-safe.
  void BeginKernelRead(uint64_t ino);
  void EndKernelRead(uint64_t ino);
  bool KernelReading(uint64_t ino);
  // The attributes the kernel was last given for `path`, while they are younger than
  // attr_timeout_s (the kernel checks permissions against them meanwhile): nothing otherwise.
  // `fetched_ns`, if not null, receives when they were read from the store.
  // `dir_id`: only a name held under the directory record of that store identity answers
  // (0: any).
  std::optional<cfs_client::FileAttr> KnownAttr(const std::string& path,
                                                uint64_t* fetched_ns = nullptr,
                                                uint64_t dir_id = 0) const;
  // The prefetcher's source of fresh attributes (prefetch::AttrSource): KnownAttr.
  std::optional<cfs_client::FileAttr> FreshAttr(const std::string& path,
                                                uint64_t* fetched_ns) const override {
    return KnownAttr(path, fetched_ns);
  }
  // The prefetcher's page-resident marks, kept in the inode table's records.
  uint64_t MarkOf(const std::string& path,
                  std::optional<cfs_client::FileAttr>* fresh) const override;
  bool SetMark(const std::string& path, uint64_t mark) override {
    return inodes_.SetMark(path, mark);
  }
  uint64_t Marks() const override { return inodes_.marks(); }
  // The store identity of the directory record the mount holds for `path`'s parent
  // (prefetch::AttrSource), whatever the age of its attributes; 0: none.
  uint64_t DirIdOf(const std::string& path) const override;

  // The model-file fast path (prefetch/model_fetch.h) to tell about reads; null: none. Set before
  // the first read; must outlive the FileSystem.
  void set_model_fetcher(prefetch::ModelFetcher* fetcher) { model_fetcher_ = fetcher; }

 private:
  FileSystem(const Options& options, cfs_client::Backend* backend, cache::RamCache* cache,
             prefetch::Prefetcher* prefetcher, Clock* clock, prometheus::Registry& registry,
             const cfs_client::FileAttr& root_attr, cache::DiskCache* disk);

  struct KernelReads {
    Mutex mu;
    std::unordered_map<uint64_t, uint32_t> count GUARDED_BY(mu);  // reads in progress
  };
  static constexpr size_t kKernelReadShards = 16;
  KernelReads& KernelReadsOf(uint64_t ino) { return kernel_reads_[ino % kKernelReadShards]; }
  std::array<KernelReads, kKernelReadShards> kernel_reads_;

  Result<InodeInfo> GetInode(uint64_t ino);
  // The inode `ino` with fresh attributes, if it is a regular file (what open needs).
  struct OpenTarget {
    InodeInfo inode;
    cfs_client::FileAttr attr;
  };
  Result<OpenTarget> RegularForOpen(uint64_t ino);
  // Stale for an inode unlinked or renamed over with no write state kept open for it.
  Status CheckNotRemoved(const InodeInfo& inode);
  // The inode's attributes: those of the bytes written so far while it is being written,
  // else those held, re-read from the store when older than attr_timeout_s.
  Result<cfs_client::FileAttr> FreshAttr(const InodeInfo& inode);
  // Attributes read from the store at `attr_time_ns` are younger than attr_timeout_s.
  bool AttrFresh(uint64_t attr_time_ns, uint64_t now) const;
  static std::string ChildPath(const std::string& parent, const std::string& name);

  // The entry of `path` from what the daemon holds, whatever the age of its attributes (for a
  // store that does not answer), acquired; nullopt for a name not held or removed.
  std::optional<Entry> HeldEntry(const std::string& path);
  // Lookup of `path` in the store: Backend::LookupRead (options_.lookup_read_bytes) or Stat.
  Result<Entry> StoreLookup(const std::string& path);
  // Lookup of `path` through Backend::LookupRead (options_.lookup_read_bytes).
  Result<Entry> LookupRead(const std::string& path);

  // Write path helpers (write_path.cc).
  Status CheckWritable() const;
  // Counts a change through the mount as it begins and again as it ends, so that a listing
  // made ahead (ListAhead) that began before the end is not handed out.
  class ChangeScope {
   public:
    explicit ChangeScope(std::atomic<uint64_t>* changes) : changes_(changes) {
      changes_->fetch_add(1);
    }
    ChangeScope(ChangeScope&& other) noexcept : changes_(std::exchange(other.changes_, nullptr)) {}
    ChangeScope& operator=(ChangeScope&&) = delete;
    ~ChangeScope() {
      if (changes_ != nullptr) changes_->fetch_add(1);
    }

   private:
    std::atomic<uint64_t>* changes_;
  };
  // CheckWritable, then the change's scope. Every operation that changes the store holds one
  // while it runs.
  Result<ChangeScope> BeginChange();
  // The store path of `name` in directory inode `parent`; `dir_id`, if not null, receives the
  // directory's store identity, which a change of the name binds (cfs_client::Expected).
  Result<std::string> ChildOf(uint64_t parent, const std::string& name, uint64_t* dir_id = nullptr);
  static std::string_view DirPart(const std::string& path);  // "" for the root's entries
  // A store request made for inode `ino` found another object where it was bound (Stale):
  // the inode's attributes expire, so that the kernel's lookup again (it retries an ESTALE
  // walk with LOOKUP_REVAL) asks the store, and the name gets the new object's inode.
  Status NoteStale(uint64_t ino, Status s);
  template <typename T>
  Result<T> NoteStale(uint64_t ino, Result<T> r) {
    if (!r.ok()) (void)NoteStale(ino, r.status());
    return r;
  }
  std::shared_ptr<WriteState> FindWriteState(uint64_t ino);
  // The write state of `ino`, opening the file in the store if it has none.
  Result<std::shared_ptr<WriteState>> GetWriteState(uint64_t ino, bool add_writer,
                                                    int64_t uid = -1);
  // One more file open for writing for `uid` (writes_by_uid_), or EMFILE.
  Status TakeWrite(int64_t uid);
  // `st` leaves writes_: its user's count goes down. REQUIRES: writes_mu_ held.
  void UncountWriteLocked(WriteState& st) REQUIRES(writes_mu_);
  // The write state of `ino` (opened if need be, and again if a flush of another descriptor
  // closed it meanwhile), locked.
  struct LockedWriteState {
    std::shared_ptr<WriteState> state;
    std::unique_lock<Mutex> lock;  // of state->mu (callers then state->mu.AssertHeld())
  };
  Result<LockedWriteState> LockOpenWriteState(uint64_t ino);
  // Flushes and closes `state` if nothing writes it any more (an unlinked file: once the
  // kernel forgot it).
  Status MaybeCloseLocked(uint64_t ino, WriteState& state, bool forgotten = false)
      REQUIRES(state.mu);
  // The state's bytes reach the store, if it has unflushed ones.
  Status FlushLocked(WriteState& state) REQUIRES(state.mu);
  // Records a change (dirty, with a new write sequence).
  void MarkChangedLocked(WriteState& state) REQUIRES(state.mu);
  // Records the attributes of the bytes written so far for WrittenAttr (none once closed).
  void RefreshWrittenAttrLocked(WriteState& state) REQUIRES(state.mu);
  // The file was unlinked or renamed over: its bytes go nowhere.
  void MarkRemovedLocked(WriteState& state) REQUIRES(state.mu);
  // Notes that the state's bytes up to its write sequence reached the store at its path
  // (kept only while orphans exist).
  void RecordFlushed(const WriteState& state) REQUIRES(state.mu);
  void NotifyWritten(uint64_t ino);
  // Drops every cached copy of the file at `path` (RAM, NVMe, prefetch window).
  void InvalidateCaches(const std::string& path);
  // Records attributes after a change made through the mount.
  void Changed(uint64_t ino, const cfs_client::FileAttr& attr);
  // Attributes of a file being written, as of its last change, open or flush (never waits
  // for an upload in flight); nothing if it was closed.
  std::optional<cfs_client::FileAttr> WrittenAttr(WriteState& state);
  // Closes the write state of an inode the kernel forgot, flushing what is left.
  Status CloseForgotten(uint64_t ino, WriteState& state);
  // While orphans exist: records that `paths` now hold something newer than any orphan's
  // bytes for them (or below them). REQUIRES: writes_mu_ held.
  void MarkPathsReplacedLocked(std::initializer_list<const std::string*> paths)
      REQUIRES(writes_mu_);
  // An orphan's bytes at `path` are older than what the store has there now (or above it).
  // REQUIRES: writes_mu_ held.
  bool SupersededLocked(const std::string& path, uint64_t write_seq) const REQUIRES(writes_mu_);
  // Reads through the write state of `handle.ino`, if it has one.
  std::optional<Result<ReadResult>> ReadWritten(uint64_t ino, uint64_t offset, size_t size);
  // Where reads of `path` at `attr` may be streamed (store_stream.h): its store stream, else null.
  std::shared_ptr<StoreStream> StreamFor(const std::string& path, const cfs_client::FileAttr& attr,
                                         int64_t uid = -1);
  // A read of [offset, end) of `handle` sent from the store's file (store_stream.h), if it
  // qualifies; nullopt: read it the usual way.
  std::optional<ReadResult> TryStream(const FileHandle& handle, uint64_t offset, uint64_t end,
                                      int64_t uid);

  const Options options_;
  cfs_client::Backend* const backend_;
  cache::RamCache* const cache_;
  prefetch::Prefetcher* const prefetcher_;
  cache::DiskCache* const disk_;  // the NVMe tier, or null
  StreamAdmission stream_admission_;
  UserBudget stream_fds_;  // store descriptors of streamed reads (Options::stream_fds*)
  // The memory of open directories' snapshots (Options::dir_memory_bytes); shared with the
  // handles' charges, which may outlive this.
  const std::shared_ptr<UserBudget> dir_memory_;
  Clock* const clock_;
  InodeTable inodes_;
  prefetch::ModelFetcher* model_fetcher_ = nullptr;

  Mutex writes_mu_;  // guards writes_, orphans_, flushed_seq_ and WriteState::orphan
  std::unordered_map<uint64_t, std::shared_ptr<WriteState>> writes_ GUARDED_BY(writes_mu_);
  UserBudget writes_by_uid_;  // write states by the user who opened them (max_writes_per_uid)
  // Write states open now, and whether any change was ever made through the mount: reads
  // skip the write-path checks entirely while both are zero.
  std::atomic<uint64_t> open_writes_{0};
  std::atomic<bool> ever_written_{false};
  // Changes begun through the mount (BeginChange, and every write): what ListAhead checks.
  std::atomic<uint64_t> changes_{0};
  std::unique_ptr<ListAhead> list_ahead_;  // null: fuse.list_ahead 0
  // Orders changes: each write state records the sequence of its last one.
  std::atomic<uint64_t> write_seq_{0};
  // Write states whose inode was forgotten with bytes not in the store (kept for FlushAll),
  // and while there are any, the newest write sequence flushed at each path: an orphan older
  // than that is not flushed over it.
  uint64_t orphans_ GUARDED_BY(writes_mu_) = 0;
  std::unordered_map<std::string, uint64_t> flushed_seq_ GUARDED_BY(writes_mu_);
  std::function<void(uint64_t)> written_hook_;  // set once before serving

  void WriteBackLoop();
  void WriteBackIdle(uint64_t idle_ns);
  // Marks the write state of forgotten `ino` an orphan (counted once); null if there is none.
  std::shared_ptr<WriteState> MarkOrphan(uint64_t ino);
  // Hands `ino` to the background thread; false if it is not running.
  bool QueueForgotten(uint64_t ino);
  void CloseForgottenQueued(std::vector<uint64_t> inos);
  // After a rename of directory `from` to `to`: the write states of files under it (but
  // `skip`) follow it.
  void MoveWritesUnder(const std::string& from, const std::string& to, const WriteState* skip);
  std::thread write_back_;  // started under write_back_mu_, joined once write_back_stop_ is set
  Mutex write_back_mu_;     // a leaf lock: guards write_back_ (its start), write_back_stop_,
                            // forgotten_
  CondVar write_back_cv_{&write_back_mu_};  // the write-back thread: forgotten inodes, or stop
  bool write_back_stop_ GUARDED_BY(write_back_mu_) = false;
  std::deque<uint64_t> forgotten_ GUARDED_BY(write_back_mu_);

  // Owned by the registry.
  prometheus::Counter* bytes_ram_;
  prometheus::Counter* bytes_disk_;
  prometheus::Counter* bytes_backend_;
  prometheus::Counter* bytes_streamed_;
  prometheus::Counter* write_back_ok_;
  prometheus::Counter* write_back_failed_;
};

}  // namespace cubetorchfs::fs
