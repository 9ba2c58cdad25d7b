// Inode numbers for the paths the kernel knows about, with their lookup counts.
//
// Hard links share one inode: a name whose attributes carry the store's identity of a file
// (FileAttr::store_ino) with more than one link joins the live inode of that identity, if
// the table has one. Such an inode has several names; the first is the one its I/O uses, and
// when that name goes, the next takes its place.
//
// The kernel holds a reference (nlookup) for every successful lookup, create or readdirplus
// entry, and drops them with forget. An inode lives while its count is above zero; the root
// (inode 1) lives forever. Inode numbers are never reused, so a stale number the kernel might
// still send can never name another file.
//
// Each inode caches the attributes last read from the store and when, so open() can decide
// without a backend round trip whether its view of the file is fresh.
//
// Thread safety: all methods are safe to call concurrently; no lock is held while calling out.
// The nodes are split into 64 shards by inode number, each under its own mutex; the name
// indexes (path, hash, store identity) and the numbering are under a reader-writer lock,
// taken before any shard's. What the kernel sends by inode number (getattr, open, read without
// an open, setattr) takes one shard's lock; a lookup of a name the table knows takes the names
// shared and one shard; only a new name, a forget to zero, a remove or a rename takes the names
// exclusively. A node's names and its existence change only with both held.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <prometheus/gauge.h>

#include "cfs_client/backend.h"
#include "common/hash_hints.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::fs {

constexpr uint64_t kRootIno = 1;

struct InodeInfo {
  uint64_t ino = 0;
  std::string path;  // relative to the store root; "" for the root
  cfs_client::FileAttr attr;
  uint64_t attr_time_ns = 0;  // when `attr` was read from the store
  // The version of the file at its last open, to tell the kernel whether its page cache of
  // the file is still good.
  std::optional<cfs_client::FileVersion> opened_version;
  // Bumped by every change made through the mount, so a handle opened before it knows to
  // read the new version.
  uint64_t write_gen = 0;
  bool removed = false;  // unlinked or renamed over: no path leads to it any more
};

class InodeTable {
 public:
  explicit InodeTable(const cfs_client::FileAttr& root_attr, uint64_t now_ns);

  // Returns the inode of `path` (creating it), adds one lookup, and records `attr`.
  uint64_t Acquire(const std::string& path, const cfs_client::FileAttr& attr, uint64_t now_ns);

  // Drops `n` lookups of `ino`; the inode is removed when none remain. The root is ignored.
  // A forget of more lookups than the inode has, or of an unknown inode, breaks the FUSE
  // contract: it is logged and counted (bad_forgets) and the inode removed, but the daemon
  // goes on. libfuse's passthrough_hp aborts here; a shared daemon that aborts takes every
  // user's mount down for one bookkeeping error.
  void Forget(uint64_t ino, uint64_t n);
  uint64_t bad_forgets() const { return bad_forgets_.load(); }

  // A copy of the inode's state, or nothing if the kernel has forgotten it.
  std::optional<InodeInfo> Get(uint64_t ino) const;

  void SetAttr(uint64_t ino, const cfs_client::FileAttr& attr, uint64_t now_ns);
  // The attributes of `ino` are asked of the store again at the next GetAttr.
  void ExpireAttr(uint64_t ino);

  // Records that `ino` was opened at `version`; returns the version of the previous open.
  std::optional<cfs_client::FileVersion> SetOpenedVersion(uint64_t ino,
                                                          const cfs_client::FileVersion& version);

  // The live inode of `path`, if the kernel knows one.
  std::optional<uint64_t> Find(const std::string& path) const;
  // The attributes held for `path` and when they were read from the store: Find and Get in
  // one lock, with no copy of the path. Nothing for an unknown or removed path.
  struct HeldAttr {
    cfs_client::FileAttr attr;
    uint64_t attr_time_ns = 0;
  };
  std::optional<HeldAttr> AttrOf(const std::string& path) const;
  // What putting bytes into the kernel's page cache for `path` checks before and after:
  // the live inode `path` names (`ino` 0: look it up by path; else that inode, if it still
  // answers to `path`), its version and its write generation. One lock, no copy of the path.
  struct PageState {
    uint64_t ino = 0;
    cfs_client::FileVersion version;
    uint64_t write_gen = 0;
    bool regular = false;
  };
  std::optional<PageState> PageStateOf(const std::string& path, uint64_t ino = 0) const;

  // `path` was removed from the store: its inode (if any) no longer answers to the path. If
  // the inode has another name, that name is returned (and the inode's path is it now);
  // otherwise the inode is marked removed and stays only for the kernel's references.
  std::optional<std::string> Remove(const std::string& path);

  // A name of `ino` other than `path`, if the table knows one.
  std::optional<std::string> OtherName(uint64_t ino, const std::string& path) const;

