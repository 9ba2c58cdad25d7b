// The prefetcher's residency part: which files the kernel was served whole (or was given) and
// may still hold in its page cache, whether that can be believed without asking the kernel,
// and whether the kernel is dropping such pages often (page pressure). docs/prefetch.md says
// what each means for a user.
//
// A mark is keyed by a 64-bit hash of the store path (Key), not the path, in a flat table
// (FlatHashTable: 24-byte slots, 3/8 to 3/4 full): 48 to 96 bytes a mark with its place in
// the age order (computed from the sizes, not measured). Two paths with one hash
// share a mark, which is still checked against the file's own version (by the prefetcher) and
// by a probe against the kernel's pages of that file: a collision costs a probe, never a
// wrong byte. Past `max_marks` the oldest marks go.
//
// Trust: a mark made while the kernel's count of reclaimed page-cache pages has not moved
// since is trusted (the file is passed over with no probe). The counter is read at most every
// kReclaimSampleNs.
//
// Not thread-safe: the prefetcher's mutex guards it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>

#include "cfs_client/backend.h"
#include "common/flat_hash_table.h"

namespace cubetorchfs::prefetch {

class ResidentMarks {
 public:
  struct Mark {
    uint64_t version = 0;  // VersionDigest of the version the kernel was given
    uint64_t seq : 63 = 0;
    uint64_t probing : 1 = 0;  // a probe of it is running
  };
  // A 64-bit digest of a file version: marks compare versions by it (a false match would only
  // pass over a file the kernel itself checks by its attributes; the daemon serves no byte
  // by it).
  static uint64_t VersionDigest(const cfs_client::FileVersion& v);
  struct Options {
    uint64_t max_marks = 1u << 21;  // 0: nothing is ever marked
    // The kernel's count of reclaimed page-cache pages, or nothing if it cannot tell. Unset:
    // no mark is trusted.
    std::function<std::optional<uint64_t>()> reclaim_counter;
  };
  explicit ResidentMarks(Options options) : options_(std::move(options)) {}

  static uint64_t Key(std::string_view path);

  // The mark of `key`; valid until the next Make or Erase.
  Mark* Find(uint64_t key) { return table_.Find(key); }
  // The kernel holds all of the file of `key` at `version` (made again if marked before).
  void Make(uint64_t key, const cfs_client::FileVersion& version, uint64_t now);
  void Erase(uint64_t key) { table_.Erase(key); }  // its age-order entry is skipped when met
  // True if `mark` may be believed with no probe: no reclaim seen since it was made.
  bool Trusted(const Mark& mark, uint64_t now);

  // A read of a marked file reached the daemon: the kernel dropped its pages. Four such
  // drops within 10 s are page pressure, held 60 s past the last; true if it begins now.
  bool NoteDrop(uint64_t now);
  bool Pressure(uint64_t now) const { return now < pressure_until_ns_; }

  uint64_t size() const { return table_.size(); }
  uint64_t drops() const { return drops_; }

 private:
  void DropOldest();
  void SampleReclaim(uint64_t now);

  static constexpr uint64_t kReclaimSampleNs = 50'000'000;
  static constexpr size_t kPressureDrops = 4;
  static constexpr uint64_t kPressureSpanNs = 10'000'000'000;
  static constexpr uint64_t kPressureHoldNs = 60'000'000'000;

  const Options options_;
  FlatHashTable<Mark> table_;
  // (seq, key) of every mark made, oldest first; an entry whose mark went or was made again
  // (another seq) is skipped when met, and the deque compacted when half of it is such.
  std::deque<std::pair<uint64_t, uint64_t>> order_;
  uint64_t next_seq_ = 0;
  // Marks of seq >= trust_from_seq_ were made after the last reclaim seen: trusted.
  uint64_t trust_from_seq_ = UINT64_MAX;  // nothing trusted until a first sample
  std::optional<uint64_t> last_reclaim_;
  uint64_t reclaim_sampled_ns_ = 0;
  bool reclaim_sampled_ = false;
  std::deque<uint64_t> drop_times_;  // the last kPressureDrops drops
  uint64_t pressure_until_ns_ = 0;
  uint64_t drops_ = 0;
};

}  // namespace cubetorchfs::prefetch
