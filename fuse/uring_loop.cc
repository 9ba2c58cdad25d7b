#include "fuse/uring_loop.h"

#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/sysinfo.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "common/logging.h"
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
      highest = std::max(highest, std::stoi(dash == std::string::npos ? part : part.substr(dash + 1)));
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

Status InitRing(io_uring* ring);

// Makes the kernel give the connection up for io_uring (requests then come by /dev/fuse): a
// registration it refuses does that, and one with a single buffer is refused.
void ResetToDevFuse(int fuse_fd) {
  io_uring ring{};
  if (!InitRing(&ring).ok()) {
    CTFS_LOG(kError) << "io_uring: cannot create a ring to hand the connection back to "
                        "/dev/fuse; requests may wait until the mount is aborted";
    return;
  }
  static char scratch[sizeof(abi::UringReqHeader)];
  iovec iov{scratch, sizeof scratch};
  io_uring_sqe* sqe = Command(&ring, fuse_fd, abi::kUringCmdRegister, 0, 0);
  sqe->addr = reinterpret_cast<uint64_t>(&iov);
  sqe->len = 1;
  io_uring_submit_and_wait(&ring, 1);
  io_uring_queue_exit(&ring);
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
  std::memcpy(r->header->in_out, &out, sizeof out);
  r->header->ring_ent_in_out.payload_sz = static_cast<uint32_t>(total);
  r->stored = true;
  return true;
}

struct UringLoop::Shared {
  fuse_session* se = nullptr;
  UringLoopOptions o;
  int queues = 0;
  size_t payload_size = 0;
  std::atomic<bool> stop{false};
  std::unique_ptr<std::atomic<int>[]> busy;     // per queue: threads serving a request
  std::unique_ptr<std::atomic<int>[]> started;  // per queue: threads started
  std::mutex mu;                                // guards threads and running
  std::condition_variable cv;
  std::vector<std::thread> threads;
  int running = 0;

  bool Ending() const { return stop.load() || fuse_session_exited(se); }

  // Starts a thread for queue `qid`; its registration's result goes to `registered`.
  void StartLocked(const std::shared_ptr<Shared>& self, int qid,
                   std::promise<Status>* registered) {
    ++running;
    started[qid].fetch_add(1);
    threads.emplace_back([self, qid, registered] { self->Serve(qid, registered); });
  }

  void Serve(int qid, std::promise<Status>* registered) {
    PinTo(qid);
    Status s = Run(qid, registered);
    if (!s.ok() && registered == nullptr && !Ending())
      CTFS_LOG(kError) << "io_uring queue " << qid << ": " << s.ToString();
    std::lock_guard l(mu);
    --running;
    cv.notify_all();
  }

  Status Run(int qid, std::promise<Status>* registered) {
    auto report = [&registered](Status s) {
      if (registered != nullptr) registered->set_value(s);
      registered = nullptr;
      return s;
    };
    io_uring ring{};
    if (Status s = InitRing(&ring); !s.ok()) return report(s);
    // Never unmapped: the kernel keeps the addresses for the connection's life.
    void* mem = ::mmap(nullptr, kFront + payload_size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      io_uring_queue_exit(&ring);
      return report(Status::FromErrno(errno, "mmap an io_uring entry"));
    }
    auto* header = static_cast<abi::UringReqHeader*>(mem);
    char* payload = static_cast<char*>(mem) + kFront;
    iovec iov[2] = {{header, sizeof *header}, {payload, payload_size}};
    io_uring_sqe* sqe = Command(&ring, o.fuse_fd, abi::kUringCmdRegister, 0, qid);
    sqe->addr = reinterpret_cast<uint64_t>(iov);
    sqe->len = 2;
    int r = io_uring_submit(&ring);
    if (r < 0) {
      io_uring_queue_exit(&ring);
      return report(Status::FromErrno(-r, "io_uring_submit (register)"));
    }
    // A refused registration completes at once; an accepted one only with a request.
    io_uring_cqe* cqe = nullptr;
    __kernel_timespec zero{};
    r = io_uring_wait_cqe_timeout(&ring, &cqe, &zero);
    if (r == 0 && cqe->res < 0) {
      const int err = -cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      io_uring_queue_exit(&ring);
      return report(Status::FromErrno(err, "register an io_uring entry"));
    }
    if (registered != nullptr) registered->set_value(Status::OK());
    registered = nullptr;
    for (;;) {
      r = io_uring_wait_cqe(&ring, &cqe);
      if (r == -EINTR || r == -EAGAIN || r == -ETIME) {
        if (Ending()) break;
        continue;
      }
      if (r < 0) return Status::FromErrno(-r, "io_uring_wait_cqe");
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      if (res < 0) {
        // The connection ended (unmount, abort): the session is over.
        if (res == -ENOTCONN || res == -ECONNABORTED || res == -ECANCELED) {
          if (!stop.load()) fuse_session_exit(se);
          break;
        }
        return Status::FromErrno(-res, "io_uring entry");
      }
      const uint64_t commit_id = Handle(qid, header, payload);
      sqe = Command(&ring, o.fuse_fd, abi::kUringCmdCommitAndFetch, commit_id, qid);
      r = io_uring_submit(&ring);
      if (r < 0) return Status::FromErrno(-r, "io_uring_submit (commit)");
    }
    io_uring_queue_exit(&ring);
    return Status::OK();
  }

