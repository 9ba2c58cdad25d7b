#include "cache/disk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/file_system.h>
#include <rocksdb/write_batch.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "cache/crc32c.h"
#include "common/logging.h"
#include "common/private_dir.h"
#include "common/thread_annotations.h"
#include "common/unique_fd.h"

namespace cubetorchfs::cache {
namespace {

struct IndexValue {
  uint64_t id = 0;
  uint64_t length = 0;
  uint32_t crc = 0;
  uint64_t seq = 0;

  std::string Encode() const {
    std::string v(28, '\0');
    std::memcpy(&v[0], &id, 8);
    std::memcpy(&v[8], &length, 8);
    std::memcpy(&v[16], &crc, 4);
    std::memcpy(&v[20], &seq, 8);
    return v;
  }
  static bool Decode(const std::string& v, IndexValue* out) {
    if (v.size() != 28) return false;
    std::memcpy(&out->id, &v[0], 8);
    std::memcpy(&out->length, &v[8], 8);
    std::memcpy(&out->crc, &v[16], 4);
    std::memcpy(&out->seq, &v[20], 8);
    return true;
  }
};

std::string IdName(uint64_t id) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(id));
  return buf;
}

Status Errno(const std::string& what) {
  return Status::IOError(what + ": " + std::strerror(errno));
}

// The tier holds copies of files other users may not read.
Status PrivateDir(const std::string& dir) {
  return EnsurePrivateDir(dir, "cache.disk_dir", "cached data", CreateDir::kWithParents);
}

// RocksDB's file system, creating every file of the index 0600 (RocksDB itself uses 0644).
class PrivateFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  using FileSystemWrapper::FileSystemWrapper;
  const char* Name() const override { return "CubetorchfsPrivateFileSystem"; }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* d) override {
    return Private(f, target()->NewWritableFile(f, o, r, d));
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* d) override {
    return Private(f, target()->ReopenWritableFile(f, o, r, d));
  }
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old,
                                      const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* d) override {
    return Private(f, target()->ReuseWritableFile(f, old, o, r, d));
  }
  rocksdb::IOStatus NewRandomRWFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSRandomRWFile>* r,
                                    rocksdb::IODebugContext* d) override {
    return Private(f, target()->NewRandomRWFile(f, o, r, d));
  }
  rocksdb::IOStatus LockFile(const std::string& f, const rocksdb::IOOptions& o,
                             rocksdb::FileLock** l, rocksdb::IODebugContext* d) override {
    return Private(f, target()->LockFile(f, o, l, d));
  }
  rocksdb::IOStatus NewLogger(const std::string& f, const rocksdb::IOOptions& o,
                              std::shared_ptr<rocksdb::Logger>* r,
                              rocksdb::IODebugContext* d) override {
    return Private(f, target()->NewLogger(f, o, r, d));
  }

 private:
  // The file is in the 0700 index directory, so it was never readable by others meanwhile.
  static rocksdb::IOStatus Private(const std::string& f, rocksdb::IOStatus s) {
    if (s.ok()) ::chmod(f.c_str(), 0600);
    return s;
  }
};

class NvmeCache final : public DiskCache {
 public:
  NvmeCache(const Options& options, std::unique_ptr<rocksdb::Env> env, rocksdb::DB* db,
            prometheus::Registry* registry)
      : options_(options), env_(std::move(env)), db_(db) {
    if (registry != nullptr) {
      bytes_gauge_ = &prometheus::BuildGauge()
                          .Name("cubetorchfs_cache_bytes")
                          .Help("Bytes held by each cache tier")
                          .Register(*registry)
                          .Add({{"tier", "disk"}});
      evictions_ = &prometheus::BuildCounter()
                        .Name("cubetorchfs_cache_evictions_total")
                        .Help("Entries evicted from each cache tier to make room")
                        .Register(*registry)
                        .Add({{"tier", "disk"}});
      corruptions_counter_ = &prometheus::BuildCounter()
                                  .Name("cubetorchfs_cache_corruptions_total")
                                  .Help("NVMe-tier chunks that failed their CRC32C check")
                                  .Register(*registry)
                                  .Add({});
    }
  }

  ~NvmeCache() override {
    {
      MutexLock l(queue_mu_);
      stop_ = true;
    }
    queue_cv_.SignalAll();
    if (writer_.joinable()) writer_.join();
  }

