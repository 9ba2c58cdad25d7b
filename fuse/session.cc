#include "fuse/session.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <utility>

#include "common/logging.h"
#include "fuse/fuse_ops.h"
#include "fuse/kernel_abi.h"
#include "fuse/page_probe.h"
#include "fuse/passthrough.h"
#include "fuse/session_loop.h"
#include "fuse/uring_loop.h"

namespace cubetorchfs::fuse {
namespace {

// Owns the FUSE argument vector.
class FuseArgs {
 public:
  explicit FuseArgs(const std::vector<std::string>& args) {
    for (const auto& a : args) fuse_opt_add_arg(&args_, a.c_str());
  }
  ~FuseArgs() { fuse_opt_free_args(&args_); }
  FuseArgs(const FuseArgs&) = delete;
  FuseArgs& operator=(const FuseArgs&) = delete;
  fuse_args* get() { return &args_; }

 private:
  fuse_args args_ = FUSE_ARGS_INIT(0, nullptr);
};

// A descriptor of its own on the connection `fd` serves (FUSE_DEV_IOC_CLONE).
Result<int> CloneFuseFd(int fd) {
  int clone = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (clone < 0) return Status::FromErrno(errno, "open /dev/fuse");
  uint32_t source = static_cast<uint32_t>(fd);
  if (::ioctl(clone, FUSE_DEV_IOC_CLONE, &source) != 0) {
    const int err = errno;
    ::close(clone);
    return Status::FromErrno(err, "clone the FUSE connection");
  }
  return clone;
}

uint32_t Load32(const std::string& b, size_t off) {
  uint32_t v = 0;
  std::memcpy(&v, b.data() + off, sizeof v);
  return v;
}

// The kernel's INIT offers `flag` (one of the 64-bit set's upper half: FUSE over io_uring,
// which it offers once root set enable_uring; passthrough).
bool Offers(const std::string& init, uint64_t flag) {
  const size_t in = sizeof(fuse_in_header);
  if (init.size() < in + abi::kInitInMinSize) return false;
  const uint32_t flags = Load32(init, in + abi::kInitInFlags);
  const uint32_t flags2 = Load32(init, in + abi::kInitInFlags2);
  return (flags & abi::kInitExt) && (flags2 & static_cast<uint32_t>(flag >> 32));
}

void ClearOffer(std::string* init, uint64_t flag) {
  const size_t off = sizeof(fuse_in_header) + abi::kInitInFlags2;
  uint32_t flags2 = Load32(*init, off) & ~static_cast<uint32_t>(flag >> 32);
  std::memcpy(init->data() + off, &flags2, sizeof flags2);
}

// CAP_SYS_ADMIN in this process's effective set: the kernel registers backing files only for
// it (FUSE_DEV_IOC_BACKING_OPEN).
bool HasCapSysAdmin() {
  FILE* f = std::fopen("/proc/self/status", "re");
  if (f == nullptr) return false;
  char line[256];
  unsigned long long eff = 0;
  bool found = false;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "CapEff: %llx", &eff) == 1) found = true;
  std::fclose(f);
  return found && ((eff >> 21) & 1);  // CAP_SYS_ADMIN is 21
}

// libfuse's reply to an open (fuse_open_out), with FOPEN_PASSTHROUGH and `backing_id`.
struct PatchedOpen {
  char out[abi::kOpenOutSize];
  iovec iov[2];
};
bool PatchOpenReply(struct iovec* iov, int count, int32_t backing_id, PatchedOpen* p) {
  if (count != 2 || iov[1].iov_len != abi::kOpenOutSize) return false;
  std::memcpy(p->out, iov[1].iov_base, sizeof p->out);
  uint32_t flags = 0;
  std::memcpy(&flags, p->out + abi::kOpenOutFlags, sizeof flags);
  flags |= abi::kFopenPassthrough;
  std::memcpy(p->out + abi::kOpenOutFlags, &flags, sizeof flags);
  std::memcpy(p->out + abi::kOpenOutBackingId, &backing_id, sizeof backing_id);
  p->iov[0] = iov[0];
  p->iov[1] = {p->out, sizeof p->out};
  return true;
}

