// The model-file fast path on the daemon side.
//
// 1. FUSE reads: the first read of a `*.safetensors` file larger than one chunk starts
//    parallel ranged fetches of its chunks (chunk_bytes each, from the read offset on, up to
//    `background_max_bytes`) into the RAM cache, instead of one demand read per chunk as the
//    reader gets there. Readers that reach a chunk still in flight wait for that fetch (the
//    RAM cache shares concurrent fetches of one key).
// 2. The control API's POST /v1/files/open (docs/fd_exchange.md): MakeResident() reads the
//    whole file with parallel ranged reads (RAM cache, then the NVMe tier, then the store)
//    into a sealed memfd and returns a read-only descriptor of it, which the loader library
//    receives with SCM_RIGHTS and reads with its own threads, without FUSE. The daemon keeps
//    no reference: the memory is the caller's and is freed when it closes the descriptor.
//    Chunks fetched from the store are also written to the NVMe tier (when there is one), so
//    a second load does not go back to the store.
//    On a posix store without an NVMe tier (and without fault injection) there is nothing to
//    copy: the descriptor handed over is the store's own file, opened read-only at the
//    version just seen, so the loader reads it as fast as a direct load.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache/disk_cache.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::prefetch {

// A model file made resident, as /v1/files/open hands it out: its descriptor and where its
// bytes came from.
struct ResidentFile {
  int fd = -1;  // read-only: a sealed memfd, or the store's own file; owned by the caller
  bool store_file = false;  // fd is the store's file (posix), not a memory copy
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  cfs_client::FileVersion version;  // of the file handed out, identity included
  uint64_t ram_bytes = 0;           // where the bytes came from
  uint64_t disk_bytes = 0;
  uint64_t backend_bytes = 0;
};

class ModelFetcher {
 public:
  struct Options {
    uint64_t chunk_bytes = 4ull << 20;
    int threads = 8;                             // parallel ranged reads
    uint64_t background_max_bytes = 1ull << 30;  // per file, for FUSE reads (0: off)
  };
  // `backend`, `ram` and `disk` (null without an NVMe tier) must outlive this.
  ModelFetcher(const Options& options, cfs_client::Backend* backend, cache::RamCache* ram,
               cache::DiskCache* disk);
  ~ModelFetcher();  // drops queued fetches, waits for running ones

  // True for the files this fast path handles.
  static bool IsModelFile(const std::string& path);

  // Called for every FUSE read of a regular file (cheap when not a model file).
  void OnRead(const std::string& path, const cfs_client::FileVersion& version, uint64_t offset);

  // Reads store file `path` into a sealed memfd. NotFound ("...: no such file"),
  // InvalidArgument (not a regular file), IOError (store failure, or the file does not fit
  // in available memory), Stale (the file changed while it was read).
  // `check` (the caller's read permission), if given, is asked about the attributes read
  // and about the very file whose descriptor is handed over: PermissionDenied then.
  Result<ResidentFile> MakeResident(const std::string& path,
                                    const cfs_client::Backend::AttrCheck& check = nullptr);

  // Chunk fetches started by OnRead so far (for tests and stats).
  uint64_t background_chunks() const;
  // MakeResident calls that shared a build of the same file version already running, instead
  // of building their own (for tests and stats).
  uint64_t joined_builds() const;

  // Memory a new resident file may use: MemAvailable, or less under a cgroup limit; 0 if
  // unknown.
  static uint64_t AvailableMemory();

 private:
  // A resident file being built, shared by the requests that arrive meanwhile.
  struct Inflight {
    ~Inflight();  // closes the memory file's original descriptor
    bool done = false;
    Result<ResidentFile> result = Status::IOError("not built yet");
  };
  Result<ResidentFile> BuildResident(const std::string& path,
                                     const cfs_client::FileVersion& version);
  // Bytes a resident file took from each tier.
  struct FillCounts {
    std::atomic<uint64_t> ram{0}, disk{0}, backend{0};
  };
  // Writes chunk `c` of `path` at `version` into memory file `fd`, from the RAM cache, the
  // NVMe tier or the store (through `scratch` when there is no NVMe tier to keep it).
  Status FillChunk(int fd, const std::string& path, const cfs_client::FileVersion& version,
                   uint64_t c, std::vector<char>& scratch, FillCounts& counts);

  struct Job {
    std::string path;
    cfs_client::FileVersion version;
    uint64_t chunk;
  };
  void Worker();

  const Options options_;
  cfs_client::Backend* const backend_;
  cache::RamCache* const ram_;
  cache::DiskCache* const disk_;

  // Guards the members marked GUARDED_BY and each Inflight's `done` and `result` (workers_ is
  // started and joined by the constructor and destructor only). Held while /proc/meminfo and
  // the cgroup limit are read (a new resident file's room); never across a store request.
  mutable Mutex mu_;
  CondVar cv_{&mu_};  // workers: a job queued, or stop; requesters: a shared build done
  std::deque<Job> jobs_ GUARDED_BY(mu_);
  std::set<std::string> started_ GUARDED_BY(mu_);  // path + version keys scheduled (bounded)
  std::deque<std::string> started_order_ GUARDED_BY(mu_);
  uint64_t background_chunks_ GUARDED_BY(mu_) = 0;
  std::map<std::string, std::shared_ptr<Inflight>> inflight_ GUARDED_BY(mu_);  // path + version
  uint64_t resident_inflight_bytes_ GUARDED_BY(mu_) = 0;  // sizes of the files being built
  uint64_t joined_builds_ GUARDED_BY(mu_) = 0;  // requests that shared a build already running
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace cubetorchfs::prefetch
