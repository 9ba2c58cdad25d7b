// The cache's tiers seen as one chunk source: the RAM cache, then the NVMe tier, then the
// store, with write-back to the NVMe tier. The RAM and NVMe lookups of FUSE reads, the
// prefetcher and the model fetcher go through here; without an NVMe tier the last two read
// the store directly (warmup fills the NVMe tier alone, through DiskCache).
//
// Thread safety: as the tiers' own (all thread-safe); a Tiers is a pair of pointers.
#pragma once

#include <cstdint>
#include <string>

#include "cache/disk_cache.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/status.h"

namespace cubetorchfs::cache {

// Where a chunk came from.
enum class Tier { kRam, kDisk, kStore };

struct Tiers {
  RamCache* ram = nullptr;    // null: none
  DiskCache* disk = nullptr;  // null: none

  // Chunk `key` of exactly `len` bytes from the RAM cache, else from the NVMe tier; null if
  // neither holds it whole. `*from` (if not null) says which.
  BufferRef Find(const std::string& key, size_t len, Tier* from = nullptr) const;

  // Chunk `len` bytes at `offset` of `path` at `version` (key `key`): from the NVMe tier when
  // it holds the whole chunk, else from the store through ReadChunk, then queued for the NVMe
  // tier so a later run finds it there. Does not look in the RAM cache: callers reach here
  // through RamCache::GetOrFetch, which did. `*from` says which tier answered.
  Result<BufferRef> ReadThroughDisk(cfs_client::Backend& backend, const std::string& key,
                                    const std::string& path, const cfs_client::FileVersion& version,
                                    uint64_t offset, size_t len, Tier* from) const;
};

}  // namespace cubetorchfs::cache
