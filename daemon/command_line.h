// The `cubetorchfs` command line:
//   cubetorchfs -c CONFIG [MOUNTPOINT] [-f] [-d] [-o OPT[,OPT...]]
//   cubetorchfs CONFIG MOUNTPOINT [-o OPT[,OPT...]]      (the form mount.fuse3 and fstab use)
//   cubetorchfs --version | --help
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace cubetorchfs::daemon {

struct CommandLine {
  bool help = false;
  bool version = false;
  std::string config_path;
  std::string mount_point;  // "" = the config's mountPoint
  bool foreground = false;
  bool debug = false;
  std::vector<std::string> mount_options;  // each -o value, split at commas
  // Internal, set by the supervisor (supervisor.h): serve a connection it holds (a worker),
  // or supervise one after an upgrade executed this binary.
  std::string takeover;
  std::string resume;
};

Result<CommandLine> ParseCommandLine(const std::vector<std::string>& args);

// The --help text.
std::string UsageText();

}  // namespace cubetorchfs::daemon
