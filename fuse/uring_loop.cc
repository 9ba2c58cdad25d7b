#include "fuse/uring_loop.h"

#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysinfo.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "common/parallel.h"
#include "common/thread_annotations.h"
#include "fuse/kernel_abi.h"

namespace cubetorchfs::fuse {

struct UringReply {
  abi::UringReqHeader* header;
  char* payload;
  size_t payload_size;
  uint64_t unique;
  bool stored = false;
};

namespace {

// The header buffer's page; the payload starts right after it, so that the request's header
// and first argument can be put in front of the payload (at most 40 + 128 bytes).
constexpr size_t kFront = 4096;

thread_local UringReply* t_reply = nullptr;

// A reply in in_out is marked in the bytes a request's fuse_in_header has its nodeid in (a
// reply's fuse_out_header is 16 bytes): the kernel's next request overwrites the mark, and no
// nodeid is all ones. So the next process can tell a reply from a request (adoption).
constexpr size_t kReplyMarkAt = 16;
constexpr uint64_t kReplyMark = ~0ull;

void PutOutHeader(abi::UringReqHeader* h, const fuse_out_header& out) {
  std::memcpy(h->in_out, &out, sizeof out);
  std::memcpy(h->in_out + kReplyMarkAt, &kReplyMark, sizeof kReplyMark);
}

bool HoldsReply(const abi::UringReqHeader* h) {
  uint64_t mark = 0;
  std::memcpy(&mark, h->in_out + kReplyMarkAt, sizeof mark);
  return mark == kReplyMark;
}

// Interrupts a thread's wait for its next request; the handler does nothing.
int WakeSignal() { return SIGRTMIN + 3; }
void NoOp(int) {}

// "0-3,8-11" -> 12; the count of the highest id + 1, as the kernel sizes its queue array.
int ParseCpuList(const std::string& s) {
  int highest = -1;
  size_t i = 0;
  while (i < s.size()) {
    size_t end = s.find(',', i);
    if (end == std::string::npos) end = s.size();
    const std::string part = s.substr(i, end - i);
    const size_t dash = part.find('-');
    try {
      highest =
          std::max(highest, std::stoi(dash == std::string::npos ? part : part.substr(dash + 1)));
    } catch (...) {
      return -1;
    }
    i = end + 1;
  }
  return highest + 1;
}

void PinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (cpu >= CPU_SETSIZE) return;
  CPU_SET(cpu, &set);
  ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);  // an offline CPU: left free
}

io_uring_sqe* Command(io_uring* ring, int fd, uint32_t op, uint64_t commit_id, int qid) {
  io_uring_sqe* sqe = io_uring_get_sqe(ring);
  if (sqe == nullptr) return nullptr;
  std::memset(sqe, 0, 128);  // an SQE128 ring: the command's data follows the 64-byte SQE
  sqe->opcode = IORING_OP_URING_CMD;
  sqe->fd = fd;
  sqe->cmd_op = op;
  abi::UringCmdReq req{};
  req.commit_id = commit_id;
  req.qid = static_cast<uint16_t>(qid);
  std::memcpy(sqe->cmd, &req, sizeof req);
  return sqe;
}

Status InitRing(io_uring* ring) {
  io_uring_params p{};
  p.flags = IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN;
  int r = io_uring_queue_init_params(4, ring, &p);
  if (r == -EINVAL) {  // a kernel without the extra flags
    p = io_uring_params{};
    p.flags = IORING_SETUP_SQE128;
    r = io_uring_queue_init_params(4, ring, &p);
  }
  if (r < 0) return Status::FromErrno(-r, "io_uring_setup");
  return Status::OK();
}

}  // namespace

Status CanUseIoUring() {
  io_uring ring{};
  CTFS_RETURN_IF_ERROR(InitRing(&ring));
  io_uring_queue_exit(&ring);
  return Status::OK();
}

// A registration the kernel refuses makes it give the connection up for io_uring, and one with
// a single buffer is refused.
void ResetToDevFuse(int fuse_fd) {
  io_uring ring{};
  if (!InitRing(&ring).ok()) {
    CTFS_LOG(kError) << "io_uring: cannot create a ring to hand the connection back to "
                        "/dev/fuse; requests may wait until the mount is aborted";
    return;
  }
  // The kernel refuses it before reading the buffer.
  iovec iov{nullptr, 0};
  if (io_uring_sqe* sqe = Command(&ring, fuse_fd, abi::kUringCmdRegister, 0, 0)) {
    sqe->addr = reinterpret_cast<uint64_t>(&iov);
    sqe->len = 1;
    io_uring_submit_and_wait(&ring, 1);
  }
  io_uring_queue_exit(&ring);
}

