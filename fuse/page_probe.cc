#include "fuse/page_probe.h"

#include <unistd.h>

#include <algorithm>

namespace cubetorchfs::fuse {

PageProbe::PageProbe(fuse_session* session, uint64_t max_retrieve,
                     std::chrono::milliseconds timeout)
    : max_retrieve_(std::max<uint64_t>(max_retrieve, 4096)), timeout_(timeout),
      session_(session) {}

bool PageProbe::Resident(uint64_t ino, uint64_t size) {
  if (size == 0) return true;  // nothing to hold
  if (!Retrieve(ino, 0, std::min(size, max_retrieve_))) return false;
  if (size <= max_retrieve_) return true;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t last = (size - 1) / page * page;
  return Retrieve(ino, last, size - last);
}

bool PageProbe::Retrieve(uint64_t ino, uint64_t offset, uint64_t len) {
  std::unique_lock<std::mutex> l(mu_);
  if (session_ == nullptr) return false;
  const uint64_t cookie = next_cookie_++;
  pending_.emplace(cookie, std::nullopt);
  // The kernel answers with a request our own loop serves: it cannot arrive before the
  // cookie is registered, and the write itself does not wait for it.
  const int rc = fuse_lowlevel_notify_retrieve(session_, ino, static_cast<size_t>(len),
                                               static_cast<off_t>(offset),
                                               reinterpret_cast<void*>(cookie));
  if (rc != 0) {  // -ENOENT: the kernel has forgotten the inode, and its pages with it
    pending_.erase(cookie);
    return false;
  }
  cv_.wait_for(l, timeout_,
               [&] { return session_ == nullptr || pending_.at(cookie).has_value(); });
  const std::optional<uint64_t> got = pending_.at(cookie);
  pending_.erase(cookie);
  return got.has_value() && *got >= len;
}

void PageProbe::OnReply(void* cookie, uint64_t bytes) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = pending_.find(reinterpret_cast<uint64_t>(cookie));
  if (it == pending_.end()) return;  // answered after its caller gave up
  it->second = bytes;
  cv_.notify_all();
}

void PageProbe::Close() {
  std::lock_guard<std::mutex> l(mu_);
  session_ = nullptr;
  cv_.notify_all();
}

}  // namespace cubetorchfs::fuse
