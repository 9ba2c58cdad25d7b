// FileSystem's write path: writes, flush/fsync, truncation, and the write states behind them.
// The contract is in file_system.h; the durability rules users see are in docs/writing.md.

#include <fcntl.h>
#include <linux/fs.h>  // RENAME_NOREPLACE
#include <prometheus/counter.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>

#include "common/logging.h"
#include "common/thread_annotations.h"
#include "fs/file_system.h"
#include "fs/write_state.h"

namespace cubetorchfs::fs {

namespace {

// File times are wall-clock times, whatever clock drives the caches.
int64_t WallNowNs() {
  struct timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace

Status FileSystem::CheckWritable() const {
  if (options_.read_only) return Status::ReadOnly("the mount is read-only (fuse.read_only)");
  return Status::OK();
}

Result<FileSystem::ChangeScope> FileSystem::BeginChange() {
  CTFS_RETURN_IF_ERROR(CheckWritable());
  return ChangeScope(&changes_);
}

Result<std::string> FileSystem::ChildOf(uint64_t parent, const std::string& name,
                                        uint64_t* dir_id) {
  CTFS_ASSIGN_OR_RETURN(InodeInfo dir, GetInode(parent));
  if (dir_id != nullptr) *dir_id = dir.attr.StoreId();
  if (!dir.attr.IsDir()) return Status::NotDirectory(dir.path);
  // A removed directory has no entries (its old path names another one, if any).
  if (dir.removed) return Status::NotFound(dir.path + ": removed from the store");
  if (name.size() > 255) return Status::NameTooLong(name.substr(0, 32) + "...");
  return ChildPath(dir.path, name);
}

Status FileSystem::NoteStale(uint64_t ino, Status s) {
  if (s.code() == Status::Code::kStale) inodes_.ExpireAttr(ino);
  return s;
}

std::string_view FileSystem::DirPart(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string_view() : std::string_view(path).substr(0, slash);
}

void FileSystem::InvalidateCaches(const std::string& path) {
  cache_->EraseFile(path);
  if (disk_ != nullptr) disk_->EraseFile(path);
  prefetcher_->Invalidate(path);
}

void FileSystem::Changed(uint64_t ino, const cfs_client::FileAttr& attr) {
  ever_written_.store(true);
  changes_.fetch_add(1);
  inodes_.SetAttr(ino, attr, clock_->NowNanos());
  inodes_.BumpWriteGen(ino);
}

std::shared_ptr<WriteState> FileSystem::FindWriteState(uint64_t ino) {
  if (open_writes_.load() == 0) return nullptr;
  MutexLock l(writes_mu_);
  auto it = writes_.find(ino);
  return it == writes_.end() ? nullptr : it->second;
}

Status FileSystem::TakeWrite(int64_t uid) {
  if (writes_by_uid_.Take(uid)) return Status::OK();
  return Status::Errno(EMFILE, "user " + std::to_string(uid) + " has " +
                                   std::to_string(writes_by_uid_.held(uid)) +
                                   " files open for writing through the mount, the most one "
                                   "user may (fuse.max_writes_per_uid)");
}

void FileSystem::UncountWriteLocked(WriteState& st) {
  writes_by_uid_.Give(st.uid);
  st.uid = -1;
}

Result<std::shared_ptr<WriteState>> FileSystem::GetWriteState(uint64_t ino, bool add_writer,
                                                              int64_t uid) {
  for (;;) {
    std::shared_ptr<WriteState> st;
    bool created = false;
    {
      MutexLock l(writes_mu_);
      auto it = writes_.find(ino);
      if (it != writes_.end()) {
        st = it->second;
      } else {
        st = std::make_shared<WriteState>();
        st->changed_ns = clock_->NowNanos();
        created = true;
      }
    }
    if (!created) {
      MutexLock l(st->mu);
      if (st->closed) continue;  // closed meanwhile: open a new one
      if (add_writer) st->writers++;
      return st;
    }
    // Open the file with the new state locked, so other callers wait for the outcome.
    MutexLock sl(st->mu);
    {
      MutexLock l(writes_mu_);
      if (writes_.count(ino)) continue;  // another caller got there first
      if (Status room = TakeWrite(uid); !room.ok()) {
        st->closed = true;
        return room;
      }
      st->uid = uid;
      writes_.emplace(ino, st);
      open_writes_++;
      inodes_.SetWriting(ino, true);
    }
    ever_written_.store(true);
    Result<InodeInfo> inode = GetInode(ino);
    // The store's file of this inode, the object the kernel checked, or Stale.
    const cfs_client::Expected::Scope self(
        {{inode.ok() ? std::string_view(inode->path) : std::string_view(),
          inode.ok() ? inode->attr.StoreId() : 0}});
    Result<std::unique_ptr<cfs_client::WritableFile>> file =
        !inode.ok() ? Result<std::unique_ptr<cfs_client::WritableFile>>(inode.status())
        // Unlinked or renamed over with nothing kept open: its old path names another file.
        : inode->removed ? Status::Stale(inode->path + ": removed from the store")
                         : NoteStale(ino, backend_->OpenWrite(inode->path, {}));
    if (!file.ok()) {
      st->closed = true;
      MutexLock l(writes_mu_);
      writes_.erase(ino);
      inodes_.SetWriting(ino, false);
      UncountWriteLocked(*st);
      open_writes_--;
      return file.status();
    }
    st->file = std::move(file).value();
    st->path = inode->path;
    if (add_writer) st->writers++;
    RefreshWrittenAttrLocked(*st);
    sl.Unlock();
    // Reads are served through the state from now on; the cached copies go (not under the
    // state's lock: the NVMe tier may wait for a chunk being written).
    InvalidateCaches(inode->path);
    return st;
  }
}

Result<FileSystem::LockedWriteState> FileSystem::LockOpenWriteState(uint64_t ino) {
  for (;;) {
    CTFS_ASSIGN_OR_RETURN(std::shared_ptr<WriteState> st, GetWriteState(ino, false));
    std::unique_lock<Mutex> l(st->mu);
    st->mu.AssertHeld();
    // Closed meanwhile (a flush of another descriptor): open it again.
    if (!st->closed) return LockedWriteState{std::move(st), std::move(l)};
  }
}

void FileSystem::MarkChangedLocked(WriteState& st) {
  changes_.fetch_add(1);
  st.dirty = true;
  st.write_seq = ++write_seq_;
  st.changed_ns = clock_->NowNanos();
  RefreshWrittenAttrLocked(st);
}

void FileSystem::RefreshWrittenAttrLocked(WriteState& st) {
  std::optional<cfs_client::FileAttr> attr;
  if (!st.closed && st.file) {
    Result<cfs_client::FileAttr> a = st.file->Stat();
    if (a.ok()) attr = a.value();
  }
  MutexLock al(st.attr_mu);
  st.written_attr = attr;
}

void FileSystem::StartWriteBack() {
  MutexLock l(write_back_mu_);
  if (write_back_.joinable() || write_back_stop_) return;
  write_back_ = std::thread([this] { WriteBackLoop(); });
}

void FileSystem::StopWriteBack() {
  {
    MutexLock l(write_back_mu_);
    write_back_stop_ = true;
  }
  write_back_cv_.SignalAll();
  if (write_back_.joinable()) write_back_.join();
}

std::shared_ptr<WriteState> FileSystem::MarkOrphan(uint64_t ino) {
  // Found and marked in one hold of writes_mu_: a close erases the state and uncounts its
  // orphan mark in one hold too, so every mark is uncounted exactly once.
  MutexLock l(writes_mu_);
  auto it = writes_.find(ino);
  if (it == writes_.end()) return nullptr;
  // Counted as an orphan before its last flush is tried: a flush of the same path by a new
  // inode while that upload runs is then recorded (see RecordFlushed). If the flush
  // succeeds, closing the state uncounts it.
  if (!it->second->orphan) {
    it->second->orphan = true;
    orphans_++;
  }
  return it->second;
}

bool FileSystem::QueueForgotten(uint64_t ino) {
  {
    MutexLock l(write_back_mu_);
    if (!write_back_.joinable() || write_back_stop_) return false;
    // At most one entry per write state, and write states are bounded by the open files.
    if (std::find(forgotten_.begin(), forgotten_.end(), ino) == forgotten_.end())
      forgotten_.push_back(ino);
  }
  write_back_cv_.SignalAll();
  return true;
}

void FileSystem::CloseForgottenQueued(std::vector<uint64_t> inos) {
  for (uint64_t ino : inos) {
    std::shared_ptr<WriteState> st = FindWriteState(ino);
    if (!st) continue;  // closed meanwhile
    if (Status s = CloseForgotten(ino, *st); !s.ok()) {
      // Kept: the idle write-back (if on) tries again, FlushAll at unmount in any case.
      CTFS_LOG(kError) << "forget: bytes written could not reach the store: " << s.ToString();
    }
  }
}

void FileSystem::WriteBackIdle(uint64_t idle_ns) {
  std::vector<uint64_t> idle;
  {
    const uint64_t now = clock_->NowNanos();
    MutexLock w(writes_mu_);
    for (const auto& [ino, st] : writes_)
      if (now - std::min(now, st->changed_ns.load()) >= idle_ns) idle.push_back(ino);
  }
  // As a close would: the bytes reach the store and the file is closed there (a later
  // write opens it again). A failure keeps the bytes for the next try or fsync.
  // A failure is tried again one idle time later, not at every pass.
  // A file that cannot be closed yet (still open for writing, or unlinked while open) is
  // looked at again one idle time later too, and is not counted.
  for (uint64_t ino : idle) {
    const Status s = Flush(ino);
    std::shared_ptr<WriteState> still_open = FindWriteState(ino);
    if (still_open) still_open->changed_ns = clock_->NowNanos();
    if (!s.ok()) {
      write_back_failed_->Increment();
      CTFS_LOG(kError) << "write-back: " << s.ToString() << " (kept, tried again in "
                       << options_.write_back_idle_s << " s)";
    } else if (!still_open) {
      write_back_ok_->Increment();
    }
  }
}

void FileSystem::WriteBackLoop() {
  const bool idle_on = options_.write_back_idle_s > 0;
  const auto idle_ns = static_cast<uint64_t>(options_.write_back_idle_s * 1e9);
  const std::chrono::duration<double> period(
      idle_on ? std::clamp(options_.write_back_idle_s / 4, 0.01, 0.25) : 3600.0);
  auto next_scan = std::chrono::steady_clock::now() + period;
  MutexLock l(write_back_mu_);
  for (;;) {
    while (!write_back_stop_ && forgotten_.empty())
      if (!write_back_cv_.WaitUntil(next_scan)) break;
    // Forgotten files left at a stop are flushed by FlushAll at unmount.
    if (write_back_stop_) return;
    std::vector<uint64_t> forgotten(forgotten_.begin(), forgotten_.end());
    forgotten_.clear();
    l.Unlock();
    CloseForgottenQueued(std::move(forgotten));
    if (idle_on && std::chrono::steady_clock::now() >= next_scan) {
      WriteBackIdle(idle_ns);
      next_scan = std::chrono::steady_clock::now() + period;
    } else if (!idle_on) {
      next_scan = std::chrono::steady_clock::now() + period;
    }
    l.Lock();
  }
}

void FileSystem::MarkRemovedLocked(WriteState& st) {
  st.removed = true;
  st.dirty = false;
  if (!st.closed && st.file) st.file->Discard();
  RefreshWrittenAttrLocked(st);  // an fstat of a descriptor still open shows the lost link
}

Status FileSystem::FlushLocked(WriteState& st) {
  if (!st.dirty || st.removed || st.closed) return Status::OK();
  CTFS_RETURN_IF_ERROR(st.file->Flush());
  st.dirty = false;
  RecordFlushed(st);
  RefreshWrittenAttrLocked(st);
  return Status::OK();
}

void FileSystem::RecordFlushed(const WriteState& st) {
  MutexLock l(writes_mu_);
  if (orphans_ == 0) return;  // only an orphan could be older than these bytes
  uint64_t& seq = flushed_seq_[st.path];
  seq = std::max(seq, st.write_seq);
}

Status FileSystem::MaybeCloseLocked(uint64_t ino, WriteState& st, bool forgotten) {
  if (st.closed || st.writers > 0) return Status::OK();
  // An unlinked file stays open for descriptors that may still use it, until forgotten.
  if (st.removed && !forgotten) return Status::OK();
  // Kept open on failure: the next flush, fsync or release tries again.
  CTFS_RETURN_IF_ERROR(FlushLocked(st));
  if (!st.removed) {
    // While the state still serves reads: the cached copies go, and the store's own
    // attributes (its mtime, an object's version) and a new write generation are recorded,
    // so a read that finds the state closed reads the new version.
    InvalidateCaches(st.path);
    Result<cfs_client::FileAttr> stored = backend_->Stat(st.path);
    if (!stored.ok()) stored = st.file->Stat();
    if (stored.ok()) {
      // A stat answered from here on shows the store's version, before the write generation
      // moves: an open that sees the new generation must not pair it with the staged version.
      {
        MutexLock al(st.attr_mu);
        st.written_attr = stored.value();
      }
      Changed(ino, stored.value());
    }
  }
  Status closed = st.file->Close();
  st.file.reset();
  st.closed = true;
  RefreshWrittenAttrLocked(st);
  {
    MutexLock l(writes_mu_);
    auto it = writes_.find(ino);
    if (it != writes_.end() && it->second.get() == &st) {
      writes_.erase(it);
      inodes_.SetWriting(ino, false);
      UncountWriteLocked(st);
      open_writes_--;
    }
    if (st.orphan && --orphans_ == 0) flushed_seq_.clear();
  }
  if (!closed.ok()) {
    // The store may report a failed write-back only now (NFS): the bytes may not be there.
    CTFS_LOG(kError) << "close " << st.path << ": " << closed.ToString();
    if (!st.removed) return closed;
  }
  return Status::OK();
}

Result<OpenResult> FileSystem::OpenForWrite(uint64_t ino, int flags, bool track_handle,
                                            int64_t uid) {
  (void)flags;  // O_TRUNC arrives as a setattr (atomic_o_trunc is off), O_APPEND as offsets
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  CTFS_ASSIGN_OR_RETURN(OpenTarget target, RegularForOpen(ino));
  const InodeInfo* inode = &target.inode;
  const cfs_client::FileAttr* attr = &target.attr;
  OpenResult r;
  r.handle = std::make_unique<FileHandle>();
  r.handle->ino = ino;
  r.handle->path = inode->path;
  r.handle->version = attr->Version();
  r.handle->write_gen = inode->write_gen;
  r.handle->writable = track_handle;
  if (track_handle) {
    CTFS_ASSIGN_OR_RETURN(std::shared_ptr<WriteState> st,
                          GetWriteState(ino, /*add_writer=*/true, uid));
  }
  return r;
}

Result<size_t> FileSystem::Write(uint64_t ino, uint64_t offset, const char* data, size_t len) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  CTFS_ASSIGN_OR_RETURN(LockedWriteState locked, LockOpenWriteState(ino));
  WriteState* st = locked.state.get();
  st->mu.AssertHeld();
  CTFS_ASSIGN_OR_RETURN(size_t n, st->file->Write(offset, data, len));
  MarkChangedLocked(*st);
  if (std::optional<InodeInfo> inode = inodes_.Get(ino)) {
    cfs_client::FileAttr a = inode->attr;
    a.size = std::max<uint64_t>(a.size, offset + n);
    a.mtime_ns = a.ctime_ns = WallNowNs();
    a.blocks = (a.size + 511) / 512;
    inodes_.SetAttr(ino, a, clock_->NowNanos());
  }
  return n;
}

Status FileSystem::Flush(uint64_t ino) {
  std::shared_ptr<WriteState> st = FindWriteState(ino);
  if (!st) return Status::OK();
  Status s;
  {
    MutexLock sl(st->mu);
    if (st->closed) return Status::OK();  // closed by another flush, which flushed it all
    CTFS_RETURN_IF_ERROR(FlushLocked(*st));
    s = MaybeCloseLocked(ino, *st);
    if (!st->closed) return s;
  }
  NotifyWritten(ino);
  return s;
}

void FileSystem::SetWrittenHook(std::function<void(uint64_t ino)> hook) {
  written_hook_ = std::move(hook);
}

void FileSystem::NotifyWritten(uint64_t ino) {
  if (written_hook_) written_hook_(ino);
}

Status FileSystem::Fsync(uint64_t ino) {
  if (options_.read_only) return Status::OK();
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  std::shared_ptr<WriteState> existing = FindWriteState(ino);
  if (!existing && (!inode.attr.IsRegular() || inode.removed)) return Status::OK();
  // Without a write state the file may still hold bytes written (and flushed) earlier that
  // were never made durable: open it to sync them. A state closed meanwhile (by a flush of
  // another descriptor) made the bytes visible, not durable: open it again and sync.
  Result<LockedWriteState> locked = LockOpenWriteState(ino);
  if (!locked.ok()) {
    if (locked.status().IsNotFound() || locked.status().code() == Status::Code::kStale)
      return Status::OK();  // gone from the store: nothing left to make durable
    return locked.status();
  }
  WriteState& st = *locked->state;
  st.mu.AssertHeld();
  if (!st.removed) {
    CTFS_RETURN_IF_ERROR(st.file->Sync());
    if (st.dirty) {
      st.dirty = false;
      RecordFlushed(st);
    }
  }
  return MaybeCloseLocked(ino, st);
}

Status FileSystem::FsyncDir(uint64_t ino) {
  if (options_.read_only) return Status::OK();
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  return backend_->SyncDir(inode.path);
}

Status FileSystem::Release(uint64_t ino, const FileHandle* handle) {
  std::shared_ptr<WriteState> st = FindWriteState(ino);
  if (!st) return Status::OK();
  Status s;
  {
    MutexLock sl(st->mu);
    if (st->closed) return Status::OK();
    if (handle != nullptr && handle->writable && st->writers > 0) st->writers--;
    s = MaybeCloseLocked(ino, *st);
    if (!s.ok())
      CTFS_LOG(kWarn) << "release " << st->path << ": bytes not in the store yet, kept for a "
                      << "later flush: " << s.ToString();
    if (!st->closed) return s;
  }
  NotifyWritten(ino);
  return s;
}

Result<cfs_client::FileAttr> FileSystem::SetAttr(uint64_t ino, const AttrChange& change) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  // Mode, owner and times change on the object the kernel checked (its owner, for chmod and
  // chown), or Stale: never on one swapped in at its path since.
  const cfs_client::Expected::Scope self({{inode.path, inode.attr.StoreId()}});
  if (change.size) {
    if (inode.attr.IsDir()) return Status::IsDirectory(inode.path);
    CTFS_ASSIGN_OR_RETURN(LockedWriteState locked, LockOpenWriteState(ino));
    WriteState& st = *locked.state;
    st.mu.AssertHeld();
    CTFS_RETURN_IF_ERROR(st.file->Truncate(*change.size));
    MarkChangedLocked(st);
    Result<cfs_client::FileAttr> a = st.file->Stat();
    if (a.ok()) Changed(ino, *a);
    CTFS_RETURN_IF_ERROR(MaybeCloseLocked(ino, st));
  }
  const cfs_client::AttrChange& m = change.meta;
  if (m.mode || m.uid || m.gid || m.atime_ns || m.mtime_ns) {
    // Its old path names another file now, if any.
    if (inode.removed) return Status::Stale(inode.path + ": removed from the store");
    Result<cfs_client::FileAttr> a = NoteStale(ino, backend_->SetAttr(inode.path, m));
    if (!a.ok()) {
      // A file created through the mount may not be in an object store yet (touch of a new
      // file): there is nothing there to change then.
      bool unflushed = false;
      if (a.status().IsNotFound()) {
        if (std::shared_ptr<WriteState> st = FindWriteState(ino)) {
          MutexLock sl(st->mu);
          unflushed = st->dirty && !st->closed;
        }
      }
      if (!unflushed) return a.status();
    }
  }
  if (std::shared_ptr<WriteState> st = FindWriteState(ino)) {
    MutexLock sl(st->mu);
    if (!st->closed) {
      RefreshWrittenAttrLocked(*st);  // its mode, owner or times changed too
      Result<cfs_client::FileAttr> a = st->file->Stat();
      if (a.ok()) inodes_.SetAttr(ino, *a, clock_->NowNanos());
      return a;
    }
  }
  if (inode.removed) return inode.attr;
  Result<cfs_client::FileAttr> a = backend_->Stat(inode.path);
  if (a.ok()) Changed(ino, *a);
  return a;
}

Status FileSystem::Fallocate(uint64_t ino, int mode, uint64_t offset, uint64_t len) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  CTFS_ASSIGN_OR_RETURN(LockedWriteState locked, LockOpenWriteState(ino));
  WriteState& st = *locked.state;
  st.mu.AssertHeld();
  CTFS_RETURN_IF_ERROR(st.file->Allocate(mode, offset, len));
  MarkChangedLocked(st);
  Result<cfs_client::FileAttr> a = st.file->Stat();
  if (a.ok()) inodes_.SetAttr(ino, *a, clock_->NowNanos());
  return MaybeCloseLocked(ino, st);
}

