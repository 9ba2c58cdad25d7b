// The supervisor: a small parent process that holds the mount's FUSE connection for the
// process serving it (the worker), so that neither an upgrade nor a crash of the worker ends
// the mount. The worker's side is daemon/handover.h; docs/architecture.md's "What survives a
// crash and an upgrade" is the one table of what each keeps.
//
//   cubetorchfs -c CONFIG MNT
//     └ supervisor: mounts (the /dev/fuse descriptor stays open here), starts the worker,
//       waits. It loads no backend and holds no cache: a few MiB.
//         └ worker: `cubetorchfs ... --takeover fuse=N,channel=M,generation=G[,init=I][,state=S]`,
//           the whole daemon, serving the connection it inherited (libfuse's /dev/fd/N mount).
//
// The kernel sends FUSE_INIT once per connection. The first worker reads it itself and hands
// a copy to the supervisor; every later worker replays that copy into its own libfuse session
// (the reply goes nowhere), so it knows the connection's parameters without a new INIT.
//
// - Worker killed (kill -9, a crash, the OOM killer): the supervisor starts a new worker on
//   the same connection at the next generation. Requests the kernel had queued wait for it;
//   those the dead worker was handling fail with ECONNABORTED (each worker reads through a
//   clone of the descriptor, which the kernel closes with it; it aborts nothing else). The new
//   worker adopts the memfds the dead one sent (kMsgTable, kMsgCache, kMsgRing,
//   kMsgPassthrough): the inode numbers the kernel holds go on naming their files, the RAM
//   cache is cached again, the io_uring entries and passthrough opens live on. Numbers it
//   cannot adopt answer ESTALE, on which the kernel looks the path up again. Lost: bytes
//   written but not yet flushed (such files are dropped: ESTALE), the handles' read state and
//   the prefetch plans (the hook publishes again). The NVMe tier is kept (it recovers at
//   start). A worker whose main
//   thread has ended while another is held in the kernel (a page-cache store waiting for a
//   read that only the next worker can answer: fuse/page_probe.h) is taken as dead after
//   5 s with its channel closed and the connection alive, and the next one starts; the old
//   one is reaped when it ends.
// - Upgrade (`cubetorchfs upgrade MNT`, or SIGUSR2 to the supervisor): the worker lets the
//   page-cache stores under way finish while it still serves (each may wait for a read the
//   loop answers), stops taking requests, finishes those it is handling, and hands its inode
//   and passthrough tables, serialized (kMsgState), to the supervisor, which executes the
//   installed binary in its own place (same pid) and starts a new worker with them, the RAM
//   cache's memfd and the io_uring entries'. Every inode number the kernel holds keeps naming its
//   file; files opened before are read at their current version. Refused while a file is open for
//   writing.
// - Worker exits 0 (the mount was unmounted, or SIGTERM): the supervisor unmounts and exits 0.
// - Supervisor gets SIGTERM/SIGINT/SIGHUP: it passes SIGTERM to the worker, waits for it,
//   unmounts and exits with its status.
// - More than kMaxRestarts crashes within kRestartWindowS: the supervisor unmounts and exits 1.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "conf/config.h"
#include "daemon/command_line.h"

namespace cubetorchfs::daemon {

constexpr int kMaxRestarts = 5;
constexpr double kRestartWindowS = 60;

// The supervisor's budget of restarts after crashes: kMaxRestarts within any kRestartWindowS,
// the first at once, the next after 0.25, 0.5, 1 and 2 s, so that a worker failing at start
// does not spend the budget in a few milliseconds. Not thread-safe (the supervisor's loop).
class RestartBudget {
 public:
  // A crash at `now_s` (seconds on a steady clock): how long to wait before the next worker,
  // or nothing once the budget is spent (the supervisor then unmounts and exits 1).
  std::optional<double> OnCrash(double now_s);

