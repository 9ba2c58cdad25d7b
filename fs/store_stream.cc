#include "fs/store_stream.h"

#include <sys/stat.h>

#include <algorithm>
#include <functional>

namespace cubetorchfs::fs {

void StoreStream::GiveUpLocked() {
  fd_.reset();
  unavailable_ = true;
  if (charged_) budget_->Give(uid_);
  charged_ = false;
}

StoreStream::~StoreStream() {
  MutexLock l(mu_);
  fd_.reset();
  if (charged_) budget_->Give(uid_);
}

int StoreStream::Fd(cfs_client::Backend& backend) {
  MutexLock l(mu_);
  if (unavailable_) return -1;
  if (fd_.get() < 0) {
    if (budget_ != nullptr && !charged_) {
      // Over the opener's share of descriptors: this handle reads through the cache.
      if (!budget_->Take(uid_)) {
        unavailable_ = true;
        return -1;
      }
      charged_ = true;
    }
    Result<int> fd = backend.OpenReadFd(path_, version_);
    if (!fd.ok()) {
      GiveUpLocked();
      return -1;
    }
    fd_.reset(*fd);
  }
  struct stat st;
  if (::fstat(fd_.get(), &st) != 0 || cfs_client::FromStat(st).Version() != version_) {
    GiveUpLocked();
    return -1;
  }
  return fd_.get();
}

bool StreamAdmission::FirstTouch(const std::string& chunk_key, uint64_t chunk_bytes, uint64_t from,
                                 uint64_t to) {
  if (capacity_ == 0 || to <= from) return true;
  const uint64_t granule = std::max<uint64_t>(4096, (chunk_bytes + kGranules - 1) / kGranules);
  // Granules overlapped (marked) and granules covered whole (compared).
  const uint64_t first = from / granule;
  const uint64_t last = std::min<uint64_t>((to - 1) / granule, kGranules - 1);
  const uint64_t whole_first = (from + granule - 1) / granule;
  const uint64_t whole_end = std::min<uint64_t>(to / granule, kGranules);  // exclusive
  const uint64_t key = std::hash<std::string>{}(chunk_key);
  MutexLock l(mu_);
  auto it = ghosts_.find(key);
  if (it == ghosts_.end()) {
    if (ghosts_.size() >= capacity_) {
      ghosts_.erase(lru_.back());
      lru_.pop_back();
    }
    lru_.push_front(key);
    it = ghosts_.emplace(key, Ghost{{}, lru_.begin()}).first;
  } else {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    for (uint64_t g = whole_first; g < whole_end; ++g)
      if ((it->second.streamed[g / 64] >> (g % 64)) & 1) return false;
  }
  for (uint64_t g = first; g <= last && g < kGranules; ++g)
    it->second.streamed[g / 64] |= uint64_t{1} << (g % 64);
  return true;
}

size_t StreamAdmission::size() const {
  MutexLock l(mu_);
  return ghosts_.size();
}

}  // namespace cubetorchfs::fs
