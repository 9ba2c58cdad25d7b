// `cubetorchfs`: mounts a store through FUSE with a RAM cache and Prometheus metrics.

#include <fcntl.h>
#include <malloc.h>
#include <prometheus/registry.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "cache/cache_arena.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/private_dir.h"
#include "common/reclaim.h"
#include "common/version.h"
#include "conf/config.h"
#include "control/control_file.h"
#include "control/control_server.h"
#include "daemon/admin.h"
#include "daemon/command_line.h"
#include "daemon/handover.h"
#include "daemon/health.h"
#include "daemon/supervisor.h"
#include "daemon/warmup.h"
#include "fs/file_system.h"
#include "fuse/page_probe.h"
#include "fuse/session.h"
#include "prefetch/prefetcher.h"
#include "prefetch/resident_marks.h"

namespace cubetorchfs::daemon {
namespace {

using fs::FileSystem;
using fuse::FuseSession;
using fuse::PageProbe;

constexpr int kExitBadConfig = 2;
constexpr int kExitFailure = 1;

// Whether `option` is among the -o options (each may hold several, comma-separated).
bool HasMountOption(const std::vector<std::string>& options, const std::string& option) {
  for (const std::string& o : options) {
    size_t start = 0;
    while (start <= o.size()) {
      const size_t end = std::min(o.find(',', start), o.size());
      if (o.compare(start, end - start, option) == 0) return true;
      start = end + 1;
    }
  }
  return false;
}

int Fail(int code, const std::string& msg) {
  std::cerr << "cubetorchfs: " << msg << std::endl;
  if (!LogIsStderr()) CTFS_LOG(kError) << msg;  // one line on the terminal, not two
  return code;
}

// The supervisor's exit: the session it kept open for the mount's life is not destroyed
// (that would close the connection before the unmount is done), so no destructors run.
// Raises this process's descriptor limit before anything is opened: a mount made by hand or
// from fstab gets the shell's soft limit (often 1,024), and every user's open handles, the
// store's descriptors and the listeners share it. As root the hard limit too, up to
// fs.nr_open (at most 2^20); otherwise the soft limit up to the hard one. Returns the limit.
uint64_t RaiseDescriptorLimit() {
  struct rlimit rl;
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  rlim_t want = 1u << 20;
  if (std::ifstream f("/proc/sys/fs/nr_open"); f) {
    uint64_t nr_open = 0;
    if (f >> nr_open && nr_open > 0) want = std::min<rlim_t>(want, nr_open);
  }
  if (rl.rlim_cur >= want) return rl.rlim_cur;
  struct rlimit raised = {want, std::max(want, rl.rlim_max)};
  if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) return want;
  raised = {rl.rlim_max, rl.rlim_max};  // not allowed to raise the hard limit
  if (rl.rlim_max > rl.rlim_cur && ::setrlimit(RLIMIT_NOFILE, &raised) == 0) return rl.rlim_max;
  return rl.rlim_cur;
}

[[noreturn]] void ExitNow(int code) {
  std::fflush(nullptr);
  std::_Exit(code);
}

// The binary to start workers and upgrades from: this one's path, which after a package
// upgrade holds the new version ("/usr/bin/cubetorchfs (deleted)" names the old one).
std::string SelfExe() {
  std::error_code ec;
  std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  const std::string deleted = " (deleted)";
  if (exe.size() > deleted.size() && exe.ends_with(deleted))
    exe.resize(exe.size() - deleted.size());
  return ec ? "/proc/self/exe" : exe;
}

Result<std::string> RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return Status::NotFound(std::strerror(errno));
  return std::string(buf);
}

// Forks. The parent waits until the child reports the mount ready (prints `ready_line`, exit
// 0) or exits (its status); only the child returns, holding the write end of the pipe.
int Daemonize(const std::string& ready_line) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::perror("cubetorchfs: pipe");
    std::exit(kExitFailure);
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("cubetorchfs: fork");
    std::exit(kExitFailure);
  }
  if (pid > 0) {
    ::close(fds[1]);
    char c = 0;
    ssize_t n;
    do n = ::read(fds[0], &c, 1);
    while (n < 0 && errno == EINTR);
    if (n == 1 && c == 'R') {
      std::fputs(ready_line.c_str(), stdout);
      std::fflush(stdout);
      std::_Exit(0);
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    std::_Exit(WIFEXITED(status) ? WEXITSTATUS(status) : kExitFailure);
  }
  ::close(fds[0]);
  ::setsid();
  if (::chdir("/") != 0) {
  }  // "/" always exists; nothing sensible to do otherwise
  return fds[1];
}

void DetachStdio(bool keep_stderr) {
  int null = ::open("/dev/null", O_RDWR);
  if (null < 0) return;
  ::dup2(null, STDIN_FILENO);
  ::dup2(null, STDOUT_FILENO);
  if (!keep_stderr) ::dup2(null, STDERR_FILENO);
  if (null > STDERR_FILENO) ::close(null);
}

