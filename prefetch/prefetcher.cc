#include "prefetch/prefetcher.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <atomic>

#include "common/logging.h"

namespace cubetorchfs::prefetch {
namespace {

constexpr uint64_t kSecond = 1'000'000'000;
// Parallel ranged reads per large file being prefetched.
constexpr size_t kParallelChunks = 8;
// A file read only in part is released this long after its last read.
constexpr uint64_t kPartialReadIdleNs = 30 * kSecond;

}  // namespace

Prefetcher::Prefetcher(const Options& options, cfs_client::Backend* backend, cache::RamCache* ram,
                       Clock* clock, prometheus::Registry* registry, cache::DiskCache* disk)
    : options_(options), backend_(backend), ram_(ram), disk_(disk), clock_(clock) {
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
    probed_absent_ = &files.Add({{"outcome", "probed_absent"}});
    cached_ = &files.Add({{"outcome", "cached"}});
    warmed_ = &files.Add({{"outcome", "warmed"}});
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
  }
  totals_.window_budget_bytes = options_.window_budget_bytes;
  if (options_.start_workers && options_.prefetch.enabled) {
    for (uint32_t i = 0; i < options_.prefetch.max_inflight; ++i)
      workers_.emplace_back([this] { WorkerLoop(); });
  }
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  room_cv_.notify_all();
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
                                     std::shared_ptr<const Caller> reader) {
  std::lock_guard<std::mutex> l(mu_);
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
  s.last_active_ns = clock_->NowNanos();
  s.stats.id = id;
  s.stats.name = name;
  s.stats.pid = pid;
  s.stats.uid = uid;
  CTFS_LOG(kInfo) << "stream " << id << " created: " << name << " (pid " << pid << ", uid " << uid
                  << ")";
  return id;
}

Prefetcher::Stream* Prefetcher::StreamById(const std::string& id) {
  auto it = streams_.find(id);
  return it == streams_.end() ? nullptr : &it->second;
}

bool Prefetcher::DeleteStream(const std::string& id) { return DeleteStreamAs(0, id) == Op::kOk; }

Prefetcher::Op Prefetcher::CheckStream(uid_t uid, const std::string& id) {
  std::lock_guard<std::mutex> l(mu_);
  const Stream* s = StreamById(id);
  if (s == nullptr) return Op::kNotFound;
  return uid != 0 && s->uid != uid ? Op::kForbidden : Op::kOk;
}

Prefetcher::Op Prefetcher::DeleteStreamAs(uid_t uid, const std::string& id) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = streams_.find(id);
  if (it == streams_.end()) return Op::kNotFound;
  if (uid != 0 && it->second.uid != uid) return Op::kForbidden;
  DeleteStreamLocked(it);
  Wake();
  return Op::kOk;
}

void Prefetcher::DeleteStreamLocked(std::map<std::string, Stream>::iterator it) {
  Stream& s = it->second;
  std::vector<std::string> attached;
  for (uint64_t pos = s.low; pos < s.next && pos < s.base + s.paths.size(); ++pos)
    if (s.states[pos - s.base] == (kPending | kAttached)) attached.push_back(s.paths[pos - s.base]);
  CTFS_LOG(kInfo) << "stream " << s.id << " deleted (" << s.stats.read << " of "
                  << s.stats.published << " published files read)";
  if (rr_after_ == s.id) rr_after_.clear();
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
                                     const std::vector<std::string>& paths, bool partial,
                                     size_t* taken) {
  if (taken != nullptr) *taken = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    Stream* s = StreamById(id);
    if (s == nullptr) return Op::kNotFound;
    if (uid != 0 && s->uid != uid) return Op::kForbidden;
    // Queued positions of all the owner's streams stay under the per-uid limit.
    uint64_t queued = 0, all = 0;
    for (const auto& [sid, st] : streams_) {
      const uint64_t q = st.base + st.paths.size() - st.low;
      all += q;
      if (st.uid == s->uid) queued += q;
    }
    const uint64_t room = std::min(
        options_.max_queued_paths_per_uid - std::min(queued, options_.max_queued_paths_per_uid),
        options_.max_queued_paths - std::min(all, options_.max_queued_paths));
    if (room < paths.size() && (!partial || room == 0)) return Op::kFull;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(room, paths.size()));
    if (taken != nullptr) *taken = n;
    for (size_t i = 0; i < n; ++i) {
      const std::string& path = paths[i];
      const uint64_t pos = s->base + s->paths.size();
      s->paths.push_back(path);
      s->states.push_back(kPending);
      s->pending[path].push_back(pos);
    }
    s->stats.published += n;
    s->last_active_ns = clock_->NowNanos();
  }
  Wake();
  return Op::kOk;
}

