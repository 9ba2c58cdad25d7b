// The named ways, besides a service loop's own std::thread member, that code starts threads
// (docs/architecture.md, "Threads and locks"; a contract test checks no other code does):
// running one work loop on several threads, with or without a periodic tick on the caller's
// thread, one task beside the caller's work (joined when it is done), and work nobody waits
// for on a detached thread.
//
// Thread safety: each may be called from any thread; a `worker` runs concurrently with itself
// and must take its own work (e.g. from an atomic counter) and return when none is left.
#pragma once

#include <chrono>
#include <functional>
#include <system_error>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"

namespace cubetorchfs {

// Runs `worker` on this thread and on up to `threads - 1` new ones, and returns once every
// copy has returned. If the system refuses a thread (a pids limit), the copies already
// running and this thread do the work.
inline void RunOnThreads(int threads, const std::function<void()>& worker) {
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  worker();
  for (auto& t : pool) t.join();
}

// Runs `worker` on up to `threads` new threads (on this one if the system refuses them all)
// while this thread calls `tick` every `period`; returns once every copy of `worker` has
// returned, without a last tick. For a progress line drawn while the work runs.
inline void RunOnThreadsWithTick(int threads, const std::function<void()>& worker,
                                 std::chrono::milliseconds period,
                                 const std::function<void()>& tick) {
  Mutex mu;
  CondVar cv(&mu);
  bool done = false;  // guarded by mu
  std::thread runner;
  try {
    runner = std::thread([&] {
      RunOnThreads(threads, worker);
      MutexLock lock(mu);
      done = true;
      cv.SignalAll();
    });
  } catch (const std::system_error&) {
    RunOnThreads(threads, worker);
    return;
  }
  mu.lock();
  for (auto next = std::chrono::steady_clock::now() + period; !done;) {
    if (cv.WaitUntil(next) || done) continue;  // woken (perhaps spuriously), or done at the end
    mu.unlock();
    tick();
    mu.lock();
    next = std::chrono::steady_clock::now() + period;
  }
  mu.unlock();
  runner.join();
}

// Runs `fn` on a detached thread, for work nobody waits for: a release that may take long
// (the last close of a big memory file frees its pages), or a loop that ends with the
// process or when its descriptor closes (the daemon's reader of its supervisor's channel).
// False, and `fn` not run, if the system refuses a thread: the caller does without, or does
// the work itself.
inline bool RunDetached(std::function<void()> fn) {
  try {
    std::thread(std::move(fn)).detach();
    return true;
  } catch (const std::system_error&) {
    return false;
  }
}

// One task beside the caller's own work: `fn` runs on a thread of its own, joined by Join()
// or the destructor (on this thread, before the constructor returns, if the system refuses
// a thread).
class Background {
 public:
  explicit Background(const std::function<void()>& fn) {
    try {
      thread_ = std::thread(fn);
    } catch (const std::system_error&) {
      fn();
    }
  }
  ~Background() { Join(); }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
};

}  // namespace cubetorchfs
