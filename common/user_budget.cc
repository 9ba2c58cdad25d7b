#include "common/user_budget.h"

#include <algorithm>

namespace cubetorchfs {

bool UserBudget::Take(int64_t uid, uint64_t n) {
  MutexLock l(mu_);
  if (n > total_ - std::min(held_, total_)) return false;
  if (uid >= 0) {
    auto it = by_uid_.find(uid);
    const uint64_t mine = it == by_uid_.end() ? 0 : it->second;
    if (n > per_uid_ - std::min(mine, per_uid_)) return false;
  }
  by_uid_[uid] += n;
  held_ += n;
  return true;
}

void UserBudget::Give(int64_t uid, uint64_t n) {
  MutexLock l(mu_);
  auto it = by_uid_.find(uid);
  if (it == by_uid_.end()) return;
  n = std::min(n, it->second);
  if ((it->second -= n) == 0) by_uid_.erase(it);
  held_ -= n;
}

uint64_t UserBudget::held() const {
  MutexLock l(mu_);
  return held_;
}

uint64_t UserBudget::held(int64_t uid) const {
  MutexLock l(mu_);
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? 0 : it->second;
}

}  // namespace cubetorchfs