void Prefetcher::SetAttrSource(AttrSource source) {
  std::lock_guard<std::mutex> l(mu_);
  attr_source_ = std::make_shared<const AttrSource>(std::move(source));
}

void Prefetcher::SetPageProbe(PageProbe probe) {
  std::lock_guard<std::mutex> l(mu_);
  page_probe_ = probe ? std::make_shared<const PageProbe>(std::move(probe)) : nullptr;
}

Stats Prefetcher::GetStats(std::optional<uid_t> only) {
  std::lock_guard<std::mutex> l(mu_);
  Stats out = totals_;
  out.resident_marks = marks_.size();
  out.page_pressure = PressureLocked(clock_->NowNanos());
  out.inflight = inflight_;
  out.window_files = window_.size();
  out.window_bytes = window_bytes_;
  for (const auto& [id, s] : streams_) {
    if (only && s.uid != *only) continue;
    StreamStats st = s.stats;
    st.queued = s.base + s.paths.size() - s.low;
    out.streams.push_back(std::move(st));
  }
  return out;
}

std::optional<Prefetcher::Job> Prefetcher::NextJobLocked() {
  if (!options_.prefetch.enabled || streams_.empty()) return std::nullopt;
  // The window is shared fairly among the users whose streams have files to fetch: each
  // gets an equal part of its files and bytes, and one over its part gives way to one under.
  std::unordered_map<uid_t, bool> wanting;
  for (auto& [id, s] : streams_)
    if (std::max(s.next, s.low) < s.base + s.paths.size()) wanting[s.uid] = true;
  const uint64_t users = std::max<uint64_t>(1, wanting.size());
  const uint64_t share_files = std::max<uint64_t>(1, options_.prefetch.window_files / users);
  const uint64_t share_bytes = options_.window_budget_bytes / users;
  auto over_share = [&](uid_t uid) {
    if (users < 2) return false;
    auto u = use_.find(uid);
    return u != use_.end() && (u->second.files >= share_files || u->second.bytes >= share_bytes);
  };
  // Probes take no room in the window.
  for (auto& [id, s] : streams_)
    if (std::optional<Job> job = RecheckLocked(s)) return job;
  if (window_.size() >= options_.prefetch.window_files ||
      window_bytes_ >= options_.window_budget_bytes) {
    if (users < 2 || !PreemptLocked(wanting, share_files, share_bytes)) return std::nullopt;
    if (window_.size() >= options_.prefetch.window_files ||
        window_bytes_ >= options_.window_budget_bytes)
      return std::nullopt;
  }
  // Round-robin over streams so one DataLoader cannot starve another.
  auto it = streams_.upper_bound(rr_after_);
  for (size_t n = 0; n < streams_.size(); ++n, ++it) {
    if (it == streams_.end()) it = streams_.begin();
    Stream& s = it->second;
    if (over_share(s.uid)) continue;
    s.next = std::max(s.next, s.low);
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
      if (Mark* mark = page_probe_ ? FreshMarkLocked(path) : nullptr) {
        // The kernel may hold it: pass over it unless the probe finds a page missing. Probed
        // this near the readers, it is not probed again as they come.
        state |= kProbed;
        const bool near = pos < s.high + RecheckLead();
        if (near) state |= kRechecked;
        if (std::optional<Job> job = PassOverJobLocked(s, path, *mark, near)) return job;
        continue;
      }
      state |= kAttached;
      Entry& e = window_[path];
      e.refs = 1;
      e.first_stream = s.id;
      e.owner = s.uid;
      e.reader = s.reader;
      use_[s.uid].files++;
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

void Prefetcher::FinishFetchLocked(Entry& e) {
  inflight_--;
  if (inflight_gauge_) inflight_gauge_->Decrement();
  e.promise->set_value();
  e.promise.reset();
}

void Prefetcher::FailLocked(std::unordered_map<std::string, Entry>::iterator it) {
  Entry& e = it->second;
  totals_.failed++;
  if (failed_) failed_->Increment();
  if (Stream* s = StreamById(e.first_stream)) s->stats.failed++;
  FinishFetchLocked(e);
  EraseLocked(it);
  Wake();
}

void Prefetcher::RunJob(const Job& job) {
  std::unique_lock<std::mutex> l(mu_);
  // Entries that are not ready are erased only here, so the element stays put.
  Entry* e = &window_.at(job.path);
  auto reserve = [&](uint64_t bytes) { ChargeLocked(*e, static_cast<int64_t>(bytes)); };
  auto abandon = [&] {
    FinishFetchLocked(*e);
    EraseLocked(window_.find(job.path));
    Wake();
  };
  // Most files are small: one request brings attributes and data. Reserve a guess at the
  // size first (the budget holds even while the data is in flight); a bigger file falls back
  // to reserving its real size and reading it in chunks.
  const uint64_t guess =
      std::min({options_.chunk_bytes, options_.window_budget_bytes - window_bytes_,
                (size_estimate_ + size_estimate_ / 4 + 4095) / 4096 * 4096});
  reserve(guess);
  // The owner's read permission is checked on the attributes before any byte is fetched.
  cfs_client::Backend::AttrCheck check;
  if (e->reader) {
    check = [reader = e->reader, &job](const cfs_client::FileAttr& a) -> Status {
      if (!MayAccess(a, *reader, R_OK))
        return Status::PermissionDenied(job.path + ": the stream's owner may not read it");
      return Status::OK();
    };
  }
  const std::shared_ptr<const AttrSource> source = attr_source_;
  l.unlock();

  std::shared_ptr<cache::Buffer> first;
  Result<cfs_client::Backend::Fetched> got = Status::NotFound("");
  cache::BufferRef from_disk;  // the whole small file, from the RAM cache or the NVMe tier
  // Fresh attributes the daemon holds: a file the RAM cache or the NVMe tier has at that
  // version costs no store request at all, and a large one only the chunks they lack.
  uint64_t known_ns = 0;
  std::optional<cfs_client::FileAttr> known;
  if (source) known = (*source)(job.path, &known_ns);
  bool from_cache = false;
  if (known && !known->IsRegular()) {
    got = Status::InvalidArgument(job.path + ": not a regular file");
  } else if (known) {
    if (Status denied = check ? check(*known) : Status::OK(); !denied.ok()) {
      got = denied;
    } else if (known->size > guess) {
      got = cfs_client::Backend::Fetched{*known, 0};  // the chunked path below
    } else {
      const std::string key = cache::ChunkKey(job.path, known->Version(), 0);
      cache::BufferRef hit = ram_->Get(key);
      if (!hit && disk_ != nullptr) {
        if (Result<cache::BufferRef> d = disk_->Get(key); d.ok()) hit = std::move(d).value();
      }
      if (hit && hit->size == known->size) {
        from_disk = std::move(hit);
        from_cache = true;
        got = cfs_client::Backend::Fetched{*known, from_disk->size};
      }
    }
  } else if (disk_ != nullptr) {
    // With an NVMe tier, a file cached there (say, by an earlier run) costs only a metadata
    // request to the store.
    Result<cfs_client::FileAttr> attr = backend_->Stat(job.path);
    if (attr.ok() && check) {
      if (Status denied = check(attr.value()); !denied.ok()) attr = denied;
    }
    if (!attr.ok() && attr.status().code() == Status::Code::kPermissionDenied) {
      got = attr.status();
    } else if (attr.ok() && attr->IsRegular() && attr->size > guess) {
      got = cfs_client::Backend::Fetched{attr.value(), 0};  // the chunked path reads the tier
    } else if (attr.ok() && attr->IsRegular()) {
      Result<cache::BufferRef> d = disk_->Get(cache::ChunkKey(job.path, attr->Version(), 0));
      if (d.ok() && (*d)->size == attr->size) {
        from_disk = std::move(d).value();
        got = cfs_client::Backend::Fetched{attr.value(), from_disk->size};
      }
    }
  }
  if (!from_disk && !got.ok() && got.status().code() != Status::Code::kPermissionDenied &&
      got.status().code() != Status::Code::kInvalidArgument) {
    first = cache::Buffer::Allocate(guess);
    got = backend_->StatRead(job.path, static_cast<size_t>(guess), first->data.get(), check);
  }

  l.lock();
  if (!got.ok() && got.status().code() == Status::Code::kPermissionDenied) totals_.denied++;
  if (!got.ok()) {
    CTFS_LOG(kDebug) << "prefetch " << job.path << ": " << got.status().ToString();
    FailLocked(window_.find(job.path));
    return;
  }
  const cfs_client::FileAttr attr = got->attr;
  const uint64_t size = attr.size;
  size_estimate_ = (size_estimate_ * 7 + size) / 8;
  e->attr = attr;
  e->attr_time_ns = known ? known_ns : clock_->NowNanos();
  if (from_cache) {
    totals_.cached++;
    if (cached_) cached_->Increment();
  }
  e->state = State::kFetching;
  // The whole file came from the RAM cache or the NVMe tier: nothing to write back.
  const bool had_copy = from_disk != nullptr;
  std::vector<cache::BufferRef> chunks;
  Status failure;
  if (size <= guess && got->bytes != size) {
    failure = Status::Stale(job.path + ": short read from the store");
  } else if (size <= guess) {
    if (from_disk) {
      chunks.push_back(std::move(from_disk));
    } else {
      first->Shrink(size);
      chunks.push_back(std::move(first));
    }
    ChargeLocked(*e, static_cast<int64_t>(size) - static_cast<int64_t>(e->reserved));
  } else {
    first.reset();
    if (size > options_.window_budget_bytes) {  // can never fit: leave it to demand reads
      abandon();
      return;
    }
    // Wait for room: the window never pushes out a file that has not been read.
    ChargeLocked(*e, -static_cast<int64_t>(e->reserved));
    e->waiting_for_room = true;  // readers fetch it themselves rather than wait on this
    // Release readers already waiting on the first request: room may only come from their
    // own reads of other files, so they must not wait here.
    e->promise->set_value();
    e->promise = std::make_shared<std::promise<void>>();
    e->done = e->promise->get_future().share();
    room_cv_.wait(l, [&] {
      return stop_ || e->refs == 0 || window_bytes_ + size <= options_.window_budget_bytes;
    });
    e->waiting_for_room = false;
    if (stop_ || e->refs == 0) {
      abandon();
      return;
    }
    reserve(size);
    l.unlock();
    const cfs_client::FileVersion version = attr.Version();
    const uint64_t chunk_bytes = options_.chunk_bytes;
    const size_t n_chunks = static_cast<size_t>((size + chunk_bytes - 1) / chunk_bytes);
    chunks.resize(n_chunks);
    std::vector<Status> errors(n_chunks);
    // A large file's chunks are fetched in parallel ranged reads: a store's bandwidth per
    // request is limited, its bandwidth in all is not.
    std::atomic<size_t> next_chunk{0};
    auto fetch_chunks = [&] {
      for (size_t c = next_chunk++; c < n_chunks; c = next_chunk++) {
        const uint64_t off = c * chunk_bytes;
        const size_t len = static_cast<size_t>(std::min(chunk_bytes, size - off));
        // A demand read may have fetched this chunk already, or an NVMe tier hold it.
        const std::string key = cache::ChunkKey(job.path, version, c);
        if (cache::BufferRef cached = ram_->Get(key)) {
          chunks[c] = std::move(cached);
          continue;
        }
        if (disk_ != nullptr) {
          if (Result<cache::BufferRef> d = disk_->Get(key); d.ok() && (*d)->size == len) {
            chunks[c] = std::move(d).value();
            continue;
          }
        }
        Result<cache::BufferRef> r = cache::ReadChunk(*backend_, job.path, version, off, len);
        if (r.ok())
          chunks[c] = std::move(r).value();
        else
          errors[c] = r.status();
      }
    };
    const size_t helpers = std::min<size_t>(kParallelChunks, n_chunks) - 1;
    std::vector<std::thread> threads;
    for (size_t t = 0; t < helpers; ++t) threads.emplace_back(fetch_chunks);
    fetch_chunks();
    for (auto& t : threads) t.join();
    for (const Status& err : errors)
      if (!err.ok() && failure.ok()) failure = err;
    l.lock();
  }
  if (!failure.ok()) {
    CTFS_LOG(kDebug) << "prefetch " << job.path << ": " << failure.ToString();
    FailLocked(window_.find(job.path));
    return;
  }
  // Kept on the NVMe tier for later runs and epochs.
  std::vector<std::pair<std::string, cache::BufferRef>> to_disk;
  if (disk_ != nullptr && !e->invalidated && !had_copy)
    for (size_t i = 0; i < chunks.size(); ++i)
      to_disk.emplace_back(cache::ChunkKey(job.path, attr.Version(), i), chunks[i]);
  e->chunks = std::move(chunks);
  e->state = State::kReady;
  totals_.fetched++;
  if (fetched_) fetched_->Increment();
  if (Stream* s = StreamById(e->first_stream)) s->stats.fetched++;
  FinishFetchLocked(*e);
  MaybeReleaseLocked(job.path);
  Wake();
  l.unlock();
  // Written by the worker that fetched it, not queued: prefetching outruns the tier's writer
  // queue, which would drop files; this way the tier's write speed paces prefetching.
  for (const auto& [key, chunk] : to_disk)
    if (Status s = disk_->Put(key, *chunk); !s.ok())
      CTFS_LOG(kDebug) << "NVMe tier: " << key << ": " << s.ToString();
}

void Prefetcher::DropRefLocked(const std::string& path) {
  auto it = window_.find(path);
  if (it != window_.end() && it->second.refs > 0) it->second.refs--;
}

void Prefetcher::MaybeReleaseLocked(const std::string& path) {
  auto it = window_.find(path);
  if (it == window_.end()) return;
  const Entry& e = it->second;
  if (e.refs > 0 || e.state != State::kReady) return;
  // Wanted by no stream: keep it only while a read of it is under way.
  if (e.was_read && e.bytes_read < e.attr.size) return;
  ReleaseLocked(it);
}

void Prefetcher::ReleaseLocked(std::unordered_map<std::string, Entry>::iterator it) {
  Entry& e = it->second;
  if (!e.was_read) {
    totals_.evicted_unread++;
    if (evicted_unread_) evicted_unread_->Increment();
    if (Stream* s = StreamById(e.first_stream)) s->stats.evicted_unread++;
  } else if (e.invalidated) {
    // Bytes of a version written over through the mount: kept nowhere.
  } else if (!options_.prefetch.evict_after_read) {
    // Keep it for later readers in the RAM cache's LRU (which demotes to NVMe in turn).
    for (size_t i = 0; i < e.chunks.size(); ++i)
      ram_->Insert(cache::ChunkKey(it->first, e.attr.Version(), i), e.chunks[i]);
  } else if (disk_ != nullptr) {
    // Evicted after its read: the NVMe tier keeps it for the next epoch.
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      const std::string key = cache::ChunkKey(it->first, e.attr.Version(), i);
      disk_->PutAsync(key, e.chunks[i]);
    }
  }
  EraseLocked(it);
  Wake();
}

void Prefetcher::ChargeLocked(Entry& e, int64_t bytes) {
  e.reserved = static_cast<uint64_t>(static_cast<int64_t>(e.reserved) + bytes);
  window_bytes_ = static_cast<uint64_t>(static_cast<int64_t>(window_bytes_) + bytes);
  Use& u = use_[e.owner];
  u.bytes = static_cast<uint64_t>(static_cast<int64_t>(u.bytes) + bytes);
  if (window_gauge_) window_gauge_->Increment(static_cast<double>(bytes));
}

void Prefetcher::EraseLocked(std::unordered_map<std::string, Entry>::iterator it) {
  ChargeLocked(it->second, -static_cast<int64_t>(it->second.reserved));
  auto u = use_.find(it->second.owner);
  if (u != use_.end() && --u->second.files == 0 && u->second.bytes == 0) use_.erase(u);
  window_.erase(it);
}

bool Prefetcher::PreemptLocked(const std::unordered_map<uid_t, bool>& wanting, uint64_t share_files,
                               uint64_t share_bytes) {
  // Only for a user under its share who has files to fetch.
  bool someone_under = false;
  for (const auto& [uid, w] : wanting) {
    auto u = use_.find(uid);
    if (u == use_.end() || (u->second.files < share_files && u->second.bytes < share_bytes))
      someone_under = true;
  }
  if (!someone_under) return false;
  // The user furthest over its share gives up one fetched file nobody has read yet.
  uid_t victim = 0;
  uint64_t worst = 0;
  for (const auto& [uid, u] : use_) {
    const uint64_t over =
        std::max(u.files > share_files ? (u.files - share_files) * share_bytes : 0,
                 u.bytes > share_bytes ? (u.bytes - share_bytes) * share_files : 0);
    if (over > worst) {
      worst = over;
      victim = uid;
    }
  }
  if (worst == 0) return false;
  for (auto it = window_.begin(); it != window_.end(); ++it) {
    if (it->second.owner != victim || it->second.state != State::kReady || it->second.was_read)
      continue;
    totals_.preempted++;
    ReleaseLocked(it);
    return true;
  }
  return false;
}

uint64_t Prefetcher::RecheckLead() const {
  // Room to fetch what has gone since: twice what the workers fetch at once.
  return 2 * std::max<uint64_t>(options_.prefetch.max_inflight, 1);
}

std::optional<Prefetcher::Job> Prefetcher::RecheckLocked(Stream& s) {
  if (!page_probe_) return std::nullopt;
  // Files passed over are probed again as the readers come near: the first probe may have
  // been a whole window ahead.
  const uint64_t end = std::min({s.high + RecheckLead(), s.next, s.base + s.paths.size()});
  s.recheck = std::max(s.recheck, s.low);
  while (s.recheck < end) {
    const uint64_t pos = s.recheck++;
    uint8_t& state = s.states[pos - s.base];
    if ((state & kStateMask) != kPending || (state & kProbed) == 0 || (state & kRechecked) != 0)
      continue;
    state |= kRechecked;
    const std::string& path = s.paths[pos - s.base];
    Mark* mark = FreshMarkLocked(path);
    if (mark == nullptr) {  // its attributes expired or changed meanwhile: fetch it
      UnprobeLocked(s, pos);
      continue;
    }
    if (std::optional<Job> job = PassOverJobLocked(s, path, *mark, /*near=*/true)) return job;
  }
  return std::nullopt;
}

std::optional<Prefetcher::Job> Prefetcher::PassOverJobLocked(const Stream& s,
                                                             const std::string& path, Mark& mark,
                                                             bool near) {
  if (near && PressureLocked(clock_->NowNanos())) return WarmJobLocked(s, path, mark);
  if (mark.probing) return std::nullopt;  // a probe of it runs: its answer serves this position
  mark.probing = true;
  rr_after_ = s.id;
  return Job{path, true, mark.version.size};
}

std::optional<Prefetcher::Job> Prefetcher::WarmJobLocked(const Stream& s, const std::string& path,
                                                         const Mark& mark) {
  // A probe now may be stale by the read: the file goes to the LRU cache instead, where the
  // read finds it if the kernel drops it meanwhile. Large files are left to their reads.
  if (mark.version.size > options_.chunk_bytes) return std::nullopt;
  rr_after_ = s.id;
  Job job{path, false, mark.version.size};
  job.warm = true;
  job.version = mark.version;
  job.reader = s.reader;
  return job;
}

void Prefetcher::UnprobeLocked(Stream& s, uint64_t pos) {
  s.states[pos - s.base] &= static_cast<uint8_t>(~(kProbed | kRechecked));
  s.next = std::min(s.next, pos);
  s.recheck = std::min(s.recheck, pos);
}

Prefetcher::Mark* Prefetcher::FreshMarkLocked(const std::string& path) {
  auto m = marks_.find(path);
  if (m == marks_.end()) return nullptr;
  // Only at the version of attributes still fresh: once they expire, the kernel asks again
  // and drops its pages if the file changed.
  std::optional<cfs_client::FileAttr> attr;
  if (attr_source_) attr = (*attr_source_)(path, nullptr);
  if (attr && attr->Version() == m->second.version) return &m->second;
  EraseMarkLocked(path);
  return nullptr;
}

void Prefetcher::Run(const Job& job) {
  if (job.probe)
    RunProbe(job);
  else if (job.warm)
    RunWarm(job);
  else
    RunJob(job);
}

void Prefetcher::RunWarm(const Job& job) {
  std::shared_ptr<const AttrSource> source;
  {
    std::lock_guard<std::mutex> l(mu_);
    source = attr_source_;
  }
  // Only at the version of fresh attributes, and only what the stream's owner may read.
  std::optional<cfs_client::FileAttr> known;
  if (source) known = (*source)(job.path, nullptr);
  if (!known || known->Version() != job.version || !known->IsRegular()) return;
  if (job.reader && !MayAccess(*known, *job.reader, R_OK)) {
    std::lock_guard<std::mutex> l(mu_);
    totals_.denied++;
    return;
  }
  const std::string key = cache::ChunkKey(job.path, job.version, 0);
  bool from_disk = false;
  Result<cache::Lookup> got = ram_->GetOrFetch(key, [&] {
    return cache::ReadChunkThroughTier(*backend_, disk_, key, job.path, job.version, 0,
                                       static_cast<size_t>(job.version.size), &from_disk);
  });
  std::lock_guard<std::mutex> l(mu_);
  if (!got.ok()) {
    CTFS_LOG(kDebug) << "warm " << job.path << ": " << got.status().ToString();
    return;
  }
  if (got->served != cache::Served::kCached) {
    totals_.warmed++;
    if (warmed_) warmed_->Increment();
  }
}

void Prefetcher::RunProbe(const Job& job) {
  std::shared_ptr<const PageProbe> probe;
  {
    std::lock_guard<std::mutex> l(mu_);
    probe = page_probe_;
  }
  const bool resident = probe && (*probe)(job.path, job.size);
  std::lock_guard<std::mutex> l(mu_);
  auto m = marks_.find(job.path);
  if (m != marks_.end()) m->second.probing = false;
  if (resident && m != marks_.end()) {
    totals_.page_resident++;
    if (page_resident_) page_resident_->Increment();
    return;
  }
  // Pages are gone (or the mark went meanwhile): the positions passed over want the file.
  if (m != marks_.end()) {
    EraseMarkLocked(job.path);
    totals_.probed_absent++;
    if (probed_absent_) probed_absent_->Increment();
  }
  for (auto& [id, s] : streams_) {
    auto p = s.pending.find(job.path);
    if (p == s.pending.end()) continue;
    for (uint64_t pos : p->second)
      if (pos >= s.base) UnprobeLocked(s, pos);
  }
  Wake();
}

void Prefetcher::EraseMarkLocked(const std::string& path) {
  auto m = marks_.find(path);
  if (m == marks_.end()) return;
  marks_by_seq_.erase(m->second.seq);
  marks_.erase(m);
}

void Prefetcher::DropOldestMarkLocked() {
  auto oldest = marks_by_seq_.begin();
  marks_.erase(marks_.find(*oldest->second));  // by iterator: the key is the node's own
  marks_by_seq_.erase(oldest);
}

void Prefetcher::MarkResidentLocked(const std::string& path,
                                    const cfs_client::FileVersion& version) {
  if (!options_.keep_cache || options_.max_resident_marks == 0) return;
  EraseMarkLocked(path);
  while (marks_.size() >= options_.max_resident_marks) DropOldestMarkLocked();
  const uint64_t seq = next_mark_seq_++;
  auto it = marks_.emplace(path, Mark{version, seq}).first;
  marks_by_seq_.emplace(seq, &it->first);
}

void Prefetcher::NotePageDropLocked(uint64_t now) {
  totals_.page_drops++;
  drop_times_.push_back(now);
  if (drop_times_.size() > kPressureDrops) drop_times_.pop_front();
  if (drop_times_.size() < kPressureDrops || now - drop_times_.front() > kPressureSpanNs) return;
  const bool entering = !PressureLocked(now);
  pressure_until_ns_ = now + kPressureHoldNs;
  if (!entering) return;
  // Files passed over and already rechecked near the readers are taken up again, to be warmed.
  for (auto& [id, s] : streams_) {
    const uint64_t end =
        std::min<uint64_t>({s.next, s.base + s.paths.size(), s.high + RecheckLead()});
    for (uint64_t pos = std::max(s.low, s.high); pos < end; ++pos) {
      uint8_t& state = s.states[pos - s.base];
      if ((state & kStateMask) != kPending || (state & kProbed) == 0) continue;
      state &= static_cast<uint8_t>(~kRechecked);
      s.recheck = std::min(s.recheck, pos);
    }
  }
  Wake();
}

void Prefetcher::NoteNotResidentLocked(const std::string& path, uint64_t now) {
  auto m = marks_.find(path);
  if (m == marks_.end()) return;
  NotePageDropLocked(now);
  // The kernel was served this file whole, yet asks for it: its pages were dropped, maybe
  // after a probe found them. The page cache drops what it was served earliest first, so the
  // files passed over whose marks are older still may have gone the same way since their
  // probe: they are asked about again.
  const uint64_t seq = m->second.seq;
  EraseMarkLocked(path);
  bool again = false;
  for (auto& [id, s] : streams_) {
    // Only the files the readers are about to reach: the rest are rechecked as they come.
    const uint64_t end =
        std::min<uint64_t>({s.next, s.base + s.paths.size(), s.high + RecheckLead()});
    for (uint64_t pos = std::max(s.low, s.high); pos < end; ++pos) {
      if ((s.states[pos - s.base] & kProbed) == 0) continue;
      auto other = marks_.find(s.paths[pos - s.base]);
      if (other == marks_.end() || other->second.seq > seq || other->second.probing) continue;
      UnprobeLocked(s, pos);
      again = true;
    }
  }
  if (again) Wake();
}

void Prefetcher::MarkPositionLocked(Stream& s, uint64_t pos, PosState state) {
  const std::string path = s.paths[pos - s.base];
  const bool attached = (s.states[pos - s.base] & kAttached) != 0;
  s.states[pos - s.base] = state;
  auto p = s.pending.find(path);
  if (p != s.pending.end()) {
    auto& positions = p->second;
    auto found = std::find(positions.begin(), positions.end(), pos);
    if (found != positions.end()) positions.erase(found);
    if (positions.empty()) s.pending.erase(p);
  }
  (state == kRead ? s.stats.read : s.stats.skipped)++;
  if (attached) {  // the position holds a ref of the window entry
    DropRefLocked(path);
    if (state == kSkipped) MaybeReleaseLocked(path);
  }
}

void Prefetcher::AdvanceLocked(Stream& s) {
  const uint64_t slack = Slack();
  const uint64_t skip_below = s.high > slack ? s.high - slack : 0;
  const uint64_t end = s.base + s.paths.size();
  while (s.low < end) {
    if ((s.states[s.low - s.base] & kStateMask) == kPending) {
      if (s.low >= skip_below) break;
      MarkPositionLocked(s, s.low, kSkipped);
    }
    s.low++;
  }
  // Positions behind the cursor are never looked at again.
  while (s.base < s.low) {
    s.paths.pop_front();
    s.states.pop_front();
    s.base++;
  }
}

void Prefetcher::OnRead(const std::string& path, const cfs_client::FileVersion& version,
                        uint64_t offset, uint64_t bytes, ReadOutcome outcome, bool to_kernel) {
  const int o = static_cast<int>(outcome);
  if (reads_[o]) reads_[o]->Increment();
  std::lock_guard<std::mutex> l(mu_);
  uint64_t* counts[3] = {&totals_.reads.hit, &totals_.reads.late, &totals_.reads.miss};
  (*counts[o])++;
  const uint64_t now = clock_->NowNanos();
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
    for (auto& [id, s] : streams_) {
      auto p = s.pending.find(path);
      if (p == s.pending.end()) continue;
      const uint64_t pos = p->second.front();
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
      best->high = std::max(best->high, best_pos + 1);
      best->last_active_ns = now;
      MarkPositionLocked(*best, best_pos, kRead);
      AdvanceLocked(*best);
      Wake();
    }
  }
  auto it = window_.find(path);
  if (it == window_.end()) return;
  Entry& e = it->second;
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
}

