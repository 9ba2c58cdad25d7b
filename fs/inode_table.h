// Inode numbers for the names the kernel knows about, with their lookup counts.
//
// The table holds one record per inode, keyed by (parent, name) like a directory tree, not by
// full path: a file costs its name (kept inside the record up to 23 bytes), its packed
// attributes, the prefetcher's page-resident mark and one 4-byte slot of the name index,
// under 150 bytes in all at any size
// (docs/memory.md has the measure). A path is resolved a component at a time; an inode's
// path is made by walking its parents. Renaming a directory moves one record, whatever lies
// under it.
//
// Inode numbers name their record: (generation << 44) | (reuse << 28) | slot. A record's slot
// is used again once the kernel has forgotten it, under a higher reuse count, so a number is
// never given out twice; a slot used 65,535 times is retired. A number the kernel sends is
// found without any index (the slot, then a check that the record still has that number).
// Numbers restored from a table written by a version before this layout keep working through
// a side map.
//
// An inode number names one object of the store for its life: when a name is found to hold an
// object of another store identity (FileAttr::StoreId: swapped in behind the mount), Acquire
// gives the name a new inode and the old one is marked removed, so the kernel's number keeps
// meaning the object whose rights it checked (docs/security.md).
//
// Hard links share one inode: a name whose attributes carry the store's identity of a file
// (FileAttr::store_ino) with more than one link joins the live inode of that identity, if
// the table has one. Such an inode has several names (at most 16 are indexed; a further link
// is an inode of its own); the first is the one its I/O uses, and when that name goes, the
// next takes its place.
//
// The kernel holds a reference (nlookup) for every successful lookup, create or readdirplus
// entry, and drops them with forget. An inode lives while its count is above zero; the root
// (inode 1) lives forever. A directory the kernel forgot while the table still knows names
// under it stays as a bare record (no number the kernel holds, no attributes anyone reads)
// until they go; so does one made for a path whose parents were never looked up.
//
// Each inode caches the attributes last read from the store and when, so open() can decide
// without a backend round trip whether its view of the file is fresh.
//
// Thread safety: all methods are safe to call concurrently, except Restore (before the table
// is shared); no lock is held while calling out. A record's counts and attributes are under
// one of 64 stripe locks (by slot); the names (the index, each record's parent and name) and
// the allocation of slots are under a reader-writer lock, taken before any stripe's. What the
// kernel sends by inode number (getattr, open, read without an open, setattr, forget) takes one
// stripe's lock; a lookup of a name the table knows takes the names shared and one stripe; a
// new name, a forget to zero, a remove or a rename takes the names exclusively.
//
// The code is in three files: inode_records.cc (the durable region, names, allocation and
// numbers, the (parent, name) index), inode_table.cc (attributes and what the file system asks)
// and inode_handover.cc (the serialized form an upgrade hands on, and a crashed process's region
// adopted). inode_table_internal.h holds what they share.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <prometheus/gauge.h>

#include "cfs_client/backend.h"
#include "common/durable_region.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::fs {

constexpr uint64_t kRootIno = 1;

struct InodeInfo {
  uint64_t ino = 0;
  std::string path;  // relative to the store root; "" for the root
  cfs_client::FileAttr attr;
  uint64_t attr_time_ns = 0;  // when `attr` was read from the store
  // Changes with every change made through the mount to the file or to a directory above it
  // (a write, a rename), so a handle opened before it knows to look up the inode's path again.
  uint64_t write_gen = 0;
  bool removed = false;  // unlinked or renamed over: no path leads to it any more
};

class InodeTable {
 public:
  explicit InodeTable(const cfs_client::FileAttr& root_attr, uint64_t now_ns);
  ~InodeTable();
  InodeTable(const InodeTable&) = delete;
  InodeTable& operator=(const InodeTable&) = delete;

  // Returns the inode of `path` (creating it), adds one lookup, and records `attr`.
  uint64_t Acquire(const std::string& path, const cfs_client::FileAttr& attr, uint64_t now_ns);

