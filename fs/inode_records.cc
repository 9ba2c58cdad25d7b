// The inode table's durable records: the region they live in (so that a new process adopts them
// after a crash), each record's name in the region's name blocks, the records' allocation and
// their numbers, and the open-addressed index of (parent, name) that finds a record by path.
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

// ---- the region and the names ----

size_t InodeTable::ChunkBytes() { return (size_t{1} << kChunkBits) * sizeof(Rec); }
size_t InodeTable::NamesAt() {
  const size_t end = kRecordsAt + (size_t{kMaxSlots} >> kChunkBits) * ChunkBytes();
  return (end + (size_t{2} << 20) - 1) & ~((size_t{2} << 20) - 1);
}
size_t InodeTable::RegionBytes() { return NamesAt() + kNameClasses * kNameClassBytes; }

InodeTable::DurableHeader& InodeTable::Header() const {
  return *reinterpret_cast<DurableHeader*>(region_.data());
}

int InodeTable::NameClassOf(size_t length) {
  for (int k = 0; k < kNameClasses; ++k)
    if (length <= (size_t{32} << k)) return k;
  return -1;
}

char* InodeTable::NameBlock(int cls, uint32_t block) const {
  return region_.data() + NamesAt() + static_cast<size_t>(cls) * kNameClassBytes +
         static_cast<size_t>(block) * (size_t{32} << cls);
}

std::string_view InodeTable::NameView(const Rec& r) const {
  const char* b = r.name.b;
  if (static_cast<unsigned char>(b[23]) != kHeapName)
    return std::string_view(b, static_cast<unsigned char>(b[23]));
  uint32_t block = 0, n = 0;
  std::memcpy(&block, b, 4);
  std::memcpy(&n, b + 4, 4);
  return std::string_view(NameBlock(NameClassOf(n), block), n);
}

size_t InodeTable::NameBytes(const Rec& r) {
  if (static_cast<unsigned char>(r.name.b[23]) != kHeapName) return 0;
  uint32_t n = 0;
  std::memcpy(&n, r.name.b + 4, 4);
  return size_t{32} << NameClassOf(n);
}

void InodeTable::ClearName(Rec& r) {
  char* b = r.name.b;
  if (static_cast<unsigned char>(b[23]) == kHeapName) {
    uint32_t block = 0, n = 0;
    std::memcpy(&block, b, 4);
    std::memcpy(&n, b + 4, 4);
    name_free_[NameClassOf(n)].push_back(block);
    heap_names_ -= size_t{32} << NameClassOf(n);
  }
  b[23] = 0;
}

bool InodeTable::SetName(Rec& r, std::string_view s) {
  ClearName(r);
  char* b = r.name.b;
  if (s.size() <= 23) {
    std::memcpy(b, s.data(), s.size());
    b[23] = static_cast<char>(s.size());
    return true;
  }
  // Past the largest block only a removed file's whole path can be: kept by its end.
  if (NameClassOf(s.size()) < 0) s = s.substr(s.size() - (size_t{32} << (kNameClasses - 1)));
  const int cls = NameClassOf(s.size());
  uint32_t block = 0;
  if (!name_free_[cls].empty()) {
    block = name_free_[cls].back();
    name_free_[cls].pop_back();
  } else if (name_next_[cls] < kNameClassBytes / (size_t{32} << cls)) {
    block = name_next_[cls]++;
  } else {
    CTFS_LOG(kError) << "inode table: no room for more names of " << s.size() << " bytes";
    return false;
  }
  std::memcpy(NameBlock(cls, block), s.data(), s.size());
  const uint32_t n = static_cast<uint32_t>(s.size());
  std::memcpy(b, &block, 4);
  std::memcpy(b + 4, &n, 4);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the bytes before the reference
  b[23] = static_cast<char>(kHeapName);
  heap_names_ += size_t{32} << cls;
  return true;
}

