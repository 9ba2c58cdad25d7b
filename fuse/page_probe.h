// Asks the kernel whether its page cache still holds a file of the mount.
//
// FUSE_NOTIFY_RETRIEVE makes the kernel send back the pages of an inode it holds in a range,
// up to the first page it lacks. The probe asks for the file's first page and its last page:
// the pages of a file read whole are dropped together, oldest first, so those two stand for
// the file, and a probe moves two pages through /dev/fuse however large the file is. A page
// dropped from the middle of a larger file is not seen: its read reaches the daemon.
//
// The answer comes back as a request (retrieve_reply) on a FUSE thread; Resident() waits
// for it, at most `timeout` for each of its two retrieves. A kernel that does not know the inode, a
// failed notify or no answer in time all mean "not resident": the caller fetches the file, which is
// always safe.
//
// Thread-safe. Attach() once the session exists; Close() before it is destroyed (it waits for
// notifies being sent). Resident() answers false before Attach() and after Close(). What it
// sends goes through a Kernel: libfuse's notifications on the session, or a fake in tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/thread_annotations.h"
#include "prefetch/prefetcher.h"

struct fuse_session;  // libfuse's

namespace cubetorchfs::fs {
class FileSystem;
}

namespace cubetorchfs::fuse {

class PageProbe {
 public:
  // The two notifications the probe sends; each returns 0 or a negative errno. Called with no
  // lock held, from many threads at once.
  class Kernel {
   public:
    virtual ~Kernel() = default;
    // FUSE_NOTIFY_RETRIEVE of [offset, offset + len) of `ino`; the answer comes to OnReply
    // with `cookie`.
    virtual int Retrieve(uint64_t ino, uint64_t offset, uint64_t len, void* cookie) = 0;
    // FUSE_NOTIFY_STORE of `size` bytes at `data` into `ino` from offset 0.
    virtual int Store(uint64_t ino, const char* data, size_t size) = 0;
  };

  explicit PageProbe(std::chrono::milliseconds timeout = std::chrono::milliseconds(1000));
  ~PageProbe();

  void Attach(fuse_session* session);  // libfuse's notifications on `session`
  void Attach(Kernel* kernel);         // `kernel` must outlive the probe's use of it (Close)
  // No retrieve or store starts until Resume(); returns once those under way are done. Called
  // before a handover while the loop still serves: a store waits for the page lock a read of
  // the kernel's own holds until the loop answers that read.
  void Pause();
  void Resume();
  // Whether the kernel's page cache holds the first and last page of inode `ino` (`size`
  // bytes).
  bool Resident(uint64_t ino, uint64_t size);
  // Puts `size` bytes at `data` into the page cache of inode `ino` from offset 0
  // (FUSE_NOTIFY_STORE); false if the kernel does not know the inode or the notify failed.
  bool Store(uint64_t ino, const char* data, size_t size);
  // The kernel's answer to the retrieve `cookie`: `bytes` bytes from its offset.
  void OnReply(void* cookie, uint64_t bytes);
  // No more retrieves; waiting callers return false.
  void Close();

 private:
  struct Pending {
    CondVar cv;                     // bound to mu_
    std::optional<uint64_t> bytes;  // the answer (guarded by mu_)
  };
  // Whether the kernel returns all of [offset, offset + len).
  bool Retrieve(uint64_t ino, uint64_t offset, uint64_t len);

  const std::chrono::milliseconds timeout_;
  const uint64_t page_;
  Mutex mu_;
  CondVar idle_cv_{&mu_};                     // sending_ dropped to 0
  std::unique_ptr<Kernel> own_;               // the session's, after Attach(fuse_session*)
  Kernel* kernel_ GUARDED_BY(mu_) = nullptr;  // null before Attach, once closed or paused
  Kernel* paused_ GUARDED_BY(mu_) = nullptr;  // the kernel while paused
  int sending_ GUARDED_BY(mu_) = 0;           // notifies being written to the session now
  uint64_t next_cookie_ GUARDED_BY(mu_) = 1;
  std::unordered_map<uint64_t, Pending*> pending_ GUARDED_BY(mu_);  // cookie -> waiter, on stack
};

// The prefetcher's page-cache probe for the mount (prefetch::PageCacheProbe): the inode
// number the inode table has for a store path, then `probe` of that inode. A path the table
// does not know is not resident. `fs` and `probe` must outlive it. Thread-safe.
class MountPageCacheProbe final : public prefetch::PageCacheProbe {
 public:
  // `invalidate` drops the kernel's pages of an inode (FuseSession::InvalidateInode); may be
  // empty (tests).
  MountPageCacheProbe(fs::FileSystem* fs, PageProbe* probe,
                      std::function<void(uint64_t ino)> invalidate = {})
      : fs_(fs), probe_(probe), invalidate_(std::move(invalidate)) {}
  bool Resident(const std::string& path, uint64_t size) override;
  // Stores only while the inode table's attributes of the path (those the kernel was given)
  // are of `version`; a change through the mount meanwhile drops what was stored.
  bool Store(const std::string& path, const cfs_client::FileVersion& version,
             const cache::Buffer& data) override;

 private:
  fs::FileSystem* const fs_;
  PageProbe* const probe_;
  const std::function<void(uint64_t)> invalidate_;
};

}  // namespace cubetorchfs::fuse