std::optional<cfs_client::FileAttr> FileSystem::WrittenAttr(WriteState& st) {
  // Not under st.mu: an upload in flight holds it, and a stat must not wait for it.
  MutexLock al(st.attr_mu);
  return st.written_attr;
}

Status FileSystem::CloseForgotten(uint64_t ino, WriteState& st) {
  MutexLock sl(st.mu);
  st.writers = 0;
  return MaybeCloseLocked(ino, st, /*forgotten=*/true);
}

void FileSystem::MarkPathsReplacedLocked(std::initializer_list<const std::string*> paths) {
  if (orphans_ == 0) return;  // only an orphan could be older than what these paths hold now
  const uint64_t seq = ++write_seq_;
  for (const std::string* p : paths) flushed_seq_[*p] = seq;
}

bool FileSystem::SupersededLocked(const std::string& path, uint64_t write_seq) const {
  // The path itself, or a directory above it, changed in the store after these bytes.
  for (std::string p = path;;) {
    auto it = flushed_seq_.find(p);
    if (it != flushed_seq_.end() && it->second > write_seq) return true;
    const size_t slash = p.rfind('/');
    if (slash == std::string::npos) return false;
    p.resize(slash);
  }
}

Status FileSystem::FlushAll() {
  struct Item {
    uint64_t ino;
    uint64_t seq;
    std::shared_ptr<WriteState> st;
  };
  std::vector<Item> states;
  {
    MutexLock l(writes_mu_);
    for (const auto& [ino, st] : writes_) states.push_back({ino, 0, st});
  }
  for (Item& i : states) {
    MutexLock sl(i.st->mu);
    i.seq = i.st->write_seq;
  }
  // Newest changes first: an orphan (see CloseForgotten) older than bytes since flushed at
  // its path must not overwrite them.
  std::sort(states.begin(), states.end(),
            [](const Item& a, const Item& b) { return a.seq > b.seq; });
  Status first;
  for (Item& i : states) {
    WriteState& st = *i.st;
    MutexLock sl(st.mu);
    if (st.closed) continue;
    if (st.dirty && !st.removed) {
      bool superseded = false;
      {
        MutexLock l(writes_mu_);
        superseded = SupersededLocked(st.path, st.write_seq);
      }
      if (superseded) {
        CTFS_LOG(kWarn) << "flush " << st.path << " at unmount: skipped, the file was written "
                        << "anew since these bytes failed to reach the store";
      } else if (Status s = FlushLocked(st); !s.ok()) {
        CTFS_LOG(kError) << "flush " << st.path << " at unmount: " << s.ToString();
        if (first.ok()) first = s;
      }
    }
    // Let go of the file: local copies of what reached the store (s3 staging files) go too.
    if (Status c = st.file->Close(); !c.ok()) {
      CTFS_LOG(kError) << "close " << st.path << " at unmount: " << c.ToString();
      if (first.ok() && !st.removed) first = c;
    }
    st.file.reset();
    st.closed = true;
    RefreshWrittenAttrLocked(st);
    MutexLock l(writes_mu_);
    auto it = writes_.find(i.ino);
    if (it != writes_.end() && it->second == i.st) {
      writes_.erase(it);
      inodes_.SetWriting(i.ino, false);
      UncountWriteLocked(st);
      open_writes_--;
    }
    if (st.orphan && --orphans_ == 0) flushed_seq_.clear();
  }
  return first;
}

