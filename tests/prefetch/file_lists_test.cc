#include "prefetch/file_lists.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/test_util.h"

namespace cubetorchfs::prefetch {
namespace {

using Op = FileLists::Op;
using testing::FakeClock;

TEST(FileLists, NumbersEntriesAndKeepsRefusedOnesInPlace) {
  FakeClock clock;
  FileLists lists({}, &clock);
  const std::string id = lists.Create(1000);
  ASSERT_FALSE(id.empty());
  uint64_t first = 9, size = 9;
  std::string why;
  ASSERT_EQ(lists.Append(1000, id, {"a/1.jpg", "", "b/2.jpg"}, &first, &size, &why), Op::kOk);
  EXPECT_EQ(first, 0u);
  EXPECT_EQ(size, 3u);
  ASSERT_EQ(lists.Append(1000, id, {"c/3.jpg"}, &first, &size, &why), Op::kOk);
  EXPECT_EQ(first, 3u);
  std::vector<std::string> out;
  uint64_t refused = 0;
  const std::vector<uint32_t> positions = {3, 1, 0, 2, 0};
  ASSERT_EQ(lists.Paths(1000, id, positions, &out, &refused, &size), Op::kOk);
  EXPECT_EQ(out, (std::vector<std::string>{"c/3.jpg", "a/1.jpg", "b/2.jpg", "a/1.jpg"}));
  EXPECT_EQ(refused, 1u);
  // Past the end: nothing appended.
  out.clear();
  const std::vector<uint32_t> bad = {0, 4};
  EXPECT_EQ(lists.Paths(1000, id, bad, &out, &refused, &size), Op::kRange);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(size, 4u);
  // Another user may not use it; root may.
  EXPECT_EQ(lists.Paths(1001, id, positions, &out, &refused, &size), Op::kForbidden);
  EXPECT_EQ(lists.Paths(0, id, positions, &out, &refused, &size), Op::kOk);
  EXPECT_EQ(lists.Delete(1001, id), Op::kForbidden);
  EXPECT_EQ(lists.Delete(1000, id), Op::kOk);
  EXPECT_EQ(lists.Paths(1000, id, positions, &out, &refused, &size), Op::kNotFound);
  EXPECT_EQ(lists.GetStats().lists, 0u);
  EXPECT_EQ(lists.GetStats().bytes, 0u);
}

TEST(FileLists, BytesChargedAreTheCapacityHeldAndBounded) {
  FakeClock clock;
  FileLists::Options o;
  o.max_bytes_per_uid = 1 << 20;
  o.max_bytes = 1536 << 10;
  FileLists lists(o, &clock);
  const std::string path(60, 'p');
  std::vector<std::string> batch(1000, path);
  const std::string a = lists.Create(1);
  uint64_t first = 0, size = 0;
  std::string why;
  Op op = Op::kOk;
  int appended = 0;
  while ((op = lists.Append(1, a, batch, &first, &size, &why)) == Op::kOk) ++appended;
  EXPECT_EQ(op, Op::kFull);
  EXPECT_NE(why.find("prefetch.max_list_bytes_per_uid"), std::string::npos) << why;
  const FileLists::Stats st = lists.GetStats(1);
  EXPECT_LE(st.bytes, o.max_bytes_per_uid);
  // The charge covers what is really held: 60 bytes and a 4-byte offset an entry at least.
  EXPECT_GE(st.bytes, st.entries * 64);
  EXPECT_GE(appended, 8);  // growth by half, not doubling: most of the limit is usable
  // A second user finds the rest of the global bytes, then the global limit.
  const std::string b = lists.Create(2);
  while ((op = lists.Append(2, b, batch, &first, &size, &why)) == Op::kOk) {
  }
  EXPECT_EQ(op, Op::kFull);
  EXPECT_NE(why.find("prefetch.max_list_bytes ("), std::string::npos) << why;
  EXPECT_LE(lists.GetStats().bytes, o.max_bytes);
  // User 1's own limits evict its least recently used other list, never user 2's.
  const std::string c = lists.Create(1);
  EXPECT_EQ(lists.Append(1, c, batch, &first, &size, &why), Op::kOk) << why;
  std::vector<std::string> out;
  uint64_t refused = 0;
  const std::vector<uint32_t> zero = {0};
  EXPECT_EQ(lists.Paths(1, a, zero, &out, &refused, &size), Op::kNotFound);
  EXPECT_EQ(lists.Paths(2, b, zero, &out, &refused, &size), Op::kOk);
}

TEST(FileLists, IdleListsExpireAndUseKeepsThemAlive) {
  FakeClock clock;
  FileLists::Options o;
  o.idle_s = 60;
  FileLists lists(o, &clock);
  const std::string used = lists.Create(1), idle = lists.Create(1);
  std::vector<std::string> out;
  uint64_t refused = 0, size = 0;
  for (int i = 0; i < 3; ++i) {
    clock.AdvanceSeconds(30);
    ASSERT_EQ(lists.Paths(1, used, {}, &out, &refused, &size), Op::kOk);
  }
  lists.Sweep();
  EXPECT_EQ(lists.Paths(1, idle, {}, &out, &refused, &size), Op::kNotFound);
  EXPECT_EQ(lists.Paths(1, used, {}, &out, &refused, &size), Op::kOk);
}

}  // namespace
}  // namespace cubetorchfs::prefetch
