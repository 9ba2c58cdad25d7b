// Internal to fs/: the write state of an inode being written, shared by write_path.cc and
// namespace_ops.cc (file_system.h includes it only so that its lock annotations can name the
// state's mutex). See file_system.h for the write path's contract and lock order.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cfs_client/backend.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::fs {

// The one open backend file of an inode being written, shared by all its writing handles.
struct WriteState {
  WriteState() = default;
  // A state for `file`, opened already at `path`.
  WriteState(std::unique_ptr<cfs_client::WritableFile> opened, std::string at)
      : file(std::move(opened)), path(std::move(at)) {}
  // Serializes the backend calls on `file` (held across its store requests: an upload holds it
  // for its whole length); guards file, path, writers, dirty, removed, closed and write_seq.
  Mutex mu;
  std::unique_ptr<cfs_client::WritableFile> file GUARDED_BY(mu);
  std::string path GUARDED_BY(mu);      // where the file is in the store (renames follow it)
  uint32_t writers GUARDED_BY(mu) = 0;  // tracked handles open for writing
  bool dirty GUARDED_BY(mu) = false;    // written since the last successful Flush
  bool removed GUARDED_BY(mu) = false;  // unlinked or renamed over: its bytes go nowhere
  bool closed GUARDED_BY(mu) = false;   // taken out of writes_: look the inode up again
  // Its inode was forgotten before its bytes reached the store. Guarded by
  // FileSystem::writes_mu_ (not mu: a forget marks it without waiting for an upload).
  bool orphan = false;
  // The user whose open made it (-1: unknown), counted against Options::max_writes_per_uid
  // while it is in writes_. Guarded by FileSystem::writes_mu_.
  int64_t uid = -1;
  uint64_t write_seq GUARDED_BY(mu) = 0;  // FileSystem::write_seq_ at its last change
  // Clock time of its opening or last change (read by the write-back thread without mu).
  std::atomic<uint64_t> changed_ns{0};
  // The attributes of the bytes written so far, as of the last change, open or flush: what a
  // stat answers without taking mu, which an upload holds for its whole length. Nothing once
  // closed.
  Mutex attr_mu;  // a leaf lock: guards written_attr alone
  std::optional<cfs_client::FileAttr> written_attr GUARDED_BY(attr_mu);
};

}  // namespace cubetorchfs::fs
