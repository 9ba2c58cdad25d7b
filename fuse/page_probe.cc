#include "fuse/page_probe.h"

#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "fs/file_system.h"

namespace cubetorchfs::fuse {

namespace {

// libfuse's notifications on a session.
class SessionKernel final : public PageProbe::Kernel {
 public:
  explicit SessionKernel(fuse_session* session) : session_(session) {}
  int Retrieve(uint64_t ino, uint64_t offset, uint64_t len, void* cookie) override {
    return fuse_lowlevel_notify_retrieve(session_, ino, static_cast<size_t>(len),
                                         static_cast<off_t>(offset), cookie);
  }
  int Store(uint64_t ino, const char* data, size_t size) override {
    fuse_bufvec bufv = FUSE_BUFVEC_INIT(size);
    bufv.buf[0].mem = const_cast<char*>(data);  // only read
    return fuse_lowlevel_notify_store(session_, ino, 0, &bufv, FUSE_BUF_NO_SPLICE);
  }

 private:
  fuse_session* const session_;
};

}  // namespace

PageProbe::PageProbe(std::chrono::milliseconds timeout)
    : timeout_(timeout), page_(static_cast<uint64_t>(::sysconf(_SC_PAGESIZE))) {}

PageProbe::~PageProbe() = default;

void PageProbe::Attach(fuse_session* session) {
  own_ = std::make_unique<SessionKernel>(session);
  Attach(own_.get());
}

void PageProbe::Attach(Kernel* kernel) {
  MutexLock l(mu_);
  kernel_ = kernel;
}

bool PageProbe::Resident(uint64_t ino, uint64_t size) {
  if (size == 0) return true;  // nothing to hold
  if (!Retrieve(ino, 0, std::min(size, page_))) return false;
  if (size <= page_) return true;
  const uint64_t last = (size - 1) / page_ * page_;
  return Retrieve(ino, last, size - last);
}

bool PageProbe::Retrieve(uint64_t ino, uint64_t offset, uint64_t len) {
  Pending pending{CondVar(&mu_)};
  MutexLock l(mu_);
  Kernel* const kernel = kernel_;
  if (kernel == nullptr) return false;
  const uint64_t cookie = next_cookie_++;
  // Registered before the notify: the answer, a request our own loop serves, finds it.
  pending_.emplace(cookie, &pending);
  sending_++;
  l.Unlock();
  const int rc = kernel->Retrieve(ino, offset, len, reinterpret_cast<void*>(cookie));
  l.Lock();
  if (--sending_ == 0) idle_cv_.SignalAll();
  // rc -ENOENT: the kernel has forgotten the inode, and its pages with it.
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (rc == 0 && kernel_ != nullptr && !pending.bytes && pending.cv.WaitUntil(deadline)) {
  }
  pending_.erase(cookie);
  return pending.bytes.has_value() && *pending.bytes >= len;
}

bool PageProbe::Store(uint64_t ino, const char* data, size_t size) {
  MutexLock l(mu_);
  Kernel* const kernel = kernel_;
  if (kernel == nullptr) return false;
  sending_++;
  l.Unlock();
  // The kernel copies the bytes into the inode's pages and marks them up to date; it waits
  // for a page a read of the kernel's own holds locked (that read is answered by the loop).
  const int rc = kernel->Store(ino, data, size);
  l.Lock();
  if (--sending_ == 0) idle_cv_.SignalAll();
  return rc == 0;
}

void PageProbe::OnReply(void* cookie, uint64_t bytes) {
  MutexLock l(mu_);
  auto it = pending_.find(reinterpret_cast<uint64_t>(cookie));
  if (it == pending_.end()) return;  // answered after its caller gave up
  it->second->bytes = bytes;
  it->second->cv.Signal();
}

void PageProbe::Pause() {
  MutexLock l(mu_);
  if (kernel_ != nullptr) paused_ = kernel_;
  kernel_ = nullptr;
  for (auto& [cookie, pending] : pending_) pending->cv.Signal();
  while (sending_ != 0) idle_cv_.Wait();
}

void PageProbe::Resume() {
  MutexLock l(mu_);
  if (kernel_ == nullptr && paused_ != nullptr) kernel_ = paused_;
  paused_ = nullptr;
}

void PageProbe::Close() {
  MutexLock l(mu_);
  kernel_ = nullptr;
  paused_ = nullptr;
  for (auto& [cookie, pending] : pending_) pending->cv.Signal();
  while (sending_ != 0) idle_cv_.Wait();
}

bool MountPageCacheProbe::Resident(const std::string& path, uint64_t size) {
  std::optional<uint64_t> ino = fs_->inodes().Find(path);
  return ino.has_value() && probe_->Resident(*ino, size);
}

bool MountPageCacheProbe::Store(const std::string& path, const cfs_client::FileVersion& version,
                                const cache::Buffer& data) {
  if (data.size != version.size) return false;
  // (The inode's path, not one of its other names: a file with hard links is left alone.)
  std::optional<fs::InodeTable::PageState> before = fs_->inodes().PageStateOf(path);
  // Not while a read of the kernel's own of the file is being served either: the store would
  // wait for the pages that read holds locked until it is answered, and a kill -9 meanwhile
  // would leave the storing thread waiting for a reply only the dead process could send (its
  // descriptors, whose reads the kernel ends when they close, stay open while that thread
  // lives: the mount would hang). That reader is fetching the file anyway.
  if (!before || !before->regular || before->version != version || fs_->BeingWritten(before->ino) ||
      fs_->KernelReading(before->ino))
    return false;
  const uint64_t ino = before->ino;
  if (!probe_->Store(ino, data.data.get(), data.size)) return false;
  // Changed through the mount (written, renamed, removed) or refreshed to another version
  // while the bytes went to the kernel: they may be stale there, so they go again.
  std::optional<fs::InodeTable::PageState> after = fs_->inodes().PageStateOf(path, ino);
  if (!after || after->write_gen != before->write_gen || after->version != version ||
      fs_->BeingWritten(ino)) {
    if (invalidate_) invalidate_(ino);
    return false;
  }
  return true;
}

}  // namespace cubetorchfs::fuse
