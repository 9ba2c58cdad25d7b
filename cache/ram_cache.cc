#include "cache/ram_cache.h"

#include <sys/mman.h>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cache/cache_arena.h"
#include "common/logging.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::cache {

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = 2u << 20;

size_t PageRound(size_t n) { return (n + kPage - 1) & ~(kPage - 1); }

[[noreturn]] void OutOfMemory(size_t size) {
  std::fprintf(stderr, "cubetorchfs: out of memory allocating %zu bytes\n", size);
  std::abort();
}

// `len` (page-rounded) bytes at a 2 MiB boundary: the huge pages cover all of it but the tail.
char* MapAligned(size_t len) {
  void* raw =
      ::mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
  if (aligned > start) ::munmap(raw, aligned - start);
  const uintptr_t end = start + len + kHugePage;
  if (end > aligned + len) ::munmap(reinterpret_cast<void*>(aligned + len), end - aligned - len);
  ::madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);  // a hint: may fail
  return reinterpret_cast<char*>(aligned);
}

}  // namespace

static CacheArena* g_arena = nullptr;  // set once, before any buffer (Buffer::UseArena)

void Buffer::Free::operator()(char* p) const {
  if (arena != nullptr)
    arena->Free(p);
  else if (mapped != 0)
    ::munmap(p, mapped);
  else
    std::free(p);
}

Buffer::~Buffer() {
  // The record goes before the block it names (which data's deleter frees next).
  if (const uint64_t r = record.load(std::memory_order_relaxed); r != 0 && r != kForgotten)
    data.get_deleter().arena->Retire(r & ~kWithdrawn);
}

uint64_t Buffer::RecordOf(std::string_view key) const {
  const uint64_t r = record.load(std::memory_order_acquire);
  if (r == 0 || r == kForgotten) return 0;
  const uint64_t at = r & ~kWithdrawn;
  return data.get_deleter().arena->RecordKey(at) == key ? at : 0;
}

void Buffer::UseArena(CacheArena* arena) { g_arena = arena; }
CacheArena* Buffer::arena() { return g_arena; }

void Buffer::Publish(const std::string& key) const {
  CacheArena* a = data.get_deleter().arena;
  if (a == nullptr || record.load(std::memory_order_relaxed) != 0) return;
  const uint64_t r = a->Publish(key, data.get(), size);
  uint64_t none = 0;
  if (r != 0 && !record.compare_exchange_strong(none, r)) a->Retire(r);  // another won
}

void Buffer::Forget() const {
  // For good: a later Publish (the window giving the buffer to the LRU) must not bring it back.
  // The record's block stays until the buffer dies: an entry of the RAM cache may read its key.
  uint64_t r = record.load(std::memory_order_relaxed);
  while (true) {
    if (r == kForgotten || (r & kWithdrawn) != 0) return;
    const uint64_t to = r == 0 ? kForgotten : r | kWithdrawn;
    if (record.compare_exchange_weak(r, to)) break;
  }
  if (r != 0) data.get_deleter().arena->Withdraw(r);
}

std::shared_ptr<Buffer> Buffer::Allocate(size_t size) {
  auto b = std::make_shared<Buffer>();
  if (g_arena != nullptr) {
    if (char* p = g_arena->Allocate(size)) {
      b->data = std::unique_ptr<char, Free>(p, Free(g_arena));
      b->size = size;
      return b;
    }
    static std::atomic<bool> told{false};
    if (!told.exchange(true))
      CTFS_LOG(kWarn) << "the RAM cache's arena is full (" << g_arena->reserved()
                      << " bytes reserved): buffers come from the heap, and a crash loses them";
  }
  if (size >= kHugePage) {
    const size_t len = PageRound(size);
    char* p = MapAligned(len);
    if (p == nullptr) OutOfMemory(size);
    b->data = std::unique_ptr<char, Free>(p, Free{len});
  } else {
    b->data.reset(static_cast<char*>(std::malloc(size == 0 ? 1 : size)));
    if (!b->data) OutOfMemory(size);
  }
  b->size = size;
  return b;
}

