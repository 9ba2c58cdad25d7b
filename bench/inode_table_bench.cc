// The inode table under concurrent readers: what a warm epoch asks of it per file (a lookup
// of a known name, a getattr by number, the kernel's forget), from 1..T threads at once, on a
// table of --files known files. Reports operations per second for each thread count and the
// scaling against one thread; run it before and after a change to the table's locking
// (bench/README.md has the figures).
//
//   cmake --build build --target inode_table_bench && build/bin/inode_table_bench
//   build/bin/inode_table_bench --files 100000 --threads 1,2 --seconds 2
//
// With --memory it measures instead what the table holds per known file: --files names of
// ImageNet's shape (train/n01440764/n01440764_10026.JPEG: 1,300 files a directory), looked
// up once each and given a page-resident mark (as a file read whole under keep_cache is),
// counted by malloc (mallinfo2: the index and side maps; the records are shared memory) and by
// the process's resident set (both), and then the seconds a next process takes to adopt the
// records (InodeTable::AdoptDurable: what a crash costs before the mount answers again).
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fs/inode_table.h"

namespace {

using cubetorchfs::cfs_client::FileAttr;
using cubetorchfs::fs::InodeTable;

FileAttr FileOf(uint64_t k) {
  FileAttr a;
  a.mode = S_IFREG | 0644;
  a.size = 110 << 10;
  a.blocks = 224;  // ext4's count for 110 KiB
  a.store_dev = 1;
  a.store_ino = k + 100;
  return a;
}

std::string PathOf(uint64_t k) {
  return "train/n" + std::to_string(k % 1000) + "/img_" + std::to_string(k) + ".JPEG";
}

long RssKiB() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
  std::fclose(f);
  return kib;
}

size_t MallocBytes() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

int MeasureMemory(uint64_t files) {
  FileAttr root;
  root.mode = S_IFDIR | 0755;
  const size_t heap0 = MallocBytes();
  const long rss0 = RssKiB();
  const auto began = std::chrono::steady_clock::now();
  {
    InodeTable table(root, 0);
    char path[96];
    for (uint64_t k = 0; k < files; ++k) {
      const unsigned long long dir = 1440764 + k / 1300;
      std::snprintf(path, sizeof path, "train/n%08llu/n%08llu_%llu.JPEG", dir, dir,
                    static_cast<unsigned long long>(k));
      table.Acquire(path, FileOf(k), 1);
      table.SetMark(path, k + 1);
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    const double known = static_cast<double>(table.size());
    std::printf(
        "inode_table_bench --memory: %llu files known (%.0f inodes, %zu records, %zu marked); "
        "per known inode %.1f bytes by malloc, %.1f by RSS, %.1f by the table's count; %.2f s, "
        "%.2f us a new name\n",
        static_cast<unsigned long long>(files), known, table.records(), table.marks(),
        static_cast<double>(MallocBytes() - heap0) / known,
        static_cast<double>(RssKiB() - rss0) * 1024 / known,
        static_cast<double>(table.bytes()) / known, secs, secs * 1e6 / static_cast<double>(files));
    // What a crash then costs the next process before it serves: adopting these records.
    InodeTable next(root, 0);
    next.SetGeneration(1);
    const auto adopt_began = std::chrono::steady_clock::now();
    auto adopted = next.AdoptDurable(::dup(table.durable_fd()));
    const double adopt_secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - adopt_began).count();
    if (!adopted.ok()) {
      std::fprintf(stderr, "adoption failed: %s\n", adopted.status().ToString().c_str());
      return 1;
    }
    std::printf("adopted by a next process in %.3f s: %zu records kept, %zu dropped, %zu known\n",
                adopt_secs, adopted->records, adopted->dropped, next.size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t files = 100000;
  double seconds = 2;
  std::vector<int> thread_counts = {1, 2};
  bool memory = false;
  for (int i = 1; i < argc; i += 2) {
    if (std::strcmp(argv[i], "--memory") == 0) {
      memory = true;
      --i;
    } else if (i + 1 >= argc) {
      std::fprintf(stderr, "inode_table_bench: %s needs a value\n", argv[i]);
      return 2;
    } else if (std::strcmp(argv[i], "--files") == 0) {
      files = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (std::strcmp(argv[i], "--seconds") == 0) {
      seconds = std::strtod(argv[i + 1], nullptr);
    } else if (std::strcmp(argv[i], "--threads") == 0) {
      thread_counts.clear();
      std::stringstream ss(argv[i + 1]);
      for (std::string t; std::getline(ss, t, ',');) thread_counts.push_back(std::stoi(t));
    } else {
      std::fprintf(stderr, "usage: %s [--files N] [--threads 1,2,...] [--seconds S] [--memory]\n",
                   argv[0]);
      return 2;
    }
  }
  if (files == 0 || seconds <= 0 || thread_counts.empty()) {
    std::fprintf(stderr, "inode_table_bench: --files, --seconds and --threads must be positive\n");
    return 2;
  }
  if (memory) return MeasureMemory(files);
  FileAttr root;
  root.mode = S_IFDIR | 0755;
  InodeTable table(root, 0);
  std::vector<std::string> paths(files);
  std::vector<uint64_t> inos(files);
  for (uint64_t k = 0; k < files; ++k) {
    paths[k] = PathOf(k);
    inos[k] = table.Acquire(paths[k], FileOf(k), 1);
  }
  std::printf(
      "inode_table_bench: %llu known files, %.1f s a run; per file: a lookup of its "
      "name, a getattr, a forget\n",
      static_cast<unsigned long long>(files), seconds);
  double one = 0;
  for (int threads : thread_counts) {
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> done{0};
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        std::mt19937_64 rng(static_cast<uint64_t>(t) * 7919 + 1);
        uint64_t n = 0;
        while (!stop.load(std::memory_order_relaxed)) {
          for (int b = 0; b < 256; ++b) {
            const uint64_t k = rng() % files;
            const uint64_t ino = table.Acquire(paths[k], FileOf(k), 2);
            if (ino != inos[k] || !table.Get(ino)) std::abort();
            table.Forget(ino, 1);
          }
          n += 256;
        }
        done.fetch_add(n);
      });
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    stop = true;
    for (std::thread& w : workers) w.join();
    const double rate = static_cast<double>(done.load()) / seconds;
    if (one == 0) one = rate / threads;
    std::printf("threads %2d  %10.0f files/s  %.2fx one thread\n", threads, rate, rate / one);
  }
  return 0;
}
