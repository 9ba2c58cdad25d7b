#include "daemon/health.h"

#include <unistd.h>

#include <chrono>

#include "common/logging.h"
#include "common/version.h"

namespace cubetorchfs::daemon {
namespace {

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double UnixS() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

Health::Health(const Options& options, cfs_client::Backend* backend,
               std::function<nlohmann::json()> extra)
    : options_(options), backend_(backend), extra_(std::move(extra)), started_s_(NowS()) {}

Health::~Health() {
  std::thread t;
  {
    MutexLock l(mu_);
    t = std::move(prober_);
  }
  if (t.joinable()) t.join();
}

void Health::Probe() {
  const double start = NowS();
  Result<cfs_client::FileAttr> root = backend_->Stat("");
  MutexLock l(mu_);
  probing_ = false;
  checked_s_ = NowS();
  latency_s_ = checked_s_ - start;
  reachable_ = root.ok();
  error_ = root.ok() ? "" : root.status().ToString();
  cv_.notify_all();
}

nlohmann::json Health::Report(bool details) {
  nlohmann::json store;
  bool healthy = false;
  {
    MutexLock l(mu_);
    const double now = NowS();
    if (!probing_ && (checked_s_ == 0 || now - checked_s_ >= options_.probe_every_s)) {
      if (prober_.joinable()) prober_.join();  // done: probing_ is false
      probing_ = true;
      probe_started_s_ = now;
      prober_ = std::thread([this] { Probe(); });
    }
    const double deadline = probe_started_s_ + options_.probe_wait_s;
    while (probing_ && NowS() < deadline)
      cv_.wait_for(mu_, std::chrono::duration<double>(deadline - NowS()));
    store["name"] = options_.store;
    if (probing_ && NowS() >= deadline) {
      // The store has not answered a probe within probe_wait_s: unhealthy, whatever an
      // earlier probe said.
      store["reachable"] = false;
      store["error"] = "no answer to a probe for " +
                       std::to_string(static_cast<int>(NowS() - probe_started_s_)) + " s";
    } else {
      store["reachable"] = reachable_;
      store["latency_ms"] = latency_s_ * 1e3;
      store["checked_s_ago"] = NowS() - checked_s_;
      if (!reachable_) store["error"] = details ? error_ : "the store does not answer";
      healthy = reachable_;
    }
  }
  nlohmann::json r = {{"healthy", healthy},
                      {"version", CUBETORCHFS_VERSION},
                      {"pid", ::getpid()},
                      {"supervisor_pid", ::getppid()},
                      {"generation", options_.generation},
                      {"uptime_s", NowS() - started_s_},
                      {"store", store}};
  if (extra_) r.update(extra_());
  const LoggedProblem p = LastLoggedProblem();
  if (p.unix_s > 0 && details)
    r["last_error"] = {{"text", p.text}, {"s_ago", std::max(0.0, UnixS() - p.unix_s)}};
  else if (p.unix_s > 0)
    r["last_error"] = {{"s_ago", std::max(0.0, UnixS() - p.unix_s)}};
  else
    r["last_error"] = nullptr;
  return r;
}

}  // namespace cubetorchfs::daemon
