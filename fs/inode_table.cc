#include "fs/inode_table.h"

#include "common/logging.h"
#include "common/snapshot_bytes.h"
#include "common/thread_annotations.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace cubetorchfs::fs {

InodeTable::InodeTable(const cfs_client::FileAttr& root_attr, uint64_t now_ns) {
  Node root;
  root.info.ino = kRootIno;
  root.info.attr = root_attr;
  root.info.attr_time_ns = now_ns;
  root.nlookup = 1;
  WriterLock w(names_mu_);
  {
    Shard& s = ShardOf(kRootIno);
    MutexLock l(s.mu);
    s.nodes.emplace(kRootIno, std::move(root));
  }
  size_ = 1;
  by_path_.emplace("", kRootIno);
  HintLocked("", kRootIno);
}

uint64_t InodeTable::PathHash(std::string_view path) { return std::hash<std::string_view>{}(path); }

void InodeTable::HintLocked(const std::string& path, uint64_t ino) {
  by_hash_.Put(PathHash(path), ino);
}

void InodeTable::UnhintLocked(const std::string& path, uint64_t ino) {
  by_hash_.EraseIf(PathHash(path), ino);
}

bool InodeTable::Names(const Node& n, std::string_view path) {
  if (n.info.removed) return false;
  if (n.info.path == path) return true;
  for (const std::string& other : n.other_paths)
    if (other == path) return true;
  return false;
}

std::optional<InodeTable::StoreId> InodeTable::IdOf(const cfs_client::FileAttr& attr) {
  if (attr.store_ino == 0 || attr.IsDir()) return std::nullopt;
  return StoreId{attr.store_dev, attr.store_ino};
}

void InodeTable::SizeChangedLocked(int64_t delta) {
  const uint64_t n = size_.fetch_add(static_cast<uint64_t>(delta)) + static_cast<uint64_t>(delta);
  if (size_gauge_ != nullptr) size_gauge_->Set(static_cast<double>(n));
}

uint64_t InodeTable::Acquire(const std::string& path, const cfs_client::FileAttr& attr,
                             uint64_t now_ns) {
  const uint64_t hash = PathHash(path);
  const std::optional<StoreId> id = IdOf(attr);
  {
    // A name the table knows, of the same file: one more lookup, the names untouched.
    ReaderLock r(names_mu_);
    std::optional<uint64_t> ino = FindLocked(path, hash);
    bool same_file = ino.has_value();
    if (ino && id) {
      auto known = by_store_id_.find(*id);
      same_file = known != by_store_id_.end() && known->second == *ino;
    }
    if (same_file) {
      Shard& s = ShardOf(*ino);
      MutexLock l(s.mu);
      auto n = s.nodes.find(*ino);
      if (n != s.nodes.end()) {
        n->second.nlookup++;
        n->second.info.attr = attr;
        n->second.info.attr_time_ns = now_ns;
        return *ino;
      }
    }
  }
  WriterLock w(names_mu_);
  auto [it, inserted] = by_path_.try_emplace(path, 0);
  if (inserted && id && attr.nlink > 1) {
    // Another link of a file the table knows: the same inode. (A file of one link is never
    // joined, so a store that reuses the identity of a file deleted behind the mount's back
    // cannot make a new file an old inode's name.)
    auto known = by_store_id_.find(*id);
    if (known != by_store_id_.end()) {
      Shard& s = ShardOf(known->second);
      MutexLock l(s.mu);
      auto n = s.nodes.find(known->second);
      if (n != s.nodes.end() && !n->second.info.removed) {
        it->second = known->second;
        n->second.other_paths.push_back(path);
        HintLocked(path, it->second);
        n->second.nlookup++;
        n->second.info.attr = attr;
        n->second.info.attr_time_ns = now_ns;
        return it->second;
      }
    }
  }
  if (inserted) it->second = next_ino_++;
  const uint64_t ino = it->second;
  {
    Shard& s = ShardOf(ino);
    MutexLock l(s.mu);
    auto [n, created] = s.nodes.try_emplace(ino);
    if (created) {
      n->second.info.ino = ino;
      n->second.info.path = path;
    }
    n->second.nlookup++;
    n->second.info.attr = attr;
    n->second.info.attr_time_ns = now_ns;
    if (created) SizeChangedLocked(1);
  }
  if (inserted) HintLocked(path, ino);
  if (id) by_store_id_[*id] = ino;
  return ino;
}

