#include "fs/file_system.h"

#include <fcntl.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "cache/tiers.h"
#include "common/heap_trim.h"
#include "common/logging.h"

namespace cubetorchfs::fs {

namespace {

// A quarter of this process's descriptor limit (RLIMIT_NOFILE's soft limit), at least 16.
uint64_t QuarterOfFdLimit() {
  struct rlimit rl;
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 1024;
  return std::max<uint64_t>(16, rl.rlim_cur / 4);
}

}  // namespace

size_t ReadResult::size() const {
  size_t n = 0;
  for (const auto& s : slices) n += s.length;
  if (store) n += store->length;
  return n;
}

Result<std::unique_ptr<FileSystem>> FileSystem::New(const Options& options,
                                                    cfs_client::Backend* backend,
                                                    cache::RamCache* cache,
                                                    prefetch::Prefetcher* prefetcher, Clock* clock,
                                                    prometheus::Registry& registry,
                                                    cache::DiskCache* disk) {
  Result<cfs_client::FileAttr> root = backend->Stat("");
  cfs_client::FileAttr root_attr;
  if (root.ok()) {
    if (!root->IsDir()) return Status::NotDirectory("the store's root is not a directory");
    root_attr = root.value();
  } else if (root.status().code() == Status::Code::kIOError) {
    // A flaky store must not stop the mount: serve a plain directory until getattr
    // succeeds, and let each operation report its own error meanwhile.
    CTFS_LOG(kWarn) << "store root not readable yet: " << root.status().ToString();
    root_attr.mode = S_IFDIR | 0755;
    root_attr.nlink = 2;
  } else {
    return root.status();
  }
  return std::unique_ptr<FileSystem>(
      new FileSystem(options, backend, cache, prefetcher, clock, registry, root_attr, disk));
}

FileSystem::FileSystem(const Options& options, cfs_client::Backend* backend, cache::RamCache* cache,
                       prefetch::Prefetcher* prefetcher, Clock* clock,
                       prometheus::Registry& registry, const cfs_client::FileAttr& root_attr,
                       cache::DiskCache* disk)
    : options_(options),
      backend_(backend),
      cache_(cache),
      prefetcher_(prefetcher),
      disk_(disk),
      stream_admission_(options.stream_ghost_chunks),
      stream_fds_(options.stream_fds_per_uid,
                  options.stream_fds != 0 ? options.stream_fds : QuarterOfFdLimit()),
      dir_memory_(
          std::make_shared<UserBudget>(options.dir_memory_bytes / 2, options.dir_memory_bytes)),
      clock_(clock),
      inodes_(root_attr, clock->NowNanos()),
      writes_by_uid_(options.max_writes_per_uid, UINT64_MAX) {
  auto& bytes = prometheus::BuildCounter()
                    .Name("cubetorchfs_read_bytes_total")
                    .Help("Bytes returned by FUSE reads, by where they came from")
                    .Register(registry);
  bytes_ram_ = &bytes.Add({{"source", "ram"}});
  bytes_disk_ = &bytes.Add({{"source", "disk"}});
  bytes_backend_ = &bytes.Add({{"source", "backend"}});
  bytes_streamed_ = &prometheus::BuildCounter()
                         .Name("cubetorchfs_read_streamed_bytes_total")
                         .Help(
                             "Bytes of cold reads of large files sent from the store's file to "
                             "the kernel without passing through the cache (also counted in "
                             "cubetorchfs_read_bytes_total{source=\"backend\"})")
                         .Register(registry)
                         .Add({});
  auto& write_backs = prometheus::BuildCounter()
                          .Name("cubetorchfs_write_back_total")
                          .Help(
                              "Written files closed in the store by the write-back thread "
                              "(fuse.flush_on_close false), by result; a failed one is kept "
                              "and tried again")
                          .Register(registry);
  write_back_ok_ = &write_backs.Add({{"result", "ok"}});
  write_back_failed_ = &write_backs.Add({{"result", "error"}});
  inodes_.SetSizeGauge(&prometheus::BuildGauge()
                            .Name("cubetorchfs_inodes")
                            .Help("Files and directories the kernel knows (the daemon's inode "
                                  "table, the root included): what grows with the dataset")
                            .Register(registry)
                            .Add({}));
  if (options_.list_ahead > 0) {
    ListAhead::Options o;
    o.depth = options_.list_ahead;
    o.threads = options_.list_ahead_threads;
    // Listings made ahead are as stale as the attributes the daemon holds may be.
    o.fresh_ns = static_cast<uint64_t>(std::max(1.0, options_.attr_timeout_s) * 1e9);
    list_ahead_ = std::make_unique<ListAhead>(o, backend_, clock_, &changes_, &registry);
  }
}

FileSystem::~FileSystem() {
  list_ahead_.reset();  // its threads list through backend_
  StopWriteBack();
}

std::string FileSystem::ChildPath(const std::string& parent, const std::string& name) {
  return parent.empty() ? name : parent + "/" + name;
}

Result<InodeInfo> FileSystem::GetInode(uint64_t ino) {
  std::optional<InodeInfo> info = inodes_.Get(ino);
  if (!info) return Status::Stale("inode " + std::to_string(ino) + " is not known");
  return *info;
}

std::optional<cfs_client::FileAttr> FileSystem::KnownAttr(const std::string& path,
                                                          uint64_t* fetched_ns,
                                                          uint64_t dir_id) const {
  std::optional<InodeTable::HeldAttr> held = inodes_.AttrOf(path);
  if (!held) return std::nullopt;
  if (dir_id != 0 && !path.empty() && held->dir_id != dir_id) return std::nullopt;
  if (!AttrFresh(held->attr_time_ns, clock_->NowNanos())) return std::nullopt;
  if (fetched_ns != nullptr) *fetched_ns = held->attr_time_ns;
  return held->attr;
}

uint64_t FileSystem::DirIdOf(const std::string& path) const {
  const size_t slash = path.rfind('/');
  std::optional<InodeTable::HeldAttr> dir =
      inodes_.AttrOf(slash == std::string::npos ? std::string() : path.substr(0, slash));
  return dir ? dir->attr.StoreId() : 0;
}

uint64_t FileSystem::MarkOf(const std::string& path,
                            std::optional<cfs_client::FileAttr>* fresh) const {
  std::optional<InodeTable::HeldAttr> held = inodes_.AttrOf(path);
  if (fresh != nullptr) {
    fresh->reset();
    if (held && AttrFresh(held->attr_time_ns, clock_->NowNanos())) *fresh = held->attr;
  }
  return held ? held->mark : 0;
}

void FileSystem::BeginKernelRead(uint64_t ino) {
  KernelReads& k = KernelReadsOf(ino);
  MutexLock l(k.mu);
  k.count[ino]++;
}

void FileSystem::EndKernelRead(uint64_t ino) {
  KernelReads& k = KernelReadsOf(ino);
  MutexLock l(k.mu);
  auto it = k.count.find(ino);
  if (it != k.count.end() && --it->second == 0) k.count.erase(it);
}

bool FileSystem::KernelReading(uint64_t ino) {
  KernelReads& k = KernelReadsOf(ino);
  MutexLock l(k.mu);
  return k.count.count(ino) > 0;
}

bool FileSystem::AttrFresh(uint64_t attr_time_ns, uint64_t now) const {
  return static_cast<double>(now - attr_time_ns) / 1e9 < options_.attr_timeout_s;
}

Result<cfs_client::FileAttr> FileSystem::FreshAttr(const InodeInfo& inode) {
  const uint64_t now = clock_->NowNanos();
  // Being written: the bytes written so far (an object store may not have them yet).
  if (open_writes_.load() > 0) {
    if (std::shared_ptr<WriteState> st = FindWriteState(inode.ino)) {
      if (std::optional<cfs_client::FileAttr> attr = WrittenAttr(*st)) {
        // Unlinked while open: no name is left, whatever a staging file's own count says.
        if (inode.removed && !attr->IsDir()) attr->nlink = 0;
        inodes_.SetAttr(inode.ino, *attr, now);
        return *attr;
      }
    }
  }
  if (AttrFresh(inode.attr_time_ns, now)) return inode.attr;
  // Unlinked or renamed over: its old path names another file now, if any.
  if (inode.removed) return inode.attr;
  // The store is known not to answer: what the daemon holds answers at once, unrenewed.
  if (backend_->InOutage()) return inode.attr;
  Result<cfs_client::FileAttr> attr = backend_->Stat(inode.path);
  // Another object at the inode's path (swapped in behind the mount): the kernel checked this
  // inode's rights on the object it was given, so the inode answers for nothing else.
  if (attr.ok() && !attr->Version().SameFile(inode.attr.Version()))
    return Status::Stale(inode.path + ": another object than this inode's is there now");
  if (attr.ok()) inodes_.SetAttr(inode.ino, attr.value(), now);
  // A store that does not answer: what the daemon holds answers, unrenewed, so that what is
  // cached is served through an outage and the next request asks the store again.
  if (!attr.ok() && attr.status().code() == Status::Code::kIOError) return inode.attr;
  return attr;
}

Result<Entry> FileSystem::Lookup(uint64_t parent, const std::string& name) {
  CTFS_ASSIGN_OR_RETURN(InodeInfo dir, GetInode(parent));
  if (!dir.attr.IsDir()) return Status::NotDirectory(dir.path);
  if (dir.removed) return Status::NotFound(dir.path + ": removed from the store");
  if (name.size() > 255) return Status::NameTooLong(name.substr(0, 32) + "...");
  std::string path = ChildPath(dir.path, name);
  if (open_writes_.load() > 0) {
    // A file being written: its attributes are those of the bytes written so far (an
    // object store may not have it yet).
    if (std::optional<uint64_t> ino = inodes_.Find(path)) {
      if (std::shared_ptr<WriteState> st = FindWriteState(*ino)) {
        std::optional<cfs_client::FileAttr> attr = WrittenAttr(*st);
        if (attr) return Entry{inodes_.Acquire(path, *attr, clock_->NowNanos()), *attr};
      }
    }
  }
  // Every answer is of a name found in this very directory, the object whose rights the kernel
  // checked (docs/security.md): a fetch made in it, a name held under its record, or the store
  // asked in it (Expected, below).
  const uint64_t dir_id = dir.attr.StoreId();
  uint64_t fetched_ns = 0;
  if (std::optional<cfs_client::FileAttr> warm = prefetcher_->WindowAttr(path, dir_id, &fetched_ns))
    return Entry{inodes_.Acquire(path, *warm, fetched_ns), *warm};
  // Attributes the daemon holds and may still answer with (a listing's, say: readdirplus).
  if (std::optional<cfs_client::FileAttr> known = KnownAttr(path, &fetched_ns, dir_id))
    return Entry{inodes_.Acquire(path, *known, fetched_ns), *known};
  // The store does not answer (known before asking, or learnt by asking): a name the daemon
  // holds (its attributes expired) is answered with them, unrenewed, as FreshAttr does; a name
  // it does not hold fails.
  if (backend_->InOutage()) {
    if (std::optional<Entry> held = HeldEntry(path)) return *held;
  }
  Result<Entry> asked = [&] {
    const cfs_client::Expected::Scope in_dir({{dir.path, dir_id}});
    return NoteStale(parent, StoreLookup(path));
  }();
  if (asked.ok() || asked.status().code() != Status::Code::kIOError) return asked;
  if (std::optional<Entry> held = HeldEntry(path)) return *held;
  return asked;
}

std::optional<Entry> FileSystem::HeldEntry(const std::string& path) {
  std::optional<uint64_t> ino = inodes_.Find(path);
  std::optional<InodeInfo> held = ino ? inodes_.Get(*ino) : std::nullopt;
  if (!held || held->removed) return std::nullopt;
  return Entry{inodes_.Acquire(path, held->attr, held->attr_time_ns), held->attr};
}

Result<Entry> FileSystem::StoreLookup(const std::string& path) {
  if (options_.lookup_read_bytes > 0) return LookupRead(path);
  CTFS_ASSIGN_OR_RETURN(cfs_client::FileAttr attr, backend_->Stat(path));
  return Entry{inodes_.Acquire(path, attr, clock_->NowNanos()), attr};
}

Result<Entry> FileSystem::LookupRead(const std::string& path) {
  std::shared_ptr<cache::Buffer> buf = cache::Buffer::Allocate(options_.lookup_read_bytes);
  CTFS_ASSIGN_OR_RETURN(cfs_client::Backend::Fetched got,
                        backend_->LookupRead(path, options_.lookup_read_bytes, buf->data.get()));
  const cfs_client::FileAttr& attr = got.attr;
  // A whole small file: what its first read would fetch (the same key and version).
  if (attr.IsRegular() && attr.size > 0 && got.bytes == attr.size &&
      attr.size <= options_.chunk_bytes) {
    buf->Shrink(got.bytes);
    cache_->Insert(cache::ChunkKey(path, attr.Version(), 0), std::move(buf));
  }
  return Entry{inodes_.Acquire(path, attr, clock_->NowNanos()), attr};
}

void FileSystem::Forget(uint64_t ino, uint64_t nlookup) {
  inodes_.Forget(ino, nlookup);
  if (open_writes_.load() == 0 || inodes_.Get(ino)) return;
  // The kernel holds no reference any more, so no descriptor is open: whatever is still
  // being written (under no_open, a file never flushed) goes to the store now, on the
  // background thread: a forget has no reply, but the FUSE thread it came on must not spend
  // an upload's length on it.
  std::shared_ptr<WriteState> st = MarkOrphan(ino);
  if (!st || QueueForgotten(ino)) return;
  // No background thread (before StartWriteBack or after StopWriteBack): here, then.
  if (Status s = CloseForgotten(ino, *st); !s.ok())
    CTFS_LOG(kError) << "forget: bytes written could not reach the store: " << s.ToString();
}

Result<cfs_client::FileAttr> FileSystem::GetAttr(uint64_t ino) {
  // The kernel asks again long before its copy expires: every read of a writable mount
  // invalidates the file's atime, and the next fstat (Python's open() does one) comes here.
  // Within attr_timeout_s the attributes the daemon holds answer, under the contract lookups
  // keep; only older ones are asked of the store.
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  return FreshAttr(inode);
}

Result<std::string> FileSystem::ReadLink(uint64_t ino) {
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  if (inode.removed) return Status::Stale(inode.path + ": removed from the store");
  const cfs_client::Expected::Scope self({{inode.path, inode.attr.StoreId()}});
  return NoteStale(ino, backend_->ReadLink(inode.path));
}

namespace {

// What a listing holds in memory: its vector and each entry's name outside the string.
uint64_t ListingBytes(const std::vector<cfs_client::DirEntry>& entries) {
  uint64_t bytes = entries.capacity() * sizeof(cfs_client::DirEntry);
  for (const cfs_client::DirEntry& e : entries)
    if (e.name.capacity() > 15) bytes += e.name.capacity() + 1;  // beyond the inline buffer
  return bytes;
}

}  // namespace

DirHandle::Charge::~Charge() {
  budget->Give(uid, bytes);
  if (bytes >= (1u << 20)) TrimHeap();
}

uint64_t FileSystem::dir_memory_held() const { return dir_memory_->held(); }

Result<std::unique_ptr<DirHandle>> FileSystem::OpenDir(uint64_t ino, int64_t uid) {
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  auto handle = std::make_unique<DirHandle>();
  handle->ino = ino;
  handle->path = inode.path;
  handle->id = inode.attr.StoreId();
  handle->uid = uid;
  if (inode.removed) return handle;  // removed: no entries (its old path may name another one)
  DirHandle& dir = *handle;
  MutexLock l(dir.mu);
  std::optional<std::vector<cfs_client::DirEntry>> ahead;
  if (list_ahead_ != nullptr) ahead = list_ahead_->Take(inode.path, inode.attr.StoreId());
  if (ahead) {
    dir.entries = std::move(*ahead);
  } else {
    // The first page now, so that a directory that cannot be listed fails its opendir. The
    // store lists the directory the kernel checked, or fails with Stale.
    const cfs_client::Expected::Scope self({{dir.path, dir.id}});
    CTFS_ASSIGN_OR_RETURN(dir.lister, NoteStale(ino, backend_->ListPages(inode.path)));
    CTFS_ASSIGN_OR_RETURN(cfs_client::DirPage page, dir.lister->Next(options_.list_page_entries));
    dir.entries = std::move(page.entries);
    if (page.last) dir.lister.reset();
  }
  if (list_ahead_ != nullptr && dir.lister == nullptr) {
    // A directory listed whole in one page plans the listing of its subdirectories now.
    list_ahead_->OnListed(inode.path, dir.entries);
  } else if (list_ahead_ != nullptr) {
    dir.plan = true;
    GatherSubdirs(dir, dir.entries, false);
  }
  CTFS_RETURN_IF_ERROR(ChargeDirWindow(dir));
  return handle;
}

void FileSystem::GatherSubdirs(DirHandle& dir, const std::vector<cfs_client::DirEntry>& page,
                               bool last) {
  if (!dir.plan) return;
  for (const cfs_client::DirEntry& e : page)
    if (e.attr.IsDir()) dir.subdirs.push_back(e);
  if (dir.subdirs.size() > kDirPlanNames) {
    dir.plan = false;  // too many to plan from (as ListAhead itself would refuse)
    std::vector<cfs_client::DirEntry>().swap(dir.subdirs);
    return;
  }
  if (!last) return;
  dir.plan = false;
  if (list_ahead_ != nullptr) list_ahead_->OnListed(dir.path, dir.subdirs);
  std::vector<cfs_client::DirEntry>().swap(dir.subdirs);
}

Status FileSystem::ChargeDirWindow(DirHandle& dir) {
  dir.entries.shrink_to_fit();  // held until the next page or the release: no growth slack
  const uint64_t bytes = ListingBytes(dir.entries) + ListingBytes(dir.subdirs);
  if (dir.charge == nullptr) dir.charge.reset(new DirHandle::Charge{dir_memory_, dir.uid, 0});
  DirHandle::Charge& c = *dir.charge;
  if (bytes <= c.bytes) {
    dir_memory_->Give(dir.uid, c.bytes - bytes);
    c.bytes = bytes;
    return Status::OK();
  }
  if (dir_memory_->Take(dir.uid, bytes - c.bytes)) {
    c.bytes = bytes;
    return Status::OK();
  }
  CTFS_LOG(kWarn) << "listing " << dir.path << " refused: its window of " << dir.entries.size()
                  << " entries (" << bytes << " bytes) would pass fuse.dir_memory_bytes ("
                  << options_.dir_memory_bytes << " for all open directories, half per user)";
  // Nothing kept: the next readdir lists the directory again.
  dir.entries = {};
  dir.plan = false;
  std::vector<cfs_client::DirEntry>().swap(dir.subdirs);
  dir.first = 0;
  dir.lister.reset();
  dir_memory_->Give(dir.uid, c.bytes);
  c.bytes = 0;
  dir.restart = true;
  TrimHeap();
  return Status::Errno(ENOMEM, dir.path + ": open directories hold too much memory");
}

Result<bool> FileSystem::DirEntryAt(DirHandle& dir, uint64_t index) {
  if (index < dir.first || dir.restart) {
    // Before the window (a rewind, a seek back): the listing again, from its start.
    dir.entries = {};
    dir.first = 0;
    dir.plan = false;  // planned once, or not at all, per handle
    std::vector<cfs_client::DirEntry>().swap(dir.subdirs);
    dir.restart = true;  // until the listing is open again: a failure here is not an end
    const cfs_client::Expected::Scope self({{dir.path, dir.id}});
    CTFS_ASSIGN_OR_RETURN(dir.lister, NoteStale(dir.ino, backend_->ListPages(dir.path)));
    dir.restart = false;
  }
  while (index >= dir.first + dir.entries.size() && dir.lister != nullptr) {
    CTFS_ASSIGN_OR_RETURN(cfs_client::DirPage page, dir.lister->Next(options_.list_page_entries));
    if (dir.entries.size() > kDirKeepBehind) {
      const size_t drop = dir.entries.size() - kDirKeepBehind;
      dir.entries.erase(dir.entries.begin(), dir.entries.begin() + static_cast<ptrdiff_t>(drop));
      dir.first += drop;
    }
    GatherSubdirs(dir, page.entries, page.last);
    dir.entries.insert(dir.entries.end(), std::make_move_iterator(page.entries.begin()),
                       std::make_move_iterator(page.entries.end()));
    if (page.last) dir.lister.reset();
    CTFS_RETURN_IF_ERROR(ChargeDirWindow(dir));
  }
  return index < dir.first + dir.entries.size();
}

uint64_t FileSystem::AcquireDirEntry(const DirHandle& dir, const cfs_client::DirEntry& entry) {
  return inodes_.Acquire(ChildPath(dir.path, entry.name), entry.attr, clock_->NowNanos());
}

Status FileSystem::CheckNotRemoved(const InodeInfo& inode) {
  // Unlinked or renamed over, and not kept open: its bytes are gone, and its old path names
  // another file now, if any. Never resolve that path again.
  if (inode.removed && !FindWriteState(inode.ino))
    return Status::Stale(inode.path + ": removed from the store");
  return Status::OK();
}

Result<FileSystem::OpenTarget> FileSystem::RegularForOpen(uint64_t ino) {
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  CTFS_RETURN_IF_ERROR(CheckNotRemoved(inode));
  CTFS_ASSIGN_OR_RETURN(cfs_client::FileAttr attr, FreshAttr(inode));
  if (attr.IsDir()) return Status::IsDirectory(inode.path);
  if (!attr.IsRegular()) return Status::InvalidArgument(inode.path + ": not a regular file");
  return OpenTarget{std::move(inode), attr};
}

Result<OpenResult> FileSystem::Open(uint64_t ino, int flags, bool track_handle, int64_t uid) {
  if ((flags & O_ACCMODE) != O_RDONLY) return OpenForWrite(ino, flags, track_handle, uid);
  if ((flags & O_TRUNC) != 0) CTFS_RETURN_IF_ERROR(CheckWritable());
  CTFS_ASSIGN_OR_RETURN(OpenTarget target, RegularForOpen(ino));
  const InodeInfo* inode = &target.inode;
  const cfs_client::FileAttr* attr = &target.attr;

  OpenResult r;
  r.handle =
      std::make_unique<FileHandle>(FileHandle{ino, inode->path, attr->Version(), inode->write_gen,
                                              false, StreamFor(inode->path, *attr, uid)});
  const InodeTable::OpenedBefore before = inodes_.SetOpenedVersion(ino, attr->Version());
  r.keep_cache = options_.keep_cache && before == InodeTable::OpenedBefore::kSameVersion;
  r.invalidate_inode = before == InodeTable::OpenedBefore::kOtherVersion;
  return r;
}

Result<FileHandle> FileSystem::HandleFor(uint64_t ino, bool opened_before) {
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  CTFS_RETURN_IF_ERROR(CheckNotRemoved(inode));
  CTFS_ASSIGN_OR_RETURN(cfs_client::FileAttr attr, FreshAttr(inode));
  if (!attr.IsRegular()) return Status::InvalidArgument(inode.path + ": not a regular file");
  if (opened_before && !inodes_.OpenedAt(ino, attr.Version()))
    return Status::Stale(inode.path + ": changed in the store since it was opened");
  // Under no_open each read comes here: a streamed read then opens the store's file for itself.
  return FileHandle{
      ino, inode.path, attr.Version(), inode.write_gen, false, StreamFor(inode.path, attr)};
}

std::shared_ptr<StoreStream> FileSystem::StreamFor(const std::string& path,
                                                   const cfs_client::FileAttr& attr, int64_t uid) {
  if (options_.stream_min_bytes == 0 || attr.size < options_.stream_min_bytes ||
      attr.size <= options_.chunk_bytes || disk_ != nullptr ||
      !backend_->capabilities().hands_out_fds || prefetch::ModelFetcher::IsModelFile(path))
    return nullptr;
  return std::make_shared<StoreStream>(path, attr.Version(), &stream_fds_, uid);
}

Result<ReadResult> FileSystem::Read(const FileHandle& opened, uint64_t offset, size_t size,
                                    int64_t uid) {
  const FileHandle* current = &opened;
  FileHandle refreshed;
  if (opened.ino != 0 && ever_written_.load()) {
    // Being written through the mount: the bytes written so far, never a cached copy.
    if (std::optional<Result<ReadResult>> w = ReadWritten(opened.ino, offset, size))
      return std::move(*w);
    // Changed through the mount since this handle was opened: read the new version.
    std::optional<InodeInfo> inode = inodes_.Get(opened.ino);
    if (inode && inode->removed) {
      // Removed with no state kept open (ReadWritten found none): the bytes are gone.
      return Status::Stale(inode->path + ": removed from the store");
    }
    if (inode && inode->write_gen != opened.write_gen) {
      CTFS_ASSIGN_OR_RETURN(FileHandle h, HandleFor(opened.ino));
      // The inode's path now (renamed through the mount, the handle's path may name another
      // file): the same file as opened, or nothing.
      if (!h.version.SameFile(opened.version))
        return Status::Stale(opened.path + ": not the file that was opened any more");
      refreshed = std::move(h);
      current = &refreshed;
    }
  }
  const FileHandle& handle = *current;
  ReadResult out;
  const uint64_t file_size = handle.version.size;
  if (offset >= file_size || size == 0) return out;
  if (model_fetcher_ != nullptr) model_fetcher_->OnRead(handle.path, handle.version, offset);
  const uint64_t end = std::min<uint64_t>(file_size, offset + size);
  // Files up to chunk_bytes are one whole-file entry; larger ones are chunks of chunk_bytes.
  const uint64_t chunk_bytes = options_.chunk_bytes;
  if (handle.stream != nullptr && &handle == &opened) {
    if (std::optional<ReadResult> streamed = TryStream(handle, offset, end, uid))
      return std::move(*streamed);
  }
  prefetch::ReadOutcome outcome = prefetch::ReadOutcome::kHit;
  uint64_t backend_bytes = 0;
  uint64_t disk_bytes = 0;
  for (uint64_t chunk = offset / chunk_bytes; chunk * chunk_bytes < end; ++chunk) {
    const uint64_t chunk_begin = chunk * chunk_bytes;
    const size_t chunk_len = static_cast<size_t>(std::min(chunk_bytes, file_size - chunk_begin));
    const size_t from = static_cast<size_t>(std::max(offset, chunk_begin) - chunk_begin);
    const size_t to =
        static_cast<size_t>(std::min<uint64_t>(end, chunk_begin + chunk_len) - chunk_begin);
    // The one read policy (the control API's batches and downloads read here too): the RAM
    // cache first (one shard's lock; a warm epoch's files are there), then the prefetch window
    // (its view index; a fetch in flight is waited for), then the NVMe tier and the store.
    const std::string key = cache::ChunkKey(handle.path, handle.version, chunk);
    cache::BufferRef buffer = cache_->Get(key);
    if (buffer == nullptr) {
      if (std::optional<prefetch::Prefetcher::WindowHit> w =
              prefetcher_->Get(handle.path, handle.version, chunk)) {
        buffer = std::move(w->buffer);
        if (w->waited) outcome = std::max(outcome, prefetch::ReadOutcome::kLate);
      }
    }
    if (buffer != nullptr && buffer->size < to) buffer = nullptr;  // not the whole chunk
    if (buffer == nullptr) {
      cache::Tier tier = cache::Tier::kRam;
      Result<cache::Lookup> got = cache_->GetOrFetch(key, [&] {
        return cache::Tiers{cache_, disk_}.ReadThroughDisk(
            *backend_, key, handle.path, handle.version, chunk_begin, chunk_len, &tier);
      });
      if (!got.ok()) return got.status();
      if (tier == cache::Tier::kDisk) {  // no wait on the backend: still a hit
        disk_bytes += to - from;
      } else if (got->served != cache::Served::kCached) {
        outcome = prefetch::ReadOutcome::kMiss;
        backend_bytes += to - from;
      }
      buffer = std::move(got->buffer);
    }
    out.slices.push_back({std::move(buffer), from, to - from});
  }
  const size_t total = out.size();
  // ino 0: StreamFile, a read for the control API, not the kernel.
  prefetcher_->OnRead(handle.path, handle.version, offset, total, outcome,
                      /*to_kernel=*/opened.ino != 0, uid);
  bytes_backend_->Increment(static_cast<double>(backend_bytes));
  bytes_disk_->Increment(static_cast<double>(disk_bytes));
  bytes_ram_->Increment(static_cast<double>(total - backend_bytes - disk_bytes));
  return out;
}

std::optional<ReadResult> FileSystem::TryStream(const FileHandle& handle, uint64_t offset,
                                                uint64_t end, int64_t uid) {
  // Cold: no prefetch window or cache tier holds any of the chunks read (a chunk being
  // fetched counts as held: Get waits for it and the usual path then finds it).
  const uint64_t chunk_bytes = options_.chunk_bytes;
  for (uint64_t chunk = offset / chunk_bytes; chunk * chunk_bytes < end; ++chunk) {
    if (prefetcher_->Get(handle.path, handle.version, chunk)) return std::nullopt;
    if (cache_->Get(cache::ChunkKey(handle.path, handle.version, chunk)) != nullptr)
      return std::nullopt;
  }
  // First touch: no byte of the read's first chunk streamed before. The bytes it streams of
  // the chunks after that one are remembered too, so that a later read starting in one of them
  // (the kernel splits its reads where it likes) is a second touch of those bytes, not a first.
  const uint64_t first = offset / chunk_bytes;
  const uint64_t from = offset - first * chunk_bytes;
  if (!stream_admission_.FirstTouch(cache::ChunkKey(handle.path, handle.version, first),
                                    chunk_bytes, from, std::min(end - offset + from, chunk_bytes)))
    return std::nullopt;
  for (uint64_t chunk = first + 1; chunk * chunk_bytes < end; ++chunk)
    (void)stream_admission_.FirstTouch(cache::ChunkKey(handle.path, handle.version, chunk),
                                       chunk_bytes, 0,
                                       std::min(end - chunk * chunk_bytes, chunk_bytes));
  const int fd = handle.stream->Fd(*backend_);
  if (fd < 0) return std::nullopt;
  const size_t length = static_cast<size_t>(end - offset);
  ReadResult out;
  out.store = ReadResult::StoreSlice{handle.stream, fd, offset, length};
  prefetcher_->OnRead(handle.path, handle.version, offset, length, prefetch::ReadOutcome::kMiss,
                      /*to_kernel=*/true, uid);
  bytes_backend_->Increment(static_cast<double>(length));
  bytes_streamed_->Increment(static_cast<double>(length));
  return out;
}

Status FileSystem::StreamFile(const std::string& path, const cfs_client::FileAttr& attr,
                              const std::function<Status(const char* data, size_t len)>& piece,
                              int64_t uid) {
  if (!attr.IsRegular()) return Status::InvalidArgument(path + ": not a regular file");
  const FileHandle handle{0, path, attr.Version(), 0, false};
  constexpr size_t kPiece = 1 << 20;
  for (uint64_t off = 0; off < attr.size;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kPiece, attr.size - off));
    CTFS_ASSIGN_OR_RETURN(ReadResult r, Read(handle, off, want, uid));
    if (r.size() == 0 || r.size() > want)
      return Status::Stale(path + ": file changed in the store while read");
    for (const auto& s : r.slices)
      CTFS_RETURN_IF_ERROR(piece(s.buffer->data.get() + s.offset, s.length));
    off += r.size();
  }
  return Status::OK();
}

Result<cfs_client::FsStats> FileSystem::StatFs() { return backend_->StatFs(); }

Status FileSystem::Access(uint64_t ino, int mask) {
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  if (mask & W_OK) return CheckWritable();
  return Status::OK();
}

}  // namespace cubetorchfs::fs
