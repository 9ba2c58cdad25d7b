// The control server's request handling (server_impl.h declares what both files share):
// ServerImpl::Handle, which routes a request, and each route's handler, on the worker threads.
// Every path a request names is checked here for its caller (ServerImpl::Check) before
// anything is fetched, warmed, sent or opened. Also the checks control_server.h declares
// (CheckJsonShape, ToStorePath).
#include <prometheus/counter.h>
#include <unistd.h>

#include <atomic>
#include <boost/beast/http.hpp>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/logging.h"
#include "control/control_server.h"
#include "control/routes.h"
#include "control/server_impl.h"

namespace cubetorchfs::control {

Status CheckJsonShape(std::string_view body, int max_depth, uint64_t max_elements) {
  int depth = 0;
  uint64_t elements = 1;
  bool in_string = false;
  size_t run = 0;  // characters of the number or literal being read
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    // A number (or true/false/null) of megabytes parses into far more memory than its bytes;
    // no value of this API needs more than a few dozen characters.
    const bool token = !in_string && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
                                      (c >= 'A' && c <= 'Z') || c == '-' || c == '+' || c == '.');
    run = token ? run + 1 : 0;
    if (run > kMaxJsonTokenBytes)
      return Status::InvalidArgument("a JSON number or literal over " +
                                     std::to_string(kMaxJsonTokenBytes) + " characters");
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth)
          return Status::InvalidArgument("JSON nested deeper than " + std::to_string(max_depth));
        if (c == '{') break;  // an object's values follow ':'
        // An array's first value follows '[', the others ',': without this count, arrays of
        // one array of one array... parse to 16 times max_elements values (fuzz_json_shape).
        [[fallthrough]];
      case ',':
      case ':':
        if (++elements > max_elements)
          return Status::InvalidArgument("JSON of more than " + std::to_string(max_elements) +
                                         " values");
        break;
      case ']':
      case '}':
        --depth;
        break;
      default:
        break;
    }
  }
  return Status::OK();
}

Result<std::string> ToStorePath(const std::string& mount_point, const std::string& path) {
  // What the kernel would refuse with ENAMETOOLONG is refused here too, before it is kept
  // anywhere: a queued path holds its bytes until read.
  auto shown = [&path] { return path.size() > 64 ? path.substr(0, 64) + "..." : path; };
  if (path.size() > kMaxPathBytes)
    return Status::NameTooLong(shown() + ": path over " + std::to_string(kMaxPathBytes) +
                               " bytes (PATH_MAX)");
  std::string rel;
  if (!path.empty() && path[0] == '/') {
    const std::string prefix = mount_point == "/" ? "/" : mount_point + "/";
    if (path.compare(0, prefix.size(), prefix) != 0)
      return Status::InvalidArgument(path + " is outside the mount " + mount_point);
    rel = path.substr(prefix.size());
  } else {
    rel = path;
  }
  std::string out;
  size_t start = 0;
  while (start <= rel.size()) {
    size_t slash = rel.find('/', start);
    if (slash == std::string::npos) slash = rel.size();
    std::string part = rel.substr(start, slash - start);
    if (part == "..") return Status::InvalidArgument(path + ": \"..\" is not allowed");
    if (part.size() > kMaxNameBytes)
      return Status::NameTooLong(shown() + ": a name over " + std::to_string(kMaxNameBytes) +
                                 " bytes (NAME_MAX)");
    if (!part.empty() && part != ".") out += (out.empty() ? "" : "/") + part;
    start = slash + 1;
  }
  if (out.empty()) return Status::InvalidArgument("\"" + path + "\" names no file");
  if (out.find('\0') != std::string::npos) return Status::InvalidArgument("path contains NUL");
  return out;
}

