// The prefetcher: the files a DataLoader pass will read, published ahead of its reads, are
// fetched in order into the window ahead of the readers, or passed over where the kernel's page
// cache holds them. Its parts are data structures it changes under its one mutex, each header
// saying what it holds: the streams and their cursors (stream.h), the queued positions' bounds
// and fair shares (queued_paths.h), the window (window.h), and residency, when a file the
// kernel was served is passed over, probed, put back or put in the LRU cache (resident_marks.h,
// residency.cc). What it asks of the mount is in sources.h, what it counts in prefetch_stats.h.
// docs/prefetch.md says what each does for a user, docs/security.md how queued positions are
// bounded and shared, docs/metrics.md what each counter means.
//
// Thread safety: all public methods are thread-safe. mu_ (every field it guards GUARDED_BY,
// every ...Locked method REQUIRES it) is never held across a backend call (it is held while
// /proc/vmstat is read, at most every 50 ms). The attribute source (the inode table) is asked
// under it. Lock order: mu_ before the inode table's mutex, before any RamCache shard lock, and
// before a view shard's or a deferred-read shard's lock; those take no other lock.
//
// On the read path, Get finds files shown ready in the window's view index (one of 64 shard
// locks); it takes mu_ only for a path not shown ready while some entry is not yet ready (to
// find a fetch in flight, and wait on it with mu_ released). OnRead takes mu_ only when it is
// free; when another thread holds it, the read is queued in one of 16 shards (by reader
// thread) and applied by the next holder before any other work, and only a reader whose shard
// is full (1,024 reads) waits for it. WindowAttr never takes it.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/disk_cache.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/clock.h"
#include "common/thread_annotations.h"
#include "conf/options.h"
#include "prefetch/access.h"
#include "prefetch/prefetch_stats.h"
#include "prefetch/queued_paths.h"
#include "prefetch/resident_marks.h"
#include "prefetch/sources.h"
#include "prefetch/stream.h"
#include "prefetch/window.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
}  // namespace prometheus

namespace cubetorchfs::prefetch {

class Prefetcher {
 public:
  struct Options {
    conf::PrefetchOptions prefetch;
    uint64_t chunk_bytes = 4ull << 20;
    uint64_t window_budget_bytes = 1ull << 30;  // part of cache.memory_bytes
    double attr_timeout_s = 1.0;                // how long fetched attributes may answer lookups
    double stream_idle_s = 300;                 // a stream without publish or read expires
    // Positions this far behind the furthest read are skipped; 0 = window_files / 4, clamped
    // to [64, 1024] (DataLoader workers read a few batches out of order).
    uint64_t skip_slack = 0;
    bool start_workers = true;                     // false: tests run jobs with RunOneJob()
    uint64_t max_streams_per_uid = 64;             // streams one user may have at once
    uint64_t max_queued_paths_per_uid = 1u << 17;  // positions not yet read, all its streams
    uint64_t max_queued_paths = 1u << 18;          // positions not yet read, all streams
    // The memory those positions hold (QueuedPathCost each), one user and all users.
    uint64_t max_queued_path_bytes_per_uid = 32ull << 20;
    uint64_t max_queued_path_bytes = 64ull << 20;
    // Gives freed heap back to the system, after queued paths of 1 MiB or more were freed;
    // true if it ran (false: skipped, tried again later). Called with no lock held. Default:
    // TrimHeap (common/heap_trim.h).
    std::function<bool()> trim_heap;
    // The mount lets the kernel keep the pages of files it was served (fuse.keep_cache).
    bool keep_cache = false;
    // The kernel's count of reclaimed page-cache pages (ReadReclaimCounter), or nothing if it
    // cannot tell. While it has not moved since a file was marked, the mark is trusted: the
    // file is passed over with no page probe. Unset: every marked file is probed.
    std::function<std::optional<uint64_t>()> reclaim_counter;
    // Whether trusted files must be put back into the page cache as a stream reaches them
    // (something drops page cache unseen by reclaim_counter: ProactivePageoutActive). Asked
    // every 10 s by a worker, with no lock held. Unset: always.
    std::function<bool()> restore_needed;
  };

