// The `cubetorchfs` command line:
//   cubetorchfs -c CONFIG [MOUNTPOINT] [-f] [-d] [-o OPT[,OPT...]]
//   cubetorchfs CONFIG MOUNTPOINT [-o OPT[,OPT...]]      (the form mount.fuse3 and fstab use)
//   cubetorchfs COMMAND ...                               (Commands(): warmup, status, upgrade)
//   cubetorchfs --version | --help
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

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

// A command of its own, named by the first argument: what `cubetorchfs --help` lists and
// what Main dispatches on (RunCommand in main.cc), from this one table.
struct Command {
  std::string_view name;
  std::string_view synopsis;  // its arguments
  std::string_view summary;   // one line
};
const std::vector<Command>& Commands();

// The --help text: the mount's usage, every command of Commands(), the options.
std::string UsageText();

// Where a detached daemon logs when the config has no logDir: /var/log/cubetorchfs for root,
// else $XDG_STATE_HOME/cubetorchfs (if absolute) or $HOME/.local/state/cubetorchfs; "" if
// neither variable names an absolute directory.
std::string DefaultLogDir(uid_t euid, const char* xdg_state_home, const char* home);

// Opens that default directory: walked from "/" a component at a time, never through a
// symlink (O_NOFOLLOW), the missing ones made (0755, the last 0700). The last must be owned by
// us or root and closed to others' writes unless sticky. The directories above it are not
// checked: the log is opened beneath the descriptor returned (LogPathIn), never by its path,
// so a group that may write one of them (Debian's and Ubuntu's /var/log is root:syslog 0775)
// can rename names there, but cannot lead the daemon's log anywhere else. Errors start with
// "logDir: " and say what to set.
Result<UniqueFd> OpenDefaultLogDir(const std::string& dir);
// The name that opens `file` in the directory `dir_fd` holds: /proc/self/fd/N/file.
std::string LogPathIn(int dir_fd, const std::string& file);

}  // namespace cubetorchfs::daemon