prefetch::Prefetcher::Options PrefetcherOptions(const conf::Config& config,
                                                uint64_t window_budget) {
  prefetch::Prefetcher::Options o;
  o.prefetch = config.prefetch;
  o.chunk_bytes = config.cache.chunk_bytes;
  o.window_budget_bytes = window_budget;
  o.attr_timeout_s = config.fuse.attr_timeout_s;
  o.max_streams_per_uid = config.prefetch.max_streams_per_uid;
  o.max_queued_paths_per_uid = config.prefetch.max_queued_paths_per_uid;
  o.max_queued_paths = config.prefetch.max_queued_paths;
  o.max_queued_path_bytes_per_uid = config.prefetch.max_queued_path_bytes_per_uid;
  o.max_queued_path_bytes = config.prefetch.max_queued_path_bytes;
  o.keep_cache = config.fuse.keep_cache;
  // Marked files are passed over without a page probe while the kernel reclaims no page.
  if (config.prefetch.trust_page_cache) o.reclaim_counter = ReadReclaimCounter;
  switch (config.prefetch.restore_pages) {
    case conf::PrefetchOptions::RestorePages::kAuto:
      o.restore_needed = [] { return ProactivePageoutActive(); };
      break;
    case conf::PrefetchOptions::RestorePages::kAlways:
      break;  // unset: always
    case conf::PrefetchOptions::RestorePages::kNever:
      o.restore_needed = [] { return false; };
      break;
  }
  return o;
}

FileSystem::Options FileSystemOptions(const conf::Config& config,
                                      const cfs_client::Capabilities& store) {
  FileSystem::Options o;
  o.attr_timeout_s = config.fuse.attr_timeout_s;
  o.keep_cache = config.fuse.keep_cache;
  o.chunk_bytes = config.cache.chunk_bytes;
  o.read_only = config.fuse.read_only;
  o.stream_min_bytes = config.cache.stream_min_bytes;
  o.list_ahead = config.fuse.list_ahead;
  o.list_ahead_threads = config.fuse.list_ahead_threads;
  o.dir_memory_bytes = config.fuse.dir_memory_bytes;
  o.list_page_entries = config.fuse.list_page_entries;
  o.max_writes_per_uid = config.fuse.max_writes_per_uid;
  // No close reaches the daemon when the kernel skips FLUSH: written files are closed after
  // an idle time instead.
  if (config.fuse.keep_cache && !config.fuse.flush_on_close && !config.fuse.read_only)
    o.write_back_idle_s = config.fuse.write_back_idle_s;
  // A lookup may bring a small file's bytes, unless the NVMe tier makes them moot.
  if (store.lookup_returns_data && config.cache.disk_dir.empty())
    o.lookup_read_bytes = static_cast<size_t>(
        std::min<uint64_t>(config.backend.s3.lookup_read_bytes, config.cache.chunk_bytes));
  return o;
}

// *.safetensors: parallel ranged fetches on first read and for /v1/files/open.
prefetch::ModelFetcher::Options ModelFetcherOptions(const conf::Config& config) {
  prefetch::ModelFetcher::Options o;
  o.chunk_bytes = config.cache.chunk_bytes;
  o.threads = static_cast<int>(std::clamp<uint64_t>(config.prefetch.max_inflight, 1, 8));
  o.background_max_bytes = config.cache.memory_bytes / 2;
  return o;
}

control::ControlServer::Options ControlOptions(const conf::Config& config, const CommandLine& cl,
                                               prometheus::Registry* registry) {
  control::ControlServer::Options o;
  o.socket_path = conf::ControlSocketPath(config);
  o.prof_port = config.prof_port;
  o.mount_point = config.mount_point;
  o.registry = registry;
  o.max_body_bytes = config.control.max_body_bytes;
  o.body_memory_bytes = config.control.body_memory_bytes;
  o.max_json_elements = config.control.max_json_elements;
  o.batch_max_bytes = config.control.batch_max_bytes;
  o.batch_memory_bytes_per_uid = config.control.batch_memory_bytes_per_uid;
  o.max_json_depth = static_cast<int>(config.control.max_json_depth);
  o.max_connections_unix = static_cast<int>(config.control.max_connections_unix);
  o.max_connections_tcp = static_cast<int>(config.control.max_connections_tcp);
  o.max_connections_per_uid = static_cast<int>(config.control.max_connections_per_uid);
  o.idle_timeout_s = config.control.idle_timeout_s;
  o.lists.max_lists_per_uid = config.prefetch.max_lists_per_uid;
  o.lists.max_bytes_per_uid = config.prefetch.max_list_bytes_per_uid;
  o.lists.max_bytes = config.prefetch.max_list_bytes;
  o.queued = {.paths_per_uid = config.prefetch.max_queued_paths_per_uid,
              .bytes_per_uid = config.prefetch.max_queued_path_bytes_per_uid,
              .paths = config.prefetch.max_queued_paths,
              .bytes = config.prefetch.max_queued_path_bytes};
  o.others_may_use = HasMountOption(cl.mount_options, "allow_other");
  return o;
}

