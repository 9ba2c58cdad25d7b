#include "fs/list_ahead.h"

#include <algorithm>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "common/logging.h"

namespace cubetorchfs::fs {

ListAhead::ListAhead(const Options& options, cfs_client::Backend* backend, Clock* clock,
                     const std::atomic<uint64_t>* changes, prometheus::Registry* registry)
    : options_(options), backend_(backend), clock_(clock), changes_(changes) {
  if (registry != nullptr) {
    auto& family = prometheus::BuildCounter()
                       .Name("cubetorchfs_list_ahead_total")
                       .Help(
                           "Directories listed ahead of the kernel's opendir (fuse.list_ahead), "
                           "by outcome: listed, taken by an opendir, waited for (taken while "
                           "still being listed), stale (a change through the mount or age), "
                           "dropped (over the entry bound, or the listing failed)")
                       .Register(*registry);
    int i = 0;
    for (const char* outcome : {"listed", "taken", "waited", "stale", "dropped"})
      counters_[i++] = &family.Add({{"outcome", outcome}});
  }
  for (unsigned i = 0; i < std::max(1u, options_.threads); ++i)
    threads_.emplace_back([this] { Loop(); });
}

ListAhead::~ListAhead() {
  {
    MutexLock l(mu_);
    stopping_ = true;
  }
  work_cv_.SignalAll();
  done_cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

std::string ListAhead::ChildPath(const std::string& dir, const std::string& name) const {
  if (dir.empty()) return name;
  std::string path = dir;
  path += '/';
  path += name;
  return path;
}

void ListAhead::OnListed(const std::string& dir, const std::vector<cfs_client::DirEntry>& entries) {
  if (options_.depth == 0) return;
  std::vector<std::pair<std::string, uint64_t>> dirs;  // name, store identity
  for (const cfs_client::DirEntry& e : entries)
    if (e.attr.IsDir()) dirs.emplace_back(e.name, e.attr.StoreId());
  std::sort(dirs.begin(), dirs.end());
  std::vector<std::string> names;
  std::vector<uint64_t> ids;
  names.reserve(dirs.size());
  ids.reserve(dirs.size());
  for (auto& [name, id] : dirs) {
    names.push_back(std::move(name));
    ids.push_back(id);
  }
  dirs = {};
  if (names.size() < 2) return;
  if (names.size() > options_.max_plan_dirs) {
    // Not silently: a scan of this tree waits on the store for each directory.
    if (!warned_too_large_.exchange(true))
      CTFS_LOG(kInfo) << "list-ahead: " << (dir.empty() ? "the store's root" : dir) << " has "
                      << names.size() << " subdirectories, more than a plan holds ("
                      << options_.max_plan_dirs
                      << "): they are listed as the kernel asks (said once)";
    return;
  }
  MutexLock l(mu_);
  const uint64_t now = clock_->NowNanos();
  auto it = std::find_if(plans_.begin(), plans_.end(), [&](const Plan& p) { return p.dir == dir; });
  if (it == plans_.end()) {
    if (plans_.size() >= std::max<uint64_t>(1, options_.max_plans))
      plans_.erase(std::min_element(plans_.begin(), plans_.end(), [](const Plan& a, const Plan& b) {
        return a.used_ns < b.used_ns;
      }));
    plans_.push_back(Plan{dir, {}, {}, 0, 0, 0});
    it = plans_.end() - 1;
  }
  it->names = std::move(names);
  it->ids = std::move(ids);
  it->next = 0;
  it->opened = 0;
  it->used_ns = now;
  ScheduleLocked(*it, options_.depth);
}

void ListAhead::ScheduleLocked(Plan& plan, uint64_t upto) {
  upto = std::min<uint64_t>(upto, plan.names.size());
  // Listings held at most: `depth` a plan.
  const uint64_t max_listings = options_.depth * std::max<uint64_t>(1, options_.max_plans);
  bool queued = false;
  while (plan.next < upto && listings_.size() < max_listings) {
    const uint64_t i = plan.next++;
    std::string path = ChildPath(plan.dir, plan.names[i]);
    auto [it, inserted] = listings_.try_emplace(path, nullptr);
    if (!inserted) continue;
    it->second = std::make_shared<Listing>();
    it->second->dir_id = plan.ids[i];
    queue_.push_back(std::move(path));
    queued = true;
  }
  if (queued) work_cv_.SignalAll();
}

std::optional<std::vector<cfs_client::DirEntry>> ListAhead::Take(const std::string& path,
                                                                 uint64_t dir_id) {
  if (options_.depth == 0) return std::nullopt;
  MutexLock l(mu_);
  const uint64_t now = clock_->NowNanos();
  // Move the plan `path` belongs to ahead of it, and drop what the scan went past.
  const size_t slash = path.rfind('/');
  const std::string parent = slash == std::string::npos ? "" : path.substr(0, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  for (Plan& plan : plans_) {
    if (plan.dir != parent) continue;
    auto pos = std::lower_bound(plan.names.begin(), plan.names.end(), name);
    if (pos == plan.names.end() || *pos != name) break;
    const uint64_t index = pos - plan.names.begin();
    // The listings the scan went past since the latest one opened, made and never taken.
    for (uint64_t i = plan.opened; i < index; ++i) {
      auto old = listings_.find(ChildPath(plan.dir, plan.names[i]));
      if (old == listings_.end() || !old->second->done) continue;
      if (old->second->ok) held_entries_ -= old->second->entries.size();
      CountLocked(&Stats::stale);
      listings_.erase(old);
    }
    plan.opened = std::max(plan.opened, index + 1);
    plan.used_ns = now;
    plan.next = std::max(plan.next, index + 1);
    ScheduleLocked(plan, index + 1 + options_.depth);
    break;
  }
  auto it = listings_.find(path);
  if (it == listings_.end()) return std::nullopt;
  std::shared_ptr<Listing> listing = it->second;
  if (listing->started_ns == 0 && !listing->done) {
    // Queued, not begun: the caller lists it now, as soon as a thread here would.
    listings_.erase(it);
    queue_.erase(std::find(queue_.begin(), queue_.end(), path));
    return std::nullopt;
  }
  if (!listing->done) {
    CountLocked(&Stats::waited);
    while (!listing->done && !stopping_) done_cv_.Wait();
    if (!listing->done) return std::nullopt;
    it = listings_.find(path);
    if (it == listings_.end() || it->second != listing) return std::nullopt;  // dropped
  }
  listings_.erase(it);
  if (!listing->ok) return std::nullopt;
  held_entries_ -= listing->entries.size();
  // Another directory at the path than the one planned (swapped in the store, behind the
  // mount): its listing is not this one.
  const bool other_dir = listing->dir_id != 0 && dir_id != 0 && listing->dir_id != dir_id;
  if (other_dir || listing->changes != Changes() || now - listing->started_ns > options_.fresh_ns) {
    CountLocked(&Stats::stale);
    return std::nullopt;
  }
  CountLocked(&Stats::taken);
  return std::move(listing->entries);
}

void ListAhead::Loop() {
  MutexLock l(mu_);
  for (;;) {
    while (!stopping_ && queue_.empty()) work_cv_.Wait();
    if (stopping_) return;
    const std::string path = std::move(queue_.front());
    queue_.pop_front();
    auto it = listings_.find(path);
    if (it == listings_.end()) continue;
    std::shared_ptr<Listing> listing = it->second;
    listing->changes = Changes();
    listing->started_ns = std::max<uint64_t>(1, clock_->NowNanos());
    const uint64_t room = options_.max_entries - std::min(options_.max_entries, held_entries_);
    l.Unlock();
    Result<std::vector<cfs_client::DirEntry>> r = [&] {
      // The directory planned, or Stale: never the listing of one swapped in since.
      const cfs_client::Expected::Scope self({{path, listing->dir_id}});
      return ListWithin(path, room);
    }();
    l.Lock();
    listing->done = true;
    it = listings_.find(path);
    const bool held = it != listings_.end() && it->second == listing;
    if (r.ok() && held && held_entries_ + r->size() <= options_.max_entries) {
      listing->ok = true;
      listing->entries = std::move(r).value();
      held_entries_ += listing->entries.size();
      CountLocked(&Stats::listed);
    } else {
      CountLocked(&Stats::dropped);
      if (held) listings_.erase(it);
    }
    done_cv_.SignalAll();
  }
}

Result<std::vector<cfs_client::DirEntry>> ListAhead::ListWithin(const std::string& path,
                                                                uint64_t room) {
  CTFS_ASSIGN_OR_RETURN(std::unique_ptr<cfs_client::DirLister> lister, backend_->ListPages(path));
  std::vector<cfs_client::DirEntry> out;
  for (;;) {
    CTFS_ASSIGN_OR_RETURN(cfs_client::DirPage page, lister->Next(kPageEntries));
    if (out.size() + page.entries.size() > room)
      return Status::Errno(EFBIG, path + ": too large to be listed ahead");
    out.insert(out.end(), std::make_move_iterator(page.entries.begin()),
               std::make_move_iterator(page.entries.end()));
    if (page.last) return out;
  }
}

void ListAhead::CountLocked(uint64_t Stats::*outcome) {
  stats_.*outcome += 1;
  static constexpr uint64_t Stats::*kOrder[] = {&Stats::listed, &Stats::taken, &Stats::waited,
                                                &Stats::stale, &Stats::dropped};
  for (size_t i = 0; i < std::size(kOrder); ++i)
    if (kOrder[i] == outcome && counters_[i] != nullptr) counters_[i]->Increment();
}

ListAhead::Stats ListAhead::GetStats() const {
  MutexLock l(mu_);
  return stats_;
}

}  // namespace cubetorchfs::fs
