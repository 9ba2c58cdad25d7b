#include "prefetch/warmer.h"

#include <algorithm>

namespace cubetorchfs::prefetch {

Result<WarmResult> Warmer::WarmFile(const std::string& path) {
  CTFS_ASSIGN_OR_RETURN(cfs_client::FileAttr attr, backend_->Stat(path));
  if (!attr.IsRegular()) return Status::InvalidArgument(path + ": not a regular file");
  const cfs_client::FileVersion version = attr.Version();
  WarmResult out;
  for (uint64_t off = 0, chunk = 0; off < attr.size; off += chunk_bytes_, ++chunk) {
    const std::string key = cache::ChunkKey(path, version, chunk);
    if (disk_->Contains(key)) continue;
    const size_t len = static_cast<size_t>(std::min(chunk_bytes_, attr.size - off));
    CTFS_ASSIGN_OR_RETURN(cache::BufferRef buf,
                          cache::ReadChunk(*backend_, path, version, off, len));
    CTFS_RETURN_IF_ERROR(disk_->Put(key, *buf));
    out.fetched = true;
    out.bytes += len;
  }
  return out;
}

}  // namespace cubetorchfs::prefetch
