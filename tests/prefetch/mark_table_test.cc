#include "prefetch/mark_table.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

namespace cubetorchfs::prefetch {
namespace {

// Against std::unordered_map, through growth and many deletions, at loads up to 7/8 (long
// probe runs, some wrapping round the end of the array).
TEST(MarkTableTest, AgreesWithAMapThroughGrowthAndDeletes) {
  for (uint64_t spread : {uint64_t{1} << 40, uint64_t{1}}) {
    MarkTable t;
    std::unordered_map<uint64_t, uint64_t> ref;
    std::mt19937_64 rng(7);
    for (int step = 0; step < 200000; ++step) {
      const uint64_t key = (rng() % 5000 + 2) * spread;
      const int op = static_cast<int>(rng() % 3);
      if (op == 0) {
        t.Insert(key).seq = static_cast<uint64_t>(step);
        ref[key] = static_cast<uint64_t>(step);
      } else if (op == 1) {
        EXPECT_EQ(t.Erase(key), ref.erase(key) == 1) << step;
      } else {
        const MarkTable::Mark* m = t.Find(key);
        auto r = ref.find(key);
        ASSERT_EQ(m != nullptr, r != ref.end()) << step;
        if (m != nullptr) {
          EXPECT_EQ(m->seq, r->second);
        }
      }
      ASSERT_EQ(t.size(), ref.size());
    }
    for (const auto& [key, seq] : ref) {
      ASSERT_NE(t.Find(key), nullptr);
      EXPECT_EQ(t.Find(key)->seq, seq);
    }
  }
}

// Key 0 marks an empty slot: a path hashing to 0 shares the mark of key 1 (a collision, which
// marks tolerate), and is neither lost nor taken for an empty slot.
TEST(MarkTableTest, KeyZeroSharesKeyOnesMark) {
  MarkTable t;
  EXPECT_EQ(t.Find(0), nullptr);
  t.Insert(0).seq = 5;
  ASSERT_NE(t.Find(0), nullptr);
  EXPECT_EQ(t.Find(1), t.Find(0));
  EXPECT_EQ(t.size(), 1u);
  EXPECT_TRUE(t.Erase(1));
  EXPECT_EQ(t.Find(0), nullptr);
  EXPECT_FALSE(t.Erase(0));
}

TEST(MarkTableTest, StaysBetweenSevenSixteenthsAndSevenEighthsFull) {
  MarkTable t;
  for (uint64_t k = 1; k <= 1000000; ++k) {
    t.Insert(k * 0x9e3779b97f4a7c15ull);
    const double slots = static_cast<double>(t.Bytes()) / 24;
    ASSERT_LE(static_cast<double>(t.size()), slots * 7 / 8) << k;
    if (slots > 1024) {
      ASSERT_GE(static_cast<double>(t.size()), slots * 7 / 16 - 1) << k;
    }
  }
  t.Clear();
  EXPECT_EQ(t.size(), 0u);
  EXPECT_EQ(t.Bytes(), 0u);
  EXPECT_EQ(t.Find(1), nullptr);
}

TEST(MarkTableTest, VersionDigestTellsVersionsApart) {
  cfs_client::FileVersion a{100, 5, 9, 6};
  cfs_client::FileVersion b = a;
  EXPECT_EQ(MarkTable::VersionDigest(a), MarkTable::VersionDigest(b));
  for (int field = 0; field < 4; ++field) {
    b = a;
    if (field == 0) b.size++;
    if (field == 1) b.mtime_ns++;
    if (field == 2) b.id++;
    if (field == 3) b.ctime_ns++;
    EXPECT_NE(MarkTable::VersionDigest(a), MarkTable::VersionDigest(b)) << field;
  }
}

}  // namespace
}  // namespace cubetorchfs::prefetch