// libfuse's I/O on the device (fuse_session_custom_io): a reply to a request that came by
// io_uring goes to its entry; the reply to FUSE_INIT takes FUSE_OVER_IO_URING when chosen;
// everything else goes to the device as libfuse would write it.
ssize_t ReadDevice(int fd, void* buf, size_t len, void*) { return ::read(fd, buf, len); }

ssize_t WritevDevice(int fd, struct iovec* iov, int count, void* userdata) {
  PatchedOpen patched_open;
  if (const int32_t id = PassthroughReply::Current();
      id != 0 && PatchOpenReply(iov, count, id, &patched_open))
    iov = patched_open.iov;
  if (UringReply* r = CurrentUringReply(); r != nullptr && StoreUringReply(r, iov, count)) {
    ssize_t n = 0;
    for (int i = 0; i < count; ++i) n += static_cast<ssize_t>(iov[i].iov_len);
    return n;
  }
  auto* ctx = static_cast<FuseContext*>(userdata);
  // (A load first: the exchange, once, is the only write to that line.)
  if (ctx != nullptr && ctx->patch_init.load(std::memory_order_relaxed) &&
      ctx->patch_init.exchange(false) && count == 2 && iov[1].iov_len >= abi::kInitOutSize) {
    std::string out(static_cast<const char*>(iov[1].iov_base), iov[1].iov_len);
    uint32_t flags = Load32(out, abi::kInitOutFlags);
    if (flags & abi::kInitExt) {
      uint32_t flags2 = Load32(out, abi::kInitOutFlags2) | ctx->init_flags2;
      std::memcpy(out.data() + abi::kInitOutFlags2, &flags2, sizeof flags2);
      if (ctx->init_flags2 & static_cast<uint32_t>(abi::kPassthrough >> 32))
        std::memcpy(out.data() + abi::kInitOutMaxStackDepth, &abi::kPassthroughStackDepth,
                    sizeof abi::kPassthroughStackDepth);
    }
    iovec patched[2] = {iov[0], {out.data(), out.size()}};
    return ::writev(fd, patched, 2);
  }
  return ::writev(fd, iov, count);
}

ssize_t SpliceToDevice(int fdin, off_t* offin, int fdout, off_t* offout, size_t len,
                       unsigned int flags, void*) {
  return ::splice(fdin, offin, fdout, offout, len, flags);
}

const fuse_custom_io kDeviceIo = {WritevDevice, ReadDevice, nullptr, SpliceToDevice};

}  // namespace

Result<int> FuseSession::MountForSupervisor(const std::vector<std::string>& argv,
                                            const std::string& mount_point) {
  FuseArgs args(argv);
  static const fuse_lowlevel_ops kNoOps{};
  fuse_session* se = fuse_session_new(args.get(), &kNoOps, sizeof kNoOps, nullptr);
  if (se == nullptr)
    return Status::InvalidArgument("-o: invalid FUSE mount options (see the line above)");
  if (fuse_session_mount(se, mount_point.c_str()) != 0)
    return Status::IOError(mount_point + ": mount failed (see the line above)");
  return fuse_session_fd(se);
}

Result<std::unique_ptr<FuseSession>> FuseSession::Create(fs::FileSystem* fs,
                                                         const conf::FuseOptions& options,
                                                         prometheus::Registry& registry,
                                                         PageProbe* page_probe,
                                                         const std::vector<std::string>& argv) {
  auto ctx = std::make_unique<FuseContext>(fs, options, registry);
  FuseArgs args(argv);
  fuse_session* se =
      fuse_session_new(args.get(), &Operations(), sizeof(fuse_lowlevel_ops), ctx.get());
  if (se == nullptr)
    return Status::InvalidArgument("-o: invalid FUSE mount options (see the line above)");
  ctx->session = se;
  // Under keep_cache the prefetcher asks the kernel which marked files it still holds.
  page_probe->Attach(se);
  ctx->page_probe = page_probe;
  return std::unique_ptr<FuseSession>(new FuseSession(std::move(ctx), se));
}

FuseSession::FuseSession(std::unique_ptr<FuseContext> ctx, fuse_session* se)
    : ctx_(std::move(ctx)), se_(se) {}

FuseSession::~FuseSession() { fuse_session_destroy(se_); }

Status FuseSession::SetSignalHandlers() {
  if (fuse_set_signal_handlers(se_) != 0) return Status::IOError("cannot set signal handlers");
  return Status::OK();
}

