// The prefetcher's window part: the files fetched ahead of the readers, or being fetched, with
// what each holds of the window's budget and which user's share it uses. A part of the RAM
// budget bounded by files and bytes; docs/prefetch.md and docs/memory.md say how it is shared
// and what it costs.
//
// Workers fetch stream files in order into the window; when it is full fetching waits, so
// prefetching never pushes out an unread file. A file fetched whole in one chunk under
// keep_cache is put into the kernel's page cache (PageCacheProbe::Store) and its bytes go to the
// LRU. A file leaves the window once read whole and wanted by no position.
//
// Not thread-safe, but for FindView and Settled: the prefetcher's mutex guards it. What readers
// need of it (an entry's attributes once known, its chunks once ready) is also shown in a view
// index of its own, sharded by path, that the read path looks up with no prefetcher lock
// (docs/architecture.md#locks).
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/thread_annotations.h"
#include "prefetch/access.h"

namespace prometheus {
class Gauge;
}  // namespace prometheus

namespace cubetorchfs::prefetch {

class Window {
 public:
  // kStat: the first request (attributes and, for most files, all the data) is running;
  // kFetching: the rest of a large file is being read; kReady: all bytes are in memory.
  enum class State { kStat, kFetching, kReady };
  struct Entry {
    State state = State::kStat;
    cfs_client::FileAttr attr;
    uint64_t attr_time_ns = 0;
    uint64_t dir_id = 0;    // the store identity of the directory it was fetched in (0: none)
    uint64_t reserved = 0;  // bytes counted against the budget
    std::vector<cache::BufferRef> chunks;
    uint32_t refs = 0;        // pending stream positions that want this file
    uint64_t bytes_read = 0;  // since its latest read at offset 0
    uint64_t last_read_ns = 0;
    bool was_read = false;
    bool waiting_for_room = false;  // a large file waiting for room before its fetch
    bool invalidated = false;       // written through the mount since fetched: never served
    bool store = true;              // put into the page cache once fetched (Stream::page_cache)
    std::string first_stream;       // the stream whose position created it (for its counters)
    uid_t owner = 0;                // that stream's owner, whose share of the window it uses
    std::shared_ptr<const Caller> reader;  // whose read permission the fetch checks
    std::shared_future<void> done;         // ready when the fetch ends, either way
    std::shared_ptr<std::promise<void>> promise;
    bool shown = false;        // in the view index (Show)
    bool shown_ready = false;  // and shown ready there
  };
  // What a reader finds of an entry with no prefetcher lock: its attributes once known
  // (kFetching), and its chunks once ready. Immutable once shown; a change shows a new one.
  struct View {
    cfs_client::FileAttr attr;
    uint64_t attr_time_ns = 0;
    uint64_t dir_id = 0;
    bool ready = false;
    std::vector<cache::BufferRef> chunks;
  };
  using Map = std::unordered_map<std::string, Entry>;
  using iterator = Map::iterator;

  Window(uint64_t max_files, uint64_t budget_bytes)
      : max_files_(max_files), budget_(budget_bytes) {}
  // Follows the bytes held from now on (null: none). Set before any entry is added.
  void set_gauge(prometheus::Gauge* gauge) { gauge_ = gauge; }

  iterator find(const std::string& path) { return files_.find(path); }
  Entry& at(const std::string& path) { return files_.at(path); }
  iterator begin() { return files_.begin(); }
  iterator end() { return files_.end(); }
  size_t size() const { return files_.size(); }
  uint64_t bytes() const { return bytes_; }
  uint64_t budget() const { return budget_; }
  // No room for another file: max_files of them, or the budget held.
  bool Full() const { return files_.size() >= max_files_ || bytes_ >= budget_; }
  // Whether `more` bytes fit in the budget now.
  bool Fits(uint64_t more) const { return bytes_ + more <= budget_; }

  // A new entry for `path`, one file of `owner`'s share; no bytes yet.
  Entry& Add(const std::string& path, uid_t owner);
  // Shows readers what entry `e` of `path` holds now, after its attributes, state or chunks
  // changed (from kFetching on); an invalidated entry is hidden instead.
  void Show(const std::string& path, Entry& e);
  // Hides `e` of `path` from readers (invalidated: never served again).
  void Hide(const std::string& path, Entry& e);
  // What readers are shown of `path`, or null. Thread-safe, with no prefetcher lock.
  std::shared_ptr<const View> FindView(const std::string& path) const;
  // Every entry is shown ready: a path with no view is not in the window, and a reader need
  // not look under the prefetcher's lock for a fetch to wait on. Thread-safe.
  bool Settled() const { return unsettled_.load(std::memory_order_acquire) == 0; }
  // Adds `bytes` (may be negative) to what `e` holds.
  void Charge(Entry& e, int64_t bytes);
  // Removes an entry, giving back what it held.
  void Erase(iterator it);

  // Whether `uid` holds `share_files` files or `share_bytes` bytes or more.
  bool AtShare(uid_t uid, uint64_t share_files, uint64_t share_bytes) const;
  // The user furthest over its share, if any is over.
  std::optional<uid_t> FurthestOver(uint64_t share_files, uint64_t share_bytes) const;

 private:
  struct Use {
    uint64_t files = 0, bytes = 0;
  };
  const uint64_t max_files_, budget_;
  prometheus::Gauge* gauge_ = nullptr;
  Map files_;
  uint64_t bytes_ = 0;
  std::unordered_map<uid_t, Use> use_;  // what each user's streams hold

  // The view index: shards by path, each under its own lock (taken after the prefetcher's).
  static constexpr size_t kViewShards = 64;
  struct ViewShard {
    mutable Mutex mu;
    std::unordered_map<std::string, std::shared_ptr<const View>> views GUARDED_BY(mu);
  };
  ViewShard& ShardOf(const std::string& path) const {
    return views_[std::hash<std::string>{}(path) % kViewShards];
  }
  void Unshow(const std::string& path, Entry& e);
  mutable std::array<ViewShard, kViewShards> views_;
  std::atomic<uint64_t> unsettled_{0};  // entries not shown ready
};

}  // namespace cubetorchfs::prefetch
