#include "common/reclaim.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <string>

#include "common/unique_fd.h"

namespace cubetorchfs {

std::optional<uint64_t> ReclaimCounterOf(std::string_view vmstat) {
  uint64_t sum = 0;
  bool seen = false;
  while (!vmstat.empty()) {
    const size_t eol = vmstat.find('\n');
    std::string_view line = vmstat.substr(0, eol);
    vmstat.remove_prefix(eol == std::string_view::npos ? vmstat.size() : eol + 1);
    const size_t space = line.find(' ');
    if (space == std::string_view::npos) continue;
    const std::string_view name = line.substr(0, space);
    // Pages reclaimed from the LRU lists, pages freed with inodes the kernel evicted to make
    // room (their page cache goes with them), and drop_caches: of the page cache, and of the
    // inode cache (drop_slab), whose inodes take their pages along.
    if (!name.starts_with("pgsteal_") && name != "pginodesteal" && name != "kswapd_inodesteal" &&
        name != "drop_pagecache" && name != "drop_slab")
      continue;
    uint64_t v = 0;
    const std::string_view digits = line.substr(space + 1);
    if (std::from_chars(digits.data(), digits.data() + digits.size(), v).ec != std::errc())
      continue;
    sum += v;
    seen = seen || name.starts_with("pgsteal_");
  }
  if (!seen) return std::nullopt;
  return sum;
}

std::optional<uint64_t> ReadReclaimCounter() {
  UniqueFd fd(::open("/proc/vmstat", O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return std::nullopt;
  char buf[16384];  // about 5 KiB on 6.x kernels
  size_t used = 0;
  while (used < sizeof(buf)) {
    const ssize_t n = ::read(fd.get(), buf + used, sizeof(buf) - used);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::nullopt;
    if (n == 0) break;
    used += static_cast<size_t>(n);
  }
  return ReclaimCounterOf(std::string_view(buf, used));
}

namespace {

// The first line of a small sysfs file, or "" if it cannot be read.
std::string FirstLine(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return "";
  char buf[256];
  ssize_t n;
  do {
    n = ::read(fd.get(), buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return "";
  std::string line(buf, static_cast<size_t>(n));
  return line.substr(0, line.find('\n'));
}

// The numbered entries 0 .. N-1 of a DAMON sysfs directory, N from its `nr_*` file; at most
// 64 looked at.
uint64_t Count(const std::string& file) {
  const std::string text = FirstLine(file);
  uint64_t n = 0;
  if (std::from_chars(text.data(), text.data() + text.size(), n).ec != std::errc()) return 0;
  return std::min<uint64_t>(n, 64);
}

}  // namespace

bool ProactivePageoutActive(const std::string& damon_root, const std::string& reclaim_enabled) {
  const std::string enabled = FirstLine(reclaim_enabled);
  if (enabled == "Y" || enabled == "1") return true;
  for (uint64_t k = 0, nk = Count(damon_root + "/nr_kdamonds"); k < nk; ++k) {
    const std::string kd = damon_root + "/" + std::to_string(k);
    if (FirstLine(kd + "/state") != "on") continue;
    for (uint64_t c = 0, nc = Count(kd + "/contexts/nr_contexts"); c < nc; ++c) {
      const std::string ctx = kd + "/contexts/" + std::to_string(c);
      for (uint64_t s = 0, ns = Count(ctx + "/schemes/nr_schemes"); s < ns; ++s)
        if (FirstLine(ctx + "/schemes/" + std::to_string(s) + "/action") == "pageout") return true;
    }
  }
  return false;
}

}  // namespace cubetorchfs