  // `backend`, `ram`, `clock`, `registry` (may be null) and `disk` (the NVMe tier; may be
  // null) must outlive the Prefetcher.
  Prefetcher(const Options& options, cfs_client::Backend* backend, cache::RamCache* ram,
             Clock* clock, prometheus::Registry* registry, cache::DiskCache* disk = nullptr);
  ~Prefetcher();  // stops and joins the workers

  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // --- the control API ---
  // A stream owned by `uid`; "" when that user already has max_streams_per_uid.
  // `reader`, if given, is the user each file is checked against before its bytes are
  // fetched (read permission, as the kernel would check it); a file it may not read is
  // counted `denied` and not fetched.
  // `list`: the registered file list (FileLists) its positions name, if any.
  // `page_cache`: the readers read through the mount's page cache (Stream::page_cache).
  std::string CreateStream(const std::string& name, int pid, uid_t uid = 0,
                           std::shared_ptr<const Caller> reader = nullptr,
                           const std::string& list = "", bool page_cache = true,
                           bool claims_share = true);
  uint64_t max_streams_per_uid() const { return options_.max_streams_per_uid; }
  bool DeleteStream(const std::string& id);  // false: unknown stream
  // Appends store-relative paths, in read order. False: unknown stream.
  bool Publish(const std::string& id, const std::vector<std::string>& paths);
  // The same, on behalf of user `uid`: a stream belongs to its creator (root may act on any).
  enum class Op { kOk, kNotFound, kForbidden, kFull };  // kFull: a queued-path limit
  using Limit = QueuedPaths::Limit;  // the queued-path limit a publish would have passed
  using Refusal = QueuedPaths::Refusal;
  // What one queued position costs in memory for a path of `path_bytes` (an upper bound).
  static uint64_t QueuedPathCost(size_t path_bytes) { return QueuedPaths::Cost(path_bytes); }
  Op DeleteStreamAs(uid_t uid, const std::string& id);
  // Whether stream `id` exists and `uid` may act on it (kOk, kNotFound or kForbidden).
  Op CheckStream(uid_t uid, const std::string& id);
  // The same, and the file list the stream was created with ("" if none) in *list.
  Op StreamList(uid_t uid, const std::string& id, std::string* list);
  // kFull when the paths would take the stream's owner past one of its limits (per user, or
  // its fair share of the global ones) or all users past a global one; nothing is published
  // then, and *refusal (if given) says which limit. With `partial`, as many as fit are
  // published instead (kFull only if none fit) and *taken says how many.
  // `unread`, if given: at most that many of the stream's latest positions (these included)
  // are still to be read, so the readers are past every earlier one even where no read
  // reached the daemon (the kernel served it from its page cache): those positions leave the
  // queue at once (the publisher knows; no slack applies), and each whose file the kernel was
  // known to hold whole then counts as a hit. A stream whose publisher says so costs O(its
  // lookahead), not O(the epoch).
  Op PublishAs(uid_t uid, const std::string& id, std::vector<std::string> paths,
               bool partial = false, size_t* taken = nullptr, Refusal* refusal = nullptr,
               std::optional<uint64_t> unread = std::nullopt);
  // Where residency checks find fresh attributes (no store request). Without one, every
  // file is fetched. Set before streams are published; `source` must outlive the Prefetcher.
  void SetAttrSource(AttrSource* source);
  // Asks whether the kernel's page cache holds a marked file. Without one, no file is taken as
  // page-resident (nullptr: none from now on; a probe already under way may still finish, so
  // `probe` must outlive the Prefetcher).
  void SetPageProbe(PageCacheProbe* probe);

  // Counters; the streams of user `only` if given, else all.
  Stats GetStats(std::optional<uid_t> only = std::nullopt);

