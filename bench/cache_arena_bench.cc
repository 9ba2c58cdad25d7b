// What the RAM cache's arena (cache/cache_arena.h) costs a crash: --files cached files of
// --min..--max bytes under ImageNet-shaped keys, in a RAM cache whose buffers come from the
// arena, then the next process's adoption of it: the allocator rebuilt from the records
// (CacheArena::Adopt, before the mount answers) and the buffers cached again
// (CacheAdopted). Prints the memfd's and the heap's bytes a file, and the seconds of each step.
//
//   cmake --build build --target cache_arena_bench && build/bin/cache_arena_bench
//   build/bin/cache_arena_bench --files 2000000 --min 1024 --max 3072
#include <fcntl.h>
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "cache/cache_arena.h"
#include "cache/ram_cache.h"

namespace {

using cubetorchfs::cache::Buffer;
using cubetorchfs::cache::CacheArena;
using cubetorchfs::cache::RamCache;

uint64_t Held(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
}

uint64_t Heap() {
  const struct mallinfo2 m = ::mallinfo2();
  return m.uordblks + m.hblkhd;
}

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t files = 1000000, min_bytes = 1024, max_bytes = 3072;
  for (int i = 1; i + 1 < argc; i += 2) {
    const uint64_t v = std::strtoull(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--files") == 0) {
      files = v;
    } else if (std::strcmp(argv[i], "--min") == 0) {
      min_bytes = v;
    } else if (std::strcmp(argv[i], "--max") == 0) {
      max_bytes = v;
    } else {
      std::fprintf(stderr, "usage: cache_arena_bench [--files N] [--min BYTES] [--max BYTES]\n");
      return 2;
    }
  }
  if (min_bytes == 0 || max_bytes < min_bytes) {
    std::fprintf(stderr, "cache_arena_bench: need 0 < --min <= --max\n");
    return 2;
  }
  const uint64_t budget = files * (max_bytes + 1024) * 2;
  auto made = CacheArena::Create(CacheArena::ReserveFor(budget));
  if (!made.ok()) {
    std::fprintf(stderr, "cache_arena_bench: %s\n", made.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<CacheArena> arena = std::move(made).value();
  Buffer::UseArena(arena.get());
  const uint64_t heap0 = Heap();
  auto cache = RamCache::New({budget, 4 << 20}, nullptr);
  std::mt19937_64 rng(1);
  char path[96];
  auto t = std::chrono::steady_clock::now();
  for (uint64_t k = 0; k < files; ++k) {
    std::snprintf(path, sizeof path, "train/n%08llu/n%08llu_%llu.JPEG",
                  static_cast<unsigned long long>(k / 1300),
                  static_cast<unsigned long long>(k / 1300), static_cast<unsigned long long>(k));
    const size_t size = min_bytes + rng() % (max_bytes - min_bytes + 1);
    auto b = Buffer::Allocate(size);
    std::memset(b->data.get(), static_cast<int>(k), size);
    cache->Insert(cubetorchfs::cache::ChunkKey(path, {size, 1}, 0), std::move(b));
  }
  const double fill_s = Since(t);
  const double memfd_per = static_cast<double>(Held(arena->fd())) / static_cast<double>(files);
  const double heap_per = static_cast<double>(Heap() - heap0) / static_cast<double>(files);

  // The next process: the memfd as its supervisor hands it over, the dead one's memory left
  // as it was (this process's cache is never touched again).
  const int fd = ::fcntl(arena->fd(), F_DUPFD_CLOEXEC, 0);
  CacheArena::Adoption adopted;
  t = std::chrono::steady_clock::now();
  auto next = CacheArena::Adopt(fd, &adopted);
  const double adopt_s = Since(t);
  if (!next.ok()) {
    std::fprintf(stderr, "cache_arena_bench: %s\n", next.status().ToString().c_str());
    return 1;
  }
  const size_t found = adopted.entries.size();
  auto cache2 = RamCache::New({budget, 4 << 20}, nullptr);
  t = std::chrono::steady_clock::now();
  cache2->BeginAdoption();
  const uint64_t kept = cubetorchfs::cache::CacheAdopted(*cache2, next->get(), &adopted);
  const double insert_s = Since(t);
  std::printf(
      "cache_arena_bench: %llu files of %llu-%llu bytes (filled in %.2f s): %.0f bytes a file "
      "in the memfd, %.0f in the heap; adoption %.3f s (%zu found, %llu dropped), cached again "
      "%llu in %.3f s\n",
      static_cast<unsigned long long>(files), static_cast<unsigned long long>(min_bytes),
      static_cast<unsigned long long>(max_bytes), fill_s, memfd_per, heap_per, adopt_s, found,
      static_cast<unsigned long long>(adopted.dropped), static_cast<unsigned long long>(kept),
      insert_s);
  // Both caches hold buffers of the one memfd: leave them to the exit rather than free
  // blocks twice (the dead process's are the next one's now).
  (void)cache.release();
  (void)arena.release();
  (void)cache2.release();
  (void)next->release();
  return found == files && kept == files ? 0 : 1;
}
