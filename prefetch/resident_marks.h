// The prefetcher's residency part: which files the kernel was served whole (or was given) and
// may still hold in its page cache, whether that can be believed without asking the kernel,
// and whether the kernel is dropping such pages often (page pressure). docs/prefetch.md says
// what each means for a user.
//
// A mark is 8 bytes kept with the file's inode in the mount's inode table (fs::InodeTable
// SetMark, through AttrSource), not in a table of its own: it costs no memory past the inode
// record the kernel's reference needs anyway, and it goes when the kernel forgets the inode,
// as the kernel's pages of the file do. So no bound and no age order is needed. What a mark
// holds (Mark::Pack): a 32-bit digest of the file version the kernel was given (a false match
// would only pass over a file whose reader then reads it from the daemon: the kernel checks
// the file by its attributes; the daemon serves no byte by the mark), a 31-bit sequence
// number of marks made, and whether a probe of it is running.
//
// Trust: a mark made while the kernel's count of reclaimed page-cache pages has not moved
// since is trusted (the file is passed over with no probe). The counter is read at most every
// kReclaimSampleNs. Sequence numbers compare modulo 2^31: a mark made more than 2^30 marks
// ago may be taken as newer than it is (trusted, or not probed again), which costs a read
// from the daemon if its pages went, never a wrong byte.
//
// What the prefetcher does with a mark (residency.cc): a file marked at the version of the
// daemon's fresh attributes is passed over as a stream reaches it. If its mark is trusted and
// page cache is dropped unseen (restore_needed: DAMON pageout), it is put back into the page
// cache from RAM or the NVMe tier; an untrusted mark is probed (FUSE_NOTIFY_RETRIEVE), and probed
// again as the readers come near. Under page pressure (the kernel keeps dropping files passed
// over before their readers reach them), a file passed over near the readers goes to the LRU
// cache instead, if the kernel no longer holds it and neither RAM nor NVMe does.
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

namespace cubetorchfs::prefetch {

class ResidentMarks {
 public:
  struct Mark {
    uint32_t version = 0;  // VersionTag of the version the kernel was given
    uint32_t seq = 0;      // 31 bits, from 1
    bool probing = false;  // a probe of it is running
    // 0 is no mark; a mark packs to non-zero (seq >= 1).
    uint64_t Pack() const {
      return uint64_t{version} | uint64_t{seq & kSeqMask} << 32 | uint64_t{probing} << 63;
    }
    static std::optional<Mark> Unpack(uint64_t packed);
    // A mark an earlier process of the mount made (its inode records outlived it,
    // fs::InodeTable::AdoptDurable): no probe of it runs any more, and it is older than any
    // mark this process makes, so it is probed before it is believed. 0 stays 0.
    static uint64_t OfEarlierProcess(uint64_t packed);
  };
  // A 64-bit digest of a file version.
  static uint64_t VersionDigest(const cfs_client::FileVersion& v);
  // The 32 bits of it a mark keeps.
  static uint32_t VersionTag(const cfs_client::FileVersion& v) {
    return static_cast<uint32_t>(VersionDigest(v) >> 32);
  }
  struct Options {
    bool enabled = true;  // false: nothing is ever marked
    // The kernel's count of reclaimed page-cache pages, or nothing if it cannot tell. Unset:
    // no mark is trusted.
    std::function<std::optional<uint64_t>()> reclaim_counter;
  };
  explicit ResidentMarks(Options options) : options_(std::move(options)) {}

  bool enabled() const { return options_.enabled; }
  // A new mark: the kernel holds all of a file at `version` now.
  Mark Make(const cfs_client::FileVersion& version, uint64_t now);
  // True if `mark` may be believed with no probe: no reclaim seen since it was made.
  bool Trusted(const Mark& mark, uint64_t now);
  // True if mark `a` was made after mark `b`.
  static bool Newer(const Mark& a, const Mark& b) { return SeqAfter(a.seq, b.seq); }

  // A read of a marked file reached the daemon: the kernel dropped its pages. `ahead`: a
  // stream had passed over the file as held there, its readers yet to reach it. Four such
  // drops within 10 s are page pressure, held 60 s past the last; true if it begins now. A
  // drop of a file no stream passed over (read outside the streams, or while in the window)
  // is counted, and says nothing of what the streams pass over.
  bool NoteDrop(uint64_t now, bool ahead);
  bool Pressure(uint64_t now) const { return now < pressure_until_ns_; }

  uint64_t drops() const { return drops_; }

 private:
  static constexpr uint32_t kSeqMask = 0x7FFFFFFFu;
  static bool SeqAfter(uint32_t a, uint32_t b) {
    return a != b && ((a - b) & kSeqMask) < (uint32_t{1} << 30);
  }
  void SampleReclaim(uint64_t now);

  static constexpr uint64_t kReclaimSampleNs = 50'000'000;
  static constexpr size_t kPressureDrops = 4;
  static constexpr uint64_t kPressureSpanNs = 10'000'000'000;
  static constexpr uint64_t kPressureHoldNs = 60'000'000'000;

  const Options options_;
  uint32_t next_seq_ = 1;  // of the next mark; never 0
  // Marks from this sequence number on were made after the last reclaim seen: trusted.
  std::optional<uint32_t> trust_from_;  // nothing trusted until a first sample
  std::optional<uint64_t> last_reclaim_;
  uint64_t reclaim_sampled_ns_ = 0;
  bool reclaim_sampled_ = false;
  std::deque<uint64_t> drop_times_;  // the last kPressureDrops drops ahead
  uint64_t pressure_until_ns_ = 0;
  uint64_t drops_ = 0;
};

}  // namespace cubetorchfs::prefetch
