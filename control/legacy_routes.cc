// The legacy routes of cube_torch's first control API, kept for its clients: the publish of
// POST /prefetch/read/path (LegacyPrefetch, PublishLegacy) and POST /batchdownload/path, which
// streams whole files in one framed reply (BatchDownload). docs/control-api.md#legacy-routes
// says what each accepts; every path is checked for its caller (ServerImpl::Check) as any
// other route's is.
#include <unistd.h>

#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/logging.h"
#include "control/control_server.h"
#include "control/server_impl.h"

namespace cubetorchfs::control::detail {

namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int shift = 56; shift >= 0; shift -= 8)
    out.push_back(static_cast<char>((v >> shift) & 0xff));
}

}  // namespace

std::optional<Response> ServerImpl::PublishLegacy(const Caller& caller,
                                                  const std::vector<std::string>& all, bool batch,
                                                  unsigned v) {
  // One legacy stream per user and kind: users never share a stream. A batch stream's files
  // are fetched for /batchdownload/path, which sends them, not into the kernel's page cache.
  MutexLock l(legacy_mu_);
  std::string& id = (batch ? legacy_batch_streams_ : legacy_streams_)[caller.uid];
  // The original package expects its answer whatever happens: past the per-user limits, as
  // many paths as fit are published (prefetching is best effort).
  size_t taken = 0;
  Prefetcher::Refusal refusal;
  Prefetcher::Op op = id.empty()
                          ? Prefetcher::Op::kNotFound
                          : prefetcher_->PublishAs(caller.uid, id, all, true, &taken, &refusal);
  if (op == Prefetcher::Op::kNotFound) {
    id = prefetcher_->CreateStream(batch ? "cube_torch legacy batch" : "cube_torch legacy", 0,
                                   caller.uid, ReaderFor(caller), "", /*page_cache=*/!batch,
                                   /*claims_share=*/!batch);
    if (id.empty()) {
      (batch ? legacy_batch_streams_ : legacy_streams_).erase(caller.uid);
      if (batch) return std::nullopt;  // the files are read as asked, one after another
      return StreamsFull(v);
    }
    op = prefetcher_->PublishAs(caller.uid, id, all, true, &taken, &refusal);
  }
  if (op == Prefetcher::Op::kFull || taken < all.size()) {
    if (dropped_warnings_++ < 3 || dropped_warnings_ % 1000 == 0)
      CTFS_LOG(kWarn) << "legacy prefetch of uid " << caller.uid << ": " << all.size() - taken
                      << " paths over the queued-path limits dropped"
                      << (refusal.limit != Prefetcher::Limit::kNone ? ": " + FullMessage(refusal)
                                                                    : "");
  } else if (op != Prefetcher::Op::kOk && !batch) {
    return StreamError(op, id, v);
  }
  return std::nullopt;
}

Response ServerImpl::LegacyPrefetch(const Request& req, const Caller& caller) {
  const unsigned v = req.version();
  std::string why;
  std::optional<json> body = ParseBody(req, &why);
  if (!body) return Error(http::status::bad_request, why, v);
  if (!body->is_array())
    return Error(http::status::bad_request, "body must be [[path, ...], ...]", v);
  std::vector<std::string> all;
  for (const auto& group : *body) {
    uint64_t rejected = 0;
    std::optional<std::vector<std::string>> paths = StorePaths(group, caller, &rejected, &why);
    if (!paths) return Error(http::status::bad_request, why, v);
    all.insert(all.end(), paths->begin(), paths->end());
  }
  if (std::optional<Response> failed = PublishLegacy(caller, all, /*batch=*/false, v))
    return std::move(*failed);
  return Text(http::status::ok, "prefetching.\n", v);
}

