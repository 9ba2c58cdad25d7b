#include "cache/ram_cache.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <fcntl.h>
#include <malloc.h>
#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

namespace cubetorchfs::cache {
namespace {

BufferRef MakeBuffer(size_t size, char fill) {
  auto b = Buffer::Allocate(size);
  std::memset(b->data.get(), fill, size);
  return b;
}

std::string Key(int i) { return ChunkKey(std::to_string(i), {100, 1}, 0); }

TEST(ChunkKeyTest, VersionAndChunkMakeDistinctKeys) {
  EXPECT_NE(ChunkKey("a", {1, 2}, 0), ChunkKey("a", {1, 3}, 0));
  EXPECT_NE(ChunkKey("a", {1, 2}, 0), ChunkKey("a", {2, 2}, 0));
  EXPECT_NE(ChunkKey("a", {1, 2}, 0), ChunkKey("a", {1, 2}, 1));
  EXPECT_NE(ChunkKey("a", {1, 2}, 0), ChunkKey("ab", {1, 2}, 0));
  EXPECT_EQ(ChunkKey("a", {1, 2}, 0), ChunkKey("a", {1, 2}, 0));
}

// Inserts 20,000 entries of each size into a fresh cache and checks what `in_use` grew by
// against what the cache charged them: covered (give or take `slack` bytes in all), and not
// much more.
[[maybe_unused]] void ExpectChargeCoversWhatIsHeld(std::initializer_list<size_t> sizes,
                                                   const std::function<uint64_t()>& in_use,
                                                   uint64_t slack, const char* where) {
  constexpr int kFiles = 20000;
  for (size_t size : sizes) {
    auto cache = RamCache::New({1ull << 32, 64 << 10}, nullptr);
    std::vector<std::string> keys;
    for (int i = 0; i < kFiles; ++i)
      keys.push_back(
          ChunkKey("n01440764/n01440764_" + std::to_string(10000 + i) + ".JPEG", {size, 1}, 0));
    const uint64_t before = in_use();
    for (const std::string& key : keys) cache->Insert(key, MakeBuffer(size, 'x'));
    const uint64_t used = in_use() - before;
    const uint64_t charged = kFiles * RamCache::EntryCost(keys[0].size(), size);
    std::printf("  %zu-byte files%s: %.0f bytes each held, %.0f charged\n", size, where,
                static_cast<double>(used) / kFiles, static_cast<double>(charged) / kFiles);
    EXPECT_LE(used, charged + slack) << size;
    EXPECT_LE(charged, used + used / 8) << size;  // and not much more
  }
}

TEST(RamCacheTest, WhatAnEntryIsChargedCoversWhatItTakes) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers keep their own heap: malloc's counts say nothing";
#else
  ExpectChargeCoversWhatIsHeld(
      {1u, 1000u, 3000u, 20000u},
      [] {
        const struct mallinfo2 m = ::mallinfo2();
        return static_cast<uint64_t>(m.uordblks + m.hblkhd);
      },
      0, "");
#endif
}

// The same with the buffers in the arena that outlives a crash: the index's heap blocks, and
// the memfd's pages for the bytes and their records.
TEST(RamCacheTest, InTheArenaWhatAnEntryIsChargedCoversWhatItTakes) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers keep their own heap: malloc's counts say nothing";
#else
  auto arena = CacheArena::Create(uint64_t{4} << 30);
  ASSERT_TRUE(arena.ok());
  ASSERT_GE((*arena)->fd(), 0);
  Buffer::UseArena(arena->get());
  struct Reset {
    ~Reset() { Buffer::UseArena(nullptr); }
  } reset;
  // (A span's last, partly used page apart: one a size class.)
  ExpectChargeCoversWhatIsHeld(
      {1u, 1000u, 3000u, 20000u, 110000u},
      [&] {
        const struct mallinfo2 m = ::mallinfo2();
        struct stat st {};
        ::fstat((*arena)->fd(), &st);
        return static_cast<uint64_t>(m.uordblks + m.hblkhd) +
               static_cast<uint64_t>(st.st_blocks) * 512;
      },
      2 * 4096, " in the arena");
#endif
}

