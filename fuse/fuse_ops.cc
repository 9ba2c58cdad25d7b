#include "fuse/fuse_ops.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "common/logging.h"
#include "fuse/page_probe.h"
#include "fuse/passthrough.h"

namespace cubetorchfs::fuse {

enum Op {
  kLookup,
  kForget,
  kGetattr,
  kReadlink,
  kOpendir,
  kReaddir,
  kReaddirplus,
  kReleasedir,
  kOpen,
  kRead,
  kRelease,
  kStatfs,
  kAccess,
  kGetxattr,
  kListxattr,
  kWrite,
  kCreate,
  kMknod,
  kMkdir,
  kUnlink,
  kRmdir,
  kRename,
  kSymlink,
  kLink,
  kSetattr,
  kFlush,
  kFsync,
  kFsyncdir,
  kFallocate,
  kXattrWrite,
  kIoctl,
  kNumOps
};
constexpr std::array<const char*, kNumOps> kOpNames = {
    "lookup",     "forget",   "getattr", "readlink", "opendir", "readdir", "readdirplus",
    "releasedir", "open",     "read",    "release",  "statfs",  "access",  "getxattr",
    "listxattr",  "write",    "create",  "mknod",    "mkdir",   "unlink",  "rmdir",
    "rename",     "symlink",  "link",    "setattr",  "flush",   "fsync",   "fsyncdir",
    "fallocate",  "setxattr", "ioctl"};

// cubetorchfs_fuse_ops_total{op} and cubetorchfs_fuse_op_seconds{op}; owned by the registry.
struct OpMetrics {
  explicit OpMetrics(prometheus::Registry& registry) {
    auto& ops = prometheus::BuildCounter()
                    .Name("cubetorchfs_fuse_ops_total")
                    .Help("FUSE requests received, by operation")
                    .Register(registry);
    auto& secs = prometheus::BuildHistogram()
                     .Name("cubetorchfs_fuse_op_seconds")
                     .Help("Time to handle a FUSE request, by operation")
                     .Register(registry);
    const prometheus::Histogram::BucketBoundaries buckets = {
        0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
        0.025,   0.05,     0.1,     0.25,   0.5,     1,      2.5,   5,      10};
    for (int op = 0; op < kNumOps; ++op) {
      count[op] = &ops.Add({{"op", kOpNames[op]}});
      seconds[op] = &secs.Add({{"op", kOpNames[op]}}, buckets);
    }
    passthrough.opens = &prometheus::BuildCounter()
                             .Name("cubetorchfs_passthrough_opens_total")
                             .Help("Opens the kernel reads straight from the store's file")
                             .Register(registry)
                             .Add({});
    passthrough.backing_files = &prometheus::BuildGauge()
                                     .Name("cubetorchfs_passthrough_backing_files")
                                     .Help("Store files registered for passthrough opens")
                                     .Register(registry)
                                     .Add({});
  }
  prometheus::Counter* count[kNumOps];
  prometheus::Histogram* seconds[kNumOps];
  Passthrough::Metrics passthrough;
};

Passthrough::Metrics PassthroughMetrics(const FuseContext& ctx) { return ctx.metrics->passthrough; }

FuseContext::FuseContext(FileSystem* filesystem, const conf::FuseOptions& opts,
                         prometheus::Registry& registry)
    : fs(filesystem), options(opts), metrics(std::make_unique<OpMetrics>(registry)) {}
FuseContext::~FuseContext() = default;

namespace {

FuseContext& Ctx(fuse_req_t req) { return *static_cast<FuseContext*>(fuse_req_userdata(req)); }

// Counts and times one request. The count is taken on arrival, before any reply: a
// caller whose system call has returned must find its request already counted when it
// scrapes the metrics.
class OpScope {
 public:
  OpScope(fuse_req_t req, Op op)
      : m_(*Ctx(req).metrics), op_(op), start_(SystemClock()->NowNanos()) {
    m_.count[op_]->Increment();
  }
  ~OpScope() {
    m_.seconds[op_]->Observe(static_cast<double>(SystemClock()->NowNanos() - start_) / 1e9);
  }

