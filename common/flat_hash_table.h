// A flat hash table keyed by 64-bit hashes (keys that are already hashes of something, which
// their users check): open addressing with linear probing and backward-shift deletion (no
// tombstones), one array of (key, value) slots kept at most 3/4 full (at least 1/4 once it has
// shrunk). A lookup is about one cache miss, where a node-based std::unordered_map costs a
// bucket, a node and a division. Key 0 marks an empty slot: a key of 0 is stored as 1, so the
// two share a slot (a collision, which every user of a hash-keyed table tolerates).
//
// Pointers to values stay valid until the next Insert or Erase. Not thread-safe: its owner's
// lock guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace cubetorchfs {

template <typename V>
class FlatHashTable {
 public:
  V* Find(uint64_t key) { return const_cast<V*>(std::as_const(*this).Find(key)); }
  const V* Find(uint64_t key) const {
    if (used_ == 0) return nullptr;
    const uint64_t k = Stored(key);
    for (size_t i = Home(k);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == k) return &s.value;
      if (s.key == 0) return nullptr;
    }
  }

  // The value under `key`, made (value-initialized) if there was none.
  V& Insert(uint64_t key) {
    if (4 * (used_ + 1) > 3 * slots_.size()) Resize(slots_.empty() ? 16 : 2 * slots_.size());
    const uint64_t k = Stored(key);
    size_t i = Home(k);
    for (; slots_[i].key != 0; i = (i + 1) & mask_)
      if (slots_[i].key == k) return slots_[i].value;
    slots_[i] = Slot{k, V{}};
    ++used_;
    return slots_[i].value;
  }

  // Removes `key` if `pred(its value)` holds; true if removed.
  template <typename Pred>
  bool EraseIf(uint64_t key, Pred pred) {
    if (used_ == 0) return false;
    const uint64_t k = Stored(key);
    size_t i = Home(k);
    for (; slots_[i].key != k; i = (i + 1) & mask_)
      if (slots_[i].key == 0) return false;
    if (!pred(static_cast<const V&>(slots_[i].value))) return false;
    // Backward shift: entries after the hole whose home is not between the hole and them move
    // into it, so no probe sequence is broken and no tombstone is left.
    for (size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      const size_t home = Home(slots_[j].key);
      const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = Slot{};
    --used_;
    if (slots_.size() > 1024 && 4 * used_ < slots_.size()) Resize(slots_.size() / 2);
    return true;
  }
  bool Erase(uint64_t key) {
    return EraseIf(key, [](const V&) { return true; });
  }

  size_t size() const { return used_; }
  size_t capacity() const { return slots_.size(); }
  size_t Bytes() const { return slots_.capacity() * sizeof(Slot); }
  void Reserve(size_t n) {
    size_t cap = 16;
    while (3 * cap < 4 * n) cap *= 2;
    if (cap > slots_.size()) Resize(cap);
  }
  void Clear() {
    std::vector<Slot>().swap(slots_);
    mask_ = 0;
    used_ = 0;
  }

 private:
  struct Slot {
    uint64_t key = 0;  // Stored(key); 0: empty
    V value{};
  };

  static uint64_t Stored(uint64_t key) { return key == 0 ? 1 : key; }
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
    for (const Slot& s : old) {
      if (s.key == 0) continue;
      size_t i = Home(s.key);
      while (slots_[i].key != 0) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t used_ = 0;
};

}  // namespace cubetorchfs
