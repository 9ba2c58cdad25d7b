// `cubetorchfs warmup -c CONFIG (DIR | --list FILE) [--jobs N]`: fills the NVMe tier.
//
// With a daemon of the same volume running, the work goes through its control socket
// (POST /v1/warmup), so the daemon's tier is the one filled (its RocksDB index is locked to
// it). Otherwise this process opens the tier itself. Files already cached are skipped, so an
// interrupted warmup resumes. A progress bar on a terminal, a line every 5 s otherwise.

#include "daemon/warmup.h"
#include "common/trusted_file.h"

#include <prometheus/registry.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <variant>
#include <vector>

#include "cache/disk_cache.h"
#include "cfs_client/backend.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/thread_annotations.h"
#include "conf/config.h"
#include "control/control_client.h"
#include "control/control_file.h"
#include "control/control_server.h"
#include "prefetch/warmer.h"

namespace cubetorchfs::daemon {
namespace {

using json = nlohmann::json;

constexpr int kExitBadUsage = 2;

const char* kUsage = R"(usage: cubetorchfs warmup -c CONFIG (DIR | --list FILE) [--jobs N]

Fills the NVMe tier (cache.disk_dir) with every file under DIR (a path under the mount point,
or relative to the store's root; "/" for everything), or with the files listed one per line in
FILE. Already cached files are skipped, so an interrupted warmup resumes. With the daemon of
this volume running, the work goes through it, and its cache is the one filled.

options:
  -c, --config CONFIG   the daemon's config
  --list FILE           the files to warm, one path per line
  -j, --jobs N          files fetched in parallel (default 16)
  -h, --help            print this help
)";

struct Item {
  std::string path;   // store-relative
  uint64_t size = 0;  // 0 when not known (from --list)
};

struct Progress {
  std::atomic<uint64_t> done{0}, fetched{0}, skipped{0}, failed{0}, bytes{0};
  Mutex mu;
  std::vector<std::string> errors GUARDED_BY(mu);

