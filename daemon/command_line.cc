#include "daemon/command_line.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
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

const std::vector<Command>& Commands() {
  static const std::vector<Command> commands = {
      {"warmup", "-c CONFIG (DIR | --list FILE) [--jobs N]",
       "fill the NVMe tier with a directory's files or a list's, before training"},
      {"status", "MOUNTPOINT [--json] [--timeout S]",
       "the health of a mount: transport, cache, store, upgrades; exit 1 when unhealthy"},
      {"upgrade", "MOUNTPOINT [--timeout S]",
       "replace the running daemon with the installed binary; the mount stays"},
  };
  return commands;
}

std::string UsageText() {
  std::string text =
      "usage: cubetorchfs -c CONFIG [MOUNTPOINT] [-f] [-d] [-o OPT[,OPT...]]\n"
      "       cubetorchfs CONFIG MOUNTPOINT [-o OPT[,OPT...]]\n";
  for (const Command& c : Commands())
    text += "       cubetorchfs " + std::string(c.name) + " " + std::string(c.synopsis) + "\n";
  text += R"(       cubetorchfs --version | --help

Mounts the store described by CONFIG (JSON or YAML) at MOUNTPOINT (default: the config's
mountPoint) and serves it through a RAM cache. Returns once the mount is ready, and says
where the daemon logs: the config's logDir, else /var/log/cubetorchfs/VOLNAME.log (root) or
~/.local/state/cubetorchfs/VOLNAME.log.

commands (each has its own --help):
)";
  for (const Command& c : Commands()) {
    std::string name(c.name);
    name.resize(std::max<size_t>(name.size(), 10), ' ');
    text += "  " + name + std::string(c.summary) + "\n";
  }
  text += R"(
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
  return text;
}

std::string DefaultLogDir(uid_t euid, const char* xdg_state_home, const char* home) {
  if (euid == 0) return "/var/log/cubetorchfs";
  if (xdg_state_home != nullptr && xdg_state_home[0] == '/')
    return std::string(xdg_state_home) + "/cubetorchfs";
  if (home != nullptr && home[0] == '/') return std::string(home) + "/.local/state/cubetorchfs";
  return "";
}

Result<UniqueFd> OpenDefaultLogDir(const std::string& dir) {
  const std::string what = "logDir: not set, and the default " + dir;
  const std::string set =
      " (set logDir to a directory only root can change, or mount with -f "
      "to log to stderr)";
  if (dir.empty() || dir.front() != '/')
    return Status::InvalidArgument(what + " is not an absolute path" + set);
  UniqueFd at(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (at.get() < 0) return Status::IOError(what + ": /: " + std::strerror(errno));
  std::string walked;
  std::stringstream parts(dir);
  std::vector<std::string> names;
  for (std::string name; std::getline(parts, name, '/');)
    if (!name.empty() && name != ".") names.push_back(name);
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    if (name == "..") return Status::InvalidArgument(what + " holds \"..\"" + set);
    walked += "/" + name;
    const bool last = i + 1 == names.size();
    int fd = ::openat(at.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT &&
        (::mkdirat(at.get(), name.c_str(), last ? 0700 : 0755) == 0 || errno == EEXIST))
      fd = ::openat(at.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      struct stat l;
      if (::fstatat(at.get(), name.c_str(), &l, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(l.st_mode))
        return Status::PermissionDenied(what + ": " + walked + " is a symlink; refusing it" + set);
      return Status::IOError(what + ": " + walked + ": " + std::strerror(err) + set);
    }
    at.reset(fd);
  }
  struct stat st;
  if (::fstat(at.get(), &st) != 0) return Status::IOError(what + ": " + std::strerror(errno));
  if (st.st_uid != ::geteuid() && st.st_uid != 0)
    return Status::PermissionDenied(what + " is owned by uid " + std::to_string(st.st_uid) +
                                    ", another user; refusing it" + set);
  if ((st.st_mode & 022) != 0 && (st.st_mode & S_ISVTX) == 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::PermissionDenied(what + " (mode " + mode +
                                    ") lets other users replace what is in it; refusing it" + set);
  }
  return at;
}

std::string LogPathIn(int dir_fd, const std::string& file) {
  return "/proc/self/fd/" + std::to_string(dir_fd) + "/" + file;
}

}  // namespace cubetorchfs::daemon
