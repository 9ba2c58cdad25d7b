#include "fuse/passthrough.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/logging.h"
#include "common/snapshot_bytes.h"
#include "common/unique_fd.h"
#include "fuse/kernel_abi.h"

namespace cubetorchfs::fuse {
namespace {

constexpr uint64_t kTableMagic = 0x31545048'53465443ull;   // "CTFSHPT1"
constexpr uint64_t kMemoryMagic = 0x31445450'53465443ull;  // "CTFSPTD1": the memfd's layout

thread_local int32_t t_reply_backing = 0;

// The memfd: a header, then one entry a slot. Every field is written with one aligned store,
// so a process killed at any instant leaves each field old or new, never torn.
struct MemoryHeader {
  uint64_t magic;
  uint64_t slots;
  uint64_t entry_bytes;
  uint64_t reserved[5];
};
struct Entry {
  uint64_t ino;
  uint64_t file;
  int32_t backing_id;
  uint32_t passthrough;
  uint32_t other;
  uint32_t used;  // 1: the entry names an inode with opens; written last, cleared first
};
static_assert(sizeof(MemoryHeader) == 64 && sizeof(Entry) == 32);

template <typename T>
void Store(T* field, T v) {
  std::atomic_ref<T>(*field).store(v, std::memory_order_release);
}
template <typename T>
T Load(T* field) {
  return std::atomic_ref<T>(*field).load(std::memory_order_acquire);
}

}  // namespace

Passthrough::Passthrough(Device device, Metrics metrics)
    : device_(std::move(device)), metrics_(metrics) {
  const size_t slots = kShards * kSlotsPerShard;
  Result<DurableRegion> r = DurableRegion::TryCreate("cubetorchfs-passthrough",
                                                     sizeof(MemoryHeader) + slots * sizeof(Entry));
  if (!r.ok()) return;  // the table works; after a crash the next process does without it
  memory_ = std::move(*r);
  auto* h = reinterpret_cast<MemoryHeader*>(memory_.data());
  h->slots = slots;
  h->entry_bytes = sizeof(Entry);
  Store(&h->magic, kMemoryMagic);
}

void Passthrough::Persist(Shard& s, uint64_t ino, Inode& n) {
  if (!memory_) return;
  const size_t shard = static_cast<size_t>(&s - shards_.data());
  auto* entries = reinterpret_cast<Entry*>(memory_.data() + sizeof(MemoryHeader));
  if (n.slot == kNoSlot) {
    if (!s.free_slots.empty()) {
      n.slot = s.free_slots.back();
      s.free_slots.pop_back();
    } else if (s.next_slot < kSlotsPerShard) {
      n.slot = static_cast<uint32_t>(shard * kSlotsPerShard + s.next_slot++);
    } else {
      if (unkept_.fetch_add(1) == 0)
        CTFS_LOG(kWarn) << "passthrough: more than " << kSlotsPerShard * kShards
                        << " inodes with opens; those past it are not kept for the process "
                           "after a crash";
      return;
    }
    Entry& e = entries[n.slot];
    Store(&e.ino, ino);
    Store(&e.file, n.file);
    Store(&e.backing_id, n.backing_id);
    Store(&e.passthrough, n.passthrough);
    Store(&e.other, n.other);
    Store(&e.used, 1u);
    return;
  }
  // The registration before the count that uses it; a count before a registration is given
  // back (Release clears backing_id after the count reached 0).
  Entry& e = entries[n.slot];
  Store(&e.file, n.file);
  if (n.backing_id != 0) Store(&e.backing_id, n.backing_id);
  Store(&e.passthrough, n.passthrough);
  Store(&e.other, n.other);
  if (n.backing_id == 0) Store(&e.backing_id, 0);
}

void Passthrough::Forget(Shard& s, Inode& n) {
  if (!memory_ || n.slot == kNoSlot) return;
  auto* entries = reinterpret_cast<Entry*>(memory_.data() + sizeof(MemoryHeader));
  Store(&entries[n.slot].used, 0u);
  s.free_slots.push_back(n.slot);
  n.slot = kNoSlot;
}

Result<size_t> Passthrough::AdoptDurable(int fd) {
  const size_t slots = kShards * kSlotsPerShard;
  Result<DurableRegion> r = DurableRegion::Adopt(fd, sizeof(MemoryHeader) + slots * sizeof(Entry));
  if (!r.ok()) return r.status();
  auto* h = reinterpret_cast<MemoryHeader*>(r->data());
  if (Load(&h->magic) != kMemoryMagic || h->slots != slots || h->entry_bytes != sizeof(Entry))
    return Status::InvalidArgument("passthrough table: not a table of this layout");
  if (!empty()) return Status::InvalidArgument("passthrough table: this one already has opens");
  memory_ = std::move(*r);
  auto* entries = reinterpret_cast<Entry*>(memory_.data() + sizeof(MemoryHeader));
  size_t adopted = 0;
  for (size_t k = 0; k < kShards; ++k) {
    Shard& s = shards_[k];
    MutexLock l(s.mu);
    s.free_slots.clear();
    s.next_slot = kSlotsPerShard;
    for (uint32_t i = kSlotsPerShard; i-- > 0;) {
      const uint32_t slot = static_cast<uint32_t>(k * kSlotsPerShard + i);
      Entry& e = entries[slot];
      const uint64_t ino = Load(&e.ino);
      Inode n{Load(&e.backing_id), Load(&e.file), Load(&e.passthrough), Load(&e.other), slot};
      // Only what the kernel can have: a registration iff passthrough opens (a death between
      // the two stores leaves one without the other: the open was never answered), in the
      // shard of its inode, once.
      if (n.backing_id <= 0 || n.passthrough == 0) n.backing_id = 0, n.passthrough = 0;
      if (Load(&e.used) != 1 || ino % kShards != k || n.passthrough + n.other == 0 ||
          s.inodes.count(ino) != 0) {
        Store(&e.used, 0u);
        s.free_slots.push_back(slot);
        continue;
      }
      Persist(s, ino, n);  // the fields as corrected
      if (n.backing_id > 0) Count(0, 1);
      s.inodes.emplace(ino, n);
      ++adopted;
    }
  }
  return adopted;
}

Passthrough::Device Passthrough::Ioctls(int fuse_fd) {
  Device d;
  d.open = [fuse_fd](int fd) -> Result<int32_t> {
    abi::BackingMap map{};
    map.fd = fd;
    const int id = ::ioctl(fuse_fd, abi::kDevIocBackingOpen, &map);
    if (id < 0) return Status::FromErrno(errno, "register the backing file");
    if (id == 0) return Status::IOError("register the backing file: the kernel gave id 0");
    return static_cast<int32_t>(id);
  };
  d.close = [fuse_fd](int32_t id) {
    uint32_t v = static_cast<uint32_t>(id);
    if (::ioctl(fuse_fd, abi::kDevIocBackingClose, &v) != 0 && errno != ENOENT)
      CTFS_LOG(kWarn) << "passthrough: give back registration " << id << ": "
                      << std::strerror(errno);
  };
  return d;
}

Result<Passthrough::Answer> Passthrough::Open(uint64_t ino, bool writable, uint64_t file,
                                              const std::function<int()>& backing) {
  Shard& s = ShardOf(ino);
  // The store's file, opened outside the shard's lock (a store open may be slow, and the
  // handle's write state may be busy uploading): at most one pass opens it, the next decides.
  UniqueFd fd;
  bool opened = false;
  for (;;) {
    {
      MutexLock l(s.mu);
      auto it = s.inodes.find(ino);
      if (it != s.inodes.end() && it->second.passthrough > 0) {
        Inode& n = it->second;
        if (file != 0 && n.file != 0 && file != n.file)
          return Status::Errno(ESTALE,
                               "open: the store holds another file at this inode's name than "
                               "the one open through passthrough; the name is looked up again");
        ++n.passthrough;
        Persist(s, ino, n);
        Count(1, 0);
        // A writer too, whoever else holds the file: its reads and writes go to the daemon
        // (direct I/O), never around the write path; only its maps are of the store's file.
        return Answer{Mode::kPassthrough, n.backing_id, /*direct_io=*/writable};
      }
      const bool eligible =
          !writable && (it == s.inodes.end() || it->second.other == 0) && enabled();
      if (!eligible || opened) {
        if (eligible && fd.get() >= 0) {
          Result<int32_t> id = device_.open(fd.get());
          if (id.ok()) {
            Inode& n = s.inodes[ino];
            n.backing_id = *id;
            n.file = file;
            n.passthrough = 1;
            Persist(s, ino, n);
            Count(1, 1);
            return Answer{Mode::kPassthrough, *id};
          }
          NoteRefusal(id.status());
        }
        Inode& n = s.inodes[ino];
        ++n.other;
        Persist(s, ino, n);
        return Answer{};
      }
    }
    fd.reset(backing());
    opened = true;
  }
}

void Passthrough::NoteRefusal(const Status& refused) {
  const int err = ToErrno(refused);
  if (err == EPERM || err == EOPNOTSUPP || err == ENOTTY || err == EINVAL || err == ELOOP) {
    // The same for every file of this store and connection: says so once, then serves as
    // without passthrough. ELOOP: the store's file system is itself stacked (overlayfs),
    // deeper than the kernel lets a backing file be.
    if (enabled_.exchange(false))
      CTFS_LOG(kWarn) << "passthrough unavailable (" << refused.ToString()
                      << "; it needs CAP_SYS_ADMIN, a connection that took it at mount and a "
                         "store on an unstacked file system): large files are read through "
                         "the daemon";
  } else if (const uint64_t k = failures_.fetch_add(1); k < 5) {
    CTFS_LOG(kWarn) << "passthrough: " << refused.ToString()
                    << "; this open reads through the daemon"
                    << (k == 4 ? " (further such failures are not logged)" : "");
  }
}

void Passthrough::Release(uint64_t ino, std::optional<Mode> mode) {
  int32_t give_back = 0;
  {
    Shard& s = ShardOf(ino);
    MutexLock l(s.mu);
    auto it = s.inodes.find(ino);
    if (it == s.inodes.end()) return;
    Inode& n = it->second;
    const Mode m = mode.value_or(n.passthrough > 0 ? Mode::kPassthrough : Mode::kCached);
    if (m == Mode::kPassthrough && n.passthrough > 0) {
      if (--n.passthrough == 0) {
        give_back = n.backing_id;
        n.backing_id = 0;
        n.file = 0;
      }
    } else if (m == Mode::kCached && n.other > 0) {
      --n.other;
    }
    // The entry first: a registration given back is never named by one the next process
    // adopts.
    if (n.passthrough + n.other == 0) {
      Forget(s, n);
      s.inodes.erase(it);
    } else {
      Persist(s, ino, n);
    }
    // Given back under the lock: an open of this inode now registers anew, after this.
    if (give_back > 0) {
      device_.close(give_back);
      Count(0, -1);
    }
  }
}

void Passthrough::Count(int opens, int backing_files) {
  if (opens > 0) {
    opens_.fetch_add(static_cast<uint64_t>(opens), std::memory_order_relaxed);
    if (metrics_.opens != nullptr) metrics_.opens->Increment(opens);
  }
  if (backing_files != 0 && metrics_.backing_files != nullptr)
    metrics_.backing_files->Increment(backing_files);
}

size_t Passthrough::backings() const {
  size_t n = 0;
  for (const Shard& s : shards_) {
    MutexLock l(s.mu);
    for (const auto& [ino, i] : s.inodes) n += i.backing_id > 0;
  }
  return n;
}

bool Passthrough::empty() const {
  for (const Shard& s : shards_) {
    MutexLock l(s.mu);
    if (!s.inodes.empty()) return false;
  }
  return true;
}

std::string Passthrough::Serialize() const {
  std::string out;
  std::vector<std::pair<uint64_t, Inode>> all;
  for (const Shard& s : shards_) {
    MutexLock l(s.mu);
    all.insert(all.end(), s.inodes.begin(), s.inodes.end());
  }
  PutU64(&out, kTableMagic);
  PutU64(&out, all.size());
  for (const auto& [ino, i] : all) {
    PutU64(&out, ino);
    PutU64(&out, static_cast<uint64_t>(static_cast<uint32_t>(i.backing_id)));
    PutU64(&out, i.file);
    PutU64(&out, i.passthrough);
    PutU64(&out, i.other);
  }
  return out;
}

Status Passthrough::Restore(std::string_view bytes) {
  SnapshotReader r(bytes);
  uint64_t magic = 0, count = 0;
  if (!r.U64(&magic) || magic != kTableMagic || !r.U64(&count) || count > bytes.size() / 40)
    return Status::InvalidArgument("passthrough table: not a table this version wrote");
  std::vector<std::pair<uint64_t, Inode>> all;
  for (uint64_t k = 0; k < count; ++k) {
    uint64_t v[5];
    for (uint64_t& x : v)
      if (!r.U64(&x)) return Status::InvalidArgument("passthrough table: truncated");
    if (v[1] > 0x7fffffff || v[3] > 0xffffffff || v[4] > 0xffffffff || (v[1] == 0) != (v[3] == 0))
      return Status::InvalidArgument("passthrough table: inode " + std::to_string(v[0]) +
                                     " has counts the kernel cannot have");
    all.push_back({v[0], Inode{static_cast<int32_t>(v[1]), v[2], static_cast<uint32_t>(v[3]),
                               static_cast<uint32_t>(v[4])}});
  }
  if (!r.done()) return Status::InvalidArgument("passthrough table: bytes after the end");
  for (const auto& [ino, i] : all) {
    Shard& s = ShardOf(ino);
    MutexLock l(s.mu);
    Inode& n = s.inodes[ino];
    const uint32_t slot = n.slot;
    n = i;
    n.slot = slot;
    Persist(s, ino, n);
    if (i.backing_id > 0) Count(0, 1);
  }
  return Status::OK();
}

PassthroughReply::PassthroughReply(int32_t backing_id) { t_reply_backing = backing_id; }
PassthroughReply::~PassthroughReply() { t_reply_backing = 0; }
int32_t PassthroughReply::Current() { return t_reply_backing; }

}  // namespace cubetorchfs::fuse