namespace detail {

std::string FullMessage(const Prefetcher::Refusal& r) {
  using Limit = Prefetcher::Limit;
  const std::string held = std::to_string(r.held), value = std::to_string(r.value);
  const std::string asked = std::to_string(r.asked), users = std::to_string(r.users);
  const std::string share =
      "with " + users + " users queuing, each may have 1/" + std::to_string(r.users + 1) + " of ";
  switch (r.limit) {
    case Limit::kUserPaths:
      return "too many queued paths for this user (prefetch.max_queued_paths_per_uid = " + value +
             "): it has " + held + ", this request adds " + asked;
    case Limit::kUserBytes:
      return "the queued paths of this user would take too much memory "
             "(prefetch.max_queued_path_bytes_per_uid = " +
             value + " bytes): it has " + held + ", this request adds " + asked;
    case Limit::kSharePaths:
      return "this user's fair share of the queued paths of all users is used (" + share +
             "prefetch.max_queued_paths: " + value + " paths): it has " + held +
             ", this request adds " + asked;
    case Limit::kShareBytes:
      return "this user's fair share of the memory for queued paths is used (" + share +
             "prefetch.max_queued_path_bytes: " + value + " bytes): it has " + held +
             ", this request adds " + asked;
    case Limit::kPoolPaths:
      return "too many queued paths of all users (prefetch.max_queued_paths = " + value +
             "): " + held + " queued, this request adds " + asked;
    case Limit::kPoolBytes:
      return "the queued paths of all users would take too much memory "
             "(prefetch.max_queued_path_bytes = " +
             value + " bytes): " + held + " queued, this request adds " + asked;
    case Limit::kNone:
      break;
  }
  return "too many queued paths";
}

std::optional<json> ServerImpl::ParseBody(const Request& req, std::string* why) {
  Status shape = CheckJsonShape(req.body(), options_.max_json_depth, options_.max_json_elements);
  if (!shape.ok()) {
    CountRefused(kBadJson);
    *why = "body refused: " + shape.message();
    return std::nullopt;
  }
  return json::parse(req.body(), nullptr, false);
}

Reply ServerImpl::Handle(Request& req, const Caller& caller, bool can_pass_fd, int sock) {
  return Handle(
      req, MatchRoute(req.method(), std::string_view(req.target().data(), req.target().size())),
      caller, can_pass_fd, sock);
}

Reply ServerImpl::Handle(Request& req, const RouteMatch& m, const Caller& caller, bool can_pass_fd,
                         int sock) {
  const unsigned v = req.version();
  const std::string_view target(req.target().data(), req.target().size());
  if (m.route == nullptr && !m.allowed.empty()) {
    Response res = Error(http::status::method_not_allowed, "use " + m.allowed, v);
    res.set(http::field::allow, m.allowed);
    return {res};
  }
  // A route this daemon does not have: a client may fall back to another way.
  if (m.route == nullptr)
    return {ErrorFrom(http::status::not_found,
                      Status::NotSupported("no route " + std::string(target)), v)};
  if (m.route->unix_only && !can_pass_fd)
    return {Error(
        http::status::bad_request,
        std::string(m.route->pattern) + " passes a file descriptor: use the unix control socket",
        v)};
  switch (m.route->id) {
    case RouteId::kCreateStream:
      return {CreateStream(req, caller)};
    case RouteId::kPublishPaths:
      return {PublishPaths(req, caller, m.id)};
    case RouteId::kPublishPositions:
      return {PublishPositions(req, caller, m.id)};
    case RouteId::kDeleteStream:
      return {DeleteStream(caller, m.id, v)};
    case RouteId::kCreateList:
      return {AppendList(req, caller, "")};
    case RouteId::kAppendList:
      return {AppendList(req, caller, m.id)};
    case RouteId::kDeleteList: {
      const prefetch::FileLists::Op op = lists_.Delete(caller.uid, m.id);
      if (op == prefetch::FileLists::Op::kNotFound)
        return {Error(http::status::not_found, "unknown file list " + m.id, v)};
      if (op != prefetch::FileLists::Op::kOk) return {ListError(op, m.id, v)};
      Response res{http::status::no_content, v};
      res.prepare_payload();
      return {res};
    }
    case RouteId::kStats:
      return {JsonResponse(http::status::ok, StatsJson(caller), v)};
    case RouteId::kOpenFile: {
      if (!opener_)
        return {Error(http::status::not_implemented, "this daemon cannot open files", v)};
      Reply r;
      r.res = OpenFile(req, caller, &r.fd);
      return r;
    }
    case RouteId::kWarmup:
      return {Warmup(req, caller)};
    case RouteId::kHealth:
      return {Health(caller, v)};
    case RouteId::kUpgrade:
      return {Upgrade(caller, v)};
    case RouteId::kLegacyPrefetch:
      return {LegacyPrefetch(req, caller)};
    case RouteId::kRegisterPid:
    case RouteId::kUnregisterPid:
      return {RegisterPids(req, caller, m.route->pattern)};
    case RouteId::kBatchDownload:
      return BatchDownload(req, caller, sock);
    case RouteId::kBatchFiles: {
      Reply r;
      r.res = BatchFiles(req, caller, &r.fd);
      return r;
    }
  }
  return {Error(http::status::internal_server_error, "a route without a handler", v)};
}

Response ServerImpl::DeleteStream(const Caller& caller, const std::string& id, unsigned v) {
  const Prefetcher::Op op = prefetcher_->DeleteStreamAs(caller.uid, id);
  if (op != Prefetcher::Op::kOk) return StreamError(op, id, v);
  Response res{http::status::no_content, v};
  res.prepare_payload();
  return res;
}

Response ServerImpl::Health(const Caller& caller, unsigned v) {
  if (!options_.health)
    return Error(http::status::not_implemented, "this daemon reports no health", v);
  json report = options_.health(caller.IsRoot() || caller.uid == ::geteuid());
  const bool healthy = report.value("healthy", false);
  return JsonResponse(healthy ? http::status::ok : http::status::service_unavailable, report, v);
}

Response ServerImpl::Upgrade(const Caller& caller, unsigned v) {
  if (!caller.IsRoot() && caller.uid != ::geteuid())
    return Error(http::status::forbidden, "only root or the daemon's user may upgrade it", v);
  if (!options_.upgrade)
    return Error(http::status::not_implemented,
                 "this daemon runs without a supervisor: it cannot be upgraded in place", v);
  if (Status s = options_.upgrade(); !s.ok()) return ErrorFrom(http::status::conflict, s, v);
  return JsonResponse(http::status::accepted, json{{"handing_over", true}, {"pid", ::getpid()}}, v);
}

Response ServerImpl::RegisterPids(const Request& req, const Caller& caller,
                                  std::string_view route) {
  const unsigned v = req.version();
  std::string why;
  std::optional<json> body = ParseBody(req, &why);
  if (!body) return Error(http::status::bad_request, why, v);
  if (!body->is_array())
    return Error(http::status::bad_request, "body must be a JSON array of pids", v);
  for (const auto& pid : *body)
    if (!pid.is_number_integer())
      return Error(http::status::bad_request, "pids must be integers", v);
  // The original package's bookkeeping: nothing here depends on it, so it is only logged.
  CTFS_LOG(kDebug) << route.substr(1) << ": " << body->size() << " pids from uid " << caller.uid;
  return Text(http::status::ok, "ok\n", v);
}

std::shared_ptr<const Caller> ServerImpl::ReaderFor(const Caller& caller) const {
  if (caller.IsRoot() || options_.resolver == nullptr || !options_.resolver->checks_store())
    return nullptr;
  return std::make_shared<const Caller>(caller);
}

Response ServerImpl::StreamError(Prefetcher::Op op, const std::string& id, unsigned v,
                                 const Prefetcher::Refusal& refusal) {
  switch (op) {
    case Prefetcher::Op::kForbidden:
      return Error(http::status::forbidden, "stream " + id + " belongs to another user", v);
    case Prefetcher::Op::kFull:
      return Error(http::status::too_many_requests, FullMessage(refusal), v);
    default:
      return Error(http::status::not_found, "unknown stream " + id, v);
  }
}

Response ServerImpl::StreamsFull(unsigned v) {
  return Error(http::status::too_many_requests,
               "too many streams for this user: at most " +
                   std::to_string(prefetcher_->max_streams_per_uid()) +
                   " (prefetch.max_streams_per_uid)",
               v);
}

Response ServerImpl::CreateStream(const Request& req, const Caller& caller) {
  const unsigned v = req.version();
  std::string why;
  std::optional<json> parsed = ParseBody(req, &why);
  if (!parsed) return Error(http::status::bad_request, why, v);
  json& body = *parsed;
  if (!body.is_object()) return Error(http::status::bad_request, "body must be a JSON object", v);
  std::string name = "stream";
  int pid = 0;
  if (body.contains("name")) {
    if (!body["name"].is_string())
      return Error(http::status::bad_request, "\"name\" must be a string", v);
    name = body["name"].get<std::string>();
    if (name.size() > 256) name.resize(256);
  }
  if (body.contains("pid")) {
    if (!body["pid"].is_number_integer())
      return Error(http::status::bad_request, "\"pid\" must be an integer", v);
    pid = body["pid"].get<int>();
  }
  std::string list;
  if (body.contains("list")) {
    if (!body["list"].is_string())
      return Error(http::status::bad_request, "\"list\" must be a string", v);
    list = body["list"].get<std::string>();
    // The list must be the caller's now; its positions are checked again at each publish.
    uint64_t size = 0, refused = 0;
    std::vector<std::string> none;
    if (auto op = lists_.Paths(caller.uid, list, {}, &none, &refused, &size);
        op != prefetch::FileLists::Op::kOk)
      return ListError(op, list, v);
  }
  // "mode": "batch": the hook's batch mode reads the files through /v1/files/batch, not the
  // mount's page cache (Stream::page_cache).
  bool page_cache = true;
  if (body.contains("mode")) {
    if (!body["mode"].is_string() || (body["mode"] != "prefetch" && body["mode"] != "batch"))
      return Error(http::status::bad_request, "\"mode\" must be \"prefetch\" or \"batch\"", v);
    page_cache = body["mode"] == "prefetch";
  }
  const std::string id =
      prefetcher_->CreateStream(name, pid, caller.uid, ReaderFor(caller), list, page_cache);
  if (id.empty()) return StreamsFull(v);
  return JsonResponse(http::status::created, json{{"id", id}}, v);
}

void ServerImpl::CountRejected(Reject r) {
  rejected_counts_[static_cast<int>(r)]++;
  if (rejected_[static_cast<int>(r)]) rejected_[static_cast<int>(r)]->Increment();
}

Result<PathResolver::Resolved> ServerImpl::Check(const std::string& p, const Caller& caller,
                                                 bool fresh, PathResolver::Depth depth,
                                                 PathResolver::Searched* searched) {
  Result<std::string> sp = ToStorePath(options_.mount_point, p);
  if (!sp.ok()) {
    CountRejected(Reject::kOutside);
    return sp.status();
  }
  if (options_.resolver == nullptr) return PathResolver::Resolved{sp.value(), {}};
  Reject why = Reject::kNone;
  Result<PathResolver::Resolved> r =
      options_.resolver->Resolve(*sp, caller, fresh, &why, depth, searched);
  if (!r.ok()) {
    CountRejected(why);
    // Say what a user may know: the path asked for, not where the store keeps it.
    const Status& s = r.status();
    if (why == Reject::kNotFound) return Status::NotFound(p + ": no such file");
    if (why == Reject::kPermission) return Status::PermissionDenied(p + ": permission denied");
    if (why == Reject::kNotFile)
      return s.code() == Status::Code::kIsDirectory
                 ? Status::IsDirectory(p + ": names a directory, not a regular file")
                 : Status::InvalidArgument(p + ": not a regular file");
    if (why == Reject::kSymlink || why == Reject::kLoop) {
      const size_t colon = s.message().find(": ");
      return Status::PermissionDenied(
          p + ": " + (colon == std::string::npos ? s.message() : s.message().substr(colon + 2)));
    }
    // A directory checked, found to be another object when the store was asked in it.
    if (s.code() == Status::Code::kStale)
      return Status::Stale(p + ": changed in the store while it was checked");
    return Status::IOError(p + ": the store failed");
  }
  return r;
}

void ServerImpl::WarmDirectories(const json& paths) {
  if (options_.resolver == nullptr || !options_.resolver->checks_store() || !paths.is_array())
    return;
  std::unordered_set<std::string> dirs;
  for (const auto& p : paths) {
    if (!p.is_string()) return;  // refused below
    Result<std::string> sp = ToStorePath(options_.mount_point, p.get_ref<const std::string&>());
    if (!sp.ok()) continue;
    for (size_t slash = sp->find('/'); slash != std::string::npos; slash = sp->find('/', slash + 1))
      dirs.insert(sp->substr(0, slash));
  }
  options_.resolver->Warm(std::vector<std::string>(dirs.begin(), dirs.end()));
}

std::optional<std::vector<std::string>> ServerImpl::StorePaths(const json& paths,
                                                               const Caller& caller,
                                                               uint64_t* rejected, std::string* why,
                                                               PathResolver::Depth depth,
                                                               bool fresh) {
  if (!paths.is_array()) {
    *why = "paths must be an array of strings";
    return std::nullopt;
  }
  std::vector<std::string> out;
  out.reserve(paths.size());
  PathResolver::Searched searched;  // each directory checked once per request
  WarmDirectories(paths);
  for (const auto& p : paths) {
    if (!p.is_string()) {
      *why = "paths must be an array of strings";
      return std::nullopt;
    }
    Result<PathResolver::Resolved> r =
        Check(p.get_ref<const std::string&>(), caller, fresh, depth, &searched);
    if (r.ok()) {
      out.push_back(std::move(r->path));
    } else {
      ++*rejected;
      *why = r.status().message();
    }
  }
  return out;
}

std::optional<std::vector<std::string>> ServerImpl::PathsBody(const Request& req,
                                                              const Caller& caller,
                                                              uint64_t* rejected, std::string* why,
                                                              PathResolver::Depth depth, bool fresh,
                                                              json* object) {
  std::optional<json> body = ParseBody(req, why);
  if (!body) return std::nullopt;
  if (!body->is_object() || !body->contains("paths")) {
    *why = "body must be {\"paths\": [...]}";
    return std::nullopt;
  }
  std::optional<std::vector<std::string>> paths =
      StorePaths((*body)["paths"], caller, rejected, why, depth, fresh);
  if (paths && object != nullptr) *object = std::move(*body);
  return paths;
}

Response ServerImpl::PublishPaths(const Request& req, const Caller& caller, const std::string& id) {
  const unsigned v = req.version();
  if (Prefetcher::Op op = prefetcher_->CheckStream(caller.uid, id); op != Prefetcher::Op::kOk)
    return StreamError(op, id, v);
  uint64_t rejected = 0;
  std::string why;
  json body;
  std::optional<std::vector<std::string>> paths =
      PathsBody(req, caller, &rejected, &why, PathResolver::Depth::kDirectories, false, &body);
  if (!paths) return Error(http::status::bad_request, why, v);
  // "unread": at most this many of the stream's latest positions, these included, are still
  // to be read; the readers are past every earlier one (the hook knows: its lookahead and the
  // DataLoader's batches in flight).
  std::optional<uint64_t> unread;
  if (auto u = body.find("unread"); u != body.end()) {
    if (!u->is_number_unsigned())
      return Error(http::status::bad_request, "unread must be a non-negative integer", v);
    unread = u->get<uint64_t>();
  }
  if (paths->empty() && rejected > 0) return Error(http::status::unprocessable_entity, why, v);
  Prefetcher::Refusal refusal;
  const size_t accepted = paths->size();
  const Prefetcher::Op op =
      prefetcher_->PublishAs(caller.uid, id, std::move(*paths), false, nullptr, &refusal, unread);
  if (op != Prefetcher::Op::kOk) return StreamError(op, id, v, refusal);
  return JsonResponse(http::status::accepted, json{{"accepted", accepted}, {"rejected", rejected}},
                      v);
}

Response ServerImpl::ListError(prefetch::FileLists::Op op, const std::string& id, unsigned v,
                               const std::string& why) {
  using Op = prefetch::FileLists::Op;
  switch (op) {
    case Op::kForbidden:
      return Error(http::status::forbidden, "file list " + id + " belongs to another user", v);
    case Op::kFull:
      return Error(http::status::too_many_requests, why, v);
    default:
      // Gone, not "not found": the publisher's list expired (idle) or the daemon restarted;
      // it registers the list again.
      return ErrorFrom(http::status::gone,
                       Status::Stale("file list " + id +
                                     " is unknown (expired, deleted or never made): register "
                                     "it again"),
                       v);
  }
}

Response ServerImpl::AppendList(const Request& req, const Caller& caller, const std::string& id) {
  using Op = prefetch::FileLists::Op;
  const unsigned v = req.version();
  const std::string& body = req.body();
  if (!body.empty() && body.back() != '\0')
    return Error(http::status::bad_request,
                 "body must be paths each followed by a NUL byte (the last one too)", v);
  // Each path resolved and its directories checked for the caller, once: positions later
  // name it with no path work. A refused one keeps its place, empty, so numbers hold.
  std::vector<std::string> entries;
  uint64_t rejected = 0;
  std::string why;
  PathResolver::Searched searched;
  for (size_t at = 0; at < body.size();) {
    const size_t end = body.find('\0', at);
    if (entries.size() >= options_.max_json_elements)
      return Error(http::status::bad_request,
                   "more than " + std::to_string(options_.max_json_elements) +
                       " paths in one request (control.max_json_elements)",
                   v);
    Result<PathResolver::Resolved> r = Check(body.substr(at, end - at), caller, false,
                                             PathResolver::Depth::kDirectories, &searched);
    if (r.ok()) {
      entries.push_back(std::move(r->path));
    } else {
      entries.emplace_back();
      ++rejected;
      if (why.empty()) why = r.status().message();
    }
    at = end + 1;
  }
  std::string list = id;
  if (list.empty()) {
    list = lists_.Create(caller.uid);
    if (list.empty())
      return Error(http::status::too_many_requests,
                   "too many file lists for this user: at most " +
                       std::to_string(lists_.options().max_lists_per_uid) +
                       " (prefetch.max_lists_per_uid)",
                   v);
  }
  uint64_t first = 0, size = 0;
  std::string full;
  const Op op = lists_.Append(caller.uid, list, entries, &first, &size, &full);
  if (op != Op::kOk) {
    if (id.empty()) (void)lists_.Delete(caller.uid, list);
    return ListError(op, list, v, full);
  }
  json reply{{"id", list}, {"first", first}, {"size", size}, {"rejected", rejected}};
  if (rejected > 0) reply["error"] = why;
  return JsonResponse(id.empty() ? http::status::created : http::status::ok, reply, v);
}

Response ServerImpl::PublishPositions(const Request& req, const Caller& caller,
                                      const std::string& id) {
  using Op = prefetch::FileLists::Op;
  const unsigned v = req.version();
  std::string list;
  if (Prefetcher::Op op = prefetcher_->StreamList(caller.uid, id, &list); op != Prefetcher::Op::kOk)
    return StreamError(op, id, v);
  if (list.empty())
    return Error(http::status::bad_request,
                 "stream " + id + " was created without a file list: publish paths to it", v);
  const std::string& body = req.body();
  if (body.size() < 8 || (body.size() - 8) % 4 != 0)
    return Error(http::status::bad_request,
                 "body must be an 8-byte unread count then 4-byte positions, little-endian", v);
  const auto* b = reinterpret_cast<const unsigned char*>(body.data());
  uint64_t u = 0;
  for (int i = 7; i >= 0; --i) u = (u << 8) | b[i];
  std::optional<uint64_t> unread;
  if (u != UINT64_MAX) unread = u;  // all ones: not said
  const size_t n = (body.size() - 8) / 4;
  if (n > options_.max_json_elements)
    return Error(http::status::bad_request,
                 "more than " + std::to_string(options_.max_json_elements) +
                     " positions in one request (control.max_json_elements)",
                 v);
  std::vector<uint32_t> positions(n);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char* p = b + 8 + 4 * i;
    positions[i] =
        uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
  }
  // The queued-path limits before the paths are decoded: no user may queue more than its own
  // limits or half of the global ones (its share when alone), so positions naming more (a
  // long path named 131,072 times is 500 MB of paths) are refused as soon as the decoding
  // passes that, holding no more than it. The exact limits, which depend on what is queued
  // already, are checked by the publish.
  const prefetch::QueuedPaths::Limits& q = options_.queued;
  prefetch::FileLists::Bound bound;
  bound.paths = std::min(q.paths_per_uid, q.paths / 2);
  bound.bytes = std::min(q.bytes_per_uid, q.bytes / 2);
  bound.cost = &Prefetcher::QueuedPathCost;
  prefetch::FileLists::Over over;
  std::vector<std::string> paths;
  uint64_t refused = 0, size = 0;
  const Op op = lists_.Paths(caller.uid, list, positions, &paths, &refused, &size, bound, &over);
  if (op == Op::kOver) {
    const bool count = over.paths > bound.paths;
    const bool own = count ? q.paths_per_uid <= q.paths / 2 : q.bytes_per_uid <= q.bytes / 2;
    const std::string key = count ? (own ? "prefetch.max_queued_paths_per_uid = "
                                         : "half of prefetch.max_queued_paths, a user's share "
                                           "when alone: ")
                                  : (own ? "prefetch.max_queued_path_bytes_per_uid = "
                                         : "half of prefetch.max_queued_path_bytes, a user's "
                                           "share when alone: ");
    return Error(
        http::status::too_many_requests,
        "these positions name more than one user may queue (" + key +
            std::to_string(count ? bound.paths : bound.bytes) + (count ? " paths" : " bytes") +
            "): " +
            (over.counted ? std::to_string(over.paths) + " positions"
                          : "past it after " + std::to_string(over.paths) + " paths costing " +
                                std::to_string(over.bytes) + " bytes") +
            "; nothing published",
        v);
  }
  if (op == Op::kRange)
    return Error(http::status::bad_request,
                 "a position is past the end of file list " + list + " (" + std::to_string(size) +
                     " entries)",
                 v);
  if (op != Op::kOk) return ListError(op, list, v);
  Prefetcher::Refusal refusal;
  const size_t accepted = paths.size();
  const Prefetcher::Op pop =
      prefetcher_->PublishAs(caller.uid, id, std::move(paths), false, nullptr, &refusal, unread);
  if (pop != Prefetcher::Op::kOk) return StreamError(pop, id, v, refusal);
  return JsonResponse(http::status::accepted, json{{"accepted", accepted}, {"rejected", refused}},
                      v);
}

