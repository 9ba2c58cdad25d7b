// The handles the kernel holds (fuse_file_info::fh), by number instead of by pointer.
//
// A handle number reaches the daemon in every read, readdir and release. Handing the kernel
// a pointer would make a number from an earlier daemon process (after a restart or an upgrade
// took over the same FUSE connection, daemon/supervisor.h) a pointer into nothing. Numbers are
// looked up here instead; one this process never gave out is simply not found, and the caller
// decides what that means (fuse_ops.cc: reads fall back to the inode, a directory is listed
// again).
//
// Numbers are (generation << 40) + a counter, so a process never gives out a number that an
// earlier process of the same mount gave out (each process of a mount runs at a higher
// generation, see InodeTable::SetGeneration). 0 is never a handle.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "common/thread_annotations.h"

namespace cubetorchfs::fuse {

template <typename T>
class HandleTable {
 public:
  void SetGeneration(uint64_t generation) {
    WriterLock l(mu_);
    next_ = (generation << 40) + 1;
  }

  uint64_t Insert(std::unique_ptr<T> handle) {
    WriterLock l(mu_);
    const uint64_t id = next_++;
    map_.emplace(id, std::shared_ptr<T>(std::move(handle)));
    return id;
  }

  // Keeps `handle` under a number another process gave out (adopted after a takeover).
  // Returns the handle now kept under `id` (an earlier one, if two requests raced).
  std::shared_ptr<T> Adopt(uint64_t id, std::unique_ptr<T> handle) {
    WriterLock l(mu_);
    return map_.emplace(id, std::shared_ptr<T>(std::move(handle))).first->second;
  }

  std::shared_ptr<T> Get(uint64_t id) const {
    ReaderLock l(mu_);
    auto it = map_.find(id);
    return it == map_.end() ? nullptr : it->second;
  }

  // Removes and returns the handle (null if unknown).
  std::shared_ptr<T> Take(uint64_t id) {
    WriterLock l(mu_);
    auto it = map_.find(id);
    if (it == map_.end()) return nullptr;
    std::shared_ptr<T> h = std::move(it->second);
    map_.erase(it);
    return h;
  }

  size_t size() const {
    ReaderLock l(mu_);
    return map_.size();
  }

 private:
  mutable SharedMutex mu_;
  uint64_t next_ GUARDED_BY(mu_) = 1;
  std::unordered_map<uint64_t, std::shared_ptr<T>> map_ GUARDED_BY(mu_);
};

}  // namespace cubetorchfs::fuse