 private:
  OpMetrics& m_;
  Op op_;
  uint64_t start_;
};

void ReplyError(fuse_req_t req, const Status& s, const char* op) {
  int err = ToErrno(s);
  // During a store outage (logged once by the metered backend) each EIO it causes is not.
  if ((err == EIO && !cfs_client::StoreDown()) || err == ESTALE) {
    CTFS_LOG(kWarn) << op << ": " << s.ToString();
  } else {
    CTFS_LOG(kDebug) << op << ": " << s.ToString();
  }
  fuse_reply_err(req, err);
}

struct stat ToStat(uint64_t ino, const cfs_client::FileAttr& a) {
  struct stat st {};
  st.st_ino = ino;
  st.st_mode = a.mode;
  st.st_nlink = a.nlink;
  st.st_rdev = static_cast<dev_t>(a.rdev);
  st.st_uid = a.uid;
  st.st_gid = a.gid;
  st.st_size = static_cast<off_t>(a.size);
  st.st_blksize = 4096;
  st.st_blocks = static_cast<blkcnt_t>(a.blocks);
  auto ts = [](int64_t ns) {
    return timespec{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  };
  st.st_atim = ts(a.atime_ns);
  st.st_mtim = ts(a.mtime_ns);
  st.st_ctim = ts(a.ctime_ns);
  return st;
}

fuse_entry_param ToEntryParam(const FuseContext& ctx, uint64_t ino, const cfs_client::FileAttr& a) {
  fuse_entry_param e{};
  e.ino = ino;
  e.generation = 0;  // inode numbers are never reused
  e.attr = ToStat(ino, a);
  e.attr_timeout = ctx.options.attr_timeout_s;
  e.entry_timeout = ctx.options.entry_timeout_s;
  return e;
}

void Init(void* userdata, fuse_conn_info* conn) {
  auto* ctx = static_cast<FuseContext*>(userdata);
  conn->max_read = static_cast<unsigned>(ctx->options.max_read);  // must match -o max_read
  conn->max_write = static_cast<unsigned>(ctx->options.max_read);
  // The kernel applies min(its bdi's readahead, this) once it has our reply; the daemon sets
  // the bdi's to fuse.read_ahead before answering (main.cc), so both say the same.
  conn->max_readahead =
      static_cast<unsigned>(std::max(ctx->options.max_read, ctx->options.read_ahead_bytes));
  // Many training workers read at once; let the kernel keep many reads in flight.
  conn->max_background = 128;
  conn->congestion_threshold = 96;
  if (ctx->options.keep_cache && (conn->capable & FUSE_CAP_CACHE_SYMLINKS))
    conn->want |= FUSE_CAP_CACHE_SYMLINKS;
  // Drop the kernel's cached pages when the attributes show the file changed.
  if (conn->capable & FUSE_CAP_AUTO_INVAL_DATA) conn->want |= FUSE_CAP_AUTO_INVAL_DATA;
  // Streamed reads (fs/store_stream.h) reach the kernel by splice, not through our memory.
  // Not over io_uring: a reply goes to the entry's buffer, never to the device.
  if (ctx->io_uring)
    conn->want &= ~(FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
  else if (conn->capable & FUSE_CAP_SPLICE_WRITE)
    conn->want |= FUSE_CAP_SPLICE_WRITE;
  conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
  // O_TRUNC must reach us as a setattr: under no_open the open that would carry it is
  // never sent, and the kernel would truncate only its own page cache.
  conn->want &= ~FUSE_CAP_ATOMIC_O_TRUNC;
  // With keep_cache (the ai_prefetch profile: datasets do not change under training), let the
  // kernel skip open and release altogether: a hot file is then served from the page cache
  // with no round trip to this daemon at all. Changes in the store still show once the
  // attributes expire (attr_timeout_s), since AUTO_INVAL_DATA drops pages whose file changed.
  // Writes work without handles then: the kernel still sends write, flush (at every close)
  // and fsync, with fh 0, and FileSystem keeps one write state per inode (see file_system.h).
  ctx->no_open = ctx->options.keep_cache && (conn->capable & FUSE_CAP_NO_OPEN_SUPPORT);
  // Under keep_cache (a dataset that does not change under training), every readdir is a
  // readdirplus, not only a directory's first buffer: a scan that lists a class directory is
  // followed by an open of each of its files, and the entries it brings spare those opens a
  // LOOKUP each.
  if (ctx->options.keep_cache) conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
  CTFS_LOG(kInfo) << "FUSE session started: protocol " << conn->proto_major << "."
                  << conn->proto_minor << ", max_read " << ctx->options.max_read << ", transport "
                  << (ctx->io_uring ? "io_uring" : "/dev/fuse")
                  << (ctx->passthrough != nullptr && ctx->passthrough->enabled()
                          ? ", large files by passthrough"
                          : "");
}

void Lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  OpScope scope(req, kLookup);
  FuseContext& ctx = Ctx(req);
  Result<Entry> e = ctx.fs->Lookup(parent, name);
  if (!e.ok()) {
    if (e.status().IsNotFound() && ctx.options.negative_timeout_s > 0) {
      fuse_entry_param neg{};  // ino 0: the kernel caches the absence
      neg.entry_timeout = ctx.options.negative_timeout_s;
      fuse_reply_entry(req, &neg);
      return;
    }
    ReplyError(req, e.status(), "lookup");
    return;
  }
  fuse_entry_param param = ToEntryParam(ctx, e->ino, e->attr);
  fuse_reply_entry(req, &param);
}

void Forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  OpScope scope(req, kForget);
  Ctx(req).fs->Forget(ino, nlookup);
  fuse_reply_none(req);
}

void ForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  OpScope scope(req, kForget);
  for (size_t i = 0; i < count; ++i) Ctx(req).fs->Forget(forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void GetAttr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  OpScope scope(req, kGetattr);
  FuseContext& ctx = Ctx(req);
  Result<cfs_client::FileAttr> a = ctx.fs->GetAttr(ino);
  if (!a.ok()) return ReplyError(req, a.status(), "getattr");
  struct stat st = ToStat(ino, a.value());
  fuse_reply_attr(req, &st, ctx.options.attr_timeout_s);
}

void ReadLink(fuse_req_t req, fuse_ino_t ino) {
  OpScope scope(req, kReadlink);
  Result<std::string> target = Ctx(req).fs->ReadLink(ino);
  if (!target.ok()) return ReplyError(req, target.status(), "readlink");
  fuse_reply_readlink(req, target->c_str());
}

void OpenDir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  OpScope scope(req, kOpendir);
  Result<std::unique_ptr<DirHandle>> dir = Ctx(req).fs->OpenDir(ino, fuse_req_ctx(req)->uid);
  if (!dir.ok()) return ReplyError(req, dir.status(), "opendir");
  fi->fh = Ctx(req).dirs.Insert(std::move(dir).value());
  fi->cache_readdir = Ctx(req).options.keep_cache;
  if (fuse_reply_open(req, fi) == -ENOENT) Ctx(req).dirs.Take(fi->fh);
}

// The directory handle `fh` of `ino`. A number this process did not give out was given out by
// the process it took over from (daemon/supervisor.h): the directory is listed again and kept
// under that number until its release.
Result<std::shared_ptr<DirHandle>> DirOf(FuseContext& ctx, fuse_ino_t ino, uint64_t fh) {
  if (std::shared_ptr<DirHandle> dir = ctx.dirs.Get(fh)) return dir;
  CTFS_ASSIGN_OR_RETURN(std::unique_ptr<DirHandle> dir, ctx.fs->OpenDir(ino));
  return ctx.dirs.Adopt(fh, std::move(dir));
}

// Lists entries from `offset` (0 = start; entry i has offset i+1, "." and ".." first), from
// the directory's window (FileSystem::DirEntryAt).
void DoReadDir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset, fuse_file_info* fi,
               bool plus) {
  FuseContext& ctx = Ctx(req);
  Result<std::shared_ptr<DirHandle>> opened = DirOf(ctx, ino, fi->fh);
  if (!opened.ok()) return ReplyError(req, opened.status(), plus ? "readdirplus" : "readdir");
  DirHandle& dir = **opened;
  MutexLock lock(dir.mu);
  std::vector<char> buf(size);
  size_t used = 0;
  for (uint64_t i = static_cast<uint64_t>(offset);; ++i) {
    const bool dot = i < 2;
    if (!dot) {
      // The entry from the listing's window, the next page listed when the window ends.
      Result<bool> there = ctx.fs->DirEntryAt(dir, i - 2);
      if (!there.ok()) {
        if (used == 0) return ReplyError(req, there.status(), plus ? "readdirplus" : "readdir");
        break;  // what was listed goes now; the next readdir asks for the rest again
      }
      if (!*there) break;
    }
    const cfs_client::DirEntry* de = dot ? nullptr : &dir.entries[i - 2 - dir.first];
    const char* name = i == 0 ? "." : i == 1 ? ".." : de->name.c_str();
    const off_t next = static_cast<off_t>(i + 1);
    if (!plus) {
      struct stat st {};
      // d_ino must not be 0 (readdir(3) skips such entries). Without a lookup there is no
      // inode number yet, so give a stable one derived from the name; stat() shows the real one.
      st.st_ino = dot ? dir.ino : (std::hash<std::string>{}(de->name) | 1);
      st.st_mode = dot ? S_IFDIR : de->attr.mode;
      size_t n = fuse_add_direntry(req, buf.data() + used, size - used, name, &st, next);
      if (n > size - used) break;
      used += n;
      continue;
    }
    if (fuse_add_direntry_plus(req, nullptr, 0, name, nullptr, 0) > size - used) break;
    fuse_entry_param e{};
    if (dot) {
      // ino 0: the kernel makes no dentry and takes no lookup for "." and "..".
      e.attr.st_ino = dir.ino;
      e.attr.st_mode = S_IFDIR;
    } else {
      e = ToEntryParam(ctx, ctx.fs->AcquireDirEntry(dir, *de), de->attr);
    }
    used += fuse_add_direntry_plus(req, buf.data() + used, size - used, name, &e, next);
  }
  fuse_reply_buf(req, buf.data(), used);
}

