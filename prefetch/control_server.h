// The control server: HTTP/1.1 + JSON on a unix socket (the /v1 API the cube_torch hook
// uses) and on 127.0.0.1:profPort (the original cube_torch package's endpoints).
//
//   POST   /v1/streams              {"name": str, "pid": int}   -> 201 {"id": str}
//   POST   /v1/streams/{id}/paths   {"paths": [str, ...]}       -> 202 {"accepted": n, "rejected": m}
//   DELETE /v1/streams/{id}                                     -> 204
//   GET    /v1/stats                                            -> 200 counters, global and per stream
//   POST   /prefetch/read/path      [[abs_path, ...], ...]      -> 200 "prefetching.\n"
//   POST   /register/pid, /unregister/pid   [pid, ...]          -> 200
//   POST   /batchdownload/path      [[path, ...]]               -> 200 framed file contents
//   POST   /v1/files/open           {"path": str}  (unix socket only) -> 200 {"size", "mtime_ns",
//                                     "kind", "bytes": {"ram", "disk", "backend"}} and a read-only file
//                                     descriptor of the file's bytes attached with SCM_RIGHTS
//                                     (docs/fd_exchange.md)
//   POST   /v1/warmup               {"paths": [str, ...]}       -> 200 {"fetched", "skipped",
//                                     "failed", "bytes", "errors"}: fills the NVMe tier
//
// Errors are JSON {"error": "..."}: 400 malformed, 404 unknown stream or route, 405 wrong
// method, 413 body over 16 MiB, 422 no path inside the mount. Both listeners serve every
// route. One Asio thread runs all connections; /batchdownload, which reads file data, runs on
// a small worker pool so a slow store cannot stall the other clients. Every connection has an
// idle timeout, and malformed or truncated requests only ever close their own connection.
//
// Thread safety: Start() and the destructor from one thread; the rest is internal.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "cache/ram_cache.h"
#include "common/status.h"
#include "prefetch/prefetcher.h"
#include "prefetch/warmer.h"

namespace cubetorchfs::prefetch {

// Maps a published path (absolute under `mount_point`, or relative to the mount root) to a
// store-relative path. Rejects paths outside the mount and ".." components.
Result<std::string> ToStorePath(const std::string& mount_point, const std::string& path);

class ControlServer {
 public:
  struct Options {
    std::string socket_path;  // "" = no unix socket
    uint16_t prof_port = 0;   // 0 = no loopback TCP listener
    std::string mount_point;  // absolute, without a trailing slash
  };
  // Reads a whole file by store-relative path (for /batchdownload/path), refusing files over
  // `max_bytes` before reading them.
  using FileReader =
      std::function<Result<std::string>(const std::string& store_path, uint64_t max_bytes)>;
  // Makes a whole file resident and returns a descriptor of it (for /v1/files/open).
  struct OpenedFile {
    int fd = -1;  // ownership passes to the server, which closes it after sending
    bool store_file = false;  // the store's own file rather than a memory copy
    uint64_t size = 0;
    int64_t mtime_ns = 0;
    uint64_t ram_bytes = 0;
    uint64_t disk_bytes = 0;
    uint64_t backend_bytes = 0;
  };
  using FileOpener = std::function<Result<OpenedFile>(const std::string& store_path)>;

  // Binds the listeners and starts serving. Fails naming the socket or port it could not
  // bind. `prefetcher`, `ram` and `warmer` (null without an NVMe tier) must outlive the server.
  // Without an `opener`, /v1/files/open answers 501.
  static Result<std::unique_ptr<ControlServer>> Start(const Options& options,
                                                      Prefetcher* prefetcher,
                                                      cache::RamCache* ram, FileReader reader,
                                                      Warmer* warmer = nullptr,
                                                      FileOpener opener = nullptr);
  virtual ~ControlServer() = default;  // stops serving and removes the socket file
};

}  // namespace cubetorchfs::prefetch
