// What the prefetcher counts (Prefetcher::GetStats): reads by outcome, what its fetches and
// residency checks did, and what the window and the queued positions hold now. Each FUSE read
// of a regular file is a hit (no wait), late (waited on a fetch in flight) or miss (fetched on
// demand); a position the readers passed while the kernel held the file whole is a hit read
// from the page cache. docs/metrics.md says what each counter means for a user.
#pragma once

#include <cstdint>
#include <vector>

#include "prefetch/stream.h"

namespace cubetorchfs::prefetch {

struct Stats {
  ReadCounts reads;  // every FUSE read of a regular file
  uint64_t fetched = 0, failed = 0, evicted_unread = 0;
  uint64_t preempted = 0;       // unread files given up so another user got its share
  uint64_t denied = 0;          // files the stream's owner may not read: not fetched
  uint64_t page_resident = 0;   // probes that found the file whole in the kernel's page cache
  uint64_t trusted = 0;         // marked files passed over with no probe: no reclaim since
  uint64_t probed_absent = 0;   // probes of marked files whose pages were gone: fetched
  uint64_t page_drops = 0;      // reads of marked files: the kernel dropped their pages
  bool page_pressure = false;   // drops of files passed over come often: see lru_filled
  uint64_t lru_filled = 0;      // files passed over, dropped, put in the LRU cache (pressure)
  uint64_t stored = 0;          // files put into the kernel's page cache once fetched
  uint64_t restored = 0;        // files passed over put back into the page cache from RAM or NVMe
  uint64_t cached = 0;          // files taken from the RAM cache or NVMe tier, no store request
  uint64_t resident_marks = 0;  // files now marked page-resident
  uint64_t inflight = 0;        // fetches running now
  uint64_t window_files = 0;    // entries in the window (fetching or ready)
  uint64_t window_bytes = 0;    // bytes reserved by them
  uint64_t window_budget_bytes = 0;
  uint64_t queued_paths = 0;  // positions not yet read or skipped, all streams
  uint64_t queued_bytes = 0;  // the memory they hold
  uint64_t queued_users = 0;  // users with positions queued
  // Data reads the prefetcher asked of the store (requests; a large file's chunks are one each),
  // by why. No other part of it reads the store: probes, restores and pass-overs never do.
  struct StoreReads {
    uint64_t window = 0;    // a stream's file fetched into the window: not known to be held
    uint64_t lru_fill = 0;  // a file passed over, dropped by the kernel, read into the LRU
  } store_reads;
  std::vector<StreamStats> streams;
};

}  // namespace cubetorchfs::prefetch
