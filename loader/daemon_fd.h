// The loader's side of the file-descriptor exchange with a cubetorchfs daemon
// (docs/fd_exchange.md): find the cubetorchfs mount that holds a path, find its daemon's
// control socket through the control file, and ask it for a read-only descriptor of the
// file's bytes, made resident in memory by the daemon, received with SCM_RIGHTS.
//
// Thread safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace cubetorchfs::loader {

struct MountOf {
  std::string mount_point;  // as in /proc/self/mountinfo, unescaped
  std::string vol_name;     // from the source "cubetorchfs:<volName>"
  std::string root = "/";   // the directory of the volume mounted there (a bind mount of a
                            // subdirectory has its own)
  // `path` (inside mount_point) relative to the volume's root, as the daemon's API takes it.
  std::string StorePath(const std::string& path) const;
};

// The innermost fuse.cubetorchfs mount containing the absolute, resolved `path`; nullopt when
// the path is on no such mount. `mountinfo` is the text of /proc/self/mountinfo (for tests);
// empty reads the real one.
std::optional<MountOf> FindCubetorchfsMount(const std::string& path,
                                            const std::string& mountinfo = "");

// The control socket of the daemon serving `vol_name`, from its control file
// ($CUBE_TORCH_CONFIG_DIR or /tmp, file cube_torch.config.<volName>). NotFound if there is no
// control file (or no socket), Corruption if it does not hold a control_socket.
// Both are trusted only as a root daemon (or this user's own) would leave them: the file not
// a symlink (O_NOFOLLOW), a regular file with one link, owned by root or the caller (real or
// effective uid), not group/world-writable; the socket as CheckControlSocket says. Anything
// else is PermissionDenied, after one warning on stderr naming the path and its owner.
Result<std::string> ControlSocketOf(const std::string& vol_name);

// OK if `socket_path` is a socket (not a symlink) owned by root or the caller, in a directory
// owned by root or the caller that others cannot write to (or sticky). NotFound if absent;
// PermissionDenied after one warning on stderr otherwise.
Status CheckControlSocket(const std::string& socket_path);

struct DaemonFile {
  int fd = -1;  // owned by the caller; read-only, CLOEXEC
  uint64_t size = 0;
};

// POST /v1/files/open {"path": path} on the unix socket `socket_path`, receiving the reply and
// the descriptor attached to it. Errors carry the daemon's {"error"} text, with the status its
// {"code"} names (a reply without one: NotSupported for 404/405/501). `timeout_ms` bounds
// the whole exchange (the daemon fetches the file before it answers).
Result<DaemonFile> OpenViaDaemon(const std::string& socket_path, const std::string& path,
                                 int timeout_ms);

}  // namespace cubetorchfs::loader
