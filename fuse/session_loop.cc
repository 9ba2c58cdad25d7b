#include "fuse/session_loop.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::fuse {
namespace {

// Interrupts a worker's read(); the handler does nothing (and has no SA_RESTART).
int WakeSignal() { return SIGRTMIN + 2; }

void NoOp(int) {}

class Loop {
 public:
  Loop(fuse_session* se, int max_threads, const std::atomic<bool>* stop)
      : se_(se), max_threads_(max_threads), stop_(stop) {}

  bool Ending() const { return fuse_session_exited(se_) || (stop_ != nullptr && stop_->load()); }

  int Run(int min_threads) {
    struct sigaction sa {};
    sa.sa_handler = NoOp;
    sigemptyset(&sa.sa_mask);
    ::sigaction(WakeSignal(), &sa, nullptr);
    {
      MutexLock l(mu_);
      for (int i = 0; i < min_threads; ++i) StartLocked();
      started_.store(static_cast<int>(workers_.size()));
    }
    while (!Ending()) {
      MutexLock l(mu_);
      cv_.WaitFor(std::chrono::milliseconds(50));
    }
    // Wake every worker until all are gone: one that was between its check of the exit flag
    // and read() when a signal came would otherwise sleep on.
    for (;;) {
      std::vector<pthread_t> live;
      {
        MutexLock l(mu_);
        if (running_ == 0) break;
        for (auto& w : workers_) live.push_back(w.native_handle());
      }
      for (pthread_t t : live) ::pthread_kill(t, WakeSignal());
      MutexLock l(mu_);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
      while (running_ != 0 && cv_.WaitUntil(deadline)) {
      }
    }
    MutexLock l(mu_);  // (no worker is left to want it)
    for (auto& w : workers_) w.join();
    return error_.load();
  }

 private:
  void StartLocked() REQUIRES(mu_) {
    ++running_;
    workers_.emplace_back([this] { Work(); });
  }

  void Work() {
    fuse_buf buf{};
    while (!Ending()) {
      const int res = fuse_session_receive_buf(se_, &buf);
      if (res == -EINTR || res == -EAGAIN || res == -ENOENT) continue;
      if (res <= 0) {  // 0: the connection ended (unmounted)
        if (res < 0) error_.store(res);
        fuse_session_exit(se_);
        break;
      }
      if (busy_.fetch_add(1) + 1 >= started_.load() && started_.load() < max_threads_) {
        MutexLock l(mu_);
        if (static_cast<int>(workers_.size()) < max_threads_ && !Ending()) {
          StartLocked();
          started_.store(static_cast<int>(workers_.size()));
        }
      }
      fuse_session_process_buf(se_, &buf);
      busy_.fetch_sub(1);
    }
    std::free(buf.mem);
    MutexLock l(mu_);
    --running_;
    cv_.SignalAll();
  }

  fuse_session* const se_;
  const int max_threads_;
  const std::atomic<bool>* const stop_;
  std::atomic<int> error_{0};
  std::atomic<int> busy_{0};
  std::atomic<int> started_{0};
  Mutex mu_;
  CondVar cv_{&mu_};
  std::vector<std::thread> workers_ GUARDED_BY(mu_);
  int running_ GUARDED_BY(mu_) = 0;
};

}  // namespace

int RunSessionLoop(fuse_session* se, int min_threads, int max_threads,
                   const std::atomic<bool>* stop) {
  Loop loop(se, max_threads, stop);
  return loop.Run(min_threads);
}

}  // namespace cubetorchfs::fuse
