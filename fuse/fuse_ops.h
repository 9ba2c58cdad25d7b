// The libfuse low-level operations table: thin thunks that call FileSystem and reply.
//
// This is the one place where a Status becomes an errno for the kernel.
#pragma once

#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>

#include <atomic>
#include <memory>

#include "fs/file_system.h"
#include "fuse/handle_table.h"
#include "fuse/passthrough.h"

namespace prometheus {
class Registry;
}

namespace cubetorchfs::fuse {

// The file system these operations serve (fs/).
using fs::DirHandle;
using fs::Entry;
using fs::FileHandle;
using fs::FileSystem;
using fs::kRootIno;
using fs::OpenResult;
using fs::Owner;
using fs::ReadResult;

struct OpMetrics;
class PageProbe;

// The FUSE session's userdata: everything the thunks need. Lives for the whole session.
struct FuseContext {
  FuseContext(FileSystem* fs, const conf::FuseOptions& options, prometheus::Registry& registry);
  ~FuseContext();

  FileSystem* const fs;
  const conf::FuseOptions options;
  fuse_session* session = nullptr;  // set once after fuse_session_new
  // The kernel may skip open/release and keep its page cache (set once in init).
  bool no_open = false;
  // Requests come through FUSE over io_uring (fuse/uring_loop.h), not /dev/fuse reads: set
  // before the connection's INIT is processed; cleared if the queues cannot be set up.
  std::atomic<bool> io_uring{false};
  // The next reply written is to FUSE_INIT, and takes these flags2 bits (FUSE_OVER_IO_URING,
  // FUSE_PASSTHROUGH; session.cc).
  std::atomic<bool> patch_init{false};
  uint32_t init_flags2 = 0;
  // The connection takes passthrough opens (passthrough.h): set before INIT is processed,
  // where the connection has passthrough (even if fuse.passthrough is off now: an earlier
  // process's passthrough opens still rule what this one may answer).
  std::unique_ptr<Passthrough> passthrough;
  // Answers the kernel's retrieve replies (set once after the session starts; may be null).
  PageProbe* page_probe = nullptr;
  // The open files and directories, by the number the kernel holds (handle_table.h).
  HandleTable<FileHandle> files;
  HandleTable<DirHandle> dirs;
  std::unique_ptr<OpMetrics> metrics;
};

const fuse_lowlevel_ops& Operations();

// The passthrough metrics of the session (registered with its operations' metrics).
Passthrough::Metrics PassthroughMetrics(const FuseContext& ctx);

}  // namespace cubetorchfs::fuse