Response ServerImpl::Warmup(const Request& req, const Caller& caller) {
  const unsigned v = req.version();
  if (warmer_ == nullptr)
    return Error(http::status::unprocessable_entity,
                 "no NVMe tier configured (cache.disk_dir): nothing to warm", v);
  uint64_t rejected = 0;
  std::string why;
  // Warming writes the files to the NVMe tier: each is checked whole, as of now.
  std::optional<std::vector<std::string>> paths =
      PathsBody(req, caller, &rejected, &why, PathResolver::Depth::kFile, /*fresh=*/true);
  if (!paths) return Error(http::status::bad_request, why, v);
  uint64_t fetched = 0, skipped = 0, failed = rejected, bytes = 0;
  json errors = json::array();
  if (rejected > 0) errors.push_back(why);
  for (const auto& p : *paths) {
    Result<WarmResult> r = warmer_->WarmFile(p);
    if (!r.ok()) {
      ++failed;
      if (errors.size() < 10) errors.push_back(r.status().message());
    } else if (r->fetched) {
      ++fetched;
      bytes += r->bytes;
    } else {
      ++skipped;
    }
  }
  return JsonResponse(http::status::ok,
                      json{{"fetched", fetched},
                           {"skipped", skipped},
                           {"failed", failed},
                           {"bytes", bytes},
                           {"errors", errors}},
                      v);
}

