#include "fs/inode_table.h"

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
namespace {

constexpr uint32_t kSlotMask = InodeTable::kSlotBits == 28 ? 0x0FFFFFFFu : 0;
constexpr uint64_t kReuseMask = (uint64_t{1} << InodeTable::kReuseBits) - 1;

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

uint64_t VersionDigest(const cfs_client::FileVersion& v) {
  const uint64_t h = Mix(v.size ^ Mix(static_cast<uint64_t>(v.mtime_ns) ^
                                      Mix(v.id ^ Mix(static_cast<uint64_t>(v.ctime_ns)))));
  return h == 0 ? 1 : h;
}

// "a/b/c" -> ("a/b", "c"); "c" -> ("", "c").
std::pair<std::string_view, std::string_view> SplitLast(std::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return {std::string_view(), path};
  return {path.substr(0, slash), path.substr(slash + 1)};
}

}  // namespace

// ---- the region and the names ----

// What the region begins with. `layout` tells a table of another build's records apart.
struct InodeTable::DurableHeader {
  uint64_t magic;
  uint64_t layout;
  std::atomic<uint64_t> slots;           // slots_: records at and past it were never used
  std::atomic<uint64_t> dev_count;       // dev_count_
  std::atomic<uint64_t> devs[kMaxDevs];  // devs_
};

namespace {
constexpr uint64_t kRegionMagic = 0x31524E49'53465443ull;  // "CTFSINR1"
constexpr unsigned char kHeapName = 0xFF;
}  // namespace

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

namespace {
// What must match for a process to read another's records: their size, the chunk and name
// geometry and the version of this code's record form.
constexpr uint64_t kRecordForm = 1;
}  // namespace

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

}  // namespace cubetorchfs::fs

// ---- handing the table on ----

namespace cubetorchfs::fs {
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

void InodeTable::MarkBusyForTest(uint64_t ino, bool name) {
  WithRecord(ino, [&](uint32_t, Rec& r) { r.flags |= name ? kNameBusy : kAttrBusy; });
}

void InodeTable::MarkForgottenForTest(uint64_t ino) {
  WithRecord(ino, [&](uint32_t, Rec& r) { r.nlookup = 0; });
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
