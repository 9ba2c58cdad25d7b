// Cold reads of large files sent from the store's own file to the kernel, not through the cache.
//
// A checkpoint or a packed shard read once, in order, gains nothing from the RAM cache: the
// kernel keeps the pages it reads in the mount's page cache, and admitting the file would only
// evict the training set. For such reads the daemon hands the kernel the store's file
// descriptor (posix backend) and libfuse splices the bytes from the store's page cache into the
// reply: no copy through this process, no cache buffer. Which reads qualify:
//   - the file is at least cache.stream_min_bytes (FileSystem decides at open) and the backend
//     hands out descriptors (posix; not S3, CubeFS or fault injection); no NVMe tier is
//     configured (its point is to keep what was read); not a *.safetensors file (the model
//     fetcher caches those on purpose);
//   - the read lies in one chunk, no prefetch window or cache tier holds that chunk, and
//   - StreamAdmission says it is the first touch of that part of the chunk.
// A second read of the same part of a chunk (a re-read, or a second epoch of a shard) goes
// the usual way and is cached: the scan-resistance of 2Q's "A1out" ghost queue. The ghost
// queue holds hashes of chunk keys only, a bounded number of them.
//
// Thread safety: StoreStream and StreamAdmission are thread-safe.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cfs_client/backend.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/unique_fd.h"
#include "common/user_budget.h"

namespace cubetorchfs::fs {

// The store's descriptor of one open file, opened on the first streamed read.
class StoreStream {
 public:
  // `budget` (may be null: unbounded) bounds the store descriptors streams hold open, per
  // user and in all: past it a handle reads through the cache, which holds none. It outlives
  // the stream; `uid` is the opener's.
  StoreStream(std::string path, cfs_client::FileVersion version, UserBudget* budget = nullptr,
              int64_t uid = -1)
      : path_(std::move(path)), version_(version), budget_(budget), uid_(uid) {}
  ~StoreStream();
  StoreStream(const StoreStream&) = delete;
  StoreStream& operator=(const StoreStream&) = delete;

  // The descriptor, opened at the handle's version, or -1 if the backend has none or the file
  // is no longer that version (the caller then reads the usual way, which reports it).
  // The fstat on every call keeps a file replaced or rewritten in the store from being served
  // under the old version's name.
  int Fd(cfs_client::Backend& backend);

 private:
  const std::string path_;
  const cfs_client::FileVersion version_;
  UserBudget* const budget_;
  const int64_t uid_;
  bool charged_ = false;  // a descriptor of the budget is held (under mu_)
  // No streaming for this handle any more: the descriptor closed, its charge given back.
  void GiveUpLocked() REQUIRES(mu_);
  // Guards the descriptor; held across the store's open and the fstat of each call, so one
  // handle's streamed reads take it in turn. A leaf lock.
  Mutex mu_;
  UniqueFd fd_ GUARDED_BY(mu_);
  bool unavailable_ GUARDED_BY(mu_) = false;
};

// The ghost queue: which bytes of which chunks were streamed, for at most `capacity` chunks
// (least recently streamed forgotten first). Each chunk is tracked in 1,024 granules: pages,
// for chunks of up to 4 MiB, so kernel reads (whole pages) are tracked exactly.
class StreamAdmission {
 public:
  static constexpr size_t kGranules = 1024;
  explicit StreamAdmission(size_t capacity) : capacity_(capacity) {}

  // True (and remembered) if no byte of [from, to) of chunk `chunk_key` was streamed before:
  // stream it. False: a second touch, to be read into the cache. With granules larger than a
  // page, only granules the read covers whole are compared (a read smaller than a granule is
  // always a first touch).
  bool FirstTouch(const std::string& chunk_key, uint64_t chunk_bytes, uint64_t from, uint64_t to);

  size_t size() const;

 private:
  struct Ghost {
    std::array<uint64_t, kGranules / 64> streamed{};
    std::list<uint64_t>::iterator lru;
  };
  const size_t capacity_;
  mutable Mutex mu_;
  std::unordered_map<uint64_t, Ghost> ghosts_ GUARDED_BY(mu_);
  std::list<uint64_t> lru_ GUARDED_BY(mu_);  // front: most recently streamed
};

}  // namespace cubetorchfs::fs
