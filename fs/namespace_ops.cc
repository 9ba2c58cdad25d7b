// FileSystem's namespace changes: create, mknod, mkdir, symlink, link, unlink, rmdir and
// rename, with what they do to files being written (write_path.cc) and to the caches.
// The contract is in file_system.h. Each change that adds or removes a name expires the
// directory's attributes in the inode table: the store moved its mtime and ctime, and the
// kernel, which drops its own copy then, must not be answered with the old ones.

#include <fcntl.h>
#include <linux/fs.h>  // RENAME_NOREPLACE
#include <sys/stat.h>

#include "common/logging.h"
#include "common/thread_annotations.h"
#include "fs/file_system.h"
#include "fs/write_state.h"

namespace cubetorchfs::fs {

Result<FileSystem::Created> FileSystem::Create(uint64_t parent, const std::string& name,
                                               mode_t mode, int flags, const Owner& owner,
                                               bool track_handle) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  uint64_t dir_id = 0;
  Result<std::string> path = ChildOf(parent, name, &dir_id);
  if (!path.ok()) return path.status();
  // The name is made in the directory the kernel checked, or nowhere (Stale).
  const cfs_client::Expected::Scope in_dir({{DirPart(*path), dir_id}});
  cfs_client::OpenWriteOptions o;
  o.create = true;
  o.exclusive = (flags & O_EXCL) != 0;
  o.truncate = (flags & O_TRUNC) != 0;
  o.mode = mode & 07777;
  o.uid = owner.uid;
  o.gid = owner.gid;
  // Taken before the store creates the file; given back unless a new write state keeps it.
  CTFS_RETURN_IF_ERROR(TakeWrite(owner.uid));
  Result<std::unique_ptr<cfs_client::WritableFile>> file =
      NoteStale(parent, backend_->OpenWrite(*path, o));
  if (file.ok()) inodes_.ExpireAttr(parent);  // its mtime and ctime moved (if it was made)
  if (!file.ok()) {
    writes_by_uid_.Give(owner.uid);
    return file.status();
  }
  Result<cfs_client::FileAttr> stat = (*file)->Stat();
  if (!stat.ok()) {
    writes_by_uid_.Give(owner.uid);
    return stat.status();
  }
  const cfs_client::FileAttr attr = *stat;
  const uint64_t ino = inodes_.Acquire(*path, attr, clock_->NowNanos());
  std::shared_ptr<WriteState> st;
  {
    MutexLock l(writes_mu_);
    auto it = writes_.find(ino);
    if (it == writes_.end()) {
      st = std::make_shared<WriteState>(std::move(file).value(), *path);
      st->changed_ns = clock_->NowNanos();
      st->uid = owner.uid;  // keeps what TakeWrite took
      writes_.emplace(ino, st);
      open_writes_++;
      inodes_.SetWriting(ino, true);
    } else {
      st = it->second;  // already being written: share that state (the new handle is dropped)
      writes_by_uid_.Give(owner.uid);
    }
  }
  {
    MutexLock sl(st->mu);
    if (track_handle) st->writers++;
    MarkChangedLocked(*st);  // an object store must receive even an empty new file
  }
  InvalidateCaches(*path);
  Changed(ino, attr);
  Created out;
  out.entry = Entry{ino, attr};
  out.handle = std::make_unique<FileHandle>();
  out.handle->ino = ino;
  out.handle->path = *path;
  out.handle->version = attr.Version();
  out.handle->write_gen = inodes_.Get(ino) ? inodes_.Get(ino)->write_gen : 0;
  out.handle->writable = track_handle;
  return out;
}

