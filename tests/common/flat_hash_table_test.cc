#include "common/flat_hash_table.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

#include "prefetch/resident_marks.h"

namespace cubetorchfs {
namespace {

struct Value {
  uint64_t a = 0, b = 0;
};

// Against std::unordered_map, through growth, shrinking and many deletions, at loads up to
// 3/4 (long probe runs, some wrapping round the end of the array), with widely spread keys
// and with consecutive ones.
TEST(FlatHashTableTest, AgreesWithAMapThroughGrowthAndDeletes) {
  for (uint64_t spread : {uint64_t{1} << 40, uint64_t{1}}) {
    FlatHashTable<Value> t;
    std::unordered_map<uint64_t, uint64_t> ref;
    std::mt19937_64 rng(7);
    for (int step = 0; step < 200000; ++step) {
      const uint64_t key = (rng() % 5000 + 2) * spread;  // 0 and 1 share a slot: not here
      const int op = static_cast<int>(rng() % 3);
      if (op == 0) {
        t.Insert(key).a = static_cast<uint64_t>(step);
        ref[key] = static_cast<uint64_t>(step);
      } else if (op == 1) {
        EXPECT_EQ(t.Erase(key), ref.erase(key) == 1) << step;
      } else {
        const Value* v = t.Find(key);
        auto r = ref.find(key);
        ASSERT_EQ(v != nullptr, r != ref.end()) << step;
        if (v != nullptr) {
          EXPECT_EQ(v->a, r->second);
        }
      }
      ASSERT_EQ(t.size(), ref.size());
    }
    for (const auto& [key, a] : ref) {
      ASSERT_NE(t.Find(key), nullptr);
      EXPECT_EQ(t.Find(key)->a, a);
    }
  }
}

// Key 0 marks an empty slot: a key of 0 shares key 1's slot, and is neither lost nor taken
// for an empty slot.
TEST(FlatHashTableTest, KeyZeroSharesKeyOnesSlot) {
  FlatHashTable<Value> t;
  EXPECT_EQ(t.Find(0), nullptr);
  t.Insert(0).a = 5;
  ASSERT_NE(t.Find(0), nullptr);
  EXPECT_EQ(t.Find(1), t.Find(0));
  EXPECT_EQ(t.size(), 1u);
  EXPECT_TRUE(t.Erase(1));
  EXPECT_EQ(t.Find(0), nullptr);
  EXPECT_FALSE(t.Erase(0));
}

TEST(FlatHashTableTest, StaysBetweenAQuarterAndThreeQuartersFullAndShrinks) {
  FlatHashTable<Value> t;
  constexpr uint64_t kN = 1000000;
  for (uint64_t k = 1; k <= kN; ++k) {
    t.Insert(k * 0x9e3779b97f4a7c15ull);
    ASSERT_LE(4 * t.size(), 3 * t.capacity()) << k;
  }
  EXPECT_EQ(t.Bytes(), t.capacity() * 24);            // (key, 16-byte value) slots
  EXPECT_GE(4 * t.size() + 4, t.capacity() * 3 / 2);  // over 3/8 full after the last growth
  EXPECT_FALSE(t.EraseIf(0x9e3779b97f4a7c15ull, [](const Value& v) { return v.a == 1; }));
  for (uint64_t k = 1; k <= kN; ++k) ASSERT_TRUE(t.Erase(k * 0x9e3779b97f4a7c15ull)) << k;
  EXPECT_EQ(t.size(), 0u);
  EXPECT_LE(t.capacity(), 2048u);
  t.Clear();
  EXPECT_EQ(t.Bytes(), 0u);
  EXPECT_EQ(t.Find(1), nullptr);
}

TEST(ResidentMarksTest, VersionDigestTellsVersionsApart) {
  using prefetch::ResidentMarks;
  cfs_client::FileVersion a{100, 5, 9, 6};
  cfs_client::FileVersion b = a;
  EXPECT_EQ(ResidentMarks::VersionDigest(a), ResidentMarks::VersionDigest(b));
  for (int field = 0; field < 4; ++field) {
    b = a;
    if (field == 0) b.size++;
    if (field == 1) b.mtime_ns++;
    if (field == 2) b.id++;
    if (field == 3) b.ctime_ns++;
    EXPECT_NE(ResidentMarks::VersionDigest(a), ResidentMarks::VersionDigest(b)) << field;
  }
}

}  // namespace
}  // namespace cubetorchfs