void ReadDir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  OpScope scope(req, kReaddir);
  DoReadDir(req, ino, size, off, fi, false);
}

void ReadDirPlus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  OpScope scope(req, kReaddirplus);
  DoReadDir(req, ino, size, off, fi, true);
}

void ReleaseDir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  OpScope scope(req, kReleasedir);
  Ctx(req).dirs.Take(fi->fh);
  fuse_reply_err(req, 0);
}

void Open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  OpScope scope(req, kOpen);
  FuseContext& ctx = Ctx(req);
  // Under no_open no release will come for this handle, so it must not count as a writer.
  Result<OpenResult> r =
      ctx.fs->Open(ino, fi->flags, /*track_handle=*/!ctx.no_open, fuse_req_ctx(req)->uid);
  if (!r.ok()) return ReplyError(req, r.status(), "open");
  if (ctx.no_open) {
    // ENOSYS to a valid open tells the kernel to stop sending opens (and releases) for every
    // file; reads then arrive with fh 0 and are served at the inode's current version, writes
    // with fh 0 go to the inode's write state, closed at flush.
    fuse_reply_err(req, ENOSYS);
    return;
  }
  if (r->invalidate_inode && ctx.session != nullptr) {
    // The file changed in the store since the kernel last saw it: drop its cached size and
    // pages, so the new version is read in full.
    int err = fuse_lowlevel_notify_inval_inode(ctx.session, ino, 0, 0);
    if (err != 0 && err != -ENOENT) CTFS_LOG(kWarn) << "invalidate inode " << ino << ": " << err;
  }
  Passthrough::Answer pt;
  if (ctx.passthrough != nullptr) {
    // Read by the kernel from the store's file, or as usual (passthrough.h has the rules).
    FileHandle& h = *r->handle;
    const bool writes = (fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC) != 0;
    Result<Passthrough::Answer> a =
        ctx.passthrough->Open(ino, writes, h.version.id, [&] { return ctx.fs->PassthroughFd(h); });
    if (!a.ok()) {
      Status ignored = ctx.fs->Release(ino, r->handle.get());
      (void)ignored;
      return ReplyError(req, a.status(), "open");
    }
    pt = *a;
    h.passthrough = pt.mode == Passthrough::Mode::kPassthrough;
    if (pt.direct_io) fi->direct_io = 1;  // a writer beside passthrough readers
  }
  // A passthrough open keeps no page cache of ours (the kernel refuses the two together).
  fi->keep_cache = pt.backing_id != 0 ? 0 : r->keep_cache;
  fi->fh = ctx.files.Insert(std::move(r->handle));
  PassthroughReply reply(pt.backing_id);
  if (fuse_reply_open(req, fi) == -ENOENT) {
    // The caller was interrupted: no release will come for this handle, which may count as
    // a writer of the file.
    std::shared_ptr<FileHandle> h = ctx.files.Take(fi->fh);
    if (ctx.passthrough != nullptr) ctx.passthrough->Undo(ino, pt.mode);
    Status ignored = ctx.fs->Release(ino, h.get());
    (void)ignored;
  }
}

