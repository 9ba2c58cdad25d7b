// Asks the kernel which files of the mount its page cache still holds.
//
// FUSE_NOTIFY_RETRIEVE makes the kernel send back the pages of an inode it holds, from an
// offset up to the first page it lacks (at most max_pages of them). A whole-file answer
// means every page is cached. For a file larger than one retrieve, the first retrieve's
// worth and the last page are asked for: the pages of a file read whole are dropped
// together, oldest first, so those two stand for the file.
//
// The answer comes back as a request (retrieve_reply) on a FUSE thread; Resident() waits
// for it, at most `timeout`. A kernel that does not know the inode, a failed notify or no
// answer in time all mean "not resident": the caller fetches the file, which is always safe.
//
// Thread-safe. Close() before the session is destroyed; Resident() then answers false.
#pragma once

#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace cubetorchfs::fuse {

class PageProbe {
 public:
  // `max_retrieve`: the most bytes one retrieve returns (the mount's max_write).
  PageProbe(fuse_session* session, uint64_t max_retrieve,
            std::chrono::milliseconds timeout = std::chrono::milliseconds(1000));

  // Whether the kernel's page cache holds [0, size) of inode `ino` (see above).
  bool Resident(uint64_t ino, uint64_t size);
  // The kernel's answer to the retrieve `cookie`: `bytes` bytes from its offset.
  void OnReply(void* cookie, uint64_t bytes);
  // No more retrieves; waiting callers return false.
  void Close();

 private:
  // Whether the kernel returns all of [offset, offset + len).
  bool Retrieve(uint64_t ino, uint64_t offset, uint64_t len);

  const uint64_t max_retrieve_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;  // guards everything below; held across the notify write (never blocks)
  std::condition_variable cv_;
  fuse_session* session_;  // null once closed
  uint64_t next_cookie_ = 1;
  std::unordered_map<uint64_t, std::optional<uint64_t>> pending_;  // cookie -> bytes answered
};

}  // namespace cubetorchfs::fuse