std::vector<std::string> FuseArgv(const conf::Config& config, const CommandLine& cl) {
  std::string opts =
      "fsname=cubetorchfs:" + config.vol_name +
      ",subtype=cubetorchfs,default_permissions,max_read=" + std::to_string(config.fuse.max_read);
  if (config.fuse.read_only) opts += ",ro";
  std::vector<std::string> argv = {"cubetorchfs", "-o", opts};
  for (const auto& o : cl.mount_options) {
    argv.push_back("-o");
    argv.push_back(o);
  }
  return argv;
}

// Writes the control file the Python hook finds this mount by, and logs the mount; returns
// the pid recorded in it.
int WriteMountInfo(const conf::Config& config, const std::string& control_path,
                   const std::string& socket_path, uint64_t generation) {
  control::ControlInfo info;
  info.vol_name = config.vol_name;
  info.mount_point = config.mount_point;
  info.prof_port = config.prof_port;
  info.control_socket = socket_path;
  info.metrics_port = config.exporter_port;
  info.pid = static_cast<int>(::getpid());
  info.supervisor_pid = static_cast<int>(::getppid());
  info.generation = generation;
  info.version = CUBETORCHFS_VERSION;
  if (Status s = control::WriteControlFile(control_path, info); !s.ok())
    CTFS_LOG(kWarn) << "control file not written, the Python hook will not find this mount: "
                    << s.ToString();
  CTFS_LOG(kInfo) << "mounted " << cfs_client::StoreName(config.backend) << " at "
                  << config.mount_point << " (volume " << config.vol_name << ", cache "
                  << config.cache.memory_bytes << " bytes)";
  return info.pid;
}

// The composition root, one function on purpose (~150 lines): every component lives in this
// frame, built in dependency order and destroyed in reverse, and the shutdown below runs in
// the one order that loses nothing. The option structs are built by the helpers above.

// The kernel's readahead for our mount: its bdi's read_ahead_kb (a FUSE mount gets 128 KiB
// whatever max_readahead says). The device comes from mountinfo, not stat(): our own file
// system answers nothing until the session loop runs. Needs root; otherwise logged and left.
void SetReadAhead(const std::string& mount_point, uint64_t bytes) {
  if (bytes == 0) return;
  std::ifstream in("/proc/self/mountinfo");
  std::string line, dev;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, majmin, root, point;
    if (fields >> id >> parent >> majmin >> root >> point &&
        UnescapeMountinfo(point) == mount_point)
      dev = majmin;  // the last one is ours: mounted over any other
  }
  const std::string path = "/sys/class/bdi/" + dev + "/read_ahead_kb";
  const std::string kb = std::to_string(bytes / 1024);
  int fd = dev.empty() ? -1 : ::open(path.c_str(), O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
  const bool ok = fd >= 0 && ::write(fd, kb.data(), kb.size()) == static_cast<ssize_t>(kb.size());
  const int err = errno;
  if (fd >= 0) ::close(fd);
  if (ok)
    CTFS_LOG(kInfo) << "fuse.read_ahead: " << kb << " KiB (" << path << ")";
  else
    CTFS_LOG(kInfo) << "fuse.read_ahead: cannot set "
                    << (dev.empty() ? "(no mountinfo entry)" : path) << ": " << std::strerror(err)
                    << "; the kernel's readahead stays";
}

// Streamed reads (fs/store_stream.h) go to the kernel by splice through a pipe that must hold
// a whole reply: fuse.max_read bytes, a header and up to three pages of slack (libfuse's rule).
// A pipe beyond fs.pipe-max-size (1 MiB by default) needs CAP_SYS_RESOURCE; without it
// libfuse falls back to a fresh buffer per read, slower than the cache. So where the pipe
// cannot grow, fuse.max_read is lowered to what fits (1008 KiB for a 1 MiB pipe), and
// streaming is turned off where even that is too small.
void FitStreamedReadsToPipes(conf::Config* config) {
  if (config->cache.stream_min_bytes == 0 ||
      !cfs_client::CapabilitiesOf(config->backend).hands_out_fds || !config->cache.disk_dir.empty())
    return;
  constexpr uint64_t kSlack = 16 << 10;
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return;
  const int grown = ::fcntl(p[0], F_SETPIPE_SZ, static_cast<int>(config->fuse.max_read + kSlack));
  ::close(p[0]);
  ::close(p[1]);
  if (grown >= 0) return;
  uint64_t pipe_max = 0;
  std::ifstream("/proc/sys/fs/pipe-max-size") >> pipe_max;
  const uint64_t fits = pipe_max > kSlack ? (pipe_max - kSlack) & ~uint64_t{4095} : 0;
  if (fits < (256u << 10)) {
    CTFS_LOG(kWarn) << "cache.stream_min_bytes: off: pipes hold at most " << pipe_max
                    << " bytes here (fs.pipe-max-size, no CAP_SYS_RESOURCE); cold reads of "
                       "large files go through the cache";
    config->cache.stream_min_bytes = 0;
    return;
  }
  CTFS_LOG(kInfo) << "fuse.max_read: " << fits << " instead of " << config->fuse.max_read
                  << ", so a streamed read fits a pipe (fs.pipe-max-size " << pipe_max
                  << ", no CAP_SYS_RESOURCE)";
  config->fuse.max_read = fits;
}

