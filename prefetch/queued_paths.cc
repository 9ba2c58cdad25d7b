#include "prefetch/queued_paths.h"

#include <algorithm>

namespace cubetorchfs::prefetch {
namespace {

// The heap block glibc's malloc gives a std::string of `len` bytes (none up to 15: they are
// stored inline): the bytes and the NUL plus an 8-byte header, in 16-byte steps, 32 at least.
uint64_t StringHeapBytes(size_t len) {
  if (len < 16) return 0;
  return std::max<uint64_t>(32, (static_cast<uint64_t>(len) + 1 + 8 + 15) & ~uint64_t{15});
}

// A queued position's fixed part, with libstdc++ and glibc (x86-64 and aarch64): the path's
// std::string in the stream's deque (32) and its state byte (1), plus the deque blocks'
// headers; in the index of pending files, keyed by the path's 64-bit hash, the node (next
// pointer, key, positions vector: 40, a 48-byte block), the positions vector's block (32),
// and buckets (8 each, kept at most 4 per entry: 32). 145 in all, rounded up.
// PrefetcherTest.QueuedPathCostCoversWhatPublishAllocates measures it against malloc's count.
constexpr uint64_t kOverhead = 160;

}  // namespace

uint64_t QueuedPaths::Cost(size_t path_bytes) {
  // The path once: the stream's copy (the index of pending files is keyed by its hash).
  return kOverhead + StringHeapBytes(path_bytes);
}

std::optional<QueuedPaths::Refusal> QueuedPaths::Check(uid_t uid, uint64_t n,
                                                       uint64_t bytes) const {
  const auto mine_it = by_uid_.find(uid);
  const Held mine = mine_it == by_uid_.end() ? Held{} : mine_it->second;
  const uint64_t users = by_uid_.size() + (mine_it == by_uid_.end() ? 1 : 0);
  struct Bound {
    Limit limit;
    uint64_t value, held;
    bool bytes;
  };
  const Bound bounds[] = {
      {Limit::kUserPaths, limits_.paths_per_uid, mine.paths, false},
      {Limit::kUserBytes, limits_.bytes_per_uid, mine.bytes, true},
      {Limit::kSharePaths, limits_.paths / (users + 1), mine.paths, false},
      {Limit::kShareBytes, limits_.bytes / (users + 1), mine.bytes, true},
      {Limit::kPoolPaths, limits_.paths, all_.paths, false},
      {Limit::kPoolBytes, limits_.bytes, all_.bytes, true},
  };
  for (const Bound& b : bounds) {
    const uint64_t asked = b.bytes ? bytes : n;
    if (b.held + asked > b.value) return Refusal{b.limit, b.value, b.held, asked, users};
  }
  return std::nullopt;
}

void QueuedPaths::Add(uid_t uid, uint64_t n, uint64_t bytes) {
  if (n == 0 && bytes == 0) return;
  Held& h = by_uid_[uid];
  h.paths += n;
  h.bytes += bytes;
  all_.paths += n;
  all_.bytes += bytes;
}

void QueuedPaths::Remove(uid_t uid, uint64_t n, uint64_t bytes) {
  if (n == 0 && bytes == 0) return;
  all_.paths -= n;
  all_.bytes -= bytes;
  auto h = by_uid_.find(uid);
  if (h == by_uid_.end()) return;
  h->second.paths -= n;
  h->second.bytes -= bytes;
  if (h->second.paths == 0) by_uid_.erase(h);
}

}  // namespace cubetorchfs::prefetch