Reply ServerImpl::BatchDownload(Request& req, const Caller& caller, int sock) {
  const unsigned v = req.version();
  std::string why;
  std::optional<json> body = ParseBody(req, &why);
  if (!body) return {Error(http::status::bad_request, why, v)};
  if (!body->is_array()) return {Error(http::status::bad_request, "body must be [[path, ...]]", v)};
  std::vector<std::string> paths;
  for (const auto& group : *body) {
    if (!group.is_array())
      return {Error(http::status::bad_request, "body must be [[path, ...]]", v)};
    for (const auto& p : group) {
      if (!p.is_string()) return {Error(http::status::bad_request, "paths must be strings", v)};
      paths.push_back(p.get<std::string>());
    }
  }
  body.reset();
  // The reply may take long: the request's body is not kept while it is sent.
  req.body().clear();
  req.body().shrink_to_fit();
  const bool keep_alive = req.keep_alive() && v == 11;
  ChunkedWriter out(sock, options_.idle_timeout_s, v == 11);
  std::string head = std::string(v == 11 ? "HTTP/1.1" : "HTTP/1.0") +
                     " 200 OK\r\nContent-Type: application/octet-stream\r\n";
  head += v == 11 ? "Transfer-Encoding: chunked\r\n" : "";
  head += keep_alive ? "" : "Connection: close\r\n";
  head += "\r\n";
  if (!out.Raw(head)) return Reply{{}, -1, true, false};
  // Framing: u64 version=0, u64 count, then per file u64 path_len | path | u64 data_len |
  // data, all big-endian. The files that cannot be read (or are empty) come last, with no data:
  // the original client stops at the first empty one, and has every other by then.
  std::string frame;
  PutU64(frame, 0);
  PutU64(frame, paths.size());
  if (!out.Write(frame.data(), frame.size())) return Reply{{}, -1, true, false};
  // Each path checked for the caller as the mount would check its open, then all of them
  // published to the caller's batch stream: the prefetcher's workers fetch them side by side
  // while this thread sends them in order (each read waits for its own fetch).
  struct Asked {
    const std::string* name;
    Result<PathResolver::Resolved> resolved;
  };
  std::vector<Asked> asked;
  asked.reserve(paths.size());
  std::vector<std::string> fetch;
  PathResolver::Searched searched;
  for (const std::string& p : paths) {
    Result<PathResolver::Resolved> r = CheckToRead(p, caller, &searched);
    if (r.ok() && r->attr.size > 0) fetch.push_back(r->path);
    asked.push_back({&p, std::move(r)});
  }
  if (!fetch.empty()) (void)PublishLegacy(caller, fetch, /*batch=*/true, v);
  fetch.clear();
  auto entry_head = [&](const std::string& p, uint64_t len) {
    frame.clear();
    PutU64(frame, p.size());
    frame += p;
    PutU64(frame, len);
    return out.Write(frame.data(), frame.size());
  };
  uint64_t warned = 0;
  std::vector<const std::string*> empty;
  for (Asked& a : asked) {
    const std::string& p = *a.name;
    Status s = a.resolved.status();
    bool started = false;
    if (s.ok() && a.resolved->attr.size == 0) {
      empty.push_back(&p);
      continue;
    }
    if (s.ok()) {
      const PathResolver::Resolved& r = *a.resolved;
      s = reader_(
          r.path, r.attr,
          [&](const char* data, size_t len) -> Status {
            if (!started) {
              if (!entry_head(p, r.attr.size)) return Status::IOError("client stopped reading");
              started = true;
            }
            if (!out.Write(data, len)) return Status::IOError("client stopped reading");
            return Status::OK();
          },
          caller.uid);
    }
    if (started && !s.ok()) {  // the length is out: the reply cannot go on
      CTFS_LOG(kWarn) << "batchdownload aborted in " << p << ": " << s.ToString();
      return Reply{{}, -1, true, false};
    }
    if (!s.ok()) {
      if (warned++ < 3) CTFS_LOG(kWarn) << "batchdownload " << p << ": " << s.ToString();
      empty.push_back(&p);
      continue;
    }
    // Each file leaves as soon as it is read: the client serves it from then on.
    if (!out.Flush()) return Reply{{}, -1, true, false};
  }
  for (const std::string* p : empty)
    if (!entry_head(*p, 0)) return Reply{{}, -1, true, false};
  if (!out.Finish()) return Reply{{}, -1, true, false};
  return Reply{{}, -1, true, keep_alive};
}

}  // namespace cubetorchfs::control::detail