  // --- the read path ---
  struct WindowHit {
    cache::BufferRef buffer;  // the whole chunk
    bool waited = false;      // the fetch was still running: a late read
  };
  // Chunk `chunk` of `path` at `version` from the window, waiting if its fetch is running.
  // Nothing if the file is not in the window (or its fetch failed): fetch it on demand.
  std::optional<WindowHit> Get(const std::string& path, const cfs_client::FileVersion& version,
                               uint64_t chunk);
  // Reports a read of [offset, offset + bytes) of `path`, and how it was served. `to_kernel`:
  // a FUSE read (the kernel may keep the pages); false for reads served to the control API.
  // `uid`: the reader's. A read moves only that user's streams, and consumes only a window
  // entry fetched for them: another user's read of a shared file ahead in a stream neither
  // skips its positions nor drops what was prefetched for it. -1: unknown (any stream).
  void OnRead(const std::string& path, const cfs_client::FileVersion& version, uint64_t offset,
              uint64_t bytes, ReadOutcome outcome, bool to_kernel = true, int64_t uid = -1);
  // Attributes fetched with a prefetched file, while fresh: lookups then need no round trip.
  // `fetched_ns`, if not null, receives when they were read from the store. `dir_id`: the
  // store identity of the directory the lookup is in; only a fetch made in that very directory
  // (AttrSource::DirIdOf, checked by the store as it read) answers.
  std::optional<cfs_client::FileAttr> WindowAttr(const std::string& path, uint64_t dir_id,
                                                 uint64_t* fetched_ns = nullptr);

  // Forgets what the window holds of `path` (its attributes and bytes), after a write through
  // the mount changed it: later lookups and reads go to the store. A fetch of it in flight
  // finishes, but its result is not served.
  void Invalidate(const std::string& path);

  // --- for tests ---
  // Runs the next eligible fetch in the calling thread; false if there is none.
  bool RunOneJob();
  // Expires idle streams and abandoned entries now (workers do it every second).
  void Sweep();
  // Runs `fn` while holding the prefetcher's lock: reads reported meanwhile are queued.
  void HoldLockForTest(const std::function<void()>& fn) {
    MutexLock l(mu_);
    fn();
  }
  static constexpr uint64_t kTrimAfterBytes = 1 << 20;  // queued-path memory freed, then trim

 private:
  using State = Window::State;
  using Entry = Window::Entry;
  using Mark = ResidentMarks::Mark;  // a file marked page-resident (marks_ below)

  struct Job {
    std::string path;
    bool probe = false;  // ask the kernel whether it holds the file, size bytes
    uint64_t size = 0;
    // Under page pressure: put a file passed over in the LRU cache at `version`, if `reader`
    // may read it and neither the kernel's page cache nor the daemon's tiers hold it.
    bool fill_lru = false;  // put a file passed over in the LRU cache (page pressure)
    // Put a file passed over as page-resident back into the kernel's page cache at `version`
    // from RAM or the NVMe tier (no store read): a mark does not prove the pages are still
    // there (see RunRestore).
    bool restore = false;
    PageCacheProbe* probe_to = nullptr;  // where a restore puts the file
    cfs_client::FileVersion version;
    std::shared_ptr<const Caller> reader;
    // A fetch (StartFetchLocked): the bytes charged for its first request, and where it finds
    // fresh attributes.
    uint64_t guess = 0;
    const AttrSource* source = nullptr;
    bool IsFetch() const { return !probe && !fill_lru && !restore; }
  };
  // A file put into the kernel's page cache by a fetch or a restore, recorded (AfterStoreLocked)
  // when its worker next takes the lock: one lock a file, not two.
  struct Stored {
    std::string path;
    cfs_client::FileVersion version;
    bool restored = false;
  };

