#include "fuse/page_probe.h"

#define FUSE_USE_VERSION 314
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/close_range.h>
#include <linux/fuse.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "fs/file_system.h"

namespace cubetorchfs::fuse {

PageProbe::PageProbe(std::chrono::milliseconds timeout)
    : timeout_(timeout), page_(static_cast<uint64_t>(::sysconf(_SC_PAGESIZE))) {}

void PageProbe::Attach(fuse_session* session) {
  std::lock_guard<std::mutex> l(mu_);
  session_ = session;
}

bool PageProbe::Resident(uint64_t ino, uint64_t size) {
  if (size == 0) return true;  // nothing to hold
  if (!Retrieve(ino, 0, std::min(size, page_))) return false;
  if (size <= page_) return true;
  const uint64_t last = (size - 1) / page_ * page_;
  return Retrieve(ino, last, size - last);
}

bool PageProbe::Retrieve(uint64_t ino, uint64_t offset, uint64_t len) {
  Pending pending;
  std::unique_lock<std::mutex> l(mu_);
  fuse_session* const session = session_;
  if (session == nullptr) return false;
  const uint64_t cookie = next_cookie_++;
  // Registered before the notify: the answer, a request our own loop serves, finds it.
  pending_.emplace(cookie, &pending);
  sending_++;
  l.unlock();
  const int rc =
      fuse_lowlevel_notify_retrieve(session, ino, static_cast<size_t>(len),
                                    static_cast<off_t>(offset), reinterpret_cast<void*>(cookie));
  l.lock();
  if (--sending_ == 0) idle_cv_.notify_all();
  // rc -ENOENT: the kernel has forgotten the inode, and its pages with it.
  if (rc == 0)
    pending.cv.wait_for(l, timeout_, [&] { return session_ == nullptr || pending.bytes; });
  pending_.erase(cookie);
  return pending.bytes.has_value() && *pending.bytes >= len;
}

PageProbe::~PageProbe() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_stores_ = true;
  }
  store_cv_.notify_all();
  if (store_thread_.joinable()) store_thread_.join();
}

bool PageProbe::StartStores(int connection_fd) {
  std::lock_guard<std::mutex> l(mu_);
  if (storing_) return true;
  try {
    store_thread_ = std::thread([this, connection_fd] { StoreLoop(connection_fd); });
  } catch (const std::system_error&) {
    return false;
  }
  storing_ = true;
  return true;
}

void PageProbe::StoreLoop(int connection_fd) {
  // A table of descriptors of this thread's own, holding one clone of the connection that no
  // request is read from (above). Nothing below may log or open a file: descriptor numbers
  // of the rest of the process mean nothing here.
  int fd = -1;
  if (::unshare(CLONE_FILES) == 0) {
    fd = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
    uint32_t source = static_cast<uint32_t>(connection_fd);
    if (fd >= 0 && ::ioctl(fd, FUSE_DEV_IOC_CLONE, &source) != 0) {
      ::close(fd);
      fd = -1;
    }
    if (fd >= 0) {
      if (fd > 0) ::syscall(SYS_close_range, 0u, static_cast<unsigned>(fd - 1), 0u);
      ::syscall(SYS_close_range, static_cast<unsigned>(fd + 1), ~0u, 0u);
    }
  }
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    store_cv_.wait(l, [&] { return stop_stores_ || !store_jobs_.empty(); });
    if (store_jobs_.empty()) break;
    StoreJob* job = store_jobs_.front();
    store_jobs_.pop_front();
    l.unlock();
    bool ok = false;
    if (fd >= 0) {
      fuse_out_header out{};
      fuse_notify_store_out store{};
      out.len = static_cast<uint32_t>(sizeof out + sizeof store + job->size);
      out.error = FUSE_NOTIFY_STORE;
      store.nodeid = job->ino;
      store.size = static_cast<uint32_t>(job->size);
      iovec iov[3] = {
          {&out, sizeof out}, {&store, sizeof store}, {const_cast<char*>(job->data), job->size}};
      ssize_t n;
      do n = ::writev(fd, iov, 3);
      while (n < 0 && errno == EINTR);
      ok = n == static_cast<ssize_t>(out.len);
    }
    l.lock();
    job->ok = ok;
    job->done = true;
    done_cv_.notify_all();
  }
  // Jobs queued after the stop was asked for are answered as failed.
  for (StoreJob* job : store_jobs_) job->done = true;
  store_jobs_.clear();
  done_cv_.notify_all();
  if (fd >= 0) ::close(fd);
}

void PageProbe::Pause() {
  std::unique_lock<std::mutex> l(mu_);
  if (session_ != nullptr) paused_ = session_;
  session_ = nullptr;
  for (auto& [cookie, pending] : pending_) pending->cv.notify_one();
  idle_cv_.wait(l, [&] { return sending_ == 0; });
}

void PageProbe::Resume() {
  std::lock_guard<std::mutex> l(mu_);
  if (session_ == nullptr && paused_ != nullptr) session_ = paused_;
  paused_ = nullptr;
}

bool PageProbe::Store(uint64_t ino, const char* data, size_t size) {
  std::unique_lock<std::mutex> l(mu_);
  fuse_session* const session = session_;
  if (session == nullptr) return false;
  sending_++;
  if (storing_ && !stop_stores_) {
    StoreJob job;
    job.ino = ino;
    job.data = data;
    job.size = size;
    store_jobs_.push_back(&job);
    store_cv_.notify_one();
    done_cv_.wait(l, [&] { return job.done; });
    if (--sending_ == 0) idle_cv_.notify_all();
    return job.ok;
  }
  l.unlock();
  fuse_bufvec bufv = FUSE_BUFVEC_INIT(size);
  bufv.buf[0].mem = const_cast<char*>(data);  // only read
  // The kernel copies the bytes into the inode's pages and marks them up to date; it waits
  // for a page a read of the kernel's own holds locked (that read is answered by the loop).
  const int rc = fuse_lowlevel_notify_store(session, ino, 0, &bufv, FUSE_BUF_NO_SPLICE);
  l.lock();
  if (--sending_ == 0) idle_cv_.notify_all();
  return rc == 0;
}

void PageProbe::OnReply(void* cookie, uint64_t bytes) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = pending_.find(reinterpret_cast<uint64_t>(cookie));
  if (it == pending_.end()) return;  // answered after its caller gave up
  it->second->bytes = bytes;
  it->second->cv.notify_one();
}

void PageProbe::Close() {
  std::unique_lock<std::mutex> l(mu_);
  session_ = nullptr;
  paused_ = nullptr;
  for (auto& [cookie, pending] : pending_) pending->cv.notify_one();
  idle_cv_.wait(l, [&] { return sending_ == 0; });
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
  if (!before || !before->regular || before->version != version || fs_->BeingWritten(before->ino))
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