int UringQueueCount() {
  std::ifstream in("/sys/devices/system/cpu/possible");
  std::string line;
  if (std::getline(in, line)) {
    const int n = ParseCpuList(line);
    if (n > 0) return n;
  }
  return std::max(1, ::get_nprocs_conf());
}

UringReply* CurrentUringReply() { return t_reply; }

bool StoreUringReply(UringReply* r, const struct iovec* iov, int count) {
  if (count < 1 || iov[0].iov_len != sizeof(fuse_out_header)) return false;
  fuse_out_header out;
  std::memcpy(&out, iov[0].iov_base, sizeof out);
  if (out.unique != r->unique) return false;
  size_t total = 0;
  for (int i = 1; i < count; ++i) total += iov[i].iov_len;
  if (total > r->payload_size) {
    CTFS_LOG(kError) << "io_uring: a reply of " << total << " bytes does not fit the "
                     << r->payload_size << "-byte payload buffer";
    return false;
  }
  char* p = r->payload;
  for (int i = 1; i < count; ++i) {
    std::memcpy(p, iov[i].iov_base, iov[i].iov_len);
    p += iov[i].iov_len;
  }
  PutOutHeader(r->header, out);
  r->header->ring_ent_in_out.payload_sz = static_cast<uint32_t>(total);
  r->stored = true;
  return true;
}

namespace {

// Where a slot's thread is; written by the thread, read by the next process (adoption).
enum SlotState : uint32_t {
  kFree = 0,     // never registered
  kWaiting = 1,  // register or commit submitted: waiting for a request (last_commit: committed)
  kServing = 2,  // serving the request `serving` (its header and payload are in the slot)
  kReplied = 3,  // the reply to `serving` is in the slot; its commit may or may not be submitted
};

// A cache line each: the threads of neighbouring slots run on different CPUs and store here
// for every request. The stores are releases (a plain store on x86): only the next process
// reads them, after this one is gone, and must see them after the buffer writes before them.
struct alignas(64) SlotInfo {
  std::atomic<uint32_t> state;
  std::atomic<int32_t> qid;
  std::atomic<uint64_t> last_commit;
  std::atomic<uint64_t> serving;
};
static_assert(sizeof(SlotInfo) == 64);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

constexpr uint64_t kMagic = 0x676e697275667463ull;  // "ctfuring"
constexpr uint32_t kVersion = 2;                    // 1: 32-byte slot states
// Far from where the kernel places mappings (near 0x7f...) and the heap (near 0x55...).
constexpr uintptr_t kBase = 0x6e0000000000ull;

#if defined(__SANITIZE_THREAD__)
constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif
#else
constexpr bool kThreadSanitizer = false;
#endif

}  // namespace

struct UringSlots::Table {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint64_t payload_size;
  uint64_t base;
  uint64_t table_bytes;
  uint64_t reserved[3];
  // The slots' states follow the table.
  SlotInfo* slot() { return reinterpret_cast<SlotInfo*>(this + 1); }
};
static_assert(sizeof(UringSlots::Table) == 64);

