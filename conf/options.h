// Options of every component: plain structs with inline defaults.
//
// Read from JSON or YAML only by conf/config.h; other components receive the struct for their
// own part through their constructor. Sizes are bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cubetorchfs::conf {

// backend.inject: fault and latency injection around any backend (tests and benchmarks).
struct InjectOptions {
  bool enabled = false;     // true when the section is present. Default: off.
  uint64_t latency_us = 0;  // added to every backend request. Default: 0.
  double error_rate = 0.0;  // fraction of requests failing with EIO, in [0, 1]. Default: 0.
  uint64_t seed = 1;        // seeds the error draw so runs repeat. Default: 1.
  // Requests served at once; the others wait their turn (the wait adds to their latency).
  // 0 = unlimited. Default: 0.
  uint64_t max_concurrency = 0;
  // Bytes per second of data read or written, shared by all requests: a request moving N
  // bytes takes N / bandwidth_bytes_s on top of its latency. 0 = unlimited. Default: 0.
  uint64_t bandwidth_bytes_s = 0;
};

// backend.* keys of type "s3": an S3-compatible object store (AWS S3, MinIO, a CubeFS
// ObjectNode). Key `prefix/a/b.jpg` of the bucket is file `a/b.jpg` of the mount.
struct S3Options {
  std::string endpoint;              // "http(s)://host[:port]". Required.
  std::string bucket;                // Default: volName.
  std::string region = "us-east-1";  // signs requests (SigV4). Default: us-east-1.
  std::string prefix;                // key prefix served as the root, no leading '/'. Default: "".
  bool path_style = true;            // endpoint/bucket/key; false: bucket.host/key. Default: true.
  std::string access_key;            // Default: $AWS_ACCESS_KEY_ID; none: unsigned requests.
  std::string secret_key;            // Default: $AWS_SECRET_ACCESS_KEY.
  uint64_t timeout_ms = 30000;       // limit of one request attempt. Default: 30000.
  uint32_t retries = 4;              // retries of a failed request (5xx, 429, network). Default: 4.
  uint32_t max_connections = 64;     // parallel requests (pooled connections). Default: 64.
  // Local directory of the staging files of files being written (one per file, uploaded on
  // flush/fsync/close; kept there when an upload fails). Default: /tmp/cubetorchfs-staging.
  std::string staging_dir = "/tmp/cubetorchfs-staging";
  // Files larger than this are uploaded in parts of this size, in parallel. Default: 16 MiB.
  uint64_t multipart_bytes = 16ull << 20;
  // A lookup of a name the daemon does not know is a GET of this many first bytes rather than
  // a HEAD: a small file comes whole with its attributes, and its cold read costs no second
  // request. 0: HEAD. Not used with an NVMe tier (its copies make the bytes moot). Default:
  // 256 KiB (at most cache.chunk_bytes).
  uint64_t lookup_read_bytes = 256ull << 10;
};

// backend.type "cubefs": a CubeFS volume through CubeFS's C SDK (libcfs.so, loaded at run
// time). The connection keys are the CubeFS client's own, at the top level of the config.
struct CubefsOptions {
  std::string lib;             // backend.cubefs.lib: libcfs.so's path. Default: the library path.
  std::string volume;          // backend.cubefs.volume, else volName: the CubeFS volume.
  std::string master_addr;     // masterAddr: "host:port[,host:port...]". Required.
  std::string access_key;      // accessKey: the volume owner's (or an authorized user's). Required.
  std::string secret_key;      // secretKey. Required.
  std::string log_dir;         // logDir: the SDK's own logs go under it. Default: none.
  std::string log_level;       // logLevel, passed on when debug, info, warn or error.
  bool follower_read = false;  // followerRead: reads may go to follower replicas.
  // backend.cubefs.remote_cache: reads go through the volume's distributed cache (FlashNodes)
  // first; the SDK must take "enableRemoteCache" or the daemon does not start. Default: off.
  bool remote_cache = false;
};

// backend.type "synthetic": a read-only ImageNet-shaped tree computed from these keys, with
// no disk (benchmarks and scale tests; cfs_client/synthetic_backend.cc).
struct SyntheticOptions {
  uint64_t dirs = 1000;           // class directories n00000000 .. Default: 1000.
  uint64_t files_per_dir = 1281;  // files in each. Default: 1281.
  uint64_t min_bytes = 1024;      // smallest file. Default: 1 KiB.
  uint64_t max_bytes = 3072;      // largest file. Default: 3 KiB.
  uint64_t seed = 1;              // sizes, bytes and the mtime derive from it. Default: 1.
};

// backend.type: which store serves the mount. What each one can do (owners, descriptors, ...)
// is its cfs_client::Backend::capabilities(), not a test of this type.
enum class BackendType {
  kPosix,      // "posix": a directory tree
  kS3,         // "s3": an S3-compatible object store
  kCubefs,     // "cubefs": a CubeFS volume through its C SDK
  kSynthetic,  // "synthetic": a computed read-only tree
};