  // Serves the request in the entry's buffers; returns the id to commit its reply with.
  uint64_t Handle(int qid, abi::UringReqHeader* header, char* payload) {
    fuse_in_header in;
    std::memcpy(&in, header->in_out, sizeof in);
    const uint64_t commit_id = header->ring_ent_in_out.commit_id;
    const uint32_t payload_sz = header->ring_ent_in_out.payload_sz;
    UringReply reply{header, payload, payload_size, in.unique};
    if (in.len < sizeof in || payload_sz > payload_size || in.len - sizeof in < payload_sz ||
        in.len - sizeof in - payload_sz > sizeof header->op_in) {
      CTFS_LOG(kError) << "io_uring: malformed request (len " << in.len << ", payload "
                       << payload_sz << ")";
      Fail(&reply, EIO);
      return commit_id;
    }
    const size_t arg0 = in.len - sizeof in - payload_sz;
    char* start = payload - sizeof in - arg0;
    static_assert(kFront >= sizeof(abi::UringReqHeader) + sizeof(fuse_in_header) + 128);
    std::memcpy(start, &in, sizeof in);
    std::memcpy(start + sizeof in, header->op_in, arg0);
    if (busy[qid].fetch_add(1) + 1 >= started[qid].load() &&
        started[qid].load() < o.max_per_queue) {
      std::lock_guard l(mu);
      if (started[qid].load() < o.max_per_queue && !Ending())
        StartLocked(self_weak.lock(), qid, nullptr);
    }
    t_reply = &reply;
    fuse_buf buf{};
    buf.mem = start;
    buf.size = in.len;
    fuse_session_process_buf(se, &buf);
    t_reply = nullptr;
    busy[qid].fetch_sub(1);
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
    std::memcpy(r->header->in_out, &out, sizeof out);
    r->header->ring_ent_in_out.payload_sz = 0;
  }

  std::weak_ptr<Shared> self_weak;
};

UringLoop::UringLoop(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}

UringLoop::~UringLoop() {
  Stop();
  Join();
}

Result<std::unique_ptr<UringLoop>> UringLoop::Start(fuse_session* se,
                                                    const UringLoopOptions& o) {
  struct sigaction sa {};
  sa.sa_handler = NoOp;
  sigemptyset(&sa.sa_mask);
  ::sigaction(WakeSignal(), &sa, nullptr);
  auto sh = std::make_shared<Shared>();
  sh->self_weak = sh;
  sh->se = se;
  sh->o = o;
  sh->o.min_per_queue = std::max(1, o.min_per_queue);
  sh->o.max_per_queue = std::max(sh->o.min_per_queue, o.max_per_queue);
  sh->queues = UringQueueCount();
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  // The kernel's size: max(8 KiB, max_write, max_pages pages), max_pages from libfuse's INIT
  // reply (max_write rounded up to pages).
  sh->payload_size = std::max<size_t>(8192, (o.max_write + page - 1) / page * page);
  sh->busy = std::make_unique<std::atomic<int>[]>(static_cast<size_t>(sh->queues));
  sh->started = std::make_unique<std::atomic<int>[]>(static_cast<size_t>(sh->queues));
  std::unique_ptr<UringLoop> loop(new UringLoop(sh));
  // Every queue's first entry before any other: the kernel uses the ring once each has one.
  std::vector<std::unique_ptr<std::promise<Status>>> registered;
  for (int round = 0; round < sh->o.min_per_queue; ++round) {
    for (int qid = 0; qid < sh->queues; ++qid) {
      registered.push_back(std::make_unique<std::promise<Status>>());
      std::future<Status> f = registered.back()->get_future();
      {
        std::lock_guard l(sh->mu);
        sh->StartLocked(sh, qid, registered.back().get());
      }
      Status s = f.get();
      if (!s.ok()) {
        loop->Stop();
        loop->Join();
        ResetToDevFuse(o.fuse_fd);
        return Status::IOError("FUSE over io_uring, queue " + std::to_string(qid) + ": " +
                               s.ToString());
      }
    }
  }
  if (!o.kick_path.empty()) {
    for (int qid = 0; qid < sh->queues; ++qid) {
      std::thread([path = o.kick_path, qid] {
        PinTo(qid);
        struct statfs st {};
        ::statfs(path.c_str(), &st);
      }).detach();
    }
  }
  return loop;
}

void UringLoop::Stop() {
  shared_->stop.store(true);
  for (;;) {
    std::vector<pthread_t> live;
    {
      std::lock_guard l(shared_->mu);
      if (shared_->running == 0) return;
      for (auto& t : shared_->threads) live.push_back(t.native_handle());
    }
    for (pthread_t t : live) ::pthread_kill(t, WakeSignal());
    std::unique_lock l(shared_->mu);
    shared_->cv.wait_for(l, std::chrono::milliseconds(10),
                         [this] { return shared_->running == 0; });
  }
}

void UringLoop::Join() {
  std::vector<std::thread> threads;
  {
    std::lock_guard l(shared_->mu);
    threads.swap(shared_->threads);
  }
  for (auto& t : threads)
    if (t.joinable()) t.join();
}

int UringLoop::threads() const {
  int n = 0;
  for (int q = 0; q < shared_->queues; ++q) n += shared_->started[q].load();
  return n;
}

}  // namespace cubetorchfs::fuse