void FuseSession::RemoveSignalHandlers() { fuse_remove_signal_handlers(se_); }

Status FuseSession::ServeClone(int fuse_fd) {
  Result<int> clone = CloneFuseFd(fuse_fd);
  if (!clone.ok()) return Status::IOError(clone.status().ToString());
  // libfuse's I/O through our hooks (above), so that replies can go to io_uring entries.
  if (int r = fuse_session_custom_io(se_, &kDeviceIo, *clone); r != 0) {
    ::close(*clone);
    RemoveSignalHandlers();
    return Status::FromErrno(-r, "cannot serve the mount");
  }
  fd_ = *clone;
  return Status::OK();
}

Result<std::string> FuseSession::ReadInit() {
  // The kernel's first request on a new connection is FUSE_INIT. The buffer must hold a
  // whole write request, as for every read of the device.
  std::string init;
  init.resize(4u << 20);
  ssize_t n;
  do n = ::read(fd_, init.data(), init.size());
  while (n < 0 && errno == EINTR);
  if (n < 0) return Status::FromErrno(errno, "read FUSE_INIT");
  init.resize(static_cast<size_t>(n));
  fuse_in_header h{};
  if (init.size() >= sizeof h) std::memcpy(&h, init.data(), sizeof h);
  if (init.size() < sizeof h || h.opcode != FUSE_INIT)
    return Status::IOError("the connection's first request is not FUSE_INIT");
  return init;
}

Result<std::string> FuseSession::PrepareInit(std::string init, bool replayed) {
  CTFS_ASSIGN_OR_RETURN(init, PrepareIoUring(std::move(init), replayed));
  CTFS_ASSIGN_OR_RETURN(init, PreparePassthrough(std::move(init), replayed));
  uint32_t add = 0;
  if (!replayed && ctx_->io_uring) add |= static_cast<uint32_t>(abi::kOverIoUring >> 32);
  if (!replayed && ctx_->passthrough) add |= static_cast<uint32_t>(abi::kPassthrough >> 32);
  ctx_->init_flags2 = add;
  ctx_->patch_init.store(add != 0);
  return init;
}

Result<std::string> FuseSession::PrepareIoUring(std::string init, bool replayed) {
  using Mode = conf::FuseOptions::Mode;
  const Mode mode = ctx_->options.io_uring;
  const bool offered = Offers(init, abi::kOverIoUring);
  replayed_ = replayed;
  if (replayed) {
    // The copy offers io_uring only where the first process took it.
    ctx_->io_uring = offered;
    if (offered && mode == Mode::kOff)
      CTFS_LOG(kWarn) << "this mount's connection is on FUSE over io_uring since it was "
                         "mounted; fuse.io_uring: off takes effect at the next mount";
    return init;
  }
  if (offered && mode != Mode::kOff) {
    if (Status s = CanUseIoUring(); s.ok()) {
      ctx_->io_uring = true;
    } else if (mode == Mode::kOn) {
      return Status::InvalidArgument("fuse.io_uring is on but this process cannot use io_uring (" +
                                     s.ToString() + ")");
    } else {
      CTFS_LOG(kWarn) << "the kernel offers FUSE over io_uring but this process cannot use "
                      << "io_uring (" << s.ToString() << "): serving through /dev/fuse";
    }
  } else if (mode == Mode::kOn) {
    return Status::InvalidArgument(
        "fuse.io_uring is on but the kernel does not offer FUSE over io_uring (Linux 6.14+ "
        "with CONFIG_FUSE_IO_URING, and as root: echo Y > "
        "/sys/module/fuse/parameters/enable_uring)");
  }
  if (!ctx_->io_uring && offered) ClearOffer(&init, abi::kOverIoUring);
  return init;
}