  // Drops `n` lookups of `ino`; the inode is removed when none remain. The root is ignored.
  // A forget of more lookups than the inode has, or of an unknown inode, breaks the FUSE
  // contract: it is logged and counted (bad_forgets) and the inode removed, but the daemon
  // goes on. libfuse's passthrough_hp aborts here; a shared daemon that aborts takes every
  // user's mount down for one bookkeeping error.
  void Forget(uint64_t ino, uint64_t n);
  uint64_t bad_forgets() const { return bad_forgets_.load(); }

  // A copy of the inode's state, or nothing if the kernel has forgotten it.
  std::optional<InodeInfo> Get(uint64_t ino) const;

  void SetAttr(uint64_t ino, const cfs_client::FileAttr& attr, uint64_t now_ns);
  // The attributes of `ino` are asked of the store again at the next GetAttr.
  void ExpireAttr(uint64_t ino);

  // Records that `ino` was opened at `version`, and says how that compares with its previous
  // open (the table keeps a 64-bit digest of the version, not the version).
  enum class OpenedBefore { kNever, kSameVersion, kOtherVersion };
  OpenedBefore SetOpenedVersion(uint64_t ino, const cfs_client::FileVersion& version);

  // False if `ino` was opened at a version other than `version` (at its last open); true if it
  // was opened at it, never opened, or is unknown.
  bool OpenedAt(uint64_t ino, const cfs_client::FileVersion& version) const;

  // The live inode of `path`, if the kernel knows one.
  std::optional<uint64_t> Find(const std::string& path) const;
  // The attributes held for `path` and when they were read from the store: Find and Get in
  // one lock, with no copy of the path. Nothing for an unknown or removed path.
  struct HeldAttr {
    cfs_client::FileAttr attr;
    uint64_t attr_time_ns = 0;
    uint64_t mark = 0;  // its page-resident mark (SetMark), 0 if none
    // The store identity (FileAttr::StoreId) of the directory record the name is in: the
    // directory its attributes were found in (0: none known, or the root's own entry).
    uint64_t dir_id = 0;
  };
  std::optional<HeldAttr> AttrOf(const std::string& path) const;

  // The prefetcher's page-resident mark of a file (prefetch/resident_marks.h), 8 bytes the
  // table keeps in the record of the live inode `path` names and does not read: it goes with
  // the inode when the kernel forgets it, as the kernel's pages do. 0 clears it. False if the
  // kernel knows no inode of `path` (nothing is marked).
  bool SetMark(const std::string& path, uint64_t mark);
  uint64_t marks() const { return marks_.load(std::memory_order_relaxed); }  // records marked
  // What putting bytes into the kernel's page cache for `path` checks before and after:
  // the live inode `path` names (`ino` 0: look it up by path; else that inode, if it still
  // answers to `path`), its version and its write generation. One lock, no copy of the path.
  struct PageState {
    uint64_t ino = 0;
    cfs_client::FileVersion version;
    uint64_t write_gen = 0;
    bool regular = false;
  };
  std::optional<PageState> PageStateOf(const std::string& path, uint64_t ino = 0) const;

  // `path` was removed from the store: its inode (if any) no longer answers to the path. If
  // the inode has another name, that name is returned (and the inode's path is it now);
  // otherwise the inode is marked removed and stays only for the kernel's references.
  std::optional<std::string> Remove(const std::string& path);

  // A name of `ino` other than `path`, if the table knows one.
  std::optional<std::string> OtherName(uint64_t ino, const std::string& path) const;

  // `from` was renamed to `to`: the inode of `from` (and so everything under it, for a
  // directory) now answers to the new path; an inode of `to` is removed. Looks at the entry
  // it moves and at most the one it replaces, whatever lies under them.
  void Rename(const std::string& from, const std::string& to);
  uint64_t rename_visits() const { return rename_visits_.load(); }  // entries looked at, ever

  // Whether `ino` is open for writing through the mount (kept for the next process: see
  // AdoptDurable).
  void SetWriting(uint64_t ino, bool writing);

  // Gives `ino` a new write generation and returns it (0 for an unknown inode).
  uint64_t BumpWriteGen(uint64_t ino);

  // This process serves the mount after `generation` earlier processes (daemon/supervisor.h):
  // new inode numbers carry it in their top 20 bits, above any number an earlier process gave
  // the kernel. A forget of an unknown number below that is an inode of an earlier process
  // that was not handed over (a crash): ignored, not a broken contract.
  void SetGeneration(uint64_t generation);

