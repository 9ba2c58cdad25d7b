// A control server's world for tests of its routes (tests/control/control_routes_test.cc) and
// for the routes' fuzzer (tests/fuzz/fuzz_control_routes.cc): in-process and real, a
// Prefetcher (its jobs run by the test, start_workers off), a PathResolver, an NVMe tier with
// its Warmer and a ModelFetcher for /v1/files/open, all over a posix store in a temp directory
// that holds what an attacker aims at: files and directories only root may read, a file its
// group may read, symlinks that climb out of the store, point outside it, loop, or lead to a
// private file, a FIFO.
//
// Limits are small, so that a few requests reach them: 2 streams and 8 queued paths a user,
// 12 queued paths in all, 64 JSON values a body.
//
// Thread safety: one thread sets it up and tears it down; the server's threads use it between.
#pragma once

#include <prometheus/registry.h>

#include <boost/asio.hpp>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "cache/disk_cache.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "control/control_server.h"
#include "control/server_impl.h"
#include "prefetch/access.h"
#include "prefetch/model_fetch.h"
#include "prefetch/prefetcher.h"
#include "prefetch/warmer.h"

namespace cubetorchfs::control::testing {

// In the files only root may read, and nowhere else.
inline constexpr std::string_view kSecret = "CTFS-FUZZ-SECRET-4c1d";
inline constexpr const char* kMount = "/mnt/fuzz";

struct RouteWorld {
  // `log_to_file`: warnings (rate-limited) go to a file in the world's directory, so that their
  // escaping runs; the process's logging is set up for that (the fuzzer's choice).
  explicit RouteWorld(bool log_to_file);
  ~RouteWorld();  // removes the directory

  // The server's options of the world: its mount, resolver, registry and limits.
  ControlServer::Options ServerOptions();
  // A server over the world; without `opener`, /v1/files/open answers 501; without a warmer,
  // /v1/warmup answers 422.
  std::unique_ptr<detail::ServerImpl> MakeServer(const ControlServer::Options& options,
                                                 bool opener = true, bool with_warmer = true);

  std::filesystem::path dir;
  std::unique_ptr<cfs_client::Backend> store;
  prometheus::Registry registry;
  std::unique_ptr<cache::RamCache> ram;
  std::unique_ptr<cache::DiskCache> disk;
  std::unique_ptr<prefetch::Prefetcher> prefetcher;
  std::unique_ptr<prefetch::PathResolver> resolver;
  std::unique_ptr<prefetch::Warmer> warmer;
  std::unique_ptr<prefetch::ModelFetcher> models;
  // root; a stranger; a member of the files' group; a second stranger.
  prefetch::Caller callers[4];
};

}  // namespace cubetorchfs::control::testing
