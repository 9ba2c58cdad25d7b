// What the prefetcher asks of the mount it serves: fresh attributes and page-resident marks
// from the inode table (AttrSource, implemented by fs::FileSystem), and whether the kernel's
// page cache holds a file, or to put one there (PageCacheProbe, implemented by
// fuse::MountPageCacheProbe). Interfaces only, so that prefetch/ includes nothing of fs/ or
// fuse/.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "cache/ram_cache.h"
#include "cfs_client/backend.h"

namespace cubetorchfs::prefetch {

// Where the prefetcher's residency checks find fresh attributes with no store request: the
// mount's inode table. Implemented by fs::FileSystem.
class AttrSource {
 public:
  virtual ~AttrSource() = default;
  // Fresh attributes the daemon holds for store path `path` (the inode table's, within
  // attr_timeout_s) and, if `fetched_ns` is not null, when they were read from the store;
  // nothing if it holds none. May be called with Prefetcher::mu_ held (taken before the inode
  // table's lock).
  virtual std::optional<cfs_client::FileAttr> FreshAttr(const std::string& path,
                                                        uint64_t* fetched_ns) const = 0;
  // The store identity (FileAttr::StoreId) of the directory the mount holds for the parent of
  // `path`, whatever the age of its attributes; 0 if it holds none. A fetch is bound to it
  // (cfs_client::Expected), and only then may its attributes answer a lookup in that directory.
  virtual uint64_t DirIdOf(const std::string& path) const {
    (void)path;
    return 0;
  }

  // The page-resident mark (ResidentMarks::Mark::Pack) kept with the inode of `path`, 0 if
  // none; and, if `fresh` is not null, its fresh attributes as FreshAttr gives them (one
  // lookup for both). A source that keeps no marks answers 0.
  virtual uint64_t MarkOf(const std::string& path,
                          std::optional<cfs_client::FileAttr>* fresh) const {
    if (fresh != nullptr) *fresh = FreshAttr(path, nullptr);
    return 0;
  }
  // Keeps `mark` with the inode of `path` (0: clears it); false if there is no such inode
  // (the kernel holds none of the file). A mark goes when the kernel forgets the inode.
  virtual bool SetMark(const std::string& path, uint64_t mark) {
    (void)path, (void)mark;
    return false;
  }
  virtual uint64_t Marks() const { return 0; }  // inodes marked now
};

// Asks the kernel whether its page cache holds a file of the mount. Implemented by
// fuse::MountPageCacheProbe (the inode table's number for the path, then fuse::PageProbe's
// FUSE_NOTIFY_RETRIEVE).
class PageCacheProbe {
 public:
  virtual ~PageCacheProbe() = default;
  // Whether the kernel's page cache holds every page of store path `path` (`size` bytes)
  // now. Called by a worker without locks held; may block briefly. Thread-safe.
  virtual bool Resident(const std::string& path, uint64_t size) = 0;
  // Puts `data`, the whole of store path `path` at `version`, into the kernel's page cache
  // (FUSE_NOTIFY_STORE), so that its readers find it there with no request to the daemon.
  // Only where the kernel knows the file's inode and was given attributes of that version;
  // true if stored. Called by a worker without locks held. Thread-safe.
  virtual bool Store(const std::string& path, const cfs_client::FileVersion& version,
                     const cache::Buffer& data) {
    (void)path, (void)version, (void)data;
    return false;
  }
};

}  // namespace cubetorchfs::prefetch
