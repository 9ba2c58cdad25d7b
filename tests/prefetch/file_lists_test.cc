#include "prefetch/file_lists.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
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
  o.max_bytes = 2 << 20;  // alone, a user's share (half) is its own limit
  FileLists lists(o, &clock);
  // Distinct paths that share no prefix: front coding saves nothing on them.
  std::mt19937_64 rng(7);
  std::vector<std::string> batch(1000);
  for (std::string& path : batch)
    for (int i = 0; i < 60; ++i) path.push_back(static_cast<char>('a' + rng() % 26));
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
  // The charge covers what is really held: 60 bytes and two varints an entry at least.
  EXPECT_GE(st.bytes, st.entries * 62);
  EXPECT_GE(appended, 8);  // growth by an eighth, not doubling: most of the limit is usable
  // A second user finds its share of the global bytes (a third of them, with two holding).
  const std::string b = lists.Create(2);
  while ((op = lists.Append(2, b, batch, &first, &size, &why)) == Op::kOk) {
  }
  EXPECT_EQ(op, Op::kFull);
  EXPECT_NE(why.find("fair share"), std::string::npos) << why;
  EXPECT_LE(lists.GetStats(2).bytes, o.max_bytes / 3);
  EXPECT_GE(lists.GetStats(2).bytes, o.max_bytes / 3 - 64 * 1024);
  // A third one finds what is left (at least a sixth of them), then the global limit.
  const std::string t = lists.Create(3);
  while ((op = lists.Append(3, t, batch, &first, &size, &why)) == Op::kOk) {
  }
  EXPECT_EQ(op, Op::kFull);
  EXPECT_NE(why.find("prefetch.max_list_bytes ("), std::string::npos) << why;
  EXPECT_GE(lists.GetStats(3).bytes, o.max_bytes / 6 - 64 * 1024);
  EXPECT_LE(lists.GetStats().bytes, o.max_bytes);
  EXPECT_EQ(lists.Delete(3, t), Op::kOk);
  // User 1's own limits evict its least recently used other list, never user 2's.
  const std::string c = lists.Create(1);
  EXPECT_EQ(lists.Append(1, c, batch, &first, &size, &why), Op::kOk) << why;
  std::vector<std::string> out;
  uint64_t refused = 0;
  const std::vector<uint32_t> zero = {0};
  EXPECT_EQ(lists.Paths(1, a, zero, &out, &refused, &size), Op::kNotFound);
  EXPECT_EQ(lists.Paths(2, b, zero, &out, &refused, &size), Op::kOk);
}