std::optional<Prefetcher::WindowHit> Prefetcher::Get(const std::string& path,
                                                     const cfs_client::FileVersion& version,
                                                     uint64_t chunk) {
  std::unique_lock<std::mutex> l(mu_);
  auto it = window_.find(path);
  if (it == window_.end() || it->second.waiting_for_room || it->second.invalidated)
    return std::nullopt;
  if (it->second.state != State::kStat && it->second.attr.Version() != version) return std::nullopt;
  bool waited = false;
  if (it->second.state != State::kReady) {  // the fetch is running: wait for it
    std::shared_future<void> done = it->second.done;
    l.unlock();
    done.wait();
    l.lock();
    it = window_.find(path);
    if (it == window_.end() || it->second.state != State::kReady || it->second.invalidated ||
        it->second.attr.Version() != version)
      return std::nullopt;
    waited = true;
  }
  if (chunk >= it->second.chunks.size()) return std::nullopt;
  return WindowHit{it->second.chunks[chunk], waited};
}

std::optional<cfs_client::FileAttr> Prefetcher::WarmAttr(const std::string& path,
                                                         uint64_t* fetched_ns) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = window_.find(path);
  if (it == window_.end() || it->second.state == State::kStat || it->second.invalidated)
    return std::nullopt;
  const double age_s = static_cast<double>(clock_->NowNanos() - it->second.attr_time_ns) / 1e9;
  if (age_s >= options_.attr_timeout_s) return std::nullopt;
  if (fetched_ns != nullptr) *fetched_ns = it->second.attr_time_ns;
  return it->second.attr;
}