  //
  std::optional<Job> NextJobLocked() REQUIRES(mu_);
  // Charges a fetch's first request to the window.
  void StartFetchLocked(Job& job) REQUIRES(mu_);
  // RunProbe, RunLruFill, RunRestore or RunJob, with no lock held; files they stored are
  // added to `stored`.
  void Run(const Job& job, std::vector<Stored>* stored);
  void RunJob(const Job& job, std::vector<Stored>* stored);
  // A chunk for the RAM cache's LRU, inserted once mu_ is released.
  struct LruInsert {
    std::string key;
    cache::BufferRef chunk;
  };
  void AfterStoreLocked(const Stored& done, std::vector<LruInsert>* to_lru) REQUIRES(mu_);
  // Records `stored` (AfterStoreLocked) and clears it; releases mu_ while the chunks go to the
  // LRU, then takes it again.
  void RecordStoredLocked(std::vector<Stored>* stored) REQUIRES(mu_);
  // What the first look at a file to prefetch found (no lock held): its attributes with the
  // whole file, or only the attributes of one too large for `guess` bytes; or an error.
  struct FirstLook {
    Result<cfs_client::Backend::Fetched> got = Status::NotFound("");
    std::shared_ptr<cache::Buffer> first;  // the store's reply, when it was asked
    cache::BufferRef cached;               // the whole file, from the RAM cache or NVMe tier
    bool known = false;                    // the attributes were the daemon's own
    uint64_t known_ns = 0;                 // and were fetched then
    bool from_cache = false;               // known attributes and a cached copy: no request
    uint64_t dir_id = 0;                   // the directory the store was asked in (DirIdOf)
  };
  FirstLook LookFirst(const std::string& path, uint64_t guess,
                      const cfs_client::Backend::AttrCheck& check, const AttrSource* source);
  // Until the window has room for `size` bytes of `e`, which are then charged; false if it
  // never will (too large, stopping, or no stream wants it any more). Waits on room_cv_.
  bool WaitForRoomLocked(Entry& e, uint64_t size) REQUIRES(mu_);
  // What is left to do of a fetch once it is ready, with no lock held (FinishOutside): the
  // chunks for the NVMe tier, and the file for the kernel's page cache.
  struct Completion {
    std::vector<std::pair<std::string, cache::BufferRef>> to_disk;
    PageCacheProbe* store = nullptr;
    cache::BufferRef to_store;
    cfs_client::FileVersion version;
  };
  // `e` (of `path`) is ready with `chunks`, kept on the NVMe tier if `write_back`.
  Completion CompleteFetchLocked(const std::string& path, Entry& e,
                                 std::vector<cache::BufferRef> chunks, bool write_back)
      REQUIRES(mu_);
  void FinishOutside(const std::string& path, const Completion& done, std::vector<Stored>* stored)
      EXCLUDES(mu_);
  // The chunks of `path` at `version`, from the tiers or the store, on parallel threads;
  // *from_store: how many the store was asked for.
  Status FetchChunks(const std::string& path, const cfs_client::FileVersion& version,
                     std::vector<cache::BufferRef>* chunks, uint64_t* from_store);
  // Why the prefetcher read the store (Stats::StoreReads).
  enum class StoreRead { kWindow = 0, kLruFill = 1 };
  // Counts `n` store reads made for `why`.
  void CountStoreReadsLocked(StoreRead why, uint64_t n) REQUIRES(mu_);
  void RunProbe(const Job& job);
  void RunLruFill(const Job& job);
  void RunRestore(const Job& job, std::vector<Stored>* stored);
  // The job for a file passed over as page-resident: put it in the LRU cache under page pressure
  // when the readers are `near`; if its mark is trusted, put it back into the page cache from
  // what the daemon holds (`restore`: the stream's first look at it); else probe it (none if a
  // probe of it runs).
  std::optional<Job> PassOverJobLocked(const Stream& s, const std::string& path, const Mark& mark,
                                       const cfs_client::FileVersion& version, bool near,
                                       bool restore) REQUIRES(mu_);
  // The job that puts a file passed over in the LRU cache, if it is small enough.
  std::optional<Job> LruFillJobLocked(const Stream& s, const std::string& path,
                                      const cfs_client::FileVersion& version) REQUIRES(mu_);
  // Position `pos` of `s` is no longer passed over: the scheduler and rechecks look again.
  void UnprobeLocked(Stream& s, uint64_t pos) REQUIRES(mu_);
  // A probe of the next file passed over that the readers are near, if any.
  std::optional<Job> RecheckLocked(Stream& s) REQUIRES(mu_);
  uint64_t RecheckLead() const;  // positions ahead of the readers where rechecks happen
  void MarkPositionLocked(Stream& s, uint64_t pos, PosState state) REQUIRES(mu_);
  // The mark of `path` if it is marked at the version of its fresh attributes (else the
  // mark, if any, is dropped); *version: that version.
  std::optional<Mark> FreshMarkLocked(const std::string& path, cfs_client::FileVersion* version)
      REQUIRES(mu_);
  // The mark of `path` whatever its attributes (nothing without an AttrSource).
  std::optional<Mark> MarkLocked(const std::string& path) const REQUIRES(mu_);
  void SetMarkLocked(const std::string& path, const std::optional<Mark>& mark) REQUIRES(mu_);
  // Records that the kernel was served all of `path` at `version`.
  void MarkResidentLocked(const std::string& path, const cfs_client::FileVersion& version)
      REQUIRES(mu_);
  // A read of `path` reached the daemon: if it was marked, its pages are gone, and older
  // marks passed over are probed again.
  void NoteNotResidentLocked(const std::string& path, uint64_t now) REQUIRES(mu_);
  // Records a page drop (`ahead`: of a file a stream passed over, its position still to come);
  // on entering pressure, the files passed over within RecheckLead() of the readers are taken
  // up again, to be put in the LRU cache (LruFillJobLocked).
  void NotePageDropLocked(uint64_t now, bool ahead) REQUIRES(mu_);
  void AdvanceLocked(Stream& s) REQUIRES(mu_);
  void DropRefLocked(const std::string& path) REQUIRES(mu_);
  void ReleaseLocked(Window::iterator it) REQUIRES(mu_);
  void FailLocked(Window::iterator it) REQUIRES(mu_);
  void DeleteStreamLocked(std::map<std::string, Stream>::iterator it) REQUIRES(mu_);
  // Trims the heap if queued paths of kTrimAfterBytes or more were freed since the last
  // trim.
  void MaybeTrimHeap() EXCLUDES(mu_);
  void SweepLocked() REQUIRES(mu_);
  void MaybeReleaseLocked(const std::string& path) REQUIRES(mu_);
  void FinishFetchLocked(Entry& e) REQUIRES(mu_);
  // Gives up one ready, unread entry of the user furthest over its share, when a user under
  // its share has files to fetch. True if one was released.
  bool PreemptLocked(const std::unordered_map<uid_t, bool>& wanting, uint64_t share_files,
                     uint64_t share_bytes) REQUIRES(mu_);
  Stream* StreamById(const std::string& id) REQUIRES(mu_);
  // Whether the RAM cache holds all of `path` at the version of its fresh attributes.
  bool HeldInRamLocked(const std::string& path) REQUIRES(mu_);
  // OnRead's work under mu_; true if a worker is to be woken.
  bool OnReadLocked(const std::string& path, const cfs_client::FileVersion& version,
                    uint64_t offset, uint64_t bytes, ReadOutcome outcome, bool to_kernel,
                    int64_t uid, uint64_t now) REQUIRES(mu_);
  void WorkerLoop();
  static constexpr size_t kRestoreRun = 64;  // restore jobs one worker takes at once