Result<std::string> FuseSession::PreparePassthrough(std::string init, bool replayed) {
  using Mode = conf::FuseOptions::Mode;
  const Mode mode = ctx_->options.passthrough;
  const bool offered = Offers(init, abi::kPassthrough);
  bool take = false;
  if (replayed) {
    // The copy offers passthrough only where the first process took it (or where a process
    // that knew nothing of it kept the kernel's offer: the first registration then fails, and
    // says so once).
    take = offered;
  } else if (offered && mode != Mode::kOff && !ctx_->options.keep_cache) {
    if (HasCapSysAdmin()) {
      take = true;
    } else if (mode == Mode::kOn) {
      return Status::InvalidArgument(
          "fuse.passthrough is on but the daemon lacks CAP_SYS_ADMIN, which the kernel "
          "requires to register backing files");
    } else {
      CTFS_LOG(kInfo) << "passthrough not used: the daemon lacks CAP_SYS_ADMIN; large files "
                         "are read through the daemon";
    }
  } else if (mode == Mode::kOn && !offered) {
    return Status::InvalidArgument(
        "fuse.passthrough is on but the kernel does not offer FUSE passthrough (Linux 6.9+ "
        "with CONFIG_FUSE_PASSTHROUGH)");
  }
  const int memory_fd = std::exchange(passthrough_memory_fd_, -1);
  if (!take) {
    if (offered) ClearOffer(&init, abi::kPassthrough);
    if (!passthrough_state_.empty())
      CTFS_LOG(kWarn) << "passthrough state handed over, but this connection has no passthrough";
    if (memory_fd >= 0) ::close(memory_fd);
    return init;
  }
  ctx_->passthrough =
      std::make_unique<Passthrough>(Passthrough::Ioctls(fd_), PassthroughMetrics(*ctx_));
  if (mode == Mode::kOff || ctx_->options.keep_cache) ctx_->passthrough->Disable();
  if (!passthrough_state_.empty()) {
    if (memory_fd >= 0) ::close(memory_fd);  // the state handed over is the newer
    if (Status s = ctx_->passthrough->Restore(passthrough_state_); !s.ok())
      CTFS_LOG(kError) << "passthrough state handed over not used: " << s.ToString();
    else
      CTFS_LOG(kInfo) << "took over " << ctx_->passthrough->backings()
                      << " passthrough registrations";
    passthrough_state_.clear();
  } else if (memory_fd >= 0) {
    // After a crash: the inodes the kernel still has opens of, and their registrations, so
    // that their next opens name the registration the kernel holds (passthrough.h).
    Result<size_t> adopted = ctx_->passthrough->AdoptDurable(memory_fd);
    if (!adopted.ok())
      CTFS_LOG(kError) << "passthrough table of the process before not used: "
                       << adopted.status().ToString()
                       << "; files it held through passthrough fail to open (EIO) until "
                          "those opens close";
    else
      CTFS_LOG(kInfo) << "after the crash, kept the opens of " << *adopted << " inodes ("
                      << ctx_->passthrough->backings() << " passthrough registrations)";
  }
  if (ctx_->passthrough->durable_fd() >= 0 && on_passthrough_memory_)
    on_passthrough_memory_(ctx_->passthrough->durable_fd());
  return init;
}

std::string FuseSession::PassthroughState() const {
  return ctx_->passthrough != nullptr && !ctx_->passthrough->empty()
             ? ctx_->passthrough->Serialize()
             : std::string();
}

bool FuseSession::passthrough() const {
  return ctx_->passthrough != nullptr && ctx_->passthrough->enabled();
}

const char* FuseSession::transport() const {
  return ctx_->io_uring.load(std::memory_order_relaxed) ? "io_uring" : "/dev/fuse";
}

Status FuseSession::ProcessInit(std::string init, bool replayed) {
  if (replayed) {
    if (init.size() < sizeof(fuse_in_header) + 8)
      return Status::InvalidArgument("--takeover: the FUSE_INIT copy is truncated");
    // A unique no request of the kernel has (they are even and count up from 2): the reply
    // to this replayed INIT finds no request and is dropped (ENOENT, which libfuse ignores).
    const uint64_t unique = 0x7ffffffffffffffeull;
    std::memcpy(init.data() + offsetof(fuse_in_header, unique), &unique, sizeof unique);
  }
  fuse_buf buf{};
  buf.size = init.size();
  buf.mem = init.data();
  fuse_session_process_buf(se_, &buf);
  return Status::OK();
}

void FuseSession::SetGeneration(uint64_t generation) {
  ctx_->files.SetGeneration(generation);
  ctx_->dirs.SetGeneration(generation);
}

