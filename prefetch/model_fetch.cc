#include "prefetch/model_fetch.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "cache/tiers.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/unique_fd.h"

namespace cubetorchfs::prefetch {

namespace {

constexpr size_t kMaxStarted = 1024;

// MemAvailable from /proc/meminfo in bytes; 0 if unknown.
uint64_t MemAvailable() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

// Room left under this process's cgroup v2 memory limit (memory files are charged to the
// daemon's cgroup); UINT64_MAX without a limit.
uint64_t CgroupRoom() {
  std::ifstream cg("/proc/self/cgroup");
  std::string line, rel;
  while (std::getline(cg, line))
    if (line.rfind("0::", 0) == 0) rel = line.substr(3);
  if (rel.empty()) return UINT64_MAX;
  const std::string dir = "/sys/fs/cgroup" + (rel == "/" ? std::string() : rel);
  std::ifstream max_in(dir + "/memory.max"), cur_in(dir + "/memory.current");
  std::string max_text;
  uint64_t current = 0;
  if (!(max_in >> max_text) || max_text == "max" || !(cur_in >> current)) return UINT64_MAX;
  const uint64_t limit = std::strtoull(max_text.c_str(), nullptr, 10);
  return limit > current ? limit - current : 0;
}

}  // namespace

uint64_t ModelFetcher::AvailableMemory() {
  uint64_t avail = MemAvailable();
  const uint64_t room = CgroupRoom();
  if (room != UINT64_MAX && (avail == 0 || room < avail)) avail = room == 0 ? 1 : room;
  return avail;
}

namespace {

std::string FileKey(const std::string& path, const cfs_client::FileVersion& v) {
  return path + '\0' + std::to_string(v.size) + '\0' + std::to_string(v.mtime_ns) + '\0' +
         std::to_string(v.id) + '\0' + std::to_string(v.ctime_ns);
}

}  // namespace

ModelFetcher::ModelFetcher(const Options& options, cfs_client::Backend* backend,
                           cache::RamCache* ram, cache::DiskCache* disk)
    : options_(options), backend_(backend), ram_(ram), disk_(disk) {
  if (options_.background_max_bytes > 0)
    for (int i = 0; i < std::max(1, options_.threads); ++i)
      workers_.emplace_back([this] { Worker(); });
}

ModelFetcher::~ModelFetcher() {
  {
    MutexLock lock(mu_);
    stop_ = true;
    jobs_.clear();
  }
  cv_.SignalAll();
  for (auto& t : workers_) t.join();
}

bool ModelFetcher::IsModelFile(const std::string& path) {
  static const std::string kSuffix = ".safetensors";
  return path.size() > kSuffix.size() &&
         path.compare(path.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0;
}

uint64_t ModelFetcher::background_chunks() const {
  MutexLock lock(mu_);
  return background_chunks_;
}

uint64_t ModelFetcher::joined_builds() const {
  MutexLock lock(mu_);
  return joined_builds_;
}

void ModelFetcher::OnRead(const std::string& path, const cfs_client::FileVersion& version,
                          uint64_t offset) {
  if (workers_.empty() || version.size <= options_.chunk_bytes || !IsModelFile(path)) return;
  std::string key = FileKey(path, version);
  {
    MutexLock lock(mu_);
    if (stop_ || !started_.insert(key).second) return;
    started_order_.push_back(key);
    if (started_order_.size() > kMaxStarted) {
      started_.erase(started_order_.front());
      started_order_.pop_front();
    }
    const uint64_t chunks = (version.size + options_.chunk_bytes - 1) / options_.chunk_bytes;
    const uint64_t limit =
        std::max<uint64_t>(1, options_.background_max_bytes / options_.chunk_bytes);
    const uint64_t first = offset / options_.chunk_bytes;
    for (uint64_t c = first; c < chunks && c - first < limit; ++c) {
      jobs_.push_back({path, version, c});
      ++background_chunks_;
    }
  }
  cv_.SignalAll();
}

void ModelFetcher::Worker() {
  for (;;) {
    Job job;
    {
      MutexLock lock(mu_);
      while (!stop_ && jobs_.empty()) cv_.Wait();
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    const std::string key = cache::ChunkKey(job.path, job.version, job.chunk);
    Result<cache::Lookup> got = ram_->GetOrFetch(key, [&] {
      const uint64_t begin = job.chunk * options_.chunk_bytes;
      cache::Tier from;
      return cache::Tiers{ram_, disk_}.ReadThroughDisk(
          *backend_, key, job.path, job.version, begin,
          static_cast<size_t>(std::min(options_.chunk_bytes, job.version.size - begin)), &from);
    });
    if (!got.ok())
      CTFS_LOG(kDebug) << "model prefetch " << job.path << " chunk " << job.chunk << ": "
                       << got.status().ToString();
  }
}

Result<ResidentFile> ModelFetcher::MakeResident(const std::string& path,
                                                const cfs_client::Backend::AttrCheck& check) {
  Result<cfs_client::FileAttr> attr = backend_->Stat(path);
  if (!attr.ok()) {
    if (attr.status().IsNotFound()) return Status::NotFound(path + ": no such file");
    return attr.status();
  }
  if (!attr->IsRegular()) return Status::InvalidArgument(path + ": not a regular file");
  if (check) CTFS_RETURN_IF_ERROR(check(attr.value()));
  const cfs_client::FileVersion version = attr->Version();
  if (disk_ == nullptr) {
    Result<int> own = backend_->OpenReadFd(path, version, check);
    if (!own.ok() && own.status().code() == Status::Code::kPermissionDenied) return own.status();
    if (own.ok()) {
      ResidentFile out;
      out.fd = *own;
      out.store_file = true;
      out.size = version.size;
      out.mtime_ns = version.mtime_ns;
      out.version = version;
      return out;
    }
    if (own.status().code() != Status::Code::kNotSupported)
      CTFS_LOG(kDebug) << "files/open " << path << ": no store descriptor ("
                       << own.status().ToString() << "), making a memory copy";
  }
  const std::string key = FileKey(path, version);

  // Requests for a version already being made resident share that memory file (8 ranks of
  // one node loading one shard make one copy, not 8).
  std::shared_ptr<Inflight> shared;
  bool leader = false;
  {
    MutexLock lock(mu_);
    auto it = inflight_.find(key);
    if (it != inflight_.end()) {
      shared = it->second;
      ++joined_builds_;
    } else {
      const uint64_t avail = AvailableMemory();
      const uint64_t usable =
          avail > resident_inflight_bytes_ ? avail - resident_inflight_bytes_ : 0;
      if (avail != 0 && version.size > usable / 10 * 9)
        return Status::IOError(path + ": " + std::to_string(version.size) +
                               " bytes do not fit in available memory (" + std::to_string(usable) +
                               " bytes, counting files being made resident); read it through "
                               "the mount");
      resident_inflight_bytes_ += version.size;
      shared = std::make_shared<Inflight>();
      inflight_.emplace(key, shared);
      leader = true;
    }
  }
  if (leader) {
    Result<ResidentFile> built = BuildResident(path, version);
    MutexLock lock(mu_);
    resident_inflight_bytes_ -= version.size;
    inflight_.erase(key);
    shared->result = std::move(built);
    shared->done = true;
    cv_.SignalAll();
  } else {
    MutexLock lock(mu_);
    while (!shared->done) cv_.Wait();
  }
  // Every requester gets its own descriptor of the shared memory file; the original is
  // closed when the last requester is done with `shared`.
  if (!shared->result.ok()) return shared->result.status();
  ResidentFile out = shared->result.value();
  out.fd = ::fcntl(shared->result->fd, F_DUPFD_CLOEXEC, 0);
  if (out.fd < 0) return Status::IOError(std::string("dup: ") + std::strerror(errno));
  return out;
}

ModelFetcher::Inflight::~Inflight() {
  if (result.ok() && result->fd >= 0) ::close(result->fd);
}

Status ModelFetcher::FillChunk(int fd, const std::string& path,
                               const cfs_client::FileVersion& version, uint64_t c,
                               std::vector<char>& scratch, FillCounts& counts) {
  const std::string key = cache::ChunkKey(path, version, c);
  const uint64_t off = c * options_.chunk_bytes;
  const size_t len = static_cast<size_t>(std::min(options_.chunk_bytes, version.size - off));
  const cache::Tiers tiers{ram_, disk_};
  cache::Tier from = cache::Tier::kStore;
  cache::BufferRef buf = tiers.Find(key, len, &from);
  if (!buf && disk_ != nullptr) {
    // With an NVMe tier, what the store gives is kept there too.
    CTFS_ASSIGN_OR_RETURN(buf,
                          tiers.ReadThroughDisk(*backend_, key, path, version, off, len, &from));
  }
  const char* src = buf ? buf->data.get() : nullptr;
  if (!buf) {
    // From the store into this thread's buffer (allocated once: no fresh pages per chunk),
    // then into the memory file.
    if (scratch.size() < len) scratch.resize(len);
    CTFS_ASSIGN_OR_RETURN(size_t n, backend_->Read(path, version, off, len, scratch.data()));
    if (n != len) return Status::Stale(path + ": changed while it was read");
    src = scratch.data();
  }
  for (size_t done = 0; done < len;) {
    ssize_t n = ::pwrite(fd, src + done, len - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOError(path + ": filling the memory file: " + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  (from == cache::Tier::kRam    ? counts.ram
   : from == cache::Tier::kDisk ? counts.disk
                                : counts.backend) += len;
  return Status::OK();
}

Result<ResidentFile> ModelFetcher::BuildResident(const std::string& path,
                                                 const cfs_client::FileVersion& version) {
  std::string name =
      "cubetorchfs:" + path.substr(path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
  UniqueFd mfd(static_cast<int>(
      ::memfd_create(name.substr(0, 200).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (mfd.get() < 0) return Status::IOError(std::string("memfd_create: ") + std::strerror(errno));
  if (::ftruncate(mfd.get(), static_cast<off_t>(version.size)) != 0)
    return Status::IOError(path + ": cannot size memory file: " + std::strerror(errno));

  const uint64_t chunks = (version.size + options_.chunk_bytes - 1) / options_.chunk_bytes;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  Mutex err_mu;  // guards first_error
  Status first_error;
  FillCounts counts;
  auto worker = [&] {
    std::vector<char> scratch;
    for (uint64_t c = next++; c < chunks && !failed; c = next++) {
      if (Status s = FillChunk(mfd.get(), path, version, c, scratch, counts); !s.ok()) {
        MutexLock lock(err_mu);
        if (first_error.ok()) first_error = std::move(s);
        failed = true;
      }
    }
  };
  const int threads = static_cast<int>(
      std::min<uint64_t>(static_cast<uint64_t>(std::max(1, options_.threads)), chunks));
  RunOnThreads(threads, worker);
  if (!first_error.ok()) return first_error;

  if (::fcntl(mfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
      0)
    return Status::IOError(std::string("sealing the memory file: ") + std::strerror(errno));
  // A read-only open file description of the same memory for the caller.
  UniqueFd ro(::open(("/proc/self/fd/" + std::to_string(mfd.get())).c_str(), O_RDONLY | O_CLOEXEC));
  if (ro.get() < 0)
    return Status::IOError(std::string("reopening the memory file: ") + std::strerror(errno));
  ResidentFile out;
  out.fd = ro.release();
  out.size = version.size;
  out.mtime_ns = version.mtime_ns;
  out.version = version;
  out.ram_bytes = counts.ram;
  out.disk_bytes = counts.disk;
  out.backend_bytes = counts.backend;
  return out;
}

}  // namespace cubetorchfs::prefetch
