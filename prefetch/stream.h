// The prefetcher's streams part: one stream is the ordered list of files a DataLoader pass will
// read, published ahead of the reads, with a state byte per position and an index of the
// positions still pending, keyed by the path's 64-bit hash (a position's own path confirms a
// hit). Positions behind `low` are popped, so a stream holds what its publisher has queued
// ahead of the readers, not the epoch. docs/prefetch.md says what the cursors mean for a user.
//
// Not thread-safe: the prefetcher's mutex guards it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "prefetch/access.h"

namespace cubetorchfs::prefetch {

enum class ReadOutcome { kHit = 0, kLate = 1, kMiss = 2 };

struct ReadCounts {
  uint64_t hit = 0, late = 0, miss = 0;
  uint64_t total() const { return hit + late + miss; }
};

struct StreamStats {
  std::string id, name;
  int pid = 0;
  uid_t uid = 0;           // the stream's owner: the user who created it
  uint64_t published = 0;  // positions appended
  uint64_t read = 0;       // positions consumed by a read
  uint64_t skipped = 0;    // positions passed over by the readers, the file not held
  // Positions the readers passed with no read reaching the daemon while the kernel held the
  // file whole (stored there, or served to it and not dropped since): page-cache reads, hits.
  uint64_t page_cache = 0;
  uint64_t queued = 0;        // positions not yet read or skipped
  uint64_t queued_bytes = 0;  // the memory they hold (QueuedPaths::Cost each)
  uint64_t fetched = 0, failed = 0, evicted_unread = 0;
  ReadCounts reads;  // outcome of the first read of each of its files
};

// A position's byte: its state, and flags.
enum PosState : uint8_t { kPending = 0, kRead = 1, kSkipped = 2 };
inline constexpr uint8_t kStateMask = 3;
// The scheduler attached it to a window entry (it holds one of the entry's refs).
inline constexpr uint8_t kAttached = 4;
// Passed over: the file is marked page-resident and the probe found it whole, or is asking.
inline constexpr uint8_t kProbed = 8;
// Probed again as the readers came near.
inline constexpr uint8_t kRechecked = 16;

struct Stream {
  std::string id, name;
  std::string list;  // the registered file list its positions name, if any
  int pid = 0;
  uid_t uid = 0;
  std::shared_ptr<const Caller> reader;
  // The readers read through the mount's page cache. False for the hook's batch mode, whose
  // workers take the files from the daemon (POST /v1/files/batch): nothing is put into the
  // page cache for it, and no file is passed over as held there.
  bool page_cache = true;
  // Whether its user counts in the window's fair shares. False for the streams of
  // /batchdownload/path, whose files are fetched ahead only into room nobody else wants: a
  // user asking for a file must not make another user's prefetched files go.
  bool claims_share = true;
  uint64_t base = 0;  // position of paths.front()
  std::deque<std::string> paths;
  std::deque<uint8_t> states;
  // Key(path) -> its pending positions, ascending (a vector: most paths have one, and a deque's
  // first block alone would cost 512 bytes a path).
  std::unordered_map<uint64_t, std::vector<uint64_t>> pending;
  uint64_t low = 0;   // first position neither read nor skipped
  uint64_t high = 0;  // one past the furthest position read
  // The publisher's word (Prefetcher::PublishAs's `unread`): the readers are past every
  // position before this one, read or not; those leave the queue with no slack.
  uint64_t passed = 0;
  uint64_t next = 0;          // the next position the scheduler looks at
  uint64_t recheck = 0;       // the next position passed over to probe again
  uint64_t queued_bytes = 0;  // QueuedPaths::Cost of each position in `paths`
  uint64_t last_active_ns = 0;
  // Reads in a row that found the file in RAM, not through the prefetch window: see
  // Prefetcher::NextJobLocked.
  uint64_t hits_in_a_row = 0;
  StreamStats stats;

  uint64_t end() const { return base + paths.size(); }
  // A batch-mode stream whose readers found `window_files` files in a row in RAM with no
  // look-ahead: the prefetcher looks nothing up ahead of it until one is not.
  bool Resting(uint64_t window_files) const { return !page_cache && hits_in_a_row >= window_files; }
  uint8_t& state(uint64_t pos) { return states[pos - base]; }
  const std::string& path(uint64_t pos) const { return paths[pos - base]; }
  // Appends a position of `path` (hash `key`), moved from.
  void Append(std::string&& path, uint64_t key);
  // The first pending position of `path` (hash `key`), if any.
  std::optional<uint64_t> FirstPending(uint64_t key, std::string_view path) const;
  // Position `pos` of hash `key` is no longer pending.
  void Unpend(uint64_t key, uint64_t pos);
  // Pops the positions before `low` (never looked at again): how many, and their cost.
  std::pair<uint64_t, uint64_t> PopConsumed();
};

}  // namespace cubetorchfs::prefetch