Result<Entry> FileSystem::Mknod(uint64_t parent, const std::string& name, mode_t mode,
                                uint64_t rdev, const Owner& owner) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  if (!S_ISREG(mode)) {
    if (!S_ISFIFO(mode) && !S_ISSOCK(mode) && !S_ISCHR(mode) && !S_ISBLK(mode))
      return Status::InvalidArgument(name + ": not a file type mknod makes");
    uint64_t dir_id = 0;
    CTFS_ASSIGN_OR_RETURN(std::string path, ChildOf(parent, name, &dir_id));
    const cfs_client::Expected::Scope in_dir({{DirPart(path), dir_id}});
    CTFS_ASSIGN_OR_RETURN(
        cfs_client::FileAttr attr,
        NoteStale(parent, backend_->Mknod(path, mode, rdev, owner.uid, owner.gid)));
    inodes_.ExpireAttr(parent);
    prefetcher_->Invalidate(path);
    return Entry{inodes_.Acquire(path, attr, clock_->NowNanos()), attr};
  }
  CTFS_ASSIGN_OR_RETURN(Created c,
                        Create(parent, name, mode, O_EXCL, owner, /*track_handle=*/false));
  Status s = Flush(c.entry.ino);
  if (!s.ok()) return s;
  return c.entry;
}

Result<Entry> FileSystem::Mkdir(uint64_t parent, const std::string& name, mode_t mode,
                                const Owner& owner) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  uint64_t dir_id = 0;
  CTFS_ASSIGN_OR_RETURN(std::string path, ChildOf(parent, name, &dir_id));
  const cfs_client::Expected::Scope in_dir({{DirPart(path), dir_id}});
  CTFS_ASSIGN_OR_RETURN(
      cfs_client::FileAttr attr,
      NoteStale(parent, backend_->Mkdir(path, mode & 07777, owner.uid, owner.gid)));
  inodes_.ExpireAttr(parent);
  prefetcher_->Invalidate(path);
  return Entry{inodes_.Acquire(path, attr, clock_->NowNanos()), attr};
}

Result<Entry> FileSystem::Symlink(const std::string& target, uint64_t parent,
                                  const std::string& name, const Owner& owner) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  uint64_t dir_id = 0;
  CTFS_ASSIGN_OR_RETURN(std::string path, ChildOf(parent, name, &dir_id));
  const cfs_client::Expected::Scope in_dir({{DirPart(path), dir_id}});
  CTFS_ASSIGN_OR_RETURN(cfs_client::FileAttr attr,
                        NoteStale(parent, backend_->Symlink(target, path, owner.uid, owner.gid)));
  inodes_.ExpireAttr(parent);
  prefetcher_->Invalidate(path);
  return Entry{inodes_.Acquire(path, attr, clock_->NowNanos()), attr};
}

Result<Entry> FileSystem::Link(uint64_t ino, uint64_t new_parent, const std::string& new_name) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  CTFS_ASSIGN_OR_RETURN(InodeInfo inode, GetInode(ino));
  // As link(2) of an unlinked file; its old path names another file now, if any.
  if (inode.removed) return Status::NotFound(inode.path + ": removed from the store");
  uint64_t dir_id = 0;
  CTFS_ASSIGN_OR_RETURN(std::string path, ChildOf(new_parent, new_name, &dir_id));
  // The object the kernel checked, linked into the directory it checked.
  const cfs_client::Expected::Scope objects(
      {{inode.path, inode.attr.StoreId()}, {DirPart(path), dir_id}});
  CTFS_ASSIGN_OR_RETURN(cfs_client::FileAttr attr,
                        NoteStale(new_parent, NoteStale(ino, backend_->Link(inode.path, path))));
  inodes_.ExpireAttr(new_parent);
  // Where the store gives its files an identity, the new name joins the inode (Acquire);
  // elsewhere each name is its own inode, and a write through one shows through the other
  // once its attributes expire.
  Changed(ino, attr);
  return Entry{inodes_.Acquire(path, attr, clock_->NowNanos()), attr};
}

