// The RAM tier: a sharded LRU of immutable buffers under a byte budget.
//
// Keys are opaque strings built by ChunkKey(): file path, file version and chunk index, so a
// file that changed in the store gets new keys and its old bytes are never served. Buffers are
// shared: an entry evicted while a reader still holds it stays alive until that reader drops
// it, so the budget bounds what the cache holds, and readers in flight add at most one
// max_read-sized reference each on top.
//
// An entry is one heap node (LRU links, links in its shard's two chained tables: by key, and
// by path for EraseFile) and a reference to its buffer; its key is read from the buffer's
// record in the arena (Buffer::Publish), else kept in the node. docs/memory.md gives what an
// entry costs, term by term.
//
// GetOrFetch() coalesces concurrent misses: the first caller runs the fetch, later callers for
// the same key wait for its result instead of asking the backend again.
//
// Thread safety: all methods are safe to call concurrently. Each shard has one mutex; no lock
// is held while a fetch runs, and no two shard locks are ever held at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "cache/cache_arena.h"
#include "cfs_client/backend.h"
#include "common/status.h"

namespace prometheus {
class Registry;
}

namespace cubetorchfs::cache {

// A block of file bytes, immutable once shared.
struct Buffer {
  struct Free {
    Free() noexcept : mapped(0) {}
    explicit Free(size_t m) noexcept : mapped(m) {}
    explicit Free(CacheArena* a) noexcept : mapped(0), arena(a) {}
    size_t mapped;                // the bytes of its own mapping, or 0: from malloc or the arena
    CacheArena* arena = nullptr;  // the block is the arena's
    void operator()(char* p) const;
  };
  Buffer() = default;
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  std::unique_ptr<char, Free> data;
  size_t size = 0;
  // The arena's record of these bytes (CacheArena::Publish), or 0, or kForgotten: retired with
  // the buffer. A record Forget withdrew keeps its block (and its key, which the RAM cache's
  // entry of the buffer reads) until then, and is flagged kWithdrawn.
  mutable std::atomic<uint64_t> record{0};
  static constexpr uint64_t kForgotten = ~uint64_t{0};  // Forget: never published again
  static constexpr uint64_t kWithdrawn = 1;             // records are 16-aligned
  // The record whose key is `key`, kept until the buffer dies, or 0.
  uint64_t RecordOf(std::string_view key) const;

  // Allocates `size` uninitialized bytes: from the arena set by UseArena while it has room,
  // else from the heap. Aborts if memory is exhausted. A heap buffer of 2 MiB or more is a
  // mapping of its own, aligned to and advised for transparent huge pages: filling a 4 MiB
  // chunk then faults twice, not 1,024 times (the cost of a cold read's fresh memory).
  static std::shared_ptr<Buffer> Allocate(size_t size);
  // Gives back the memory past the first `n` bytes: in place, or for n under
  // kCopyWhenShrunkBelow (any n of a smaller size class, in the arena) by a copy into a block
  // of n bytes. REQUIRES: n <= size, and not published.
  void Shrink(size_t n);
  static constexpr size_t kCopyWhenShrunkBelow = 64 << 10;

  // The arena buffers come from from now on (null: the heap). Set once, before any buffer is
  // allocated; the arena must outlive every buffer.
  static void UseArena(CacheArena* arena);
  static CacheArena* arena();
  // Publishes the bytes, whole, as those of `key` (a ChunkKey): after a crash the next process
  // finds them in the arena (CacheArena) and caches them again. Once: a second call is a no-op.
  // Nothing for a heap buffer.
  void Publish(const std::string& key) const;
  // Withdraws the publication for good: the bytes are no longer those of their key (a write
  // through the mount, EraseFile); a later Publish is a no-op.
  void Forget() const;
};
using BufferRef = std::shared_ptr<const Buffer>;

// Reads `len` bytes at `offset` of `path` at `version` from the store into a new buffer.
// A short read means the file changed: Status::Stale.
Result<BufferRef> ReadChunk(cfs_client::Backend& backend, const std::string& path,
                            const cfs_client::FileVersion& version, uint64_t offset, size_t len);

// Key of chunk `chunk` of version `version` of the file at `path`.
std::string ChunkKey(std::string_view path, const cfs_client::FileVersion& version, uint64_t chunk);
// The bytes chunk `key` (a ChunkKey) holds when files are cut into chunks of `chunk_bytes`;
// nothing if `key` is not a ChunkKey or names a chunk past the file's end.
std::optional<uint64_t> ChunkLength(std::string_view key, uint64_t chunk_bytes);
// Whether `key` (a ChunkKey) is of the file at `path`, any version.
bool IsKeyOfFile(std::string_view key, std::string_view path);
// Every ChunkKey of the file at `path` sorts at or after this one (and before any other
// file's): where an ordered index's range of the file begins (the NVMe tier's).
std::string FirstKeyOfFile(std::string_view path);

// How a GetOrFetch call was served.
enum class Served {
  kCached,   // the buffer was in the cache: no wait
  kWaited,   // another caller's fetch of the same key was running; this call waited for it
  kFetched,  // this call ran the fetch
};

struct Lookup {
  BufferRef buffer;
  Served served = Served::kCached;
};

class RamCache {
 public:
  struct Options {
    uint64_t capacity_bytes = 0;   // the budget. Required.
    uint64_t max_entry_bytes = 0;  // the largest buffer expected (chunk size). Required.
    // Called with each entry evicted to make room, under a shard lock: it
    // must only hand the buffer on (the NVMe tier queues it). May be empty.
    std::function<void(const std::string& key, const BufferRef& buffer)> on_evict;
  };
  using FetchFn = std::function<Result<BufferRef>()>;