  // The whole table as bytes, and back: an upgrade hands it to the next process, so every
  // inode number the kernel holds keeps naming the same file. Restore replaces the table
  // (the root included) and fails on bytes it cannot read, leaving the table as it was. It
  // reads this version's form and the path-keyed form of the versions before it.
  std::string Serialize() const;
  Status Restore(std::string_view bytes);

  // The table's records and names live in a memfd (common/durable_region.h), so that when the
  // process dies the supervisor can give them to the next one. durable_fd() is that memfd
  // (-1 where none could be made). AdoptDurable takes one an earlier process of this mount
  // left (it owns `fd` from then on) and replaces this table with what it holds: every record
  // a change was not under way in when that process died, with the kernel's counts and the
  // inode numbers the kernel holds. Records being renamed, made or freed then, and files open
  // for writing (their unflushed bytes died with the process), are dropped with everything
  // under them (the kernel's numbers of those answer ESTALE, and it looks the
  // names up again), as are records the table cannot read; attributes being written are read
  // again from the store. A memfd of another layout is refused, leaving the table as it was.
  int durable_fd() const;
  struct Adopted {
    size_t records = 0;  // kept, the root included
    size_t dropped = 0;  // and dropped
    size_t expired = 0;  // kept, with attributes to read again
  };
  // `remark` rewrites each kept record's mark (the prefetcher's, which the table does not
  // read); unset: marks are kept as they are.
  Result<Adopted> AdoptDurable(int fd, const std::function<uint64_t(uint64_t)>& remark = {});
  // For tests: marks the record of `ino` as being changed, as a process that dies in the
  // middle of that change leaves it.
  void MarkBusyForTest(uint64_t ino, bool name);
  // For tests: what a forget to zero leaves if the process dies before the record goes.
  void MarkForgottenForTest(uint64_t ino);

  size_t size() const;     // inodes the kernel knows (the root included)
  size_t records() const;  // those, the bare directory records and the removed ones
  // The heap the table holds: records, names kept outside them, the index, side maps.
  size_t bytes() const;
  uint64_t lookups(uint64_t ino) const;  // for tests
  // Kept at size() from now on (the gauge is owned by a registry that outlives the table).
  void SetSizeGauge(prometheus::Gauge* gauge);

  static constexpr int kSlotBits = 28;
  static constexpr int kReuseBits = 16;
  static constexpr int kGenerationShift = kSlotBits + kReuseBits;  // 44

