#include "daemon/admin.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/status.h"
#include "common/trusted_file.h"
#include "control/control_client.h"
#include "control/control_file.h"

namespace cubetorchfs::daemon {

using nlohmann::json;

std::string UnescapeMountinfo(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      const std::string oct = s.substr(i + 1, 3);
      if (oct.size() == 3 && oct.find_first_not_of("01234567") == std::string::npos) {
        out.push_back(static_cast<char>(std::stoi(oct, nullptr, 8)));
        i += 3;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

namespace {

constexpr int kExitUnhealthy = 1;
constexpr int kExitUsage = 2;

const char* g_what = "cubetorchfs";
double g_alarm_s = 0;

void OnAlarm(int) {
  char msg[160];
  const int n = std::snprintf(msg, sizeof msg, "%s: no answer from the daemon within %.0f s\n",
                              g_what, g_alarm_s);
  if (n > 0) {
    ssize_t ignored = ::write(STDERR_FILENO, msg, static_cast<size_t>(n));
    (void)ignored;
  }
  ::_exit(kExitUnhealthy);
}

// Ends the process if the daemon does not answer within `seconds`.
void Deadline(const char* what, double seconds) {
  g_what = what;
  g_alarm_s = seconds;
  ::signal(SIGALRM, OnAlarm);
  ::alarm(static_cast<unsigned>(std::ceil(seconds)));
}

struct Daemon {
  std::string mount_point, vol_name, socket;
  json control;  // the control file
};

// The volume mounted at `path`, from mountinfo; the mount is not touched.
Result<std::string> VolumeAt(const std::string& mount_point) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line, vol;
  bool found = false;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string id, parent, dev, root, mp, field;
    ss >> id >> parent >> dev >> root >> mp;
    while (ss >> field && field != "-") {
    }
    std::string fstype, source;
    ss >> fstype >> source;
    if (UnescapeMountinfo(mp) != mount_point) continue;
    found = true;  // the last mount on the path is the one seen there
    vol = fstype == "fuse.cubetorchfs" && UnescapeMountinfo(source).rfind("cubetorchfs:", 0) == 0
              ? UnescapeMountinfo(source).substr(std::strlen("cubetorchfs:"))
              : "";
  }
  if (!found) return Status::NotFound(mount_point + ": not a mount point");
  if (vol.empty()) return Status::InvalidArgument(mount_point + ": not a cubetorchfs mount");
  return vol;
}

Result<Daemon> FindDaemon(const std::string& path) {
  Daemon d;
  d.mount_point = std::filesystem::absolute(path).lexically_normal().string();
  if (d.mount_point.size() > 1 && d.mount_point.back() == '/') d.mount_point.pop_back();
  CTFS_ASSIGN_OR_RETURN(d.vol_name, VolumeAt(d.mount_point));
  const std::string file = control::ControlFilePath(d.vol_name);
  Result<std::string> text = ReadTrustedControlFile(file);
  if (!text.ok())
    return Status::NotFound(d.mount_point + ": no control file of volume " + d.vol_name + " (" +
                            text.status().message() + ")");
  d.control = json::parse(*text, nullptr, false);
  if (!d.control.is_object() || !d.control.contains("control_socket") ||
      !d.control["control_socket"].is_string())
    return Status::InvalidArgument(file + ": not a control file");
  d.socket = d.control["control_socket"].get<std::string>();
  struct stat st;
  if (::lstat(d.socket.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) ||
      (st.st_uid != 0 && st.st_uid != ::geteuid()))
    return Status::PermissionDenied(d.socket + ": not a socket owned by root or you");
  return d;
}

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

std::string Duration(double s) {
  const long t = static_cast<long>(s);
  char buf[48];
  if (t >= 86400)
    std::snprintf(buf, sizeof buf, "%ldd %ldh", t / 86400, t % 86400 / 3600);
  else if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh %ldm", t / 3600, t % 3600 / 60);
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%ldm %lds", t / 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

double Num(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0;
}

void PrintReport(const Daemon& d, const json& r) {
  const bool healthy = r.value("healthy", false);
  std::cout << "cubetorchfs " << r.value("version", "?") << " at " << d.mount_point << " (volume "
            << d.vol_name << "): " << (healthy ? "healthy" : "UNHEALTHY") << "\n";
  std::cout << "  pid " << r.value("pid", 0) << ", supervisor " << r.value("supervisor_pid", 0)
            << ", generation " << r.value("generation", 0) << " (restarts and upgrades so far)"
            << ", up " << Duration(Num(r, "uptime_s")) << "\n";
  if (r.contains("transport")) {
    std::cout << "  transport: " << r.value("transport", "?");
    if (r.value("passthrough", false)) std::cout << ", large files by passthrough";
    std::cout << "\n";
  }
  const json store = r.value("store", json::object());
  std::cout << "  store " << store.value("name", "?") << ": ";
  if (store.value("reachable", false)) {
    char lat[32];
    std::snprintf(lat, sizeof lat, "%.1f ms", Num(store, "latency_ms"));
    std::cout << "reachable, " << lat << "\n";
  } else {
    std::cout << "NOT reachable: " << store.value("error", "?") << "\n";
  }
  const json cache = r.value("cache", json::object());
  std::cout << "  cache: RAM " << Bytes(Num(cache, "ram_bytes")) << " of "
            << Bytes(Num(cache, "ram_capacity_bytes"));
  if (cache.contains("disk_bytes")) std::cout << ", NVMe " << Bytes(Num(cache, "disk_bytes"));
  std::cout << "\n";
  const json reads = r.value("reads", json::object());
  std::cout << "  reads: hit ratio ";
  if (r.contains("hit_ratio") && r["hit_ratio"].is_number()) {
    char ratio[16];
    std::snprintf(ratio, sizeof ratio, "%.3f", r["hit_ratio"].get<double>());
    std::cout << ratio;
  } else {
    std::cout << "-";
  }
  std::cout << " (hit " << Num(reads, "hit") << ", late " << Num(reads, "late") << ", miss "
            << Num(reads, "miss") << ")\n";
  if (r.contains("last_error") && r["last_error"].is_object())
    std::cout << "  last warning or error (" << Duration(Num(r["last_error"], "s_ago"))
              << " ago): " << r["last_error"].value("text", "") << "\n";
  else
    std::cout << "  last warning or error: none\n";
}

const char* kStatusUsage = R"(usage: cubetorchfs status MOUNTPOINT [--json] [--timeout S]

Prints the health of the mount: version, uptime, whether the store answers and how fast,
cache fill, hit rate, the last warning or error. Exit status: 0 healthy, 1 unhealthy (the
store does not answer, or the daemon does not within --timeout, default 10 s), 2 not a
cubetorchfs mount or bad usage.
)";

const char* kUpgradeUsage = R"(usage: cubetorchfs upgrade MOUNTPOINT [--timeout S]

Hands the mount over to the installed cubetorchfs binary without unmounting: the running
daemon stops taking requests, passes its open connection and inode table on, and exits;
training reading the mount goes on. Refused while files are open for writing through the
mount. Needs root or the daemon's user. Waits up to --timeout seconds (default 60).
)";

// Parses MOUNTPOINT [--json] [--timeout S]; false after printing why.
bool ParseArgs(const std::vector<std::string>& args, const char* usage, std::string* path,
               bool* as_json, double* timeout_s) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-h" || args[i] == "--help") {
      std::cout << usage;
      std::exit(0);
    } else if (args[i] == "--json" && as_json != nullptr) {
      *as_json = true;
    } else if (args[i] == "--timeout" && i + 1 < args.size()) {
      char* end = nullptr;
      *timeout_s = std::strtod(args[++i].c_str(), &end);
      if (*end != '\0' || !(*timeout_s > 0) || *timeout_s > 3600) {
        std::cerr << "--timeout: a number of seconds in (0, 3600]\n";
        return false;
      }
    } else if (!args[i].empty() && args[i][0] != '-' && path->empty()) {
      *path = args[i];
    } else {
      std::cerr << "unexpected argument " << args[i] << "\n" << usage;
      return false;
    }
  }
  if (path->empty()) {
    std::cerr << usage;
    return false;
  }
  return true;
}

}  // namespace