 private:
  std::vector<double> restarts_;  // when the restarts within the window were made
};

// Messages on the supervisor-worker channel (a SOCK_SEQPACKET socket pair): one byte of kind,
// then the payload.
enum ChannelMessage : char {
  kMsgInit = 'I',         // worker -> supervisor: the raw FUSE_INIT request
  kMsgReady = 'R',        // worker -> supervisor: the mount is served
  kMsgState = 'S',        // worker -> supervisor: handed over; a memfd of the state is attached
  kMsgUpgrade = 'U',      // supervisor -> worker: hand over (SIGUSR2 reached the supervisor)
  kMsgRing = 'Q',         // worker -> supervisor: the memfd of its io_uring entries (uring_loop.h)
  kMsgTable = 'T',        // worker -> supervisor: the memfd of its inode records (fs/inode_table.h)
  kMsgCache = 'C',        // worker -> supervisor: the memfd of its RAM cache (cache/cache_arena.h)
  kMsgPassthrough = 'P',  // worker -> supervisor: the memfd of its passthrough table
};

// What a worker is given by its supervisor (parsed from --takeover).
struct Takeover {
  int fuse_fd = -1;
  int channel_fd = -1;
  uint64_t generation = 0;
  int init_fd = -1;   // a memfd holding the raw FUSE_INIT; -1: the worker reads it
  int state_fd = -1;  // a memfd holding the state handed over; -1: none
  // The listening sockets, bound once before the mount (control::BindListeners) and kept by
  // the supervisor for every worker; -1: none (the worker binds its own).
  int unix_fd = -1;
  int prof_fd = -1;
  int metrics_fd = -1;
  // The memfd of the io_uring entries of the processes before (fuse/uring_loop.h); -1: none.
  int ring_fd = -1;
  // The memfd of the inode records of the process before, which died (no state handed over):
  // the next adopts them (fs/inode_table.h); -1: none. The supervisor hands it on once: a
  // worker that dies before sending it back (kMsgTable) leaves the next one without it.
  int table_fd = -1;
  // The memfd of the RAM cache of the process before (which died, or handed over): the next
  // adopts what it had cached (cache/cache_arena.h); -1: none. Handed on once, as table_fd.
  int cache_fd = -1;
  // The memfd of the passthrough table of the process before, which died (fuse/passthrough.h):
  // the inodes the kernel has opens of, and their registrations; -1: none. Handed to every
  // worker after a crash (its entries are checked one by one; none can kill the reader).
  int passthrough_fd = -1;
};
Result<Takeover> ParseTakeover(const std::string& spec);

// The daemon's command line for a worker or a re-executed supervisor: `argv` without any
// --takeover / --resume of its own.
std::vector<std::string> BaseArgv(const std::vector<std::string>& argv);

// Reads a whole memfd (or file) from offset 0.
Result<std::string> ReadAllFd(int fd);
// A sealed-for-nothing memfd holding `bytes` (close-on-exec cleared by whoever passes it).
Result<int> MemfdWith(const std::string& name, const std::string& bytes);

// Unmounts (lazily) the mount at `mount_point`: umount2 as root, else fusermount3 -u -z.
void UnmountPath(const std::string& mount_point);

// Sends a message with an optional descriptor; returns false on failure.
bool SendMessage(int sock, ChannelMessage kind, const std::string& payload, int fd = -1);

// Runs the supervisor until the mount ends; returns the exit status. `ready_fd` is the
// daemonizing parent's pipe (-1 in the foreground); `fuse_fd` the mounted connection;
// `listeners` the listening sockets every worker gets (the fields of Takeover; the unix
// socket's file is removed when the mount ends). `resume`: a supervisor executed by an
// upgrade, with the INIT copy and the state (--resume).
int Supervise(const conf::Config& config, const CommandLine& cl, const std::string& exe,
              const std::vector<std::string>& argv, int ready_fd, int fuse_fd,
              const Takeover& listeners, const Takeover* resume);

}  // namespace cubetorchfs::daemon
