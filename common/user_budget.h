// A resource bounded per user and in all: descriptors, bytes, open files. Whatever one local
// user makes the daemon hold (streamed-read descriptors, directory snapshots, files open for
// writing) is taken from such a budget, so that no user can take it from everyone.
//
// Thread safety: thread-safe (one leaf mutex).
#pragma once

#include <cstdint>
#include <unordered_map>

#include "common/thread_annotations.h"

namespace cubetorchfs {

class UserBudget {
 public:
  // At most `per_uid` for one user and `total` for all.
  UserBudget(uint64_t per_uid, uint64_t total) : per_uid_(per_uid), total_(total) {}
  UserBudget(const UserBudget&) = delete;
  UserBudget& operator=(const UserBudget&) = delete;

  // Takes `n` for `uid` (-1: a user not known, counted in the total only); false, taking
  // nothing, if that would pass either bound.
  bool Take(int64_t uid, uint64_t n = 1);
  // Gives back `n` taken for `uid`.
  void Give(int64_t uid, uint64_t n = 1);
  uint64_t held() const;             // in all
  uint64_t held(int64_t uid) const;  // by `uid`

 private:
  const uint64_t per_uid_;
  const uint64_t total_;
  mutable Mutex mu_;
  uint64_t held_ GUARDED_BY(mu_) = 0;
  std::unordered_map<int64_t, uint64_t> by_uid_ GUARDED_BY(mu_);
};

}  // namespace cubetorchfs