Status FileSystem::Unlink(uint64_t parent, const std::string& name) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  uint64_t dir_id = 0;
  CTFS_ASSIGN_OR_RETURN(std::string path, ChildOf(parent, name, &dir_id));
  const cfs_client::Expected::Scope in_dir({{DirPart(path), dir_id}});
  ever_written_.store(true);
  std::optional<uint64_t> ino = inodes_.Find(path);
  std::shared_ptr<WriteState> st = ino ? FindWriteState(*ino) : nullptr;
  // A hard link of a file with other names: the file stays, and its state follows a name.
  const std::optional<std::string> other = ino ? inodes_.OtherName(*ino, path) : std::nullopt;
  if (ino && !st && !other) {
    // The kernel may hold the file open (under no_open we cannot tell): keep the store's file
    // open so its descriptors go on working after the name is gone, as POSIX says. The state
    // lives until the kernel forgets the inode. A regular file only; failures just mean no
    // such descriptor can exist.
    std::optional<InodeInfo> inode = inodes_.Get(*ino);
    if (inode && inode->attr.IsRegular()) {
      Result<std::shared_ptr<WriteState>> opened = GetWriteState(*ino, false);
      if (opened.ok()) st = opened.value();
    }
  }
  bool unflushed = false;
  if (st) {
    MutexLock sl(st->mu);
    unflushed = st->dirty && !st->closed;
  }
  Status s = NoteStale(parent, backend_->Unlink(path));
  if (s.ok()) inodes_.ExpireAttr(parent);
  // A file created through the mount may not be in an object store yet: removing it is
  // then only forgetting its bytes.
  if (!s.ok() && !(unflushed && s.IsNotFound())) {
    if (st) {
      MutexLock sl(st->mu);
      Status ignored = MaybeCloseLocked(*ino, *st);
      (void)ignored;
    }
    return s;
  }
  if (st) {
    MutexLock sl(st->mu);
    if (!other) {
      MarkRemovedLocked(*st);
    } else if (st->path == path && !st->closed) {
      st->path = *other;
      st->file->Moved(*other);
    }
  }
  {
    // An orphan of this path (bytes of a forgotten file that failed to reach the store) must
    // not bring the file back at unmount.
    MutexLock l(writes_mu_);
    MarkPathsReplacedLocked({&path});
  }
  inodes_.Remove(path);
  InvalidateCaches(path);
  return Status::OK();
}

Status FileSystem::Rmdir(uint64_t parent, const std::string& name) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  uint64_t dir_id = 0;
  CTFS_ASSIGN_OR_RETURN(std::string path, ChildOf(parent, name, &dir_id));
  const cfs_client::Expected::Scope in_dir({{DirPart(path), dir_id}});
  CTFS_RETURN_IF_ERROR(NoteStale(parent, backend_->Rmdir(path)));
  inodes_.ExpireAttr(parent);
  {
    MutexLock l(writes_mu_);
    MarkPathsReplacedLocked({&path});
  }
  inodes_.Remove(path);
  prefetcher_->Invalidate(path);
  return Status::OK();
}

