// The prefetcher's queue bounds: stream positions not yet read or skipped, counted per user and
// for all users, in number and in memory, and the limits a publish must keep (docs/security.md):
// each user's own, its fair share of the global ones, and the global ones.
//
// Not thread-safe: the prefetcher's mutex guards it.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>

namespace cubetorchfs::prefetch {

class QueuedPaths {
 public:
  // The queued-path limit a publish would have passed.
  enum class Limit {
    kNone,
    kUserPaths,   // max_queued_paths_per_uid
    kUserBytes,   // max_queued_path_bytes_per_uid
    kSharePaths,  // max_queued_paths / (users + 1): the user's fair share of the global count
    kShareBytes,  // max_queued_path_bytes / (users + 1)
    kPoolPaths,   // max_queued_paths: all users together
    kPoolBytes,   // max_queued_path_bytes
  };
  struct Refusal {
    Limit limit = Limit::kNone;
    uint64_t value = 0;  // the limit: paths or bytes
    uint64_t held = 0;   // what the user (all users, for kPool*) held already
    uint64_t asked = 0;  // what the publish would have added (paths or bytes)
    uint64_t users = 0;  // users with positions queued, the publisher included
  };
  struct Limits {
    uint64_t paths_per_uid = 0, bytes_per_uid = 0;  // one user
    uint64_t paths = 0, bytes = 0;                  // all users
  };
  explicit QueuedPaths(const Limits& limits) : limits_(limits) {}

  // What one queued position costs in memory for a path of `path_bytes`: the stream's copy
  // with its heap block as glibc sizes it, its state byte, and its entry in the stream's index
  // of pending files (measured with libstdc++: see the .cc). A repeated path shares its index
  // entry and costs less: this is an upper bound.
  static uint64_t Cost(size_t path_bytes);

  // The first limit `n` more positions costing `bytes` would take user `uid` past, if any.
  // The global limits are shared: with `users` users queuing (`uid` included), one may hold a
  // (users + 1)-th of each, which leaves a share for a user with nothing queued yet.
  std::optional<Refusal> Check(uid_t uid, uint64_t n, uint64_t bytes) const;
  void Add(uid_t uid, uint64_t n, uint64_t bytes);
  void Remove(uid_t uid, uint64_t n, uint64_t bytes);

  uint64_t paths() const { return all_.paths; }
  uint64_t bytes() const { return all_.bytes; }
  uint64_t users() const { return by_uid_.size(); }

 private:
  struct Held {
    uint64_t paths = 0, bytes = 0;
  };
  const Limits limits_;
  std::unordered_map<uid_t, Held> by_uid_;  // users with positions queued
  Held all_;
};

}  // namespace cubetorchfs::prefetch