int Serve(const conf::Config& config, const CommandLine& cl, const Takeover& takeover) {
  // Cached files are mostly 10 KB-1 MB buffers allocated and freed at a high rate by many
  // threads. From mmap (glibc's default above 128 KiB) each costs page faults and an munmap;
  // from one of a few heap arenas they are recycled. Measured: a third less daemon CPU per
  // prefetched epoch, and a lower peak RSS than one arena per thread.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_ARENA_MAX, 2);
  // Cached files' bytes live in an arena that outlives the process: after a crash the next
  // one caches again what this one had fetched.
  cache::CacheArena::Adoption adopted_cache;
  cache::CacheArena* arena = OpenCacheArena(config, takeover, &adopted_cache);
  cache::Buffer::UseArena(arena);
  auto registry = std::make_shared<prometheus::Registry>();

  Result<std::unique_ptr<cfs_client::Backend>> backend =
      cfs_client::NewBackend(config.backend, *registry, SystemClock());
  if (!backend.ok()) return Fail(kExitBadConfig, backend.status().message());  // names the key
  // The prefetch window is carved out of the RAM budget; the LRU gets the rest.
  const uint64_t window_budget = config.prefetch.enabled ? std::min(config.prefetch.window_bytes,
                                                                    config.cache.memory_bytes / 2)
                                                         : 0;
  std::unique_ptr<cache::DiskCache> disk;
  if (!config.cache.disk_dir.empty()) {
    Result<std::unique_ptr<cache::DiskCache>> opened =
        cache::DiskCache::Open({config.cache.disk_dir, config.cache.disk_bytes}, registry.get());
    if (!opened.ok()) return Fail(kExitBadConfig, opened.status().message());
    disk = std::move(opened).value();
  }
  cache::RamCache::Options ram_options;
  ram_options.capacity_bytes = config.cache.memory_bytes - window_budget;
  ram_options.max_entry_bytes = config.cache.chunk_bytes;
  if (disk) {  // RAM evictions are demoted to the NVMe tier, written by its own thread
    cache::DiskCache* tier = disk.get();
    ram_options.on_evict = [tier](const std::string& key, const cache::BufferRef& buffer) {
      tier->PutAsync(key, buffer);
    };
  }
  std::unique_ptr<cache::RamCache> cache = cache::RamCache::New(ram_options, registry.get());
  // What the process before had cached is cached again, the latest published first (the
  // window the readers are about to reach): for at most 100 ms before the mount serves, the
  // rest from a thread of its own while it serves (2 us a chunk: seconds for millions). A
  // write through the mount meanwhile keeps its file's old bytes out (BeginAdoption).
  // (Joined before the cache goes: declared after it, destroyed before it.)
  std::optional<Background> caching_again;
  if (!adopted_cache.entries.empty()) {
    cache->BeginAdoption();
    const auto start = std::chrono::steady_clock::now();
    const size_t found = adopted_cache.entries.size();
    const uint64_t first =
        cache::CacheAdopted(*cache, arena, &adopted_cache, start + std::chrono::milliseconds(100));
    auto rest = [ram = cache.get(), arena, &adopted_cache, start, found, first] {
      const uint64_t kept =
          first +
          (adopted_cache.entries.empty() ? 0 : cache::CacheAdopted(*ram, arena, &adopted_cache));
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      CTFS_LOG(kInfo) << "cached again " << kept << " of the " << found
                      << " chunks the process before held, in " << static_cast<int>(ms) << " ms ("
                      << first << " before serving)";
    };
    if (adopted_cache.entries.empty())
      rest();
    else
      caching_again.emplace(rest);
  }
  PageProbe page_probe;  // outlives the prefetcher, which may call it; attached below
  prefetch::Prefetcher prefetcher(PrefetcherOptions(config, window_budget), backend->get(),
                                  cache.get(), SystemClock(), registry.get(), disk.get());
  Result<std::unique_ptr<FileSystem>> fs =
      FileSystem::New(FileSystemOptions(config, (*backend)->capabilities()), backend->get(),
                      cache.get(), &prefetcher, SystemClock(), *registry, disk.get());
  if (!fs.ok()) return Fail(kExitBadConfig, "backend.root: " + fs.status().message());
  prefetch::ModelFetcher model_fetcher(ModelFetcherOptions(config), backend->get(), cache.get(),
                                       disk.get());
  (*fs)->set_model_fetcher(&model_fetcher);

  control::ControlServer::Options control_options = ControlOptions(config, cl, registry.get());
  // Paths in control requests are resolved for their caller beneath the root. A store without
  // owners or symlinks (S3) gives every object the same owner and mode: only lexical checks.
  prefetch::PathResolver::Options resolver_options;
  resolver_options.check_store = (*backend)->capabilities().has_owners;
  FileSystem* filesystem = fs->get();
  // Asked by the control server and the supervisor's channel; the session loop stops on it.
  Handover handover([filesystem] { return filesystem->open_writes(); });
  // The session, once created, for the health report.
  std::atomic<const FuseSession*> health_session{nullptr};
  resolver_options.known_attr = [filesystem](const std::string& path, uint64_t dir_id) {
    return filesystem->KnownAttr(path, nullptr, dir_id);
  };
  prefetch::PathResolver resolver(resolver_options, backend->get(), SystemClock());
  // Residency checks before prefetching ask the inode table, never the store.
  prefetcher.SetAttrSource(filesystem);
  control_options.resolver = &resolver;
  std::unique_ptr<prefetch::Warmer> warmer;
  if (disk)
    warmer =
        std::make_unique<prefetch::Warmer>(backend->get(), disk.get(), config.cache.chunk_bytes);
  Health::Options health_options;
  health_options.store = cfs_client::StoreName(config.backend);
  health_options.generation = takeover.generation;
  cache::RamCache* ram = cache.get();
  cache::DiskCache* nvme = disk.get();
  const uint64_t ram_budget = config.cache.memory_bytes;
  Health health(health_options, backend->get(), [&prefetcher, ram, nvme, ram_budget] {
    const prefetch::Stats st = prefetcher.GetStats();
    nlohmann::json c = {{"ram_bytes", ram->bytes() + st.window_bytes},
                        {"ram_capacity_bytes", ram_budget}};
    if (nvme != nullptr) c["disk_bytes"] = nvme->bytes();
    nlohmann::json r = {
        {"cache", c},
        {"reads", {{"hit", st.reads.hit}, {"late", st.reads.late}, {"miss", st.reads.miss}}}};
    r["hit_ratio"] = st.reads.total() == 0 ? nlohmann::json(nullptr)
                                           : nlohmann::json(static_cast<double>(st.reads.hit) /
                                                            static_cast<double>(st.reads.total()));
    return r;
  });
  control_options.health = [&health, &health_session](bool details) {
    nlohmann::json r = health.Report(details);
    const FuseSession* session = health_session.load();
    r["transport"] = session != nullptr ? session->transport() : "/dev/fuse";
    r["passthrough"] = session != nullptr && session->passthrough();
    return r;
  };
  if (takeover.channel_fd >= 0)
    control_options.upgrade = [&handover] { return handover.Request(); };
  // The listeners the supervisor bound before the mount: never bound again, so nobody can take
  // a port or the socket's name while workers come and go. A worker taking over a mount
  // already served goes on without a listener it cannot have rather than end the mount.
  control_options.metrics_port = config.exporter_port;
  control_options.unix_fd = takeover.unix_fd;
  control_options.prof_fd = takeover.prof_fd;
  control_options.metrics_fd = takeover.metrics_fd;
  control_options.tolerate_listen_errors = takeover.generation > 0 || takeover.state_fd >= 0;
  control_options.ram_bytes = [ram = cache.get()] { return ram->bytes(); };
  Result<std::unique_ptr<control::ControlServer>> control = control::ControlServer::Start(
      control_options, &prefetcher,
      [filesystem](const std::string& path, const cfs_client::FileAttr& attr,
                   const std::function<Status(const char*, size_t)>& piece,
                   uid_t uid) { return filesystem->StreamFile(path, attr, piece, uid); },
      warmer.get(),
      [&model_fetcher](const std::string& path, const cfs_client::Backend::AttrCheck& check)
          -> Result<control::ControlServer::OpenedFile> {
        return model_fetcher.MakeResident(path, check);
      });
  if (!control.ok()) return Fail(kExitBadConfig, control.status().message());

  Result<std::unique_ptr<FuseSession>> created =
      FuseSession::Create(filesystem, config.fuse, *registry, &page_probe, FuseArgv(config, cl));
  if (!created.ok()) return Fail(kExitBadConfig, created.status().message());
  FuseSession& session = **created;
  // Under keep_cache the prefetcher asks the kernel which marked files it still holds.
  fuse::MountPageCacheProbe page_cache_probe(
      filesystem, &page_probe, [&session](uint64_t ino) { session.InvalidateInode(ino); });
  if (config.fuse.keep_cache) prefetcher.SetPageProbe(&page_cache_probe);
  handover.SetProbe(&page_probe);
  filesystem->SetWrittenHook([&session](uint64_t ino) {
    // A file written through the mount was closed: the kernel drops what it cached of it
    // (other descriptors' pages, attributes), so the next reader sees what the store has.
    // Not once the loop has stopped (InvalidateInode checks): the kernel may wait on a page
    // whose read is never answered, and the write-back thread would hang the unmount.
    session.InvalidateInode(ino);
  });
  if (Status s = session.SetSignalHandlers(); !s.ok()) return Fail(kExitFailure, s.message());
  // The supervisor mounted; this process serves the connection it holds, through a clone of
  // the descriptor of its own (FuseSession::ServeClone).
  if (Status s = session.ServeClone(takeover.fuse_fd); !s.ok())
    return Fail(kExitFailure, config.mount_point + ": " + s.message());
  filesystem->inodes().SetGeneration(takeover.generation);
  session.SetGeneration(takeover.generation);
  TakeHandedState(*filesystem, session, takeover);
  // After a crash (no state handed over), the inode records the dead process left in its
  // memfd: every number the kernel holds goes on naming its file, so descriptors opened
  // before read on and the kernel's cached names and pages stay good.
  const bool adopted = AdoptRecordsOfDeadProcess(*filesystem, takeover);
  OfferMemoryToSupervisor(*filesystem, session, arena, takeover);
  // After a crash on io_uring, requests queued meanwhile are fetched once a queue is kicked.
  if (takeover.generation > 0) session.SetKickPath(config.mount_point);
  if (Status s = StartConnection(session, takeover); !s.ok())
    return Fail(s.code() == Status::Code::kInvalidArgument ? kExitBadConfig : kExitFailure,
                config.mount_point + ": " + s.ToString());
  health_session.store(&session);
  if (takeover.init_fd < 0) SetReadAhead(config.mount_point, config.fuse.read_ahead_bytes);

  const std::string control_path = control::ControlFilePath(config.vol_name);
  const int pid =
      WriteMountInfo(config, control_path, control_options.socket_path, takeover.generation);
  if (takeover.channel_fd >= 0) {
    SendMessage(takeover.channel_fd, kMsgReady, "");
    // The supervisor asks for a handover here when it gets SIGUSR2.
    const bool reading = RunDetached([fd = takeover.channel_fd, &handover] {
      char c = 0;
      for (;;) {
        ssize_t n = ::recv(fd, &c, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        if (c == kMsgUpgrade)
          if (Status s = handover.Request(); !s.ok())
            CTFS_LOG(kWarn) << "upgrade refused: " << s.message();
      }
      handover.SupervisorGone();
      CTFS_LOG(kWarn) << "the supervisor is gone: a crash of this process now ends the mount";
    });
    if (!reading)
      CTFS_LOG(kWarn) << "no thread for the supervisor's channel: SIGUSR2 cannot upgrade this "
                         "daemon (cubetorchfs upgrade still can)";
  }
  if (!cl.foreground) DetachStdio(/*keep_stderr=*/false);

  filesystem->StartWriteBack();
  // After a crash (a new generation, no state handed over), the names the kernel holds from
  // the earlier process are dropped beside the serving.
  std::optional<Background> forget_old;
  if (takeover.generation > 0 && takeover.state_fd < 0 && takeover.init_fd >= 0 && !adopted)
    forget_old.emplace(
        [&session, store = backend->get()] { DropDentriesOfEarlierProcess(session, store); });
  handover.Serving();
  int rc = 0;
  for (;;) {
    // Misses wait on the store: keep many requests in flight.
    rc = session.Serve(/*min_threads=*/4, /*max_threads=*/64, handover.asked());
    if (!handover.asked()->load()) break;
    // Every request taken is answered; those not yet taken wait in the kernel for the next
    // process. A file opened for writing meanwhile cannot be handed over: go on serving.
    if (filesystem->open_writes() == 0) {
      HandOver(*filesystem, session, prefetcher, page_probe, *control, disk.get(), takeover);
    }
    CTFS_LOG(kWarn) << "upgrade abandoned: a file was opened for writing meanwhile";
    handover.Abandon();
  }

  if (forget_old) forget_old->Join();
  CTFS_LOG(kInfo) << "unmounting " << config.mount_point << " (session loop returned " << rc << ")";
  filesystem->StopWriteBack();       // it may notify the session: stop it while the session lives
  prefetcher.SetPageProbe(nullptr);  // no more probes: what is marked is simply fetched
  page_probe.Close();                // and none still being sent
  UnmountPath(config.mount_point);   // the supervisor, if any, then just exits
  session.RemoveSignalHandlers();
  // Files still open for writing when the mount went away (SIGTERM with writers running):
  // what they wrote goes to the store before exit.
  if (Status s = filesystem->FlushAll(); !s.ok())
    CTFS_LOG(kError) << "some written bytes did not reach the store: " << s.ToString();
  control->reset();         // closes the listeners and removes the socket file
  if (disk) disk->Flush();  // chunks already queued reach the NVMe tier (at most 32 MiB)
  control::RemoveControlFile(control_path, pid);
  CTFS_LOG(kInfo) << "exiting";
  // Skip the destructors: everything left is memory the kernel reclaims at once. Nothing is
  // left unwritten.
  std::_Exit(0);
}

// A command of Commands() (command_line.h), the one table --help lists.
int RunCommand(std::string_view name, const std::vector<std::string>& args) {
  if (name == "warmup") return RunWarmup(args);
  if (name == "status") return RunStatus(args);
  if (name == "upgrade") return RunUpgrade(args);
  return Fail(kExitFailure, "internal error: command " + std::string(name) + " has no handler");
}

int Main(int argc, char** argv) {
  // What an upgrading supervisor asks of the binary it is about to execute (supervisor.cc).
  if (argc == 3 && std::string(argv[1]) == "--supports")
    return std::string(argv[2]) == "listener-handover" ||
                   std::string(argv[2]) == "io_uring-adoption" ||
                   std::string(argv[2]) == "cache-handover"
               ? 0
               : 1;
  RaiseDescriptorLimit();
  if (argc > 1)
    for (const Command& c : Commands())
      if (c.name == argv[1])
        return RunCommand(c.name, std::vector<std::string>(argv + 2, argv + argc));
  Result<CommandLine> cl = ParseCommandLine(std::vector<std::string>(argv + 1, argv + argc));
  if (!cl.ok()) return Fail(kExitBadConfig, cl.status().message());
  if (cl->help) {
    std::cout << UsageText();
    return 0;
  }
  if (cl->version) {
    std::cout << "cubetorchfs " << CUBETORCHFS_VERSION << std::endl;
    return 0;
  }

  Result<conf::Config> loaded = conf::LoadConfig(cl->config_path);
  if (!loaded.ok()) return Fail(kExitBadConfig, loaded.status().message());
  conf::Config config = std::move(loaded).value();

  if (!cl->mount_point.empty()) config.mount_point = cl->mount_point;
  if (config.mount_point.empty())
    return Fail(kExitBadConfig, "mountPoint: required (in the config or on the command line)");
  if (cl->takeover.empty() && cl->resume.empty()) {
    Result<std::string> mp = RealPath(config.mount_point);
    struct stat st;
    if (!mp.ok() || ::stat(mp->c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return Fail(kExitBadConfig, "mountPoint: " + config.mount_point + " is not a directory");
    config.mount_point = mp.value();
  } else if (config.mount_point.front() != '/') {
    // A worker or a resumed supervisor: the path was resolved before the mount. Never look
    // at it again from here: the mount is there, and this process may be the one to serve it.
    return Fail(kExitBadConfig, "mountPoint: " + config.mount_point + " is not absolute");
  }

  // The backend is checked before detaching so a bad one is reported on this terminal (the
  // CubeFS SDK is loaded only after daemonizing: its errors still reach it, see Daemonize).
  if (Status s = cfs_client::CheckBackend(&config.backend); !s.ok())
    return Fail(kExitBadConfig, s.message());  // names backend.root, backend.endpoint, ...

  if (!config.cache.disk_dir.empty())  // the daemon runs from "/" once detached
    config.cache.disk_dir = std::filesystem::absolute(config.cache.disk_dir).lexically_normal();
  if (!config.backend.cubefs.log_dir.empty())  // the SDK logs there, from "/" too
    config.backend.cubefs.log_dir =
        std::filesystem::absolute(config.backend.cubefs.log_dir).lexically_normal();

  LogLevel level = cl->debug ? LogLevel::kDebug : ParseLogLevel(config.log_level).value();
  std::string log_path;
  bool logging = false;  // InitLogging done
  if (!config.log_dir.empty() &&
      (!cl->foreground || cfs_client::CapabilitiesOf(config.backend).writes_own_logs)) {
    // The daemon's log (and the CubeFS SDK's, under it) is written as root: never into a
    // directory reached through a link, or one another user could swap or fill.
    config.log_dir = std::filesystem::absolute(config.log_dir).lexically_normal();
    if (Status s = EnsureDaemonDir(config.log_dir, "logDir", "the daemon's log",
                                   CreateDir::kWithParents, 0700);
        !s.ok())
      return Fail(kExitBadConfig, s.message());
    if (!cl->foreground) log_path = config.log_dir + "/cubetorchfs.log";
  } else if (config.log_dir.empty() && !cl->foreground) {
    // Detached with no logDir: a file of its own, never the terminal the command returned to.
    const std::string dir =
        DefaultLogDir(::geteuid(), std::getenv("XDG_STATE_HOME"), std::getenv("HOME"));
    if (dir.empty())
      return Fail(kExitBadConfig,
                  "logDir: not set, and neither XDG_STATE_HOME nor HOME names a directory for "
                  "the daemon's log: set logDir");
    // Opened beneath a descriptor of the directory, never by its path: a group-writable
    // /var/log (Debian, Ubuntu) cannot redirect it (OpenDefaultLogDir).
    Result<UniqueFd> held = OpenDefaultLogDir(dir);
    if (!held.ok()) return Fail(kExitBadConfig, held.status().message());
    log_path = dir + "/" + config.vol_name + ".log";
    const std::string beneath = LogPathIn(held->get(), config.vol_name + ".log");
    if (Status s = InitLogging(beneath, level); !s.ok()) {
      std::string m = s.message();
      if (m.starts_with(beneath)) m = log_path + m.substr(beneath.size());
      return Fail(kExitBadConfig, "logDir: not set, and the default log " + m +
                                      " (set logDir, or mount with -f to log to stderr)");
    }
    logging = true;
  }
  if (Status s = logging ? Status::OK() : InitLogging(log_path, level); !s.ok())
    return Fail(kExitBadConfig, "logDir: " + s.message());

  if (!config.unknown_top_level_keys.empty()) {
    std::string keys;
    for (const auto& k : config.unknown_top_level_keys) keys += (keys.empty() ? "" : ", ") + k;
    std::cerr << "cubetorchfs: warning: ignoring unknown top-level keys: " << keys << std::endl;
    CTFS_LOG(kWarn) << "ignoring unknown top-level keys: " << keys;
  }

  if (config.backend.cubefs.remote_cache && config.backend.type != conf::BackendType::kCubefs) {
    std::cerr << "cubetorchfs: warning: backend.cubefs.remote_cache is ignored: the backend is "
                 "not cubefs"
              << std::endl;
    CTFS_LOG(kWarn) << "backend.cubefs.remote_cache is ignored: the backend is not cubefs";
  }

  FitStreamedReadsToPipes(&config);
  if (!cl->takeover.empty()) {  // a worker, started by the supervisor
    Result<Takeover> t = ParseTakeover(cl->takeover);
    if (!t.ok()) return Fail(kExitBadConfig, t.status().message());
    return Serve(config, cl.value(), *t);
  }
  const std::string exe = SelfExe();
  // Workers and upgrades run from "/" (once detached): every path in their command line is
  // absolute, the mount point as resolved here.
  std::vector<std::string> args = {argv[0], "-c",
                                   std::filesystem::absolute(cl->config_path).lexically_normal(),
                                   config.mount_point};
  if (cl->foreground) args.push_back("-f");
  if (cl->debug) args.push_back("-d");
  for (const std::string& o : cl->mount_options) args.insert(args.end(), {"-o", o});
  if (!cl->resume.empty()) {  // a supervisor executed by an upgrade
    Result<Takeover> t = ParseTakeover(cl->resume);
    if (!t.ok()) return Fail(kExitBadConfig, t.status().message());
    if (t->unix_fd < 0 && t->prof_fd < 0 && t->metrics_fd < 0) {
      // Upgraded from a version whose supervisor held no listeners: bind them now, while no
      // worker runs, and keep them from here on. One that cannot be had is left to the worker.
      Result<control::Listeners> l = control::BindListeners(conf::ControlSocketPath(config),
                                                            config.prof_port, config.exporter_port);
      if (l.ok()) {
        t->unix_fd = l->unix_fd;
        t->prof_fd = l->prof_fd;
        t->metrics_fd = l->metrics_fd;
      } else {
        CTFS_LOG(kWarn) << "supervisor: " << l.status().message()
                        << "; each worker binds its own listeners";
      }
    }
    ExitNow(Supervise(config, cl.value(), exe, args, -1, t->fuse_fd, *t, &*t));
  }
  // The NVMe tier's directory is checked here too (the worker opens it): one another user owns
  // or could swap is one line on this terminal, not a mount that comes and goes.
  if (!config.cache.disk_dir.empty())
    if (Status s = EnsurePrivateDir(config.cache.disk_dir, "cache.disk_dir", "cached data",
                                    CreateDir::kWithParents);
        !s.ok())
      return Fail(kExitBadConfig, s.message());
  // The listeners are bound here, before anything is mounted, so that a port in use or a bad
  // socket directory is one line on this terminal and nothing mounted; the supervisor keeps
  // them for every worker it starts (docs/operations.md, "Listeners").
  Result<control::Listeners> bound = control::BindListeners(conf::ControlSocketPath(config),
                                                            config.prof_port, config.exporter_port);
  if (!bound.ok()) return Fail(kExitBadConfig, bound.status().message());
  Takeover listeners;
  listeners.unix_fd = bound->unix_fd;
  listeners.prof_fd = bound->prof_fd;
  listeners.metrics_fd = bound->metrics_fd;
  const int ready_fd = cl->foreground
                           ? -1
                           : Daemonize("cubetorchfs: " + config.mount_point + " mounted (volume " +
                                       config.vol_name + "); log: " + log_path + "\n");
  // The supervisor mounts and keeps the connection for as long as the mount lives; the
  // session is never destroyed (that would close it).
  Result<int> fuse_fd =
      FuseSession::MountForSupervisor(FuseArgv(config, cl.value()), config.mount_point);
  if (!fuse_fd.ok())
    return Fail(
        fuse_fd.status().code() == Status::Code::kInvalidArgument ? kExitBadConfig : kExitFailure,
        fuse_fd.status().message());
  ExitNow(Supervise(config, cl.value(), exe, args, ready_fd, *fuse_fd, listeners, nullptr));
}

}  // namespace
}  // namespace cubetorchfs::daemon

int main(int argc, char** argv) { return cubetorchfs::daemon::Main(argc, argv); }
