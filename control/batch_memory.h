// What the memory files of POST /v1/files/batch hold, charged to the user who asked for each
// until its pages are gone (docs/security.md, "Bounded resources").
//
// A memory file's pages are the daemon's (charged to its cgroup) for as long as anything
// references the file: a descriptor, a mapping (which outlives the descriptor it was made
// from), a descriptor in flight in a unix socket, another open of it through /proc. The daemon
// learns when the last such reference goes from the kernel: before handing a memory file out it
// puts an inotify watch on it (IN_DELETE_SELF). A memory file has no name, so the kernel drops
// its dentry, and with it the watch (IN_IGNORED), exactly when the last open file description
// of it is released; a descriptor (and its dups and forks), a mapping, a descriptor in flight
// and a reopen through /proc each hold one. A watch holds the inode, not its dentry: it never
// keeps the pages alive itself. The charge is given back when the watch is gone, read from the
// inotify queue at each batch (or, had the queue overflowed, from /proc/self/fdinfo of the
// inotify descriptor, which lists the live watches).
//
// Not counted: pages a user spliced into a pipe or pinned (io_uring buffers) before closing the
// file; the kernel bounds those per user (fs.pipe-user-pages-soft, RLIMIT_MEMLOCK).
//
// Thread safety: thread-safe (one leaf mutex).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>

#include "common/status.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::control {

class BatchMemory {
 public:
  struct Options {
    // Outstanding memory files of one user: their bytes (control.batch_memory_bytes_per_uid)
    // and their number (each is a watch of the daemon's, and root's watches are shared).
    uint64_t bytes_per_uid = 1ull << 30;
    uint64_t files_per_uid = 1024;
    uint64_t files = 8192;  // all users
    // The memory left (ModelFetcher::AvailableMemory: MemAvailable or the cgroup's room).
    std::function<uint64_t()> available;
    // A batch up to this size is checked against a reading at most `reading_ns` old, less
    // what batches took since; a larger one against a fresh one.
    uint64_t fresh_above = 4ull << 20;
    uint64_t reading_ns = 100'000'000;
  };
  // Why a batch is not built.
  struct Refusal {
    bool memory = false;  // the memory left (503), not the user's bound (429)
    std::string message;
  };

  explicit BatchMemory(Options options);
  ~BatchMemory();
  BatchMemory(const BatchMemory&) = delete;
  BatchMemory& operator=(const BatchMemory&) = delete;

  // Charges a batch of `bytes` to `uid` before it is built, after giving back what memory
  // files now gone held. Refused when it would take the user past its bounds, or when all the
  // batches outstanding, this one included, would hold more than half of the memory there
  // would be without them: true, with *why, if refused (nothing charged).
  bool Take(uid_t uid, uint64_t bytes, Refusal* why);
  // Gives back what Take charged (the batch was not handed out).
  void Give(uid_t uid, uint64_t bytes);
  // Keeps the charge of a batch taken for `uid` until the last reference of its memory file
  // `fd` is gone. On failure (no watch could be had), the charge is given back and the batch
  // must not be handed out.
  Status Follow(uid_t uid, uint64_t bytes, int fd);

  // What is charged now (after giving back what is gone): bytes and files, of `uid` or all.
  uint64_t bytes(uid_t uid);
  uint64_t bytes();
  uint64_t files();
  // Gives back, as after an overflow of the inotify queue, what /proc/self/fdinfo shows gone;
  // the bytes given back.
  uint64_t ReconcileForTest();

  // A charge: the bytes rounded up to whole pages, one page at least.
  static uint64_t Charge(uint64_t bytes);

 private:
  struct Use {
    uint64_t bytes = 0, files = 0;
  };
  struct Held {
    uid_t uid;
    uint64_t bytes;
  };
  void ReapLocked() REQUIRES(mu_);
  uint64_t ReconcileLocked() REQUIRES(mu_);  // the bytes given back
  void ReleaseLocked(uid_t uid, uint64_t bytes) REQUIRES(mu_);
  uint64_t AvailableLocked(uint64_t bytes) REQUIRES(mu_);

  const Options options_;
  const int inotify_fd_;  // -1: none could be had (every batch is refused)
  Mutex mu_;
  std::unordered_map<int, Held> watched_ GUARDED_BY(mu_);  // by watch descriptor
  std::unordered_map<uid_t, Use> by_uid_ GUARDED_BY(mu_);
  Use all_ GUARDED_BY(mu_);
  // The last reading of the memory left, when it was made, and what batches took since.
  uint64_t reading_ GUARDED_BY(mu_) = 0;
  uint64_t reading_at_ns_ GUARDED_BY(mu_) = 0;
  uint64_t taken_since_ GUARDED_BY(mu_) = 0;
};

}  // namespace cubetorchfs::control