Status FileSystem::Rename(uint64_t parent, const std::string& name, uint64_t new_parent,
                          const std::string& new_name, unsigned flags) {
  CTFS_ASSIGN_OR_RETURN(ChangeScope scope, BeginChange());
  if ((flags & RENAME_EXCHANGE) != 0)
    return Status::NotSupported("rename: RENAME_EXCHANGE is not supported");
  if ((flags & ~static_cast<unsigned>(RENAME_NOREPLACE)) != 0)
    return Status::InvalidArgument("rename: unknown flags " + std::to_string(flags));
  uint64_t from_dir = 0, to_dir = 0;
  CTFS_ASSIGN_OR_RETURN(std::string from, ChildOf(parent, name, &from_dir));
  CTFS_ASSIGN_OR_RETURN(std::string to, ChildOf(new_parent, new_name, &to_dir));
  const cfs_client::Expected::Scope in_dirs({{DirPart(from), from_dir}, {DirPart(to), to_dir}});
  if (from == to) return Status::OK();
  std::optional<uint64_t> src = inodes_.Find(from);
  std::optional<uint64_t> dst = inodes_.Find(to);
  // Two links of one file: rename(2) leaves both names as they are.
  if (src && dst && *src == *dst)
    return NoteStale(
        parent, NoteStale(new_parent, backend_->Rename(from, to, (flags & RENAME_NOREPLACE) != 0)));
  const std::optional<std::string> dst_other = dst ? inodes_.OtherName(*dst, to) : std::nullopt;
  ever_written_.store(true);
  std::shared_ptr<WriteState> src_state = src ? FindWriteState(*src) : nullptr;
  std::shared_ptr<WriteState> dst_state = dst ? FindWriteState(*dst) : nullptr;
  bool dst_opened = false;
  if (dst && !dst_state && !dst_other && (flags & RENAME_NOREPLACE) == 0) {
    // As Unlink does: the replaced file may be held open by the kernel (under no_open we
    // cannot tell), so keep the store's file open for its descriptors; after the rename its
    // path names the renamed file. A regular file only; failures just mean no such
    // descriptor can exist.
    std::optional<InodeInfo> inode = inodes_.Get(*dst);
    if (inode && inode->attr.IsRegular() && !inode->removed) {
      Result<std::shared_ptr<WriteState>> opened = GetWriteState(*dst, false);
      if (opened.ok()) {
        dst_state = opened.value();
        dst_opened = true;
      }
    }
  }
  Status renamed;
  {
    // The store renames what it has: bytes still on their way there go first. The replaced
    // file's state is held too, so no upload of it can land after the rename (the kernel
    // runs no other rename of these names meanwhile; std::lock is for safety all the same).
    if (dst_state == src_state) dst_state.reset();  // renaming a file onto itself
    std::unique_lock<Mutex> sl, dl;
    if (src_state) sl = std::unique_lock<Mutex>(src_state->mu, std::defer_lock);
    if (dst_state) dl = std::unique_lock<Mutex>(dst_state->mu, std::defer_lock);
    if (src_state && dst_state)
      std::lock(sl, dl);
    else if (src_state)
      sl.lock();
    else if (dst_state)
      dl.lock();
    if (src_state) {
      src_state->mu.AssertHeld();  // by sl (the analysis follows no unique_lock)
      renamed = FlushLocked(*src_state);
    }
    if (renamed.ok())
      renamed = NoteStale(
          parent,
          NoteStale(new_parent, backend_->Rename(from, to, (flags & RENAME_NOREPLACE) != 0)));
    if (renamed.ok()) {
      inodes_.ExpireAttr(parent);
      inodes_.ExpireAttr(new_parent);
    }
    if (renamed.ok()) {
      // Both names hold something new now: an orphan of either (or below either, for a
      // directory) is older and must not be uploaded over it at unmount.
      MutexLock l(writes_mu_);
      MarkPathsReplacedLocked({&from, &to});
    }
    if (renamed.ok() && src_state) {
      src_state->mu.AssertHeld();  // by sl
      if (!src_state->closed) {
        src_state->path = to;
        src_state->file->Moved(to);
        src_state->write_seq = ++write_seq_;  // newer than the marks just made
      }
    }
    if (!renamed.ok()) {
      if (dst_opened && dst_state) {  // the keep-alive is not needed after all
        dst_state->mu.AssertHeld();   // by dl
        Status ignored = MaybeCloseLocked(*dst, *dst_state);
        (void)ignored;
      }
      return renamed;
    }
    if (dst_state) {
      dst_state->mu.AssertHeld();  // by dl
      if (!dst_other) {
        MarkRemovedLocked(*dst_state);
      } else if (dst_state->path == to && !dst_state->closed) {
        dst_state->path = *dst_other;  // the replaced name was one link of a file that stays
        dst_state->file->Moved(*dst_other);
      }
    }
  }
  MoveWritesUnder(from, to, src_state.get());
  inodes_.Rename(from, to);
  InvalidateCaches(from);
  InvalidateCaches(to);
  if (src) {
    Result<cfs_client::FileAttr> attr = backend_->Stat(to);
    if (attr.ok()) Changed(*src, *attr);
  }
  return Status::OK();
}

void FileSystem::MoveWritesUnder(const std::string& from, const std::string& to,
                                 const WriteState* skip) {
  // Files being written under a renamed directory follow it.
  const std::string prefix = from + "/";
  MutexLock l(writes_mu_);
  for (auto& [i, st] : writes_) {
    (void)i;
    if (st.get() == skip) continue;
    // A state busy in a backend call is not under this directory in any case that can
    // race with this rename (the kernel locks both directories), so skipping it is safe.
    if (!st->mu.try_lock()) continue;
    if (!st->closed && st->path.compare(0, prefix.size(), prefix) == 0) {
      st->path = to + st->path.substr(from.size());
      st->file->Moved(st->path);
      st->write_seq = ++write_seq_;  // newer than the marks of this rename
    }
    st->mu.unlock();
  }
}

}  // namespace cubetorchfs::fs
