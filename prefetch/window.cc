#include "prefetch/window.h"

#include <prometheus/gauge.h>

#include <algorithm>

namespace cubetorchfs::prefetch {

Window::Entry& Window::Add(const std::string& path, uid_t owner) {
  Entry& e = files_[path];
  e.owner = owner;
  use_[owner].files++;
  unsettled_.fetch_add(1, std::memory_order_acq_rel);
  return e;
}

void Window::Show(const std::string& path, Entry& e) {
  if (e.invalidated) return Hide(path, e);
  auto view = std::make_shared<View>();
  view->attr = e.attr;
  view->attr_time_ns = e.attr_time_ns;
  view->dir_id = e.dir_id;
  view->ready = e.state == State::kReady;
  if (view->ready) view->chunks = e.chunks;
  {
    ViewShard& shard = ShardOf(path);
    MutexLock l(shard.mu);
    shard.views[path] = std::move(view);
  }
  e.shown = true;
  if (e.state == State::kReady && !e.shown_ready) {
    e.shown_ready = true;
    unsettled_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void Window::Hide(const std::string& path, Entry& e) {
  Unshow(path, e);
  if (e.shown_ready) {
    e.shown_ready = false;
    unsettled_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void Window::Unshow(const std::string& path, Entry& e) {
  if (!e.shown) return;
  ViewShard& shard = ShardOf(path);
  MutexLock l(shard.mu);
  shard.views.erase(path);
  e.shown = false;
}

std::shared_ptr<const Window::View> Window::FindView(const std::string& path) const {
  ViewShard& shard = ShardOf(path);
  MutexLock l(shard.mu);
  auto it = shard.views.find(path);
  return it == shard.views.end() ? nullptr : it->second;
}

void Window::Charge(Entry& e, int64_t bytes) {
  e.reserved = static_cast<uint64_t>(static_cast<int64_t>(e.reserved) + bytes);
  bytes_ = static_cast<uint64_t>(static_cast<int64_t>(bytes_) + bytes);
  Use& u = use_[e.owner];
  u.bytes = static_cast<uint64_t>(static_cast<int64_t>(u.bytes) + bytes);
  if (gauge_) gauge_->Increment(static_cast<double>(bytes));
}

void Window::Erase(iterator it) {
  Charge(it->second, -static_cast<int64_t>(it->second.reserved));
  auto u = use_.find(it->second.owner);
  if (u != use_.end() && --u->second.files == 0 && u->second.bytes == 0) use_.erase(u);
  Unshow(it->first, it->second);
  if (!it->second.shown_ready) unsettled_.fetch_sub(1, std::memory_order_acq_rel);
  files_.erase(it);
}

bool Window::AtShare(uid_t uid, uint64_t share_files, uint64_t share_bytes) const {
  auto u = use_.find(uid);
  return u != use_.end() && (u->second.files >= share_files || u->second.bytes >= share_bytes);
}

std::optional<uid_t> Window::FurthestOver(uint64_t share_files, uint64_t share_bytes) const {
  std::optional<uid_t> victim;
  uint64_t worst = 0;
  for (const auto& [uid, u] : use_) {
    const uint64_t over =
        std::max(u.files > share_files ? (u.files - share_files) * share_bytes : 0,
                 u.bytes > share_bytes ? (u.bytes - share_bytes) * share_files : 0);
    if (over > worst) {
      worst = over;
      victim = uid;
    }
  }
  return victim;
}

}  // namespace cubetorchfs::prefetch