TEST(FileLists, TwoUsersFullOfListsLeaveANewcomerItsShare) {
  // The fourth security pass: two users holding all of their own limits left a third nothing.
  FakeClock clock;
  FileLists::Options o;
  o.max_bytes_per_uid = 1 << 20;
  o.max_bytes = 2 << 20;
  FileLists lists(o, &clock);
  std::mt19937_64 rng(11);
  std::vector<std::string> batch(500);
  for (std::string& path : batch)
    for (int i = 0; i < 60; ++i) path.push_back(static_cast<char>('a' + rng() % 26));
  uint64_t first = 0, size = 0;
  std::string why;
  for (uid_t uid : {1u, 2u}) {
    // Each in several lists: a user over its share loses its own older lists, not the limit.
    for (int l = 0; l < 3; ++l) {
      const std::string id = lists.Create(uid);
      while (lists.Append(uid, id, batch, &first, &size, &why) == Op::kOk) {
      }
    }
  }
  EXPECT_LE(lists.GetStats(1).bytes + lists.GetStats(2).bytes, o.max_bytes / 2 + o.max_bytes / 3);
  // The newcomer registers a sixth of the pool, less the rounding of its own charge.
  const std::string id = lists.Create(3);
  uint64_t entries = 0;
  while (lists.GetStats(3).bytes + 64 * 1024 < o.max_bytes / 6) {
    ASSERT_EQ(lists.Append(3, id, batch, &first, &size, &why), Op::kOk)
        << why << " after " << entries << " entries";
    entries += batch.size();
  }
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

// Entries come back exactly, whatever block they fall in, appended in pieces of any size and
// with refused (empty) entries and entries sharing nothing between them.
TEST(FileLists, FrontCodedEntriesComeBackExactly) {
  FakeClock clock;
  FileLists lists({}, &clock);
  const std::string id = lists.Create(1);
  std::vector<std::string> all;
  std::mt19937_64 rng(11);
  for (int i = 0; i < 1000; ++i) {
    if (i % 97 == 5) {
      all.push_back("");  // refused at registration
    } else if (i % 13 == 0) {
      all.push_back("other/" + std::to_string(rng()));
    } else {
      all.push_back("train/n" + std::to_string(1000 + i / 50) + "/img_" + std::to_string(i) +
                    (i % 3 ? ".JPEG" : ".jpeg"));
    }
  }
  all.push_back(std::string(300, 'x') + "/long");  // a length past one varint byte
  all.push_back(std::string(300, 'x') + "/longer");
  uint64_t first = 0, size = 0;
  std::string why;
  for (size_t at = 0; at < all.size();) {
    const size_t n = std::min<size_t>(all.size() - at, 1 + rng() % 40);
    std::vector<std::string> piece(all.begin() + static_cast<long>(at),
                                   all.begin() + static_cast<long>(at + n));
    ASSERT_EQ(lists.Append(1, id, piece, &first, &size, &why), Op::kOk) << why;
    EXPECT_EQ(first, at);
    at += n;
  }
  EXPECT_EQ(size, all.size());
  std::vector<uint32_t> positions(all.size());
  for (uint32_t i = 0; i < positions.size(); ++i) positions[i] = i;
  std::shuffle(positions.begin(), positions.end(), rng);
  std::vector<std::string> out;
  uint64_t refused = 0;
  ASSERT_EQ(lists.Paths(1, id, positions, &out, &refused, &size), Op::kOk);
  std::vector<std::string> expected;
  uint64_t expected_refused = 0;
  for (uint32_t p : positions) {
    if (all[p].empty())
      ++expected_refused;
    else
      expected.push_back(all[p]);
  }
  EXPECT_EQ(out, expected);
  EXPECT_EQ(refused, expected_refused);
}

// What a registered path costs, all of the list's memory counted (its capacity): ImageNet's
// 1,281,167 training paths as ImageFolder lists them (sorted), and COCO's 118,287. The target
// is 24 bytes a path (docs/memory.md).
TEST(FileLists, ADatasetsPathsCostBytesNotTheirLength) {
  auto bytes_per_path = [](const std::vector<std::string>& paths, uint64_t* path_bytes) {
    FakeClock clock;
    FileLists::Options o;
    o.max_bytes_per_uid = o.max_bytes = 1ull << 30;
    FileLists lists(o, &clock);
    const std::string id = lists.Create(1);
    uint64_t first = 0, size = 0;
    std::string why;
    *path_bytes = 0;
    for (size_t at = 0; at < paths.size(); at += 10000) {  // as the hook sends them
      std::vector<std::string> piece(
          paths.begin() + static_cast<long>(at),
          paths.begin() + static_cast<long>(std::min(paths.size(), at + 10000)));
      for (const std::string& p : piece) *path_bytes += p.size();
      EXPECT_EQ(lists.Append(1, id, piece, &first, &size, &why), Op::kOk) << why;
    }
    // Resolving an epoch's positions (shuffled) decodes at most a block a position.
    std::vector<uint32_t> positions(paths.size());
    for (uint32_t i = 0; i < positions.size(); ++i) positions[i] = i;
    std::shuffle(positions.begin(), positions.end(), std::mt19937_64(5));
    std::vector<std::string> out;
    uint64_t refused = 0;
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(lists.Paths(1, id, positions, &out, &refused, &size), Op::kOk);
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    std::printf("  resolved %zu shuffled positions: %.0f ns each\n", positions.size(),
                ns / static_cast<double>(positions.size()));
    EXPECT_EQ(out.size(), paths.size());
    for (size_t i = 0; i < out.size(); i += 997) EXPECT_EQ(out[i], paths[positions[i]]);
    return static_cast<double>(lists.GetStats().bytes) / static_cast<double>(paths.size());
  };
  // ImageNet: 1,000 classes (n01440764 ...), 1,281,167 files named <class>_<number>.JPEG.
  std::vector<std::string> imagenet;
  std::mt19937_64 rng(3);
  for (int c = 0; c < 1000 && imagenet.size() < 1281167; ++c) {
    char cls[16];
    std::snprintf(cls, sizeof(cls), "n%08d", 1440764 + c * 9973);
    std::vector<uint64_t> numbers;
    const int files = c < 167 ? 1282 : 1281;
    for (int i = 0; i < files; ++i) numbers.push_back(rng() % 60000);
    std::vector<std::string> names;
    for (uint64_t n : numbers)
      names.push_back("/data/imagenet/train/" + std::string(cls) + "/" + cls + "_" +
                      std::to_string(n) + ".JPEG");
    std::sort(names.begin(), names.end());
    imagenet.insert(imagenet.end(), names.begin(), names.end());
  }
  // COCO train2017: 12-digit zero-padded image ids, sorted.
  std::vector<std::string> coco;
  uint64_t id = 9;
  for (int i = 0; i < 118287; ++i) {
    id += 1 + rng() % 9;
    char name[64];
    std::snprintf(name, sizeof(name), "/data/coco/train2017/%012llu.jpg",
                  static_cast<unsigned long long>(id));
    coco.push_back(name);
  }
  uint64_t imagenet_bytes = 0, coco_bytes = 0;
  const double in = bytes_per_path(imagenet, &imagenet_bytes);
  const double co = bytes_per_path(coco, &coco_bytes);
  std::printf("  ImageNet-like: %zu paths of %.1f bytes: %.1f bytes each held\n", imagenet.size(),
              static_cast<double>(imagenet_bytes) / static_cast<double>(imagenet.size()), in);
  std::printf("  COCO-like: %zu paths of %.1f bytes: %.1f bytes each held\n", coco.size(),
              static_cast<double>(coco_bytes) / static_cast<double>(coco.size()), co);
  // The target is 24; 9.2 and 7.7 are measured (a list that grows by doubling, as a
  // std::string does, held 16.6 and 9.4).
  EXPECT_LE(in, 12.0);
  EXPECT_LE(co, 12.0);
}

}  // namespace
}  // namespace cubetorchfs::prefetch