void Buffer::Shrink(size_t n) {
  if (n >= size) return;
  if (CacheArena* a = data.get_deleter().arena) {
    char* q = a->Shrink(data.get(), size, n);
    if (q != data.get()) {
      (void)data.release();  // freed by the arena's Shrink
      data.reset(q);
    }
    size = n;
    return;
  }
  if (n < kCopyWhenShrunkBelow) {
    // A small file read into a large guess: a block of its own. Shrinking the large one in
    // place would keep a whole page at least (a block past malloc's mmap threshold shrinks
    // by mremap): 4 KiB for each 1 KiB file, most of the cache's memory at ImageNet scale.
    std::unique_ptr<char, Free> copy(static_cast<char*>(std::malloc(n == 0 ? 1 : n)), Free());
    if (!copy) OutOfMemory(n);
    std::memcpy(copy.get(), data.get(), n);
    data = std::move(copy);
    size = n;
    return;
  }
  size_t& mapped = data.get_deleter().mapped;
  if (mapped != 0) {
    const size_t keep = PageRound(n == 0 ? 1 : n);
    if (keep < mapped) {
      ::munmap(data.get() + keep, mapped - keep);
      mapped = keep;
    }
  } else if (char* p = static_cast<char*>(std::realloc(data.get(), n == 0 ? 1 : n))) {
    // glibc shrinks in place (or with mremap for large blocks): no copy of the bytes kept.
    (void)data.release();
    data.reset(p);
  }
  size = n;
}

Result<BufferRef> ReadChunk(cfs_client::Backend& backend, const std::string& path,
                            const cfs_client::FileVersion& version, uint64_t offset, size_t len) {
  std::shared_ptr<Buffer> buf = Buffer::Allocate(len);
  CTFS_ASSIGN_OR_RETURN(size_t n, backend.Read(path, version, offset, len, buf->data.get()));
  if (n != len) return Status::Stale(path + ": file shorter than its size in the store");
  return BufferRef(std::move(buf));
}