// An entry's key is read from its buffer's record in the arena: a record withdrawn (the bytes
// written over through the mount while the window held them) keeps its key until the buffer
// dies, and no adoption finds it; a buffer published under another key keeps its own copy.
TEST(RamCacheTest, InTheArenaAnEntryFindsItsKeyWhateverBecameOfItsRecord) {
  auto arena = CacheArena::Create(uint64_t{1} << 30);
  ASSERT_TRUE(arena.ok());
  Buffer::UseArena(arena->get());
  struct Reset {
    ~Reset() { Buffer::UseArena(nullptr); }
  } reset;
  auto cache = RamCache::New({64 << 20, 64 << 10}, nullptr);
  const std::string a = ChunkKey("d/a.JPEG", {100, 1}, 0), b = ChunkKey("d/b.JPEG", {100, 1}, 0);
  const std::string c = ChunkKey("d/c.JPEG", {100, 1}, 0);
  BufferRef forgotten = MakeBuffer(100, 'a');
  cache->Insert(a, forgotten);
  forgotten->Forget();
  BufferRef other = MakeBuffer(100, 'b');
  other->Publish(c);  // published under c, cached under b
  cache->Insert(b, other);
  ASSERT_EQ(cache->Get(a), forgotten);
  ASSERT_EQ(cache->Get(b), other);
  EXPECT_EQ(cache->Get(c), nullptr);
  // Churn: the record blocks freed meanwhile must not be those the keys are read from.
  for (int i = 0; i < 2000; ++i) cache->Insert(Key(i), MakeBuffer(100, 'x'));
  EXPECT_EQ(cache->Get(a), forgotten);
  EXPECT_EQ(cache->Get(b), other);
  EXPECT_TRUE(cache->HoldsFile("d/a.JPEG"));
  // The next process finds b's bytes under c (their record), never a's.
  CacheArena::Adoption adopted;
  auto next = CacheArena::Adopt(::fcntl((*arena)->fd(), F_DUPFD_CLOEXEC, 0), &adopted);
  ASSERT_TRUE(next.ok());
  size_t found_a = 0, found_c = 0;
  for (const CacheArena::Entry& e : adopted.entries) {
    found_a += e.key == a;
    found_c += e.key == c;
  }
  EXPECT_EQ(found_a, 0u);
  EXPECT_EQ(found_c, 1u);
  cache->EraseFile("d/a.JPEG");
  cache->EraseFile("d/b.JPEG");
  EXPECT_EQ(cache->Get(a), nullptr);
  EXPECT_EQ(cache->Get(b), nullptr);
  EXPECT_FALSE(cache->HoldsFile("d/a.JPEG"));
}

// A small file read into a large guess keeps a block of its own size, not the guess's pages.
TEST(BufferTest, ShrinkingALargeBlockToAFewBytesGivesBackItsPages) {
  for (size_t guess : {size_t{64} << 10, size_t{1} << 20, size_t{4} << 20}) {
    auto b = Buffer::Allocate(guess);
    std::memset(b->data.get(), 'q', guess);
    b->Shrink(2000);
    EXPECT_EQ(b->size, 2000u);
    EXPECT_EQ(b->data.get_deleter().mapped, 0u);
    EXPECT_LE(::malloc_usable_size(b->data.get()), 2048u) << guess;
    EXPECT_EQ(std::string(b->data.get(), 2000), std::string(2000, 'q'));
  }
}

TEST(RamCacheTest, BudgetIsNeverExceeded) {
  auto cache = RamCache::New({1 << 20, 64 << 10}, nullptr);
  std::mt19937 rng(42);
  for (int i = 0; i < 2000; ++i) {
    cache->Insert(Key(i), MakeBuffer(1 + rng() % (64 << 10), 'x'));
    ASSERT_LE(cache->bytes(), 1u << 20);
  }
  EXPECT_GT(cache->evictions(), 0u);
}

TEST(RamCacheTest, EvictsLeastRecentlyUsedFirst) {
  // One shard: 4 entries of 64 KiB fit in 256 KiB and their bookkeeping (EntryCost).
  auto cache = RamCache::New({(256 << 10) + 4096, 256 << 10}, nullptr);
  for (int i = 0; i < 4; ++i) cache->Insert(Key(i), MakeBuffer(64 << 10, 'a'));
  ASSERT_NE(cache->Get(Key(0)), nullptr);  // 0 becomes the most recent; 1 is now the oldest
  cache->Insert(Key(4), MakeBuffer(64 << 10, 'b'));
  EXPECT_EQ(cache->Get(Key(1)), nullptr);
  EXPECT_NE(cache->Get(Key(0)), nullptr);
  EXPECT_NE(cache->Get(Key(2)), nullptr);
  EXPECT_NE(cache->Get(Key(4)), nullptr);
  EXPECT_EQ(cache->evictions(), 1u);
}

