// Prefetcher, part 2: running the jobs the scheduler hands out (fetching a file into the
// window, putting one in the LRU cache, probing whether the kernel holds one) and the
// window's accounting (charges, release, eviction). The scheduling and the streams are in
// prefetcher.cc, the page-residency marks in residency.cc.
#include <prometheus/counter.h>
#include <prometheus/gauge.h>

#include <algorithm>
#include <atomic>

#include "cache/tiers.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "prefetch/prefetcher.h"

namespace cubetorchfs::prefetch {
namespace {

// Parallel ranged reads per large file being prefetched.
constexpr size_t kParallelChunks = 8;

}  // namespace

void Prefetcher::FinishFetchLocked(Entry& e) {
  inflight_--;
  if (inflight_gauge_) inflight_gauge_->Decrement();
  e.promise->set_value();
  e.promise.reset();
}

void Prefetcher::FailLocked(Window::iterator it) {
  Entry& e = it->second;
  totals_.failed++;
  if (failed_) failed_->Increment();
  if (Stream* s = StreamById(e.first_stream)) s->stats.failed++;
  FinishFetchLocked(e);
  window_.Erase(it);
  // The room goes to a fetch waiting for it, or to a stream's positions the scheduler has not
  // reached. With none (the whole list scheduled), waking an idle worker cost a futex wake-up
  // and two thread switches a read, for nothing.
  room_cv_.SignalAll();
  for (const auto& [id, s] : streams_)
    if (s.next < s.end()) {
      work_cv_.Signal();
      break;
    }
}

void Prefetcher::StartFetchLocked(Job& job) {
  // Most files are small: one request brings attributes and data. Reserve a guess at the
  // size first (the budget holds even while the data is in flight); a bigger file falls back
  // to reserving its real size and reading it in chunks.
  job.guess = std::min({options_.chunk_bytes, window_.budget() - window_.bytes(),
                        (size_estimate_ + size_estimate_ / 4 + 4095) / 4096 * 4096});
  Entry& e = window_.at(job.path);
  window_.Charge(e, static_cast<int64_t>(job.guess));
  job.reader = e.reader;
  job.source = attr_source_;
}

void Prefetcher::RunJob(const Job& job, std::vector<Stored>* stored) {
  // The owner's read permission is checked on the attributes before any byte is fetched.
  cfs_client::Backend::AttrCheck check;
  if (job.reader) {
    check = [&job](const cfs_client::FileAttr& a) -> Status {
      if (!MayAccess(a, *job.reader, R_OK))
        return Status::PermissionDenied(job.path + ": the stream's owner may not read it");
      return Status::OK();
    };
  }
  FirstLook look = LookFirst(job.path, job.guess, check, job.source);
  const uint64_t guess = job.guess;
  // A small file read whole: its block cut to size and published (a crash leaves it to the
  // next process) before the lock is taken.
  if (look.got.ok() && look.got->attr.size <= guess && look.got->bytes == look.got->attr.size) {
    const cache::BufferRef& whole = look.cached ? look.cached : look.first;
    if (look.first && !look.cached) look.first->Shrink(look.got->attr.size);
    if (whole) whole->Publish(cache::ChunkKey(job.path, look.got->attr.Version(), 0));
  }

  MutexLock l(mu_);
  if (look.first) CountStoreReadsLocked(StoreRead::kWindow, 1);  // the store was asked
  // Entries that are not ready are erased only here, so the element stays put.
  Entry* e = &window_.at(job.path);
  auto abandon = [&]() REQUIRES(mu_) {
    FinishFetchLocked(*e);
    window_.Erase(window_.find(job.path));
    Wake();
  };
  if (!look.got.ok() && look.got.status().code() == Status::Code::kPermissionDenied)
    totals_.denied++;
  if (!look.got.ok()) {
    CTFS_LOG(kDebug) << "prefetch " << job.path << ": " << look.got.status().ToString();
    FailLocked(window_.find(job.path));
    return;
  }
  const cfs_client::FileAttr attr = look.got->attr;
  const uint64_t size = attr.size;
  size_estimate_ = (size_estimate_ * 7 + size) / 8;
  e->attr = attr;
  e->attr_time_ns = look.known ? look.known_ns : clock_->NowNanos();
  e->dir_id = look.dir_id;
  if (look.from_cache) {
    totals_.cached++;
    if (cached_) cached_->Increment();
  }
  e->state = State::kFetching;
  // The whole file came from the RAM cache or the NVMe tier: nothing to write back.
  const bool had_copy = look.cached != nullptr;
  std::vector<cache::BufferRef> chunks;
  Status failure;
  if (size <= guess && look.got->bytes != size) {
    failure = Status::Stale(job.path + ": short read from the store");
  } else if (size <= guess) {
    chunks.push_back(look.cached ? std::move(look.cached) : std::move(look.first));
    window_.Charge(*e, static_cast<int64_t>(size) - static_cast<int64_t>(e->reserved));
  } else {
    look.first.reset();
    // Readers see its attributes while the rest is fetched (a small file becomes ready under
    // this same hold of the lock).
    window_.Show(job.path, *e);
    if (!WaitForRoomLocked(*e, size)) {
      abandon();
      return;
    }
    l.Unlock();
    uint64_t from_store = 0;
    failure = FetchChunks(job.path, attr.Version(), &chunks, &from_store);
    l.Lock();
    CountStoreReadsLocked(StoreRead::kWindow, from_store);
  }
  if (!failure.ok()) {
    CTFS_LOG(kDebug) << "prefetch " << job.path << ": " << failure.ToString();
    FailLocked(window_.find(job.path));
    return;
  }
  const Completion done =
      CompleteFetchLocked(job.path, *e, std::move(chunks), /*write_back=*/!had_copy);
  l.Unlock();
  FinishOutside(job.path, done, stored);
}

Prefetcher::Completion Prefetcher::CompleteFetchLocked(const std::string& path, Entry& e,
                                                       std::vector<cache::BufferRef> chunks,
                                                       bool write_back) {
  Completion done;
  // Written through the mount while it was fetched: its bytes are not those of their key, even
  // for the daemon after a crash (they were published as they came).
  if (e.invalidated)
    for (const cache::BufferRef& chunk : chunks)
      if (chunk) chunk->Forget();
  // Kept on the NVMe tier for later runs and epochs.
  if (disk_ != nullptr && !e.invalidated && write_back)
    for (size_t i = 0; i < chunks.size(); ++i)
      done.to_disk.emplace_back(cache::ChunkKey(path, e.attr.Version(), i), chunks[i]);
  // A file of one chunk goes into the kernel's page cache now: its reader then reads it there,
  // with no request to the daemon (keep_cache keeps the pages across opens).
  done.version = e.attr.Version();
  done.store = options_.keep_cache && e.store ? page_probe_ : nullptr;
  if (done.store != nullptr && !e.invalidated && chunks.size() == 1 && done.version.size > 0 &&
      chunks[0]->size == done.version.size)
    done.to_store = chunks[0];
  e.chunks = std::move(chunks);
  e.state = State::kReady;
  window_.Show(path, e);
  totals_.fetched++;
  if (fetched_) fetched_->Increment();
  if (Stream* s = StreamById(e.first_stream)) s->stats.fetched++;
  FinishFetchLocked(e);
  MaybeReleaseLocked(path);  // may erase e
  // The worker takes the next job itself (WorkerLoop): only a fetch waiting for room is told.
  room_cv_.SignalAll();
  return done;
}

void Prefetcher::FinishOutside(const std::string& path, const Completion& done,
                               std::vector<Stored>* stored) {
  // Written by the worker that fetched it, not queued: prefetching outruns the tier's writer
  // queue, which would drop files; this way the tier's write speed paces prefetching.
  for (const auto& [key, chunk] : done.to_disk)
    if (Status s = disk_->Put(key, *chunk); !s.ok())
      CTFS_LOG(kDebug) << "NVMe tier: " << key << ": " << s.ToString();
  // Stored after the entry is ready: a reader whose READ holds the page lock waits on it.
  if (done.to_store != nullptr && done.store->Store(path, done.version, *done.to_store))
    stored->push_back(Stored{path, done.version, /*restored=*/false});
}

void Prefetcher::AfterStoreLocked(const Stored& done, std::vector<LruInsert>* to_lru) {
  const std::string& path = done.path;
  const cfs_client::FileVersion& version = done.version;
  if (done.restored) {
    totals_.restored++;
    if (restored_) restored_->Increment();
    MarkResidentLocked(path, version);
    return;
  }
  totals_.stored++;
  if (stored_) stored_->Increment();
  // The kernel holds it whole: marked as if it had been read (later epochs pass it over). The
  // window gives its bytes back now, to the LRU cache as a file read is (evict_after_read
  // off, the default: a read that reaches the daemon all the same, the kernel having dropped
  // the pages, is served from RAM) or to nobody (it is fetched again: a miss, or an NVMe tier
  // hit). The entry stays, empty, while a stream position wants it.
  MarkResidentLocked(path, version);
  auto it = window_.find(path);
  if (it != window_.end() && it->second.state == State::kReady && !it->second.invalidated &&
      it->second.attr.Version() == version && !it->second.chunks.empty()) {
    Entry& w = it->second;
    w.was_read = true;
    w.bytes_read = std::max(w.bytes_read, version.size);
    if (!options_.prefetch.evict_after_read)
      to_lru->push_back({cache::ChunkKey(path, version, 0), std::move(w.chunks[0])});
    w.chunks.clear();
    window_.Show(path, w);
    window_.Charge(w, -static_cast<int64_t>(w.reserved));
    MaybeReleaseLocked(path);
    room_cv_.SignalAll();  // window room (the worker looks for its next job next)
  }
}

Prefetcher::FirstLook Prefetcher::LookFirst(const std::string& path, uint64_t guess,
                                            const cfs_client::Backend::AttrCheck& check,
                                            const AttrSource* source) {
  FirstLook out;
  // The store is asked in the directory the mount holds for the file's parent, checked as it
  // resolves the path (cfs_client::Expected): what it answers may then answer the kernel's
  // lookups in that directory (WindowAttr), never in one swapped in since.
  if (source) out.dir_id = source->DirIdOf(path);
  const size_t slash = path.rfind('/');
  const std::string_view parent =
      slash == std::string::npos ? std::string_view() : std::string_view(path).substr(0, slash);
  const cfs_client::Expected::Scope in_dir({{parent, out.dir_id}});
  // Fresh attributes the daemon holds: a file the RAM cache or the NVMe tier has at that
  // version costs no store request at all, and a large one only the chunks they lack.
  std::optional<cfs_client::FileAttr> known;
  if (source) known = source->FreshAttr(path, &out.known_ns);
  out.known = known.has_value();
  const cache::Tiers tiers{ram_, disk_};
  if (known && !known->IsRegular()) {
    out.got = Status::InvalidArgument(path + ": not a regular file");
  } else if (known) {
    if (Status denied = check ? check(*known) : Status::OK(); !denied.ok()) {
      out.got = denied;
    } else if (known->size > guess) {
      out.got = cfs_client::Backend::Fetched{*known, 0};  // the chunked path
    } else if ((out.cached = tiers.Find(cache::ChunkKey(path, known->Version(), 0),
                                        static_cast<size_t>(known->size)))) {
      out.from_cache = true;
      out.got = cfs_client::Backend::Fetched{*known, out.cached->size};
    }
  } else if (disk_ != nullptr || ram_->HoldsFile(path)) {
    // With an NVMe tier, a file cached there (say, by an earlier run) costs only a metadata
    // request to the store; so does a file the RAM cache holds at some version (its
    // attributes expired, or it was adopted after a crash: cache/cache_arena.h).
    Result<cfs_client::FileAttr> attr = backend_->Stat(path);
    if (attr.ok() && check) {
      if (Status denied = check(attr.value()); !denied.ok()) attr = denied;
    }
    if (!attr.ok() && attr.status().code() == Status::Code::kPermissionDenied) {
      out.got = attr.status();
    } else if (attr.ok() && attr->IsRegular() && attr->size > guess) {
      out.got = cfs_client::Backend::Fetched{attr.value(), 0};  // the chunked path reads the tier
    } else if (attr.ok() && attr->IsRegular()) {
      out.cached =
          tiers.Find(cache::ChunkKey(path, attr->Version(), 0), static_cast<size_t>(attr->size));
      if (out.cached) out.got = cfs_client::Backend::Fetched{attr.value(), out.cached->size};
    }
  }
  if (!out.cached && !out.got.ok() && out.got.status().code() != Status::Code::kPermissionDenied &&
      out.got.status().code() != Status::Code::kInvalidArgument) {
    out.first = cache::Buffer::Allocate(guess);
    out.got = backend_->StatRead(path, static_cast<size_t>(guess), out.first->data.get(), check);
  }
  return out;
}

bool Prefetcher::WaitForRoomLocked(Entry& e, uint64_t size) {
  if (size > options_.window_budget_bytes) return false;  // never fits: left to demand reads
  // Wait for room: the window never pushes out a file that has not been read.
  window_.Charge(e, -static_cast<int64_t>(e.reserved));
  e.waiting_for_room = true;  // readers fetch it themselves rather than wait on this
  // Release readers already waiting on the first request: room may only come from their
  // own reads of other files, so they must not wait here.
  e.promise->set_value();
  e.promise = std::make_shared<std::promise<void>>();
  e.done = e.promise->get_future().share();
  while (!stop_ && e.refs != 0 && !window_.Fits(size)) room_cv_.Wait();
  e.waiting_for_room = false;
  if (stop_ || e.refs == 0) return false;
  window_.Charge(e, static_cast<int64_t>(size));
  return true;
}

Status Prefetcher::FetchChunks(const std::string& path, const cfs_client::FileVersion& version,
                               std::vector<cache::BufferRef>* chunks, uint64_t* from_store) {
  const uint64_t size = version.size;
  const uint64_t chunk_bytes = options_.chunk_bytes;
  const size_t n_chunks = static_cast<size_t>((size + chunk_bytes - 1) / chunk_bytes);
  chunks->assign(n_chunks, nullptr);
  std::vector<Status> errors(n_chunks);
  // A large file's chunks are fetched in parallel ranged reads: a store's bandwidth per
  // request is limited, its bandwidth in all is not.
  std::atomic<size_t> next_chunk{0};
  std::atomic<uint64_t> store_reads{0};
  const cache::Tiers tiers{ram_, disk_};
  auto fetch_chunks = [&] {
    for (size_t c = next_chunk++; c < n_chunks; c = next_chunk++) {
      const uint64_t off = c * chunk_bytes;
      const size_t len = static_cast<size_t>(std::min(chunk_bytes, size - off));
      // A demand read may have fetched this chunk already, or an NVMe tier hold it.
      if (cache::BufferRef cached = tiers.Find(cache::ChunkKey(path, version, c), len)) {
        cached->Publish(cache::ChunkKey(path, version, c));  // from the NVMe tier: not yet
        (*chunks)[c] = std::move(cached);
        continue;
      }
      store_reads.fetch_add(1, std::memory_order_relaxed);
      Result<cache::BufferRef> r = cache::ReadChunk(*backend_, path, version, off, len);
      if (r.ok()) {
        (*chunks)[c] = std::move(r).value();
        (*chunks)[c]->Publish(cache::ChunkKey(path, version, c));
      } else {
        errors[c] = r.status();
      }
    }
  };
  RunOnThreads(static_cast<int>(std::min<size_t>(kParallelChunks, n_chunks)), fetch_chunks);
  *from_store = store_reads.load();
  for (const Status& err : errors)
    if (!err.ok()) return err;
  return Status::OK();
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

void Prefetcher::ReleaseLocked(Window::iterator it) {
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
  window_.Erase(it);
  // The room goes to a fetch waiting for it, or to a stream's positions the scheduler has not
  // reached. With none (the whole list scheduled), waking an idle worker cost a futex wake-up
  // and two thread switches a read, for nothing.
  room_cv_.SignalAll();
  for (const auto& [id, s] : streams_)
    if (s.next < s.end()) {
      work_cv_.Signal();
      break;
    }
}

void Prefetcher::Run(const Job& job, std::vector<Stored>* stored) {
  if (job.probe)
    RunProbe(job);
  else if (job.fill_lru)
    RunLruFill(job);
  else if (job.restore)
    RunRestore(job, stored);
  else
    RunJob(job, stored);
}

void Prefetcher::RunLruFill(const Job& job) {
  const AttrSource* source = nullptr;
  PageCacheProbe* probe = nullptr;
  {
    MutexLock l(mu_);
    source = attr_source_;
    probe = page_probe_;
  }
  // Only at the version of fresh attributes, and only what the stream's owner may read.
  std::optional<cfs_client::FileAttr> known;
  if (source) known = source->FreshAttr(job.path, nullptr);
  if (!known || known->Version() != job.version || !known->IsRegular()) return;
  if (job.reader && !MayAccess(*known, *job.reader, R_OK)) {
    MutexLock l(mu_);
    totals_.denied++;
    return;
  }
  // Only a file the kernel dropped and the daemon does not hold is read from the store: a read
  // finds one the RAM cache or the NVMe tier holds there, and the kernel serves one it holds
  // itself (each store read is a request the user pays for). The tiers are asked first: a
  // probe costs the kernel a round trip.
  const std::string key = cache::ChunkKey(job.path, job.version, 0);
  if (ram_->Contains(key) || (disk_ != nullptr && disk_->Contains(key))) return;
  if (probe != nullptr && probe->Resident(job.path, job.version.size)) {
    MutexLock l(mu_);
    totals_.page_resident++;
    if (page_resident_) page_resident_->Increment();
    return;
  }
  bool from_store = false;
  Result<cache::Lookup> got = ram_->GetOrFetch(key, [&] {
    cache::Tier from = cache::Tier::kStore;
    Result<cache::BufferRef> r = cache::Tiers{ram_, disk_}.ReadThroughDisk(
        *backend_, key, job.path, job.version, 0, static_cast<size_t>(job.version.size), &from);
    from_store = from == cache::Tier::kStore;
    return r;
  });
  MutexLock l(mu_);
  if (from_store) CountStoreReadsLocked(StoreRead::kLruFill, 1);
  if (!got.ok()) {
    CTFS_LOG(kDebug) << "LRU fill of " << job.path << ": " << got.status().ToString();
    return;
  }
  if (got->served != cache::Served::kCached) {
    totals_.lru_filled++;
    if (lru_filled_) lru_filled_->Increment();
  }
}

void Prefetcher::CountStoreReadsLocked(StoreRead why, uint64_t n) {
  if (n == 0) return;
  (why == StoreRead::kWindow ? totals_.store_reads.window : totals_.store_reads.lru_fill) += n;
  if (prometheus::Counter* c = store_reads_[static_cast<int>(why)])
    c->Increment(static_cast<double>(n));
}

void Prefetcher::RunRestore(const Job& job, std::vector<Stored>* stored) {
  // page_probe_ was set when the job was made (SetPageProbe's probe outlives the Prefetcher).
  PageCacheProbe* const probe = job.probe_to;
  if (probe == nullptr) return;
  // From what the daemon holds only: nothing is read from the store or handed to anyone, and
  // the kernel still checks the reader's rights at open. Not held: left to the mark.
  const cache::BufferRef held = cache::Tiers{ram_, disk_}.Find(
      cache::ChunkKey(job.path, job.version, 0), static_cast<size_t>(job.version.size));
  if (held == nullptr || !probe->Store(job.path, job.version, *held)) return;
  stored->push_back(Stored{job.path, job.version, /*restored=*/true});
}

void Prefetcher::RunProbe(const Job& job) {
  PageCacheProbe* probe = nullptr;
  {
    MutexLock l(mu_);
    probe = page_probe_;
  }
  const bool resident = probe != nullptr && probe->Resident(job.path, job.size);
  MutexLock l(mu_);
  std::optional<Mark> m = MarkLocked(job.path);
  if (resident && m) {
    m->probing = false;
    SetMarkLocked(job.path, m);
    totals_.page_resident++;
    if (page_resident_) page_resident_->Increment();
    return;
  }
  // Pages are gone (or the mark went meanwhile): the positions passed over want the file.
  if (m) {
    SetMarkLocked(job.path, std::nullopt);
    totals_.probed_absent++;
    if (probed_absent_) probed_absent_->Increment();
  }
  const uint64_t key = PathKey(job.path);
  for (auto& [id, s] : streams_) {
    auto p = s.pending.find(key);
    if (p == s.pending.end()) continue;
    for (uint64_t pos : p->second)
      if (pos >= s.base && s.paths[pos - s.base] == job.path) UnprobeLocked(s, pos);
  }
  Wake();
}

}  // namespace cubetorchfs::prefetch