void Read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  OpScope scope(req, kRead);
  FuseContext& ctx = Ctx(req);
  // Until the reply is sent, no page-cache store of the inode is made (fuse/page_probe.cc).
  ctx.fs->BeginKernelRead(ino);
  struct EndRead {
    FileSystem* fs;
    uint64_t ino;
    ~EndRead() { fs->EndKernelRead(ino); }
  } end_read{ctx.fs, ino};
  // The reader: a read moves only its own prefetch streams.
  const int64_t uid = fuse_req_ctx(req)->uid;
  Result<ReadResult> r = [&]() -> Result<ReadResult> {
    if (fi->fh != 0) {
      if (std::shared_ptr<FileHandle> h = ctx.files.Get(fi->fh))
        return ctx.fs->Read(*h, static_cast<uint64_t>(off), size, uid);
    }
    // Opened without an open request (no_open): read the inode's current version. Opened
    // before this process took the mount over (a handle number it never gave out): the same,
    // unless the file changed since it was opened (then ESTALE, never another version's bytes).
    CTFS_ASSIGN_OR_RETURN(FileHandle h, ctx.fs->HandleFor(ino, /*opened_before=*/fi->fh != 0));
    return ctx.fs->Read(h, static_cast<uint64_t>(off), size, uid);
  }();
  if (!r.ok()) return ReplyError(req, r.status(), "read");
  if (r->store) {
    // From the store's file to the kernel: libfuse splices it through a pipe when the kernel
    // allows (FUSE_CAP_SPLICE_WRITE), else reads it into memory and writes that. `r` keeps the
    // descriptor open until the reply is sent.
    fuse_bufvec data = FUSE_BUFVEC_INIT(r->store->length);
    data.buf[0].flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
    data.buf[0].fd = r->store->fd;
    data.buf[0].pos = static_cast<off_t>(r->store->offset);
    fuse_reply_data(req, &data, static_cast<fuse_buf_copy_flags>(0));
    return;
  }
  // Reply straight from the cached buffers; the slices keep them alive until the reply is sent.
  std::vector<iovec> iov;
  iov.reserve(r->slices.size());
  for (const auto& s : r->slices)
    iov.push_back({const_cast<char*>(s.buffer->data.get()) + s.offset, s.length});
  fuse_reply_iov(req, iov.data(), static_cast<int>(iov.size()));
}