void InodeTable::BeginNameChange(uint32_t slot) {
  MutexLock l(StripeOf(slot));
  At(slot).flags |= kNameBusy;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

void InodeTable::EndNameChange(uint32_t slot) {
  MutexLock l(StripeOf(slot));
  std::atomic_signal_fence(std::memory_order_seq_cst);
  At(slot).flags &= ~kNameBusy;
}

void InodeTable::SetSlots(uint32_t slots) {
  slots_ = slots;
  Header().slots.store(slots, std::memory_order_release);
}

// ---- records and numbers ----

InodeTable::InodeTable(const cfs_client::FileAttr& root_attr, uint64_t now_ns)
    : dirs_(new std::atomic<ChunkDir*>[kDirs]()),
      region_(DurableRegion::Create("cubetorchfs-inodes", RegionBytes())) {
  static_assert(sizeof(DurableHeader) <= kHeaderBytes);
  static_assert(std::is_trivially_destructible_v<Rec>);
  DurableHeader& h = Header();
  h.magic = kRegionMagic;
  h.layout = kRecordForm | (uint64_t{sizeof(Rec)} << 8) | (uint64_t{kChunkBits} << 24) |
             (uint64_t{kNameClasses} << 32) | (uint64_t{kSlotBits} << 40);
  devs_ = h.devs;
  h.dev_count.store(dev_count_.load());
  WriterLock w(names_mu_);
  SetSlots(kRootSlot + 1);
  MakeChunk(0);
  Rec& root = At(kRootSlot);
  MutexLock l(StripeOf(kRootSlot));
  root.ino = kRootIno;
  root.flags = kUsed | kGiven;
  root.nlookup = 1;
  SetAttrLocked(kRootSlot, root, root_attr);
  root.attr_time_ns = now_ns;
  size_ = 1;
  records_ = 1;
}

InodeTable::~InodeTable() { Release(); }

void InodeTable::Release() {
  for (size_t d = 0; d < kDirs; ++d) {
    ChunkDir* dir = dirs_[d].exchange(nullptr);
    if (dir == nullptr) break;  // made in order
    delete dir;                 // the chunks are the region's
  }
  chunk_count_ = dir_count_ = 0;
  devs_ = nullptr;
  region_ = DurableRegion();
}

int InodeTable::durable_fd() const { return region_.fd(); }

InodeTable::Rec& InodeTable::At(uint32_t slot) const {
  const ChunkDir* dir = dirs_[slot >> (kChunkBits + kDirBits)].load(std::memory_order_acquire);
  Rec* chunk =
      dir->chunks[(slot >> kChunkBits) & ((1u << kDirBits) - 1)].load(std::memory_order_acquire);
  return chunk[slot & ((uint32_t{1} << kChunkBits) - 1)];
}

bool InodeTable::HasChunk(uint32_t slot) const {
  if (slot >= kMaxSlots) return false;
  const ChunkDir* dir = dirs_[slot >> (kChunkBits + kDirBits)].load(std::memory_order_acquire);
  return dir != nullptr && dir->chunks[(slot >> kChunkBits) & ((1u << kDirBits) - 1)].load(
                               std::memory_order_acquire) != nullptr;
}

void InodeTable::MakeChunk(uint32_t slot) {
  std::atomic<ChunkDir*>& d = dirs_[slot >> (kChunkBits + kDirBits)];
  if (d.load() == nullptr) {
    d.store(new ChunkDir, std::memory_order_release);
    ++dir_count_;
  }
  // The region's pages of it: zeros, which is what a record starts as.
  Rec* chunk = reinterpret_cast<Rec*>(region_.data() + kRecordsAt +
                                      static_cast<size_t>(slot >> kChunkBits) * ChunkBytes());
  d.load()->chunks[(slot >> kChunkBits) & ((1u << kDirBits) - 1)].store(chunk,
                                                                        std::memory_order_release);
  ++chunk_count_;
}

uint32_t InodeTable::SlotOfLocked(uint64_t ino) const {
  const uint32_t slot = static_cast<uint32_t>(ino & kSlotMask);
  if (slot != 0 && slot < slots_) {
    const Rec& r = At(slot);
    if ((r.flags & kUsed) != 0 && r.ino == ino) return slot;
  }
  if (foreign_.empty()) return kNoSlot;
  auto it = foreign_.find(ino);
  return it == foreign_.end() ? kNoSlot : it->second;
}

uint64_t InodeTable::NextIno(uint64_t previous, uint32_t slot) const {
  const uint64_t reuse = previous == 0 ? 0 : ((previous >> kSlotBits) + 1) & kReuseMask;
  return generation_base_.load() | (reuse << kSlotBits) | slot;
}

uint32_t InodeTable::NewRecord(uint32_t parent, std::string_view name) {
  uint32_t slot = kNoSlot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    if (slots_ >= kMaxSlots) {
      CTFS_LOG(kError) << "inode table full (" << kMaxSlots << " records): " << std::string(name)
                       << " is answered as absent";
      return kNoSlot;
    }
    slot = slots_;
    if ((slot & ((uint32_t{1} << kChunkBits) - 1)) == 0) MakeChunk(slot);
    SetSlots(slots_ + 1);
  }
  Rec& r = At(slot);
  {
    MutexLock l(StripeOf(slot));
    r.flags = kUsed | kNameBusy;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    r.ino = NextIno(r.ino, slot);
    r.nlookup = 0;
    r.attr_time_ns = 0;
    r.opened = 0;
    r.write_gen.store(0, std::memory_order_relaxed);
    r.size = r.store_ino = 0;
    r.mark = 0;
    r.atime_ns = r.mtime_ns = r.ctime_ns = 0;
    r.mode = S_IFDIR | 0755;
    r.nlink = 1;
    r.uid = r.gid = 0;
    r.dev = 0;
  }
  r.parent = parent;
  r.children = 0;
  r.name.b[23] = 0;  // what a freed record held is not ours to give back
  const bool named = SetName(r, name);
  At(parent).children++;
  if (named) IndexPut(slot, 0);
  {
    MutexLock l(StripeOf(slot));
    std::atomic_signal_fence(std::memory_order_seq_cst);
    r.flags &= ~kNameBusy;
  }
  records_.fetch_add(1, std::memory_order_relaxed);
  if (!named) {
    // No room for its name: it goes again at once, and the caller answers as for a full table.
    At(parent).children--;
    {
      MutexLock l(StripeOf(slot));
      r.flags |= kRemoved;
    }
    MaybeFree(slot);
    return kNoSlot;
  }
  return slot;
}

