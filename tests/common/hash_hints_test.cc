#include "common/hash_hints.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

namespace cubetorchfs {
namespace {

// Against std::unordered_map under a random mix of puts and conditional erases, with keys
// drawn from a small range so that probe runs are long, wrap around the table and are cut by
// erases (the backward shift must keep every remaining key reachable).
TEST(HashHintsTest, AgreesWithAnUnorderedMap) {
  std::mt19937_64 rng(5);
  HashHints hints;
  std::unordered_map<uint64_t, uint64_t> model;
  for (int step = 0; step < 200000; ++step) {
    const uint64_t key = 1 + rng() % 5000;  // 0 would share key 1's slot (FlatHashTable)
    const uint64_t value = 1 + rng() % 3;
    if (rng() % 3 == 0) {
      hints.EraseIf(key, value);
      auto it = model.find(key);
      if (it != model.end() && it->second == value) model.erase(it);
    } else {
      hints.Put(key, value);
      model[key] = value;
    }
    if (step % 997 == 0) {
      ASSERT_EQ(hints.size(), model.size()) << step;
      for (uint64_t k = 1; k <= 5000; ++k) {
        auto it = model.find(k);
        const std::optional<uint64_t> got = hints.Get(k);
        ASSERT_EQ(got.has_value(), it != model.end()) << "key " << k << " step " << step;
        if (got) {
          ASSERT_EQ(*got, it->second);
        }
      }
    }
  }
}

TEST(HashHintsTest, HoldsAMillionEntriesInSixteenBytesASlotAndShrinksWhenEmptied) {
  HashHints hints;
  for (uint64_t k = 1; k <= 1000000; ++k) hints.Put(k * 0x9E3779B97F4A7C15ull, k);
  EXPECT_EQ(hints.size(), 1000000u);
  EXPECT_LE(hints.capacity() * 16, 1000000u * 43);  // at most 3/4 full: <= 43 bytes an entry
  for (uint64_t k = 1; k <= 1000000; ++k) ASSERT_EQ(hints.Get(k * 0x9E3779B97F4A7C15ull), k);
  hints.EraseIf(0x9E3779B97F4A7C15ull, 2);  // not its value: stays
  EXPECT_EQ(hints.Get(0x9E3779B97F4A7C15ull), 1u);
  for (uint64_t k = 1; k <= 1000000; ++k) hints.EraseIf(k * 0x9E3779B97F4A7C15ull, k);
  EXPECT_EQ(hints.size(), 0u);
  EXPECT_LE(hints.capacity(), 2048u);
  hints.Put(7, 0);  // 0 is "no value": not stored
  EXPECT_EQ(hints.Get(7), std::nullopt);
}

}  // namespace
}  // namespace cubetorchfs
