#include "cache/tiers.h"

namespace cubetorchfs::cache {

BufferRef Tiers::Find(const std::string& key, size_t len, Tier* from) const {
  if (ram != nullptr) {
    if (BufferRef hit = ram->Get(key); hit && hit->size == len) {
      if (from != nullptr) *from = Tier::kRam;
      return hit;
    }
  }
  if (disk != nullptr) {
    if (Result<BufferRef> d = disk->Get(key); d.ok() && (*d)->size == len) {
      if (from != nullptr) *from = Tier::kDisk;
      return std::move(d).value();
    }
  }
  return nullptr;
}

Result<BufferRef> Tiers::ReadThroughDisk(cfs_client::Backend& backend, const std::string& key,
                                         const std::string& path,
                                         const cfs_client::FileVersion& version, uint64_t offset,
                                         size_t len, Tier* from) const {
  *from = Tier::kDisk;
  if (disk != nullptr) {
    Result<BufferRef> d = disk->Get(key);
    if (d.ok() && (*d)->size == len) return d;
  }
  *from = Tier::kStore;
  Result<BufferRef> r = ReadChunk(backend, path, version, offset, len);
  if (r.ok() && disk != nullptr) disk->PutAsync(key, r.value());
  return r;
}

}  // namespace cubetorchfs::cache
