// The session's request loop: worker threads that read requests from /dev/fuse and answer
// them, in place of libfuse's fuse_session_loop_mt.
//
// libfuse stops badly for a handover: its loop drops a request a worker has just read (the
// worker sees the exit flag and returns), and fuse_session_receive_buf drops one read while
// the session was marked exited. The kernel then fails the request with ECONNABORTED (a
// cloned descriptor closed) or never answers it (the supervisor keeps the descriptor open).
// Handing the connection to the next process (daemon/supervisor.h) must lose nothing, so here
// a handover sets `stop`, not the session's exit flag: a worker checks it only between
// requests, and one blocked in read() is woken by a signal whose handler does nothing, so
// read() returns EINTR without having taken a request. Every request read is answered.
// (An exit through fuse_session_exit, as libfuse's SIGTERM handler does, ends the mount: a
// request dropped then fails when the connection closes.)
//
// Workers start at `min_threads` and grow to `max_threads` while all are busy (misses wait on
// the store); they never shrink. All read the session's one descriptor.
//
// Thread safety: Run() once at a time; Stop() from any thread.
#pragma once

#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>

#include <atomic>

namespace cubetorchfs::fuse {

// Serves `se` until `stop` is set or the session exits (fuse_session_exit, libfuse's signal
// handlers, an unmount); returns when every worker has finished its request: 0, or the
// negative errno that ended it.
int RunSessionLoop(fuse_session* se, int min_threads, int max_threads,
                   const std::atomic<bool>* stop);

}  // namespace cubetorchfs::fuse