namespace {

size_t Stride(size_t payload_size) { return kFront + payload_size; }

size_t TableBytes(uint32_t slots) {
  return (sizeof(UringSlots::Table) + slots * sizeof(SlotInfo) + 4095) / 4096 * 4096;
}

void* MapAt(uintptr_t base, size_t bytes, int fd) {
  void* p = ::mmap(reinterpret_cast<void*>(base), bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
  if (p == MAP_FAILED) return nullptr;
  if (reinterpret_cast<uintptr_t>(p) != base) {  // a kernel that took the address as a hint
    ::munmap(p, bytes);
    errno = EEXIST;
    return nullptr;
  }
  return p;
}

// Opcodes that change nothing, or nothing that doing them twice would change: a request of
// these an earlier process had begun is served again from its slot.
bool SafeToRedo(uint32_t opcode) {
  switch (opcode) {
    case FUSE_LOOKUP:
    case FUSE_GETATTR:
    case FUSE_READLINK:
    case FUSE_OPEN:
    case FUSE_READ:
    case FUSE_STATFS:
    case FUSE_RELEASE:
    case FUSE_FSYNC:
    case FUSE_GETXATTR:
    case FUSE_LISTXATTR:
    case FUSE_FLUSH:
    case FUSE_OPENDIR:
    case FUSE_READDIR:
    case FUSE_RELEASEDIR:
    case FUSE_FSYNCDIR:
    case FUSE_ACCESS:
    case FUSE_READDIRPLUS:
    case FUSE_LSEEK:
      return true;
    default:
      return false;
  }
}

}  // namespace

Result<std::shared_ptr<UringSlots>> UringSlots::Open(int fd, int slots, size_t payload_size) {
  std::shared_ptr<UringSlots> s(new UringSlots());
  if (fd >= 0) {
    Table head{};
    if (::pread(fd, &head, sizeof head, 0) != static_cast<ssize_t>(sizeof head) ||
        head.magic != kMagic || head.version != kVersion || head.slots == 0 || head.slots > 65536 ||
        head.payload_size < 8192 || head.payload_size > (64u << 20) ||
        head.table_bytes != TableBytes(head.slots)) {
      ::close(fd);
      return Status::IOError(
          "the io_uring entries handed over are not in a format this "
          "version knows");
    }
    const size_t bytes = head.table_bytes + head.slots * Stride(head.payload_size);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
      ::close(fd);
      return Status::IOError("the io_uring entries handed over are truncated");
    }
    void* p = MapAt(head.base, bytes, fd);
    if (p == nullptr) {
      const int err = errno;
      ::close(fd);
      return Status::FromErrno(err, "map the io_uring entries handed over at their address");
    }
    s->fd_ = fd;
    s->adopted_ = true;
    s->base_ = p;
    s->table_ = static_cast<Table*>(p);
    return s;
  }
  const uint32_t n = static_cast<uint32_t>(std::clamp(slots, 1, 65536));
  const size_t table_bytes = TableBytes(n);
  const size_t bytes = table_bytes + n * Stride(payload_size);
  const int m = ::memfd_create("cubetorchfs-uring", MFD_CLOEXEC);
  if (m < 0) return Status::FromErrno(errno, "memfd_create");
  if (::ftruncate(m, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(m);
    return Status::FromErrno(err, "size the io_uring entries' memfd");
  }
  void* p = nullptr;
  uintptr_t base = kBase;
  // (Not under ThreadSanitizer: it moves a hint outside its application ranges to 0, which
  // MAP_FIXED_NOREPLACE then takes literally.)
  for (int attempt = 0; attempt < 16 && p == nullptr && !kThreadSanitizer;
       ++attempt, base += (1ull << 40))
    p = MapAt(base, bytes, m);
  if (p == nullptr) {  // (a sanitizer's shadow there): wherever the kernel puts it
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m, 0);
    if (p == MAP_FAILED) p = nullptr;
  }
  if (p == nullptr) {
    const int err = errno;
    ::close(m);
    return Status::FromErrno(err, "map the io_uring entries");
  }
  auto* t = static_cast<Table*>(p);
  t->magic = kMagic;
  t->version = kVersion;
  t->slots = n;
  t->payload_size = payload_size;
  t->base = reinterpret_cast<uintptr_t>(p);
  t->table_bytes = table_bytes;
  s->fd_ = m;
  s->base_ = p;
  s->table_ = t;
  return s;
}

UringSlots::~UringSlots() {
  // The kernel's entries keep these addresses for the connection's life: never unmapped.
  if (fd_ >= 0) ::close(fd_);
}

int UringSlots::count() const { return static_cast<int>(table_->slots); }
size_t UringSlots::payload_size() const { return table_->payload_size; }
char* UringSlots::slot(int i) const {
  return static_cast<char*>(base_) + table_->table_bytes +
         static_cast<size_t>(i) * Stride(table_->payload_size);
}

