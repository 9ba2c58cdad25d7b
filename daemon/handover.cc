// The worker's side of a crash and of an upgrade: handover.h.
#include "daemon/handover.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "common/logging.h"
#include "common/snapshot_bytes.h"
#include "control/control_server.h"
#include "prefetch/prefetcher.h"
#include "prefetch/resident_marks.h"

namespace cubetorchfs::daemon {

Status Handover::Request() {
  MutexLock serial(mu_);
  if (const uint64_t n = open_writes_(); n > 0)
    return Status::FromErrno(EBUSY, std::to_string(n) +
                                        " file(s) open for writing through the "
                                        "mount; upgrade once they are closed");
  if (supervisor_gone_.load())
    return Status::FromErrno(ESRCH, "the supervisor is gone: nothing can take the mount over");
  if (!serving_.load()) return Status::FromErrno(EAGAIN, "the mount is not served yet; try again");
  if (asked_.load()) return Status::OK();
  if (probe_ != nullptr) probe_->Pause();  // while the loop still answers reads
  asked_.store(true);
  CTFS_LOG(kInfo) << "handing the mount over to the next binary";
  return Status::OK();  // the loop answers what it has read, then returns
}

void Handover::Abandon() {
  MutexLock serial(mu_);
  if (probe_ != nullptr) probe_->Resume();
  asked_.store(false);
}

void Handover::SetProbe(fuse::PageProbe* probe) {
  MutexLock serial(mu_);
  probe_ = probe;
}

namespace {
constexpr uint64_t kFramedStateMagic = 0x31455453'53465443ull;  // "CTFSSTE1"
}  // namespace

std::string FrameState(std::string inodes, const std::string& passthrough) {
  if (passthrough.empty()) return inodes;
  std::string out;
  PutU64(&out, kFramedStateMagic);
  PutString(&out, inodes);
  PutString(&out, passthrough);
  return out;
}

Result<std::string> UnframeState(std::string state, std::string* passthrough) {
  SnapshotReader r(state);
  uint64_t magic = 0;
  if (!r.U64(&magic) || magic != kFramedStateMagic) return state;
  std::string inodes;
  if (!r.String(&inodes) || !r.String(passthrough) || !r.done())
    return Status::InvalidArgument("state handed over: truncated");
  return inodes;
}

[[noreturn]] void HandOver(fs::FileSystem& fs, fuse::FuseSession& session,
                           prefetch::Prefetcher& prefetcher, fuse::PageProbe& page_probe,
                           std::unique_ptr<control::ControlServer>& control, cache::DiskCache* disk,
                           const Takeover& takeover) {
  const std::string state = FrameState(fs.inodes().Serialize(), session.PassthroughState());
  fs.StopWriteBack();
  prefetcher.SetPageProbe(nullptr);
  page_probe.Close();
  if (Status s = fs.FlushAll(); !s.ok())
    CTFS_LOG(kError) << "some written bytes did not reach the store: " << s.ToString();
  control.reset();          // the next process binds the socket again
  if (disk) disk->Flush();  // what is queued reaches the NVMe tier, which the next one opens
  Result<int> memfd = MemfdWith("cubetorchfs-state", state);
  if (!memfd.ok() || !SendMessage(takeover.channel_fd, kMsgState, "", *memfd)) {
    // Without its state the next process still serves the mount, as after a crash.
    CTFS_LOG(kError) << "state not handed over: "
                     << (memfd.ok() ? std::string(std::strerror(errno))
                                    : memfd.status().ToString());
  }
  CTFS_LOG(kInfo) << "handed over " << fs.inodes().size() << " inodes (" << state.size()
                  << " bytes); exiting";
  std::_Exit(0);
}

void TakeHandedState(fs::FileSystem& fs, fuse::FuseSession& session, const Takeover& t) {
  if (t.state_fd < 0) return;
  Result<std::string> state = ReadAllFd(t.state_fd);
  ::close(t.state_fd);
  std::string passthrough;
  if (state.ok()) state = UnframeState(std::move(*state), &passthrough);
  Status restored = state.ok() ? fs.inodes().Restore(*state) : state.status();
  if (restored.ok()) session.SetPassthroughState(std::move(passthrough));
  if (!restored.ok())  // the kernel's inode numbers then get ESTALE, as after a crash
    CTFS_LOG(kError) << "state handed over not used: " << restored.ToString();
  else
    CTFS_LOG(kInfo) << "took over " << fs.inodes().size() << " inodes";
}

void OfferMemoryToSupervisor(fs::FileSystem& fs, fuse::FuseSession& session,
                             const cache::CacheArena* arena, const Takeover& t) {
  if (t.channel_fd >= 0 && fs.inodes().durable_fd() >= 0 &&
      !SendMessage(t.channel_fd, kMsgTable, "", fs.inodes().durable_fd()))
    CTFS_LOG(kWarn) << "the supervisor did not take the inode records: after a crash of this "
                       "process, descriptors opened before it answer ESTALE";
  if (t.channel_fd >= 0 && arena != nullptr && arena->fd() >= 0 &&
      !SendMessage(t.channel_fd, kMsgCache, "", arena->fd()))
    CTFS_LOG(kWarn) << "the supervisor did not take the RAM cache: after a crash of this "
                       "process, what it holds is fetched again";
  // On io_uring, the entries live in a memfd the supervisor keeps for the next process.
  session.SetUringMemory(t.ring_fd, [fd = t.channel_fd](int memfd) {
    if (fd >= 0 && !SendMessage(fd, kMsgRing, "", memfd))
      CTFS_LOG(kWarn) << "the supervisor did not take the io_uring entries: a crash of this "
                         "process leaves the requests it holds unanswered";
  });
  // The passthrough table, likewise: after a crash the kernel's passthrough opens live on.
  session.SetPassthroughMemory(t.passthrough_fd, [fd = t.channel_fd](int memfd) {
    if (fd >= 0 && !SendMessage(fd, kMsgPassthrough, "", memfd))
      CTFS_LOG(kWarn) << "the supervisor did not take the passthrough table: after a crash of "
                         "this process, files held through passthrough fail to open (EIO) "
                         "until those opens close";
  });
}

Status StartConnection(fuse::FuseSession& session, const Takeover& t) {
  if (t.init_fd >= 0) {
    CTFS_ASSIGN_OR_RETURN(std::string init, ReadAllFd(t.init_fd));
    ::close(t.init_fd);
    CTFS_ASSIGN_OR_RETURN(init, session.PrepareInit(std::move(init), /*replayed=*/true));
    return session.ProcessInit(std::move(init), /*replayed=*/true);
  }
  CTFS_ASSIGN_OR_RETURN(std::string init, session.ReadInit());
  // The copy the supervisor keeps records the transport chosen (FuseSession::PrepareInit).
  CTFS_ASSIGN_OR_RETURN(init, session.PrepareInit(std::move(init), /*replayed=*/false));
  if (t.channel_fd >= 0) SendMessage(t.channel_fd, kMsgInit, init);
  return session.ProcessInit(std::move(init), /*replayed=*/false);
}

void DropDentriesOfEarlierProcess(fuse::FuseSession& session, cfs_client::Backend* store) {
  constexpr size_t kMaxNames = 1u << 20;
  constexpr size_t kPage = 4096;  // the root is read a page at a time, never held whole
  size_t dropped = 0, listed = 0;
  Result<std::unique_ptr<cfs_client::DirLister>> lister = store->ListPages("");
  Status failed = lister.status();
  for (bool last = !lister.ok(); !last && dropped < kMaxNames && !session.Exited();) {
    Result<cfs_client::DirPage> page = (*lister)->Next(kPage);
    if (!page.ok()) {
      failed = page.status();
      break;
    }
    last = page->last;
    listed += page->entries.size();
    for (const cfs_client::DirEntry& e : page->entries) {
      if (dropped == kMaxNames || session.Exited()) break;
      if (session.InvalidateEntry(fs::kRootIno, e.name)) ++dropped;
    }
  }
  if (!failed.ok()) {
    CTFS_LOG(kWarn) << "after the restart, cannot list the store's root to drop the kernel's "
                    << "old names (they expire after fuse.entry_timeout_s): " << failed.ToString();
    if (listed == 0) return;
  }
  CTFS_LOG(kInfo) << "after the restart, the kernel dropped " << dropped << " of " << listed
                  << " names under the root listed, which it had from the process before";
}

bool AdoptRecordsOfDeadProcess(fs::FileSystem& fs, const Takeover& t) {
  if (t.table_fd < 0) return false;
  if (t.state_fd >= 0) {  // a handover: the state is what counts
    ::close(t.table_fd);
    return false;
  }
  const auto start = std::chrono::steady_clock::now();
  Result<fs::InodeTable::Adopted> a =
      fs.inodes().AdoptDurable(t.table_fd, prefetch::ResidentMarks::Mark::OfEarlierProcess);
  if (!a.ok()) {
    CTFS_LOG(kWarn) << "the inode records of the process before are not used ("
                    << a.status().ToString()
                    << "): files it had opened answer ESTALE and are looked up again";
    return false;
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  CTFS_LOG(kInfo) << "after the crash, kept " << a->records
                  << " inode records of the process before in " << static_cast<int>(ms) << " ms ("
                  << a->dropped << " dropped: being changed when it died, or "
                  << "unreadable; " << a->expired << " with attributes to read again)";
  return true;
}

cache::CacheArena* OpenCacheArena(const conf::Config& config, const Takeover& t,
                                  cache::CacheArena::Adoption* adopted) {
  if (!config.cache.durable) {
    if (t.cache_fd >= 0) ::close(t.cache_fd);
    return nullptr;
  }
  // After a crash, and after a handover (the process before ended with _Exit, as a crash
  // does: its arena is whole at every instruction).
  if (t.cache_fd >= 0) {
    const auto start = std::chrono::steady_clock::now();
    Result<std::unique_ptr<cache::CacheArena>> a = cache::CacheArena::Adopt(t.cache_fd, adopted);
    if (a.ok()) {
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      CTFS_LOG(kInfo) << (t.state_fd >= 0 ? "after the upgrade" : "after the crash") << ", found "
                      << adopted->entries.size() << " cached chunks (" << (adopted->bytes >> 20)
                      << " MiB) of the process before in " << static_cast<int>(ms) << " ms ("
                      << adopted->dropped << " dropped: unreadable)";
      return a->release();
    }
    adopted->entries.clear();
    CTFS_LOG(kWarn) << "the RAM cache of the process before is not used (" << a.status().ToString()
                    << "): what it held is fetched again";
  }
  Result<std::unique_ptr<cache::CacheArena>> a =
      cache::CacheArena::Create(cache::CacheArena::ReserveFor(config.cache.memory_bytes));
  if (!a.ok()) {
    CTFS_LOG(kWarn) << "no memory reserved for the RAM cache (" << a.status().ToString()
                    << "): it comes from the heap and does not outlive this process";
    return nullptr;
  }
  return a->release();
}

}  // namespace cubetorchfs::daemon
