// The memory of the RAM cache's buffers, made to outlive the process.
//
// Blocks are carved out of a DurableRegion (a memfd the supervisor holds, daemon/supervisor.h).
// A buffer whose bytes are whole is published: a record (its key, where its bytes are, how
// many) is written beside it. After a crash the next process adopts the memfd, keeps every
// record whose fields are sound and whose block is where the span table says blocks of its
// size are, and builds its RAM cache from them: what the dead process had fetched (the LRU
// and the prefetch window) is not fetched again.
//
// Layout: a header page, the span table (a 32-bit word a span), then spans of kSpan bytes. A
// span is free, or holds blocks of one size class (data or records, never both), or heads a
// run of spans holding one large block (over kMaxSmall). Size classes step by 16 bytes from
// 64 bytes to a page, then by a page to kMaxSmall: a block wastes under 16 bytes below a page
// and under a page above. An empty span and a freed large block give their pages back at once
// (hole punched), so the memfd holds the blocks in use and, as glibc's heap does, free blocks
// of spans still in use.
//
// Crash consistency (a kill stops the process at an instruction; the memory is shared, so
// only the compiler's order matters): a span's word is written before any block of it is
// handed out and cleared only once none is in use; a record is written whole, then its magic
// word; a record is retired (magic cleared) before its block, or its data's, is freed.
// The adopter trusts none of it all the same (the process may have died of a bug that wrote
// over it): every field is checked, a block claimed twice keeps its first claimant, and every
// record slot not kept is cleared, so a later adoption cannot find it.
//
// Thread safety: all methods are thread-safe. A class's mutex is taken before the spans'
// mutex; no other lock is taken under either, and no system call is made under a class's.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/durable_region.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::cache {

class CacheArena {
 public:
  static constexpr size_t kSpan = size_t{2} << 20;
  static constexpr size_t kMaxSmall = size_t{1} << 20;  // larger blocks are runs of spans
  static constexpr size_t kMaxKey = 8192;
  static constexpr size_t kRecordHeader = 32;  // a record: this, then its key

  // The address space an arena for a cache of `cache_bytes` (LRU and window) reserves: four
  // times as much (blocks in flight, classes' rounding, spans partly used) and 1 GiB, at most
  // 64 TiB. Only what is written costs memory.
  static uint64_t ReserveFor(uint64_t cache_bytes);
  // A fresh arena over `reserve_bytes` of address space. An error where not even anonymous
  // memory can be reserved; a memfd that cannot be made leaves an arena that is not durable.
  static Result<std::unique_ptr<CacheArena>> Create(uint64_t reserve_bytes);

  struct Entry {
    std::string key;
    char* data = nullptr;
    size_t size = 0;
    uint64_t record = 0;  // Publish's: still live, owned by the entry
    uint64_t seq = 0;     // the order of publication
  };
  struct Adoption {
    std::vector<Entry> entries;  // the latest published first
    size_t next = 0;             // the first not yet cached again (CacheAdopted)
    uint64_t bytes = 0;          // their data
    uint64_t dropped = 0;        // records not kept: unsound, or a block claimed twice
  };
  // The arena an earlier process left in memfd `fd` (taken: closed with the arena, or on
  // failure), and in `*out` the buffers it had published, which the caller now owns (each is
  // given back with Free(data) and Retire(record)).
  static Result<std::unique_ptr<CacheArena>> Adopt(int fd, Adoption* out);

  ~CacheArena();
  CacheArena(const CacheArena&) = delete;
  CacheArena& operator=(const CacheArena&) = delete;

  // A block of at least `size` bytes (16-aligned; page-aligned from a page up), or null when
  // the reservation is used up.
  char* Allocate(size_t size);
  // Gives back a block Allocate or Shrink made (or Adopt found).
  void Free(char* p);
  // Block `p`, holding `old_size` bytes, made to hold `new_size` <= old_size: `p` itself when
  // its class is that of the new size (a large block gives back the spans past it), else a
  // block of the smaller class with the bytes copied and `p` freed; `p` when none is left.
  char* Shrink(char* p, size_t old_size, size_t new_size);
  // The memory a block for `size` bytes takes: its class, or a large block's pages.
  static uint64_t BlockBytes(size_t size);
  // The memory a record of a key of `key_bytes` takes.
  static uint64_t RecordBytes(size_t key_bytes) { return BlockBytes(kRecordHeader + key_bytes); }

  // Records that block `data` (of this arena) holds `size` bytes of `key`. Returns the record,
  // or 0 when none could be made (a key over kMaxKey, no room): the bytes then die with the
  // process.
  uint64_t Publish(std::string_view key, const char* data, size_t size);
  // Forgets a record Publish made, and frees its block.
  void Retire(uint64_t record);
  // Forgets a record Publish made but keeps its block (its key stays readable) until Retire.
  void Withdraw(uint64_t record);
  // The key of a record Publish made, until it is retired.
  std::string_view RecordKey(uint64_t record) const;

  bool Owns(const char* p) const { return p >= base_ + first_ && p < base_ + region_.size(); }
  int fd() const { return region_.fd(); }  // -1 where not durable
  uint64_t reserved() const { return region_.size(); }
  // Spans in use (of blocks of a class, or large ones) and the bytes of the records live.
  uint64_t spans_used() const { return spans_used_.load(std::memory_order_relaxed); }
  // Allocations refused for want of address space (the buffer then came from the heap).
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  struct SmallSpan {
    uint32_t used = 0;  // blocks handed out
    uint32_t bump = 0;  // blocks [0, bump) have been handed out at some time
    uint32_t nfree = 0;
    int32_t partial_pos = -1;    // in its class's `partial`, or -1
    std::vector<uint64_t> free;  // bit i: block i (< bump) is free
  };
  struct Class {
    Mutex mu;
    uint32_t size = 0;
    uint32_t per_span = 0;
    std::vector<uint32_t> partial GUARDED_BY(mu);  // spans with a block to hand out
  };
  enum Kind : uint32_t { kData = 0, kRecord = 1 };

  explicit CacheArena(DurableRegion region);
  void Format();
  uint32_t Word(uint32_t span) const;
  void SetWord(uint32_t span, uint32_t w);
  char* SpanBase(uint32_t span) const { return base_ + first_ + uint64_t{span} * kSpan; }
  char* AllocateIn(Kind kind, uint32_t cls);
  void FreeIn(uint32_t span, uint32_t word, char* p);
  bool TakeSpans(uint32_t n, uint32_t* first);
  void GiveSpans(uint32_t first, uint32_t n);
  void Punch(char* p, size_t len);
  Status AdoptRecords(Adoption* out);

  DurableRegion region_;
  char* base_ = nullptr;
  uint64_t first_ = 0;  // offset of span 0
  uint32_t nspans_ = 0;
  std::unique_ptr<Class[]> classes_[2];
  // One per span, guarded by the mutex of the class the span's word names.
  std::vector<std::unique_ptr<SmallSpan>> small_;
  Mutex spans_mu_;
  std::map<uint32_t, uint32_t> free_runs_ GUARDED_BY(spans_mu_);  // first span -> count
  uint32_t top_ GUARDED_BY(spans_mu_) = 0;  // spans from here on have never been used
  std::atomic<uint64_t> spans_used_{0};
  std::atomic<uint64_t> seq_{1};  // the next record's
  std::atomic<uint64_t> refused_{0};
};

}  // namespace cubetorchfs::cache