struct UringLoop::Shared {
  fuse_session* se = nullptr;
  UringLoopOptions o;
  int queues = 0;
  size_t payload_size = 0;
  std::atomic<bool> stop{false};
  std::atomic<bool> draining{false};
  std::chrono::steady_clock::time_point drain_end;
  // Per queue, a cache line each (every request counts itself busy on its queue's):
  struct alignas(64) QueueCount {
    std::atomic<int> busy{0};     // threads serving a request
    std::atomic<int> started{0};  // threads started
  };
  std::unique_ptr<QueueCount[]> count;
  Mutex mu;
  CondVar cv{&mu};
  std::vector<std::thread> threads_ GUARDED_BY(mu);
  std::vector<bool> taken GUARDED_BY(mu);  // slots a thread of this loop serves
  int running GUARDED_BY(mu) = 0;
  std::atomic<int> adopted_served{0}, adopted_retried{0}, adopted_aborted{0}, adopted_committed{0},
      adopted_slots{0};
  std::weak_ptr<Shared> self_weak;

  bool Ending() const { return stop.load() || fuse_session_exited(se); }

  // Signals every thread until all have returned: one that had not yet begun to wait when a
  // signal came would otherwise wait on.
  void WakeUntilGone() {
    for (;;) {
      std::vector<pthread_t> live;
      {
        MutexLock l(mu);
        if (running == 0) return;
        for (auto& t : threads_) live.push_back(t.native_handle());
      }
      for (pthread_t t : live) ::pthread_kill(t, WakeSignal());
      MutexLock l(mu);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
      while (running != 0 && cv.WaitUntil(deadline)) {
      }
    }
  }

  // Joins the threads started so far (after Stop or Drain: no more start).
  void JoinAll() {
    std::vector<std::thread> joining;
    {
      MutexLock l(mu);
      joining = std::move(threads_);
      threads_.clear();
    }
    for (auto& t : joining)
      if (t.joinable()) t.join();
  }
  SlotInfo& Info(int slot) { return o.slots->table()->slot()[slot]; }

  // Starts a thread for queue `qid` on a free slot (`adopt`: the slot `slot` of an earlier
  // process); its first command's result goes to `registered`. False: no slot left.
  bool StartLocked(int qid, int slot, bool adopt, std::promise<Status>* registered) REQUIRES(mu) {
    if (slot < 0) {  // (a given slot was reserved by the caller)
      for (int i = 0; i < static_cast<int>(taken.size()) && slot < 0; ++i)
        if (!taken[i] && Info(i).state.load() == kFree) slot = i;
      for (int i = 0; i < static_cast<int>(taken.size()) && slot < 0; ++i)
        if (!taken[i]) slot = i;  // a slot an earlier process left: its entry is gone
      if (slot < 0) return false;
    }
    taken[slot] = true;
    ++running;
    count[qid].started.fetch_add(1);
    threads_.emplace_back([self = self_weak.lock(), qid, slot, adopt, registered] {
      self->Serve(qid, slot, adopt, registered);
    });
    return true;
  }

  void Serve(int qid, int slot, bool adopt, std::promise<Status>* registered) {
    PinTo(qid);
    Status s = Run(qid, slot, adopt, registered);
    if (!s.ok() && !Ending()) CTFS_LOG(kError) << "io_uring queue " << qid << ": " << s.ToString();
    MutexLock l(mu);
    --running;
    cv.SignalAll();
  }

  // A fresh registration of the slot's buffers on queue `qid`.
  bool Register(io_uring* ring, int qid, int slot, iovec* iov) {
    auto* header = static_cast<abi::UringReqHeader*>(iov[0].iov_base);
    // What the slot holds from before must never read as a request given to it.
    header->ring_ent_in_out.commit_id = 0;
    std::memset(header->in_out, 0, sizeof(fuse_in_header));
    SlotInfo& info = Info(slot);
    info.qid.store(qid, std::memory_order_release);
    info.last_commit.store(0, std::memory_order_release);
    info.state.store(kWaiting, std::memory_order_release);
    io_uring_sqe* sqe = Command(ring, o.fuse_fd, abi::kUringCmdRegister, 0, qid);
    if (sqe == nullptr) return false;
    sqe->addr = reinterpret_cast<uint64_t>(iov);
    sqe->len = 2;
    return true;
  }

  bool Commit(io_uring* ring, int qid, int slot, uint64_t commit_id) {
    SlotInfo& info = Info(slot);
    io_uring_sqe* sqe = Command(ring, o.fuse_fd, abi::kUringCmdCommitAndFetch, commit_id, qid);
    if (sqe == nullptr) return false;
    info.state.store(kReplied, std::memory_order_release);
    return true;
  }