// Contains answers whether a key is cached without making it recent: the oldest entry is
// still the one evicted.
TEST(RamCacheTest, ContainsIsNotAUse) {
  auto cache = RamCache::New({(256 << 10) + 4096, 256 << 10}, nullptr);
  for (int i = 0; i < 4; ++i) cache->Insert(Key(i), MakeBuffer(64 << 10, 'a'));
  EXPECT_TRUE(cache->Contains(Key(0)));
  EXPECT_FALSE(cache->Contains(Key(5)));
  cache->Insert(Key(4), MakeBuffer(64 << 10, 'b'));
  EXPECT_FALSE(cache->Contains(Key(0)));
  EXPECT_TRUE(cache->Contains(Key(1)));
}

// Keys hash to shards and each shard evicts on its own: a cache many times the size of a file
// must still hold the whole file whatever its chunks' keys (its identity changes every run). A
// shard holds 16 of the largest entries less their bookkeeping, so any 15 stay.
TEST(RamCacheTest, AFewLargestEntriesStayWhateverShardTheirKeysHashTo) {
  constexpr size_t kChunk = 64 << 10;
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    auto cache = RamCache::New({64 * kChunk, kChunk}, nullptr);
    const cfs_client::FileVersion version{15 * kChunk, static_cast<int64_t>(rng() >> 1), rng(),
                                          static_cast<int64_t>(rng() >> 1)};
    for (uint64_t c = 0; c < 15; ++c)
      cache->Insert(ChunkKey("ckpt.bin", version, c), MakeBuffer(kChunk, 'c'));
    ASSERT_EQ(cache->evictions(), 0u) << "trial " << trial;
    ASSERT_EQ(cache->bytes(), 15 * kChunk);
  }
}

TEST(RamCacheTest, OversizedBufferIsNotCached) {
  auto cache = RamCache::New({128 << 10, 64 << 10}, nullptr);
  cache->Insert(Key(0), MakeBuffer(200 << 10, 'x'));
  EXPECT_EQ(cache->Get(Key(0)), nullptr);
  EXPECT_EQ(cache->bytes(), 0u);
}

TEST(RamCacheTest, EvictedBufferStaysValidForItsHolder) {
  auto cache = RamCache::New({128 << 10, 128 << 10}, nullptr);
  cache->Insert(Key(0), MakeBuffer(100 << 10, 'q'));
  BufferRef held = cache->Get(Key(0));
  cache->Insert(Key(1), MakeBuffer(100 << 10, 'r'));  // evicts key 0
  EXPECT_EQ(cache->Get(Key(0)), nullptr);
  EXPECT_EQ(held->data.get()[0], 'q');
  EXPECT_EQ(held->data.get()[(100 << 10) - 1], 'q');
}

TEST(RamCacheTest, FailedFetchIsNotCachedAndIsRetried) {
  auto cache = RamCache::New({1 << 20, 64 << 10}, nullptr);
  int calls = 0;
  auto failing = [&]() -> Result<BufferRef> {
    ++calls;
    return Status::IOError("backend down");
  };
  EXPECT_FALSE(cache->GetOrFetch(Key(0), failing).ok());
  EXPECT_FALSE(cache->GetOrFetch(Key(0), failing).ok());
  EXPECT_EQ(calls, 2);
  Result<Lookup> ok =
      cache->GetOrFetch(Key(0), [] { return Result<BufferRef>(MakeBuffer(10, 'z')); });
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->served, Served::kFetched);
  Result<Lookup> again = cache->GetOrFetch(Key(0), failing);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->served, Served::kCached);
  EXPECT_EQ(calls, 2);
}

