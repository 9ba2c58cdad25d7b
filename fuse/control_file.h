// The control file /tmp/cube_torch.config.<volName> through which the Python hook (and the
// original cube_torch package) find a running daemon. Written atomically (temp file, fsync,
// rename) once the mount is ready; removed on clean exit.
#pragma once

#include <string>

#include "common/status.h"

namespace cubetorchfs::fuse {

struct ControlInfo {
  std::string vol_name;
  std::string mount_point;
  int prof_port = 0;
  std::string control_socket;
  int metrics_port = 0;
  int pid = 0;
  std::string version;
};

// $CUBE_TORCH_CONFIG_DIR (default /tmp) + "/cube_torch.config." + vol_name.
std::string ControlFilePath(const std::string& vol_name);

std::string ControlFileJson(const ControlInfo& info);

Status WriteControlFile(const std::string& path, const ControlInfo& info);

// Removes the file if it still names `pid` (another daemon may have replaced it).
void RemoveControlFile(const std::string& path, int pid);

}  // namespace cubetorchfs::fuse
