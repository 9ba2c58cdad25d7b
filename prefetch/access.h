// Who is asking, and what they may read: the caller of a control request, taken from the
// kernel, and the resolution of the paths it names as the kernel would resolve them through
// the mount for that caller.
//
// The daemon runs as root. A request over the unix socket or the loopback TCP port comes from
// some local user, and every path it names is checked as that user's own open() through the
// mount would be under default_permissions: search permission on every directory from the
// root down, read permission on the file, by the mode bits (ACLs are not consulted). Symlinks
// in the store are followed while they are relative and stay beneath the root (datasets link
// class folders); an absolute one, or one that climbs out of the root, is refused for that
// path. The result is a path without symlinks, which the backend then opens without following
// any (a component swapped for a symlink after the check fails there; it never reaches
// another file).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cfs_client/backend.h"
#include "common/clock.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::prefetch {

struct Caller {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;              // 0 when the kernel does not say (TCP)
  std::vector<gid_t> groups;  // supplementary groups; the primary gid counts as well
  bool IsRoot() const { return uid == 0; }
  bool InGroup(gid_t g) const;
};

// The peer of a connected unix socket: SO_PEERCRED, and SO_PEERGROUPS for its groups.
Result<Caller> UnixPeer(int fd);
// The owner of the local TCP socket at the other end of connected socket `fd` (loopback),
// found with the kernel's socket diagnostics (NETLINK_SOCK_DIAG); its groups from the user
// database. An error when the kernel does not know it (the peer is not on this host's
// loopback in this network namespace): such a connection is refused.
Result<Caller> TcpPeer(int fd);

// Whether `caller` may `want` (a mask of R_OK, W_OK, X_OK) a file with attributes `a`, by its
// mode bits, as the kernel checks them. Root may read and search anything.
bool MayAccess(const cfs_client::FileAttr& a, const Caller& caller, int want);

// Why a path was refused; counted per reason.
enum class Reject {
  kNone = 0,
  kOutside,     // not under the mount, "..", NUL, too long
  kSymlink,     // an absolute symlink, or one that leaves the root
  kPermission,  // the caller may not search a directory or read the file
  kNotFound,    // a component does not exist or is not a directory
  kNotFile,     // not a regular file
  kLoop,        // more than 40 symlinks
  kStore,       // the store failed
};
constexpr int kRejectReasons = 8;
const char* RejectName(Reject r);

class PathResolver {
 public:
  struct Options {
    // How long a directory's or file's attributes may answer a later check, when the mount
    // holds none (/v1/files/open and /v1/warmup ask the store for the file itself).
    double ttl_s = 2.0;
    size_t max_cached = 65536;  // attributes kept; all are dropped when full
    // false for stores without symlinks or per-file owners (S3): only the lexical checks
    // (and, when `fresh`, the file's attributes).
    bool check_store = true;
    // Attributes the mount already holds for a path (the FUSE inode table, while the kernel
    // may use them), for a name held under the directory of store identity `dir_id` (0: any):
    // asked first when a check need not be fresh. May be null.
    std::function<std::optional<cfs_client::FileAttr>(const std::string& path, uint64_t dir_id)>
        known_attr;
  };
  PathResolver(const Options& options, cfs_client::Backend* backend, Clock* clock);

  struct Resolved {
    std::string path;           // store-relative, without symlinks
    cfs_client::FileAttr attr;  // of the file (unset when the store is not checked)
  };
  // What Resolve checks. kFile: every directory and the file (a regular file the caller may
  // read). kDirectories: the directories only; the last component is taken as it is, and
  // the file is checked when it is fetched (Prefetcher's `reader`), with no extra request.
  enum class Depth { kFile, kDirectories };
  // Resolves store-relative `path` (from ToStorePath) for `caller` as described above.
  // Directories are checked as the mount sees them (known_attr, else attributes at most ttl_s
  // old: the kernel too checks permissions on attributes it caches); `fresh`: the file's
  // attributes come from the store now. On failure, *why says why.
  // Directories found searchable for one caller during one request (the root, then each
  // directory checked): a request naming many files of a few directories checks each of them
  // once. Never shared between callers or requests.
  struct Searched {
    bool root = false;
    uint64_t root_id = 0;
    std::unordered_map<std::string, uint64_t> dirs;  // and their store identities
  };
  Result<Resolved> Resolve(const std::string& path, const Caller& caller, bool fresh, Reject* why,
                           Depth depth = Depth::kFile, Searched* searched = nullptr);
  bool checks_store() const { return options_.check_store; }

  // Asks the store for the attributes of `dirs` (store-relative directories a request is
  // about to resolve through) that are neither known to the mount nor cached, at most
  // kWarmThreads at a time, so that resolving a request that names files of many directories
  // the mount has not seen costs a few round trips, not one a directory in a row. Only fills
  // the cache Resolve reads; decides nothing.
  void Warm(const std::vector<std::string>& dirs);
  static constexpr size_t kWarmThreads = 16;

 private:
  // The attributes of `path`, found in the directory of store identity `dir_id` (0: not
  // checked): from the mount, the cache or the store, each only as found in that directory (a
  // store request is bound to it: cfs_client::Expected).
  Result<cfs_client::FileAttr> StatCached(const std::string& path, bool fresh, uint64_t dir_id);
  // The store identity of directory `path` as the mount or the cache hold it, 0 if neither.
  uint64_t HeldDirId(const std::string& path);
  // Resolve without check_store: the path is taken as it is (an S3 store has no symlinks or
  // per-object rights); `fresh`: its attributes from the store, a regular file's only.
  Result<Resolved> ResolveLexical(const std::string& path, bool fresh, Reject* why);

  const Options options_;
  cfs_client::Backend* const backend_;
  Clock* const clock_;
  struct Cached {
    cfs_client::FileAttr attr;
    uint64_t time_ns = 0;
    uint64_t dir_id = 0;  // the directory it was found in (the binding of its request)
  };
  Mutex mu_;  // a leaf lock, never held across a store request
  std::unordered_map<std::string, Cached> cache_ GUARDED_BY(mu_);
};

}  // namespace cubetorchfs::prefetch
