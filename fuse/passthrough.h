// FUSE passthrough (Linux 6.9+): opens the kernel reads and maps straight from a backing file,
// with no request to this daemon (docs/architecture.md#passthrough).
//
// The daemon registers the store's file with the connection (FUSE_DEV_IOC_BACKING_OPEN, which
// needs CAP_SYS_ADMIN) and answers the open with FOPEN_PASSTHROUGH and the registration's id
// (the writev hook of session.cc patches both into libfuse's reply). The kernel's rules
// (fs/fuse/iomode.c), which every answer here keeps:
//   - while an inode has passthrough opens, every open of it must be a passthrough open, with
//     the same registration (another one: EBUSY; a cached or direct-I/O open: EIO);
//   - a passthrough open of an inode with cached opens fails (ETXTBSY, EIO to the caller).
// So this table counts, per inode, the opens it answered each way, and answers:
//   - an open that may be passed through (read-only, large, a store file of this host, no
//     write state: FileSystem::PassthroughFd), of an inode with no other open: passthrough;
//   - a read-only open of an inode with passthrough opens: passthrough, with the same
//     registration, where the store still has the same file (written in place since: the kernel
//     reads what the file holds now); another file at the inode's name in the store: ESTALE
//     (never the old file's bytes under the new file's name): the kernel looks the name up
//     again, finds the new file under a new inode number (fs/inode_table.h), and opens that;
//   - an open for writing of an inode with passthrough opens: passthrough with the same
//     registration and FOPEN_DIRECT_IO, which the kernel allows beside them: its reads and
//     writes come to the daemon (the write contract, docs/writing.md, holds), only its maps are
//     of the store's file, which the posix store's write path writes in place too. So no
//     reader, whoever it is, keeps the file's owner from writing or replacing it;
//   - everything else: as without passthrough.
// The registration is given back when the inode's last passthrough open is released.
//
// The kernel's inodes, opens and registrations outlive this process (the connection is the
// supervisor's), and so do inode numbers, at an upgrade and after a crash alike. So must the
// table: a next process that knew nothing of an inode in passthrough mode would register
// another file for it, and every open of it would fail (EIO) until the old opens closed.
//   - An upgrade passes the table to the next process (Serialize, Restore).
//   - After a crash the next process adopts it (AdoptDurable): every entry is also kept in a
//     memfd (`durable_fd`, sent to the supervisor, which hands it to the next worker), one
//     slot of 32 bytes an inode with opens, each field written with a single store, the
//     registration before the count that uses it, and given back only after its entry is
//     cleared. What a death in the middle leaves is an open counted that never was, or a
//     registration the kernel holds that no entry names: both only keep a registration until
//     the unmount, never make an open fail.
//
// Thread safety: all methods may be called concurrently. The table is sharded by inode.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/durable_region.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace prometheus {
class Counter;
class Gauge;
}  // namespace prometheus

namespace cubetorchfs::fuse {

// cubetorchfs_passthrough_opens_total and _backing_files (null: not counted).
struct PassthroughCounters {
  prometheus::Counter* opens = nullptr;
  prometheus::Gauge* backing_files = nullptr;
};

class Passthrough {
 public:
  // The kernel's side: register an open descriptor (its id, > 0), and drop a registration.
  struct Device {
    std::function<Result<int32_t>(int fd)> open;
    std::function<void(int32_t id)> close;
  };
  // The ioctls on `fuse_fd`, a descriptor of the connection.
  static Device Ioctls(int fuse_fd);

  using Metrics = PassthroughCounters;
  // The table's memfd is made here (without one the table works, and dies with the process).
  explicit Passthrough(Device device, Metrics metrics = {});

  enum class Mode : uint8_t { kCached, kPassthrough };
  struct Answer {
    Mode mode = Mode::kCached;
    int32_t backing_id = 0;  // kPassthrough: the registration to name in the reply
    bool direct_io = false;  // kPassthrough for a writer: FOPEN_DIRECT_IO too
  };

