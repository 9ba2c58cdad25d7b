#include "fs/inode_table.h"

#include "common/logging.h"
#include "common/thread_annotations.h"

#include <vector>

namespace cubetorchfs::fs {

InodeTable::InodeTable(const cfs_client::FileAttr& root_attr, uint64_t now_ns) {
  Node root;
  root.info.ino = kRootIno;
  root.info.attr = root_attr;
  root.info.attr_time_ns = now_ns;
  root.nlookup = 1;
  nodes_.emplace(kRootIno, std::move(root));
  by_path_.emplace("", kRootIno);
}

std::optional<InodeTable::StoreId> InodeTable::IdOf(const cfs_client::FileAttr& attr) {
  if (attr.store_ino == 0 || attr.IsDir()) return std::nullopt;
  return StoreId{attr.store_dev, attr.store_ino};
}

uint64_t InodeTable::Acquire(const std::string& path, const cfs_client::FileAttr& attr,
                             uint64_t now_ns) {
  MutexLock l(mu_);
  auto [it, inserted] = by_path_.try_emplace(path, 0);
  const std::optional<StoreId> id = IdOf(attr);
  if (inserted && id && attr.nlink > 1) {
    // Another link of a file the table knows: the same inode. (A file of one link is never
    // joined, so a store that reuses the identity of a file deleted behind the mount's back
    // cannot make a new file an old inode's name.)
    auto known = by_store_id_.find(*id);
    if (known != by_store_id_.end()) {
      Node& n = nodes_.at(known->second);
      if (!n.info.removed) {
        it->second = known->second;
        n.other_paths.push_back(path);
        n.nlookup++;
        n.info.attr = attr;
        n.info.attr_time_ns = now_ns;
        return it->second;
      }
    }
  }
  if (inserted) it->second = next_ino_++;
  Node& n = nodes_[it->second];
  if (inserted) {
    n.info.ino = it->second;
    n.info.path = path;
    SizeChangedLocked();
  }
  n.nlookup++;
  n.info.attr = attr;
  n.info.attr_time_ns = now_ns;
  if (id) by_store_id_[*id] = it->second;
  return it->second;
}

void InodeTable::Forget(uint64_t ino, uint64_t n) {
  if (ino == kRootIno) return;
  uint64_t had = 0;
  bool bad = false;
  {
    MutexLock l(mu_);
    auto it = nodes_.find(ino);
    bad = it == nodes_.end() || n > it->second.nlookup;
    if (it != nodes_.end()) {
      Node& node = it->second;
      had = node.nlookup;
      node.nlookup = n >= node.nlookup ? 0 : node.nlookup - n;
      if (node.nlookup == 0) {
        node.other_paths.push_back(node.info.path);
        for (const std::string& path : node.other_paths) {
          auto p = by_path_.find(path);
          if (p != by_path_.end() && p->second == ino)
            by_path_.erase(p);  // not a removed inode's old path
        }
        if (std::optional<StoreId> id = IdOf(node.info.attr)) {
          auto s = by_store_id_.find(*id);
          if (s != by_store_id_.end() && s->second == ino) by_store_id_.erase(s);
        }
        nodes_.erase(it);
        SizeChangedLocked();
      }
    }
  }
  if (!bad) return;
  const uint64_t count = ++bad_forgets_;
  if (count <= 10 || (count & (count - 1)) == 0)  // the first ten, then at powers of two
    CTFS_LOG(kError) << "FUSE forget of " << n << " lookups of inode " << ino << ", which had "
                     << had << " (" << count << " such forgets so far)";
}

std::optional<InodeInfo> InodeTable::Get(uint64_t ino) const {
  MutexLock l(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return std::nullopt;
  return it->second.info;
}

void InodeTable::SetAttr(uint64_t ino, const cfs_client::FileAttr& attr, uint64_t now_ns) {
  MutexLock l(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return;
  it->second.info.attr = attr;
  it->second.info.attr_time_ns = now_ns;
}

void InodeTable::ExpireAttr(uint64_t ino) {
  MutexLock l(mu_);
  auto it = nodes_.find(ino);
  if (it != nodes_.end()) it->second.info.attr_time_ns = 0;
}

std::optional<cfs_client::FileVersion> InodeTable::SetOpenedVersion(
    uint64_t ino, const cfs_client::FileVersion& version) {
  MutexLock l(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return std::nullopt;
  std::optional<cfs_client::FileVersion> previous = it->second.info.opened_version;
  it->second.info.opened_version = version;
  return previous;
}

std::optional<uint64_t> InodeTable::Find(const std::string& path) const {
  MutexLock l(mu_);
  auto it = by_path_.find(path);
  if (it == by_path_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> InodeTable::Remove(const std::string& path) {
  if (path.empty()) return std::nullopt;
  MutexLock l(mu_);
  return RemoveLocked(path);
}

std::optional<std::string> InodeTable::OtherName(uint64_t ino, const std::string& path) const {
  MutexLock l(mu_);
  auto n = nodes_.find(ino);
  if (n == nodes_.end() || n->second.info.removed) return std::nullopt;
  if (n->second.info.path != path) return n->second.info.path;
  if (n->second.other_paths.empty()) return std::nullopt;
  return n->second.other_paths.front();
}

std::optional<std::string> InodeTable::RemoveLocked(const std::string& path) {
  auto it = by_path_.find(path);
  if (it == by_path_.end()) return std::nullopt;
  const uint64_t ino = it->second;
  by_path_.erase(it);
  auto n = nodes_.find(ino);
  if (n == nodes_.end()) return std::nullopt;
  Node& node = n->second;
  node.info.write_gen++;
  // What an fstat of a descriptor still open shows: one link fewer (none for a directory).
  cfs_client::FileAttr& a = node.info.attr;
  a.nlink = a.IsDir() || a.nlink == 0 ? 0 : a.nlink - 1;
  std::vector<std::string>& others = node.other_paths;
  if (node.info.path == path) {
    if (others.empty()) {
      node.info.removed = true;
      if (std::optional<StoreId> id = IdOf(a)) {
        auto s = by_store_id_.find(*id);
        if (s != by_store_id_.end() && s->second == ino) by_store_id_.erase(s);
      }
      return std::nullopt;
    }
    node.info.path = std::move(others.front());
    others.erase(others.begin());
  } else {
    std::erase(others, path);
  }
  node.info.attr_time_ns = 0;  // its ctime moved
  return node.info.path;
}

void InodeTable::RenameNameLocked(uint64_t ino, const std::string& from, std::string to) {
  auto n = nodes_.find(ino);
  if (n == nodes_.end()) return;
  if (n->second.info.path == from) {
    n->second.info.path = std::move(to);
    return;
  }
  for (std::string& other : n->second.other_paths)
    if (other == from) other = to;
}

void InodeTable::Rename(const std::string& from, const std::string& to) {
  MutexLock l(mu_);
  RemoveLocked(to);
  // The entry itself, then everything under it (a directory): by_path_ is ordered, so the
  // paths under "from/" are one range, and nothing else is visited.
  std::vector<std::pair<std::string, uint64_t>> moved;
  uint64_t visits = 0;  // entries looked at: what the moved ones cost, plus two at most
  if (auto self = by_path_.find(from); self != by_path_.end()) {
    ++visits;
    moved.emplace_back(*self);
  }
  const std::string prefix = from + "/";
  for (auto it = by_path_.lower_bound(prefix); it != by_path_.end(); ++it) {
    ++visits;
    if (it->first.compare(0, prefix.size(), prefix) != 0) break;
    moved.emplace_back(*it);
  }
  rename_visits_.fetch_add(visits, std::memory_order_relaxed);
  for (const auto& [path, ino] : moved) {
    by_path_.erase(path);
    std::string new_path = to + path.substr(from.size());
    auto stale = by_path_.find(new_path);  // an entry under the replaced directory
    if (stale != by_path_.end()) RemoveLocked(new_path);
    by_path_[new_path] = ino;
    RenameNameLocked(ino, path, std::move(new_path));
  }
}

uint64_t InodeTable::BumpWriteGen(uint64_t ino) {
  MutexLock l(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return 0;
  return ++it->second.info.write_gen;
}

void InodeTable::SetSizeGauge(prometheus::Gauge* gauge) {
  MutexLock l(mu_);
  size_gauge_ = gauge;
  SizeChangedLocked();
}

void InodeTable::SizeChangedLocked() {
  if (size_gauge_ != nullptr) size_gauge_->Set(static_cast<double>(nodes_.size()));
}

size_t InodeTable::size() const {
  MutexLock l(mu_);
  return nodes_.size();
}

uint64_t InodeTable::lookups(uint64_t ino) const {
  MutexLock l(mu_);
  auto it = nodes_.find(ino);
  return it == nodes_.end() ? 0 : it->second.nlookup;
}

}  // namespace cubetorchfs::fs
