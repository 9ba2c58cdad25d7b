// The inode table's records and numbers, their attributes, and what the file system asks of
// them (inode_table.h).
#include "fs/inode_table.h"
#include "fs/inode_table_internal.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/logging.h"
#include "common/snapshot_bytes.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::fs {
using namespace inode_table_internal;  // NOLINT: this file's own internals

// ---- records ----

template <typename Fn>
bool InodeTable::WithRecord(uint64_t ino, Fn fn) const {
  const uint32_t slot = static_cast<uint32_t>(ino & kSlotMask);
  if (slot != 0 && HasChunk(slot)) {
    MutexLock l(StripeOf(slot));
    Rec& r = At(slot);
    if ((r.flags & kUsed) != 0 && r.ino == ino) {
      fn(slot, r);
      return true;
    }
  }
  if (foreign_count_.load(std::memory_order_acquire) == 0) return false;
  uint32_t found = kNoSlot;
  {
    ReaderLock r(names_mu_);
    found = SlotOfLocked(ino);
  }
  if (found == kNoSlot) return false;
  MutexLock l(StripeOf(found));
  Rec& r = At(found);
  if ((r.flags & kUsed) == 0 || r.ino != ino) return false;  // freed meanwhile
  fn(found, r);
  return true;
}

// ---- attributes ----

uint64_t InodeTable::DevOf(uint32_t slot, const Rec& r) const {
  if (r.dev != kDevSide) return devs_[r.dev].load(std::memory_order_relaxed);
  auto it = dev_side_.find(slot);
  return it == dev_side_.end() ? 0 : it->second;
}

cfs_client::FileAttr InodeTable::AttrOf(uint32_t slot, const Rec& r) const {
  cfs_client::FileAttr a;
  a.mode = r.mode & kModeBits;
  a.size = r.size;
  a.nlink = r.nlink;
  a.uid = r.uid;
  a.gid = r.gid;
  a.atime_ns = r.atime_ns;
  a.mtime_ns = r.mtime_ns;
  a.ctime_ns = r.ctime_ns;
  switch (r.mode & kBlocksMask) {
    case kBlocks512:
      a.blocks = r.size / 512 + (r.size % 512 != 0);
      break;
    case kBlocks4K:
      a.blocks = 8 * (r.size / 4096 + (r.size % 4096 != 0));
      break;
    case kBlocksNone:
      a.blocks = 0;
      break;
    default: {
      auto it = blocks_side_.find(slot);
      a.blocks = it == blocks_side_.end() ? 0 : it->second;
    }
  }
  a.store_ino = r.store_ino;
  a.store_dev = DevOf(slot, r);
  if ((r.flags & kRdev) != 0) {
    auto it = rdevs_.find(slot);
    if (it != rdevs_.end()) a.rdev = it->second;
  }
  return a;
}

uint32_t InodeTable::BlocksKind(uint64_t size, uint64_t blocks) {
  if (blocks == size / 512 + (size % 512 != 0)) return kBlocks512;
  if (blocks == 8 * (size / 4096 + (size % 4096 != 0))) return kBlocks4K;
  return blocks == 0 ? kBlocksNone : kBlocksSide;
}

bool InodeTable::FitsFast(const Rec& r, const cfs_client::FileAttr& a) const {
  if (a.rdev != 0 || (r.flags & kRdev) != 0 || r.dev == kDevSide) return false;
  if ((r.mode & kBlocksMask) == kBlocksSide || BlocksKind(a.size, a.blocks) == kBlocksSide)
    return false;
  return devs_[r.dev].load(std::memory_order_relaxed) == a.store_dev;
}

void InodeTable::SetAttrFast(Rec& r, const cfs_client::FileAttr& a) {
  r.flags |= kAttrBusy;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  FillAttrs(r, a);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  r.flags &= ~kAttrBusy;
}

void InodeTable::FillAttrs(Rec& r, const cfs_client::FileAttr& a) {
  r.mode = (a.mode & kModeBits) | BlocksKind(a.size, a.blocks);
  r.size = a.size;
  r.nlink = a.nlink;
  r.uid = a.uid;
  r.gid = a.gid;
  r.atime_ns = a.atime_ns;
  r.mtime_ns = a.mtime_ns;
  r.ctime_ns = a.ctime_ns;
  r.store_ino = a.store_ino;
}