void Release(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  OpScope scope(req, kRelease);
  FuseContext& ctx = Ctx(req);
  std::shared_ptr<FileHandle> handle = ctx.files.Take(fi->fh);
  if (ctx.passthrough != nullptr) {
    // A number this process never gave out: its mode is the table's to infer.
    ctx.passthrough->Release(ino, handle == nullptr
                                      ? std::nullopt
                                      : std::optional<Passthrough::Mode>(
                                            handle->passthrough ? Passthrough::Mode::kPassthrough
                                                                : Passthrough::Mode::kCached));
  }
  // A number this process never gave out was opened before a takeover: nothing to release.
  if (handle != nullptr) {
    // close(2) already got flush's answer; an error here (logged) keeps the bytes for later.
    Status ignored = ctx.fs->Release(ino, handle.get());
    (void)ignored;
  }
  fuse_reply_err(req, 0);
}

Owner OwnerOf(fuse_req_t req) {
  const fuse_ctx* c = fuse_req_ctx(req);
  return Owner{static_cast<int64_t>(c->uid), static_cast<int64_t>(c->gid)};
}

void ReplyEntry(fuse_req_t req, const Result<Entry>& e, const char* op) {
  if (!e.ok()) return ReplyError(req, e.status(), op);
  fuse_entry_param param = ToEntryParam(Ctx(req), e->ino, e->attr);
  fuse_reply_entry(req, &param);
}