void InodeTable::MaybeFree(uint32_t first) {
  std::vector<uint32_t> todo{first};
  while (!todo.empty()) {
    const uint32_t slot = todo.back();
    todo.pop_back();
    if (slot == kRootSlot || slot == kNoSlot) continue;
    Rec& r = At(slot);
    if ((r.flags & kUsed) == 0 || r.children > 0) continue;
    {
      MutexLock l(StripeOf(slot));
      if (r.nlookup > 0) continue;
      r.flags |= kNameBusy;
      std::atomic_signal_fence(std::memory_order_seq_cst);
    }
    // Its names go: the links first (their numbers are above the first's), then its own.
    if ((r.flags & kLinks) != 0) {
      std::vector<Link>& links = links_[slot];
      for (uint32_t k = static_cast<uint32_t>(links.size()); k >= 1; --k) {
        IndexErase(slot, k);
        At(links[k - 1].parent).children--;
        todo.push_back(links[k - 1].parent);
      }
      links_.erase(slot);
    }
    if ((r.flags & kRemoved) == 0) {
      IndexErase(slot, 0);
      At(r.parent).children--;
      todo.push_back(r.parent);
    }
    if (r.store_ino != 0) {
      auto sid = by_store_id_.find(StoreId{DevOf(slot, r), r.store_ino});
      if (sid != by_store_id_.end() && sid->second == slot) by_store_id_.erase(sid);
    }
    if ((r.flags & kRdev) != 0) rdevs_.erase(slot);
    if (r.dev == kDevSide) dev_side_.erase(slot);
    if ((r.mode & kBlocksMask) == kBlocksSide) blocks_side_.erase(slot);
    if (!foreign_.empty() && foreign_.erase(r.ino) != 0) foreign_count_ = foreign_.size();
    ClearName(r);
    r.parent = 0;
    const bool retire = ((r.ino >> kSlotBits) & kReuseMask) == kReuseMask;
    {
      MutexLock l(StripeOf(slot));
      std::atomic_signal_fence(std::memory_order_seq_cst);
      r.flags = retire ? kRetired : 0;
      r.mode = 0;
      if (r.mark != 0) marks_.fetch_sub(1, std::memory_order_relaxed);
      r.mark = 0;  // the kernel's pages went with its inode
    }
    if (!retire) free_.push_back(slot);
    records_.fetch_sub(1, std::memory_order_relaxed);
  }
}