 private:
  // A name, kept inside its record when it is 23 bytes or less (ImageNet's and COCO's file
  // names are), else in a block of the table's name area (the record keeps the block's number
  // and the length). Read and written through the table (NameView, SetName, ClearName).
  struct Name {
    alignas(8) char b[24] = {};
  };
  enum Flags : uint16_t {
    kUsed = 1,      // the slot holds a record
    kRemoved = 2,   // unlinked: no name indexed; `name` is its last path, for messages
    kLinks = 4,     // has further names in links_
    kRdev = 8,      // its rdev is in rdevs_
    kRetired = 16,  // a free slot that is never used again (its reuse count ran out)
    kGiven = 32,    // its number was given to the kernel
    // Being changed: what a process that dies in the middle leaves for the next one to judge
    // (AdoptDurable). Its attributes (the next process reads them again from the store)...
    kAttrBusy = 64,
    // ...or its name, parent or being (the next process drops it).
    kNameBusy = 128,
    // Open for writing through the mount: a process that dies loses what it had not flushed,
    // so the next drops the record (the writer's descriptors answer ESTALE, not a success
    // that would leave a hole where those bytes were).
    kWriting = 256,
  };
  // The block count a record keeps in bits 16-17 of its mode word (a mode is 16 bits): the
  // one a file's size gives in 512- or 4096-byte blocks, none, or another, in blocks_side_.
  static constexpr uint32_t kModeBits = 0xFFFF;
  static constexpr uint32_t kBlocks512 = 0, kBlocks4K = 1u << 16, kBlocksNone = 2u << 16,
                            kBlocksSide = 3u << 16, kBlocksMask = 3u << 16;
  static uint32_t BlocksKind(uint64_t size, uint64_t blocks);
  // 136 bytes. `ino`, the counts, the attributes and the mark are under the record's stripe lock;
  // the structure (flags kUsed/kRemoved/kLinks, parent, children, name) under names_mu_, and
  // changed only with the stripe held too.
  struct Rec {
    uint64_t ino = 0;
    uint64_t attr_time_ns = 0;
    uint64_t opened = 0;                 // digest of the version at its last open; 0: never opened
    std::atomic<uint64_t> write_gen{0};  // read on a path's walk under the names alone
    uint64_t size = 0;
    int64_t atime_ns = 0, mtime_ns = 0, ctime_ns = 0;
    uint64_t mark = 0;  // SetMark's
    uint64_t store_ino = 0;
    uint32_t nlookup = 0;   // saturates (4 G lookups without a forget)
    uint32_t parent = 0;    // slot of the directory it is named in (0: none)
    uint32_t children = 0;  // names whose parent this is
    uint32_t mode = 0;      // st_mode, and which block count (kBlocks*)
    uint32_t nlink = 0, uid = 0, gid = 0;
    uint16_t dev = 0;  // index of its store_dev in devs_ (kDevSide: in dev_side_)
    // Atomic: the structural bits change under names_mu_ and the stripe, but kAttrBusy and
    // kWriting under the stripe alone, while readers of the structure hold only names_mu_.
    std::atomic<uint16_t> flags{0};
    Name name;
  };
  static constexpr int kChunkBits = 10;  // 1,024 records a chunk (139 KiB)
  static constexpr int kDirBits = 9;     // 512 chunks a directory of chunks
  static constexpr size_t kDirs = size_t{1} << (kSlotBits - kChunkBits - kDirBits);
  struct ChunkDir {
    std::atomic<Rec*> chunks[size_t{1} << kDirBits] = {};
  };
  static constexpr uint32_t kMaxSlots = uint32_t{1} << kSlotBits;
  static constexpr size_t kStripes = 64;
  static constexpr uint32_t kMaxNames = 16;  // per inode, in the index (a 4-bit name number)

  // The region: a header (layout, slots used, the devices), the records' chunks, then the
  // name area (docs/architecture.md).
  struct DurableHeader;
  static constexpr size_t kHeaderBytes = size_t{64} << 10;
  static constexpr size_t kRecordsAt = kHeaderBytes;
  static size_t ChunkBytes();
  static size_t NamesAt();
  static constexpr int kNameClasses = 12;  // blocks of 32 << k bytes, k < 12: up to 64 KiB
  static constexpr size_t kNameClassBytes = size_t{2} << 30;
  static size_t RegionBytes();
  DurableHeader& Header() const;
  static int NameClassOf(size_t length);  // -1 for a name too long
  char* NameBlock(int cls, uint32_t block) const;
  std::string_view NameView(const Rec& r) const;
  // False (the name left empty) if the name area is full.
  bool SetName(Rec& r, std::string_view s) REQUIRES(names_mu_);
  void ClearName(Rec& r) REQUIRES(names_mu_);
  static size_t NameBytes(const Rec& r);  // of the name area it holds
  void SetSlots(uint32_t slots) REQUIRES(names_mu_);
  // Around a change of a record's name, parent or being (kNameBusy).
  void BeginNameChange(uint32_t slot) REQUIRES(names_mu_);
  void EndNameChange(uint32_t slot) REQUIRES(names_mu_);
  Status AdoptInto(DurableRegion region, const std::function<uint64_t(uint64_t)>& remark,
                   Adopted* out);

  Rec& At(uint32_t slot) const;
  bool HasChunk(uint32_t slot) const;
  void MakeChunk(uint32_t slot);  // for the chunk `slot` is in, which has none yet
  Mutex& StripeOf(uint32_t slot) const { return stripes_[slot % kStripes]; }
  // The slot of the record numbered `ino`, or kNoSlot.
  static constexpr uint32_t kNoSlot = 0;
  uint32_t SlotOfLocked(uint64_t ino) const REQUIRES_SHARED(names_mu_);
  // Calls fn(slot, record) under the stripe lock of the record numbered `ino`, without the
  // names' lock where the number encodes its slot; false if there is none.
  template <typename Fn>
  bool WithRecord(uint64_t ino, Fn fn) const;

