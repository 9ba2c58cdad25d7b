// The control server: HTTP/1.1 + JSON on a unix socket (the /v1 API the cube_torch hook
// uses) and on 127.0.0.1:profPort (the original cube_torch package's endpoints).
//
// Its routes are the table of control/routes.h (method, target, threads, where each may be
// asked); docs/control-api.md gives each one's body, reply and status codes, and a unit test
// checks that the two name the same routes. Errors are JSON {"error": "...", "code": "...",
// "errno": n} (docs/errors.md): 400 malformed, 403 another user's stream or a file the caller
// may not read, 404 unknown stream or route, 405 wrong method (with Allow), 409 an upgrade
// refused, 413 body over the limit, 422 no acceptable path, 429 a limit on streams or queued
// paths reached (the error names it), 501 not available in this daemon, 503 the server's
// request memory is in use (retry).
//
// Every connection is from a known local user: the unix socket's peer credentials
// (SO_PEERCRED), or for the loopback TCP port the owner of the peer socket as the kernel's
// socket diagnostics tell it (a peer it cannot name is refused). Every path a request names is
// resolved for that user as its own open() through the mount would be (access.h): paths it
// may not read are rejected, counted per reason, and never fetched. Streams belong to their
// creator. Resources are bounded: connections per listener and per user, an idle timeout,
// request bodies (each, and all being handled at once), the JSON shape (depth, elements),
// streams per user, queued paths by count and memory (per user, and shared fairly by all),
// paths over PATH_MAX or with a name over NAME_MAX. /batchdownload replies are streamed (chunked),
// never built in memory. Request handling, JSON parsing included, runs on worker threads, off the
// one Asio thread that reads and writes the connections.
//
// Thread safety: Start() and the destructor from one thread; the rest is internal.
#pragma once

#include <cstdint>
#include <functional>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "cfs_client/backend.h"
#include "common/status.h"
#include "prefetch/access.h"
#include "prefetch/file_lists.h"
#include "prefetch/model_fetch.h"
#include "prefetch/prefetcher.h"
#include "prefetch/warmer.h"

namespace prometheus {
class Registry;
}