void InodeTable::Forget(uint64_t ino, uint64_t n) {
  if (ino == kRootIno) return;
  uint64_t had = 0;
  bool bad = false;
  bool none_left = false;
  {
    Shard& s = ShardOf(ino);
    MutexLock l(s.mu);
    auto it = s.nodes.find(ino);
    if (it == s.nodes.end() && ino < generation_base_.load()) return;  // an earlier process's
    bad = it == s.nodes.end() || n > it->second.nlookup;
    if (it != s.nodes.end()) {
      Node& node = it->second;
      had = node.nlookup;
      node.nlookup = n >= node.nlookup ? 0 : node.nlookup - n;
      none_left = node.nlookup == 0;
    }
  }
  if (none_left) {
    // The names go with the node: under the names' lock, if no lookup came back meanwhile.
    WriterLock w(names_mu_);
    Shard& s = ShardOf(ino);
    MutexLock l(s.mu);
    auto it = s.nodes.find(ino);
    if (it != s.nodes.end() && it->second.nlookup == 0) {
      Node& node = it->second;
      node.other_paths.push_back(node.info.path);
      for (const std::string& path : node.other_paths) {
        auto p = by_path_.find(path);
        if (p != by_path_.end() && p->second == ino) by_path_.erase(p);  // not a removed
        UnhintLocked(path, ino);                                         // inode's old path
      }
      if (std::optional<StoreId> id = IdOf(node.info.attr)) {
        auto sid = by_store_id_.find(*id);
        if (sid != by_store_id_.end() && sid->second == ino) by_store_id_.erase(sid);
      }
      s.nodes.erase(it);
      SizeChangedLocked(-1);
    }
  }
  if (!bad) return;
  const uint64_t count = ++bad_forgets_;
  if (count <= 10 || (count & (count - 1)) == 0)  // the first ten, then at powers of two
    CTFS_LOG(kError) << "FUSE forget of " << n << " lookups of inode " << ino << ", which had "
                     << had << " (" << count << " such forgets so far)";
}

std::optional<InodeInfo> InodeTable::Get(uint64_t ino) const {
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto it = s.nodes.find(ino);
  if (it == s.nodes.end()) return std::nullopt;
  return it->second.info;
}

void InodeTable::SetAttr(uint64_t ino, const cfs_client::FileAttr& attr, uint64_t now_ns) {
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto it = s.nodes.find(ino);
  if (it == s.nodes.end()) return;
  it->second.info.attr = attr;
  it->second.info.attr_time_ns = now_ns;
}

void InodeTable::ExpireAttr(uint64_t ino) {
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto it = s.nodes.find(ino);
  if (it != s.nodes.end()) it->second.info.attr_time_ns = 0;
}

std::optional<cfs_client::FileVersion> InodeTable::SetOpenedVersion(
    uint64_t ino, const cfs_client::FileVersion& version) {
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto it = s.nodes.find(ino);
  if (it == s.nodes.end()) return std::nullopt;
  std::optional<cfs_client::FileVersion> previous = it->second.info.opened_version;
  it->second.info.opened_version = version;
  return previous;
}

std::optional<uint64_t> InodeTable::Find(const std::string& path) const {
  const uint64_t hash = PathHash(path);
  ReaderLock r(names_mu_);
  return FindLocked(path, hash);
}

std::optional<uint64_t> InodeTable::FindLocked(const std::string& path, uint64_t hash) const {
  if (std::optional<uint64_t> hint = by_hash_.Get(hash)) {
    Shard& s = ShardOf(*hint);
    MutexLock l(s.mu);
    auto n = s.nodes.find(*hint);
    if (n != s.nodes.end() && Names(n->second, path)) return *hint;
  }
  auto it = by_path_.find(path);
  if (it == by_path_.end()) return std::nullopt;
  return it->second;
}

std::optional<InodeTable::HeldAttr> InodeTable::AttrOf(const std::string& path) const {
  const uint64_t hash = PathHash(path);
  ReaderLock r(names_mu_);
  std::optional<uint64_t> ino = FindLocked(path, hash);
  if (!ino) return std::nullopt;
  Shard& s = ShardOf(*ino);
  MutexLock l(s.mu);
  auto n = s.nodes.find(*ino);
  if (n == s.nodes.end() || n->second.info.removed) return std::nullopt;
  return HeldAttr{n->second.info.attr, n->second.info.attr_time_ns};
}

std::optional<InodeTable::PageState> InodeTable::PageStateOf(const std::string& path,
                                                             uint64_t ino) const {
  const uint64_t hash = ino == 0 ? PathHash(path) : 0;
  ReaderLock r(names_mu_);
  if (ino == 0) {
    std::optional<uint64_t> found = FindLocked(path, hash);
    if (!found) return std::nullopt;
    ino = *found;
  }
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto n = s.nodes.find(ino);
  if (n == s.nodes.end() || n->second.info.removed || n->second.info.path != path)
    return std::nullopt;
  const InodeInfo& i = n->second.info;
  return PageState{i.ino, i.attr.Version(), i.write_gen, S_ISREG(i.attr.mode)};
}

