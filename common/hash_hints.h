// A compact map from 64-bit hashes to nonzero 64-bit values, for an index that is only a hint
// (its user checks what a value names). Open addressing with linear probing and backward-shift
// deletion: 16 bytes a slot, at most 3/4 full (at least 1/4 once it has shrunk), so from 21
// bytes an entry: a std::unordered_map<uint64_t, uint64_t> took 64 (node, bucket, malloc).
//
// Not thread-safe: its owner's lock guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace cubetorchfs {

class HashHints {
 public:
  // The value under `key`, if any.
  std::optional<uint64_t> Get(uint64_t key) const {
    if (slots_.empty()) return std::nullopt;
    for (size_t i = Home(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.value == 0) return std::nullopt;
      if (s.key == key) return s.value;
    }
  }

  // Maps `key` to `value` (nonzero), replacing what it mapped to.
  void Put(uint64_t key, uint64_t value) {
    if (value == 0) return;
    if (4 * (used_ + 1) > 3 * slots_.size()) Resize(slots_.empty() ? 16 : 2 * slots_.size());
    for (size_t i = Home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.value == 0) {
        s = Slot{key, value};
        ++used_;
        return;
      }
      if (s.key == key) {
        s.value = value;
        return;
      }
    }
  }

  // Removes `key` if it maps to `value`.
  void EraseIf(uint64_t key, uint64_t value) {
    if (slots_.empty()) return;
    size_t i = Home(key);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].value == 0) return;
      if (slots_[i].key == key) break;
    }
    if (slots_[i].value != value) return;
    // Backward shift: entries after the hole whose home is not between the hole and them move
    // into it, so no probe sequence is broken and no tombstone is left.
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (slots_[j].value == 0) break;
      const size_t home = Home(slots_[j].key);
      const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = Slot{};
    --used_;
    if (slots_.size() > 1024 && 4 * used_ < slots_.size()) Resize(slots_.size() / 2);
  }

  size_t size() const { return used_; }
  size_t capacity() const { return slots_.size(); }
  void Reserve(size_t n) {
    size_t cap = 16;
    while (3 * cap < 4 * n) cap *= 2;
    if (cap > slots_.size()) Resize(cap);
  }

 private:
  struct Slot {
    uint64_t key = 0;
    uint64_t value = 0;  // 0: empty
  };

  size_t Home(uint64_t key) const {
    // Keys are hashes already; mixing guards against a weak one (std::hash of an integer).
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return static_cast<size_t>(key) & mask_;
  }

  void Resize(size_t capacity) {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(capacity, Slot{});
    slots_.shrink_to_fit();
    mask_ = capacity - 1;
    used_ = 0;
    for (const Slot& s : old)
      if (s.value != 0) Put(s.key, s.value);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t used_ = 0;
};

}  // namespace cubetorchfs
