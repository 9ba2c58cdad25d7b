// The control server's world for tests of its routes (route_world.h).
#include "tests/control/route_world.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>

#include "common/clock.h"
#include "common/logging.h"

namespace cubetorchfs::control::testing {

namespace fs = std::filesystem;

namespace {

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "route world: %s failed\n", what);
  std::abort();
}

void WriteFile(const fs::path& p, const std::string& data, mode_t mode) {
  std::ofstream(p, std::ios::binary) << data;
  fs::permissions(p, static_cast<fs::perms>(mode));
}

}  // namespace

RouteWorld::RouteWorld(bool log_to_file) {
  char tmpl[] = "/tmp/ctfs-routes.XXXXXX";
  Check(::mkdtemp(tmpl) != nullptr, "mkdtemp");
  dir = tmpl;
  if (log_to_file) Check(InitLogging((dir / "log").string(), LogLevel::kWarn).ok(), "log");
  const fs::path root = dir / "store";
  fs::create_directories(root / "data" / "cls");
  fs::create_directories(root / "private");
  WriteFile(root / "data" / "a.jpg", std::string(1000, 'a'), 0644);
  WriteFile(root / "data" / "big.bin", std::string(70 << 10, 'b'), 0644);  // > one send buffer
  WriteFile(root / "data" / "empty", "", 0644);
  WriteFile(root / "data" / "cls" / "c.jpg", std::string(3000, 'c'), 0644);
  WriteFile(root / "data" / "model.safetensors", std::string(4096, 'm'), 0644);
  WriteFile(root / "data" / "group.bin", "group may read", 0640);
  WriteFile(root / "data" / "secret.bin", std::string(kSecret) + " in a 0600 file", 0600);
  WriteFile(root / "private" / "inner.bin", std::string(kSecret) + " in a 0700 dir", 0644);
  fs::permissions(root / "private", fs::perms::owner_all);
  fs::create_symlink("a.jpg", root / "data" / "rel.jpg");
  fs::create_symlink("cls", root / "data" / "clslink");
  fs::create_symlink("secret.bin", root / "data" / "to_secret");
  fs::create_symlink("../private/inner.bin", root / "data" / "to_private");
  fs::create_symlink("../../outside", root / "data" / "up");
  fs::create_symlink("/etc/passwd", root / "data" / "abs");
  fs::create_symlink("loop", root / "data" / "loop");
  Check(::mkfifo((root / "data" / "fifo").c_str(), 0644) == 0, "mkfifo");
  WriteFile(dir / "outside", std::string(kSecret) + " outside the store", 0600);

  auto backend = cfs_client::NewPosixBackend(root.string());
  Check(backend.ok(), "posix backend");
  store = std::move(backend).value();
  ram = cache::RamCache::New({8 << 20, 64 << 10}, &registry);
  cache::DiskCache::Options disk_options;
  disk_options.dir = (dir / "tier").string();
  disk_options.capacity_bytes = 16 << 20;
  auto tier = cache::DiskCache::Open(disk_options, &registry);
  Check(tier.ok(), "NVMe tier");
  disk = std::move(tier).value();

  prefetch::Prefetcher::Options po;
  po.start_workers = false;  // the test runs the jobs
  po.chunk_bytes = 64 << 10;
  po.window_budget_bytes = 4 << 20;
  po.prefetch.window_files = 16;
  po.max_streams_per_uid = 2;
  po.max_queued_paths_per_uid = 8;
  po.max_queued_paths = 12;
  prefetcher = std::make_unique<prefetch::Prefetcher>(po, store.get(), ram.get(), SystemClock(),
                                                      &registry, disk.get());
  resolver = std::make_unique<prefetch::PathResolver>(prefetch::PathResolver::Options{},
                                                      store.get(), SystemClock());
  warmer = std::make_unique<prefetch::Warmer>(store.get(), disk.get(), 64 << 10);
  prefetch::ModelFetcher::Options mo;
  mo.chunk_bytes = 64 << 10;
  mo.threads = 2;
  models = std::make_unique<prefetch::ModelFetcher>(mo, store.get(), ram.get(), disk.get());

  callers[0] = prefetch::Caller{0, 0, 1, {}};
  callers[1] = prefetch::Caller{4242, 4242, 2, {}};
  callers[2] = prefetch::Caller{4243, 4243, 3, {::getgid()}};  // in the files' group
  callers[3] = prefetch::Caller{4244, 4244, 0, {4244}};
}

RouteWorld::~RouteWorld() {
  models.reset();
  warmer.reset();
  resolver.reset();
  prefetcher.reset();
  disk.reset();
  ram.reset();
  store.reset();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

ControlServer::Options RouteWorld::ServerOptions() {
  ControlServer::Options so;
  so.mount_point = kMount;
  so.resolver = resolver.get();
  so.registry = &registry;
  so.max_json_elements = 64;    // reachable by small requests; the depth limit is the default
  so.queued.paths_per_uid = 8;  // the prefetcher's
  so.queued.paths = 12;
  so.idle_timeout_s = 5;
  so.ram_bytes = [r = ram.get()] { return r->bytes(); };
  return so;
}

std::unique_ptr<detail::ServerImpl> RouteWorld::MakeServer(const ControlServer::Options& options,
                                                           bool opener, bool with_warmer) {
  cfs_client::Backend* b = store.get();
  auto reader = [b](const std::string& path, const cfs_client::FileAttr& attr,
                    const std::function<Status(const char*, size_t)>& piece, uid_t) -> Status {
    std::string buf(32 << 10, '\0');
    for (uint64_t off = 0; off < attr.size;) {
      Result<size_t> n = b->Read(path, attr.Version(), off, buf.size(), buf.data());
      if (!n.ok()) return n.status();
      if (*n == 0) return Status::Stale(path + ": shorter than its size");
      if (Status s = piece(buf.data(), *n); !s.ok()) return s;
      off += *n;
    }
    return Status::OK();
  };
  ControlServer::FileOpener open;
  if (opener) {
    prefetch::ModelFetcher* mf = models.get();
    open = [mf](const std::string& path, const cfs_client::Backend::AttrCheck& check) {
      return mf->MakeResident(path, check);
    };
  }
  return std::make_unique<detail::ServerImpl>(options, prefetcher.get(), reader,
                                              with_warmer ? warmer.get() : nullptr, open);
}

}  // namespace cubetorchfs::control::testing