struct BackendOptions {
  // "posix" (a directory tree), "s3", "cubefs" or "synthetic". Default: posix.
  BackendType type = BackendType::kPosix;
  std::string root;            // posix: the directory served. Required for posix.
  S3Options s3;                // s3: where the objects are.
  CubefsOptions cubefs;        // cubefs: the volume and how to reach it.
  SyntheticOptions synthetic;  // synthetic: the shape of the tree.
  InjectOptions inject;
};

struct CacheOptions {
  uint64_t memory_bytes = 4ull << 30;  // RAM tier budget. Default: 4 GiB.
  std::string disk_dir;                // NVMe tier directory; "" = no tier. Default: "".
  uint64_t disk_bytes = 0;             // NVMe tier budget. Default: 0.
  uint64_t chunk_bytes = 4ull << 20;   // files above this are cached in chunks. Default: 4 MiB.
  // Cold first reads of files of at least this size (and over chunk_bytes) go from the store's
  // file to the kernel without entering the cache; a second read of the same bytes is cached.
  // posix backend without an NVMe tier only; 0 = never. Default: 32 MiB.
  uint64_t stream_min_bytes = 32ull << 20;
  // The RAM cache's bytes live in a memfd the supervisor holds (cache/cache_arena.h), so the
  // daemon after a crash serves them again; false: the heap. Default: true.
  bool durable = true;
};

struct PrefetchOptions {
  bool enabled = true;                 // Default: true.
  uint32_t max_inflight = 64;          // parallel backend fetches. Default: 64.
  uint64_t window_files = 4096;        // files fetched ahead of a stream's cursor. Default: 4096.
  uint64_t window_bytes = 1ull << 30;  // bytes fetched ahead. Default: 1 GiB.
  // Drop a file from RAM once read, rather than keep it in the LRU. Default: false.
  bool evict_after_read = false;
  // Under keep_cache, pass over a file the kernel was served whole with no page probe while
  // the kernel reclaims no page (/proc/vmstat). false: probe every such file (for loaders
  // that drop pages themselves with POSIX_FADV_DONTNEED, which the count misses).
  // Default: true.
  bool trust_page_cache = true;
  // Under keep_cache, put a trusted file back into the page cache from the daemon's RAM or
  // NVMe copy as a stream reaches it (one FUSE_NOTIFY_STORE, no store request): kAuto while
  // DAMON pages out memory here (it drops page cache unnoticed by /proc/vmstat), kAlways,
  // kNever. Default: kAuto.
  enum class RestorePages { kAuto, kAlways, kNever };
  RestorePages restore_pages = RestorePages::kAuto;
  // Default: /run/cubetorchfs/<volName>.sock (conf::ControlSocketPath). At most 107 bytes.
  std::string control_socket;
  uint64_t max_streams_per_uid = 64;             // streams one user may have. Default: 64.
  uint64_t max_queued_paths_per_uid = 1u << 17;  // paths not yet read, one user. Default: 131072.
  uint64_t max_queued_paths = 1u << 18;          // paths not yet read, all users. Default: 262144.
  // The memory those paths hold (about 200 bytes plus twice the path each), one user and all
  // users. Default: 32 MiB and 64 MiB.
  uint64_t max_queued_path_bytes_per_uid = 32ull << 20;
  uint64_t max_queued_path_bytes = 64ull << 20;
  // Registered file lists (POST /v1/lists): how many one user may hold, and the memory they
  // hold (front-coded: about 17 bytes a path for ImageNet-like names), one user and all
  // users. Default: 16, 128 MiB and 256 MiB.
  uint64_t max_lists_per_uid = 16;
  uint64_t max_list_bytes_per_uid = 128ull << 20;
  uint64_t max_list_bytes = 256ull << 20;
};

// The control server's limits (docs/security.md): what one outsider can make it hold.
struct ControlOptions {
  uint64_t max_body_bytes = 16ull << 20;     // one request's body. Default: 16 MiB.
  uint64_t body_memory_bytes = 32ull << 20;  // all bodies held at once. Default: 32 MiB.
  uint64_t max_json_elements = 1u << 17;     // values in one body. Default: 131072.
  uint64_t max_json_depth = 16;              // nesting of one body. Default: 16.
  // The bytes of one POST /v1/files/batch (the batch mode's memory file): files past it are
  // left to the mount. Default: 64 MiB.
  uint64_t batch_max_bytes = 64ull << 20;
  // What one user's batch memory files may hold while they are mapped or open after the reply
  // (their pages stay the daemon's until then): a batch past it gets 429. At least
  // batch_max_bytes. Default: 1 GiB.
  uint64_t batch_memory_bytes_per_uid = 1ull << 30;
  uint64_t max_connections_unix = 256;    // on the unix socket. Default: 256.
  uint64_t max_connections_tcp = 128;     // on 127.0.0.1:profPort. Default: 128.
  uint64_t max_connections_per_uid = 64;  // one user, both listeners. Default: 64.
  double idle_timeout_s = 30;             // to send a request or take a reply. Default: 30 s.
};

