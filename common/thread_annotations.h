// Lock annotations that clang's -Wthread-safety checks (scripts/thread_safety.sh runs it in
// CI on the files that use them); with other compilers they expand to nothing.
//
// std::mutex carries no annotations in libstdc++, so every lock of the project is a Mutex
// (locked with MutexLock, a scoped lock) or a SharedMutex, and a thread that waits for a change
// under one waits on a CondVar bound to it. A wait is a loop the caller writes,
// `while (!ready_) cv_.Wait();`, so the condition is read under the lock where the analysis sees
// it held. The one std::mutex left outside this file is libcurl's share lock
// (cfs_client/s3_transport.cc), which libcurl takes and releases from two callbacks and which
// guards no field of the project.
//
// Thread safety: Mutex is a std::mutex, SharedMutex a std::shared_mutex, CondVar a
// std::condition_variable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#if defined(__clang__)
#define CTFS_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define CTFS_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) CTFS_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY CTFS_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) CTFS_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) CTFS_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) CTFS_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) CTFS_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) CTFS_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) CTFS_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) CTFS_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) CTFS_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) CTFS_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define REQUIRES_SHARED(...) CTFS_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) CTFS_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) CTFS_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) CTFS_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS CTFS_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace cubetorchfs {

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the calling thread holds this mutex, where a lock it cannot follow
  // (a std::unique_lock<Mutex> returned or moved between scopes) took it. Checks nothing.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// A condition variable bound to one Mutex, which the caller holds around every Wait: the
// wait releases it while asleep and holds it again on return. Wakeups may be spurious.
class CondVar {
 public:
  explicit CondVar(Mutex* mu) : mu_(mu) {}
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait() {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Returns false once `deadline` has passed.
  template <class Clock, class Duration>
  bool WaitUntil(const std::chrono::time_point<Clock, Duration>& deadline) {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  // Returns false once `timeout` has passed.
  template <class Rep, class Period>
  bool WaitFor(const std::chrono::duration<Rep, Period>& timeout) {
    return WaitUntil(std::chrono::steady_clock::now() + timeout);
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  Mutex* const mu_;
  std::condition_variable cv_;
};

// Holds `mu` for its own lifetime, but while let go by Unlock() (until Lock()).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_.unlock();
  }
  void Unlock() RELEASE() {
    mu_.unlock();
    held_ = false;
  }
  void Lock() ACQUIRE() {
    mu_.lock();
    held_ = true;
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
  bool held_ = true;
};

// A reader-writer lock: many holders in shared mode (ReaderLock), or one in exclusive mode
// (WriterLock).
class CAPABILITY("mutex") SharedMutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  void lock_shared() ACQUIRE_SHARED() { mu_.lock_shared(); }
  void unlock_shared() RELEASE_SHARED() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Holds `mu` shared for its own lifetime.
class SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex& mu) ACQUIRE_SHARED(mu) : mu_(mu) { mu_.lock_shared(); }
  ~ReaderLock() RELEASE() { mu_.unlock_shared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex& mu_;
};

// Holds `mu` exclusively for its own lifetime.
class SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~WriterLock() RELEASE() { mu_.unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  SharedMutex& mu_;
};

}  // namespace cubetorchfs
