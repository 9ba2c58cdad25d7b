// The control file /tmp/cube_torch.config.<volName> through which the Python hook (and the
// original cube_torch package) find a running daemon. Written once the mount is ready; removed
// on clean exit.
//
// The directory is usually /tmp, shared with every local user, and the daemon runs as root,
// so the file is written as an attacker would not want it (docs/permissions.md):
// - the directory must be owned by root or by us, and not writable by others unless sticky
//   (like /tmp): elsewhere another user could swap the file under us;
// - the bytes go to a temp file of random name created by mkostemp (O_EXCL: a planted symlink
//   is never followed), mode 0644 set with fchmod (readers are other users), fsynced, then
//   renamed over the final name (rename replaces a planted symlink, never follows it);
// - removal unlinks only the very file we wrote (same device and inode, regular, ours).
//
// Thread safety: the functions may be called from any thread.
#pragma once

#include <string>

#include "common/status.h"

namespace cubetorchfs::control {

struct ControlInfo {
  std::string vol_name;
  std::string mount_point;
  int prof_port = 0;
  std::string control_socket;
  int metrics_port = 0;
  int pid = 0;              // the process serving the mount
  int supervisor_pid = 0;   // its supervisor, which holds the FUSE connection
  uint64_t generation = 0;  // processes that served the mount before this one
  std::string version;
};

// $CUBE_TORCH_CONFIG_DIR (default /tmp) + "/cube_torch.config." + vol_name.
std::string ControlFilePath(const std::string& vol_name);

std::string ControlFileJson(const ControlInfo& info);

// OK if `dir` may hold a control file: a directory (symlinks to one are followed) owned by
// root or by this process's effective user, and not group/world-writable unless sticky.
// PermissionDenied naming the directory and the problem otherwise.
Status CheckControlDir(const std::string& dir);

// Checks the directory (CheckControlDir), then writes `path` through a random temp file
// (see the top of this file). Remembers the device and inode written, for RemoveControlFile.
Status WriteControlFile(const std::string& path, const ControlInfo& info);

// Removes `path` only if it is still the file WriteControlFile wrote there (regular, owned by
// us, same device and inode, naming `pid`): never a file that replaced it, never a link.
void RemoveControlFile(const std::string& path, int pid);

}  // namespace cubetorchfs::control