Response ServerImpl::OpenFile(const Request& req, const Caller& caller, int* fd) {
  const unsigned v = req.version();
  std::string why;
  std::optional<json> parsed = ParseBody(req, &why);
  if (!parsed) return Error(http::status::bad_request, why, v);
  json& body = *parsed;
  if (!body.is_object() || !body.contains("path") || !body["path"].is_string())
    return Error(http::status::bad_request, "body must be {\"path\": str}", v);
  Result<PathResolver::Resolved> sp = Check(body["path"].get<std::string>(), caller, true);
  if (!sp.ok()) {
    files_open_failed_++;
    const Status& s = sp.status();
    const http::status code =
        s.IsNotFound()                                ? http::status::not_found
        : s.code() == Status::Code::kPermissionDenied ? http::status::forbidden
        : s.code() == Status::Code::kIsDirectory      ? http::status::bad_request
                                                      : http::status::unprocessable_entity;
    return ErrorFrom(code, s, v);
  }
  // The caller's read permission once more, on the file actually opened: one swapped in
  // since the check above is refused, whatever its size and mtime.
  const Caller who = caller;
  Result<OpenedFile> f = opener_(sp->path, [who](const cfs_client::FileAttr& a) -> Status {
    if (!a.IsRegular() || !MayAccess(a, who, R_OK))
      return Status::PermissionDenied("permission denied");
    return Status::OK();
  });
  if (f.ok() && sp->attr.mode != 0 && f->version != sp->attr.Version()) {
    // Not the file just checked (replaced meanwhile): hand out nothing.
    ::close(f->fd);
    f = Status::Stale(sp->path + ": file changed while it was opened; retry");
  }
  if (!f.ok()) {
    files_open_failed_++;
    const Status& s = f.status();
    if (s.IsNotFound())
      CTFS_LOG(kDebug) << "files/open " << sp->path << ": " << s.ToString();
    else
      CTFS_LOG(kWarn) << "files/open " << sp->path << ": " << s.ToString();
    http::status code = s.IsNotFound()                                ? http::status::not_found
                        : s.code() == Status::Code::kInvalidArgument  ? http::status::bad_request
                        : s.code() == Status::Code::kPermissionDenied ? http::status::forbidden
                        : s.IsStale()                                 ? http::status::conflict
                                      : http::status::service_unavailable;
    return ErrorFrom(code, s, v);
  }
  files_opened_++;
  files_open_bytes_ += f->size;
  if (f->store_file) files_open_store_++;
  *fd = f->fd;
  return JsonResponse(
      http::status::ok,
      json{{"size", f->size},
           {"mtime_ns", f->mtime_ns},
           {"kind", f->store_file ? "store" : "memory"},
           {"bytes",
            {{"ram", f->ram_bytes}, {"disk", f->disk_bytes}, {"backend", f->backend_bytes}}}},
      v);
}

}  // namespace detail
}  // namespace cubetorchfs::control