// ---- the index ----

uint64_t InodeTable::KeyHash(uint32_t parent, std::string_view name) {
  return Mix(std::hash<std::string_view>{}(name) ^ (uint64_t{parent} * 0x9E3779B97F4A7C15ull));
}

InodeTable::NameRef InodeTable::NameOf(uint32_t slot, uint32_t k) const {
  const Rec& r = At(slot);
  if (k == 0) return {r.parent, NameView(r)};
  const Link& l = links_.at(slot)[k - 1];
  return {l.parent, l.name};
}

size_t InodeTable::IndexHome(uint32_t entry) const {
  const NameRef n = NameOf(entry & kSlotMask, entry >> kSlotBits);
  return KeyHash(n.parent, n.name) & (index_.size() - 1);
}

uint32_t InodeTable::IndexFind(uint32_t parent, std::string_view name) const {
  if (index_used_ == 0) return 0;
  const size_t mask = index_.size() - 1;
  for (size_t i = KeyHash(parent, name) & mask;; i = (i + 1) & mask) {
    const uint32_t e = index_[i];
    if (e == 0) return 0;
    const NameRef n = NameOf(e & kSlotMask, e >> kSlotBits);
    if (n.parent == parent && n.name == name) return e;
  }
}

void InodeTable::IndexResize(size_t capacity) {
  std::vector<uint32_t> old;
  old.swap(index_);
  index_.assign(capacity, 0);
  const size_t mask = capacity - 1;
  for (uint32_t e : old) {
    if (e == 0) continue;
    size_t i = IndexHome(e);
    while (index_[i] != 0) i = (i + 1) & mask;
    index_[i] = e;
  }
}

void InodeTable::IndexPut(uint32_t slot, uint32_t k) {
  if (4 * (index_used_ + 1) > 3 * index_.size())
    IndexResize(index_.empty() ? 64 : 2 * index_.size());
  const uint32_t e = slot | (k << kSlotBits);
  const size_t mask = index_.size() - 1;
  size_t i = IndexHome(e);
  while (index_[i] != 0) i = (i + 1) & mask;
  index_[i] = e;
  ++index_used_;
}

bool InodeTable::IndexPutNew(uint32_t slot) {
  const Rec& r = At(slot);
  const std::string_view name = NameView(r);
  if (4 * (index_used_ + 1) > 3 * index_.size())
    IndexResize(index_.empty() ? 64 : 2 * index_.size());
  const size_t mask = index_.size() - 1;
  size_t i = KeyHash(r.parent, name) & mask;
  for (; index_[i] != 0; i = (i + 1) & mask) {
    const uint32_t e = index_[i];
    const NameRef n = NameOf(e & kSlotMask, e >> kSlotBits);
    if (n.parent == r.parent && n.name == name) return false;
  }
  index_[i] = slot;
  ++index_used_;
  return true;
}