  // Names of a record: 0 its own, k > 0 its k-th further link.
  struct NameRef {
    uint32_t parent = 0;
    std::string_view name;
  };
  NameRef NameOf(uint32_t slot, uint32_t k) const REQUIRES_SHARED(names_mu_);
  static uint64_t KeyHash(uint32_t parent, std::string_view name);
  // The index: open addressing of 4-byte entries (slot | name number << 28; 0 empty), linear
  // probing, backward-shift deletion, at most 3/4 full; an entry's key is read from its record.
  uint32_t IndexFind(uint32_t parent, std::string_view name) const REQUIRES_SHARED(names_mu_);
  void IndexPut(uint32_t slot, uint32_t k) REQUIRES(names_mu_);
  // Puts the first name of `slot` unless the index has that name already (then false).
  bool IndexPutNew(uint32_t slot) REQUIRES(names_mu_);
  void IndexErase(uint32_t slot, uint32_t k) REQUIRES(names_mu_);
  void IndexResize(size_t capacity) REQUIRES(names_mu_);
  size_t IndexHome(uint32_t entry) const REQUIRES_SHARED(names_mu_);

  // The index entry `path` names (its last component's slot | name number << 28), or 0; with
  // `parent_out` the slot of the directory it is in (0 if a component before the last is
  // unknown).
  uint32_t ResolveEntry(std::string_view path, uint32_t* parent_out = nullptr) const
      REQUIRES_SHARED(names_mu_);
  // The slot of directory `path`, made (a bare record) with its parents where unknown.
  uint32_t MakeDirs(std::string_view path) REQUIRES(names_mu_);
  // A fresh record named `name` in `parent`; its number is a new one.
  uint32_t NewRecord(uint32_t parent, std::string_view name) REQUIRES(names_mu_);
  uint64_t NextIno(uint64_t previous, uint32_t slot) const;
  // Frees `slot` if nothing holds it (no lookup, no names under it), then its parent likewise.
  void MaybeFree(uint32_t slot) REQUIRES(names_mu_);
  // Takes name k of `slot` out of the index and out of its parent's children.
  void Unname(uint32_t slot, uint32_t k) REQUIRES(names_mu_);
  // The full path of `slot` and the newest write generation on the way to the root.
  void PathOf(uint32_t slot, std::string* path, uint64_t* gen) const REQUIRES_SHARED(names_mu_);
  std::string PathOfName(uint32_t slot, uint32_t k) const REQUIRES_SHARED(names_mu_);
  // The attributes of a record, and back.
  cfs_client::FileAttr AttrOf(uint32_t slot, const Rec& r) const REQUIRES_SHARED(names_mu_);
  uint64_t DevOf(uint32_t slot, const Rec& r) const REQUIRES_SHARED(names_mu_);
  // The record's store identity (FileAttr::StoreId), and whether `a` is of the same object
  // (true where either has none).
  uint64_t IdOf(uint32_t slot, const Rec& r) const REQUIRES_SHARED(names_mu_);
  bool SameObject(uint32_t slot, const Rec& r, const cfs_client::FileAttr& a) const
      REQUIRES_SHARED(names_mu_);
  void SetAttrLocked(uint32_t slot, Rec& r, const cfs_client::FileAttr& a) REQUIRES(names_mu_);
  uint16_t DevIndexLocked(uint64_t dev) REQUIRES(names_mu_);
  // Whether an attribute set fits the record without a change to the table (a new device
  // or rdev): then SetAttrFast may be called under the stripe alone.
  bool FitsFast(const Rec& r, const cfs_client::FileAttr& a) const;
  static void SetAttrFast(Rec& r, const cfs_client::FileAttr& a);  // kAttrBusy around it
  static void FillAttrs(Rec& r, const cfs_client::FileAttr& a);
  bool Live(const Rec& r) const { return r.nlookup > 0 || &r == &At(kRootSlot); }
  std::optional<std::string> RemoveLocked(const std::string& path) REQUIRES(names_mu_);
  void SizeChanged(int64_t delta);
  void Release();  // frees every record's names and the chunks

