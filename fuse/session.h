// The daemon's FUSE session: libfuse behind the few calls the daemon makes, so that daemon/
// wires components and includes no libfuse header (docs/architecture.md).
//
// Two processes use it (daemon/supervisor.h):
//   - the supervisor mounts (MountForSupervisor) and keeps the /dev/fuse descriptor for the
//     mount's life;
//   - a worker creates a session serving fs::FileSystem (Create), serves the connection the
//     supervisor holds through a clone of its descriptor (ServeClone), gives it the
//     connection's FUSE_INIT (ReadInit, ProcessInit), then runs the request loop (Serve)
//     until the mount ends or a handover stops it.
//
// Thread safety: InvalidateInode, InvalidateEntry and Exited may be called from any thread
// once ServeClone has succeeded; the rest from the thread that owns the session.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "conf/options.h"

struct fuse_session;  // libfuse's, never touched outside fuse/

namespace prometheus {
class Registry;
}

namespace cubetorchfs::fs {
class FileSystem;
}

namespace cubetorchfs::fuse {

struct FuseContext;
class PageProbe;
class UringLoop;
class UringSlots;

class FuseSession {
 public:
  // The supervisor's mount: a session with no operations, mounted at `mount_point` with the
  // mount options `argv` (libfuse's command line: {"cubetorchfs", "-o", "opts", ...});
  // returns its /dev/fuse descriptor. The session is never destroyed (that would close the
  // connection): the supervisor exits without destructors. InvalidArgument: `argv` has options
  // libfuse refuses (it printed why); IOError: the mount failed (likewise).
  static Result<int> MountForSupervisor(const std::vector<std::string>& argv,
                                        const std::string& mount_point);

  // A worker's session: the low-level operations (fuse_ops.h) over `fs`, the page probe
  // attached so that it can send retrieves and get their answers. `fs`, `page_probe` and
  // `registry` must outlive the session. InvalidArgument: `argv` has options libfuse refuses.
  static Result<std::unique_ptr<FuseSession>> Create(fs::FileSystem* fs,
                                                     const conf::FuseOptions& options,
                                                     prometheus::Registry& registry,
                                                     PageProbe* page_probe,
                                                     const std::vector<std::string>& argv);
  ~FuseSession();  // destroys the libfuse session (never reached by a worker that served)

  FuseSession(const FuseSession&) = delete;
  FuseSession& operator=(const FuseSession&) = delete;

  // libfuse's handlers of SIGTERM, SIGINT, SIGHUP (they end the session loop and so the
  // mount) and SIGPIPE. The error's message: "cannot set signal handlers".
  Status SetSignalHandlers();
  void RemoveSignalHandlers();

  // Serves the connection the supervisor mounted, `fuse_fd`, through a descriptor of this
  // process's own (FUSE_DEV_IOC_CLONE, mounted as libfuse's /dev/fd/N): when this process
  // dies, its clone closes and the requests it had taken fail at once (ECONNABORTED) instead
  // of waiting forever on the supervisor's descriptor. On failure the signal handlers are
  // removed when the mount was refused; the message says what failed, for after the mount
  // point.
  Status ServeClone(int fuse_fd);

  // The first request of a new connection, FUSE_INIT, read from it, as raw bytes (for the
  // supervisor to keep and hand to later workers).
  Result<std::string> ReadInit();
  // Chooses the connection's transport from its FUSE_INIT (`options.io_uring`, what the kernel
  // offers) before ProcessInit, and returns the copy of the INIT to keep for later processes:
  // where /dev/fuse was chosen the copy no longer offers io_uring. A `replayed` copy that
  // offers it names a connection on io_uring, which a process must go on serving that way.
  // InvalidArgument: fuse.io_uring is on and the kernel does not offer it.
  Result<std::string> PrepareInit(std::string init, bool replayed);
  // Gives the session the connection's FUSE_INIT: read by ReadInit, or a copy of an earlier
  // process's (`replayed`: the kernel sends INIT once per connection; the reply to the copy
  // finds no request and is dropped). Either way the session then knows the connection's
  // parameters.
  Status ProcessInit(std::string init, bool replayed);

  // Numbers handle tables' handles from `generation` (fs/inode_table.h's scheme), so that no
  // number the kernel holds from an earlier process names a handle of this one.
  void SetGeneration(uint64_t generation);

  // Runs the request loop (session_loop.h) until `stop` is set or the session exits (signal,
  // unmount); every request read is answered. 0, or the negative errno that ended it.
  int Serve(int min_threads, int max_threads, const std::atomic<bool>* stop);

  // "io_uring" or "/dev/fuse" once PrepareInit has chosen (docs/operations.md).
  const char* transport() const;
  // Large files are read through passthrough (fuse/passthrough.h) once PrepareInit has chosen.
  bool passthrough() const;
  // The passthrough table (fuse/passthrough.h), for the next process of the mount; "" where
  // the connection has no passthrough. SetPassthroughState: the table an earlier process
  // handed over, taken by PrepareInit.
  std::string PassthroughState() const;
  void SetPassthroughState(std::string bytes) { passthrough_state_ = std::move(bytes); }
  // The memfd of the passthrough table a process that died left (-1: none; taken by
  // PrepareInit where no state was handed over), and what to do with the memfd of the table
  // this process keeps (give it to the supervisor, which hands it to the next process).
  void SetPassthroughMemory(int fd, std::function<void(int)> on_table) {
    passthrough_memory_fd_ = fd;
    on_passthrough_memory_ = std::move(on_table);
  }
  // After a crash of the process before, on io_uring: where the queues are kicked once
  // registered (uring_loop.h). Empty: no kick.
  void SetKickPath(std::string path) { kick_path_ = std::move(path); }
  // On io_uring: the memfd of the entries an earlier process left (-1: none; taken), and what
  // to do with the memfd of entries this process creates (give it to the supervisor, which
  // hands it to the next process). See uring_loop.h.
  void SetUringMemory(int fd, std::function<void(int)> on_created) {
    uring_memory_fd_ = fd;
    on_uring_memory_ = std::move(on_created);
  }

  // The loop has stopped for good (signal, unmount): the kernel's requests go unanswered.
  bool Exited() const;
  // The kernel drops what it caches of inode `ino` (pages of all its descriptors,
  // attributes). Nothing once the session has exited: the kernel may wait on a page whose
  // read is never answered. Errors other than an inode the kernel does not know are logged.
  void InvalidateInode(uint64_t ino);
  // The kernel drops its name `name` under directory `parent` (and what is unused beneath
  // it). True if it did; false once the session has exited, or if the kernel did not know it.
  bool InvalidateEntry(uint64_t parent, const std::string& name);

 private:
  FuseSession(std::unique_ptr<FuseContext> ctx, fuse_session* se);
  Result<std::string> PrepareIoUring(std::string init, bool replayed);
  Result<std::string> PreparePassthrough(std::string init, bool replayed);

  const std::unique_ptr<FuseContext> ctx_;  // the session's userdata: outlives se_
  fuse_session* const se_;
  int fd_ = -1;  // the clone this process serves
  std::string kick_path_;
  std::string passthrough_state_;     // handed over, until PrepareInit
  bool replayed_ = false;             // the INIT was a copy: the connection was served before
  std::unique_ptr<UringLoop> uring_;  // the io_uring queues, while Serve runs them
  std::shared_ptr<UringSlots> uring_slots_;
  int uring_memory_fd_ = -1;
  std::function<void(int)> on_uring_memory_;
  int passthrough_memory_fd_ = -1;
  std::function<void(int)> on_passthrough_memory_;
};

}  // namespace cubetorchfs::fuse