struct FuseOptions {
  // Mount read-only: every change fails with EROFS. Not implied by profile ai_prefetch.
  // Default: false.
  bool read_only = false;
  double entry_timeout_s = 1.0;     // Default: 1 s; 300 s with profile ai_prefetch.
  double attr_timeout_s = 1.0;      // Default: 1 s; 300 s with profile ai_prefetch.
  double negative_timeout_s = 0.0;  // Default: 0 s; 5 s with profile ai_prefetch.
  uint64_t max_read = 1ull << 20;   // largest read/write request. Default: 1 MiB.
  // The kernel's readahead for the mount (its bdi's read_ahead_kb, set by the daemon after
  // mounting; a FUSE mount otherwise gets 128 KiB): up to this much of a file read in
  // sequence is asked for ahead, in max_read requests. 0 leaves the kernel's. Default: 8 MiB.
  uint64_t read_ahead_bytes = 8ull << 20;
  // Keep the kernel page cache across opens of a file whose version (size, mtime) did not
  // change. Default: false; true with profile ai_prefetch.
  bool keep_cache = false;
  // Under keep_cache (the kernel then skips open and release), whether every close(2) asks
  // the daemon to flush (FUSE FLUSH). true: a file written through the mount is in the store
  // when close returns, and close reports the store's error; every close of a file only read
  // costs a round trip too. false: no close ever reaches the daemon (a hot read costs no
  // round trip at all); a written file reaches the store at fsync, at rename, or
  // write_back_idle_s after its last write (errors are logged and kept for the next fsync).
  // A read-only mount never flushes. Default: true.
  bool flush_on_close = true;
  double write_back_idle_s = 1.0;  // with flush_on_close false. Default: 1 s.
  // When a directory listed holds subdirectories, this many of them (in name order) are listed
  // ahead of the kernel's opendir, on list_ahead_threads threads, and kept this many ahead of
  // the latest one opened (fs/list_ahead.h). 0: none. Default: 0; 16 with profile
  // ai_prefetch.
  uint64_t list_ahead = 0;
  unsigned list_ahead_threads = 4;  // Default: 4.
  // The memory the listings of open directories may hold in all (each open directory keeps
  // a window of its listing: the page being read and up to 8,192 entries before it); one user
  // at most half. An opendir or readdir past it fails with ENOMEM. Default: 512MiB.
  uint64_t dir_memory_bytes = 512ull << 20;
  // Entries a directory is listed in at a time (a store request each: an S3 page holds at most
  // 1,000). Default: 4096.
  uint64_t list_page_entries = 4096;
  // Files one user may have open for writing through the mount at once; an open past it
  // fails with EMFILE. Default: 4096.
  uint64_t max_writes_per_uid = 4096;
  // The transport of requests (docs/operations.md): kAuto takes FUSE over io_uring when the
  // kernel offers it (root set /sys/module/fuse/parameters/enable_uring), else /dev/fuse; kOn
  // requires io_uring (the mount fails without it); kOff always /dev/fuse. Default: kAuto.
  enum class Mode { kAuto, kOn, kOff };
  using IoUring = Mode;
  IoUring io_uring = IoUring::kAuto;
  // FUSE passthrough (docs/config.md): kAuto lets the kernel read large files of a posix
  // store straight from the store's file (those cache.stream_min_bytes streams) when it
  // offers passthrough and the daemon has CAP_SYS_ADMIN; kOn requires it (the mount fails
  // without it); kOff never. Profiles with keep_cache (ai_prefetch) send no opens, so never
  // use it. Default: kAuto.
  Mode passthrough = Mode::kAuto;
};

struct Config {
  std::string vol_name;            // volName. Required.
  std::string mount_point;         // mountPoint; the command line may override it.
  std::string log_dir;             // logDir; "" logs to stderr. Default: "".
  std::string log_level = "info";  // logLevel. Default: info.
  uint16_t exporter_port = 0;      // exporterPort; 0 = no metrics listener. Default: 0.
  uint16_t prof_port = 0;          // profPort; 0 = no legacy listener. Default: 0.
  std::string profile;             // "" or "ai_prefetch". Default: "".
  BackendOptions backend;
  CacheOptions cache;
  PrefetchOptions prefetch;
  ControlOptions control;
  FuseOptions fuse;

  // Top-level keys that are neither ours nor the CubeFS client's, for one warning.
  std::vector<std::string> unknown_top_level_keys;
  // Accepted but doubtful settings (cache.memory_bytes above physical memory), one line each.
  std::vector<std::string> warnings;
};

}  // namespace cubetorchfs::conf