  // A read reported (OnRead) while another thread held mu_: the reader does not wait, the next
  // holder applies it (ApplyDeferredLocked), all threads' reads in the order they were
  // reported. Sharded by reader thread; each shard holds at most kDeferMax (past it, the
  // reader waits for mu_ as before), so what readers can leave queued is bounded.
  struct DeferredRead {
    std::string path;
    cfs_client::FileVersion version;
    uint64_t offset = 0, bytes = 0;
    ReadOutcome outcome = ReadOutcome::kHit;
    bool to_kernel = true;
    int64_t uid = -1;
    uint64_t now = 0;
    uint64_t seq = 0;  // the order reported, across threads (defer_seq_)
  };
  static constexpr size_t kDeferShards = 16;
  static constexpr size_t kDeferMax = 1024;
  struct DeferShard {
    Mutex mu;
    std::vector<DeferredRead> reads GUARDED_BY(mu);
  };
  // Queues `read` in the calling thread's shard; false if that shard is full.
  bool Defer(DeferredRead&& read);
  // Applies the queued reads; true if a worker is to be woken.
  bool ApplyDeferredLocked() REQUIRES(mu_);
  uint64_t Slack() const;
  // The window's view index and settled count, which the read path reads with no lock (their
  // own shard locks and an atomic: Window::FindView, Window::Settled); the rest of the window
  // is mu_'s.
  const Window& Views() const NO_THREAD_SAFETY_ANALYSIS { return window_; }
  void Wake();  // after any change that may make work or room