TEST(RamCacheTest, ConcurrentMissesShareOneFetch) {
  auto cache = RamCache::New({1 << 20, 64 << 10}, nullptr);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> fetches{0};
  auto slow_fetch = [&]() -> Result<BufferRef> {
    fetches++;
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return release; });
    return MakeBuffer(1000, 'c');
  };
  constexpr int kThreads = 16;
  std::vector<std::thread> threads;
  std::atomic<int> fetched{0}, waited{0}, cached{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      Result<Lookup> r = cache->GetOrFetch(Key(7), slow_fetch);
      ASSERT_TRUE(r.ok());
      ASSERT_EQ(r->buffer->size, 1000u);
      ASSERT_EQ(r->buffer->data.get()[999], 'c');
      switch (r->served) {
        case Served::kFetched:
          fetched++;
          break;
        case Served::kWaited:
          waited++;
          break;
        case Served::kCached:
          cached++;
          break;
      }
    });
  }
  // Let the threads pile up on the one fetch, then release it.
  while (fetches.load() == 0) std::this_thread::yield();
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();
  EXPECT_EQ(fetches.load(), 1);
  EXPECT_EQ(fetched.load(), 1);
  EXPECT_EQ(fetched + waited + cached, kThreads);
}

TEST(RamCacheTest, ConcurrentMixedUseKeepsBudget) {
  auto cache = RamCache::New({2 << 20, 64 << 10}, nullptr);
  std::vector<std::thread> threads;
  std::atomic<bool> bad{false};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 3000; ++i) {
        int k = static_cast<int>(rng() % 200);
        size_t size = 1 + (k * 997) % (64 << 10);
        Result<Lookup> r = cache->GetOrFetch(
            Key(k), [&] { return Result<BufferRef>(MakeBuffer(size, static_cast<char>(k))); });
        if (!r.ok() || r->buffer->size != size || r->buffer->data.get()[0] != static_cast<char>(k))
          bad = true;
        if (cache->bytes() > (2u << 20)) bad = true;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(bad.load());
}

TEST(RamCacheTest, ExportsBytesAndEvictions) {
  prometheus::Registry registry;
  auto cache = RamCache::New({128 << 10, 128 << 10}, &registry);
  cache->Insert(Key(0), MakeBuffer(100 << 10, 'x'));
  cache->Insert(Key(1), MakeBuffer(100 << 10, 'y'));
  double bytes = -1, evictions = -1;
  for (const auto& family : registry.Collect()) {
    if (family.name == "cubetorchfs_cache_bytes") bytes = family.metric.at(0).gauge.value;
    if (family.name == "cubetorchfs_cache_evictions_total")
      evictions = family.metric.at(0).counter.value;
  }
  EXPECT_EQ(bytes, 100 << 10);
  EXPECT_EQ(evictions, 1);
}

// EraseFile drops every chunk of the file, of every version, and nothing else (a path that
// starts the same is another file), looking at those chunks and one more key a shard rather
// than at the whole cache.
TEST(RamCacheTest, EraseFileVisitsOnlyTheFilesChunks) {
  auto cache = RamCache::New({64 << 20, 64 << 10}, nullptr);  // 16 shards
  for (int i = 0; i < 5000; ++i) {
    std::string path = "d/f";
    path += std::to_string(i);
    cache->Insert(ChunkKey(path, {100, 1}, 0), MakeBuffer(100, 'x'));
  }
  for (uint64_t c = 0; c < 6; ++c)
    cache->Insert(ChunkKey("d/f7", {900, 2}, c), MakeBuffer(100, 'y'));
  cache->Insert(ChunkKey("d/f7", {100, 9}, 0), MakeBuffer(100, 'z'));  // an older version
  const uint64_t before = cache->erase_visits();
  cache->EraseFile("d/f7");
  // Its 8 chunks, and the other files of its bucket of each shard's files index: one a bucket
  // on average (the load factor is at most 1), so under two a shard.
  EXPECT_LE(cache->erase_visits() - before, 8u + 2u * 16u);
  EXPECT_EQ(cache->Get(ChunkKey("d/f7", {100, 1}, 0)), nullptr);
  EXPECT_EQ(cache->Get(ChunkKey("d/f7", {900, 2}, 5)), nullptr);
  EXPECT_EQ(cache->Get(ChunkKey("d/f7", {100, 9}, 0)), nullptr);
  // "d/f70" starts with "d/f7" but is another file.
  EXPECT_NE(cache->Get(ChunkKey("d/f70", {100, 1}, 0)), nullptr);
  EXPECT_NE(cache->Get(ChunkKey("d/f6", {100, 1}, 0)), nullptr);
  EXPECT_EQ(cache->bytes(), 4999u * 100);
}

}  // namespace
}  // namespace cubetorchfs::cache
