#include "common/thread_annotations.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace cubetorchfs {
namespace {

TEST(CondVarTest, AWaiterWakesToTheChangeMadeUnderTheLock) {
  Mutex mu;
  CondVar cv(&mu);
  bool ready = false;
  std::thread setter([&] {
    MutexLock lock(mu);
    ready = true;
    cv.SignalAll();
  });
  {
    MutexLock lock(mu);
    while (!ready) cv.Wait();
    EXPECT_TRUE(ready);
  }
  setter.join();
  // The lock is free again once the waiter's scope ends.
  bool free_again = false;
  if (mu.try_lock()) {
    free_again = true;
    mu.unlock();
  }
  EXPECT_TRUE(free_again);
}

TEST(CondVarTest, ATimedWaitReturnsFalseAtItsDeadlineStillHoldingTheLock) {
  Mutex mu;
  CondVar cv(&mu);
  MutexLock lock(mu);
  const auto start = std::chrono::steady_clock::now();
  bool woken = true;
  while (woken) woken = cv.WaitFor(std::chrono::milliseconds(20));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(20));
  // Still held: another thread cannot take it.
  bool taken = true;
  std::thread other([&] {
    taken = false;
    if (mu.try_lock()) {
      taken = true;
      mu.unlock();
    }
  });
  other.join();
  EXPECT_FALSE(taken);
}

// Whether another thread can take `mu` now (and gives it back).
bool FreeForOthers(Mutex& mu) {
  bool taken = false;
  std::thread other([&] {
    if (mu.try_lock()) {
      taken = true;
      mu.unlock();
    }
  });
  other.join();
  return taken;
}

TEST(MutexLockTest, UnlockFreesTheMutexUntilLockAndTheEndOfScopeFreesItOnce) {
  Mutex mu;
  {
    MutexLock lock(mu);
    EXPECT_FALSE(FreeForOthers(mu));
    lock.Unlock();
    EXPECT_TRUE(FreeForOthers(mu));
    lock.Lock();
    EXPECT_FALSE(FreeForOthers(mu));
  }
  EXPECT_TRUE(FreeForOthers(mu));
  {
    MutexLock lock(mu);
    lock.Unlock();  // left unlocked: the destructor does not unlock again
  }
  EXPECT_TRUE(FreeForOthers(mu));
}

}  // namespace
}  // namespace cubetorchfs
