// The NVMe tier: chunk files under `dir/data` with a RocksDB index, surviving restarts.
//
// Keys are the same opaque chunk keys as the RAM tier (path + version + chunk), so a file
// that changed in the store is never served from here. Each chunk is one file; the index maps
// key -> {file id, length, CRC32C, insertion sequence}.
//
// Crash safety: a chunk is written to `dir/tmp`, fsynced, renamed into `dir/data`, and only
// then indexed. At open, `dir/tmp` is emptied, index entries whose data file is missing or of
// the wrong length are dropped, and data files no entry names are deleted. So a crash at any
// step leaves either a complete entry or none.
//
// Every read verifies the CRC32C; a mismatch drops the entry, counts
// cubetorchfs_cache_corruptions_total, and reports NotFound so the caller refetches.
//
// Eviction is least-recently-used (use order is kept in memory; after a restart it starts
// from insertion order) under `capacity_bytes` and a minimum free-space ratio of the file
// system holding `dir`.
//
// Thread safety: all methods are thread-safe. One mutex guards the in-memory index and is
// held for no I/O: statvfs, chunk writes and reads, evictions' unlinks and every RocksDB write
// run outside it, so a Get or Contains waits on no other thread's I/O (a Get reads its own
// chunk; one that finds its chunk gone or corrupt deletes its index row, under the second
// mutex). RocksDB writes are serialised by that second mutex (taken before the first). PutAsync
// hands the write to one writer thread through a bounded queue.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "cache/ram_cache.h"
#include "common/status.h"

namespace prometheus {
class Registry;
}

namespace cubetorchfs::cache {

class DiskCache {
 public:
  struct Options {
    std::string dir;                     // required
    uint64_t capacity_bytes = 0;         // required
    double min_free_ratio = 0.05;        // keep this share of the file system free
    uint64_t queue_bytes = 32ull << 20;  // PutAsync buffers waiting for the writer
    // For crash tests: stop Put after this step, as if the process died there.
    enum class CrashPoint { kNone, kAfterTempWrite, kAfterRename };
    CrashPoint crash_point = CrashPoint::kNone;
    // For tests: called before evicted chunks' files are removed (a slow disk).
    std::function<void()> before_remove;
  };

  // Opens (creating if needed) and recovers the tier. Fails naming the directory.
  static Result<std::unique_ptr<DiskCache>> Open(const Options& options,
                                                 prometheus::Registry* registry);
  virtual ~DiskCache() = default;  // drains the writer queue

  // The chunk stored under `key`; NotFound if absent or corrupt (then dropped).
  virtual Result<BufferRef> Get(const std::string& key) = 0;
  virtual bool Contains(const std::string& key) = 0;
  // Stores `data` under `key` now (replacing nothing: an existing key is kept).
  virtual Status Put(const std::string& key, const Buffer& data) = 0;
  // Queues a Put for the writer thread, unless `key` is already stored or queued; dropped
  // (and logged) when the queue is full. Cheap enough to call under other locks.
  virtual void PutAsync(const std::string& key, BufferRef data) = 0;
  // Waits until every queued Put is done.
  virtual void Flush() = 0;
  // Drops every chunk of the file at `path`, any version, stored or queued (after a write
  // through the mount). O(log entries + the file's chunks) under the index lock, plus a scan
  // of the write queue (bounded by its byte limit).
  virtual void EraseFile(const std::string& path) = 0;
  // Index entries EraseFile has looked at, ever: the file's own and one more a call.
  virtual uint64_t erase_visits() const = 0;

  virtual uint64_t bytes() const = 0;
  virtual uint64_t entries() const = 0;
  virtual uint64_t corruptions() const = 0;
  // For tests: the data file holding `key`, or "".
  virtual std::string DataFileOf(const std::string& key) = 0;
};

}  // namespace cubetorchfs::cache
