#include "fuse/session.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/logging.h"
#include "fuse/fuse_ops.h"
#include "fuse/page_probe.h"
#include "fuse/session_loop.h"

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
  // libfuse takes a mounted /dev/fuse descriptor as /dev/fd/N.
  std::string fd_mount = "/dev/fd/";
  fd_mount += std::to_string(*clone);
  if (fuse_session_mount(se_, fd_mount.c_str()) != 0) {
    RemoveSignalHandlers();
    return Status::IOError("cannot serve the mount (see the line above)");
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
  return RunSessionLoop(se_, min_threads, max_threads, stop);
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