  void Error(const std::string& e) EXCLUDES(mu) {
    MutexLock l(mu);
    if (errors.size() < 20) errors.push_back(e);
  }
  std::vector<std::string> Errors() EXCLUDES(mu) {
    MutexLock l(mu);
    return errors;
  }
};

std::string Human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

std::string Clock(double seconds) {
  if (seconds < 0 || seconds > 360000) return "--:--";
  char buf[32];
  auto s = static_cast<long>(seconds);
  std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

// Every regular file under store path `dir`, depth first.
Status Walk(cfs_client::Backend& backend, const std::string& dir, std::vector<Item>* out) {
  CTFS_ASSIGN_OR_RETURN(cfs_client::FileAttr attr, backend.Stat(dir));
  if (attr.IsRegular()) {
    out->push_back({dir, attr.size});
    return Status::OK();
  }
  std::vector<std::string> stack = {dir};
  while (!stack.empty()) {
    std::string d = std::move(stack.back());
    stack.pop_back();
    // A page at a time: a flat directory of 100 M names is never held whole.
    CTFS_ASSIGN_OR_RETURN(std::unique_ptr<cfs_client::DirLister> lister, backend.ListPages(d));
    for (bool last = false; !last;) {
      CTFS_ASSIGN_OR_RETURN(cfs_client::DirPage page, lister->Next(4096));
      last = page.last;
      for (const auto& e : page.entries) {
        std::string p = d.empty() ? e.name : d + "/" + e.name;
        if (e.attr.IsDir())
          stack.push_back(std::move(p));
        else if (e.attr.IsRegular())
          out->push_back({std::move(p), e.attr.size});
      }
    }
  }
  return Status::OK();
}

// The socket of a live daemon serving this volume, or "".
// Only a control file and socket owned by root or the caller are used (warmup often runs as
// root: a file another user planted must not steer it).
std::string LiveDaemonSocket(const std::string& vol_name) {
  Result<std::string> text = ReadTrustedControlFile(control::ControlFilePath(vol_name));
  if (!text.ok()) {
    if (!text.status().IsNotFound()) std::cerr << "warmup: " << text.status().message() << "\n";
    return "";
  }
  json c = json::parse(text.value(), nullptr, false);
  if (!c.is_object() || !c.contains("pid") || !c.contains("control_socket")) return "";
  if (!c["pid"].is_number_integer() || ::kill(c["pid"].get<int>(), 0) != 0) return "";
  if (!c["control_socket"].is_string()) return "";
  std::string sock = c["control_socket"].get<std::string>();
  struct stat st;
  if (::lstat(sock.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) ||
      (st.st_uid != 0 && st.st_uid != ::geteuid())) {
    std::cerr << "warmup: ignoring control socket " << sock
              << ": not a socket owned by root or you\n";
    return "";
  }
  control::ControlClient probe(sock);
  Result<control::HttpReply> r = probe.Call("GET", "/v1/stats", "");
  return r.ok() && r->status == 200 ? sock : "";
}

void Draw(const Progress& p, size_t total, uint64_t total_bytes, double elapsed, bool tty,
          bool final) {
  const uint64_t done = p.done.load();
  const double rate = elapsed > 0 ? static_cast<double>(p.bytes.load()) / elapsed : 0;
  const double files_rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  const double eta = files_rate > 0 ? static_cast<double>(total - done) / files_rate : -1;
  std::ostringstream os;
  if (tty) {
    const int width = 24;
    const int fill = total ? static_cast<int>(width * done / total) : width;
    os << "\r[" << std::string(fill, '#') << std::string(width - fill, '.') << "] ";
  } else {
    os << "warmup: ";
  }
  os << done << "/" << total << " files";
  if (total_bytes) os << " of " << Human(static_cast<double>(total_bytes));
  os << ", fetched " << Human(static_cast<double>(p.bytes.load())) << " at " << Human(rate)
     << "/s, ETA " << (final ? Clock(0) : Clock(eta)) << "   ";
  std::cerr << os.str();
  if (!tty || final) std::cerr << "\n";
  std::cerr.flush();
}

}  // namespace

namespace {

struct WarmupArgs {
  std::string config_path, list_path, dir;
  int jobs = 16;
};

// The command line; an exit code when there is nothing more to do (--help, a bad argument).
std::variant<WarmupArgs, int> ParseArgs(const std::vector<std::string>& args) {
  WarmupArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto next = [&]() -> const std::string* { return i + 1 < args.size() ? &args[++i] : nullptr; };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (a == "-c" || a == "--config" || a == "--list" || a == "-j" || a == "--jobs") {
      const std::string* v = next();
      if (v == nullptr) {
        std::cerr << "cubetorchfs warmup: " << a << " needs a value (see --help)\n";
        return kExitBadUsage;
      }
      if (a == "--list")
        out.list_path = *v;
      else if (a == "-j" || a == "--jobs")
        out.jobs = std::max(1, std::atoi(v->c_str()));
      else
        out.config_path = *v;
    } else if (!a.empty() && a[0] == '-') {
      std::cerr << "cubetorchfs warmup: unknown option " << a << " (see --help)\n";
      return kExitBadUsage;
    } else if (out.dir.empty()) {
      out.dir = a;
    } else {
      std::cerr << "cubetorchfs warmup: unexpected argument " << a << "\n";
      return kExitBadUsage;
    }
  }
  if (out.config_path.empty() || out.dir.empty() == out.list_path.empty()) {
    std::cerr << "cubetorchfs warmup: needs -c CONFIG and either DIR or --list FILE (see --help)\n";
    return kExitBadUsage;
  }
  return out;
}

// What to warm: the files of --list, or every file under DIR. Prints the error and returns
// false if it cannot say.
bool CollectItems(const WarmupArgs& args, const conf::Config& config, cfs_client::Backend& backend,
                  std::vector<Item>* items) {
  const std::string mount = config.mount_point;
  auto store_path = [&](const std::string& p) -> Result<std::string> {
    if (p == "/" || p == "." || (!mount.empty() && p == mount)) return std::string();
    return control::ToStorePath(mount.empty() ? "/" : mount, p);
  };
  if (!args.list_path.empty()) {
    std::ifstream in(args.list_path);
    if (!in) {
      std::cerr << "cubetorchfs warmup: --list " << args.list_path << ": cannot read\n";
      return false;
    }
    for (std::string line; std::getline(in, line);) {
      while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
      if (line.empty()) continue;
      Result<std::string> p = store_path(line);
      if (!p.ok()) {
        std::cerr << "cubetorchfs warmup: --list: " << p.status().message() << "\n";
        return false;
      }
      items->push_back({p.value(), 0});
    }
    return true;
  }
  Result<std::string> root = store_path(args.dir);
  if (!root.ok()) {
    std::cerr << "cubetorchfs warmup: " << root.status().message() << "\n";
    return false;
  }
  if (Status s = Walk(backend, root.value(), items); !s.ok()) {
    std::cerr << "cubetorchfs warmup: " << args.dir << ": " << s.message() << "\n";
    return false;
  }
  return true;
}

// Warms one file into the tier opened here.
void WarmHere(prefetch::Warmer& warmer, const Item& item, Progress& progress) {
  Result<prefetch::WarmResult> r = warmer.WarmFile(item.path);
  if (!r.ok()) {
    progress.failed++;
    progress.Error(r.status().message());
  } else if (r->fetched) {
    progress.fetched++;
    progress.bytes += r->bytes;
  } else {
    progress.skipped++;
  }
  progress.done++;
}

// Asks the running daemon to warm `items[begin, end)`.
void WarmThroughDaemon(control::ControlClient& client, const std::vector<Item>& items, size_t begin,
                       size_t end, Progress& progress) {
  json paths = json::array();
  for (size_t i = begin; i < end; ++i) paths.push_back(items[i].path);
  Result<control::HttpReply> r = client.Call("POST", "/v1/warmup", json{{"paths", paths}}.dump());
  json reply = r.ok() ? json::parse(r->body, nullptr, false) : json();
  if (!r.ok() || r->status != 200 || !reply.is_object()) {
    progress.failed += end - begin;
    progress.Error(r.ok() ? "daemon replied " + std::to_string(r->status) + ": " + r->body
                          : r.status().message());
  } else {
    progress.fetched += reply.value("fetched", 0ull);
    progress.skipped += reply.value("skipped", 0ull);
    progress.failed += reply.value("failed", 0ull);
    progress.bytes += reply.value("bytes", 0ull);
    if (reply.contains("errors") && reply["errors"].is_array())
      for (const auto& e : reply["errors"])
        if (e.is_string()) progress.Error(e.get<std::string>());
  }
  progress.done += end - begin;
}

// Runs `work` on `jobs` threads while a progress line is drawn; returns the seconds taken.
double WithProgress(int jobs, const std::function<void()>& work, const Progress& progress,
                    size_t files, uint64_t total_bytes) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const bool tty = ::isatty(STDERR_FILENO);
  RunOnThreadsWithTick(jobs, work,
                       tty ? std::chrono::milliseconds(200) : std::chrono::milliseconds(5000),
                       [&] { Draw(progress, files, total_bytes, elapsed(), tty, false); });
  if (tty) Draw(progress, files, total_bytes, elapsed(), tty, true);
  return elapsed();
}

}  // namespace