  // The answer to an open of `ino`. `writable`: opened for writing. `file`: the store file's
  // identity (FileVersion::id) now. `backing`: opens the store's file when this open may be
  // passed through, -1 when it may not (called only where a registration may be needed,
  // without the table's lock held; the descriptor is closed here). Errno(ESTALE): the inode's
  // passthrough opens are of another file than the store has now.
  Result<Answer> Open(uint64_t ino, bool writable, uint64_t file,
                      const std::function<int()>& backing);
  // The open answered `mode` was not delivered (the caller gave up): it never counted.
  void Undo(uint64_t ino, Mode mode) { Release(ino, mode); }
  // A handle of `ino` opened `mode` was released. A handle an earlier process opened (its
  // mode unknown) counts as passthrough while the inode has passthrough opens: the kernel lets
  // no other kind coexist with them.
  void Release(uint64_t ino, std::optional<Mode> mode);

  // No more registrations (the kernel refused one: no CAP_SYS_ADMIN, or a connection without
  // passthrough). Opens already passed through go on.
  void Disable() { enabled_.store(false); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // Registrations held (one per inode with passthrough opens).
  size_t backings() const;
  // No inode has an open this table counted.
  bool empty() const;
  uint64_t opens() const { return opens_.load(std::memory_order_relaxed); }

  // The table, for the next process of the mount (daemon/main.cc's handover).
  std::string Serialize() const;
  Status Restore(std::string_view bytes);

  // The memfd the table is kept in (-1: none), for the supervisor to hand to the next process
  // after a crash.
  int durable_fd() const { return memory_.fd(); }
  // Takes the table a process of this build that died left in `fd` (its durable_fd), in place
  // of this one's, which must be empty; takes `fd`. The inodes it adopted with opens, or an
  // error (not a table of this layout: this one's is kept).
  Result<size_t> AdoptDurable(int fd);

 private:
  struct Inode {
    int32_t backing_id = 0;  // > 0 while passthrough opens exist
    uint64_t file = 0;       // the store file registered
    uint32_t passthrough = 0;
    uint32_t other = 0;
    uint32_t slot = kNoSlot;  // its entry in memory_
  };
  static constexpr uint32_t kNoSlot = ~0u;
  static constexpr size_t kShards = 16;
  static constexpr uint32_t kSlotsPerShard = 4096;  // inodes with opens at once, per shard
  struct Shard {
    mutable Mutex mu;
    std::unordered_map<uint64_t, Inode> inodes GUARDED_BY(mu);
    std::vector<uint32_t> free_slots GUARDED_BY(mu);  // of this shard's range, below next_slot
    uint32_t next_slot GUARDED_BY(mu) = 0;            // slots of its range used so far
  };
  Shard& ShardOf(uint64_t ino) { return shards_[ino % kShards]; }

  // Writes `n`'s entry (a slot taken if it has none; none left: not kept, counted), or clears
  // it once the inode has no opens (Forget).
  void Persist(Shard& s, uint64_t ino, Inode& n) REQUIRES(s.mu);
  void Forget(Shard& s, Inode& n) REQUIRES(s.mu);

  void Count(int opens, int backing_files);
  // A registration the kernel refused: turns passthrough off where no file can have it.
  void NoteRefusal(const Status& refused);

  const Device device_;
  const Metrics metrics_;
  std::atomic<bool> enabled_{true};
  std::atomic<uint64_t> opens_{0};
  std::atomic<uint64_t> failures_{0};  // registrations refused for one file (logged: 5)
  std::array<Shard, kShards> shards_;
  DurableRegion memory_;             // a header, then kShards * kSlotsPerShard entries
  std::atomic<uint64_t> unkept_{0};  // entries no slot was left for (logged: once)
};

// The registration the open reply being written on this thread names (session.cc's writev
// hook reads it): set for the scope of a fuse_reply_open.
class PassthroughReply {
 public:
  explicit PassthroughReply(int32_t backing_id);
  ~PassthroughReply();
  PassthroughReply(const PassthroughReply&) = delete;
  PassthroughReply& operator=(const PassthroughReply&) = delete;
  // 0: the reply on this thread names none.
  static int32_t Current();
};

}  // namespace cubetorchfs::fuse
