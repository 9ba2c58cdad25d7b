// The prefetcher's page-resident marks, in one flat array: open addressing on 64-bit keys
// that are already hashes (Prefetcher::MarkKey), linear probing, and backward-shift deletion
// (no tombstones). A lookup in a warm epoch of 1.28 M marks is one cache miss, where a node
// per mark (std::unordered_map) cost a bucket and a node, each a miss, and a division.
//
// 24 bytes a slot, the array at most 7/8 full and doubled past that (so at least 7/16 full
// after), never shrunk but by Clear(). Pointers returned stay valid until the next Insert or
// Erase. Not thread-safe: the prefetcher's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cfs_client/backend.h"

namespace cubetorchfs::prefetch {

class MarkTable {
 public:
  struct Mark {
    uint64_t version = 0;  // VersionDigest of the version the kernel was given
    uint64_t seq : 63 = 0;
    uint64_t probing : 1 = 0;  // a probe of it is running
  };

  // A 64-bit digest of a file version: marks compare versions by it (a false match would only
  // pass over a file the kernel itself checks by its attributes; the daemon serves no byte by it).
  static uint64_t VersionDigest(const cfs_client::FileVersion& v) {
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (uint64_t x :
         {v.size, static_cast<uint64_t>(v.mtime_ns), v.id, static_cast<uint64_t>(v.ctime_ns)}) {
      h ^= x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
      h *= 0xff51afd7ed558ccdull;
      h ^= h >> 33;
    }
    return h;
  }

  Mark* Find(uint64_t key) {
    if (size_ == 0) return nullptr;
    const uint64_t k = Stored(key);
    for (size_t i = Home(k);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == k) return &s.mark;
      if (s.key == 0) return nullptr;
    }
  }
  // The mark of `key`, made (zeroed) if there was none.
  Mark& Insert(uint64_t key) {
    if ((size_ + 1) * 8 > slots_.size() * 7) Grow();
    const uint64_t k = Stored(key);
    size_t i = Home(k);
    for (; slots_[i].key != 0; i = (i + 1) & mask_)
      if (slots_[i].key == k) return slots_[i].mark;
    slots_[i].key = k;
    slots_[i].mark = Mark{};
    ++size_;
    return slots_[i].mark;
  }
  bool Erase(uint64_t key) {
    if (size_ == 0) return false;
    const uint64_t k = Stored(key);
    size_t i = Home(k);
    for (; slots_[i].key != k; i = (i + 1) & mask_)
      if (slots_[i].key == 0) return false;
    // Backward shift: each later slot of the run that may move into the hole does.
    for (size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      const size_t home = Home(slots_[j].key);
      // Slot j stays if its home lies cyclically in (i, j].
      const bool stays = i < j ? (home > i && home <= j) : (home > i || home <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i].key = 0;
    --size_;
    return true;
  }
  size_t size() const { return size_; }
  void Clear() {
    std::vector<Slot>().swap(slots_);
    mask_ = 0;
    size_ = 0;
  }
  // Bytes the array holds.
  size_t Bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  struct Slot {
    uint64_t key = 0;  // Stored(key); 0: empty
    Mark mark;
  };
  static_assert(sizeof(Slot) == 24);
  // Key 0 marks an empty slot: a path hashing to 0 shares key 1's mark (a collision, which
  // marks tolerate: see Prefetcher::Mark).
  static uint64_t Stored(uint64_t key) { return key == 0 ? 1 : key; }
  size_t Home(uint64_t k) const { return (k * 0x9e3779b97f4a7c15ull >> 20) & mask_; }
  void Grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.empty() ? 1024 : old.size() * 2, Slot{});
    mask_ = slots_.size() - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.key != 0) {
        size_t i = Home(s.key);
        while (slots_[i].key != 0) i = (i + 1) & mask_;
        slots_[i] = s;
        ++size_;
      }
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace cubetorchfs::prefetch
