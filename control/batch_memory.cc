#include "control/batch_memory.h"

#include <fcntl.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <unordered_set>
#include <utility>

#include "common/clock.h"
#include "common/logging.h"

namespace cubetorchfs::control {

namespace {

constexpr uint64_t kPage = 4096;

std::string Mib(uint64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

}  // namespace

uint64_t BatchMemory::Charge(uint64_t bytes) {
  return std::max(kPage, (bytes + kPage - 1) / kPage * kPage);
}

BatchMemory::BatchMemory(Options options)
    : options_(std::move(options)), inotify_fd_(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) {
  if (inotify_fd_ < 0)
    CTFS_LOG(kWarn) << "inotify_init1: " << std::strerror(errno)
                    << ": /v1/files/batch is refused (its memory files could not be followed)";
}

BatchMemory::~BatchMemory() {
  if (inotify_fd_ >= 0) ::close(inotify_fd_);
}

void BatchMemory::ReleaseLocked(uid_t uid, uint64_t bytes) {
  all_.bytes -= std::min(bytes, all_.bytes);
  all_.files -= std::min<uint64_t>(1, all_.files);
  auto it = by_uid_.find(uid);
  if (it == by_uid_.end()) return;
  it->second.bytes -= std::min(bytes, it->second.bytes);
  it->second.files -= std::min<uint64_t>(1, it->second.files);
  if (it->second.files == 0) by_uid_.erase(it);
}

void BatchMemory::ReapLocked() {
  if (inotify_fd_ < 0) return;
  alignas(inotify_event) char buf[16 << 10];
  bool overflow = false;
  for (;;) {
    const ssize_t n = ::read(inotify_fd_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EAGAIN: nothing more
    for (const char* p = buf; p < buf + n;) {
      inotify_event e;
      std::memcpy(&e, p, sizeof e);
      p += sizeof e + e.len;
      if (e.mask & IN_Q_OVERFLOW) overflow = true;
      // IN_IGNORED: the watch is gone, with the file's last reference (IN_DELETE_SELF comes
      // just before it).
      if ((e.mask & IN_IGNORED) == 0) continue;
      auto it = watched_.find(e.wd);
      if (it == watched_.end()) continue;
      ReleaseLocked(it->second.uid, it->second.bytes);
      watched_.erase(it);
    }
  }
  if (overflow) (void)ReconcileLocked();
}

uint64_t BatchMemory::ReconcileLocked() {
  // Each live watch is a line "inotify wd:<hex> ino:... " of the descriptor's fdinfo.
  std::ifstream in("/proc/self/fdinfo/" + std::to_string(inotify_fd_));
  if (!in) return 0;  // keep the charges: a charge never goes before its pages
  std::unordered_set<int> live;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("inotify wd:", 0) != 0) continue;
    live.insert(static_cast<int>(std::strtol(line.c_str() + 11, nullptr, 16)));
  }
  uint64_t gone = 0;
  for (auto it = watched_.begin(); it != watched_.end();) {
    if (live.count(it->first) != 0) {
      ++it;
      continue;
    }
    gone += it->second.bytes;
    ReleaseLocked(it->second.uid, it->second.bytes);
    it = watched_.erase(it);
  }
  return gone;
}

uint64_t BatchMemory::AvailableLocked(uint64_t bytes) {
  const uint64_t now = SystemClock()->NowNanos();
  if (bytes > options_.fresh_above || reading_at_ns_ == 0 ||
      now - reading_at_ns_ >= options_.reading_ns) {
    reading_ = options_.available ? options_.available() : 0;
    reading_at_ns_ = now;
    taken_since_ = 0;
  }
  return reading_ - std::min(reading_, taken_since_);
}

bool BatchMemory::Take(uid_t uid, uint64_t bytes, Refusal* why) {
  const uint64_t charge = Charge(bytes);
  MutexLock l(mu_);
  ReapLocked();
  if (inotify_fd_ < 0) {
    *why = {true,
            "the daemon cannot follow batch memory files (no inotify): read the files "
            "through the mount"};
    return true;
  }
  const Use mine = by_uid_.count(uid) != 0 ? by_uid_[uid] : Use{};
  if (mine.bytes + charge > options_.bytes_per_uid) {
    *why = {false,
            "this user's batch memory files still held would take more than "
            "control.batch_memory_bytes_per_uid (" +
                std::to_string(options_.bytes_per_uid) + " bytes): " + std::to_string(mine.files) +
                " files of " + std::to_string(mine.bytes) +
                " bytes are mapped or open, this batch needs " + std::to_string(charge) +
                "; close or unmap them, or read through the mount"};
    return true;
  }
  if (mine.files + 1 > options_.files_per_uid || all_.files + 1 > options_.files) {
    *why = {false, "too many batch memory files still held: " + std::to_string(mine.files) +
                       " of this user (at most " + std::to_string(options_.files_per_uid) + "), " +
                       std::to_string(all_.files) + " of all users (at most " +
                       std::to_string(options_.files) + "); close or unmap them"};
    return true;
  }
  // Outstanding memory files are resident (shmem, no swap to go to) and so not in the memory
  // left: together with this one they may take half of what there would be without them, so
  // that batches never take the last of it however many come (a share of what is left would,
  // one batch after another).
  const uint64_t avail = AvailableLocked(charge);
  if (avail != 0 && 2 * (all_.bytes + charge) > avail + all_.bytes) {
    *why = {true, "not enough free memory for a batch of " + std::to_string(bytes) + " bytes (" +
                      Mib(avail) + " left, " + Mib(all_.bytes) +
                      " held by batch memory files, which may take half): read it through the "
                      "mount"};
    return true;
  }
  Use& u = by_uid_[uid];
  u.bytes += charge;
  u.files++;
  all_.bytes += charge;
  all_.files++;
  taken_since_ += charge;
  return false;
}

void BatchMemory::Give(uid_t uid, uint64_t bytes) {
  MutexLock l(mu_);
  ReleaseLocked(uid, Charge(bytes));
}

Status BatchMemory::Follow(uid_t uid, uint64_t bytes, int fd) {
  const uint64_t charge = Charge(bytes);
  MutexLock l(mu_);
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const int wd =
      inotify_fd_ < 0 ? -1 : ::inotify_add_watch(inotify_fd_, path.c_str(), IN_DELETE_SELF);
  if (wd < 0) {
    const int err = inotify_fd_ < 0 ? ENOSYS : errno;
    ReleaseLocked(uid, charge);
    return Status::IOError(std::string("following the batch's memory file (inotify_add_watch: ") +
                           std::strerror(err) +
                           (err == ENOSPC ? "; see fs.inotify.max_user_watches" : "") + ")");
  }
  // A watch descriptor is not reused while the kernel cycles through 2^31 of them, but were
  // it, the file it named is gone (its IN_IGNORED not read yet): its charge goes.
  if (auto old = watched_.find(wd); old != watched_.end()) {
    ReleaseLocked(old->second.uid, old->second.bytes);
    watched_.erase(old);
  }
  watched_.emplace(wd, Held{uid, charge});
  return Status::OK();
}

uint64_t BatchMemory::bytes(uid_t uid) {
  MutexLock l(mu_);
  ReapLocked();
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? 0 : it->second.bytes;
}

uint64_t BatchMemory::bytes() {
  MutexLock l(mu_);
  ReapLocked();
  return all_.bytes;
}

uint64_t BatchMemory::files() {
  MutexLock l(mu_);
  ReapLocked();
  return all_.files;
}

uint64_t BatchMemory::ReconcileForTest() {
  MutexLock l(mu_);
  return ReconcileLocked();
}

}  // namespace cubetorchfs::control