std::optional<std::string> InodeTable::Remove(const std::string& path) {
  if (path.empty()) return std::nullopt;
  WriterLock w(names_mu_);
  return RemoveLocked(path);
}

std::optional<std::string> InodeTable::OtherName(uint64_t ino, const std::string& path) const {
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto n = s.nodes.find(ino);
  if (n == s.nodes.end() || n->second.info.removed) return std::nullopt;
  if (n->second.info.path != path) return n->second.info.path;
  if (n->second.other_paths.empty()) return std::nullopt;
  return n->second.other_paths.front();
}

std::optional<std::string> InodeTable::RemoveLocked(const std::string& path) {
  auto it = by_path_.find(path);
  if (it == by_path_.end()) return std::nullopt;
  const uint64_t ino = it->second;
  by_path_.erase(it);
  UnhintLocked(path, ino);
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto n = s.nodes.find(ino);
  if (n == s.nodes.end()) return std::nullopt;
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
        auto sid = by_store_id_.find(*id);
        if (sid != by_store_id_.end() && sid->second == ino) by_store_id_.erase(sid);
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
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto n = s.nodes.find(ino);
  if (n == s.nodes.end()) return;
  // Handles opened by the old path must not read by it again: someone else's file may be
  // renamed there next. The new generation makes them take the inode's path.
  n->second.info.write_gen++;
  if (n->second.info.path == from) {
    n->second.info.path = std::move(to);
    return;
  }
  for (std::string& other : n->second.other_paths)
    if (other == from) other = to;
}

void InodeTable::Rename(const std::string& from, const std::string& to) {
  WriterLock w(names_mu_);
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
    UnhintLocked(path, ino);
    std::string new_path = to + path.substr(from.size());
    auto stale = by_path_.find(new_path);  // an entry under the replaced directory
    if (stale != by_path_.end()) RemoveLocked(new_path);
    by_path_[new_path] = ino;
    HintLocked(new_path, ino);
    RenameNameLocked(ino, path, std::move(new_path));
  }
}

uint64_t InodeTable::BumpWriteGen(uint64_t ino) {
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto it = s.nodes.find(ino);
  if (it == s.nodes.end()) return 0;
  return ++it->second.info.write_gen;
}

void InodeTable::SetSizeGauge(prometheus::Gauge* gauge) {
  WriterLock w(names_mu_);
  size_gauge_ = gauge;
  SizeChangedLocked(0);
}

size_t InodeTable::size() const { return size_.load(); }

uint64_t InodeTable::lookups(uint64_t ino) const {
  Shard& s = ShardOf(ino);
  MutexLock l(s.mu);
  auto it = s.nodes.find(ino);
  return it == s.nodes.end() ? 0 : it->second.nlookup;
}

}  // namespace cubetorchfs::fs

