// The inode table handed on: its serialized form across an upgrade (Serialize, Restore) and
// its adoption from another process's region after a crash (TakeFrom).
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

// ---- handing the table on ----

namespace cubetorchfs::fs {
using namespace inode_table_internal;  // NOLINT: this file's own internals
namespace {

constexpr uint64_t kSnapshotMagicV1 = 0x31544E49'53465443ull;  // "CTFSINT1": path-keyed
constexpr uint64_t kSnapshotMagicV2 = 0x32544E49'53465443ull;  // "CTFSINT2": (parent, name)
constexpr uint64_t kMaxGeneration = (uint64_t{1} << (64 - InodeTable::kGenerationShift)) - 1;

Status Truncated() { return Status::InvalidArgument("inode table: truncated"); }

// Attributes from the 12 words both snapshot forms keep them in.
cfs_client::FileAttr AttrOfWords(const uint64_t* w) {
  cfs_client::FileAttr a;
  a.mode = static_cast<mode_t>(w[0]);
  a.size = w[1];
  a.nlink = static_cast<uint32_t>(w[2]);
  a.uid = static_cast<uid_t>(w[3]);
  a.gid = static_cast<gid_t>(w[4]);
  a.atime_ns = static_cast<int64_t>(w[5]);
  a.mtime_ns = static_cast<int64_t>(w[6]);
  a.ctime_ns = static_cast<int64_t>(w[7]);
  a.blocks = w[8];
  a.rdev = w[9];
  a.store_dev = w[10];
  a.store_ino = w[11];
  return a;
}

}  // namespace

void InodeTable::SetGeneration(uint64_t generation) {
  if (generation > kMaxGeneration) {
    CTFS_LOG(kWarn) << "process generation " << generation << " is past " << kMaxGeneration
                    << "; inode numbers go on at " << kMaxGeneration;
    generation = kMaxGeneration;
  }
  generation_base_ = generation << kGenerationShift;
}

std::string InodeTable::Serialize() const {
  ReaderLock r(names_mu_);  // the names hold still; each record is read under its stripe
  std::string body;
  body.reserve(records_.load() * 200);
  uint64_t count = 0;
  for (uint32_t slot = kRootSlot; slot < slots_; ++slot) {
    if ((At(slot).flags & kUsed) == 0) continue;
    AppendRecord(&body, slot);
    ++count;
  }
  std::string out;
  out.reserve(32 + body.size());
  PutU64(&out, kSnapshotMagicV2);
  PutU64(&out, gen_clock_.load());
  PutU64(&out, slots_);
  PutU64(&out, count);
  out += body;
  return out;
}

void InodeTable::AppendRecord(std::string* out, uint32_t slot) const {
  const Rec& r = At(slot);
  cfs_client::FileAttr a;
  uint64_t head[8];
  {
    MutexLock l(StripeOf(slot));
    a = AttrOf(slot, r);
    head[0] = slot;
    head[1] = r.ino;
    head[2] = r.flags & (kRemoved | kGiven);
    head[3] = r.nlookup;
    head[4] = r.parent;
    head[5] = r.write_gen.load(std::memory_order_relaxed);
    head[6] = r.attr_time_ns;
    head[7] = r.opened;
  }
  for (uint64_t v : head) PutU64(out, v);
  for (uint64_t v : {uint64_t{a.mode}, a.size, uint64_t{a.nlink}, uint64_t{a.uid}, uint64_t{a.gid},
                     static_cast<uint64_t>(a.atime_ns), static_cast<uint64_t>(a.mtime_ns),
                     static_cast<uint64_t>(a.ctime_ns), a.blocks, a.rdev, a.store_dev, a.store_ino})
    PutU64(out, v);
  PutString(out, std::string(NameView(r)));
  if ((r.flags & kLinks) == 0) {
    PutU64(out, 0);
    return;
  }
  const std::vector<Link>& links = links_.at(slot);
  PutU64(out, links.size());
  for (const Link& l : links) {
    PutU64(out, l.parent);
    PutString(out, l.name);
  }
}

cfs_client::FileAttr InodeTable::RootAttr() const {
  ReaderLock r(names_mu_);
  MutexLock l(StripeOf(kRootSlot));
  return AttrOf(kRootSlot, At(kRootSlot));
}

Status InodeTable::Restore(std::string_view bytes) {
  uint64_t magic = 0;
  if (bytes.size() >= 8) std::memcpy(&magic, bytes.data(), 8);
  InodeTable fresh(RootAttr(), 0);
  fresh.generation_base_ = generation_base_.load();
  Status read = magic == kSnapshotMagicV2 ? fresh.RestoreV2(bytes)
                : magic == kSnapshotMagicV1
                    ? fresh.RestoreV1(bytes)
                    : Status::InvalidArgument("inode table: not a table this version wrote");
  if (!read.ok()) return read;
  TakeFrom(fresh);
  return Status::OK();
}

Result<InodeTable::Adopted> InodeTable::AdoptDurable(
    int fd, const std::function<uint64_t(uint64_t)>& remark) {
  CTFS_ASSIGN_OR_RETURN(DurableRegion region, DurableRegion::Adopt(fd, RegionBytes()));
  InodeTable fresh(RootAttr(), 0);
  fresh.generation_base_ = generation_base_.load();
  Adopted out;
  CTFS_RETURN_IF_ERROR(fresh.AdoptInto(std::move(region), remark, &out));
  TakeFrom(fresh);
  return out;
}

// Takes the records an earlier process left in `region` into this table (fresh, unshared).
// Nothing there is trusted: that process may have died of a bug that wrote over them.
Status InodeTable::AdoptInto(DurableRegion region, const std::function<uint64_t(uint64_t)>& remark,
                             Adopted* out) {
  const auto& h = *reinterpret_cast<const DurableHeader*>(region.data());
  if (h.magic != kRegionMagic || h.layout != Header().layout)
    return Status::InvalidArgument(
        "inode table: the earlier process kept its records in another form");
  const uint64_t slots = h.slots.load();
  const uint64_t devs = h.dev_count.load();
  if (slots <= kRootSlot || slots > kMaxSlots || devs == 0 || devs > kMaxDevs)
    return Status::InvalidArgument("inode table: the earlier process's header is damaged (" +
                                   std::to_string(slots) + " slots, " + std::to_string(devs) +
                                   " devices)");
  WriterLock w(names_mu_);
  Release();
  region_ = std::move(region);
  devs_ = Header().devs;
  dev_count_.store(static_cast<uint16_t>(devs));
  for (uint64_t c = 0; c <= ((slots - 1) >> kChunkBits); ++c)
    MakeChunk(static_cast<uint32_t>(c << kChunkBits));
  slots_ = static_cast<uint32_t>(slots);

  // 1. Each record alone: what it says must be readable.
  enum : uint8_t { kFree = 0, kCheck, kOnWalk, kGood, kDrop };
  std::vector<uint8_t> state(slots, kFree);
  struct Block {
    int cls;
    uint32_t block;
    uint32_t slot;
  };
  std::vector<Block> blocks;
  auto name_ok = [&](uint32_t slot, const Rec& r) {
    const unsigned char tag = static_cast<unsigned char>(r.name.b[23]);
    if (tag != kHeapName && tag > 23) return false;
    if (tag == kHeapName) {
      uint32_t block = 0, n = 0;
      std::memcpy(&block, r.name.b, 4);
      std::memcpy(&n, r.name.b + 4, 4);
      const int cls = n <= 23 ? -1 : NameClassOf(n);
      if (cls < 0 || block >= kNameClassBytes / (size_t{32} << cls)) return false;
      blocks.push_back(Block{cls, block, slot});
    }
    const std::string_view name = NameView(r);
    if (slot == kRootSlot) return name.empty();
    if ((r.flags & kRemoved) != 0) return !name.empty();
    return !name.empty() && name != "." && name != ".." &&
           name.find_first_of(std::string_view("/\0", 2)) == std::string_view::npos;
  };
  size_t candidates = 0;
  for (uint32_t slot = kRootSlot; slot < slots; ++slot) {
    Rec& r = At(slot);
    if ((r.flags & kUsed) == 0) continue;
    const bool root = slot == kRootSlot;
    const bool bad = (r.flags & (kNameBusy | kRdev | kWriting)) != 0 || r.dev == kDevSide ||
                     r.dev >= devs || r.parent >= slots || r.ino == 0 ||
                     root != (r.ino == kRootIno) || (root && r.parent != kNoSlot) ||
                     ((r.flags & kRemoved) != 0) != (r.parent == kNoSlot && !root) ||
                     (!root && (r.flags & kRemoved) == 0 && r.parent == kNoSlot);
    r.children = 0;  // counted again below, from the names kept
    state[slot] = bad ? kDrop : kCheck;
    if (!bad && !name_ok(slot, r)) state[slot] = kDrop;
    candidates += state[slot] == kCheck;
  }
  if (state[kRootSlot] != kCheck)
    return Status::InvalidArgument("inode table: the earlier process's root record is damaged");
  // A block two records claim: the later one is dropped.
  std::sort(blocks.begin(), blocks.end(), [](const Block& a, const Block& b) {
    return a.cls != b.cls       ? a.cls < b.cls
           : a.block != b.block ? a.block < b.block
                                : a.slot < b.slot;
  });
  for (size_t i = 1; i < blocks.size(); ++i)
    if (blocks[i].cls == blocks[i - 1].cls && blocks[i].block == blocks[i - 1].block)
      state[blocks[i].slot] = kDrop;

  // 2. Every name leads to the root through kept directories.
  std::vector<uint32_t> walk;
  for (uint32_t slot = kRootSlot; slot < slots; ++slot) {
    if (state[slot] != kCheck) continue;
    walk.clear();
    uint8_t end = kDrop;
    for (uint32_t s = slot;;) {
      const bool removed = (At(s).flags & kRemoved) != 0;
      if (state[s] == kGood) {
        end = removed ? kDrop : kGood;  // nothing is named under a removed record
        break;
      }
      if (state[s] != kCheck) break;  // free, dropped, or on this walk: a cycle
      if (s == kRootSlot || (removed && s == slot)) {
        state[s] = end = kGood;
        break;
      }
      if (removed) break;
      state[s] = kOnWalk;
      walk.push_back(s);
      s = At(s).parent;
    }
    for (uint32_t x : walk) state[x] = end;
  }

  // 3. The index, from the names kept; a second record of one name is dropped, and what lies
  // under it (a walk again, over what was good).
  bool dropped_dirs = false;
  size_t capacity = 64;
  while (4 * candidates > 3 * capacity) capacity *= 2;
  IndexResize(capacity);  // once, not doubling through the inserts
  for (uint32_t slot = kRootSlot + 1; slot < slots; ++slot) {
    if (state[slot] != kGood || (At(slot).flags & kRemoved) != 0) continue;
    if (!IndexPutNew(slot)) {
      state[slot] = kDrop;
      dropped_dirs = true;
    }
  }
  if (dropped_dirs) {
    for (uint32_t slot = kRootSlot + 1; slot < slots; ++slot) {
      if (state[slot] != kGood || (At(slot).flags & kRemoved) != 0) continue;
      bool under_dropped = false;
      for (uint32_t s = At(slot).parent, depth = 0; s != kRootSlot && depth < slots; ++depth) {
        if (state[s] == kDrop) {
          under_dropped = true;
          break;
        }
        s = At(s).parent;
      }
      if (under_dropped) {
        IndexErase(slot, 0);
        state[slot] = kDrop;
      }
    }
  }

  // 4. What the table keeps beside its records.
  uint64_t live = 0, clock = 0, marks = 0;
  for (uint32_t slot = kRootSlot; slot < slots; ++slot) {
    Rec& r = At(slot);
    if (state[slot] == kDrop) {
      const bool retire = ((r.ino >> kSlotBits) & kReuseMask) == kReuseMask;
      r.name.b[23] = 0;
      r.mark = 0;
      r.nlookup = 0;
      r.flags = retire ? kRetired : 0;  // keeps its number: the next one given is another
      if (!retire) free_.push_back(slot);
      ++out->dropped;
      continue;
    }
    if (state[slot] != kGood) {
      if ((r.flags & kRetired) == 0 && slot != kRootSlot) free_.push_back(slot);
      continue;
    }
    ++out->records;
    r.flags &= ~kLinks;  // further names are looked up again
    const uint64_t gen = r.write_gen.load(std::memory_order_relaxed);
    clock = std::max(clock, gen);
    if ((r.flags & kAttrBusy) != 0 || (r.mode & kBlocksMask) == kBlocksSide || gen != 0) {
      // Torn, not kept, or written through the mount (bytes the store may not have): asked
      // of the store again.
      r.flags &= ~kAttrBusy;
      r.attr_time_ns = 0;
      ++out->expired;
    }
    heap_names_ += NameBytes(r);
    if (remark && r.mark != 0) r.mark = remark(r.mark);
    if (r.mark != 0) ++marks;
    if (slot != kRootSlot && r.nlookup > 0) ++live;
    if ((r.ino & kSlotMask) != slot) foreign_.emplace(r.ino, slot);
    if (slot != kRootSlot && (r.flags & kRemoved) == 0) {
      At(r.parent).children++;
      if (r.nlookup > 0 && r.nlink > 1 && !S_ISDIR(r.mode))
        if (std::optional<StoreId> id = LinkIdOf(AttrOf(slot, r))) by_store_id_[*id] = slot;
    }
  }
  // The name area: blocks of kept records are used; the others below the highest are free.
  for (int k = 0; k < kNameClasses; ++k) name_next_[k] = 0;
  std::vector<std::vector<uint32_t>> used(kNameClasses);
  for (const Block& b : blocks)
    if (state[b.slot] == kGood) used[b.cls].push_back(b.block);
  for (int k = 0; k < kNameClasses; ++k) {
    std::vector<uint32_t>& u = used[k];  // sorted by the sort above
    name_next_[k] = u.empty() ? 0 : u.back() + 1;
    size_t i = 0;
    for (uint32_t b = 0; b < name_next_[k]; ++b) {
      if (i < u.size() && u[i] == b) {
        while (i < u.size() && u[i] == b) ++i;
        continue;
      }
      name_free_[k].push_back(b);
    }
  }
  std::reverse(free_.begin(), free_.end());
  foreign_count_ = foreign_.size();
  gen_clock_ = clock;
  records_ = out->records;
  size_ = 1 + live;
  marks_ = marks;
  // A record no lookup holds and no name lies under (its last forget came as the process
  // died, before the record went) goes now, as it would have then.
  for (uint32_t slot = kRootSlot + 1; slot < slots; ++slot)
    if (state[slot] == kGood && (At(slot).flags & kUsed) != 0 && At(slot).nlookup == 0 &&
        At(slot).children == 0)
      MaybeFree(slot);
  out->records = records_.load();
  return Status::OK();
}

void InodeTable::TakeFrom(InodeTable& o) {
  WriterLock w(names_mu_);
  WriterLock wo(o.names_mu_);
  Release();
  dirs_.swap(o.dirs_);
  std::swap(chunk_count_, o.chunk_count_);
  std::swap(dir_count_, o.dir_count_);
  region_ = std::move(o.region_);
  devs_ = o.devs_;
  o.devs_ = nullptr;
  dev_count_.store(o.dev_count_.load());
  for (int k = 0; k < kNameClasses; ++k) {
    name_next_[k] = o.name_next_[k];
    name_free_[k].swap(o.name_free_[k]);
  }
  std::swap(slots_, o.slots_);
  free_.swap(o.free_);
  index_.swap(o.index_);
  std::swap(index_used_, o.index_used_);
  gen_clock_.store(o.gen_clock_.load());
  dev_side_.swap(o.dev_side_);
  rdevs_.swap(o.rdevs_);
  links_.swap(o.links_);
  by_store_id_.swap(o.by_store_id_);
  foreign_.swap(o.foreign_);
  foreign_count_.store(foreign_.size());
  records_.store(o.records_.load());
  heap_names_.store(o.heap_names_.load());
  blocks_side_.swap(o.blocks_side_);
  marks_.store(o.marks_.load());
  const int64_t live = static_cast<int64_t>(o.size_.load());
  SizeChanged(live - static_cast<int64_t>(size_.load()));
}

// This version's form: records by slot, each with its parent's slot and its name.
Status InodeTable::RestoreV2(std::string_view bytes) {
  SnapshotReader in(bytes);
  uint64_t magic = 0, clock = 0, slots = 0, count = 0;
  if (!in.U64(&magic) || !in.U64(&clock) || !in.U64(&slots) || !in.U64(&count)) return Truncated();
  if (slots > kMaxSlots || slots <= kRootSlot || count >= slots)
    return Status::InvalidArgument("inode table: " + std::to_string(slots) + " slots");
  WriterLock w(names_mu_);
  for (uint32_t c = 1; c <= ((slots - 1) >> kChunkBits); ++c) MakeChunk(c << kChunkBits);
  SetSlots(static_cast<uint32_t>(slots));
  std::vector<uint32_t> used;
  used.reserve(count);
  bool root_seen = false;
  uint64_t live = 0;
  for (uint64_t k = 0; k < count; ++k) {
    uint64_t v[20];
    for (uint64_t& x : v)
      if (!in.U64(&x)) return Truncated();
    std::string name;
    uint64_t nlinks = 0;
    if (!in.String(&name) || !in.U64(&nlinks) || nlinks >= kMaxNames) return Truncated();
    std::vector<Link> links(nlinks);
    for (Link& l : links) {
      uint64_t parent = 0;
      if (!in.U64(&parent) || !in.String(&l.name) || parent >= slots) return Truncated();
      l.parent = static_cast<uint32_t>(parent);
    }
    const uint64_t slot = v[0];
    if (slot == kNoSlot || slot >= slots || v[1] == 0 || v[4] >= slots ||
        (slot == kRootSlot) != (v[1] == kRootIno) || v[3] > std::numeric_limits<uint32_t>::max())
      return Status::InvalidArgument("inode table: record " + std::to_string(k) + " out of range");
    Rec& r = At(static_cast<uint32_t>(slot));
    if ((r.flags & kUsed) != 0 && slot != kRootSlot)
      return Status::InvalidArgument("inode table: slot " + std::to_string(slot) + " twice");
    if (slot == kRootSlot) {
      if (root_seen) return Status::InvalidArgument("inode table: two roots");
      root_seen = true;
    }
    MutexLock l(StripeOf(static_cast<uint32_t>(slot)));
    r.ino = v[1];
    r.flags = static_cast<uint16_t>(kUsed | (v[2] & (kRemoved | kGiven)));
    r.nlookup = static_cast<uint32_t>(v[3]);
    r.parent = static_cast<uint32_t>(v[4]);
    r.write_gen.store(v[5], std::memory_order_relaxed);
    r.attr_time_ns = v[6];
    r.opened = v[7];
    const cfs_client::FileAttr a = AttrOfWords(v + 8);
    SetAttrLocked(static_cast<uint32_t>(slot), r, a);
    if (!SetName(r, name)) return Status::InvalidArgument("inode table: no room for its names");
    if (!links.empty()) {
      r.flags |= kLinks;
      links_[static_cast<uint32_t>(slot)] = std::move(links);
    }
    if (slot != kRootSlot) {
      used.push_back(static_cast<uint32_t>(slot));
      if (r.nlookup > 0) ++live;
    }
  }
  if (!in.done() || !root_seen)
    return Status::InvalidArgument("inode table: no root, or bytes after the end");
  // Every name's parent is a directory record, and every chain of parents ends at the root.
  auto named = [this](uint32_t p) {
    const Rec& d = At(p);
    return (d.flags & kUsed) != 0 && (d.flags & kRemoved) == 0;
  };
  for (uint32_t slot : used) {
    Rec& r = At(slot);
    const bool removed = (r.flags & kRemoved) != 0;
    if (removed != (r.parent == kNoSlot) || (!removed && !named(r.parent)))
      return Status::InvalidArgument("inode table: slot " + std::to_string(slot) +
                                     " has no directory");
    if ((r.flags & kLinks) != 0)
      for (const Link& l : links_[slot])
        if (!named(l.parent) || removed)
          return Status::InvalidArgument("inode table: a link of slot " + std::to_string(slot) +
                                         " has no directory");
  }
  std::vector<uint8_t> state(slots, 0);  // 1: on the walk now, 2: reaches the root
  state[kRootSlot] = 2;
  std::vector<uint32_t> walk;
  for (uint32_t slot : used) {
    walk.clear();
    uint32_t s = slot;
    while (s != kNoSlot && state[s] == 0 && (At(s).flags & kRemoved) == 0) {
      state[s] = 1;
      walk.push_back(s);
      s = At(s).parent;
    }
    if (s != kNoSlot && state[s] == 1)
      return Status::InvalidArgument("inode table: a cycle of directories at slot " +
                                     std::to_string(s));
    for (uint32_t x : walk) state[x] = 2;
  }
  for (uint32_t slot : used) {
    Rec& r = At(slot);
    if ((r.flags & kRemoved) == 0) {
      At(r.parent).children++;
      IndexPut(slot, 0);
    }
    if ((r.flags & kLinks) != 0) {
      for (uint32_t j = 1; j <= links_[slot].size(); ++j) {
        At(links_[slot][j - 1].parent).children++;
        IndexPut(slot, j);
      }
    }
    if ((r.ino & kSlotMask) != slot) {
      if (!foreign_.emplace(r.ino, slot).second)
        return Status::InvalidArgument("inode table: inode " + std::to_string(r.ino) + " twice");
    }
    if ((r.flags & kRemoved) == 0 && r.nlookup > 0) {
      const cfs_client::FileAttr a = AttrOf(slot, r);
      if (std::optional<StoreId> id = LinkIdOf(a)) by_store_id_[*id] = slot;
    }
  }
  for (uint32_t slot = kRootSlot + 1; slot < slots_; ++slot)
    if ((At(slot).flags & kUsed) == 0) free_.push_back(slot);
  std::reverse(free_.begin(), free_.end());
  foreign_count_ = foreign_.size();
  gen_clock_ = clock;
  records_ = 1 + used.size();
  size_ = 1 + live;
  return Status::OK();
}

// The form of the versions before: one node per inode, with its whole path and its other
// names' paths.
Status InodeTable::RestoreV1(std::string_view bytes) {
  SnapshotReader in(bytes);
  uint64_t magic = 0, next = 0, count = 0;
  if (!in.U64(&magic) || !in.U64(&next) || !in.U64(&count)) return Truncated();
  WriterLock w(names_mu_);
  uint64_t live = 0, clock = 0;
  bool root_seen = false;
  for (uint64_t k = 0; k < count; ++k) {
    uint64_t v[20];
    for (uint64_t& x : v)
      if (!in.U64(&x)) return Truncated();
    std::string path;
    uint64_t others = 0;
    if (!in.String(&path) || !in.U64(&others) || others > bytes.size()) return Truncated();
    std::vector<std::string> other_paths;
    for (uint64_t o = 0; o < others; ++o) {
      std::string p;
      if (!in.String(&p)) return Truncated();
      other_paths.push_back(std::move(p));
    }
    const uint64_t ino = v[0];
    const bool removed = v[2] != 0;
    if (ino == 0 || ino >= next || v[1] > std::numeric_limits<uint32_t>::max() ||
        (ino == kRootIno) != (path.empty() && !removed) || foreign_.count(ino) != 0)
      return Status::InvalidArgument("inode table: inode " + std::to_string(ino) + " out of order");
    const cfs_client::FileAttr a = AttrOfWords(v + 8);
    uint32_t slot = kNoSlot;
    if (ino == kRootIno) {
      if (root_seen) return Status::InvalidArgument("inode table: two roots");
      root_seen = true;
      slot = kRootSlot;
    } else if (removed) {
      slot = NewRecord(kRootSlot, "");  // then made nameless below
      IndexErase(slot, 0);
      At(kRootSlot).children--;
      At(slot).parent = kNoSlot;
      if (!SetName(At(slot), path))
        return Status::InvalidArgument("inode table: no room for its names");
      At(slot).flags |= kRemoved;
    } else {
      uint32_t parent = kNoSlot;
      slot = ResolveEntry(path, &parent) & kSlotMask;
      if (slot != kNoSlot && (At(slot).flags & kGiven) != 0)
        return Status::InvalidArgument("inode table: " + path + " twice");
      if (slot == kNoSlot) {
        const auto [dir, name] = SplitLast(path);
        if (parent == kNoSlot) parent = MakeDirs(dir);
        slot = parent == kNoSlot ? kNoSlot : NewRecord(parent, name);
      }
      if (slot == kNoSlot) return Status::InvalidArgument("inode table: full");
    }
    Rec& r = At(slot);
    MutexLock l(StripeOf(slot));
    if (ino != kRootIno) {
      r.ino = ino;
      foreign_.emplace(ino, slot);
    }
    r.flags |= kGiven;
    r.nlookup = static_cast<uint32_t>(v[1]);
    r.write_gen.store(v[3], std::memory_order_relaxed);
    clock = std::max(clock, v[3]);
    r.attr_time_ns = v[4];
    // The snapshot keeps size and mtime of the last open; identity and ctime are the held
    // attributes' (a file changed since is then seen as changed at its next open).
    r.opened = v[5] == 0 ? 0
                         : VersionDigest(cfs_client::FileVersion{v[6], static_cast<int64_t>(v[7]),
                                                                 a.StoreId(), a.ctime_ns});
    SetAttrLocked(slot, r, a);
    if (slot != kRootSlot && r.nlookup > 0) ++live;
    if (!removed && !other_paths.empty()) {
      std::vector<Link>& links = links_[slot];
      for (const std::string& p : other_paths) {
        if (links.size() + 1 >= kMaxNames) break;
        const auto [dir, name] = SplitLast(p);
        const uint32_t parent = MakeDirs(dir);
        if (parent == kNoSlot) continue;
        links.push_back(Link{parent, std::string(name)});
        At(parent).children++;
        IndexPut(slot, static_cast<uint32_t>(links.size()));
      }
      if (!links.empty()) r.flags |= kLinks;
    }
    if (!removed && r.nlookup > 0)
      if (std::optional<StoreId> id = LinkIdOf(a)) by_store_id_[*id] = slot;
  }
  if (!in.done() || !root_seen)
    return Status::InvalidArgument("inode table: no root, or bytes after the end");
  foreign_count_ = foreign_.size();
  gen_clock_ = clock;
  size_ = 1 + live;
  return Status::OK();
}

}  // namespace cubetorchfs::fs
