// The prefetcher's read path under concurrent readers: what a warm epoch with the hook asks of
// it per file (Get of the window's copy, then OnRead), from 1..T reader threads at once, while
// its workers fetch ahead from a synthetic store. Each run publishes --files positions to one
// stream; the window fills (all of them by default: the readers' own cost is measured, not
// the workers' fetch rate), then the readers take them in order (one shared cursor, as
// DataLoader workers do) and serve each file from the window, or from the store when the
// window does not hold it (a miss). Reports files/s for each thread count, the scaling against one
// thread and the hit ratio; run it before and after a change to the prefetcher's locking
// (bench/README.md has the figures).
//
//   cmake --build build --target prefetcher_bench && build/bin/prefetcher_bench
//   build/bin/prefetcher_bench --files 100000 --threads 1,2,4 [--window 4096]
#include <prometheus/registry.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/clock.h"
#include "prefetch/prefetcher.h"

namespace {

using cubetorchfs::cfs_client::Backend;
using cubetorchfs::cfs_client::FileVersion;
using cubetorchfs::prefetch::Prefetcher;
using cubetorchfs::prefetch::ReadOutcome;

}  // namespace

int main(int argc, char** argv) {
  uint64_t files = 100000;
  uint64_t window = 0;  // 0: --files
  std::vector<int> thread_counts = {1, 2, 4};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--files") == 0) {
      files = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (std::strcmp(argv[i], "--window") == 0) {
      window = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (std::strcmp(argv[i], "--threads") == 0) {
      thread_counts.clear();
      std::stringstream ss(argv[i + 1]);
      for (std::string t; std::getline(ss, t, ',');) thread_counts.push_back(std::stoi(t));
    } else {
      std::fprintf(stderr, "usage: %s [--files N] [--window W] [--threads 1,2,...]\n", argv[0]);
      return 2;
    }
  }
  if (files == 0 || thread_counts.empty()) {
    std::fprintf(stderr, "prefetcher_bench: --files and --threads must be positive\n");
    return 2;
  }
  if (window == 0) window = files;
  cubetorchfs::conf::SyntheticOptions so;
  so.dirs = (files + 1279) / 1280;
  so.files_per_dir = 1280;
  std::unique_ptr<Backend> store = cubetorchfs::cfs_client::NewSyntheticBackend(so);
  std::vector<std::string> paths;
  std::vector<FileVersion> versions;
  for (uint64_t d = 0; d < so.dirs && paths.size() < files; ++d) {
    char dir[32];
    std::snprintf(dir, sizeof(dir), "n%08llu", static_cast<unsigned long long>(d));
    for (uint64_t i = 0; i < so.files_per_dir && paths.size() < files; ++i) {
      paths.push_back(std::string(dir) + "/" + dir + "_" + std::to_string(i) + ".JPEG");
      auto attr = store->Stat(paths.back());
      if (!attr.ok()) {
        std::fprintf(stderr, "prefetcher_bench: %s: %s\n", paths.back().c_str(),
                     attr.status().ToString().c_str());
        return 1;
      }
      versions.push_back(attr->Version());
    }
  }
  std::printf(
      "prefetcher_bench: %llu files of 1-3 KiB, window %llu files; per file: Get, then OnRead "
      "of the whole file\n",
      static_cast<unsigned long long>(files), static_cast<unsigned long long>(window));
  double one = 0;
  for (int threads : thread_counts) {
    prometheus::Registry registry;
    auto ram = cubetorchfs::cache::RamCache::New({1ull << 30, 64 << 10}, nullptr);
    Prefetcher::Options o;
    o.prefetch.window_files = window;
    o.prefetch.max_inflight = 16;
    o.max_queued_paths_per_uid = files;
    o.max_queued_paths = 4 * files;
    o.max_queued_path_bytes_per_uid = 1ull << 30;
    o.max_queued_path_bytes = 4ull << 30;
    o.window_budget_bytes = 4ull << 30;
    Prefetcher pf(o, store.get(), ram.get(), cubetorchfs::SystemClock(), &registry);
    const std::string id = pf.CreateStream("bench", 1);
    Prefetcher::Refusal refusal;
    if (pf.PublishAs(0, id, paths, false, nullptr, &refusal) != Prefetcher::Op::kOk) {
      std::fprintf(stderr, "prefetcher_bench: the publish was refused (limit %d: %llu)\n",
                   static_cast<int>(refusal.limit), static_cast<unsigned long long>(refusal.value));
      return 1;
    }
    // The window fills first (--window files of the --files; all by default), so that the
    // readers' own cost is measured, not the workers' fetch rate.
    const uint64_t ahead = std::min(window, files);
    for (int wait = 0; pf.GetStats().fetched < ahead; ++wait) {
      if (wait == 6000) {
        std::fprintf(stderr, "prefetcher_bench: the window did not fill in 60 s\n");
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::atomic<uint64_t> cursor{0};
    std::vector<std::thread> readers;
    rusage before{};
    getrusage(RUSAGE_SELF, &before);
    const auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      readers.emplace_back([&] {
        std::vector<char> buf(4096);
        for (uint64_t k; (k = cursor.fetch_add(1)) < files;) {
          const FileVersion& v = versions[k];
          ReadOutcome outcome = ReadOutcome::kHit;
          if (auto w = pf.Get(paths[k], v, 0)) {
            if (w->waited) outcome = ReadOutcome::kLate;
          } else {
            outcome = ReadOutcome::kMiss;
            if (!store->StatRead(paths[k], buf.size(), buf.data()).ok()) std::abort();
          }
          pf.OnRead(paths[k], v, 0, v.size, outcome, /*to_kernel=*/true, 0);
        }
      });
    for (std::thread& r : readers) r.join();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rusage after{};
    getrusage(RUSAGE_SELF, &after);
    // Waits: voluntary context switches (a thread blocked on a lock, or a woken worker).
    const auto cpu_us = [](const rusage& r) {
      return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1e6 +
             static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
    };
    const double waits = static_cast<double>(after.ru_nvcsw - before.ru_nvcsw);
    const double us_per_file = (cpu_us(after) - cpu_us(before)) / static_cast<double>(files);
    const auto stats = pf.GetStats();
    const double rate = static_cast<double>(files) / secs;
    if (one == 0) one = rate / threads;
    const uint64_t all = stats.reads.hit + stats.reads.late + stats.reads.miss;
    std::printf(
        "threads %2d  %10.0f files/s  %.2fx one thread  %.2f us CPU/file  %.3f waits/file  "
        "hit %.4f  late %llu  miss %llu\n",
        threads, rate, rate / one, us_per_file, waits / static_cast<double>(files),
        all ? static_cast<double>(stats.reads.hit) / static_cast<double>(all) : 0.0,
        static_cast<unsigned long long>(stats.reads.late),
        static_cast<unsigned long long>(stats.reads.miss));
  }
  return 0;
}
