// GET /v1/stats: the prefetcher's, the file lists' and the control server's counters, all
// users' for root and the caller's own for anyone else (docs/metrics.md says what each means).
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/logging.h"
#include "control/control_server.h"
#include "control/server_impl.h"

namespace cubetorchfs::control::detail {

namespace {

json CountsJson(const ReadCounts& c) {
  return json{{"hit", c.hit}, {"late", c.late}, {"miss", c.miss}};
}

json RatioJson(const ReadCounts& c) {
  if (c.total() == 0) return nullptr;
  return static_cast<double>(c.hit) / static_cast<double>(c.total());
}

}  // namespace

json ServerImpl::StatsJson(const Caller& caller) {
  Stats s = caller.IsRoot() ? prefetcher_->GetStats() : prefetcher_->GetStats(caller.uid);
  const prefetch::FileLists::Stats lists =
      caller.IsRoot() ? lists_.GetStats() : lists_.GetStats(caller.uid);
  json streams = json::array();
  for (const auto& st : s.streams) {
    streams.push_back({{"id", st.id},
                       {"name", st.name},
                       {"pid", st.pid},
                       {"uid", st.uid},
                       {"published", st.published},
                       {"read", st.read},
                       {"skipped", st.skipped},
                       {"page_cache", st.page_cache},
                       {"queued", st.queued},
                       {"queued_bytes", st.queued_bytes},
                       {"fetched", st.fetched},
                       {"failed", st.failed},
                       {"evicted_unread", st.evicted_unread},
                       {"reads", CountsJson(st.reads)},
                       {"hit_ratio", RatioJson(st.reads)}});
  }
  json rejected = json::object();
  for (int r = 1; r < kRejectReasons; ++r)
    rejected[RejectName(static_cast<Reject>(r))] = rejected_counts_[r].load();
  json refused = json::object();
  for (int r = 0; r < kRefuseReasons; ++r) refused[kRefuseNames[r]] = refused_counts_[r].load();
  return json{
      {"global",
       {{"reads", CountsJson(s.reads)},
        {"hit_ratio", RatioJson(s.reads)},
        {"prefetch",
         {{"fetched", s.fetched},
          {"failed", s.failed},
          {"evicted_unread", s.evicted_unread},
          {"preempted", s.preempted},
          {"denied", s.denied},
          {"page_resident", s.page_resident},
          {"trusted", s.trusted},
          {"probed_absent", s.probed_absent},
          {"page_drops", s.page_drops},
          {"page_pressure", s.page_pressure},
          {"lru_filled", s.lru_filled},
          {"store_reads", {{"window", s.store_reads.window}, {"lru_fill", s.store_reads.lru_fill}}},
          {"stored", s.stored},
          {"restored", s.restored},
          {"cached", s.cached},
          {"resident_marks", s.resident_marks},
          {"inflight", s.inflight},
          {"window_files", s.window_files},
          {"window_bytes", s.window_bytes},
          {"window_budget_bytes", s.window_budget_bytes},
          {"queued_paths", s.queued_paths},
          {"queued_bytes", s.queued_bytes},
          {"queued_users", s.queued_users}}},
        {"cache",
         {{"ram_bytes", (options_.ram_bytes ? options_.ram_bytes() : 0) + s.window_bytes}}},
        {"files_open",
         {{"opened", files_opened_.load()},
          {"failed", files_open_failed_.load()},
          {"store_files", files_open_store_.load()},
          {"bytes", files_open_bytes_.load()}}},
        {"files_batch",
         {{"batches", batches_.load()},
          {"files", batch_files_.load()},
          {"bytes", batch_bytes_.load()},
          {"refused", batch_refused_.load()}}},
        {"control", {{"rejected_paths", rejected}, {"refused", refused}}},
        {"lists", {{"lists", lists.lists}, {"entries", lists.entries}, {"bytes", lists.bytes}}}}},
      {"streams", streams}};
}

}  // namespace cubetorchfs::control::detail
