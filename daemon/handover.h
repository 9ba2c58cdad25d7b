// The worker's side of a crash and of an upgrade (supervisor.h is the supervisor's): what a new
// worker takes over from the one before it, and what it leaves for the next. The table of what
// survives which is docs/architecture.md's "What survives a crash and an upgrade".
//
// - A crash: the dead worker's inode records (AdoptRecordsOfDeadProcess) and RAM cache
//   (OpenCacheArena) are adopted from the memfds it sent (kMsgTable, kMsgCache); without its
//   records, the names the kernel holds are dropped (DropDentriesOfEarlierProcess).
// - An upgrade: Handover stops the session loop once asked (Request), and HandOver sends the
//   inode and passthrough tables, serialized and framed (FrameState), to the supervisor, which
//   executes the next binary; that one takes them (TakeHandedState) and adopts the RAM cache's
//   memfd as after a crash.
//
// Thread safety: Handover's methods may be called from any thread (the control server's, the
// supervisor channel's reader, the session loop's); the rest run on the main thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "cache/cache_arena.h"
#include "cache/disk_cache.h"
#include "cfs_client/backend.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "conf/config.h"
#include "control/control_server.h"
#include "daemon/supervisor.h"
#include "fs/file_system.h"
#include "fuse/page_probe.h"
#include "fuse/session.h"
#include "prefetch/prefetcher.h"

namespace cubetorchfs::daemon {

// Whether an upgrade was asked of this worker, and what may refuse it.
class Handover {
 public:
  // `open_writes`: the files open for writing through the mount now (their write states
  // cannot be handed on).
  explicit Handover(std::function<uint64_t()> open_writes) : open_writes_(std::move(open_writes)) {}

  // Asks the session loop to stop so that the state can go to the next binary (POST
  // /v1/admin/upgrade, or the supervisor's kMsgUpgrade). EBUSY while files are open for
  // writing, ESRCH once the supervisor is gone, EAGAIN before the loop serves. Pauses the page
  // probe first, while the loop still answers the reads its page-cache stores wait for.
  Status Request();
  // The loop stopped for a handover but a file was opened for writing meanwhile: it serves on.
  void Abandon();

  void SetProbe(fuse::PageProbe* probe);  // paused by Request, resumed by Abandon
  void Serving() { serving_.store(true); }
  void SupervisorGone() { supervisor_gone_.store(true); }
  // Set once a handover is asked: what the session loop stops on (FuseSession::Serve).
  const std::atomic<bool>* asked() const { return &asked_; }

 private:
  const std::function<uint64_t()> open_writes_;
  Mutex mu_;  // one request at a time, and around the probe's pause and resume
  fuse::PageProbe* probe_ GUARDED_BY(mu_) = nullptr;
  std::atomic<bool> asked_{false};
  std::atomic<bool> serving_{false};
  std::atomic<bool> supervisor_gone_{false};  // nobody to hand over to
};

// The state an upgrade hands on: the inode table's bytes, framed with the passthrough table
// where it has opens (a table with none keeps the form an earlier version reads).
std::string FrameState(std::string inodes, const std::string& passthrough);
// The inode table's bytes of a state handed over; `passthrough` gets the rest.
Result<std::string> UnframeState(std::string state, std::string* passthrough);

// Hands this worker's state to the supervisor (Takeover::channel_fd), which executes the next
// binary, and exits. Written bytes reach the store first; the NVMe tier's queue is written.
[[noreturn]] void HandOver(fs::FileSystem& fs, fuse::FuseSession& session,
                           prefetch::Prefetcher& prefetcher, fuse::PageProbe& page_probe,
                           std::unique_ptr<control::ControlServer>& control, cache::DiskCache* disk,
                           const Takeover& takeover);

// The next binary's side of an upgrade: the state handed over (Takeover::state_fd), if any,
// restored into `fs`'s inode table and `session`'s passthrough table. Without it (or if it
// cannot be read) the kernel's numbers answer ESTALE, as after a crash.
void TakeHandedState(fs::FileSystem& fs, fuse::FuseSession& session, const Takeover& t);

// Sends the supervisor this worker's memfds (inode records, RAM cache arena, io_uring entries,
// passthrough table) for the next worker to adopt if this one dies.
void OfferMemoryToSupervisor(fs::FileSystem& fs, fuse::FuseSession& session,
                             const cache::CacheArena* arena, const Takeover& t);

// The FUSE_INIT of the connection: read from it (the first worker, which passes a copy to the
// supervisor) or replayed from the copy.
Status StartConnection(fuse::FuseSession& session, const Takeover& t);

// After a crash with no inode records adopted: the kernel's names under the root are dropped,
// so that its next path walk looks them up here. Runs beside the session loop.
void DropDentriesOfEarlierProcess(fuse::FuseSession& session, cfs_client::Backend* store);

// Takes the inode records a worker that died left (Takeover::table_fd); false if there were
// none or they could not be read.
bool AdoptRecordsOfDeadProcess(fs::FileSystem& fs, const Takeover& t);

// The RAM cache's memory (cache/cache_arena.h): the arena the worker before left
// (Takeover::cache_fd) when it can be adopted, its published buffers in `*adopted`; else a new
// one. Null if none can be reserved (buffers then come from the heap and die with the
// process). Never freed: buffers may be let go by threads still running at exit.
cache::CacheArena* OpenCacheArena(const conf::Config& config, const Takeover& t,
                                  cache::CacheArena::Adoption* adopted);

}  // namespace cubetorchfs::daemon
