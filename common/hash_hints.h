// A compact map from 64-bit hashes to nonzero 64-bit values, for an index that is only a hint
// (its user checks what a value names): a FlatHashTable of 16-byte slots, at most 3/4 full (at
// least 1/4 once it has shrunk), so from 21 bytes an entry: a std::unordered_map<uint64_t,
// uint64_t> took 64 (node, bucket, malloc).
//
// Not thread-safe: its owner's lock guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "common/flat_hash_table.h"

namespace cubetorchfs {

class HashHints {
 public:
  // The value under `key`, if any.
  std::optional<uint64_t> Get(uint64_t key) const {
    const uint64_t* v = table_.Find(key);
    if (v == nullptr) return std::nullopt;
    return *v;
  }
  // Maps `key` to `value` (nonzero), replacing what it mapped to.
  void Put(uint64_t key, uint64_t value) {
    if (value != 0) table_.Insert(key) = value;
  }
  // Removes `key` if it maps to `value`.
  void EraseIf(uint64_t key, uint64_t value) {
    table_.EraseIf(key, [value](uint64_t v) { return v == value; });
  }

  size_t size() const { return table_.size(); }
  size_t capacity() const { return table_.capacity(); }
  void Reserve(size_t n) { table_.Reserve(n); }

 private:
  FlatHashTable<uint64_t> table_;
};

}  // namespace cubetorchfs