int FileSystem::PassthroughFd(const FileHandle& handle) {
  if (handle.stream == nullptr || handle.writable) return -1;
  if (ever_written_.load()) {
    if (std::shared_ptr<WriteState> st = FindWriteState(handle.ino)) {
      MutexLock sl(st->mu);
      if (!st->closed) return -1;  // bytes written through the mount the store lacks yet
    }
  }
  Result<int> fd = backend_->OpenReadFd(handle.path, handle.version);
  return fd.ok() ? *fd : -1;
}

std::optional<Result<ReadResult>> FileSystem::ReadWritten(uint64_t ino, uint64_t offset,
                                                          size_t size) {
  std::shared_ptr<WriteState> st = FindWriteState(ino);
  if (!st) return std::nullopt;
  MutexLock sl(st->mu);
  if (st->closed) return std::nullopt;
  std::shared_ptr<cache::Buffer> buf = cache::Buffer::Allocate(std::max<size_t>(size, 1));
  Result<size_t> n = st->file->Read(offset, size, buf->data.get());
  if (!n.ok()) return Result<ReadResult>(n.status());
  ReadResult out;
  if (*n > 0) out.slices.push_back({cache::BufferRef(std::move(buf)), 0, *n});
  return Result<ReadResult>(std::move(out));
}

}  // namespace cubetorchfs::fs
