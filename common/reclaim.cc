#include "common/reclaim.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>

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

}  // namespace cubetorchfs
