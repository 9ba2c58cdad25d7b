// Filling the NVMe tier ahead of training (`cubetorchfs warmup` and POST /v1/warmup).
//
// WarmFile makes every chunk of one file resident in the NVMe tier, reading from the store
// only the chunks that are not there yet, so a warmup that was interrupted resumes where it
// stopped. Thread-safe: many threads may warm different files at once.
#pragma once

#include <cstdint>
#include <string>

#include "cache/disk_cache.h"
#include "cfs_client/backend.h"
#include "common/status.h"

namespace cubetorchfs::prefetch {

struct WarmResult {
  bool fetched = false;  // false: every chunk was already cached
  uint64_t bytes = 0;    // bytes read from the store
};

class Warmer {
 public:
  // `backend` and `disk` must outlive the Warmer.
  Warmer(cfs_client::Backend* backend, cache::DiskCache* disk, uint64_t chunk_bytes)
      : backend_(backend), disk_(disk), chunk_bytes_(chunk_bytes) {}

  // Store-relative `path` must name a regular file.
  Result<WarmResult> WarmFile(const std::string& path);

 private:
  cfs_client::Backend* const backend_;
  cache::DiskCache* const disk_;
  const uint64_t chunk_bytes_;
};

}  // namespace cubetorchfs::prefetch