void Prefetcher::Invalidate(const std::string& path) {
  std::lock_guard<std::mutex> l(mu_);
  EraseMarkLocked(path);
  auto it = window_.find(path);
  if (it == window_.end()) return;
  it->second.invalidated = true;
  MaybeReleaseLocked(path);
}

bool Prefetcher::RunOneJob() {
  std::optional<Job> job;
  {
    std::lock_guard<std::mutex> l(mu_);
    job = NextJobLocked();
  }
  if (!job) return false;
  Run(*job);
  return true;
}

void Prefetcher::Sweep() {
  std::lock_guard<std::mutex> l(mu_);
  SweepLocked();
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
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    if (clock_->NowNanos() - last_sweep_ns_ > kSecond) SweepLocked();
    std::optional<Job> job = NextJobLocked();
    if (!job) {
      work_cv_.wait_for(l, std::chrono::seconds(1));
      continue;
    }
    // Chain: another idle worker looks for more work (wakeups are one at a time).
    work_cv_.notify_one();
    l.unlock();
    Run(*job);
    l.lock();
  }
}

void Prefetcher::Wake() {
  // One idle worker is enough: one that finds a job wakes the next. Waking all 64 on every
  // read cost more CPU than the reads themselves.
  work_cv_.notify_one();
  room_cv_.notify_all();
}

}  // namespace cubetorchfs::prefetch
