#include "prefetch/prefetcher.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <utility>

#include "cache/tiers.h"
#include "common/heap_trim.h"
#include "common/logging.h"
#include "common/parallel.h"

namespace cubetorchfs::prefetch {
namespace {

constexpr uint64_t kSecond = 1'000'000'000;
// A file read only in part is released this long after its last read.
constexpr uint64_t kPartialReadIdleNs = 30 * kSecond;

}  // namespace

Prefetcher::Prefetcher(const Options& options, cfs_client::Backend* backend, cache::RamCache* ram,
                       Clock* clock, prometheus::Registry* registry, cache::DiskCache* disk)
    : options_(options),
      backend_(backend),
      ram_(ram),
      disk_(disk),
      clock_(clock),
      window_(options.prefetch.window_files, options.window_budget_bytes),
      queued_({options.max_queued_paths_per_uid, options.max_queued_path_bytes_per_uid,
               options.max_queued_paths, options.max_queued_path_bytes}),
      marks_({options.keep_cache, options.reclaim_counter}) {
  if (registry != nullptr) {
    auto& reads = prometheus::BuildCounter()
                      .Name("cubetorchfs_reads_total")
                      .Help(
                          "FUSE reads of regular files. hit: no wait on the backend; late: "
                          "waited on a prefetch in flight; miss: fetched synchronously")
                      .Register(*registry);
    reads_[0] = &reads.Add({{"result", "hit"}});
    reads_[1] = &reads.Add({{"result", "late"}});
    reads_[2] = &reads.Add({{"result", "miss"}});
    auto& files = prometheus::BuildCounter()
                      .Name("cubetorchfs_prefetch_files_total")
                      .Help("Files prefetched, by outcome")
                      .Register(*registry);
    fetched_ = &files.Add({{"outcome", "fetched"}});
    evicted_unread_ = &files.Add({{"outcome", "evicted_unread"}});
    failed_ = &files.Add({{"outcome", "failed"}});
    page_resident_ = &files.Add({{"outcome", "page_resident"}});
    trusted_ = &files.Add({{"outcome", "trusted"}});
    probed_absent_ = &files.Add({{"outcome", "probed_absent"}});
    cached_ = &files.Add({{"outcome", "cached"}});
    lru_filled_ = &files.Add({{"outcome", "lru_filled"}});
    stored_ = &files.Add({{"outcome", "stored"}});
    restored_ = &files.Add({{"outcome", "restored"}});
    auto& store_reads = prometheus::BuildCounter()
                            .Name("cubetorchfs_prefetch_store_reads_total")
                            .Help(
                                "Data reads the prefetcher asked of the store, by reason. "
                                "window: a stream's file fetched ahead of its reader; lru_fill: "
                                "a file passed over as page-resident, dropped by the kernel, "
                                "read into the LRU cache under page pressure")
                            .Register(*registry);
    store_reads_[static_cast<int>(StoreRead::kWindow)] = &store_reads.Add({{"reason", "window"}});
    store_reads_[static_cast<int>(StoreRead::kLruFill)] =
        &store_reads.Add({{"reason", "lru_fill"}});
    inflight_gauge_ = &prometheus::BuildGauge()
                           .Name("cubetorchfs_prefetch_inflight")
                           .Help("Prefetches running now")
                           .Register(*registry)
                           .Add({});
    // The window is part of the RAM tier; this is the gauge the RAM cache also updates.
    window_gauge_ = &prometheus::BuildGauge()
                         .Name("cubetorchfs_cache_bytes")
                         .Help("Bytes held by each cache tier")
                         .Register(*registry)
                         .Add({{"tier", "ram"}});
    window_.set_gauge(window_gauge_);
  }
  totals_.window_budget_bytes = options_.window_budget_bytes;
  if (options_.start_workers && options_.prefetch.enabled) {
    for (uint32_t i = 0; i < options_.prefetch.max_inflight; ++i)
      workers_.emplace_back([this] { WorkerLoop(); });
  }
}

Prefetcher::~Prefetcher() {
  {
    MutexLock l(mu_);
    stop_ = true;
  }
  work_cv_.SignalAll();
  room_cv_.SignalAll();
  for (auto& t : workers_) t.join();
  // Wake any reader still waiting on a fetch that will not run now.
  for (auto& [path, e] : window_)
    if (e.state != State::kReady && e.promise) e.promise->set_value();
}

uint64_t Prefetcher::Slack() const {
  if (options_.skip_slack != 0) return options_.skip_slack;
  return std::clamp<uint64_t>(options_.prefetch.window_files / 4, 64, 1024);
}

std::string Prefetcher::CreateStream(const std::string& name, int pid, uid_t uid,
                                     std::shared_ptr<const Caller> reader, const std::string& list,
                                     bool page_cache, bool claims_share) {
  MutexLock l(mu_);
  uint64_t owned = 0;
  for (const auto& [sid, st] : streams_) owned += st.uid == uid;
  if (owned >= options_.max_streams_per_uid) return "";
  std::string id = std::to_string(next_stream_id_++);
  id.insert(id.begin(), 's');  // not "s" + ...: g++ 12 warns falsely (-Wrestrict) on that
  Stream& s = streams_[id];
  s.id = id;
  s.name = name;
  s.pid = pid;
  s.uid = uid;
  s.reader = std::move(reader);
  s.list = list;
  s.page_cache = page_cache;
  s.claims_share = claims_share;
  s.last_active_ns = clock_->NowNanos();
  s.stats.id = id;
  s.stats.name = name;
  s.stats.pid = pid;
  s.stats.uid = uid;
  CTFS_LOG(kInfo) << "stream " << id << " created: " << name << " (pid " << pid << ", uid " << uid
                  << ")";
  return id;
}

Stream* Prefetcher::StreamById(const std::string& id) {
  auto it = streams_.find(id);
  return it == streams_.end() ? nullptr : &it->second;
}

bool Prefetcher::DeleteStream(const std::string& id) { return DeleteStreamAs(0, id) == Op::kOk; }

Prefetcher::Op Prefetcher::CheckStream(uid_t uid, const std::string& id) {
  MutexLock l(mu_);
  const Stream* s = StreamById(id);
  if (s == nullptr) return Op::kNotFound;
  return uid != 0 && s->uid != uid ? Op::kForbidden : Op::kOk;
}

Prefetcher::Op Prefetcher::StreamList(uid_t uid, const std::string& id, std::string* list) {
  MutexLock l(mu_);
  const Stream* s = StreamById(id);
  if (s == nullptr) return Op::kNotFound;
  if (uid != 0 && s->uid != uid) return Op::kForbidden;
  *list = s->list;
  return Op::kOk;
}

Prefetcher::Op Prefetcher::DeleteStreamAs(uid_t uid, const std::string& id) {
  {
    MutexLock l(mu_);
    auto it = streams_.find(id);
    if (it == streams_.end()) return Op::kNotFound;
    if (uid != 0 && it->second.uid != uid) return Op::kForbidden;
    // Its reads reported so far count in its final counters.
    ApplyDeferredLocked();
    it = streams_.find(id);
    if (it == streams_.end()) return Op::kNotFound;
    DeleteStreamLocked(it);
    Wake();
  }
  MaybeTrimHeap();
  return Op::kOk;
}

void Prefetcher::MaybeTrimHeap() {
  uint64_t freed = 0;
  {
    MutexLock l(mu_);
    if (freed_queued_bytes_ < kTrimAfterBytes) return;
    freed = std::exchange(freed_queued_bytes_, 0);
  }
  const bool ran = options_.trim_heap ? options_.trim_heap() : TrimHeap();
  if (!ran) {  // another trim ran just before: the next sweep tries again
    MutexLock l(mu_);
    freed_queued_bytes_ += freed;
  }
}

void Prefetcher::DeleteStreamLocked(std::map<std::string, Stream>::iterator it) {
  Stream& s = it->second;
  std::vector<std::string> attached;
  for (uint64_t pos = s.low; pos < s.next && pos < s.base + s.paths.size(); ++pos)
    if (s.states[pos - s.base] == (kPending | kAttached)) attached.push_back(s.paths[pos - s.base]);
  CTFS_LOG(kInfo) << "stream " << s.id << " deleted (" << s.stats.read << " of "
                  << s.stats.published << " published files read)";
  if (rr_after_ == s.id) rr_after_.clear();
  // Its queue goes with it: the memory is given back (MaybeTrimHeap, once unlocked).
  queued_.Remove(s.uid, s.paths.size(), s.queued_bytes);
  freed_queued_bytes_ += s.queued_bytes;
  streams_.erase(it);
  for (const auto& path : attached) {
    DropRefLocked(path);
    MaybeReleaseLocked(path);
  }
  Wake();  // fetches waiting for room may no longer be wanted
}

bool Prefetcher::Publish(const std::string& id, const std::vector<std::string>& paths) {
  return PublishAs(0, id, paths) == Op::kOk;
}

Prefetcher::Op Prefetcher::PublishAs(uid_t uid, const std::string& id,
                                     std::vector<std::string> paths, bool partial, size_t* taken,
                                     Refusal* refusal, std::optional<uint64_t> unread) {
  if (taken != nullptr) *taken = 0;
  if (refusal != nullptr) *refusal = Refusal{};
  {
    MutexLock l(mu_);
    // Reads reported before the publish come first (`unread` counts them as read).
    if (ApplyDeferredLocked()) Wake();
    Stream* s = StreamById(id);
    if (s == nullptr) return Op::kNotFound;
    if (uid != 0 && s->uid != uid) return Op::kForbidden;
    // The readers are past every position but the `unread` latest, these paths included:
    // true whether or not the paths fit, so it frees room before the limits are checked.
    if (const uint64_t end = s->base + s->paths.size() + paths.size();
        unread && end > *unread && end - *unread > s->passed) {
      s->passed = std::min(end - *unread, s->base + s->paths.size());
      s->high = std::max(s->high, s->passed);
      AdvanceLocked(*s);
      Wake();  // window room freed, if any (notifying under mu_ is fine)
    }
    // As many as fit, in order; or all or none (nothing is never refused).
    size_t n = 0;
    uint64_t bytes = 0;
    std::optional<Refusal> over;
    if (partial) {
      for (; n < paths.size(); ++n) {
        const uint64_t cost = QueuedPathCost(paths[n].size());
        if ((over = queued_.Check(s->uid, n + 1, bytes + cost))) break;
        bytes += cost;
      }
    } else if (!paths.empty()) {
      for (const auto& path : paths) bytes += QueuedPathCost(path.size());
      over = queued_.Check(s->uid, paths.size(), bytes);
      n = over ? 0 : paths.size();
    }
    if (over && refusal != nullptr) *refusal = *over;
    if (over && n == 0) return Op::kFull;
    if (taken != nullptr) *taken = n;
    // The caller's copies move in: no allocation under mu_ but the index's.
    for (size_t i = 0; i < n; ++i) {
      const uint64_t key = PathKey(paths[i]);
      s->Append(std::move(paths[i]), key);
    }
    s->queued_bytes += bytes;
    queued_.Add(s->uid, n, bytes);
    s->stats.published += n;
    s->last_active_ns = clock_->NowNanos();
  }
  Wake();
  return Op::kOk;
}

void Prefetcher::SetAttrSource(AttrSource* source) {
  MutexLock l(mu_);
  attr_source_ = source;
}

void Prefetcher::SetPageProbe(PageCacheProbe* probe) {
  MutexLock l(mu_);
  page_probe_ = probe;
}

Stats Prefetcher::GetStats(std::optional<uid_t> only) {
  MutexLock l(mu_);
  if (ApplyDeferredLocked()) Wake();  // every read reported so far is counted
  Stats out = totals_;
  out.resident_marks = attr_source_ != nullptr ? attr_source_->Marks() : 0;
  out.page_pressure = marks_.Pressure(clock_->NowNanos());
  out.page_drops = marks_.drops();
  out.inflight = inflight_;
  out.window_files = window_.size();
  out.window_bytes = window_.bytes();
  out.queued_paths = queued_.paths();
  out.queued_bytes = queued_.bytes();
  out.queued_users = queued_.users();
  for (const auto& [id, s] : streams_) {
    if (only && s.uid != *only) continue;
    StreamStats st = s.stats;
    st.queued = s.base + s.paths.size() - s.low;
    st.queued_bytes = s.queued_bytes;
    out.streams.push_back(std::move(st));
  }
  return out;
}

std::optional<Prefetcher::Job> Prefetcher::NextJobLocked() {
  if (!options_.prefetch.enabled || streams_.empty()) return std::nullopt;
  // The window is shared fairly among the users whose streams have files to fetch: each
  // gets an equal part of its files and bytes, and one over its part gives way to one under.
  std::unordered_map<uid_t, bool> wanting;
  // A stream that claims no share takes room only where it is free: it never makes another
  // user give up a file.
  for (auto& [id, s] : streams_)
    if (s.claims_share && std::max(s.next, s.low) < s.base + s.paths.size()) wanting[s.uid] = true;
  const uint64_t users = std::max<uint64_t>(1, wanting.size());
  const uint64_t share_files = std::max<uint64_t>(1, options_.prefetch.window_files / users);
  const uint64_t share_bytes = options_.window_budget_bytes / users;
  auto over_share = [&](uid_t uid) REQUIRES(mu_) {
    return users >= 2 && window_.AtShare(uid, share_files, share_bytes);
  };
  // Probes take no room in the window.
  for (auto& [id, s] : streams_)
    if (std::optional<Job> job = RecheckLocked(s)) return job;
  if (window_.Full()) {
    if (users < 2 || !PreemptLocked(wanting, share_files, share_bytes)) return std::nullopt;
    if (window_.Full()) return std::nullopt;
  }
  // Round-robin over streams so one DataLoader cannot starve another.
  auto it = streams_.upper_bound(rr_after_);
  for (size_t n = 0; n < streams_.size(); ++n, ++it) {
    if (it == streams_.end()) it = streams_.begin();
    Stream& s = it->second;
    if (over_share(s.uid)) continue;
    s.next = std::max(s.next, s.low);
    // A batch-mode stream whose requests found a window's worth of files in a row in RAM,
    // none through the window: each file ahead would be looked up only to be found there too
    // (an inode-table and an LRU lookup each: a fifth of the daemon's CPU in a warm epoch).
    // Nothing is looked at ahead of it until a read is not such a hit (the batch request
    // read the file from the store itself); the look-ahead starts again where the readers are.
    if (s.Resting(options_.prefetch.window_files)) continue;
    const uint64_t limit = s.low + options_.prefetch.window_files;
    const uint64_t end = s.base + s.paths.size();
    while (s.next < end && s.next < limit) {
      const uint64_t pos = s.next++;
      uint8_t& state = s.states[pos - s.base];
      if (state != kPending) continue;  // read, skipped, or attached already
      const std::string& path = s.paths[pos - s.base];
      auto found = window_.find(path);
      if (found != window_.end()) {  // already fetched or fetching: this position shares it
        found->second.refs++;
        state |= kAttached;
        continue;
      }
      // A batch-mode stream's file the RAM cache holds is left there for the batch request to
      // find: no trip through the window (the position stays pending until it is read).
      if (!s.page_cache && HeldInRamLocked(path)) continue;
      cfs_client::FileVersion version;
      std::optional<Mark> mark;
      if (page_probe_ && s.page_cache) mark = FreshMarkLocked(path, &version);
      if (mark) {
        // The kernel may hold it: pass over it unless the probe finds a page missing. Probed
        // this near the readers, it is not probed again as they come.
        state |= kProbed;
        const bool near = pos < s.high + RecheckLead();
        // Probed this near the readers, or trusted (no reclaim since it was marked) with no
        // page pressure, it is not looked at again as they come: a second look would only
        // check the same mark (a reclaim meanwhile leaves its reader a read from RAM).
        const uint64_t now = clock_->NowNanos();
        if (near || (!marks_.Pressure(now) && marks_.Trusted(*mark, now))) state |= kRechecked;
        if (std::optional<Job> job =
                PassOverJobLocked(s, path, *mark, version, near, /*restore=*/true))
          return job;
        continue;
      }
      state |= kAttached;
      Entry& e = window_.Add(path, s.uid);
      e.refs = 1;
      e.first_stream = s.id;
      e.reader = s.reader;
      e.store = s.page_cache;
      e.promise = std::make_shared<std::promise<void>>();
      e.done = e.promise->get_future().share();
      inflight_++;
      if (inflight_gauge_) inflight_gauge_->Increment();
      rr_after_ = s.id;
      return Job{path};
    }
  }
  // The scan above may have moved past files the readers are near.
  for (auto& [id, s] : streams_)
    if (std::optional<Job> job = RecheckLocked(s)) return job;
  return std::nullopt;
}

bool Prefetcher::HeldInRamLocked(const std::string& path) {
  if (attr_source_ == nullptr) return false;
  std::optional<cfs_client::FileAttr> a = attr_source_->FreshAttr(path, nullptr);
  if (!a || !a->IsRegular() || a->size == 0 || a->size > options_.chunk_bytes) return false;
  return ram_->Contains(cache::ChunkKey(path, a->Version(), 0));
}

bool Prefetcher::PreemptLocked(const std::unordered_map<uid_t, bool>& wanting, uint64_t share_files,
                               uint64_t share_bytes) {
  // Only for a user under its share who has files to fetch.
  bool someone_under = false;
  for (const auto& [uid, w] : wanting)
    if (!window_.AtShare(uid, share_files, share_bytes)) someone_under = true;
  if (!someone_under) return false;
  // The user furthest over its share gives up one fetched file nobody has read yet.
  const std::optional<uid_t> victim = window_.FurthestOver(share_files, share_bytes);
  if (!victim) return false;
  for (auto it = window_.begin(); it != window_.end(); ++it) {
    if (it->second.owner != *victim || it->second.state != State::kReady || it->second.was_read)
      continue;
    totals_.preempted++;
    ReleaseLocked(it);
    return true;
  }
  return false;
}

void Prefetcher::MarkPositionLocked(Stream& s, uint64_t pos, PosState state) {
  // A reference: nothing below touches the stream's deques.
  const std::string& path = s.paths[pos - s.base];
  const uint64_t key = PathKey(path);
  const uint8_t before = s.states[pos - s.base];
  const bool attached = (before & kAttached) != 0;
  s.states[pos - s.base] = state;
  s.Unpend(key, pos);
  if (state == kRead) {
    s.stats.read++;
  } else if ((before & kProbed) != 0 || MarkLocked(path)) {
    // (kProbed: the scheduler passed it over on its mark, which it would have cleared had the
    // mark gone since: no second look at the marks needed.)
    // Passed by the readers with no read reaching the daemon while the kernel was known to
    // hold the file whole (stored there, or served to it and not dropped since): a hit, read
    // from the page cache. A read that did reach the daemon consumed its position as kRead
    // instead, and was counted by OnRead as what it was.
    s.stats.page_cache++;
    totals_.reads.hit++;
    s.stats.reads.hit++;
    if (reads_[0]) reads_[0]->Increment();
  } else {
    s.stats.skipped++;
  }
  if (attached) {  // the position holds a ref of the window entry
    DropRefLocked(path);
    if (state == kSkipped) MaybeReleaseLocked(path);
  }
}

void Prefetcher::AdvanceLocked(Stream& s) {
  const uint64_t slack = Slack();
  const uint64_t skip_below = std::max(s.high > slack ? s.high - slack : 0, s.passed);
  const uint64_t end = s.base + s.paths.size();
  while (s.low < end) {
    if ((s.states[s.low - s.base] & kStateMask) == kPending) {
      if (s.low >= skip_below) break;
      MarkPositionLocked(s, s.low, kSkipped);
    }
    s.low++;
  }
  // Positions behind the cursor are never looked at again.
  const auto [popped, bytes] = s.PopConsumed();
  queued_.Remove(s.uid, popped, bytes);
}

void Prefetcher::OnRead(const std::string& path, const cfs_client::FileVersion& version,
                        uint64_t offset, uint64_t bytes, ReadOutcome outcome, bool to_kernel,
                        int64_t uid) {
  const int o = static_cast<int>(outcome);
  if (reads_[o]) reads_[o]->Increment();
  if (!mu_.try_lock()) {
    if (Defer({path, version, offset, bytes, outcome, to_kernel, uid, clock_->NowNanos()})) {
      // The holder may have released the lock before the read was queued: apply it now if
      // nobody holds it, rather than leave it for the next holder.
      if (!mu_.try_lock()) return;
      const bool wake = ApplyDeferredLocked();
      mu_.unlock();
      if (wake) Wake();
      return;
    }
    mu_.lock();  // this thread's shard is full: wait, as every read once did
  }
  // Reads queued earlier (this thread's among them) first.
  bool wake = ApplyDeferredLocked();
  wake |= OnReadLocked(path, version, offset, bytes, outcome, to_kernel, uid, clock_->NowNanos());
  mu_.unlock();
  if (wake) Wake();
}

bool Prefetcher::Defer(DeferredRead&& read) {
  // Threads take shards in turn, the first time each reports a read.
  static std::atomic<size_t> next_shard{0};
  thread_local const size_t shard_index = next_shard.fetch_add(1) % kDeferShards;
  DeferShard& shard = deferred_[shard_index];
  MutexLock l(shard.mu);
  if (shard.reads.size() >= kDeferMax) return false;
  read.seq = defer_seq_.fetch_add(1, std::memory_order_relaxed);
  shard.reads.push_back(std::move(read));
  deferred_count_.fetch_add(1, std::memory_order_release);
  return true;
}

bool Prefetcher::ApplyDeferredLocked() {
  if (deferred_count_.load(std::memory_order_acquire) == 0) return false;
  for (DeferShard& shard : deferred_) {
    MutexLock l(shard.mu);
    if (shard.reads.empty()) continue;
    deferred_count_.fetch_sub(shard.reads.size(), std::memory_order_acq_rel);
    std::move(shard.reads.begin(), shard.reads.end(), std::back_inserter(applying_));
    shard.reads.clear();
  }
  // In the order they were reported, across threads: a stream's cursor skips positions far
  // behind the furthest read, so one thread's reads applied ahead of another's would make
  // the other's look that far behind.
  std::sort(applying_.begin(), applying_.end(),
            [](const DeferredRead& a, const DeferredRead& b) { return a.seq < b.seq; });
  bool wake = false;
  for (const DeferredRead& r : applying_)
    wake |=
        OnReadLocked(r.path, r.version, r.offset, r.bytes, r.outcome, r.to_kernel, r.uid, r.now);
  applying_.clear();  // keeps its capacity for the next time
  return wake;
}

bool Prefetcher::OnReadLocked(const std::string& path, const cfs_client::FileVersion& version,
                              uint64_t offset, uint64_t bytes, ReadOutcome outcome, bool to_kernel,
                              int64_t uid, uint64_t now) {
  const int o = static_cast<int>(outcome);
  uint64_t* counts[3] = {&totals_.reads.hit, &totals_.reads.late, &totals_.reads.miss};
  (*counts[o])++;
  bool wake = false;
  // Page residency is about the kernel: a read served to the control API says nothing of it.
  if (to_kernel && offset == 0) NoteNotResidentLocked(path, now);
  // A read of the whole file at once (most small files): the kernel now holds its pages.
  if (to_kernel && offset == 0 && bytes >= version.size) MarkResidentLocked(path, version);
  if (offset == 0) {
    // A read of the file begins: it consumes the file's earliest pending stream position.
    // Positions count per stream: the file belongs to the stream whose own cursor is
    // nearest to it.
    Stream* best = nullptr;
    uint64_t best_pos = 0;
    const uint64_t key = PathKey(path);
    for (auto& [id, s] : streams_) {
      if (uid >= 0 && static_cast<int64_t>(s.uid) != uid) continue;  // another user's stream
      std::optional<uint64_t> first = s.FirstPending(key, path);
      if (!first) continue;
      const uint64_t pos = *first;
      if (best == nullptr || pos - s.low < best_pos - best->low) {
        best = &s;
        best_pos = pos;
      }
    }
    auto it = window_.find(path);
    // A new read of the whole file starts (unless an earlier read is still under way).
    if (it != window_.end() && it->second.bytes_read >= it->second.attr.size)
      it->second.bytes_read = 0;
    if (best != nullptr) {
      uint64_t* stream_counts[3] = {&best->stats.reads.hit, &best->stats.reads.late,
                                    &best->stats.reads.miss};
      (*stream_counts[o])++;
      // A hit the window did not serve: the file was in RAM with no look-ahead needed. A read
      // the window served, or one that waited or missed, says the look-ahead is wanted.
      const bool was_resting = best->Resting(options_.prefetch.window_files);
      const bool from_ram = outcome == ReadOutcome::kHit && it == window_.end();
      best->hits_in_a_row = from_ram ? best->hits_in_a_row + 1 : 0;
      if (was_resting && !from_ram) wake = true;  // look ahead again
      best->last_active_ns = now;
      // The scheduler looks at most window_files positions past the cursor: a worker is woken
      // when the read moved that horizon with positions waiting past it. Window room a read
      // frees wakes one where it is freed (ReleaseLocked). Waking one on every read cost a
      // futex wake-up and two thread switches a file where reads reach the daemon.
      // Passed-over files the readers come near are probed again (RecheckLocked): a worker is
      // woken each time the readers cover half the lead of those probes.
      const uint64_t high_before = best->high;
      best->high = std::max(best->high, best_pos + 1);
      const uint64_t half_lead = std::max<uint64_t>(1, RecheckLead() / 2);
      const bool recheck =
          page_probe_ != nullptr && best->high / half_lead != high_before / half_lead;
      const uint64_t horizon = best->low + options_.prefetch.window_files;
      const bool at_horizon = best->next >= horizon && horizon < best->end();
      MarkPositionLocked(*best, best_pos, kRead);
      AdvanceLocked(*best);
      wake =
          wake || (at_horizon && best->low + options_.prefetch.window_files > horizon) || recheck;
    }
  }
  auto it = window_.find(path);
  if (it == window_.end()) return wake;
  Entry& e = it->second;
  // Fetched for another user's stream: this read is served from it, and leaves it to them.
  if (uid >= 0 && static_cast<int64_t>(e.owner) != uid) return wake;
  if (e.state != State::kReady) {
    // Read on demand before its prefetch finished: once fetched, nobody needs it.
    e.was_read = true;
    e.bytes_read = UINT64_MAX;
  } else if (e.attr.Version() == version) {
    e.was_read = true;
    e.bytes_read = bytes > UINT64_MAX - e.bytes_read ? UINT64_MAX : e.bytes_read + bytes;
    e.last_read_ns = now;
    if (to_kernel && e.bytes_read >= e.attr.size) MarkResidentLocked(path, version);
  }
  MaybeReleaseLocked(path);
  return wake;
}

std::optional<Prefetcher::WindowHit> Prefetcher::Get(const std::string& path,
                                                     const cfs_client::FileVersion& version,
                                                     uint64_t chunk) {
  // With no lock but the view shard's: a file shown ready (most reads of a warm epoch), or
  // one not in the window at all while every entry is ready. Settled is read before the view:
  // a fetch that starts after it was read is not waited for, as if it had started after
  // this read.
  const bool settled = Views().Settled();
  if (std::shared_ptr<const Window::View> view = Views().FindView(path)) {
    if (view->ready) {
      if (view->attr.Version() != version || chunk >= view->chunks.size()) return std::nullopt;
      return WindowHit{view->chunks[chunk], false};
    }
  } else if (settled) {
    return std::nullopt;
  }
  MutexLock l(mu_);
  auto it = window_.find(path);
  if (it == window_.end() || it->second.waiting_for_room || it->second.invalidated)
    return std::nullopt;
  if (it->second.state != State::kStat && it->second.attr.Version() != version) return std::nullopt;
  bool waited = false;
  if (it->second.state != State::kReady) {  // the fetch is running: wait for it
    std::shared_future<void> done = it->second.done;
    l.Unlock();
    done.wait();
    l.Lock();
    it = window_.find(path);
    if (it == window_.end() || it->second.state != State::kReady || it->second.invalidated ||
        it->second.attr.Version() != version)
      return std::nullopt;
    waited = true;
  }
  if (chunk >= it->second.chunks.size()) return std::nullopt;
  return WindowHit{it->second.chunks[chunk], waited};
}

std::optional<cfs_client::FileAttr> Prefetcher::WindowAttr(const std::string& path, uint64_t dir_id,
                                                           uint64_t* fetched_ns) {
  // No prefetcher lock: entries past kStat and not invalidated are shown.
  std::shared_ptr<const Window::View> view = Views().FindView(path);
  if (view == nullptr || view->dir_id != dir_id) return std::nullopt;
  const double age_s = static_cast<double>(clock_->NowNanos() - view->attr_time_ns) / 1e9;
  if (age_s >= options_.attr_timeout_s) return std::nullopt;
  if (fetched_ns != nullptr) *fetched_ns = view->attr_time_ns;
  return view->attr;
}

void Prefetcher::Invalidate(const std::string& path) {
  MutexLock l(mu_);
  // Reads of the old version reported so far are applied first: a file read whole before it
  // was written is not counted as evicted unread.
  if (ApplyDeferredLocked()) Wake();
  SetMarkLocked(path, std::nullopt);
  auto it = window_.find(path);
  if (it == window_.end()) return;
  it->second.invalidated = true;
  for (const cache::BufferRef& chunk : it->second.chunks)
    if (chunk) chunk->Forget();  // no longer the bytes of their key, even after a crash
  window_.Hide(path, it->second);
  MaybeReleaseLocked(path);
}

bool Prefetcher::RunOneJob() {
  std::optional<Job> job;
  {
    MutexLock l(mu_);
    if (ApplyDeferredLocked()) Wake();  // this thread looks for work next, and one more
    job = NextJobLocked();
    if (job && job->IsFetch()) StartFetchLocked(*job);
  }
  if (!job) return false;
  std::vector<Stored> stored;
  Run(*job, &stored);
  MutexLock l(mu_);
  RecordStoredLocked(&stored);
  return true;
}

void Prefetcher::RecordStoredLocked(std::vector<Stored>* stored) {
  if (stored->empty()) return;
  std::vector<LruInsert> to_lru;
  for (const Stored& done : *stored) AfterStoreLocked(done, &to_lru);
  stored->clear();
  if (to_lru.empty()) return;
  mu_.unlock();
  for (auto& [key, chunk] : to_lru) ram_->Insert(key, std::move(chunk));
  mu_.lock();
}

void Prefetcher::Sweep() {
  {
    MutexLock l(mu_);
    if (ApplyDeferredLocked()) Wake();
    SweepLocked();
  }
  MaybeTrimHeap();
}

void Prefetcher::SweepLocked() {
  const uint64_t now = clock_->NowNanos();
  last_sweep_ns_ = now;
  const auto idle_ns = static_cast<uint64_t>(options_.stream_idle_s * 1e9);
  for (auto it = streams_.begin(); it != streams_.end();) {
    auto next = std::next(it);
    if (now - it->second.last_active_ns > idle_ns) {
      CTFS_LOG(kInfo) << "stream " << it->first << " expired after " << options_.stream_idle_s
                      << " s idle";
      DeleteStreamLocked(it);
    }
    it = next;
  }
  std::vector<std::string> stale;
  for (const auto& [path, e] : window_)
    if (e.refs == 0 && e.state == State::kReady && e.was_read &&
        now - e.last_read_ns > kPartialReadIdleNs)
      stale.push_back(path);
  for (const auto& path : stale) ReleaseLocked(window_.find(path));
}

void Prefetcher::WorkerLoop() {
  std::vector<Job> batch;
  std::vector<Stored> stored;  // by the last batch, recorded at the next lock
  bool woken = true;           // came from waiting for work (not from finishing a job)
  MutexLock l(mu_);
  while (!stop_) {
    RecordStoredLocked(&stored);
    if (stop_) break;
    if (options_.restore_needed &&
        (restore_asked_ns_ == 0 || clock_->NowNanos() - restore_asked_ns_ > 10 * kSecond)) {
      restore_asked_ns_ = clock_->NowNanos();
      l.Unlock();
      const bool needed = options_.restore_needed();  // a few sysfs reads
      l.Lock();
      if (needed != restore_) {
        CTFS_LOG(kInfo) << (needed ? "page cache is dropped unseen (DAMON pageout): trusted "
                                     "files are put back into it as streams reach them"
                                   : "no unseen page-cache drops: trusted files are passed over "
                                     "with no restore");
        restore_ = needed;
      }
    }
    if (clock_->NowNanos() - last_sweep_ns_ > kSecond) {
      SweepLocked();
      if (freed_queued_bytes_ >= kTrimAfterBytes) {  // streams expired or were deleted
        l.Unlock();
        MaybeTrimHeap();
        l.Lock();
        continue;
      }
    }
    // Reads other threads queued while the lock was held, before looking for work. What they
    // call for (look-ahead moved, room freed) wakes an idle worker and the fetches waiting
    // for room, as it would have from the reader: this worker takes one job only.
    if (ApplyDeferredLocked()) Wake();
    std::optional<Job> job = NextJobLocked();
    if (!job) {
      work_cv_.WaitFor(std::chrono::seconds(1));
      woken = true;
      continue;
    }
    batch.clear();
    batch.push_back(std::move(*job));
    // Restores are short and never wait on the store: a run of them is taken at once, where
    // waking another worker for each cost more than the restore (a warm epoch is one restore
    // a file). A fetch ends the run: it waits on the store, so others look further meanwhile.
    bool more = true;
    while (batch.back().restore && batch.size() < kRestoreRun) {
      std::optional<Job> next = NextJobLocked();
      if (!next) {
        more = false;
        break;
      }
      batch.push_back(std::move(*next));
    }
    if (batch.back().IsFetch()) StartFetchLocked(batch.back());
    // Chain: another idle worker looks for more work (wakeups are one at a time). A worker
    // back from a fetch takes the next one itself, with no wakeup: the number of fetches in
    // flight grows as workers are woken, and holds as each finishes and takes another.
    if (more && (woken || batch.back().restore)) work_cv_.Signal();
    woken = false;
    l.Unlock();
    for (const Job& j : batch) Run(j, &stored);
    l.Lock();
  }
}

void Prefetcher::Wake() {
  // One idle worker is enough: one that finds a job wakes the next. Waking all 64 on every
  // read cost more CPU than the reads themselves.
  work_cv_.Signal();
  room_cv_.SignalAll();
}

}  // namespace cubetorchfs::prefetch
