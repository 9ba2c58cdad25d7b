// Listing ahead: the subdirectories of a directory just listed are listed before the kernel
// asks for them.
//
// A training scan (torchvision's ImageFolder, os.walk) lists a tree's root, then each class
// directory in name order, one at a time: every listing is a store round trip on the scan's
// critical path. When a listing holds at least two subdirectories, they become a plan: the
// first `depth` of them, in name order, are listed on this component's own threads, and as
// the kernel opens one of them (Take), the plan is kept `depth` directories ahead of it.
// FileSystem::OpenDir takes a listing from here when one is ready or being made (it waits for
// that one rather than ask the store a second time), else lists the directory itself.
//
// Staleness: a listing made ahead is the store as it was when its List began. It is handed out
// only if nothing was changed through the mount since then (the file system's change count,
// `changes`), it is at most `fresh_ns` old, and the directory opened is the one planned (its
// store identity: a directory swapped in the store by another user gets its own listing). A change
// made behind the mount's back is seen as late as that, as it would be through the kernel's own
// entry cache (the entry timeout).
//
// Bounds: at most `max_plans` plans (the oldest goes), each of at most `max_plan_dirs` names;
// listings held, ready or being made, at most `depth` a plan and `max_entries` entries in
// all (past it, a listing is dropped when done: OpenDir lists that directory itself).
//
// Thread safety: all methods are thread-safe. One mutex guards the plans and listings; it is
// never held across a store request.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cfs_client/backend.h"
#include "common/clock.h"
#include "common/thread_annotations.h"

namespace prometheus {
class Counter;
class Registry;
}  // namespace prometheus

namespace cubetorchfs::fs {

class ListAhead {
 public:
  struct Options {
    uint64_t depth = 16;  // directories listed ahead of the latest one opened, per plan
    unsigned threads = 4;
    uint64_t fresh_ns = 300'000'000'000;  // listings older than this are not handed out
    uint64_t max_entries = 1u << 17;      // entries held in all listings made ahead (~20 MB)
    uint64_t max_plans = 4;
    uint64_t max_plan_dirs = 1u << 17;  // names of subdirectories a plan holds (~5 MB)
  };
  struct Stats {
    uint64_t listed = 0;   // listings made ahead
    uint64_t taken = 0;    // handed to OpenDir
    uint64_t waited = 0;   // of those, still being made when OpenDir came
    uint64_t stale = 0;    // made ahead, but a change through the mount or age made them unusable
    uint64_t dropped = 0;  // made ahead, not kept (max_entries) or failed
  };

  // `backend`, `clock` and `registry` (may be null) outlive this; `changes` (may be null:
  // nothing ever changes) is the file system's count of changes made through the mount.
  ListAhead(const Options& options, cfs_client::Backend* backend, Clock* clock,
            const std::atomic<uint64_t>* changes, prometheus::Registry* registry = nullptr);
  ~ListAhead();  // stops and joins the threads; listings being made are finished first
  ListAhead(const ListAhead&) = delete;
  ListAhead& operator=(const ListAhead&) = delete;

  // `dir` was listed with `entries` (by OpenDir): its subdirectories become a plan.
  void OnListed(const std::string& dir, const std::vector<cfs_client::DirEntry>& entries);
  // The listing of `path` made ahead, if one is ready or being made and still good (waiting
  // for it then); nothing if OpenDir must list `path` itself. Moves its plan ahead. `dir_id`
  // is the store identity (FileAttr::StoreId) of the directory the caller opens, as the
  // kernel checked its permissions: a listing planned from another directory's entry (one
  // swapped in the store since) is not handed out. 0: not known.
  std::optional<std::vector<cfs_client::DirEntry>> Take(const std::string& path,
                                                        uint64_t dir_id = 0);

  Stats GetStats() const;

 private:
  struct Listing {
    bool done = false;
    bool ok = false;
    uint64_t changes = 0;  // the change count when its List began
    uint64_t dir_id = 0;   // the store identity of the directory planned (0: none)
    uint64_t started_ns = 0;
    std::vector<cfs_client::DirEntry> entries;
  };
  struct Plan {
    std::string dir;                 // "" for the store's root
    std::vector<std::string> names;  // its subdirectories, in name order
    std::vector<uint64_t> ids;       // their store identities (FileAttr::StoreId), same order
    uint64_t next = 0;               // names[next] is the next to list
    uint64_t opened = 0;             // one past the latest of names opened (Take)
    uint64_t used_ns = 0;            // when it was made or last moved
  };

  std::string ChildPath(const std::string& dir, const std::string& name) const;
  // The whole listing of `path`, read a page at a time; an error past `room` entries (a
  // directory too large to hold ahead is never held whole, not even for a moment).
  Result<std::vector<cfs_client::DirEntry>> ListWithin(const std::string& path, uint64_t room);
  static constexpr size_t kPageEntries = 4096;
  // Schedules listings of `plan` up to names[upto).
  void ScheduleLocked(Plan& plan, uint64_t upto) REQUIRES(mu_);
  void Loop();
  uint64_t Changes() const { return changes_ == nullptr ? 0 : changes_->load(); }
  // Counts one of `outcome` (in stats_ and the metric).
  void CountLocked(uint64_t Stats::*outcome) REQUIRES(mu_);

  const Options options_;
  cfs_client::Backend* const backend_;
  Clock* const clock_;
  const std::atomic<uint64_t>* const changes_;
  std::atomic<bool> warned_too_large_{false};

  mutable Mutex mu_;       // guards the members marked GUARDED_BY(mu_) and each Listing's fields
  CondVar work_cv_{&mu_};  // the loops: a path queued, or stopping
  CondVar done_cv_{&mu_};  // a Take waiting: a listing done, or stopping
  bool stopping_ GUARDED_BY(mu_) = false;
  std::deque<std::string> queue_ GUARDED_BY(mu_);  // paths to list, in order
  // Queued, being made or ready.
  std::map<std::string, std::shared_ptr<Listing>> listings_ GUARDED_BY(mu_);
  uint64_t held_entries_ GUARDED_BY(mu_) = 0;  // entries of the ready listings
  std::vector<Plan> plans_ GUARDED_BY(mu_);
  Stats stats_ GUARDED_BY(mu_);
  // cubetorchfs_list_ahead_total by outcome (null without a registry), in Stats' order.
  prometheus::Counter* counters_[5] = {};
  std::vector<std::thread> threads_;  // service loops (Loop), started and joined here
};

}  // namespace cubetorchfs::fs