  Status Run(int qid, int slot, bool adopt, std::promise<Status>* registered) {
    auto report = [&registered](const Status& s) {
      if (registered != nullptr) registered->set_value(s);
      registered = nullptr;
    };
    io_uring ring{};
    if (Status s = InitRing(&ring); !s.ok()) {
      report(s);
      return s;
    }
    char* mem = o.slots->slot(slot);
    auto* header = reinterpret_cast<abi::UringReqHeader*>(mem);
    char* payload = mem + kFront;
    iovec iov[2] = {{header, sizeof *header}, {payload, payload_size}};
    SlotInfo& info = Info(slot);
    // An adopted slot: what the process before left in it.
    bool adopting = false;
    uint64_t pending = 0;
    if (adopt) {
      const uint32_t state = info.state.load();
      const uint64_t given = header->ring_ent_in_out.commit_id;
      fuse_in_header in{};
      std::memcpy(&in, header->in_out, sizeof in);
      const uint64_t serving = info.serving.load(), last = info.last_commit.load();
      const bool reply = HoldsReply(header);
      if (!reply && given != 0 && in.unique == given) {
        if (state == kServing && given == serving) {  // begun, not answered
          pending = Handle(qid, slot, header, payload, /*redo=*/true);
        } else if (given != last && given != serving) {  // given to it, never taken
          pending = Handle(qid, slot, header, payload, /*redo=*/false);
          adopted_served.fetch_add(1);
        }
      } else if (reply && given != 0 && in.unique == given &&
                 !(state == kWaiting && given == last)) {
        pending = given;  // answered; the commit may not have been made
        adopted_committed.fetch_add(1);
      }
      adopting = pending != 0;
    }
    const bool queued =
        adopting ? Commit(&ring, qid, slot, pending) : Register(&ring, qid, slot, iov);
    int r = queued ? io_uring_submit(&ring) : -EBUSY;
    if (r < 0) {
      io_uring_queue_exit(&ring);
      Status s = Status::FromErrno(-r, "io_uring_submit");
      report(s);
      return s;
    }
    if (adopting) {
      info.last_commit.store(pending, std::memory_order_release);
      info.state.store(kWaiting, std::memory_order_release);
    }
    // A refused registration completes at once; an accepted one only with a request.
    io_uring_cqe* cqe = nullptr;
    __kernel_timespec zero{};
    if (!adopting && io_uring_wait_cqe_timeout(&ring, &cqe, &zero) == 0 && cqe->res < 0) {
      const int err = -cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      io_uring_queue_exit(&ring);
      Status s = Status::FromErrno(err, "register an io_uring entry");
      report(s);
      return s;
    }
    report(Status::OK());
    for (;;) {
      if (draining.load()) {
        const auto left = drain_end - std::chrono::steady_clock::now();
        if (left <= std::chrono::steady_clock::duration::zero()) break;
        __kernel_timespec ts{};
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
        ts.tv_sec = ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        r = io_uring_wait_cqe_timeout(&ring, &cqe, &ts);
      } else {
        r = io_uring_wait_cqe(&ring, &cqe);
      }
      if (r == -EINTR || r == -EAGAIN || r == -ETIME) {
        if (stop.load() || fuse_session_exited(se)) break;
        continue;
      }
      if (r < 0) return Status::FromErrno(-r, "io_uring_wait_cqe");
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      if (res < 0) {
        // An adopted commit whose request is gone (answered after all, or ended by the
        // kernel): the slot gets a fresh entry.
        if (adopting && (res == -ENOENT || res == -EIO)) {
          adopting = false;
          if (!Register(&ring, qid, slot, iov) || io_uring_submit(&ring) < 0)
            return Status::IOError("cannot register a fresh io_uring entry");
          continue;
        }
        // The connection ended (unmount, abort): the session is over.
        if (res == -ENOTCONN || res == -ECONNABORTED || res == -ECANCELED) {
          if (!stop.load() && !draining.load()) fuse_session_exit(se);
          break;
        }
        return Status::FromErrno(-res, "io_uring entry (slot " + std::to_string(slot) +
                                           ", last commit " +
                                           std::to_string(info.last_commit.load()) + ")");
      }
      adopting = false;
      // Handing over: the request stays in the slot, untouched, for the next process.
      if (draining.load()) break;
      if (HoldsReply(header)) {
        fuse_out_header out;
        std::memcpy(&out, header->in_out, sizeof out);
        CTFS_LOG(kError) << "io_uring: slot " << slot << " (queue " << qid
                         << ") was given a request its buffer does not hold: last commit "
                         << info.last_commit.load() << ", reply unique " << out.unique
                         << ", ring commit id " << header->ring_ent_in_out.commit_id;
      }
      const uint64_t commit_id = Handle(qid, slot, header, payload, /*redo=*/false);
      if (!Commit(&ring, qid, slot, commit_id)) return Status::IOError("no SQE for a commit");
      r = io_uring_submit(&ring);
      if (r < 0) return Status::FromErrno(-r, "io_uring_submit (commit)");
      info.last_commit.store(commit_id, std::memory_order_release);
      info.state.store(kWaiting, std::memory_order_release);
    }
    io_uring_queue_exit(&ring);
    return Status::OK();
  }