void InodeTable::IndexErase(uint32_t slot, uint32_t k) {
  if (index_used_ == 0) return;
  const uint32_t e = slot | (k << kSlotBits);
  const size_t mask = index_.size() - 1;
  size_t i = IndexHome(e);
  for (; index_[i] != e; i = (i + 1) & mask)
    if (index_[i] == 0) return;
  // Backward shift, as in common/flat_hash_table.h: no tombstones.
  for (size_t j = (i + 1) & mask; index_[j] != 0; j = (j + 1) & mask) {
    const size_t home = IndexHome(index_[j]);
    const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    index_[i] = index_[j];
    i = j;
  }
  index_[i] = 0;
  --index_used_;
  if (index_.size() > 1024 && 8 * index_used_ < index_.size()) IndexResize(index_.size() / 2);
}

uint32_t InodeTable::ResolveEntry(std::string_view path, uint32_t* parent_out) const {
  if (parent_out != nullptr) *parent_out = kNoSlot;
  if (path.empty()) return kRootSlot;
  uint32_t dir = kRootSlot;
  for (size_t pos = 0;;) {
    const size_t slash = path.find('/', pos);
    const std::string_view part =
        path.substr(pos, slash == std::string_view::npos ? std::string_view::npos : slash - pos);
    const uint32_t e = IndexFind(dir, part);
    if (slash == std::string_view::npos) {
      if (parent_out != nullptr) *parent_out = dir;
      return e;
    }
    if (e == 0) return 0;
    dir = e & kSlotMask;
    pos = slash + 1;
  }
}

uint32_t InodeTable::MakeDirs(std::string_view path) {
  uint32_t dir = kRootSlot;
  for (size_t pos = 0; pos < path.size();) {
    size_t slash = path.find('/', pos);
    if (slash == std::string_view::npos) slash = path.size();
    const std::string_view part = path.substr(pos, slash - pos);
    uint32_t e = IndexFind(dir, part);
    dir = e != 0 ? (e & kSlotMask) : NewRecord(dir, part);
    if (dir == kNoSlot) return kNoSlot;
    pos = slash + 1;
  }
  return dir;
}

void InodeTable::PathOf(uint32_t slot, std::string* path, uint64_t* gen) const {
  uint64_t newest = 0;
  size_t length = 0;
  std::string_view parts[64];
  size_t count = 0;
  std::vector<std::string_view> deep;  // a path more than 64 deep
  for (uint32_t s = slot; s != kRootSlot && s != kNoSlot;) {
    const Rec& r = At(s);
    newest = std::max(newest, r.write_gen.load(std::memory_order_relaxed));
    const std::string_view name = NameView(r);
    if (count < 64) {
      parts[count] = name;
    } else {
      deep.push_back(name);
    }
    ++count;
    length += name.size() + 1;
    if ((r.flags & kRemoved) != 0) break;  // its name is its last whole path
    s = r.parent;
  }
  newest = std::max(newest, At(kRootSlot).write_gen.load(std::memory_order_relaxed));
  if (gen != nullptr) *gen = newest;
  if (path == nullptr) return;
  path->clear();
  path->reserve(length);
  for (size_t k = count; k-- > 0;) {
    path->append(k < 64 ? parts[k] : deep[k - 64]);
    if (k != 0) path->push_back('/');
  }
}

std::string InodeTable::PathOfName(uint32_t slot, uint32_t k) const {
  std::string path;
  if (k == 0) {
    PathOf(slot, &path, nullptr);
    return path;
  }
  const Link& l = links_.at(slot)[k - 1];
  PathOf(l.parent, &path, nullptr);
  if (!path.empty()) path.push_back('/');
  path.append(l.name);
  return path;
}

}  // namespace cubetorchfs::fs