uint16_t InodeTable::DevIndexLocked(uint64_t dev) {
  const uint16_t n = dev_count_.load();
  for (uint16_t k = 0; k < n; ++k)
    if (devs_[k].load(std::memory_order_relaxed) == dev) return k;
  if (n >= kMaxDevs) return kDevSide;
  devs_[n].store(dev, std::memory_order_relaxed);
  dev_count_.store(n + 1);
  Header().dev_count.store(n + 1, std::memory_order_release);
  return n;
}

void InodeTable::SetAttrLocked(uint32_t slot, Rec& r, const cfs_client::FileAttr& a) {
  r.flags |= kAttrBusy;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if ((r.mode & kBlocksMask) == kBlocksSide) blocks_side_.erase(slot);
  FillAttrs(r, a);
  if ((r.mode & kBlocksMask) == kBlocksSide) blocks_side_[slot] = a.blocks;
  if (r.dev == kDevSide) dev_side_.erase(slot);
  r.dev = DevIndexLocked(a.store_dev);
  if (r.dev == kDevSide) dev_side_[slot] = a.store_dev;
  if (a.rdev != 0) {
    rdevs_[slot] = a.rdev;
    r.flags |= kRdev;
  } else if ((r.flags & kRdev) != 0) {
    rdevs_.erase(slot);
    r.flags &= ~kRdev;
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  r.flags &= ~kAttrBusy;
}

std::optional<InodeTable::StoreId> InodeTable::LinkIdOf(const cfs_client::FileAttr& attr) {
  if (attr.store_ino == 0 || attr.IsDir() || attr.nlink <= 1) return std::nullopt;
  return StoreId{attr.store_dev, attr.store_ino};
}

void InodeTable::SizeChanged(int64_t delta) {
  const uint64_t n = size_.fetch_add(static_cast<uint64_t>(delta)) + static_cast<uint64_t>(delta);
  prometheus::Gauge* g = size_gauge_.load(std::memory_order_acquire);
  if (g != nullptr) g->Set(static_cast<double>(n));
}

// ---- what the file system asks ----

uint64_t InodeTable::Acquire(const std::string& path, const cfs_client::FileAttr& attr,
                             uint64_t now_ns) {
  const std::optional<StoreId> link_id = LinkIdOf(attr);
  {
    // A name the table knows, of a file the kernel holds: one more lookup, the names untouched.
    ReaderLock r(names_mu_);
    const uint32_t slot = ResolveEntry(path) & kSlotMask;
    bool joined = true;
    if (slot != kNoSlot && link_id) {
      auto known = by_store_id_.find(*link_id);
      joined = known != by_store_id_.end() && known->second == slot;
    }
    if (slot != kNoSlot && joined) {
      MutexLock l(StripeOf(slot));
      Rec& rec = At(slot);
      if (rec.nlookup > 0 && FitsFast(rec, attr) && SameObject(slot, rec, attr)) {
        if (rec.nlookup < std::numeric_limits<uint32_t>::max()) rec.nlookup++;
        SetAttrFast(rec, attr);
        rec.attr_time_ns = now_ns;
        return rec.ino;
      }
    }
  }
  WriterLock w(names_mu_);
  uint32_t parent = kNoSlot;
  uint32_t slot = ResolveEntry(path, &parent) & kSlotMask;
  if (slot != kNoSlot && slot != kRootSlot) {
    Rec& rec = At(slot);
    bool same = true;
    {
      MutexLock l(StripeOf(slot));
      same = SameObject(slot, rec, attr) || (!Live(rec) && rec.children == 0);
    }
    if (!same) {
      // Another object of the store at the name (swapped there behind the mount): the number
      // the kernel holds keeps naming the object it checked, marked removed, and the name
      // gets a new inode (docs/security.md, "Which object a request acts on").
      RemoveLocked(path);
      parent = kNoSlot;
      slot = ResolveEntry(path, &parent) & kSlotMask;
    }
  }
  const auto [dir, name] = SplitLast(path);
  if (slot == kNoSlot) {
    if (parent == kNoSlot) parent = MakeDirs(dir);
    if (parent == kNoSlot) return 0;
    if (link_id) {
      // Another link of a file the table knows: the same inode. (A file of one link is never
      // joined, so a store that reuses the identity of a file deleted behind the mount's back
      // cannot make a new file an old inode's name.)
      auto known = by_store_id_.find(*link_id);
      if (known != by_store_id_.end()) {
        const uint32_t k = known->second;
        Rec& rec = At(k);
        std::vector<Link>& links = links_[k];
        if ((rec.flags & kRemoved) == 0 && rec.nlookup > 0 && links.size() + 1 < kMaxNames) {
          links.push_back(Link{parent, std::string(name)});
          rec.flags |= kLinks;
          At(parent).children++;
          IndexPut(k, static_cast<uint32_t>(links.size()));
          MutexLock l(StripeOf(k));
          if (rec.nlookup < std::numeric_limits<uint32_t>::max()) rec.nlookup++;
          SetAttrLocked(k, rec, attr);
          rec.attr_time_ns = now_ns;
          return rec.ino;
        }
        if (links.empty()) links_.erase(k);
      }
    }
    slot = NewRecord(parent, name);
    if (slot == kNoSlot) return 0;
  }
  Rec& rec = At(slot);
  uint64_t ino = 0;
  {
    MutexLock l(StripeOf(slot));
    if (rec.nlookup == 0 && slot != kRootSlot) {
      // A bare record the kernel starts to hold, or holds again after forgetting it: a number
      // never given out before.
      if ((rec.flags & kGiven) != 0) {
        if (!foreign_.empty() && foreign_.erase(rec.ino) != 0) foreign_count_ = foreign_.size();
        rec.ino = NextIno(rec.ino, slot);
      }
      rec.flags |= kGiven;
      SizeChanged(1);
    }
    if (rec.nlookup < std::numeric_limits<uint32_t>::max()) rec.nlookup++;
    SetAttrLocked(slot, rec, attr);
    rec.attr_time_ns = now_ns;
    ino = rec.ino;
  }
  if (link_id) by_store_id_[*link_id] = slot;
  return ino;
}

void InodeTable::Forget(uint64_t ino, uint64_t n) {
  if (ino == kRootIno) return;
  uint64_t had = 0;
  bool bad = false;
  bool none_left = false;
  const bool found = WithRecord(ino, [&](uint32_t, Rec& r) {
    had = r.nlookup;
    bad = n > r.nlookup;
    if (r.nlookup == 0) return;
    r.nlookup = n >= r.nlookup ? 0 : static_cast<uint32_t>(r.nlookup - n);
    none_left = r.nlookup == 0;
    if (none_left) SizeChanged(-1);
  });
  if (!found && ino < generation_base_.load()) return;  // an earlier process's
  bad = bad || !found;
  if (none_left) {
    // The names go with the record: under the names' lock, if no lookup came back meanwhile.
    WriterLock w(names_mu_);
    const uint32_t slot = SlotOfLocked(ino);
    if (slot != kNoSlot) MaybeFree(slot);
  }
  if (!bad) return;
  const uint64_t count = ++bad_forgets_;
  if (count <= 10 || (count & (count - 1)) == 0)  // the first ten, then at powers of two
    CTFS_LOG(kError) << "FUSE forget of " << n << " lookups of inode " << ino << ", which had "
                     << had << " (" << count << " such forgets so far)";
}

std::optional<InodeInfo> InodeTable::Get(uint64_t ino) const {
  ReaderLock r(names_mu_);
  const uint32_t slot = SlotOfLocked(ino);
  if (slot == kNoSlot) return std::nullopt;
  const Rec& rec = At(slot);
  InodeInfo out;
  {
    MutexLock l(StripeOf(slot));
    if (!Live(rec)) return std::nullopt;
    out.attr = AttrOf(slot, rec);
    out.attr_time_ns = rec.attr_time_ns;
  }
  out.ino = ino;
  out.removed = (rec.flags & kRemoved) != 0;
  PathOf(slot, &out.path, &out.write_gen);
  return out;
}

void InodeTable::SetAttr(uint64_t ino, const cfs_client::FileAttr& attr, uint64_t now_ns) {
  const std::optional<StoreId> link_id = LinkIdOf(attr);
  bool slow = false;
  WithRecord(ino, [&](uint32_t, Rec& r) {
    // A file that has just become one of several links (link(2) through the mount) is
    // registered by its identity, so its other names join it.
    slow = !FitsFast(r, attr) || (link_id && (r.nlink <= 1 || r.store_ino != attr.store_ino));
    if (slow) return;
    SetAttrFast(r, attr);
    r.attr_time_ns = now_ns;
  });
  if (!slow) return;
  WriterLock w(names_mu_);  // a new device, an rdev or a link: the side tables change
  const uint32_t slot = SlotOfLocked(ino);
  if (slot == kNoSlot) return;
  Rec& rec = At(slot);
  {
    MutexLock l(StripeOf(slot));
    SetAttrLocked(slot, rec, attr);
    rec.attr_time_ns = now_ns;
  }
  if (link_id && (rec.flags & kRemoved) == 0) by_store_id_[*link_id] = slot;
}

void InodeTable::ExpireAttr(uint64_t ino) {
  WithRecord(ino, [](uint32_t, Rec& r) { r.attr_time_ns = 0; });
}

InodeTable::OpenedBefore InodeTable::SetOpenedVersion(uint64_t ino,
                                                      const cfs_client::FileVersion& version) {
  OpenedBefore out = OpenedBefore::kNever;
  const uint64_t digest = VersionDigest(version);
  WithRecord(ino, [&](uint32_t, Rec& r) {
    out = r.opened == 0        ? OpenedBefore::kNever
          : r.opened == digest ? OpenedBefore::kSameVersion
                               : OpenedBefore::kOtherVersion;
    r.opened = digest;
  });
  return out;
}

bool InodeTable::OpenedAt(uint64_t ino, const cfs_client::FileVersion& version) const {
  const uint64_t digest = VersionDigest(version);
  bool same = true;
  WithRecord(ino, [&](uint32_t, const Rec& r) { same = r.opened == 0 || r.opened == digest; });
  return same;
}

std::optional<uint64_t> InodeTable::Find(const std::string& path) const {
  ReaderLock r(names_mu_);
  const uint32_t slot = ResolveEntry(path) & kSlotMask;
  if (slot == kNoSlot) return std::nullopt;
  MutexLock l(StripeOf(slot));
  const Rec& rec = At(slot);
  if (!Live(rec)) return std::nullopt;
  return rec.ino;
}

std::optional<InodeTable::HeldAttr> InodeTable::AttrOf(const std::string& path) const {
  ReaderLock r(names_mu_);
  uint32_t parent = kNoSlot;
  const uint32_t slot = ResolveEntry(path, &parent) & kSlotMask;
  if (slot == kNoSlot) return std::nullopt;
  uint64_t dir_id = 0;
  if (slot != kRootSlot && parent != kNoSlot) {
    MutexLock l(StripeOf(parent));
    const Rec& d = At(parent);
    dir_id = IdOf(parent, d);
  }
  MutexLock l(StripeOf(slot));
  const Rec& rec = At(slot);
  if (!Live(rec)) return std::nullopt;
  return HeldAttr{AttrOf(slot, rec), rec.attr_time_ns, rec.mark, dir_id};
}

uint64_t InodeTable::IdOf(uint32_t slot, const Rec& r) const {
  cfs_client::FileAttr a;
  a.store_ino = r.store_ino;
  a.store_dev = DevOf(slot, r);
  return a.StoreId();
}

bool InodeTable::SameObject(uint32_t slot, const Rec& r, const cfs_client::FileAttr& a) const {
  return r.store_ino == 0 || a.store_ino == 0 ||
         (r.store_ino == a.store_ino && DevOf(slot, r) == a.store_dev);
}

bool InodeTable::SetMark(const std::string& path, uint64_t mark) {
  ReaderLock r(names_mu_);
  const uint32_t slot = ResolveEntry(path) & kSlotMask;
  if (slot == kNoSlot) return false;
  MutexLock l(StripeOf(slot));
  Rec& rec = At(slot);
  if (!Live(rec)) return false;
  if ((rec.mark != 0) != (mark != 0)) {
    if (mark != 0)
      marks_.fetch_add(1, std::memory_order_relaxed);
    else
      marks_.fetch_sub(1, std::memory_order_relaxed);
  }
  rec.mark = mark;
  return true;
}

std::optional<InodeTable::PageState> InodeTable::PageStateOf(const std::string& path,
                                                             uint64_t ino) const {
  ReaderLock r(names_mu_);
  const uint32_t entry = ResolveEntry(path);
  // The path must be the inode's first name, the one its I/O uses.
  if (entry == 0 || (entry >> kSlotBits) != 0) return std::nullopt;
  const uint32_t slot = entry & kSlotMask;
  if (ino != 0 && SlotOfLocked(ino) != slot) return std::nullopt;
  const Rec& rec = At(slot);
  PageState out;
  {
    MutexLock l(StripeOf(slot));
    if (!Live(rec)) return std::nullopt;
    out.ino = rec.ino;
    out.version = AttrOf(slot, rec).Version();
    out.regular = S_ISREG(rec.mode);
  }
  PathOf(slot, nullptr, &out.write_gen);
  return out;
}

std::optional<std::string> InodeTable::Remove(const std::string& path) {
  if (path.empty()) return std::nullopt;
  WriterLock w(names_mu_);
  return RemoveLocked(path);
}

std::optional<std::string> InodeTable::OtherName(uint64_t ino, const std::string& path) const {
  ReaderLock r(names_mu_);
  const uint32_t slot = SlotOfLocked(ino);
  if (slot == kNoSlot) return std::nullopt;
  const Rec& rec = At(slot);
  if ((rec.flags & kRemoved) != 0) return std::nullopt;
  {
    MutexLock l(StripeOf(slot));
    if (!Live(rec)) return std::nullopt;
  }
  std::string first = PathOfName(slot, 0);
  if (first != path) return first;
  if ((rec.flags & kLinks) == 0) return std::nullopt;
  return PathOfName(slot, 1);
}

std::optional<std::string> InodeTable::RemoveLocked(const std::string& path) {
  const uint32_t entry = ResolveEntry(path);
  const uint32_t slot = entry & kSlotMask;
  if (slot == kNoSlot || slot == kRootSlot) return std::nullopt;
  const uint32_t k = entry >> kSlotBits;
  Rec& rec = At(slot);
  const uint64_t gen = ++gen_clock_;
  {
    MutexLock l(StripeOf(slot));
    rec.write_gen.store(gen, std::memory_order_relaxed);
    // What an fstat of a descriptor still open shows: one link fewer (none for a directory).
    rec.nlink = S_ISDIR(rec.mode) || rec.nlink == 0 ? 0 : rec.nlink - 1;
    rec.attr_time_ns = 0;  // its ctime moved
  }
  std::vector<Link> links;
  if ((rec.flags & kLinks) != 0) {
    for (uint32_t j = static_cast<uint32_t>(links_[slot].size()); j >= 1; --j) IndexErase(slot, j);
    links = std::move(links_[slot]);
    links_.erase(slot);
  }
  std::vector<uint32_t> parents;  // whose children went down
  if (k == 0 && links.empty()) {
    // Its last name: the inode stays only for the kernel's references.
    std::string whole = PathOfName(slot, 0);
    IndexErase(slot, 0);
    At(rec.parent).children--;
    parents.push_back(rec.parent);
    BeginNameChange(slot);
    SetName(rec, whole);
    rec.parent = kNoSlot;
    {
      MutexLock l(StripeOf(slot));
      rec.flags |= kRemoved;
    }
    EndNameChange(slot);
    if (rec.store_ino != 0) {
      auto sid = by_store_id_.find(StoreId{DevOf(slot, rec), rec.store_ino});
      if (sid != by_store_id_.end() && sid->second == slot) by_store_id_.erase(sid);
    }
    for (uint32_t p : parents) MaybeFree(p);
    MaybeFree(slot);
    return std::nullopt;
  }
  if (k == 0) {
    // The next name takes the first's place.
    IndexErase(slot, 0);
    At(rec.parent).children--;
    parents.push_back(rec.parent);
    BeginNameChange(slot);
    rec.parent = links.front().parent;
    SetName(rec, links.front().name);
    EndNameChange(slot);
    links.erase(links.begin());
    IndexPut(slot, 0);
  } else {
    At(links[k - 1].parent).children--;
    parents.push_back(links[k - 1].parent);
    links.erase(links.begin() + (k - 1));
  }
  if (links.empty()) {
    MutexLock l(StripeOf(slot));
    rec.flags &= ~kLinks;
  } else {
    links_[slot] = std::move(links);
    for (uint32_t j = 1; j <= links_[slot].size(); ++j) IndexPut(slot, j);
  }
  for (uint32_t p : parents) MaybeFree(p);
  return PathOfName(slot, 0);
}

void InodeTable::Rename(const std::string& from, const std::string& to) {
  WriterLock w(names_mu_);
  uint64_t visits = 0;
  if (ResolveEntry(to) != 0) {
    ++visits;
    RemoveLocked(to);
  }
  const uint32_t entry = ResolveEntry(from);
  if (entry == 0 || (entry & kSlotMask) == kRootSlot) {
    rename_visits_.fetch_add(visits, std::memory_order_relaxed);
    return;
  }
  ++visits;
  rename_visits_.fetch_add(visits, std::memory_order_relaxed);
  const uint32_t slot = entry & kSlotMask;
  const uint32_t k = entry >> kSlotBits;
  const auto [dir, name] = SplitLast(to);
  const uint32_t new_parent = MakeDirs(dir);
  if (new_parent == kNoSlot) return;
  Rec& rec = At(slot);
  IndexErase(slot, k);
  uint32_t old_parent = kNoSlot;
  if (k == 0) {
    old_parent = rec.parent;
    BeginNameChange(slot);
    rec.parent = new_parent;
    SetName(rec, name);
    EndNameChange(slot);
  } else {
    Link& l = links_.at(slot)[k - 1];
    old_parent = l.parent;
    l.parent = new_parent;
    l.name = std::string(name);
  }
  At(old_parent).children--;
  At(new_parent).children++;
  IndexPut(slot, k);
  // Handles opened by the old path must not read by it again: someone else's file may be
  // renamed there next. The new generation makes them take the inode's path; for a directory,
  // that of everything under it (a generation is the newest on the way to the root).
  rec.write_gen.store(++gen_clock_, std::memory_order_relaxed);
  MaybeFree(old_parent);
}

void InodeTable::SetWriting(uint64_t ino, bool writing) {
  WithRecord(ino, [&](uint32_t, Rec& r) {
    if (writing)
      r.flags |= kWriting;
    else
      r.flags &= ~kWriting;
  });
}

uint64_t InodeTable::BumpWriteGen(uint64_t ino) {
  uint64_t gen = 0;
  WithRecord(ino, [&](uint32_t, Rec& r) {
    gen = ++gen_clock_;
    r.write_gen.store(gen, std::memory_order_relaxed);
  });
  return gen;
}

void InodeTable::SetSizeGauge(prometheus::Gauge* gauge) {
  size_gauge_.store(gauge, std::memory_order_release);
  SizeChanged(0);
}

size_t InodeTable::size() const { return size_.load(); }
size_t InodeTable::records() const { return records_.load(); }

size_t InodeTable::bytes() const {
  ReaderLock r(names_mu_);
  return chunk_count_ * (size_t{1} << kChunkBits) * sizeof(Rec) + dir_count_ * sizeof(ChunkDir) +
         kDirs * sizeof(std::atomic<ChunkDir*>) + size_t{kMaxDevs} * sizeof(uint64_t) +
         index_.capacity() * sizeof(uint32_t) + free_.capacity() * sizeof(uint32_t) +
         heap_names_.load() +
         64 * (links_.size() + by_store_id_.size() + foreign_.size() + rdevs_.size() +
               dev_side_.size() + blocks_side_.size());
}

uint64_t InodeTable::lookups(uint64_t ino) const {
  uint64_t n = 0;
  WithRecord(ino, [&](uint32_t, Rec& r) { n = r.nlookup; });
  return n;
}

void InodeTable::MarkBusyForTest(uint64_t ino, bool name) {
  WithRecord(ino, [&](uint32_t, Rec& r) { r.flags |= name ? kNameBusy : kAttrBusy; });
}

void InodeTable::MarkForgottenForTest(uint64_t ino) {
  WithRecord(ino, [&](uint32_t, Rec& r) { r.nlookup = 0; });
}

}  // namespace cubetorchfs::fs
