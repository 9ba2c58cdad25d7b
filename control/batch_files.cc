// POST /v1/files/batch: the files of one DataLoader batch in one request, their bytes in one
// sealed memory file handed over with the reply (SCM_RIGHTS). docs/control-api.md says what a
// client may rely on, docs/prefetch.md how the hook's batch mode uses it.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "common/logging.h"
#include "common/unique_fd.h"
#include "control/server_impl.h"
#include "prefetch/model_fetch.h"

namespace cubetorchfs::control::detail {

namespace {

// A file that is not in the memory file, and why (the client reads it through the mount).
json Missing(const Status& s, const char* code) {
  return json{{"error", s.message()}, {"code", code}};
}

const char* CodeOf(const Status& s) {
  if (s.IsNotFound()) return "not_found";
  if (s.code() == Status::Code::kPermissionDenied) return "permission_denied";
  if (s.code() == Status::Code::kIsDirectory || s.code() == Status::Code::kInvalidArgument)
    return "not_a_file";
  if (s.IsStale()) return "changed";
  return "store_failed";
}

}  // namespace

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
    json missing;  // why it is not in the memory file
  };
  std::vector<File> files;
  uint64_t total = 0;
  for (size_t at = 0; at < body.size();) {
    const size_t end = body.find('\0', at);
    if (files.size() >= kMaxBatchFiles)
      return Error(http::status::bad_request,
                   "more than " + std::to_string(kMaxBatchFiles) + " files in one batch", v);
    File& f = files.emplace_back();
    const std::string asked = body.substr(at, end - at);
    at = end + 1;
    Result<PathResolver::Resolved> r = Check(asked, caller, /*fresh=*/false);
    if (r.ok() && r->attr.mode == 0) r = Check(asked, caller, /*fresh=*/true);  // unchecked store
    if (!r.ok()) {
      f.missing = Missing(r.status(), CodeOf(r.status()));
      continue;
    }
    if (!r->attr.IsRegular()) {
      f.missing = Missing(Status::InvalidArgument(asked + ": not a regular file"), "not_a_file");
      continue;
    }
    if (total + r->attr.size > options_.batch_max_bytes) {
      f.missing =
          json{{"error", asked + ": past the batch's " + std::to_string(options_.batch_max_bytes) +
                             " bytes (control.batch_max_bytes)"},
               {"code", "over_batch_bytes"}};
      continue;
    }
    f.path = std::move(r->path);
    f.attr = r->attr;
    f.offset = total;
    total += f.attr.size;
  }
  // The memory file is charged to the daemon's cgroup while the client holds it: none when
  // memory is short (the client reads through the mount).
  if (total > 0 && total > prefetch::ModelFetcher::AvailableMemory() / 10 * 9) {
    batch_refused_++;
    return Error(http::status::service_unavailable,
                 "not enough free memory for a batch of " + std::to_string(total) +
                     " bytes: read it through the mount",
                 v);
  }
  UniqueFd mfd(::memfd_create("cubetorchfs:batch", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (mfd.get() < 0)
    return Error(http::status::service_unavailable,
                 std::string("memfd_create: ") + std::strerror(errno), v);
  if (::ftruncate(mfd.get(), static_cast<off_t>(total)) != 0)
    return Error(http::status::service_unavailable,
                 std::string("sizing the batch's memory file: ") + std::strerror(errno), v);
  uint64_t given = 0, served_bytes = 0;
  for (File& f : files) {
    if (f.path.empty()) continue;
    uint64_t at = f.offset;
    const uint64_t end = f.offset + f.attr.size;
    Status s = reader_(
        f.path, f.attr,
        [&](const char* data, size_t len) -> Status {
          if (len > end - at) return Status::Stale(f.path + ": longer than its attributes say");
          while (len > 0) {
            const ssize_t n = ::pwrite(mfd.get(), data, len, static_cast<off_t>(at));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0)
              return Status::IOError(std::string("writing the batch: ") + std::strerror(errno));
            data += n;
            len -= static_cast<size_t>(n);
            at += static_cast<uint64_t>(n);
          }
          return Status::OK();
        },
        caller.uid);
    if (s.ok() && at != end) s = Status::Stale(f.path + ": shorter than its attributes say");
    if (!s.ok()) {
      CTFS_LOG(kDebug) << "files/batch " << f.path << ": " << s.ToString();
      f.missing = Missing(s, CodeOf(s));
      f.path.clear();
      continue;
    }
    given++;
    served_bytes += f.attr.size;
  }
  if (::fcntl(mfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
      0)
    return Error(http::status::service_unavailable,
                 std::string("sealing the batch: ") + std::strerror(errno), v);
  // A read-only open file description of the same memory for the caller.
  UniqueFd ro(::open(("/proc/self/fd/" + std::to_string(mfd.get())).c_str(), O_RDONLY | O_CLOEXEC));
  if (ro.get() < 0)
    return Error(http::status::service_unavailable,
                 std::string("reopening the batch: ") + std::strerror(errno), v);
  json out = json::array();
  for (File& f : files) {
    if (f.path.empty())
      out.push_back(std::move(f.missing));
    else
      out.push_back(
          json{{"offset", f.offset}, {"size", f.attr.size}, {"mtime_ns", f.attr.mtime_ns}});
  }
  batches_++;
  batch_files_ += given;
  batch_bytes_ += served_bytes;
  *fd = ro.release();
  return JsonResponse(http::status::ok, json{{"files", std::move(out)}, {"bytes", total}}, v);
}

}  // namespace cubetorchfs::control::detail