  // `registry` (may be null) receives cubetorchfs_cache_bytes{tier="ram"} and
  // cubetorchfs_cache_evictions_total{tier="ram"}; it must outlive the cache.
  static std::unique_ptr<RamCache> New(const Options& options, prometheus::Registry* registry);

  virtual ~RamCache() = default;

  // The cached buffer for `key`, or the result of `fetch` (run at most once at a time per
  // key across all callers), which is then cached. A failed fetch is not cached: each waiter
  // gets its error, and the next call tries again.
  virtual Result<Lookup> GetOrFetch(const std::string& key, const FetchFn& fetch) = 0;

  // The cached buffer for `key`, or null. Counts as a use for LRU order.
  virtual BufferRef Get(const std::string& key) = 0;
  // Whether `key` is cached; not a use (the LRU order is left as it is, which costs no
  // write to the entry's neighbours).
  virtual bool Contains(const std::string& key) = 0;

  // Caches `buffer` under `key`, replacing any entry, evicting least recently used entries
  // as needed. A buffer larger than a shard's share of the budget is not cached.
  virtual void Insert(const std::string& key, BufferRef buffer) = 0;

  // Drops every entry of the file at `path`, whatever its version (after a write through the
  // mount, so no reader is served the old bytes). O(shards + the file's chunks).
  virtual void EraseFile(std::string_view path) = 0;
  // Whether some version of a chunk of the file at `path` is cached. O(shards + the file's
  // chunks).
  virtual bool HoldsFile(std::string_view path) = 0;
  // Index entries EraseFile has looked at, ever: the file's own, and those of the other files
  // in its bucket of each shard's files index (one a bucket on average).
  virtual uint64_t erase_visits() const = 0;

  // The buffers an arena adopted after a crash are cached while the mount already serves
  // (CacheAdopted): from BeginAdoption to EndAdoption the paths EraseFile drops are
  // remembered, and InsertAdopted caches a buffer only if its file was not dropped since
  // (false otherwise): an adopted buffer never comes back over a write through the mount.
  // InsertAdopted puts the buffer behind every entry, and only into room (false when none is
  // left, or the key is cached already): fed the latest first, the LRU keeps their order.
  virtual void BeginAdoption() = 0;
  virtual bool InsertAdopted(const std::string& key, BufferRef buffer) = 0;
  virtual void EndAdoption() = 0;

  // Bytes held by cached entries; never above Options::capacity_bytes, against which each
  // entry is charged its EntryCost (its bookkeeping too: with files of 1-3 KB it is a tenth
  // of what they cost).
  virtual uint64_t bytes() const = 0;
  // The memory an entry of `size` bytes under a key of `key_bytes` takes, published in the
  // arena where there is one (its node, buffer and chain heads in glibc's blocks; its bytes'
  // block and record).
  static uint64_t EntryCost(size_t key_bytes, size_t size);
  virtual uint64_t evictions() const = 0;
};

// Caches the buffers an arena adopted from the process before (CacheArena::Adopt), from
// adopted->next on (the latest published first), through InsertAdopted, until all are through
// or `until` has passed (then adopted->next says where to go on). Once all are through, ends
// the adoption (the caller began it before the mount served: RamCache::BeginAdoption) and
// empties `adopted`. Returns how many were cached; a buffer not cached (no room left, erased
// since, or cached already) is freed. Each buffer keeps its record: still published.
uint64_t CacheAdopted(
    RamCache& cache, CacheArena* arena, CacheArena::Adoption* adopted,
    std::chrono::steady_clock::time_point until = std::chrono::steady_clock::time_point::max());

}  // namespace cubetorchfs::cache