namespace cubetorchfs::fs {
namespace {

constexpr uint64_t kSnapshotMagic = 0x31544E49'53465443ull;  // "CTFSINT1"

}  // namespace

void InodeTable::SetGeneration(uint64_t generation) {
  WriterLock w(names_mu_);
  generation_base_ = generation << 40;
  next_ino_ = std::max(next_ino_, generation_base_.load() + kRootIno + 1);
}

std::string InodeTable::Serialize() const {
  ReaderLock r(names_mu_);  // the names hold still; each shard is read under its own lock
  std::string body;
  body.reserve(size_.load() * 160);
  uint64_t count = 0;
  for (const Shard& s : shards_) {
    MutexLock l(s.mu);
    count += s.nodes.size();
    for (const auto& [ino, node] : s.nodes) AppendNode(&body, ino, node);
  }
  std::string out;
  out.reserve(24 + body.size());
  PutU64(&out, kSnapshotMagic);
  PutU64(&out, next_ino_);
  PutU64(&out, count);
  out += body;
  return out;
}

void InodeTable::AppendNode(std::string* out_ptr, uint64_t ino, const Node& node) {
  std::string& out = *out_ptr;
  {
    const InodeInfo& i = node.info;
    const cfs_client::FileAttr& a = i.attr;
    for (uint64_t v : {ino,
                       node.nlookup,
                       uint64_t{i.removed},
                       i.write_gen,
                       i.attr_time_ns,
                       uint64_t{i.opened_version.has_value()},
                       i.opened_version ? i.opened_version->size : 0,
                       static_cast<uint64_t>(i.opened_version ? i.opened_version->mtime_ns : 0),
                       uint64_t{a.mode},
                       a.size,
                       uint64_t{a.nlink},
                       uint64_t{a.uid},
                       uint64_t{a.gid},
                       static_cast<uint64_t>(a.atime_ns),
                       static_cast<uint64_t>(a.mtime_ns),
                       static_cast<uint64_t>(a.ctime_ns),
                       a.blocks,
                       a.rdev,
                       a.store_dev,
                       a.store_ino})
      PutU64(&out, v);
    PutString(&out, i.path);
    PutU64(&out, node.other_paths.size());
    for (const std::string& p : node.other_paths) PutString(&out, p);
  }
}

Status InodeTable::Restore(std::string_view bytes) {
  SnapshotReader r(bytes);
  uint64_t magic = 0, next = 0, count = 0;
  if (!r.U64(&magic) || magic != kSnapshotMagic || !r.U64(&next) || !r.U64(&count))
    return Status::InvalidArgument("inode table: not a table this version wrote");
  std::array<std::unordered_map<uint64_t, Node>, kShards> nodes;
  uint64_t node_count = 0;
  std::map<std::string, uint64_t, std::less<>> by_path;
  std::unordered_map<StoreId, uint64_t, StoreIdHash> by_store_id;
  for (uint64_t k = 0; k < count; ++k) {
    uint64_t v[20];
    for (uint64_t& x : v)
      if (!r.U64(&x)) return Status::InvalidArgument("inode table: truncated");
    Node n;
    InodeInfo& i = n.info;
    i.ino = v[0];
    n.nlookup = v[1];
    i.removed = v[2] != 0;
    i.write_gen = v[3];
    i.attr_time_ns = v[4];
    // The snapshot keeps size and mtime of the last open; identity and ctime are the held
    // attributes' (a file changed since is then seen as changed at its next open).
    cfs_client::FileAttr& a = i.attr;
    a.mode = static_cast<mode_t>(v[8]);
    a.size = v[9];
    a.nlink = static_cast<uint32_t>(v[10]);
    a.uid = static_cast<uid_t>(v[11]);
    a.gid = static_cast<gid_t>(v[12]);
    a.atime_ns = static_cast<int64_t>(v[13]);
    a.mtime_ns = static_cast<int64_t>(v[14]);
    a.ctime_ns = static_cast<int64_t>(v[15]);
    a.blocks = v[16];
    a.rdev = v[17];
    a.store_dev = v[18];
    a.store_ino = v[19];
    if (v[5] != 0)
      i.opened_version =
          cfs_client::FileVersion{v[6], static_cast<int64_t>(v[7]), a.StoreId(), a.ctime_ns};
    uint64_t others = 0;
    if (!r.String(&i.path) || !r.U64(&others) || others > bytes.size())
      return Status::InvalidArgument("inode table: truncated");
    for (uint64_t o = 0; o < others; ++o) {
      std::string p;
      if (!r.String(&p)) return Status::InvalidArgument("inode table: truncated");
      n.other_paths.push_back(std::move(p));
    }
    if (i.ino == 0 || i.ino >= next || nodes[i.ino % kShards].count(i.ino) != 0)
      return Status::InvalidArgument("inode table: inode " + std::to_string(i.ino) +
                                     " out of order");
    if (!i.removed) {
      by_path.emplace(i.path, i.ino);
      for (const std::string& p : n.other_paths) by_path.emplace(p, i.ino);
      if (std::optional<StoreId> id = IdOf(a)) by_store_id[*id] = i.ino;
    }
    nodes[i.ino % kShards].emplace(i.ino, std::move(n));
    ++node_count;
  }
  if (!r.done() || nodes[kRootIno % kShards].count(kRootIno) == 0)
    return Status::InvalidArgument("inode table: no root, or bytes after the end");
  HashHints by_hash;
  by_hash.Reserve(by_path.size());
  for (const auto& [path, ino] : by_path) by_hash.Put(PathHash(path), ino);
  WriterLock w(names_mu_);
  for (size_t k = 0; k < kShards; ++k) {
    MutexLock l(shards_[k].mu);
    shards_[k].nodes = std::move(nodes[k]);
  }
  by_path_ = std::move(by_path);
  by_hash_ = std::move(by_hash);
  by_store_id_ = std::move(by_store_id);
  next_ino_ = std::max(next, generation_base_.load() + kRootIno + 1);
  SizeChangedLocked(static_cast<int64_t>(node_count) - static_cast<int64_t>(size_.load()));
  return Status::OK();
}

}  // namespace cubetorchfs::fs