  // Serves the request in the slot; returns the id to commit its reply with. `redo`: a request
  // the process before had begun (SafeToRedo decides whether it is done again).
  uint64_t Handle(int qid, int slot, abi::UringReqHeader* header, char* payload, bool redo) {
    fuse_in_header in;
    std::memcpy(&in, header->in_out, sizeof in);
    const uint64_t commit_id = header->ring_ent_in_out.commit_id;
    const uint32_t payload_sz = header->ring_ent_in_out.payload_sz;
    SlotInfo& info = Info(slot);
    info.serving.store(commit_id, std::memory_order_release);
    info.state.store(kServing, std::memory_order_release);
    UringReply reply{header, payload, payload_size, in.unique};
    if (redo && !SafeToRedo(in.opcode)) {
      adopted_aborted.fetch_add(1);
      Fail(&reply, ECONNABORTED);  // as the kernel answers what a dead /dev/fuse reader held
      return commit_id;
    }
    if (redo) adopted_retried.fetch_add(1);
    if (in.len < sizeof in || payload_sz > payload_size || in.len - sizeof in < payload_sz ||
        in.len - sizeof in - payload_sz > sizeof header->op_in) {
      uint64_t mark = 0;
      std::memcpy(&mark, header->in_out + kReplyMarkAt, sizeof mark);
      CTFS_LOG(kError) << "io_uring: malformed request (len " << in.len << ", payload "
                       << payload_sz << ", opcode " << in.opcode << ", unique " << in.unique
                       << ", commit id " << commit_id << ", slot " << slot << ", redo " << redo
                       << ", mark " << std::hex << mark << std::dec << ")";
      Fail(&reply, EIO);
      return commit_id;
    }
    const size_t arg0 = in.len - sizeof in - payload_sz;
    char* start = payload - sizeof in - arg0;
    static_assert(kFront >= sizeof(abi::UringReqHeader) + sizeof(fuse_in_header) + 128);
    std::memcpy(start, &in, sizeof in);
    std::memcpy(start + sizeof in, header->op_in, arg0);
    QueueCount& c = count[qid];
    if (const int started = c.started.load();
        c.busy.fetch_add(1) + 1 >= started && started < o.max_per_queue) {
      MutexLock l(mu);
      if (c.started.load() < o.max_per_queue && !Ending() && !draining.load())
        StartLocked(qid, -1, false, nullptr);
    }
    t_reply = &reply;
    fuse_buf buf{};
    buf.mem = start;
    buf.size = in.len;
    fuse_session_process_buf(se, &buf);
    t_reply = nullptr;
    c.busy.fetch_sub(1);
    // No reply (a retrieve's notify reply takes none, fuse_reply_none) or one that did not
    // fit: the entry is committed all the same, or it would never fetch again.
    if (!reply.stored) Fail(&reply, in.opcode == FUSE_NOTIFY_REPLY ? 0 : EIO);
    return commit_id;
  }

  static void Fail(UringReply* r, int err) {
    fuse_out_header out{};
    out.len = sizeof out;
    out.error = -err;
    out.unique = r->unique;
    PutOutHeader(r->header, out);
    r->header->ring_ent_in_out.payload_sz = 0;
  }
};

UringLoop::UringLoop(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}

UringLoop::~UringLoop() {
  Stop();
  Join();
}