std::string ChunkKey(std::string_view path, const cfs_client::FileVersion& version,
                     uint64_t chunk) {
  std::string key;
  key.reserve(path.size() + 1 + 5 * sizeof(uint64_t));
  key.append(path);
  key.push_back('\0');  // paths never contain NUL, so the fields cannot run together
  auto put = [&key](uint64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(version.size);
  put(static_cast<uint64_t>(version.mtime_ns));
  put(version.id);
  put(static_cast<uint64_t>(version.ctime_ns));
  put(chunk);
  return key;
}

std::string FirstKeyOfFile(std::string_view path) {
  std::string key(path);
  key.push_back('\0');  // ChunkKey: the path, a NUL, then the fields
  return key;
}

std::optional<uint64_t> ChunkLength(std::string_view key, uint64_t chunk_bytes) {
  const size_t nul = key.find('\0');
  if (nul == std::string_view::npos || key.size() != nul + 1 + 5 * sizeof(uint64_t) ||
      chunk_bytes == 0)
    return std::nullopt;
  uint64_t size = 0, chunk = 0;
  std::memcpy(&size, key.data() + nul + 1, sizeof size);  // ChunkKey's first field
  std::memcpy(&chunk, key.data() + nul + 1 + 4 * sizeof(uint64_t), sizeof chunk);  // its last
  if (size == 0) return chunk == 0 ? std::optional<uint64_t>(0) : std::nullopt;
  if (chunk >= (size + chunk_bytes - 1) / chunk_bytes) return std::nullopt;
  return std::min(chunk_bytes, size - chunk * chunk_bytes);
}

bool IsKeyOfFile(std::string_view key, std::string_view path) {
  return key.size() > path.size() && key.compare(0, path.size(), path) == 0 &&
         key[path.size()] == '\0';
}

namespace {

using SharedResult = std::shared_future<Result<BufferRef>>;

// One heap block an entry (Node): its LRU links, its links in the shard's two hash tables (by
// key, and by the key's path for EraseFile), and the buffer. The key's bytes are those of the
// buffer's record in the arena (Buffer::RecordOf: the record lives as long as the buffer),
// else the node's own. The tables are arrays of chain heads, as many as entries (load factor
// at most 1): 8 to 16 bytes an entry each.
struct Node {
  Node* hnext = nullptr;  // the next in its bucket of the key index
  Node* fnext = nullptr;  // the next in its bucket of the files index
  Node* newer = nullptr;  // LRU: towards the most recently used
  Node* older = nullptr;
  BufferRef buffer;
  uint32_t tag = 0;  // the key hash's high half: a chain's other keys are passed over unread
  uint16_t key_len = 0;
  bool in_record = false;  // the key is the buffer's record's (whose offset only Forget flags)
  char key_bytes[1];       // else key_len bytes here: the block is allocated for them

  std::string_view key() const {
    if (!in_record) return {key_bytes, key_len};
    const uint64_t record = buffer->record.load(std::memory_order_relaxed) & ~Buffer::kWithdrawn;
    return buffer->data.get_deleter().arena->RecordKey(record);
  }
  // The block for a key of `key_len` bytes, held in the node or not.
  static size_t BlockSize(size_t key_len, bool inline_key) {
    return offsetof(Node, key_bytes) + std::max<size_t>(inline_key ? key_len : 0, sizeof key_bytes);
  }
  size_t BlockSize() const { return BlockSize(key_len, !in_record); }
  static constexpr size_t kMaxKey = UINT16_MAX;
  static Node* New(std::string_view key, BufferRef buffer, uint64_t hash) {
    const bool in_record = buffer->RecordOf(key) != 0;
    const size_t bytes = BlockSize(key.size(), !in_record);
    void* mem = std::malloc(bytes);
    if (mem == nullptr) OutOfMemory(bytes);
    Node* n = new (mem) Node;
    n->buffer = std::move(buffer);
    n->in_record = in_record;
    n->tag = static_cast<uint32_t>(hash >> 32);
    n->key_len = static_cast<uint16_t>(key.size());
    if (!in_record) std::memcpy(n->key_bytes, key.data(), key.size());
    return n;
  }
  static void Delete(Node* n) {
    n->~Node();
    std::free(n);
  }
};

// Fibonacci hashing: the top bits of the product, so that the bits the shard was chosen by
// (the hash modulo the shards) do not choose the bucket too.
size_t Bucket(uint64_t hash, unsigned bits) {
  return bits == 0 ? 0 : static_cast<size_t>((hash * 0x9E3779B97F4A7C15ull) >> (64 - bits));
}

// glibc's blocks: the request plus its 8-byte header, rounded up to 16, at least 32.
uint64_t HeapBlock(size_t n) { return std::max<uint64_t>(32, (n + 8 + 15) & ~15ull); }

// What an entry costs: its node (of `node_block` bytes), the chain heads of the two tables at
// their fullest (two a table just after they doubled), the Buffer with its shared_ptr control
// block, and the bytes: in the arena, the block of their size class and the record that
// publishes them (and holds the key); else a heap block.
uint64_t NodeCost(size_t node_block, size_t key_bytes, size_t size, bool in_arena) {
  const uint64_t nodes =
      HeapBlock(node_block) + 2 * 2 * sizeof(Node*) + HeapBlock(16 + sizeof(Buffer));
  if (in_arena) return nodes + CacheArena::BlockBytes(size) + CacheArena::RecordBytes(key_bytes);
  return nodes + HeapBlock(size);
}

class ShardedLruCache final : public RamCache {
 public:
  ShardedLruCache(const Options& options, prometheus::Registry* registry)
      : capacity_(options.capacity_bytes),
        chunk_bytes_(options.max_entry_bytes),
        on_evict_(options.on_evict) {
    // Enough shards to spread lock contention, few enough that each holds 16 of the largest
    // entries. Keys hash to shards at random and each shard evicts on its own, so with 4 a
    // shard a file of 9 chunks in a cache 30 times its size lost a chunk about one time in 50;
    // with 16, any 15 entries stay whatever their keys (a shard's share of the budget is also
    // the most one entry may use).
    uint64_t max_entry = std::max<uint64_t>(options.max_entry_bytes, 1);
    size_t n = static_cast<size_t>(std::clamp<uint64_t>(capacity_ / (16 * max_entry), 1, 16));
    shards_ = std::vector<Shard>(n);
    for (auto& s : shards_) s.capacity = capacity_ / n;
    if (registry != nullptr) {
      bytes_gauge_ = &prometheus::BuildGauge()
                          .Name("cubetorchfs_cache_bytes")
                          .Help("Bytes held by each cache tier")
                          .Register(*registry)
                          .Add({{"tier", "ram"}});
      evictions_counter_ = &prometheus::BuildCounter()
                                .Name("cubetorchfs_cache_evictions_total")
                                .Help("Entries evicted from each cache tier to make room")
                                .Register(*registry)
                                .Add({{"tier", "ram"}});
    }
  }

  ~ShardedLruCache() override {
    for (Shard& s : shards_) {
      MutexLock l(s.mu);
      for (Node* n = s.newest; n != nullptr;) {
        Node* older = n->older;
        Node::Delete(n);
        n = older;
      }
    }
  }

  Result<Lookup> GetOrFetch(const std::string& key, const FetchFn& fetch) override {
    const uint64_t h = KeyHash(key);
    Shard& s = ShardOf(h);
    std::promise<Result<BufferRef>> promise;
    SharedResult pending;  // another caller's fetch of the key, to wait for
    {
      MutexLock l(s.mu);
      if (BufferRef b = GetLocked(s, key, h)) return Lookup{std::move(b), Served::kCached};
      auto it = s.inflight.find(key);
      if (it != s.inflight.end())
        pending = it->second;
      else
        s.inflight.emplace(key, promise.get_future().share());
    }
    if (pending.valid()) {
      const Result<BufferRef>& r = pending.get();
      if (!r.ok()) return r.status();
      return Lookup{r.value(), Served::kWaited};
    }
    Result<BufferRef> r = fetch();
    if (r.ok()) r.value()->Publish(key);
    {
      MutexLock l(s.mu);
      s.inflight.erase(key);
      if (r.ok()) InsertLocked(s, key, h, r.value());
    }
    promise.set_value(r);
    if (!r.ok()) return r.status();
    return Lookup{std::move(r).value(), Served::kFetched};
  }

  BufferRef Get(const std::string& key) override {
    const uint64_t h = KeyHash(key);
    Shard& s = ShardOf(h);
    MutexLock l(s.mu);
    return GetLocked(s, key, h);
  }

  bool Contains(const std::string& key) override {
    const uint64_t h = KeyHash(key);
    Shard& s = ShardOf(h);
    MutexLock l(s.mu);
    return FindLocked(s, key, h) != nullptr;
  }

  void Insert(const std::string& key, BufferRef buffer) override {
    buffer->Publish(key);
    const uint64_t h = KeyHash(key);
    Shard& s = ShardOf(h);
    MutexLock l(s.mu);
    InsertLocked(s, key, h, std::move(buffer));
  }

  // A file's keys (every version, every chunk) are found through each shard's index of
  // files: this looks at the file's own entries (and any other file's of the same bucket),
  // not at the whole cache.
  void EraseFile(std::string_view path) override {
    if (adopting_.load(std::memory_order_acquire)) {  // before the shards: InsertAdopted
      MutexLock l(erased_mu_);
      // Bounded: past it, what is left of the adoption is dropped instead.
      if (erased_.size() >= kMaxErasedDuringAdoption)
        erased_overflow_ = true;
      else if (adopting_.load(std::memory_order_relaxed))
        erased_.emplace(path);
    }
    const uint64_t h = PathHash(path);
    uint64_t visits = 0;
    std::vector<Node*> doomed;
    for (Shard& s : shards_) {
      MutexLock l(s.mu);
      if (s.count == 0) continue;
      for (Node* n = s.files[Bucket(h, s.bits)]; n != nullptr; n = n->fnext) {
        ++visits;
        if (IsKeyOfFile(n->key(), path)) doomed.push_back(n);
      }
      for (Node* n : doomed) {
        n->buffer->Forget();  // a reader may hold it on: its bytes are no longer the key's
        RemoveLocked(s, n);
      }
      doomed.clear();
    }
    erase_visits_.fetch_add(visits, std::memory_order_relaxed);
  }

  uint64_t erase_visits() const override { return erase_visits_.load(std::memory_order_relaxed); }

  void BeginAdoption() override {
    MutexLock l(erased_mu_);
    adopting_.store(true, std::memory_order_release);
  }

  bool InsertAdopted(const std::string& key, BufferRef buffer) override {
    // Under erased_mu_: an EraseFile of the file either was seen here, or erases the shards
    // only after this insert.
    // Of the length this process's chunks of that file have: a buffer cut to another
    // cache.chunk_bytes (the config changed across the crash or the upgrade) would be read
    // past its end.
    if (std::optional<uint64_t> want = ChunkLength(key, chunk_bytes_);
        !want || *want != buffer->size)
      return false;
    MutexLock l(erased_mu_);
    if (erased_overflow_) return false;
    if (!erased_.empty() && erased_.count(key.substr(0, key.find('\0'))) > 0) return false;
    // Behind every entry (they come the latest first, so the LRU keeps their order and what
    // this process cached already stays ahead), and only into room: never over an entry.
    const uint64_t h = KeyHash(key);
    Shard& s = ShardOf(h);
    MutexLock sl(s.mu);
    if (key.size() > Node::kMaxKey || FindLocked(s, key, h) != nullptr) return false;
    Node* n = Node::New(key, std::move(buffer), h);
    const uint64_t cost = CostOf(*n);
    if (s.bytes + cost > s.capacity) {
      Node::Delete(n);
      return false;
    }
    LinkLocked(s, n, h, /*newest=*/false);
    s.bytes += cost;
    return true;
  }

  void EndAdoption() override {
    MutexLock l(erased_mu_);
    adopting_.store(false, std::memory_order_release);
    erased_.clear();
    erased_overflow_ = false;
  }

  bool HoldsFile(std::string_view path) override {
    const uint64_t h = PathHash(path);
    for (Shard& s : shards_) {
      MutexLock l(s.mu);
      if (s.count == 0) continue;
      for (Node* n = s.files[Bucket(h, s.bits)]; n != nullptr; n = n->fnext)
        if (IsKeyOfFile(n->key(), path)) return true;
    }
    return false;
  }

  uint64_t bytes() const override { return bytes_.load(std::memory_order_relaxed); }
  uint64_t evictions() const override { return evictions_.load(std::memory_order_relaxed); }

 private:
  struct Shard {
    Mutex mu;               // guards everything below
    uint64_t capacity = 0;  // set once at construction
    // What its entries cost (EntryCost: bytes and bookkeeping), held within capacity.
    uint64_t bytes GUARDED_BY(mu) = 0;
    uint64_t count GUARDED_BY(mu) = 0;
    Node* newest GUARDED_BY(mu) = nullptr;
    Node* oldest GUARDED_BY(mu) = nullptr;
    // Chain heads, 2^bits of each: by the key's hash, and by its path's (PathHash).
    unsigned bits GUARDED_BY(mu) = 0;
    std::vector<Node*> index GUARDED_BY(mu);
    std::vector<Node*> files GUARDED_BY(mu);
    std::unordered_map<std::string, SharedResult> inflight GUARDED_BY(mu);
  };

  static uint64_t CostOf(const Node& n) {
    return NodeCost(n.BlockSize(), n.key_len, n.buffer->size,
                    n.buffer->data.get_deleter().arena != nullptr);
  }
  static uint64_t KeyHash(std::string_view key) { return std::hash<std::string_view>{}(key); }
  static uint64_t PathHash(std::string_view key) {
    return std::hash<std::string_view>{}(key.substr(0, key.find('\0')));
  }

  Shard& ShardOf(uint64_t key_hash) { return shards_[key_hash % shards_.size()]; }

  // `hash`: KeyHash(key).
  Node* FindLocked(Shard& s, std::string_view key, uint64_t hash) REQUIRES(s.mu) {
    if (s.count == 0) return nullptr;
    const uint32_t tag = static_cast<uint32_t>(hash >> 32);
    for (Node* n = s.index[Bucket(hash, s.bits)]; n != nullptr; n = n->hnext)
      if (n->tag == tag && n->key() == key) return n;
    return nullptr;
  }

  BufferRef GetLocked(Shard& s, std::string_view key, uint64_t hash) REQUIRES(s.mu) {
    Node* n = FindLocked(s, key, hash);
    if (n == nullptr) return nullptr;
    if (n != s.newest) {
      UnlinkLruLocked(s, n);
      PushNewestLocked(s, n);
    }
    return n->buffer;
  }

  void PushNewestLocked(Shard& s, Node* n) REQUIRES(s.mu) {
    n->newer = nullptr;
    n->older = s.newest;
    if (s.newest != nullptr) s.newest->newer = n;
    s.newest = n;
    if (s.oldest == nullptr) s.oldest = n;
  }

  void PushOldestLocked(Shard& s, Node* n) REQUIRES(s.mu) {
    n->older = nullptr;
    n->newer = s.oldest;
    if (s.oldest != nullptr) s.oldest->older = n;
    s.oldest = n;
    if (s.newest == nullptr) s.newest = n;
  }

  void UnlinkLruLocked(Shard& s, Node* n) REQUIRES(s.mu) {
    (n->newer != nullptr ? n->newer->older : s.newest) = n->older;
    (n->older != nullptr ? n->older->newer : s.oldest) = n->newer;
  }

  // Doubles the tables once there are more entries than buckets: each chain holds one entry
  // on average, at most two just after.
  void GrowLocked(Shard& s) REQUIRES(s.mu) {
    if (s.count < s.index.size()) return;
    const unsigned bits = s.index.empty() ? 4 : s.bits + 1;
    std::vector<Node*> index(size_t{1} << bits, nullptr), files(size_t{1} << bits, nullptr);
    for (Node* n = s.newest; n != nullptr; n = n->older) {
      Node*& h = index[Bucket(KeyHash(n->key()), bits)];
      n->hnext = h;
      h = n;
      Node*& f = files[Bucket(PathHash(n->key()), bits)];
      n->fnext = f;
      f = n;
    }
    s.index.swap(index);
    s.files.swap(files);
    s.bits = bits;
  }

  // Into the tables, and at either end of the LRU.
  // `hash`: KeyHash of n's key.
  void LinkLocked(Shard& s, Node* n, uint64_t hash, bool newest) REQUIRES(s.mu) {
    s.count++;
    GrowLocked(s);  // before linking n: the rehash walks the LRU, which n is not in yet
    Node*& h = s.index[Bucket(hash, s.bits)];
    n->hnext = h;
    h = n;
    Node*& f = s.files[Bucket(PathHash(n->key()), s.bits)];
    n->fnext = f;
    f = n;
    if (newest)
      PushNewestLocked(s, n);
    else
      PushOldestLocked(s, n);
    AddBytes(static_cast<int64_t>(n->buffer->size));
  }

  void InsertLocked(Shard& s, const std::string& key, uint64_t hash, BufferRef buffer)
      REQUIRES(s.mu) {
    if (Node* old = FindLocked(s, key, hash)) RemoveLocked(s, old);
    if (key.size() > Node::kMaxKey) return;  // no path is that long
    Node* n = Node::New(key, std::move(buffer), hash);
    const uint64_t cost = CostOf(*n);
    if (cost > s.capacity) {  // would evict everything and still not fit
      Node::Delete(n);
      return;
    }
    while (s.bytes + cost > s.capacity) {
      Node* victim = s.oldest;
      if (on_evict_) on_evict_(std::string(victim->key()), victim->buffer);
      RemoveLocked(s, victim);
      evictions_.fetch_add(1, std::memory_order_relaxed);
      if (evictions_counter_) evictions_counter_->Increment();
    }
    LinkLocked(s, n, hash, /*newest=*/true);
    s.bytes += cost;
  }

  static void UnchainLocked(Node** head, Node* n, Node* Node::*next) {
    for (Node** p = head; *p != nullptr; p = &((*p)->*next))
      if (*p == n) {
        *p = n->*next;
        return;
      }
  }

  void RemoveLocked(Shard& s, Node* n) REQUIRES(s.mu) {
    const std::string_view key = n->key();
    s.bytes -= CostOf(*n);
    UnchainLocked(&s.index[Bucket(KeyHash(key), s.bits)], n, &Node::hnext);
    UnchainLocked(&s.files[Bucket(PathHash(key), s.bits)], n, &Node::fnext);
    UnlinkLruLocked(s, n);
    s.count--;
    AddBytes(-static_cast<int64_t>(n->buffer->size));
    Node::Delete(n);
  }

  void AddBytes(int64_t delta) {
    bytes_.fetch_add(static_cast<uint64_t>(delta), std::memory_order_relaxed);
    if (bytes_gauge_) bytes_gauge_->Increment(static_cast<double>(delta));
  }

  const uint64_t capacity_;
  const uint64_t chunk_bytes_;  // Options::max_entry_bytes: cache.chunk_bytes
  const std::function<void(const std::string&, const BufferRef&)> on_evict_;
  std::vector<Shard> shards_;  // fixed after construction
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> erase_visits_{0};
  std::atomic<bool> adopting_{false};
  Mutex erased_mu_;  // before any shard's mutex
  std::unordered_set<std::string> erased_ GUARDED_BY(erased_mu_);
  bool erased_overflow_ GUARDED_BY(erased_mu_) = false;
  static constexpr size_t kMaxErasedDuringAdoption = 65536;
  prometheus::Gauge* bytes_gauge_ = nullptr;          // owned by the registry
  prometheus::Counter* evictions_counter_ = nullptr;  // owned by the registry
};

}  // namespace

uint64_t RamCache::EntryCost(size_t key_bytes, size_t size) {
  // Of a buffer published under the key where there is an arena.
  const bool published = g_arena != nullptr && key_bytes <= CacheArena::kMaxKey;
  return NodeCost(Node::BlockSize(key_bytes, !published), key_bytes, size, g_arena != nullptr);
}

uint64_t CacheAdopted(RamCache& cache, CacheArena* arena, CacheArena::Adoption* adopted,
                      std::chrono::steady_clock::time_point until) {
  uint64_t cached = 0;
  std::vector<CacheArena::Entry>& entries = adopted->entries;
  for (; adopted->next < entries.size(); ++adopted->next) {
    if (adopted->next % 256 == 255 && std::chrono::steady_clock::now() >= until) return cached;
    CacheArena::Entry& e = entries[adopted->next];
    auto b = std::make_shared<Buffer>();
    b->data = std::unique_ptr<char, Buffer::Free>(e.data, Buffer::Free(arena));
    b->size = e.size;
    b->record.store(e.record, std::memory_order_relaxed);
    cached += cache.InsertAdopted(e.key, BufferRef(std::move(b))) ? 1 : 0;  // else freed
    std::string().swap(e.key);
  }
  cache.EndAdoption();
  entries.clear();
  entries.shrink_to_fit();
  adopted->next = 0;
  return cached;
}

std::unique_ptr<RamCache> RamCache::New(const Options& options, prometheus::Registry* registry) {
  return std::make_unique<ShardedLruCache>(options, registry);
}

}  // namespace cubetorchfs::cache