int RunWarmup(const std::vector<std::string>& argv) {
  SetLogLevel(LogLevel::kWarn);  // progress and summary go to stderr; logs only for trouble
  std::variant<WarmupArgs, int> parsed = ParseArgs(argv);
  if (const int* code = std::get_if<int>(&parsed)) return *code;
  const WarmupArgs& args = std::get<WarmupArgs>(parsed);
  Result<conf::Config> config = conf::LoadConfig(args.config_path);
  if (!config.ok()) {
    std::cerr << "cubetorchfs warmup: " << config.status().message() << "\n";
    return kExitBadUsage;
  }
  if (config->cache.disk_dir.empty()) {
    std::cerr << "cubetorchfs warmup: no NVMe tier configured (cache.disk_dir in "
              << args.config_path << "): nothing to fill\n";
    return kExitBadUsage;
  }
  prometheus::Registry registry;
  Result<std::unique_ptr<cfs_client::Backend>> backend =
      cfs_client::NewBackend(config->backend, registry, SystemClock());
  if (!backend.ok()) {
    std::cerr << "cubetorchfs warmup: backend: " << backend.status().message() << "\n";
    return kExitBadUsage;
  }
  std::vector<Item> items;
  if (!CollectItems(args, *config, **backend, &items)) return kExitBadUsage;
  uint64_t total_bytes = 0;
  for (const auto& it : items) total_bytes += it.size;

  // Through the running daemon, or with the tier opened here.
  const std::string sock = LiveDaemonSocket(config->vol_name);
  std::unique_ptr<cache::DiskCache> disk;
  std::unique_ptr<prefetch::Warmer> warmer;
  if (sock.empty()) {
    Result<std::unique_ptr<cache::DiskCache>> opened =
        cache::DiskCache::Open({config->cache.disk_dir, config->cache.disk_bytes}, nullptr);
    if (!opened.ok()) {
      std::cerr << "cubetorchfs warmup: " << opened.status().message()
                << " (is a daemon using it without its control socket?)\n";
      return kExitBadUsage;
    }
    disk = std::move(opened).value();
    warmer =
        std::make_unique<prefetch::Warmer>(backend->get(), disk.get(), config->cache.chunk_bytes);
  }
  std::cerr << "warmup: " << items.size() << " files"
            << (total_bytes ? " (" + Human(static_cast<double>(total_bytes)) + ")" : "")
            << (sock.empty() ? " into " + config->cache.disk_dir
                             : " through the running daemon (" + sock + ")")
            << ", " << args.jobs << " in parallel\n";

  Progress progress;
  std::atomic<size_t> next{0};
  const size_t batch = sock.empty() ? 1 : 16;
  auto worker = [&] {
    std::unique_ptr<control::ControlClient> client;
    if (!sock.empty()) client = std::make_unique<control::ControlClient>(sock);
    for (size_t begin = next.fetch_add(batch); begin < items.size();
         begin = next.fetch_add(batch)) {
      if (client)
        WarmThroughDaemon(*client, items, begin, std::min(items.size(), begin + batch), progress);
      else
        WarmHere(*warmer, items[begin], progress);
    }
  };
  const double seconds = WithProgress(args.jobs, worker, progress, items.size(), total_bytes);
  if (disk) disk->Flush();

  for (const auto& e : progress.Errors()) std::cerr << "warmup: failed: " << e << "\n";
  std::cerr << "warmup: " << items.size() << " files: " << progress.fetched.load() << " fetched ("
            << Human(static_cast<double>(progress.bytes.load())) << "), " << progress.skipped.load()
            << " already cached, " << progress.failed.load() << " failed, in " << Clock(seconds)
            << "\n";
  return progress.failed.load() == 0 ? 0 : 1;
}

}  // namespace cubetorchfs::daemon
