#include "daemon/command_line.h"

#include <sstream>

namespace cubetorchfs::daemon {

Result<CommandLine> ParseCommandLine(const std::vector<std::string>& args) {
  CommandLine cl;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const std::string& flag) -> Result<std::string> {
      if (i + 1 >= args.size()) return Status::InvalidArgument(flag + " needs a value");
      return args[++i];
    };
    if (a == "-h" || a == "--help") {
      cl.help = true;
    } else if (a == "-V" || a == "--version") {
      cl.version = true;
    } else if (a == "-f" || a == "--foreground") {
      cl.foreground = true;
    } else if (a == "-d" || a == "--debug") {
      cl.debug = true;
    } else if (a == "--takeover" || a == "--resume") {
      CTFS_ASSIGN_OR_RETURN(std::string v, value(a));
      (a == "--takeover" ? cl.takeover : cl.resume) = v;
    } else if (a == "-c" || a == "--config") {
      CTFS_ASSIGN_OR_RETURN(std::string v, value(a));
      cl.config_path = v;
    } else if (a == "-o" || a.rfind("-o", 0) == 0) {
      std::string opts;
      if (a == "-o") {
        CTFS_ASSIGN_OR_RETURN(std::string v, value(a));
        opts = v;
      } else {
        opts = a.substr(2);
      }
      std::stringstream ss(opts);
      for (std::string opt; std::getline(ss, opt, ',');)
        if (!opt.empty()) cl.mount_options.push_back(opt);
    } else if (!a.empty() && a[0] == '-') {
      return Status::InvalidArgument("unknown option " + a + " (see --help)");
    } else {
      positional.push_back(a);
    }
  }
  if (cl.help || cl.version) return cl;
  if (cl.config_path.empty()) {
    // mount.fuse3 form: CONFIG MOUNTPOINT.
    if (positional.empty())
      return Status::InvalidArgument("no config given (-c CONFIG; see --help)");
    cl.config_path = positional[0];
    positional.erase(positional.begin());
  }
  if (positional.size() > 1) return Status::InvalidArgument("unexpected argument " + positional[1]);
  if (!positional.empty()) cl.mount_point = positional[0];
  return cl;
}

std::string UsageText() {
  return R"(usage: cubetorchfs -c CONFIG [MOUNTPOINT] [-f] [-d] [-o OPT[,OPT...]]
       cubetorchfs CONFIG MOUNTPOINT [-o OPT[,OPT...]]
       cubetorchfs warmup -c CONFIG (DIR | --list FILE) [--jobs N]
       cubetorchfs --version | --help

Mounts the store described by CONFIG (JSON or YAML) at MOUNTPOINT (default: the config's
mountPoint) and serves it through a RAM cache. Returns once the mount is ready.

options:
  -c, --config CONFIG   the config file
  -f, --foreground      stay in the foreground and log to stderr
  -d, --debug           log at debug level
  -o OPT[,OPT...]       FUSE mount options (allow_other, ro, ...)
  -V, --version         print the version
  -h, --help            print this help

Stop with `fusermount3 -u MOUNTPOINT`, SIGINT or SIGTERM. A bad config or an unusable backend
root exits with status 2 and one line naming the key.
)";
}

}  // namespace cubetorchfs::daemon
