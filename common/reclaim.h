// The kernel's count of page-cache pages it has taken back: every page reclaimed under memory
// pressure (kswapd, direct reclaim, khugepaged, a memory cgroup's limit, proactive reclaim:
// /proc/vmstat's pgsteal_* lines), the pages of inodes evicted to make room (pginodesteal,
// kswapd_inodesteal), plus every `drop_caches` (drop_pagecache, drop_slab). While it has not moved,
// no page the kernel was served has gone by reclaim.
//
// Thread safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace cubetorchfs {

// The sum, from /proc/vmstat; nothing if it cannot be read.
std::optional<uint64_t> ReadReclaimCounter();

// The same from a /proc/vmstat text (for tests); nothing if it has no pgsteal_ line.
std::optional<uint64_t> ReclaimCounterOf(std::string_view vmstat);

// Whether DAMON pages out memory by access pattern here: a kdamond that is on with a
// `pageout` scheme (sysfs, under `damon_root`), or the DAMON_RECLAIM module enabled
// (`reclaim_enabled`: its parameter file). Such reclaim drops page-cache pages it finds
// unused, without /proc/vmstat's pgsteal counting them (seen on 6.18 with a 60 s scheme), so
// the counter above cannot vouch for pages kept across epochs.
bool ProactivePageoutActive(
    const std::string& damon_root = "/sys/kernel/mm/damon/admin/kdamonds",
    const std::string& reclaim_enabled = "/sys/module/damon_reclaim/parameters/enabled");

}  // namespace cubetorchfs
