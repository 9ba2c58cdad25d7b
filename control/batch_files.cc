// POST /v1/files/batch: the files of one DataLoader batch in one request, their bytes in one
// sealed memory file handed over with the reply (SCM_RIGHTS). docs/control-api.md says what a
// client may rely on, docs/prefetch.md how the hook's batch mode uses it.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "common/logging.h"
#include "common/unique_fd.h"
#include "control/server_impl.h"

namespace cubetorchfs::control::detail {

Result<PathResolver::Resolved> ServerImpl::CheckToRead(const std::string& p, const Caller& caller,
                                                       PathResolver::Searched* searched) {
  Result<PathResolver::Resolved> r =
      Check(p, caller, /*fresh=*/false, PathResolver::Depth::kFile, searched);
  if (r.ok() && r->attr.mode == 0) r = Check(p, caller, /*fresh=*/true);  // unchecked store
  if (r.ok() && !r->attr.IsRegular()) return Status::InvalidArgument(p + ": not a regular file");
  return r;
}

Response ServerImpl::BatchFiles(const Request& req, const Caller& caller, int* fd) {
  const unsigned v = req.version();
  const std::string& body = req.body();
  if (body.empty() || body.back() != '\0')
    return Error(http::status::bad_request,
                 "body must be paths each followed by a NUL byte (the last one too)", v);
  // Each path checked for the caller as the mount would check its open (the attributes the
  // mount holds, else fresh ones), and its size taken from those attributes.
  struct File {
    std::string path;  // store path; empty when refused
    cfs_client::FileAttr attr;
    uint64_t offset = 0;
    json missing;  // why it is not in the memory file (ErrorJson: the client reads the mount)
  };
  std::vector<File> files;
  PathResolver::Searched searched;  // each directory checked once per batch
  uint64_t total = 0;
  for (size_t at = 0; at < body.size();) {
    const size_t end = body.find('\0', at);
    if (files.size() >= kMaxBatchFiles)
      return Error(http::status::bad_request,
                   "more than " + std::to_string(kMaxBatchFiles) + " files in one batch", v);
    File& f = files.emplace_back();
    const std::string asked = body.substr(at, end - at);
    at = end + 1;
    Result<PathResolver::Resolved> r = CheckToRead(asked, caller, &searched);
    if (!r.ok()) {
      f.missing = ErrorJson(r.status());
      continue;
    }
    if (total + r->attr.size > options_.batch_max_bytes) {
      f.missing = ErrorJson(Status::InvalidArgument(asked + ": past the batch's " +
                                                    std::to_string(options_.batch_max_bytes) +
                                                    " bytes (control.batch_max_bytes)"));
      continue;
    }
    f.path = std::move(r->path);
    f.attr = r->attr;
    f.offset = total;
    total += f.attr.size;
  }
  // The memory file is charged to the daemon's cgroup until its last reference goes, which
  // may be long after the reply (a mapping outlives the descriptor): it is charged to the
  // caller until then (BatchMemory), within the user's bound and half the memory left, and
  // none is made past them (the client reads through the mount).
  BatchMemory::Refusal refusal;
  if (batch_memory_.Take(caller.uid, total, &refusal)) {
    batch_refused_++;
    CTFS_LOG(kWarn) << "files/batch of uid " << caller.uid << " refused: " << refusal.message;
    return Error(
        refusal.memory ? http::status::service_unavailable : http::status::too_many_requests,
        refusal.message, v);
  }
  // Given back unless the memory file is handed out (then when its pages are gone).
  struct Charged {
    BatchMemory* memory;
    uid_t uid;
    uint64_t bytes;
    bool followed = false;
    ~Charged() {
      if (!followed) memory->Give(uid, bytes);
    }
  } charged{&batch_memory_, caller.uid, total};
  UniqueFd mfd(::memfd_create("cubetorchfs:batch", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (mfd.get() < 0)
    return Error(http::status::service_unavailable,
                 std::string("memfd_create: ") + std::strerror(errno), v);
  if (::ftruncate(mfd.get(), static_cast<off_t>(total)) != 0)
    return Error(http::status::service_unavailable,
                 std::string("sizing the batch's memory file: ") + std::strerror(errno), v);
  // The bytes go into the memory file through a gathering buffer: one write for many small
  // files rather than one each. A write that fails fails the request (the client reads the
  // batch through the mount).
  auto write_at = [&](uint64_t at, const char* data, size_t len) -> Status {
    while (len > 0) {
      const ssize_t n = ::pwrite(mfd.get(), data, len, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Status::IOError(std::string("writing the batch: ") + std::strerror(errno));
      data += n;
      len -= static_cast<size_t>(n);
      at += static_cast<uint64_t>(n);
    }
    return Status::OK();
  };
  std::string pending;
  uint64_t pending_at = 0;
  Status written;       // the first write that failed
  auto flush = [&]() {  // into `written`
    if (written.ok() && !pending.empty())
      written = write_at(pending_at, pending.data(), pending.size());
    pending.clear();
  };
  auto put = [&](uint64_t at, const char* data, size_t len) -> Status {
    if (!pending.empty() && pending_at + pending.size() != at) flush();
    if (!written.ok()) return written;
    if (len >= kBatchGather) {  // a large piece: written where it is
      flush();
      if (written.ok()) written = write_at(at, data, len);
      return written;
    }
    if (pending.empty()) pending_at = at;
    pending.append(data, len);
    if (pending.size() >= kBatchGather) flush();
    return written;
  };
  pending.reserve(static_cast<size_t>(std::min<uint64_t>(total, kBatchGather)));
  // Each file is read as the mount reads it (fs/: the RAM cache, the prefetch window, the NVMe
  // tier, then the store), each read counted in the stream accounting as one of the API's.
  uint64_t given = 0, served_bytes = 0;
  for (File& f : files) {
    if (f.path.empty()) continue;
    uint64_t at = f.offset;
    const uint64_t end = f.offset + f.attr.size;
    Status s = reader_(
        f.path, f.attr,
        [&](const char* data, size_t len) -> Status {
          if (len > end - at) return Status::Stale(f.path + ": longer than its attributes say");
          CTFS_RETURN_IF_ERROR(put(at, data, len));
          at += len;
          return Status::OK();
        },
        caller.uid);
    if (s.ok() && at != end) s = Status::Stale(f.path + ": shorter than its attributes say");
    if (!written.ok()) break;
    if (!s.ok()) {
      CTFS_LOG(kDebug) << "files/batch " << f.path << ": " << s.ToString();
      f.missing = ErrorJson(s);
      f.path.clear();
      continue;
    }
    given++;
    served_bytes += f.attr.size;
  }
  flush();
  if (!written.ok()) return Error(http::status::service_unavailable, written.message(), v);
  if (::fcntl(mfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
      0)
    return Error(http::status::service_unavailable,
                 std::string("sealing the batch: ") + std::strerror(errno), v);
  // A read-only open file description of the same memory for the caller.
  UniqueFd ro(::open(("/proc/self/fd/" + std::to_string(mfd.get())).c_str(), O_RDONLY | O_CLOEXEC));
  if (ro.get() < 0)
    return Error(http::status::service_unavailable,
                 std::string("reopening the batch: ") + std::strerror(errno), v);
  // From here the charge stays until the kernel drops the file's last reference.
  charged.followed = true;
  if (Status s = batch_memory_.Follow(caller.uid, total, ro.get()); !s.ok()) {
    batch_refused_++;
    CTFS_LOG(kWarn) << "files/batch of uid " << caller.uid << " refused: " << s.message();
    return Error(http::status::service_unavailable, s.message() + ": read it through the mount", v);
  }
  // The reply's JSON is written as text: built as nlohmann objects (a map each) it cost more
  // than the files' bytes did. Same document: {"files": [...], "bytes": N}.
  std::string reply = "{\"files\":[";
  reply.reserve(reply.size() + 64 * files.size() + 32);
  for (size_t i = 0; i < files.size(); ++i) {
    const File& f = files[i];
    if (i > 0) reply += ',';
    if (f.path.empty()) {
      reply += f.missing.dump(-1, ' ', false, json::error_handler_t::replace);
      continue;
    }
    reply += "{\"offset\":";
    reply += std::to_string(f.offset);
    reply += ",\"size\":";
    reply += std::to_string(f.attr.size);
    reply += ",\"mtime_ns\":";
    reply += std::to_string(f.attr.mtime_ns);
    reply += '}';
  }
  reply += "],\"bytes\":";
  reply += std::to_string(total);
  reply += "}\n";
  batches_++;
  batch_files_ += given;
  batch_bytes_ += served_bytes;
  *fd = ro.release();
  Response res{http::status::ok, v};
  res.set(http::field::content_type, "application/json");
  res.body() = std::move(reply);
  res.prepare_payload();
  return res;
}

}  // namespace cubetorchfs::control::detail
