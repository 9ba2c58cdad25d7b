#include "common/reclaim.h"

#include <gtest/gtest.h>

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
  EXPECT_EQ(ReclaimCounterOf(vmstat), 23u);
  EXPECT_FALSE(ReclaimCounterOf("nr_free_pages 1\n").has_value());
  EXPECT_FALSE(ReclaimCounterOf("").has_value());
}

TEST(ReclaimTest, ThisKernelHasTheCounter) {
  std::optional<uint64_t> c = ReadReclaimCounter();
  ASSERT_TRUE(c.has_value()) << "/proc/vmstat has no pgsteal_ line";
}

}  // namespace
}  // namespace cubetorchfs