int RunStatus(const std::vector<std::string>& args) {
  std::string path;
  bool as_json = false;
  double timeout_s = 10;
  if (!ParseArgs(args, kStatusUsage, &path, &as_json, &timeout_s)) return kExitUsage;
  Result<Daemon> d = FindDaemon(path);
  if (!d.ok()) {
    std::cerr << "cubetorchfs status: " << d.status().message() << "\n";
    return d.status().IsNotFound() && d.status().message().find("control file") != std::string::npos
               ? kExitUnhealthy
               : kExitUsage;
  }
  Deadline("cubetorchfs status", timeout_s);
  control::ControlClient client(d->socket);
  Result<control::HttpReply> r = client.Call("GET", "/v1/health", "");
  ::alarm(0);
  if (!r.ok()) {
    std::cerr << "cubetorchfs status: " << d->mount_point
              << ": the daemon does not answer: " << r.status().message() << "\n";
    return kExitUnhealthy;
  }
  json report = json::parse(r->body, nullptr, false);
  if (!report.is_object() || (r->status != 200 && r->status != 503)) {
    std::cerr << "cubetorchfs status: unexpected answer " << r->status << ": " << r->body << "\n";
    return kExitUnhealthy;
  }
  if (as_json)
    std::cout << report.dump(2) << "\n";
  else
    PrintReport(*d, report);
  return report.value("healthy", false) ? 0 : kExitUnhealthy;
}