Result<std::unique_ptr<UringLoop>> UringLoop::Start(fuse_session* se, const UringLoopOptions& o) {
  if (o.slots == nullptr) return Status::InvalidArgument("io_uring: no entry memory");
  struct sigaction sa {};
  sa.sa_handler = NoOp;
  sigemptyset(&sa.sa_mask);
  ::sigaction(WakeSignal(), &sa, nullptr);
  auto sh = std::make_shared<Shared>();
  sh->self_weak = sh;
  sh->se = se;
  sh->o = o;
  sh->queues = UringQueueCount();
  sh->o.min_per_queue = std::max(1, o.min_per_queue);
  sh->o.max_per_queue = std::max(sh->o.min_per_queue, o.max_per_queue);
  sh->payload_size = o.slots->payload_size();
  sh->count = std::make_unique<Shared::QueueCount[]>(static_cast<size_t>(sh->queues));
  std::unique_ptr<UringLoop> loop(new UringLoop(sh));
  std::vector<std::unique_ptr<std::promise<Status>>> registered;
  auto start = [&](int qid, int slot, bool adopt) -> Status {
    registered.push_back(std::make_unique<std::promise<Status>>());
    std::future<Status> f = registered.back()->get_future();
    {
      MutexLock l(sh->mu);
      if (!sh->StartLocked(qid, slot, adopt, registered.back().get()))
        return Status::IOError("no io_uring slot left");
    }
    return f.get();
  };
  Status failed = Status::OK();
  // First the slots an earlier process left with a queue: their requests are answered and
  // their entries adopted (or registered afresh). They are reserved before any thread starts,
  // so that one growing meanwhile (a request served during adoption) takes none of them.
  std::vector<int> adopt;
  {
    MutexLock l(sh->mu);
    sh->taken.assign(static_cast<size_t>(o.slots->count()), false);
    std::vector<int> per_queue(static_cast<size_t>(sh->queues), 0);
    for (int i = 0; i < o.slots->count(); ++i) {
      SlotInfo& info = sh->Info(i);
      const int qid = info.qid.load();
      if (info.state.load() == kFree || qid < 0 || qid >= sh->queues) continue;
      if (per_queue[qid]++ >= sh->o.max_per_queue) continue;
      sh->taken[i] = true;
      adopt.push_back(i);
    }
  }
  for (int i : adopt) {
    if (!failed.ok()) break;
    sh->adopted_slots.fetch_add(1);
    failed = start(sh->Info(i).qid.load(), i, /*adopt=*/true);
  }
  // Then every queue's entries up to min_per_queue, each queue's first before any second:
  // the kernel uses the ring once each queue has one. Past that, a refused entry costs only
  // itself: the kernel may already use the ring, and the connection cannot go back.
  for (int qid = 0; qid < sh->queues && failed.ok(); ++qid)
    if (sh->count[qid].started.load() == 0) failed = start(qid, -1, /*adopt=*/false);
  for (int round = 1; round < sh->o.min_per_queue && failed.ok(); ++round)
    for (int qid = 0; qid < sh->queues; ++qid)
      if (sh->count[qid].started.load() <= round)
        if (Status s = start(qid, -1, /*adopt=*/false); !s.ok())
          CTFS_LOG(kWarn) << "io_uring queue " << qid << ": an entry fewer: " << s.ToString();
  if (!failed.ok()) {
    loop->Stop();
    loop->Join();
    ResetToDevFuse(o.fuse_fd);
    return Status::IOError("FUSE over io_uring: " + failed.ToString());
  }
  if (!o.kick_path.empty()) {
    for (int qid = 0; qid < sh->queues; ++qid) {
      RunDetached([path = o.kick_path, qid] {
        PinTo(qid);
        struct statfs st {};
        ::statfs(path.c_str(), &st);
      });
    }
  }
  return loop;
}

UringAdoption UringLoop::adoption() const {
  return {shared_->adopted_served.load(), shared_->adopted_retried.load(),
          shared_->adopted_aborted.load(), shared_->adopted_committed.load(),
          shared_->adopted_slots.load()};
}

void UringLoop::Drain(int wait_ms) {
  shared_->drain_end = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  shared_->draining.store(true);
  shared_->WakeUntilGone();  // waiting threads wait again, with the deadline
}

void UringLoop::Stop() {
  shared_->stop.store(true);
  shared_->WakeUntilGone();
}

void UringLoop::Join() { shared_->JoinAll(); }

int UringLoop::threads() const {
  int n = 0;
  for (int q = 0; q < shared_->queues; ++q) n += shared_->count[q].started.load();
  return n;
}

}  // namespace cubetorchfs::fuse