  static constexpr uint32_t kRootSlot = 1;
  struct StoreId {
    uint64_t dev = 0;
    uint64_t ino = 0;
    bool operator==(const StoreId&) const = default;
  };
  struct StoreIdHash {
    size_t operator()(const StoreId& id) const {
      return std::hash<uint64_t>()(id.ino * 0x9E3779B97F4A7C15ull ^ id.dev);
    }
  };
  static std::optional<StoreId> LinkIdOf(const cfs_client::FileAttr& attr);
  void AppendRecord(std::string* out, uint32_t slot) const REQUIRES_SHARED(names_mu_);
  // Read a snapshot into this table, fresh and not yet shared.
  Status RestoreV1(std::string_view bytes);
  Status RestoreV2(std::string_view bytes);
  // Takes every record and index of `o` (a table Restore filled), which is left empty.
  void TakeFrom(InodeTable& o);
  // The root's attributes: what a fresh table that replaces this one starts with.
  cfs_client::FileAttr RootAttr() const;

  std::atomic<uint64_t> bad_forgets_{0};
  std::atomic<uint64_t> rename_visits_{0};
  std::atomic<uint64_t> size_{0};
  std::atomic<uint64_t> records_{0};
  std::atomic<uint64_t> heap_names_{0};  // bytes of names kept outside their records
  std::atomic<uint64_t> marks_{0};       // records with a mark
  // Numbers below were given out before (SetGeneration); read by Forget without the names.
  std::atomic<uint64_t> generation_base_{0};
  std::atomic<uint64_t> foreign_count_{0};  // foreign_.size(), read without the names
  // The chunks of records, in two levels by slot (directories of chunks, then chunks): a
  // number is found without a lock; a chunk once made stays until the table goes (or Restore
  // replaces it).
  std::unique_ptr<std::atomic<ChunkDir*>[]> dirs_;
  DurableRegion region_;
  // The name area's allocation, per class: blocks ever used, and those free again.
  uint32_t name_next_[kNameClasses] GUARDED_BY(names_mu_) = {};
  std::vector<uint32_t> name_free_[kNameClasses] GUARDED_BY(names_mu_);
  size_t chunk_count_ = 0;  // under names_mu_ (not annotated: Release runs without it)
  size_t dir_count_ = 0;
  mutable std::array<Mutex, kStripes> stripes_;
  mutable SharedMutex names_mu_;  // guards the members below; taken before any stripe
  uint32_t slots_ GUARDED_BY(names_mu_) = kRootSlot + 1;  // slots ever used
  std::vector<uint32_t> free_ GUARDED_BY(names_mu_);
  std::vector<uint32_t> index_ GUARDED_BY(names_mu_);
  size_t index_used_ GUARDED_BY(names_mu_) = 0;
  // Every write generation is a new high of this counter, so a rename above a file always
  // gives it a newer generation than any it had (docs/architecture.md).
  std::atomic<uint64_t> gen_clock_{0};
  std::atomic<prometheus::Gauge*> size_gauge_{nullptr};
  // The store's devices (st_dev), by index: a posix store has one or a few, so a record keeps
  // 2 bytes, not 8. Read without a lock (an index once given keeps its device); past
  // kMaxDevs a record keeps its device in dev_side_.
  static constexpr uint16_t kMaxDevs = 1024;
  static constexpr uint16_t kDevSide = 0xFFFF;
  std::atomic<uint64_t>* devs_ = nullptr;  // in the region's header
  std::atomic<uint16_t> dev_count_{1};     // devs_[0] is device 0
  std::unordered_map<uint32_t, uint64_t> dev_side_ GUARDED_BY(names_mu_);
  std::unordered_map<uint32_t, uint64_t> rdevs_ GUARDED_BY(names_mu_);  // devices' st_rdev
  // Block counts no formula gives (a sparse or preallocated file of a posix store).
  std::unordered_map<uint32_t, uint64_t> blocks_side_ GUARDED_BY(names_mu_);
  struct Link {
    uint32_t parent = 0;
    std::string name;
  };
  std::unordered_map<uint32_t, std::vector<Link>> links_ GUARDED_BY(names_mu_);
  // Files of more than one link, by store identity: what a further link joins.
  std::unordered_map<StoreId, uint32_t, StoreIdHash> by_store_id_ GUARDED_BY(names_mu_);
  // Numbers restored from a path-keyed table, which do not encode their slot.
  std::unordered_map<uint64_t, uint32_t> foreign_ GUARDED_BY(names_mu_);
};

}  // namespace cubetorchfs::fs