void Create(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, fuse_file_info* fi) {
  OpScope scope(req, kCreate);
  FuseContext& ctx = Ctx(req);
  // Under no_open the kernel may or may not send a release for this handle (it stops once it
  // saw ENOSYS on an open), so it never counts as a writer: the write state closes at flush.
  Result<FileSystem::Created> c =
      ctx.fs->Create(parent, name, mode, fi->flags, OwnerOf(req), !ctx.no_open);
  if (!c.ok()) return ReplyError(req, c.status(), "create");
  fuse_entry_param param = ToEntryParam(ctx, c->entry.ino, c->entry.attr);
  fi->keep_cache = 0;
  // A new file is written, not read: its bytes go from the writer's buffer to the request
  // without a copy into this mount's page cache (which would only hold them twice).
  fi->direct_io = 1;
  if (ctx.no_open) {
    fi->fh = 0;
    fuse_reply_create(req, &param, fi);
    return;
  }
  if (ctx.passthrough != nullptr) {
    // Counted as an open for writing. A create reply cannot name a registration (only an
    // open reply is patched): a file made meanwhile by another and held through passthrough
    // (a race: the kernel creates only names its lookup did not find) is refused.
    Result<Passthrough::Answer> a =
        ctx.passthrough->Open(c->entry.ino, /*writable=*/true, 0, [] { return -1; });
    if (a.ok() && a->mode == Passthrough::Mode::kPassthrough) {
      ctx.passthrough->Undo(c->entry.ino, a->mode);
      a = Status::Errno(ETXTBSY, "create: the file is open through passthrough");
    }
    if (!a.ok()) {
      Status ignored = ctx.fs->Release(c->entry.ino, c->handle.get());
      (void)ignored;
      return ReplyError(req, a.status(), "create");
    }
  }
  fi->fh = ctx.files.Insert(std::move(c->handle));
  if (fuse_reply_create(req, &param, fi) == -ENOENT) {
    // The caller was interrupted: no release will come for this handle.
    std::shared_ptr<FileHandle> h = ctx.files.Take(fi->fh);
    if (ctx.passthrough != nullptr) ctx.passthrough->Undo(c->entry.ino, Passthrough::Mode::kCached);
    Status ignored = ctx.fs->Release(c->entry.ino, h.get());
    (void)ignored;
  }
}

void Mknod(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, dev_t rdev) {
  OpScope scope(req, kMknod);
  ReplyEntry(req, Ctx(req).fs->Mknod(parent, name, mode, rdev, OwnerOf(req)), "mknod");
}

void Mkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  OpScope scope(req, kMkdir);
  ReplyEntry(req, Ctx(req).fs->Mkdir(parent, name, mode, OwnerOf(req)), "mkdir");
}

void Symlink(fuse_req_t req, const char* target, fuse_ino_t parent, const char* name) {
  OpScope scope(req, kSymlink);
  ReplyEntry(req, Ctx(req).fs->Symlink(target, parent, name, OwnerOf(req)), "symlink");
}

void Link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t new_parent, const char* new_name) {
  OpScope scope(req, kLink);
  ReplyEntry(req, Ctx(req).fs->Link(ino, new_parent, new_name), "link");
}

void Unlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  OpScope scope(req, kUnlink);
  Status s = Ctx(req).fs->Unlink(parent, name);
  if (!s.ok()) return ReplyError(req, s, "unlink");
  fuse_reply_err(req, 0);
}

void Rmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  OpScope scope(req, kRmdir);
  Status s = Ctx(req).fs->Rmdir(parent, name);
  if (!s.ok()) return ReplyError(req, s, "rmdir");
  fuse_reply_err(req, 0);
}