  // Runs in Open, before the cache is shared with any other thread: unlocked, unchecked.
  Status Recover() NO_THREAD_SAFETY_ANALYSIS {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::remove_all(TmpDir(), ec);  // a symlink there is removed, never followed
    CTFS_RETURN_IF_ERROR(PrivateDir(TmpDir()));
    // Index entries whose data is missing or short: a crash between data and index, or a
    // file removed by hand.
    rocksdb::WriteBatch drop;
    std::vector<std::pair<uint64_t, std::string>> by_seq;
    std::unordered_set<uint64_t> live;
    size_t narrowed = 0;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      IndexValue v;
      struct stat st;
      const std::string key = it->key().ToString();
      if (!IndexValue::Decode(it->value().ToString(), &v) ||
          ::lstat(DataPath(v.id).c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
          static_cast<uint64_t>(st.st_size) != v.length) {
        drop.Delete(key);
        continue;
      }
      // Chunks written by an older version were 0644 (in a directory now 0700).
      if ((st.st_mode & 0777) != 0600 && ::chmod(DataPath(v.id).c_str(), 0600) == 0) ++narrowed;
      Entry& e = index_[key];
      e.value = v;
      by_seq.emplace_back(v.seq, key);
      live.insert(v.id);
      bytes_ += v.length;
      next_id_ = std::max(next_id_, v.id + 1);
      next_seq_ = std::max(next_seq_, v.seq + 1);
    }
    if (!it->status().ok())
      return Status::IOError("cache.disk_dir: index: " + it->status().ToString());
    it.reset();
    if (narrowed > 0)
      CTFS_LOG(kInfo) << "NVMe tier " << options_.dir << ": made " << narrowed
                      << " chunk files 0600 (they were readable by others)";
    const size_t dropped = drop.Count();
    if (dropped > 0) db_->Write(rocksdb::WriteOptions(), &drop);
    // Data files no entry names: written but never indexed.
    size_t orphans = 0;
    for (const auto& f : fs::directory_iterator(DataDir(), ec)) {
      const std::string name = f.path().filename();
      char* end = nullptr;
      uint64_t id = std::strtoull(name.c_str(), &end, 16);
      if (name.size() != 16 || *end != '\0' || !live.count(id)) {
        fs::remove(f.path(), ec);
        ++orphans;
      }
    }
    std::sort(by_seq.begin(), by_seq.end());
    for (const auto& [seq, key] : by_seq) {  // oldest ends up at the back
      lru_.push_front(key);
      index_[key].lru = lru_.begin();
    }
    if (bytes_gauge_) bytes_gauge_->Set(static_cast<double>(bytes_));
    CTFS_LOG(kInfo) << "NVMe tier " << options_.dir << ": " << index_.size() << " chunks, "
                    << bytes_ << " bytes; dropped " << dropped << " unfinished entries and "
                    << orphans << " orphan files";
    writer_ = std::thread([this] { WriterLoop(); });
    return Status::OK();
  }