namespace cubetorchfs::control {

// The longest number or literal (true, false, null) a body may hold: JSON numbers of this
// API are pids and counts.
constexpr size_t kMaxJsonTokenBytes = 64;
// Whether `body` is JSON of at most `max_depth` nesting and `max_elements` values (counted
// without parsing it, so an oversized body costs no memory), with no number or literal over
// kMaxJsonTokenBytes. The error says which.
Status CheckJsonShape(std::string_view body, int max_depth, uint64_t max_elements);

// The longest path a request may name, and the longest name in it (the kernel's PATH_MAX and
// NAME_MAX: it would refuse longer ones with ENAMETOOLONG).
constexpr size_t kMaxPathBytes = 4096;
constexpr size_t kMaxNameBytes = 255;

// The listening sockets of a mount, bound once before the daemon detaches and kept by the
// supervisor for every worker (docs/operations.md): nobody can take a port or the socket's
// name while a worker restarts or upgrades. -1 where not configured.
struct Listeners {
  int unix_fd = -1;
  int prof_fd = -1;
  int metrics_fd = -1;
};
// Binds the unix socket at `socket_path` (its directory made as the daemon's, the socket
// 0666; one a running daemon answers on is never taken), and 127.0.0.1:`prof_port` and
// 127.0.0.1:`metrics_port` ("" or 0: none). Descriptors are close-on-exec. The error names the
// config key (prefetch.control_socket, profPort, exporterPort); nothing stays bound then.
Result<Listeners> BindListeners(const std::string& socket_path, uint16_t prof_port,
                                uint16_t metrics_port);

// Maps a published path (absolute under `mount_point`, or relative to the mount root) to a
// store-relative path. Rejects paths outside the mount, ".." components, paths over
// kMaxPathBytes and names over kMaxNameBytes (NameTooLong).
Result<std::string> ToStorePath(const std::string& mount_point, const std::string& path);

class ControlServer {
 public:
  struct Options {
    std::string socket_path;  // "" = no unix socket
    uint16_t prof_port = 0;   // 0 = no loopback TCP listener
    // 127.0.0.1:exporterPort: GET /metrics (Prometheus text) and GET /healthz only, to any
    // local user whether or not the mount has allow_other. 0 = none.
    uint16_t metrics_port = 0;
    // Listening sockets already bound (BindListeners, passed on by the supervisor so that no
    // restart or upgrade ever binds again): used instead of binding socket_path, prof_port and
    // metrics_port. -1: bind here. An inherited unix socket's file is not removed at the end.
    int unix_fd = -1;
    int prof_fd = -1;
    int metrics_fd = -1;
    // A listener that cannot be had is logged and left out instead of failing Start (a worker
    // taking over a mount already served: a missing listener must not cost the mount).
    bool tolerate_listen_errors = false;
    std::string mount_point;  // absolute, without a trailing slash
    // Resolves and checks request paths for their caller; null: the lexical checks only
    // (for tests of a store without owners).
    prefetch::PathResolver* resolver = nullptr;
    prometheus::Registry* registry = nullptr;  // counters of refusals; may be null
    uint64_t max_body_bytes = 16ull << 20;     // one request's body
    uint64_t body_memory_bytes = 32ull << 20;  // all bodies being read or handled at once
    uint64_t max_json_elements = 1u << 17;     // values in one body
    uint64_t batch_max_bytes = 64ull << 20;    // one POST /v1/files/batch's memory file
    // What one user's batch memory files may hold until their pages are gone (mapped or open
    // after the reply: control/batch_memory.h).
    uint64_t batch_memory_bytes_per_uid = 1ull << 30;
    // The memory left, for the check of every batch; null: ModelFetcher::AvailableMemory.
    std::function<uint64_t()> available_memory;
    int max_json_depth = 16;  // nesting of one body
    int max_connections_unix = 256;
    int max_connections_tcp = 128;
    int max_connections_per_uid = 64;  // on both listeners together
    double idle_timeout_s = 30;        // to send a request, or to take a reply's bytes
    // Registered file lists (POST /v1/lists): their limits.
    prefetch::FileLists::Options lists;
    // The prefetcher's queued-path limits (prefetch.max_queued_*): a publish of positions
    // decodes no more paths than one user could ever queue (half of the global limits, or its
    // own), and is refused (429) past them before the rest is decoded.
    prefetch::QueuedPaths::Limits queued{.paths_per_uid = 1u << 17,
                                         .bytes_per_uid = 32ull << 20,
                                         .paths = 1u << 18,
                                         .bytes = 64ull << 20};
    // The mount lets users other than root in (allow_other). Without it the kernel refuses
    // them the mount, so the control API refuses them too.
    bool others_may_use = true;
    // GET /v1/health: the mount's health report (daemon/health.h), 200 when its "healthy" is
    // true, else 503. Null: 501.
    // `details`: the asker is root or the daemon's user (Health::Report).
    std::function<nlohmann::json(bool details)> health;
    // POST /v1/admin/upgrade: hands the mount over to the installed binary (supervisor.h).
    // Only root or the daemon's own user may ask. Null: 501 (no supervisor).
    std::function<Status()> upgrade;
    // GET /v1/stats: the bytes the RAM cache holds now. Null: 0.
    std::function<uint64_t()> ram_bytes;
  };
  // Reads regular file `store_path` at the version of `attr` as the mount reads it (the
  // daemon's: fs::FileSystem::StreamFile), handing `piece` its bytes in order (for
  // /batchdownload/path and POST /v1/files/batch).
  // `uid`: the caller's, whose streams alone the read may move.
  using FileReader = std::function<Status(
      const std::string& store_path, const cfs_client::FileAttr& attr,
      const std::function<Status(const char* data, size_t len)>& piece, uid_t uid)>;
  // A file made resident for /v1/files/open; the server closes its fd after sending it.
  using OpenedFile = prefetch::ResidentFile;
  // Makes a whole file resident and returns a descriptor of it (for /v1/files/open).
  // `check` is the caller's read permission, asked of the file actually opened.
  using FileOpener = std::function<Result<OpenedFile>(const std::string& store_path,
                                                      const cfs_client::Backend::AttrCheck& check)>;

  // Binds the listeners and starts serving. Fails naming the socket or port it could not
  // bind. `prefetcher` and `warmer` (null without an NVMe tier) must outlive the server.
  // Without an `opener`, /v1/files/open answers 501.
  static Result<std::unique_ptr<ControlServer>> Start(const Options& options,
                                                      prefetch::Prefetcher* prefetcher,
                                                      FileReader reader,
                                                      prefetch::Warmer* warmer = nullptr,
                                                      FileOpener opener = nullptr);
  virtual ~ControlServer() = default;  // stops serving and removes the socket file
};

}  // namespace cubetorchfs::control
