// The mount's health, for `cubetorchfs status`, GET /v1/health on the control socket and
// GET /healthz on the metrics port.
//
// Healthy means: the store answered a probe (a Stat of its root: one small request) within
// `probe_wait_s`. The probe runs only when someone asks, at most once per `probe_every_s`
// (a probe is a store request like any other; an idle mount makes none), on a thread of its
// own so a hung store cannot hold the asker longer than `probe_wait_s`.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "cfs_client/backend.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::daemon {

class Health {
 public:
  struct Options {
    std::string store;  // names the store in reports (posix root, endpoint/bucket, cubefs://)
    uint64_t generation = 0;
    double probe_every_s = 2;
    double probe_wait_s = 3;
  };
  // `extra` adds the cache and hit-rate figures to a report (called without locks held).
  Health(const Options& options, cfs_client::Backend* backend,
         std::function<nlohmann::json()> extra);
  ~Health();  // waits for a probe in flight (bounded by the backend's own timeouts)

  // The report; probes the store if the last probe is older than probe_every_s. Without
  // `details` (an asker who is neither root nor the daemon's user, or /healthz, where the
  // asker is unknown) the texts of the store's error and of the last logged problem are left
  // out: they may name another user's files.
  nlohmann::json Report(bool details);

 private:
  void Probe();

  const Options options_;
  cfs_client::Backend* const backend_;
  const std::function<nlohmann::json()> extra_;
  const double started_s_;
  Mutex mu_;
  std::condition_variable_any cv_;
  std::thread prober_ GUARDED_BY(mu_);
  bool probing_ GUARDED_BY(mu_) = false;
  double probe_started_s_ GUARDED_BY(mu_) = 0;
  double checked_s_ GUARDED_BY(mu_) = 0;  // when the last probe ended (0: never)
  bool reachable_ GUARDED_BY(mu_) = false;
  double latency_s_ GUARDED_BY(mu_) = 0;
  std::string error_ GUARDED_BY(mu_);
};

}  // namespace cubetorchfs::daemon
