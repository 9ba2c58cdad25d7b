#include "common/reclaim.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace cubetorchfs {
namespace {

TEST(ReclaimTest, SumsThePagesTheKernelTookBack) {
  const char* vmstat =
      "nr_free_pages 100\n"
      "pgsteal_kswapd 10\n"
      "pgsteal_direct 5\n"
      "pgsteal_khugepaged 2\n"
      "pgscan_kswapd 999\n"
      "pginodesteal 1\n"
      "kswapd_inodesteal 2\n"
      "drop_pagecache 3\n"
      "drop_slab 4\n";
  EXPECT_EQ(ReclaimCounterOf(vmstat), 27u);
  EXPECT_FALSE(ReclaimCounterOf("nr_free_pages 1\n").has_value());
  EXPECT_FALSE(ReclaimCounterOf("").has_value());
}

// Where /proc/vmstat has the counter (Linux with procfs), it is read; a sandbox that hides it
// gets nothing, and the prefetcher then probes every mark.
TEST(ReclaimTest, ReadsThisKernelsCounterWhereItHasOne) {
  std::FILE* f = std::fopen("/proc/vmstat", "r");
  if (f == nullptr) GTEST_SKIP() << "no /proc/vmstat here";
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  std::fclose(f);
  EXPECT_EQ(ReadReclaimCounter().has_value(), ReclaimCounterOf(text).has_value());
}

}  // namespace
}  // namespace cubetorchfs
