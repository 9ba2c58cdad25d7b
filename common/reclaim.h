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
#include <string_view>

namespace cubetorchfs {

// The sum, from /proc/vmstat; nothing if it cannot be read.
std::optional<uint64_t> ReadReclaimCounter();

// The same from a /proc/vmstat text (for tests); nothing if it has no pgsteal_ line.
std::optional<uint64_t> ReclaimCounterOf(std::string_view vmstat);

}  // namespace cubetorchfs