int FuseSession::Serve(int min_threads, int max_threads, const std::atomic<bool>* stop) {
  if (ctx_->io_uring && uring_ == nullptr) {
    UringLoopOptions o;
    o.fuse_fd = fd_;
    const int queues = UringQueueCount();
    o.min_per_queue = std::max(1, (min_threads + queues - 1) / queues);
    o.max_per_queue = std::max(2, (max_threads + queues - 1) / queues);
    o.kick_path = kick_path_;
    if (uring_slots_ == nullptr) {
      // The kernel's size: max(8 KiB, max_write, max_pages pages), max_pages from libfuse's
      // INIT reply (max_write, which is fuse.max_read, rounded up to pages).
      const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
      const size_t payload =
          std::max<size_t>(8192, (ctx_->options.max_read + page - 1) / page * page);
      const int slots = queues * o.max_per_queue;
      Result<std::shared_ptr<UringSlots>> m = UringSlots::Open(uring_memory_fd_, slots, payload);
      if (!m.ok() && uring_memory_fd_ >= 0) {
        CTFS_LOG(kWarn) << m.status().ToString() << ": requests the process before had taken "
                        << "stay unanswered until the mount ends";
        m = UringSlots::Open(-1, slots, payload);
      }
      uring_memory_fd_ = -1;
      if (m.ok()) {
        uring_slots_ = *m;
        if (!uring_slots_->adopted() && on_uring_memory_) on_uring_memory_(uring_slots_->fd());
      } else {
        CTFS_LOG(kError) << m.status().ToString();
      }
    }
    o.slots = uring_slots_;
    Result<std::unique_ptr<UringLoop>> loop =
        uring_slots_ != nullptr ? UringLoop::Start(se_, o) : Status::IOError("no entry memory");
    if (!loop.ok()) {
      // Start has told the kernel to send requests by /dev/fuse where it failed a
      // registration; here for the failures before one. A connection served over io_uring
      // before cannot go back: its requests would wait forever, so the mount ends instead.
      if (uring_slots_ == nullptr) ResetToDevFuse(fd_);
      if (replayed_) {
        CTFS_LOG(kError) << loop.status().ToString() << ": this mount was served over io_uring "
                         << "and cannot go back to /dev/fuse; ending it";
        fuse_session_exit(se_);
        return -EIO;
      }
      CTFS_LOG(kError) << loop.status().ToString() << "; serving through /dev/fuse";
      ctx_->io_uring = false;
    } else {
      uring_ = std::move(*loop);
      const UringAdoption a = uring_->adoption();
      CTFS_LOG(kInfo) << "serving through FUSE over io_uring: " << queues << " queues, "
                      << uring_->threads() << " entries";
      if (a.slots > 0)
        CTFS_LOG(kInfo) << "took over " << a.slots
                        << " io_uring entries of the process before: " << a.served
                        << " requests it never took, " << a.retried
                        << " it had begun (done again), " << a.committed
                        << " replies it had not committed; " << a.aborted
                        << " changes it had begun failed with ECONNABORTED";
    }
  }
  // Over io_uring the device still brings FORGET and INTERRUPT: a few threads read it.
  const int rc = uring_ != nullptr ? RunSessionLoop(se_, 1, 2, stop)
                                   : RunSessionLoop(se_, min_threads, max_threads, stop);
  if (uring_ != nullptr) {
    // A handover leaves what the entries are given meanwhile to the next process.
    if (stop != nullptr && stop->load())
      uring_->Drain(/*wait_ms=*/500);
    else
      uring_->Stop();
    uring_->Join();
    uring_.reset();
  }
  return rc;
}

bool FuseSession::Exited() const { return fuse_session_exited(se_) != 0; }

void FuseSession::InvalidateInode(uint64_t ino) {
  if (Exited()) return;
  int err = fuse_lowlevel_notify_inval_inode(se_, ino, 0, 0);
  if (err != 0 && err != -ENOENT) CTFS_LOG(kWarn) << "invalidate inode " << ino << ": " << err;
}

bool FuseSession::InvalidateEntry(uint64_t parent, const std::string& name) {
  if (Exited()) return false;
  return fuse_lowlevel_notify_inval_entry(se_, parent, name.data(), name.size()) == 0;
}

}  // namespace cubetorchfs::fuse
