// The file system's logic, free of libfuse: what each FUSE operation does, returning values
// or a Status. fuse_ops.cc turns these into kernel replies (and Status into errno).
//
// Reads look in the prefetch window first, then the RAM cache, in units of whole files (up to
// chunk_bytes) or chunks of chunk_bytes. A read is a hit if no byte waited on the backend,
// late if it waited on a prefetch in flight, a miss if it fetched (or waited on another
// reader's fetch); every read is reported to the prefetcher, which keeps the accounting and
// moves the streams' cursors. Attributes come from the inode table while younger than attr_timeout_s, so
// opening a file whose metadata is fresh costs no backend request.
//
// Thread safety: all methods may be called concurrently from the FUSE worker threads. No lock
// is held across a backend call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/disk_cache.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/clock.h"
#include "common/status.h"
#include "fuse/inode_table.h"
#include "fuse/model_fetch.h"
#include "prefetch/prefetcher.h"

namespace prometheus {
class Registry;
class Counter;
}  // namespace prometheus

namespace cubetorchfs::fuse {

struct Entry {
  uint64_t ino = 0;
  cfs_client::FileAttr attr;
};

// An open regular file: the version it was opened at is the version every read serves.
struct FileHandle {
  uint64_t ino = 0;
  std::string path;
  cfs_client::FileVersion version;
};

struct DirHandle {
  uint64_t ino = 0;
  std::string path;
  std::vector<cfs_client::DirEntry> entries;  // a snapshot taken at opendir
};

struct OpenResult {
  std::unique_ptr<FileHandle> handle;
  bool keep_cache = false;        // the kernel may keep its page cache of the file
  bool invalidate_inode = false;  // the file changed: drop the kernel's cached attrs and pages
};

// Bytes of a read, as slices of cached buffers (no copy until the kernel reply).
struct ReadResult {
  struct Slice {
    cache::BufferRef buffer;
    size_t offset = 0;
    size_t length = 0;
  };
  std::vector<Slice> slices;
  size_t size() const;
};

class FileSystem {
 public:
  struct Options {
    double attr_timeout_s = 1.0;
    bool keep_cache = false;
    uint64_t chunk_bytes = 4ull << 20;
  };

  // `backend`, `cache`, `prefetcher`, `clock` and `registry` must outlive the FileSystem. Fails if the
  // store's root cannot be read.
  static Result<std::unique_ptr<FileSystem>> New(const Options& options,
                                                 cfs_client::Backend* backend,
                                                 cache::RamCache* cache,
                                                 prefetch::Prefetcher* prefetcher, Clock* clock,
                                                 prometheus::Registry& registry,
                                                 cache::DiskCache* disk = nullptr);
  ~FileSystem();

  Result<Entry> Lookup(uint64_t parent, const std::string& name);  // adds one lookup
  void Forget(uint64_t ino, uint64_t nlookup);
  Result<cfs_client::FileAttr> GetAttr(uint64_t ino);
  Result<std::string> ReadLink(uint64_t ino);
  Result<std::unique_ptr<DirHandle>> OpenDir(uint64_t ino);
  // For readdirplus: the inode of `entry` of `dir`, with one lookup added.
  uint64_t AcquireDirEntry(const DirHandle& dir, const cfs_client::DirEntry& entry);
  Result<OpenResult> Open(uint64_t ino, int flags);
  Result<ReadResult> Read(const FileHandle& handle, uint64_t offset, size_t size);
  // The whole file at store path `path`, through the same cache and accounting as FUSE reads
  // (for the legacy /batchdownload/path endpoint).
  // Files over `max_bytes` are refused before anything is read.
  Result<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes);
  // A handle for reading `ino` at its current version, for reads without an open (no_open).
  Result<FileHandle> HandleFor(uint64_t ino);
  Result<cfs_client::FsStats> StatFs();
  Status Access(uint64_t ino, int mask);

  const InodeTable& inodes() const { return inodes_; }

  // The model-file fast path (fuse/model_fetch.h) to tell about reads; null: none. Set before
  // the first read; must outlive the FileSystem.
  void set_model_fetcher(ModelFetcher* fetcher) { model_fetcher_ = fetcher; }

 private:
  FileSystem(const Options& options, cfs_client::Backend* backend, cache::RamCache* cache,
             prefetch::Prefetcher* prefetcher, Clock* clock, prometheus::Registry& registry,
             const cfs_client::FileAttr& root_attr, cache::DiskCache* disk);

  Result<InodeInfo> GetInode(uint64_t ino);
  // The inode's attributes, re-read from the store when older than attr_timeout_s.
  Result<cfs_client::FileAttr> FreshAttr(const InodeInfo& inode);
  static std::string ChildPath(const std::string& parent, const std::string& name);

  const Options options_;
  cfs_client::Backend* const backend_;
  cache::RamCache* const cache_;
  prefetch::Prefetcher* const prefetcher_;
  cache::DiskCache* const disk_;  // the NVMe tier, or null
  Clock* const clock_;
  InodeTable inodes_;
  ModelFetcher* model_fetcher_ = nullptr;

  // Owned by the registry.
  prometheus::Counter* bytes_ram_;
  prometheus::Counter* bytes_disk_;
  prometheus::Counter* bytes_backend_;
};

}  // namespace cubetorchfs::fuse