  // `from` was renamed to `to`: the inode of `from` (and of everything under it, for a
  // directory) now answers to the new path; an inode of `to` is removed. Looks at the entries
  // it moves and at most one other (O(log n + moved)).
  void Rename(const std::string& from, const std::string& to);
  uint64_t rename_visits() const { return rename_visits_.load(); }  // entries looked at, ever

  // Bumps the write generation of `ino` and returns it (0 for an unknown inode).
  uint64_t BumpWriteGen(uint64_t ino);

  // This process serves the mount after `generation` earlier processes (daemon/supervisor.h):
  // new inode numbers start at generation << 40, above any number an earlier process gave
  // the kernel. A forget of an unknown number below that is an inode of an earlier process
  // that was not handed over (a crash): ignored, not a broken contract.
  void SetGeneration(uint64_t generation);

  // The whole table as bytes, and back: an upgrade hands it to the next process, so every
  // inode number the kernel holds keeps naming the same file. Restore replaces the table
  // (the root included) and fails on bytes it cannot read, leaving the table as it was.
  std::string Serialize() const;
  Status Restore(std::string_view bytes);

  size_t size() const;
  uint64_t lookups(uint64_t ino) const;  // for tests
  // Kept at size() from now on (the gauge is owned by a registry that outlives the table).
  void SetSizeGauge(prometheus::Gauge* gauge);

 private:
  struct Node {
    InodeInfo info;
    uint64_t nlookup = 0;
    std::vector<std::string> other_paths;  // its other hard links' names
  };
  struct StoreId {
    uint64_t dev = 0;
    uint64_t ino = 0;
    bool operator==(const StoreId&) const = default;
  };
  struct StoreIdHash {
    size_t operator()(const StoreId& id) const {
      return std::hash<uint64_t>()(id.ino * 0x9E3779B97F4A7C15ull ^ id.dev);
    }
  };
  static std::optional<StoreId> IdOf(const cfs_client::FileAttr& attr);
  // One node's bytes in Serialize's form.
  static void AppendNode(std::string* out, uint64_t ino, const Node& node);

  std::optional<std::string> RemoveLocked(const std::string& path) REQUIRES(names_mu_);
  // Points the name `from` of node `ino` to `to`.
  void RenameNameLocked(uint64_t ino, const std::string& from, std::string to) REQUIRES(names_mu_);
  // A node was added or erased (the size gauge follows).
  void SizeChangedLocked(int64_t delta) REQUIRES(names_mu_);

  struct Shard {
    mutable Mutex mu;
    std::unordered_map<uint64_t, Node> nodes GUARDED_BY(mu);
  };
  static constexpr size_t kShards = 64;
  Shard& ShardOf(uint64_t ino) const { return shards_[ino % kShards]; }

  std::atomic<uint64_t> bad_forgets_{0};
  std::atomic<uint64_t> rename_visits_{0};
  std::atomic<uint64_t> size_{0};
  // Numbers below were given out before (SetGeneration); read by Forget without the names.
  std::atomic<uint64_t> generation_base_{0};
  mutable std::array<Shard, kShards> shards_;
  mutable SharedMutex names_mu_;  // guards the members below; taken before any shard's
  uint64_t next_ino_ GUARDED_BY(names_mu_) = kRootIno + 1;
  prometheus::Gauge* size_gauge_ GUARDED_BY(names_mu_) = nullptr;
  // Ordered, so a directory's known descendants are one range (Rename).
  std::map<std::string, uint64_t, std::less<>> by_path_ GUARDED_BY(names_mu_);
  // Find's fast way in: a 64-bit hash of a path -> the inode last given that path. Only a
  // hint, checked against the inode's own names (two paths of one hash, or a hint left by a
  // change, fall back to by_path_); dropped with the path it was made for, so it holds no
  // more entries than by_path_. A string-ordered lookup among 1.28 M paths with long common
  // prefixes took a third of the daemon's CPU in a warm epoch.
  HashHints by_hash_ GUARDED_BY(names_mu_);
  static uint64_t PathHash(std::string_view path);
  // The live inode named `path` (of hash PathHash(path)), or nothing.
  std::optional<uint64_t> FindLocked(const std::string& path, uint64_t hash) const
      REQUIRES_SHARED(names_mu_);
  void HintLocked(const std::string& path, uint64_t ino) REQUIRES(names_mu_);
  void UnhintLocked(const std::string& path, uint64_t ino) REQUIRES(names_mu_);
  // Whether `path` is a live name of node `n`.
  static bool Names(const Node& n, std::string_view path);
  std::unordered_map<StoreId, uint64_t, StoreIdHash> by_store_id_ GUARDED_BY(names_mu_);
};

}  // namespace cubetorchfs::fs
