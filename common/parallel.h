// Running one work loop on several threads.
//
// Thread safety: RunOnThreads may be called from any thread; `worker` runs concurrently with
// itself and must take its own work (e.g. from an atomic counter) and return when none is left.
#pragma once

#include <functional>
#include <system_error>
#include <thread>
#include <vector>

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

}  // namespace cubetorchfs
