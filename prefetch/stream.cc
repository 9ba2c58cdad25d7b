#include "prefetch/stream.h"

#include <algorithm>

#include "prefetch/queued_paths.h"

namespace cubetorchfs::prefetch {
namespace {

// The index of pending files is rehashed smaller when it has this many buckets or more and
// over 4 per entry (its bucket array is never given back otherwise).
constexpr size_t kShrinkBuckets = 1024;

}  // namespace

void Stream::Append(std::string&& path, uint64_t key) {
  pending[key].push_back(end());
  paths.push_back(std::move(path));
  states.push_back(kPending);
}

std::optional<uint64_t> Stream::FirstPending(uint64_t key, std::string_view path) const {
  auto p = pending.find(key);
  if (p == pending.end()) return std::nullopt;
  // Ascending; another path of the same hash shares the entry (never seen, but possible).
  for (uint64_t pos : p->second)
    if (paths[pos - base] == path) return pos;
  return std::nullopt;
}

void Stream::Unpend(uint64_t key, uint64_t pos) {
  auto p = pending.find(key);
  if (p == pending.end()) return;
  auto& positions = p->second;
  auto found = std::find(positions.begin(), positions.end(), pos);
  if (found != positions.end()) positions.erase(found);
  if (positions.empty())
    pending.erase(p);
  else if (positions.capacity() > 4 * positions.size() + 8)
    positions.shrink_to_fit();  // a path published many times keeps no stale block
}

std::pair<uint64_t, uint64_t> Stream::PopConsumed() {
  uint64_t popped = 0, bytes = 0;
  while (base < low) {
    bytes += QueuedPaths::Cost(paths.front().size());
    paths.pop_front();
    states.pop_front();
    base++;
    popped++;
  }
  queued_bytes -= bytes;
  // The deques free their blocks as they empty; the index of pending files keeps its buckets:
  // rehashed to fit when mostly empty, so what a stream holds follows what it has queued
  // (QueuedPaths::Cost counts 4 buckets a path).
  if (pending.bucket_count() >= kShrinkBuckets && pending.bucket_count() > 4 * pending.size())
    pending.rehash(0);
  return {popped, bytes};
}

}  // namespace cubetorchfs::prefetch
