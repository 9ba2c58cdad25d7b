// Lock annotations that clang's -Wthread-safety checks (scripts/thread_safety.sh runs it in
// CI on the files that use them); with other compilers they expand to nothing.
//
// std::mutex carries no annotations in libstdc++, so annotated members are a Mutex, locked
// with MutexLock (a scoped lock) or, where a condition variable waits on it, through
// native() with the wait's predicate reading only what the annotations cannot see.
//
// Thread safety: Mutex is a std::mutex, SharedMutex a std::shared_mutex.
#pragma once

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
#define NO_THREAD_SAFETY_ANALYSIS CTFS_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace cubetorchfs {

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  std::mutex mu_;
};

// Holds `mu` for its own lifetime.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
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
