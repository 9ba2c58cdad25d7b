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

constexpr uint64_t kTableMagic = 0x31545048'53465443ull;  // "CTFSHPT1"

thread_local int32_t t_reply_backing = 0;

}  // namespace

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
        if (writable)
          return Status::Errno(ETXTBSY,
                               "open for writing: the file is open for reading through "
                               "passthrough; it can be written once those opens close");
        if (file != 0 && n.file != 0 && file != n.file)
          return Status::Errno(EBUSY,
                               "open: the file was replaced in the store while open through "
                               "passthrough; the new file can be opened once those opens close");
        ++n.passthrough;
        Count(1, 0);
        return Answer{Mode::kPassthrough, n.backing_id};
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
            Count(1, 1);
            return Answer{Mode::kPassthrough, *id};
          }
          NoteRefusal(id.status());
        }
        ++s.inodes[ino].other;
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
    if (n.passthrough + n.other == 0) s.inodes.erase(it);
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
    s.inodes[ino] = i;
    if (i.backing_id > 0) Count(0, 1);
  }
  return Status::OK();
}

PassthroughReply::PassthroughReply(int32_t backing_id) { t_reply_backing = backing_id; }
PassthroughReply::~PassthroughReply() { t_reply_backing = 0; }
int32_t PassthroughReply::Current() { return t_reply_backing; }

}  // namespace cubetorchfs::fuse
