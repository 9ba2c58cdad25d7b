#include "common/reclaim.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <filesystem>
#include <fstream>

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

// DAMON's sysfs, as the kernel lays it out, in a temporary directory.
class PageoutTest : public ::testing::Test {
 protected:
  PageoutTest() {
    char tmpl[] = "/tmp/ctfs-damon.XXXXXX";
    root_ = ::mkdtemp(tmpl);
  }
  ~PageoutTest() override { std::filesystem::remove_all(root_); }
  void Put(const std::string& rel, const std::string& text) {
    const std::filesystem::path p = root_ / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  bool Active() {
    return ProactivePageoutActive((root_ / "kdamonds").string(), (root_ / "enabled").string());
  }
  std::filesystem::path root_;
};

TEST_F(PageoutTest, APageoutSchemeOfARunningKdamondCounts) {
  EXPECT_FALSE(Active());  // no DAMON at all
  Put("kdamonds/nr_kdamonds", "2");
  Put("kdamonds/0/state", "off");
  Put("kdamonds/0/contexts/nr_contexts", "1");
  Put("kdamonds/0/contexts/0/schemes/nr_schemes", "1");
  Put("kdamonds/0/contexts/0/schemes/0/action", "pageout");
  EXPECT_FALSE(Active());  // off
  Put("kdamonds/1/state", "on");
  Put("kdamonds/1/contexts/nr_contexts", "1");
  Put("kdamonds/1/contexts/0/schemes/nr_schemes", "2");
  Put("kdamonds/1/contexts/0/schemes/0/action", "stat");
  Put("kdamonds/1/contexts/0/schemes/1/action", "lru_prio");
  EXPECT_FALSE(Active());  // on, but nothing paged out
  Put("kdamonds/1/contexts/0/schemes/1/action", "pageout");
  EXPECT_TRUE(Active());
}

TEST_F(PageoutTest, TheDamonReclaimModuleCounts) {
  Put("enabled", "N");
  EXPECT_FALSE(Active());
  Put("enabled", "Y");
  EXPECT_TRUE(Active());
}

}  // namespace
}  // namespace cubetorchfs