  Result<BufferRef> Get(const std::string& key) override {
    IndexValue v;
    {
      MutexLock l(mu_);
      auto it = index_.find(key);
      if (it == index_.end()) return Status::NotFound("not in the NVMe tier");
      v = it->second.value;
      lru_.splice(lru_.begin(), lru_, it->second.lru);
    }
    std::shared_ptr<Buffer> buf = Buffer::Allocate(v.length);
    UniqueFd fd(::open(DataPath(v.id).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (fd.get() < 0) {
      // e.g. out of descriptors: keep it. A symlink (ELOOP) is not our chunk.
      if (errno != ENOENT && errno != ELOOP) return Errno(DataPath(v.id));
      DropIfSame(key, v.id);  // evicted meanwhile, or removed by hand
      return Status::NotFound("chunk file gone");
    }
    size_t done = 0;
    while (done < v.length) {
      ssize_t n =
          ::pread(fd.get(), buf->data.get() + done, v.length - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    if (done != v.length || Crc32c(buf->data.get(), v.length) != v.crc) {
      corruptions_.fetch_add(1);
      if (corruptions_counter_) corruptions_counter_->Increment();
      CTFS_LOG(kWarn) << "NVMe tier: chunk " << IdName(v.id) << " failed its CRC32C check; "
                      << "dropped, the data comes from the store again";
      DropIfSame(key, v.id);
      return Status::NotFound("corrupt chunk dropped");
    }
    return BufferRef(std::move(buf));
  }

  bool Contains(const std::string& key) override {
    MutexLock l(mu_);
    return index_.count(key) > 0;
  }

  Status Put(const std::string& key, const Buffer& data) override {
    const uint64_t length = data.size;
    // File-system calls stay outside mu_ (readers take it): the free space is read first, and
    // the evicted chunks' files and index rows are removed after.
    struct statvfs sv;
    const bool have_sv = ::statvfs(options_.dir.c_str(), &sv) == 0 && sv.f_blocks > 0;
    uint64_t id = 0, seq = 0;
    std::vector<Victim> victims;
    Status room;
    {
      MutexLock l(mu_);
      if (index_.count(key) || pending_.count(key)) return Status::OK();
      room = MakeRoomLocked(length, have_sv ? &sv : nullptr, &victims);
      if (room.ok()) {
        bytes_ += length;  // reserved now, so concurrent puts cannot overshoot
        id = next_id_++;
        seq = next_seq_++;
        pending_.insert(key);
      }
    }
    RemoveVictims(victims);
    CTFS_RETURN_IF_ERROR(room);
    Status s = WriteChunk(id, data);
    const uint32_t crc = s.ok() ? Crc32c(data.data.get(), length) : 0;
    if (s.ok() && options_.crash_point == Options::CrashPoint::kNone) {
      IndexValue v{id, length, crc, seq};
      rocksdb::Status rs;
      {
        MutexLock db(db_mu_);
        rs = db_->Put(rocksdb::WriteOptions(), key, v.Encode());
      }
      if (rs.ok()) {
        MutexLock l(mu_);
        pending_.erase(key);
        lru_.push_front(key);
        index_[key] = Entry{v, lru_.begin()};
        if (bytes_gauge_) bytes_gauge_->Set(static_cast<double>(bytes_));
        return Status::OK();
      }
      ::unlink(DataPath(id).c_str());
      s = Status::IOError("NVMe tier index: " + rs.ToString());
    }
    MutexLock l(mu_);
    pending_.erase(key);
    bytes_ -= length;
    return s.ok() ? Status::IOError("simulated crash") : s;
  }

  void PutAsync(const std::string& key, BufferRef data) override {
    if (Contains(key)) return;  // already on the tier (mu_, then queue_mu_: never both)
    {
      MutexLock l(queue_mu_);
      if (queued_keys_.count(key)) return;
      // The tier is behind: drop (a later demotion may bring it back). An empty queue takes
      // any one chunk, so chunks bigger than the queue still get written.
      if (!queue_.empty() && queued_bytes_ + data->size > options_.queue_bytes) {
        if (dropped_++ % 1000 == 0)
          CTFS_LOG(kWarn) << "NVMe tier writer is behind; " << dropped_ << " chunks not written";
        return;
      }
      queued_bytes_ += data->size;
      queued_keys_.insert(key);
      queue_.emplace_back(key, std::move(data));
    }
    queue_cv_.SignalAll();
  }

  void Flush() override {
    MutexLock l(queue_mu_);
    while (!queue_.empty() || writing_) queue_cv_.Wait();
  }

  void EraseFile(const std::string& path) override {
    {
      // Queued chunks of the file are dropped; one being written is waited for, so it is
      // indexed (and erased below) rather than appearing after this returns.
      MutexLock l(queue_mu_);
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (IsKeyOfFile(it->first, path)) {
          queued_bytes_ -= it->second->size;
          queued_keys_.erase(it->first);
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
      // Only the chunk being written now, and only if it is of this file: the writer takes
      // the next chunk without letting go of the lock, so waiting for it to be idle could
      // wait as long as others keep the queue full.
      if (writing_ && IsKeyOfFile(writing_key_, path)) {
        const uint64_t seq = taken_seq_;
        while (done_seq_ < seq) queue_cv_.Wait();
      }
    }
    // The file's chunks are one range of the ordered index: nothing else is looked at.
    std::vector<Victim> victims;
    {
      MutexLock l(mu_);
      for (auto it = index_.lower_bound(FirstKeyOfFile(path)); it != index_.end();) {
        ++erase_visits_;
        if (!IsKeyOfFile(it->first, path)) break;
        auto lru = it->second.lru;
        ++it;
        victims.push_back(DetachLocked(lru));
      }
    }
    RemoveVictims(victims);
  }

  uint64_t bytes() const override {
    MutexLock l(mu_);
    return bytes_;
  }
  uint64_t entries() const override {
    MutexLock l(mu_);
    return index_.size();
  }
  uint64_t corruptions() const override { return corruptions_.load(); }
  uint64_t erase_visits() const override {
    MutexLock l(mu_);
    return erase_visits_;
  }

  std::string DataFileOf(const std::string& key) override {
    MutexLock l(mu_);
    auto it = index_.find(key);
    return it == index_.end() ? "" : DataPath(it->second.value.id);
  }

 private:
  struct Entry {
    IndexValue value;
    std::list<std::string>::iterator lru;
  };

  std::string DataDir() const { return options_.dir + "/data"; }
  std::string TmpDir() const { return options_.dir + "/tmp"; }
  std::string DataPath(uint64_t id) const { return DataDir() + "/" + IdName(id); }

  Status WriteChunk(uint64_t id, const Buffer& data) {
    const std::string tmp = TmpDir() + "/" + IdName(id);
    {
      // 0600 (a umask can only narrow it): the chunk may be of a file only its owner may read.
      UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
      if (fd.get() < 0) return Errno(tmp);
      size_t done = 0;
      while (done < data.size) {
        ssize_t n = ::write(fd.get(), data.data.get() + done, data.size - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          Status s = Errno(tmp);
          ::unlink(tmp.c_str());
          return s;
        }
        done += static_cast<size_t>(n);
      }
      if (::fsync(fd.get()) != 0) {
        Status s = Errno(tmp);
        ::unlink(tmp.c_str());
        return s;
      }
    }
    if (options_.crash_point == Options::CrashPoint::kAfterTempWrite) return Status::OK();
    if (::rename(tmp.c_str(), DataPath(id).c_str()) != 0) {
      Status s = Errno(DataPath(id));
      ::unlink(tmp.c_str());
      return s;
    }
    return Status::OK();
  }

  // A chunk taken out of the in-memory index, whose data file and index row are still to be
  // removed (RemoveVictims, without mu_).
  struct Victim {
    std::string key;
    uint64_t id = 0;
  };

  // REQUIRES: mu_ held. Evicts least recently used chunks (into *victims) until `length` more
  // bytes fit the budget and the file system, as `sv` (null: unknown) saw it, keeps its free
  // share.
  Status MakeRoomLocked(uint64_t length, const struct statvfs* sv, std::vector<Victim>* victims)
      REQUIRES(mu_) {
    if (length > options_.capacity_bytes)
      return Status::InvalidArgument("chunk larger than the tier");
    uint64_t need =
        bytes_ + length > options_.capacity_bytes ? bytes_ + length - options_.capacity_bytes : 0;
    if (sv != nullptr) {
      const double total = static_cast<double>(sv->f_blocks) * sv->f_frsize;
      const double floor = total * options_.min_free_ratio;
      const double avail =
          static_cast<double>(sv->f_bavail) * sv->f_frsize - static_cast<double>(length);
      if (avail < floor) {
        const auto short_by = static_cast<uint64_t>(floor - avail);
        // Space someone else uses is not ours to win back: never empty the tier for it.
        if (short_by > bytes_)
          return Status::IOError("NVMe tier: file system below its free-space floor");
        need = std::max(need, short_by);
      }
    }
    uint64_t freed = 0;
    while (freed < need && !lru_.empty()) {
      auto victim = std::prev(lru_.end());
      freed += index_.at(*victim).value.length;
      victims->push_back(DetachLocked(victim));
      if (evictions_) evictions_->Increment();
    }
    if (bytes_ + length > options_.capacity_bytes)  // the rest is writes still in flight
      return Status::IOError("NVMe tier: full of writes in progress");
    return Status::OK();
  }

  // Takes the chunk at `it` out of the index and use order; its bytes no longer count.
  // REQUIRES: mu_ held.
  Victim DetachLocked(std::list<std::string>::iterator it) REQUIRES(mu_) {
    auto e = index_.find(*it);
    Victim v{*it, e->second.value.id};
    bytes_ -= e->second.value.length;
    index_.erase(e);
    lru_.erase(it);
    if (bytes_gauge_) bytes_gauge_->Set(static_cast<double>(bytes_));
    return v;
  }

  // Removes the data files and index rows of detached chunks. REQUIRES: mu_ not held. A Get
  // that read a victim's entry before it was detached finds its file gone: NotFound, and the
  // caller refetches. A Put of the same key meanwhile keeps its row: the row is deleted only
  // if the key is neither indexed nor being written, checked under db_mu_, which that Put's
  // index write also takes.
  void RemoveVictims(const std::vector<Victim>& victims) EXCLUDES(mu_, db_mu_) {
    if (victims.empty()) return;
    if (options_.before_remove) options_.before_remove();
    for (const Victim& v : victims) ::unlink(DataPath(v.id).c_str());
    MutexLock db(db_mu_);
    rocksdb::WriteBatch batch;
    {
      MutexLock l(mu_);
      for (const Victim& v : victims)
        if (!index_.count(v.key) && !pending_.count(v.key)) batch.Delete(v.key);
    }
    if (batch.Count() > 0) db_->Write(rocksdb::WriteOptions(), &batch);
  }

  void DropIfSame(const std::string& key, uint64_t id) {
    std::vector<Victim> victims;
    {
      MutexLock l(mu_);
      auto it = index_.find(key);
      if (it == index_.end() || it->second.value.id != id) return;
      victims.push_back(DetachLocked(it->second.lru));
    }
    RemoveVictims(victims);
  }

  void WriterLoop() {
    MutexLock l(queue_mu_);
    for (;;) {
      while (!stop_ && queue_.empty()) queue_cv_.Wait();
      if (queue_.empty()) return;  // stopping, nothing left
      auto [key, data] = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
      writing_key_ = key;
      const uint64_t seq = ++taken_seq_;
      l.Unlock();
      Status s = Put(key, *data);
      if (!s.ok()) CTFS_LOG(kDebug) << "NVMe tier: " << s.ToString();
      const uint64_t size = data->size;
      data.reset();
      l.Lock();
      queued_bytes_ -= size;
      queued_keys_.erase(key);
      writing_ = false;
      done_seq_ = seq;
      queue_cv_.SignalAll();
    }
  }

  const Options options_;
  std::unique_ptr<rocksdb::Env> env_;  // RocksDB's, with PrivateFileSystem; outlives db_
  std::unique_ptr<rocksdb::DB> db_;

  // Serialises index writes (db_->Put, deletes of victims' rows) so that a row deleted and
  // written again land in that order. Lock order: db_mu_, then mu_; held by readers only to
  // drop a chunk found missing or corrupt.
  Mutex db_mu_ ACQUIRED_BEFORE(mu_);
  mutable Mutex mu_;  // guards the index below (GUARDED_BY(mu_)); held for no I/O
  // Ordered, so a file's chunks are one range (EraseFile).
  std::map<std::string, Entry, std::less<>> index_ GUARDED_BY(mu_);
  std::list<std::string> lru_ GUARDED_BY(mu_);  // front: most recently used
  uint64_t erase_visits_ GUARDED_BY(mu_) = 0;
  std::unordered_set<std::string> pending_ GUARDED_BY(mu_);  // keys being written
  uint64_t bytes_ GUARDED_BY(mu_) = 0;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  uint64_t next_seq_ GUARDED_BY(mu_) = 1;

  Mutex queue_mu_;  // guards the writer's queue below; never held with mu_ by the same thread
  CondVar queue_cv_{
      &queue_mu_};  // the writer: a chunk queued, or stop; Flush, EraseFile: one written
  std::deque<std::pair<std::string, BufferRef>> queue_ GUARDED_BY(queue_mu_);
  uint64_t queued_bytes_ GUARDED_BY(queue_mu_) = 0;
  std::unordered_set<std::string> queued_keys_ GUARDED_BY(queue_mu_);
  uint64_t dropped_ GUARDED_BY(queue_mu_) = 0;
  bool writing_ GUARDED_BY(queue_mu_) = false;
  std::string writing_key_ GUARDED_BY(queue_mu_);  // the chunk being written, while writing_
  uint64_t taken_seq_ GUARDED_BY(queue_mu_) = 0;   // chunks taken by the writer so far
  uint64_t done_seq_ GUARDED_BY(queue_mu_) = 0;    // the last of them written
  bool stop_ GUARDED_BY(queue_mu_) = false;
  std::thread writer_;

  std::atomic<uint64_t> corruptions_{0};
  prometheus::Gauge* bytes_gauge_ = nullptr;
  prometheus::Counter* evictions_ = nullptr;
  prometheus::Counter* corruptions_counter_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<DiskCache>> DiskCache::Open(const Options& options,
                                                   prometheus::Registry* registry) {
  // Every directory of the tier 0700 and ours, before anything is written into it.
  for (const std::string& d :
       {options.dir, options.dir + "/data", options.dir + "/tmp", options.dir + "/index"})
    CTFS_RETURN_IF_ERROR(PrivateDir(d));
  std::unique_ptr<rocksdb::Env> env =
      rocksdb::NewCompositeEnv(std::make_shared<PrivateFileSystem>(rocksdb::FileSystem::Default()));
  rocksdb::Options db_options;
  db_options.env = env.get();
  db_options.create_if_missing = true;
  db_options.max_open_files = 256;
  db_options.keep_log_file_num = 2;
  rocksdb::DB* db = nullptr;
  rocksdb::Status rs = rocksdb::DB::Open(db_options, options.dir + "/index", &db);
  if (!rs.ok()) return Status::IOError("cache.disk_dir: " + options.dir + ": " + rs.ToString());
  auto cache = std::make_unique<NvmeCache>(options, std::move(env), db, registry);
  CTFS_RETURN_IF_ERROR(cache->Recover());
  return std::unique_ptr<DiskCache>(std::move(cache));
}

}  // namespace cubetorchfs::cache