void Rename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t new_parent,
            const char* new_name, unsigned flags) {
  OpScope scope(req, kRename);
  Status s = Ctx(req).fs->Rename(parent, name, new_parent, new_name, flags);
  if (!s.ok()) return ReplyError(req, s, "rename");
  fuse_reply_err(req, 0);
}

void Write(fuse_req_t req, fuse_ino_t ino, const char* buf, size_t size, off_t off,
           fuse_file_info*) {
  OpScope scope(req, kWrite);
  Result<size_t> n = Ctx(req).fs->Write(ino, static_cast<uint64_t>(off), buf, size);
  if (!n.ok()) return ReplyError(req, n.status(), "write");
  fuse_reply_write(req, *n);
}

void Flush(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  OpScope scope(req, kFlush);
  FuseContext& ctx = Ctx(req);
  Status s = ctx.fs->Flush(ino);
  if (!s.ok()) return ReplyError(req, s, "flush");
  // On a read-only mount (nothing ever to flush), or under no_open with flush_on_close off,
  // ENOSYS after doing the work tells the kernel to send no FLUSH again, for any file: a
  // close then never reaches the daemon. The close that got it still returns 0.
  if (ctx.options.read_only || (ctx.no_open && !ctx.options.flush_on_close)) {
    fuse_reply_err(req, ENOSYS);
    return;
  }
  fuse_reply_err(req, 0);
}

// No ioctl is served. Python before 3.14 asks every file it open()s whether it is a terminal
// (TCGETS), a round trip each: counted here so that benchmarks see them, answered "not a tty".
void Ioctl(fuse_req_t req, fuse_ino_t, unsigned int, void*, fuse_file_info*, unsigned, const void*,
           size_t, size_t) {
  OpScope scope(req, kIoctl);
  fuse_reply_err(req, ENOTTY);
}

void Fsync(fuse_req_t req, fuse_ino_t ino, int, fuse_file_info*) {
  OpScope scope(req, kFsync);
  Status s = Ctx(req).fs->Fsync(ino);
  if (!s.ok()) return ReplyError(req, s, "fsync");
  fuse_reply_err(req, 0);
}

void FsyncDir(fuse_req_t req, fuse_ino_t ino, int, fuse_file_info*) {
  OpScope scope(req, kFsyncdir);
  Status s = Ctx(req).fs->FsyncDir(ino);
  if (!s.ok()) return ReplyError(req, s, "fsyncdir");
  fuse_reply_err(req, 0);
}

void Fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
               fuse_file_info*) {
  OpScope scope(req, kFallocate);
  Status s = Ctx(req).fs->Fallocate(ino, mode, static_cast<uint64_t>(offset),
                                    static_cast<uint64_t>(length));
  if (!s.ok()) return ReplyError(req, s, "fallocate");
  fuse_reply_err(req, 0);
}

int64_t TimeOf(const struct timespec& ts) {
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void SetAttr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info*) {
  OpScope scope(req, kSetattr);
  FuseContext& ctx = Ctx(req);
  FileSystem::AttrChange c;
  if (to_set & FUSE_SET_ATTR_SIZE) c.size = static_cast<uint64_t>(attr->st_size);
  if (to_set & FUSE_SET_ATTR_MODE) c.meta.mode = attr->st_mode & 07777;
  if (to_set & FUSE_SET_ATTR_UID) c.meta.uid = attr->st_uid;
  if (to_set & FUSE_SET_ATTR_GID) c.meta.gid = attr->st_gid;
  if (to_set & FUSE_SET_ATTR_ATIME_NOW) {
    c.meta.atime_ns = cfs_client::AttrChange::kTimeNow;
  } else if (to_set & FUSE_SET_ATTR_ATIME) {
    c.meta.atime_ns = TimeOf(attr->st_atim);
  }
  if (to_set & FUSE_SET_ATTR_MTIME_NOW) {
    c.meta.mtime_ns = cfs_client::AttrChange::kTimeNow;
  } else if (to_set & FUSE_SET_ATTR_MTIME) {
    c.meta.mtime_ns = TimeOf(attr->st_mtim);
  }
  Result<cfs_client::FileAttr> a = ctx.fs->SetAttr(ino, c);
  if (!a.ok()) return ReplyError(req, a.status(), "setattr");
  struct stat st = ToStat(ino, a.value());
  fuse_reply_attr(req, &st, ctx.options.attr_timeout_s);
}