  const Options options_;
  cfs_client::Backend* const backend_;
  cache::RamCache* const ram_;
  cache::DiskCache* const disk_;
  Clock* const clock_;

  Mutex mu_;               // guards the fields marked GUARDED_BY(mu_)
  CondVar work_cv_{&mu_};  // idle workers: new paths or window room
  CondVar room_cv_{&mu_};  // fetches waiting for window room
  bool stop_ GUARDED_BY(mu_) = false;
  uint64_t next_stream_id_ GUARDED_BY(mu_) = 1;
  std::map<std::string, Stream> streams_ GUARDED_BY(mu_);
  std::string rr_after_ GUARDED_BY(mu_);  // round-robin: the stream served last
  Window window_ GUARDED_BY(mu_);
  QueuedPaths queued_ GUARDED_BY(mu_);
  uint64_t freed_queued_bytes_ GUARDED_BY(mu_) = 0;  // by deleted streams, since the last heap trim
  uint64_t inflight_ GUARDED_BY(mu_) = 0;
  uint64_t last_sweep_ns_ GUARDED_BY(mu_) = 0;
  bool restore_ GUARDED_BY(mu_) = true;  // RunRestore's jobs are made (options_.restore_needed)
  uint64_t restore_asked_ns_ GUARDED_BY(mu_) = 0;       // when restore_needed was last asked
  uint64_t size_estimate_ GUARDED_BY(mu_) = 128 << 10;  // running mean of prefetched file sizes
  Stats totals_ GUARDED_BY(mu_);  // reads and outcome counters (streams filled on demand)

  AttrSource* attr_source_ GUARDED_BY(mu_) = nullptr;
  PageCacheProbe* page_probe_ GUARDED_BY(mu_) = nullptr;
  // The key of a path in a stream's index of pending positions.
  static uint64_t PathKey(std::string_view path) { return std::hash<std::string_view>{}(path); }
  ResidentMarks marks_
      GUARDED_BY(mu_);  // the marks' trust and page pressure (the marks: attr_source_)

  std::vector<std::thread> workers_;

  std::array<DeferShard, kDeferShards> deferred_;
  std::atomic<uint64_t> deferred_count_{0};  // reads in deferred_
  std::atomic<uint64_t> defer_seq_{0};       // DeferredRead::seq of the next one
  std::vector<DeferredRead> applying_
      GUARDED_BY(mu_);  // ApplyDeferredLocked's (under mu_), kept for reuse

  // Owned by the registry; null without one.
  prometheus::Counter* reads_[3] = {nullptr, nullptr, nullptr};
  prometheus::Counter* fetched_ = nullptr;
  prometheus::Counter* evicted_unread_ = nullptr;
  prometheus::Counter* failed_ = nullptr;
  prometheus::Counter* page_resident_ = nullptr;
  prometheus::Counter* trusted_ = nullptr;
  prometheus::Counter* stored_ = nullptr;
  prometheus::Counter* restored_ = nullptr;
  prometheus::Counter* probed_absent_ = nullptr;
  prometheus::Counter* cached_ = nullptr;
  prometheus::Counter* lru_filled_ = nullptr;
  prometheus::Counter* store_reads_[2] = {nullptr, nullptr};  // by StoreRead
  prometheus::Gauge* inflight_gauge_ = nullptr;
  prometheus::Gauge* window_gauge_ = nullptr;
};

}  // namespace cubetorchfs::prefetch