int RunUpgrade(const std::vector<std::string>& args) {
  std::string path;
  double timeout_s = 60;
  if (!ParseArgs(args, kUpgradeUsage, &path, nullptr, &timeout_s)) return kExitUsage;
  Result<Daemon> d = FindDaemon(path);
  if (!d.ok()) {
    std::cerr << "cubetorchfs upgrade: " << d.status().message() << "\n";
    return kExitUsage;
  }
  const int old_pid = d->control.value("pid", 0);
  const std::string old_version = d->control.value("version", "?");
  Deadline("cubetorchfs upgrade", timeout_s);
  {
    control::ControlClient client(d->socket);
    Result<control::HttpReply> r = client.Call("POST", "/v1/admin/upgrade", "");
    if (!r.ok()) {
      std::cerr << "cubetorchfs upgrade: " << d->mount_point
                << ": the daemon does not answer: " << r.status().message() << "\n";
      return kExitUnhealthy;
    }
    if (r->status != 202) {
      json e = json::parse(r->body, nullptr, false);
      std::cerr << "cubetorchfs upgrade: refused: "
                << (e.is_object() && e.contains("error") ? e["error"].dump() : r->body) << "\n";
      return kExitUnhealthy;
    }
  }
  // The new daemon writes the control file, then answers on the socket.
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    Result<Daemon> now = FindDaemon(path);
    if (!now.ok() || now->control.value("pid", 0) == old_pid) continue;
    control::ControlClient client(now->socket);
    Result<control::HttpReply> r = client.Call("GET", "/v1/health", "");
    if (!r.ok()) continue;
    json report = json::parse(r->body, nullptr, false);
    std::cout << "upgraded " << now->mount_point << ": pid " << old_pid << " (" << old_version
              << ") -> pid " << now->control.value("pid", 0) << " ("
              << (report.is_object() ? report.value("version", "?") : "?") << ")\n";
    return 0;
  }
}

}  // namespace cubetorchfs::daemon
