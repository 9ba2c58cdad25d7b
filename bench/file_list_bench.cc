// A registered file list (prefetch/file_lists.h) of --paths ImageNet-like paths, sent in
// pieces of 10,000 as the hook sends them: what a path costs the daemon (the list's own
// count, malloc's, and the process's resident set and peak), how long registering takes, and
// how fast shuffled positions resolve to paths. Names as ImageNet's (train/n01440764/
// n01440764_10026.JPEG: classes of 1,281 files with numbers below 60,000, sorted as
// ImageFolder lists them), continued past its 1,000 classes for larger counts (180 M paths:
// 140,516 classes); --coco gives COCO's 12-digit zero-padded ids instead.
//
//   cmake --build build --target file_list_bench && build/bin/file_list_bench --paths 180000000
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/clock.h"
#include "prefetch/file_lists.h"

namespace {

using cubetorchfs::prefetch::FileLists;

long StatusKiB(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  long kib = 0;
  const size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, key, n) == 0 && std::sscanf(line + n, ": %ld kB", &kib) == 1) break;
  std::fclose(f);
  return kib;
}

size_t MallocBytes() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

// The paths of class `c` (ImageNet-like) in the order ImageFolder lists them.
void ClassPaths(uint64_t c, std::vector<std::string>* out) {
  std::mt19937_64 rng(c * 7919 + 3);
  char cls[16];
  std::snprintf(cls, sizeof cls, "n%08llu", 1440764ull + c * 97);
  std::vector<uint64_t> numbers(1281);
  for (uint64_t& n : numbers) n = rng() % 60000;
  std::sort(numbers.begin(), numbers.end());
  for (uint64_t n : numbers) {
    char name[96];
    std::snprintf(name, sizeof name, "/data/imagenet/train/%s/%s_%llu.JPEG", cls, cls,
                  static_cast<unsigned long long>(n));
    out->emplace_back(name);
  }
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t paths = 1281167;
  bool coco = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--paths") == 0 && i + 1 < argc) {
      paths = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--coco") == 0) {
      coco = true;
    } else {
      std::fprintf(stderr, "usage: %s [--paths N] [--coco]\n", argv[0]);
      return 2;
    }
  }
  if (paths == 0 || paths > FileLists::kMaxEntries) {
    std::fprintf(stderr, "file_list_bench: --paths must be 1 to %llu\n",
                 static_cast<unsigned long long>(FileLists::kMaxEntries));
    return 2;
  }
  FileLists::Options o;
  o.max_bytes_per_uid = o.max_bytes = 4ull << 30;  // the largest the configuration allows
  FileLists lists(o, cubetorchfs::SystemClock());
  const std::string id = lists.Create(1000);
  const size_t heap0 = MallocBytes();
  const long rss0 = StatusKiB("VmRSS");
  const long hwm0 = StatusKiB("VmHWM");
  std::vector<std::string> piece, kept_first, kept_last;
  uint64_t sent = 0, path_bytes = 0, cls = 0, coco_id = 9;
  std::mt19937_64 rng(5);
  std::vector<std::string> pending;
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t next_report = paths / 10;
  while (sent < paths) {
    piece.clear();
    while (piece.size() < 10000 && sent + piece.size() < paths) {
      if (pending.empty()) {
        if (coco) {
          for (int k = 0; k < 1000; ++k) {
            coco_id += 1 + rng() % 9;
            char name[64];
            std::snprintf(name, sizeof name, "/data/coco/train2017/%012llu.jpg",
                          static_cast<unsigned long long>(coco_id));
            pending.emplace_back(name);
          }
        } else {
          ClassPaths(cls++, &pending);
        }
        std::reverse(pending.begin(), pending.end());
      }
      piece.push_back(std::move(pending.back()));
      pending.pop_back();
    }
    for (const std::string& p : piece) path_bytes += p.size();
    if (sent == 0)
      kept_first.assign(piece.begin(), piece.begin() + std::min<size_t>(piece.size(), 100));
    uint64_t first = 0, size = 0;
    std::string why;
    if (lists.Append(1000, id, piece, &first, &size, &why) != FileLists::Op::kOk) {
      std::fprintf(stderr, "file_list_bench: refused after %llu paths: %s\n",
                   static_cast<unsigned long long>(sent), why.c_str());
      return 1;
    }
    sent += piece.size();
    if (sent >= paths)
      kept_last.assign(piece.end() - std::min<size_t>(piece.size(), 100), piece.end());
    if (sent >= next_report) {
      std::fprintf(stderr, "  %llu / %llu paths registered\n",
                   static_cast<unsigned long long>(sent), static_cast<unsigned long long>(paths));
      next_report += paths / 10;
    }
  }
  const double reg_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  piece.clear();
  piece.shrink_to_fit();
  const FileLists::Stats st = lists.GetStats(1000);
  const double n = static_cast<double>(paths);
  const double heap = static_cast<double>(MallocBytes() - heap0) / n;
  const double rss = static_cast<double>(StatusKiB("VmRSS") - rss0) * 1024 / n;
  const double hwm = static_cast<double>(StatusKiB("VmHWM") - hwm0) * 1024 / n;

  // An epoch's worth of shuffled positions (at most 1 M), resolved in requests of 1,024.
  const uint64_t samples = std::min<uint64_t>(paths, 1000000);
  std::vector<uint32_t> positions(samples);
  for (uint32_t& p : positions) p = static_cast<uint32_t>(rng() % paths);
  std::vector<std::string> out;
  uint64_t refused = 0, size = 0;
  const auto t1 = std::chrono::steady_clock::now();
  for (size_t at = 0; at < positions.size(); at += 1024) {
    const std::vector<uint32_t> req(
        positions.begin() + static_cast<long>(at),
        positions.begin() + static_cast<long>(std::min(positions.size(), at + 1024)));
    out.clear();
    if (lists.Paths(1000, id, req, &out, &refused, &size) != FileLists::Op::kOk) return 1;
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t1).count() /
      static_cast<double>(samples);
  // The first and last paths sent come back as sent.
  std::vector<uint32_t> ends;
  for (uint32_t i = 0; i < kept_first.size(); ++i) ends.push_back(i);
  for (uint32_t i = 0; i < kept_last.size(); ++i)
    ends.push_back(static_cast<uint32_t>(paths - kept_last.size() + i));
  out.clear();
  if (lists.Paths(1000, id, ends, &out, &refused, &size) != FileLists::Op::kOk) return 1;
  for (size_t i = 0; i < ends.size(); ++i) {
    const std::string& want =
        i < kept_first.size() ? kept_first[i] : kept_last[i - kept_first.size()];
    if (out[i] != want) {
      std::fprintf(stderr, "file_list_bench: position %u came back as %s, not %s\n", ends[i],
                   out[i].c_str(), want.c_str());
      return 1;
    }
  }
  std::printf(
      "file_list_bench: %llu %s paths of %.1f bytes: %.2f bytes a path by the list's count, "
      "%.2f by malloc, %.2f by RSS, %.2f by peak RSS; registered in %.1f s (%.2f us a path); "
      "%llu shuffled positions resolved at %.0f ns each\n",
      static_cast<unsigned long long>(paths), coco ? "COCO-like" : "ImageNet-like",
      static_cast<double>(path_bytes) / n, static_cast<double>(st.bytes) / n, heap, rss, hwm, reg_s,
      reg_s * 1e6 / n, static_cast<unsigned long long>(samples), ns);
  return 0;
}