void StatFs(fuse_req_t req, fuse_ino_t) {
  OpScope scope(req, kStatfs);
  Result<cfs_client::FsStats> s = Ctx(req).fs->StatFs();
  if (!s.ok()) return ReplyError(req, s.status(), "statfs");
  struct statvfs sv {};
  sv.f_bsize = sv.f_frsize = s->block_size;
  sv.f_blocks = s->blocks;
  sv.f_bfree = s->blocks_free;
  sv.f_bavail = s->blocks_avail;
  sv.f_files = s->files;
  sv.f_ffree = sv.f_favail = s->files_free;
  sv.f_namemax = s->name_max;
  fuse_reply_statfs(req, &sv);
}

void Access(fuse_req_t req, fuse_ino_t ino, int mask) {
  OpScope scope(req, kAccess);
  Status s = Ctx(req).fs->Access(ino, mask);
  fuse_reply_err(req, ToErrno(s));
}

// Extended attributes are not kept. ENOSYS tells the kernel once and for all, so it answers
// EOPNOTSUPP to callers itself instead of asking on every `ls -l`.
void GetXattr(fuse_req_t req, fuse_ino_t, const char*, size_t) {
  OpScope scope(req, kGetxattr);
  fuse_reply_err(req, ENOSYS);
}

void ListXattr(fuse_req_t req, fuse_ino_t, size_t) {
  OpScope scope(req, kListxattr);
  fuse_reply_err(req, ENOSYS);
}

// The kernel's answer to a page probe (FUSE_NOTIFY_RETRIEVE): only the size matters.
void RetrieveReply(fuse_req_t req, void* cookie, fuse_ino_t, off_t, fuse_bufvec* bufv) {
  auto* ctx = static_cast<FuseContext*>(fuse_req_userdata(req));
  if (ctx->page_probe != nullptr) ctx->page_probe->OnReply(cookie, fuse_buf_size(bufv));
  fuse_reply_none(req);
}

// Extended attributes are not kept: setting or removing one is not supported.
void ReplyNoXattr(fuse_req_t req) {
  OpScope scope(req, kXattrWrite);
  fuse_reply_err(req, ENOTSUP);
}

}  // namespace

const fuse_lowlevel_ops& Operations() {
  static const fuse_lowlevel_ops ops = [] {
    fuse_lowlevel_ops o{};
    o.init = Init;
    o.lookup = Lookup;
    o.forget = Forget;
    o.forget_multi = ForgetMulti;
    o.getattr = GetAttr;
    o.readlink = ReadLink;
    o.opendir = OpenDir;
    o.readdir = ReadDir;
    o.readdirplus = ReadDirPlus;
    o.releasedir = ReleaseDir;
    o.open = Open;
    o.read = Read;
    o.release = Release;
    o.statfs = StatFs;
    o.access = Access;
    o.getxattr = GetXattr;
    o.listxattr = ListXattr;
    o.setattr = SetAttr;
    o.create = Create;
    o.mknod = Mknod;
    o.mkdir = Mkdir;
    o.unlink = Unlink;
    o.rmdir = Rmdir;
    o.symlink = Symlink;
    o.rename = Rename;
    o.link = Link;
    o.write = Write;
    o.flush = Flush;
    o.fsync = Fsync;
    o.fsyncdir = FsyncDir;
    o.fallocate = Fallocate;
    o.ioctl = Ioctl;
    o.retrieve_reply = RetrieveReply;
    o.setxattr = [](fuse_req_t req, fuse_ino_t, const char*, const char*, size_t, int) {
      ReplyNoXattr(req);
    };
    o.removexattr = [](fuse_req_t req, fuse_ino_t, const char*) { ReplyNoXattr(req); };
    return o;
  }();
  return ops;
}

}  // namespace cubetorchfs::fuse
