#include "control/control_server.h"

#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "common/logging.h"

namespace cubetorchfs::control {

using prefetch::kRejectReasons;
using prefetch::MayAccess;
using prefetch::ReadCounts;
using prefetch::Reject;
using prefetch::Stats;
using prefetch::StreamStats;
using prefetch::TcpPeer;
using prefetch::UnixPeer;
using prefetch::WarmResult;

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using json = nlohmann::json;
using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

namespace {

// Threads for requests that touch file data (/batchdownload, /v1/warmup, /v1/files/open).
// A /batchdownload reply holds at most one cached chunk at a time while it is sent.
constexpr int kPoolThreads = 8;
// Threads for the other requests (JSON parsing and path checks).
constexpr int kApiThreads = 2;
// /batchdownload sends what it has gathered when this much is buffered.
constexpr size_t kSendBuffer = 64 << 10;

Response JsonResponse(http::status status, const json& body, unsigned version) {
  Response res{status, version};
  res.set(http::field::content_type, "application/json");
  res.body() = body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  res.prepare_payload();
  return res;
}

// An error reply: {"error": message, "code": the status code's wire name, "errno": n}
// (docs/errors.md). Clients map the code back to the same Status (Status::FromWire).
Response ErrorFrom(http::status status, const Status& s, unsigned version) {
  return JsonResponse(
      status,
      json{
          {"error", s.message()}, {"code", std::string(CodeName(s.code()))}, {"errno", ToErrno(s)}},
      version);
}

// An error of the request itself: the code follows the HTTP status.
Response Error(http::status status, const std::string& msg, unsigned version) {
  switch (status) {
    case http::status::forbidden:
      return ErrorFrom(status, Status::PermissionDenied(msg), version);
    case http::status::not_found:
      return ErrorFrom(status, Status::NotFound(msg), version);
    case http::status::method_not_allowed:
    case http::status::not_implemented:
      return ErrorFrom(status, Status::NotSupported(msg), version);
    case http::status::conflict:
      return ErrorFrom(status, Status::Stale(msg), version);
    case http::status::bad_request:
    case http::status::payload_too_large:
    case http::status::unprocessable_entity:
      return ErrorFrom(status, Status::InvalidArgument(msg), version);
    default:  // 429, 500, 503: may succeed if retried
      return ErrorFrom(status, Status::IOError(msg), version);
  }
}

Response Text(http::status status, const std::string& body, unsigned version) {
  Response res{status, version};
  res.set(http::field::content_type, "text/plain");
  res.body() = body;
  res.prepare_payload();
  return res;
}

json CountsJson(const ReadCounts& c) {
  return json{{"hit", c.hit}, {"late", c.late}, {"miss", c.miss}};
}

json RatioJson(const ReadCounts& c) {
  if (c.total() == 0) return nullptr;
  return static_cast<double>(c.hit) / static_cast<double>(c.total());
}

void PutU64(std::string& out, uint64_t v) {
  for (int shift = 56; shift >= 0; shift -= 8)
    out.push_back(static_cast<char>((v >> shift) & 0xff));
}

}  // namespace

Status CheckJsonShape(std::string_view body, int max_depth, uint64_t max_elements) {
  int depth = 0;
  uint64_t elements = 1;
  bool in_string = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
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
        break;
      case ']':
      case '}':
        --depth;
        break;
      case ',':
      case ':':
        if (++elements > max_elements)
          return Status::InvalidArgument("JSON of more than " + std::to_string(max_elements) +
                                         " values");
        break;
      default:
        break;
    }
  }
  return Status::OK();
}

Result<std::string> ToStorePath(const std::string& mount_point, const std::string& path) {
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
    if (!part.empty() && part != ".") out += (out.empty() ? "" : "/") + part;
    start = slash + 1;
  }
  if (out.empty()) return Status::InvalidArgument("\"" + path + "\" names no file");
  if (out.find('\0') != std::string::npos) return Status::InvalidArgument("path contains NUL");
  return out;
}

namespace {

class ServerImpl;

// What a handler gives back: a response to send, or word that it sent the reply itself.
struct Reply {
  Response res;
  int fd = -1;         // a descriptor to attach (SCM_RIGHTS), or -1
  bool sent = false;   // the handler wrote the whole reply on the socket itself
  bool reuse = false;  // with `sent`: the connection may carry another request
};
using Done = std::function<void(Reply)>;

// One HTTP connection on either listener, from a known user.
template <typename Protocol>
class Session : public std::enable_shared_from_this<Session<Protocol>> {
 public:
  using Stream = beast::basic_stream<Protocol>;
  Session(typename Protocol::socket socket, ServerImpl* server, Caller caller, int* listener_count)
      : stream_(std::move(socket)),
        server_(server),
        caller_(std::move(caller)),
        listener_count_(listener_count) {}
  ~Session();

  void Start() { Read(); }

 private:
  void Read();
  void OnHeader(beast::error_code ec);
  void OnRead(beast::error_code ec);
  void Write(Response res, bool keep_alive);
  // Sends `res` with `fd` attached (SCM_RIGHTS), closes `fd` and the connection.
  void WriteWithFd(Response res, int fd);
  void Close();
  void ReleaseBody();

  Stream stream_;
  ServerImpl* server_;
  const Caller caller_;
  int* const listener_count_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  uint64_t body_reserved_ = 0;  // of the server's body memory, for the request being handled
};

class ServerImpl final : public ControlServer {
 public:
  ServerImpl(const Options& options, Prefetcher* prefetcher, cache::RamCache* ram,
             FileReader reader, Warmer* warmer, FileOpener opener)
      : options_(options),
        prefetcher_(prefetcher),
        ram_(ram),
        reader_(std::move(reader)),
        warmer_(warmer),
        opener_(std::move(opener)),
        pool_(kPoolThreads),
        api_pool_(kApiThreads),
        open_pool_(kPoolThreads),
        unix_acceptor_(ioc_),
        tcp_acceptor_(ioc_) {
    if (options_.registry != nullptr) {
      auto& rejected = prometheus::BuildCounter()
                           .Name("cubetorchfs_control_rejected_paths_total")
                           .Help("Paths in control requests refused, by reason; never fetched")
                           .Register(*options_.registry);
      for (int r = 1; r < kRejectReasons; ++r)
        rejected_[r] = &rejected.Add({{"reason", RejectName(static_cast<Reject>(r))}});
      auto& refused = prometheus::BuildCounter()
                          .Name("cubetorchfs_control_refused_total")
                          .Help("Control connections or requests refused, by reason")
                          .Register(*options_.registry);
      for (int r = 0; r < kRefuseReasons; ++r)
        refused_[r] = &refused.Add({{"reason", kRefuseNames[r]}});
    }
  }

  ~ServerImpl() override {
    ioc_.stop();
    if (thread_.joinable()) thread_.join();
    pool_.join();
    api_pool_.join();
    open_pool_.join();
    if (bound_unix_) ::unlink(options_.socket_path.c_str());
  }

  Status Listen() {
    beast::error_code ec;
    if (!options_.socket_path.empty()) {
      const std::string& path = options_.socket_path;
      std::error_code fec;
      std::filesystem::create_directories(std::filesystem::path(path).parent_path(), fec);
      struct stat st;
      if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
        // A socket someone still answers on belongs to a running daemon: never steal it.
        asio::local::stream_protocol::socket probe(ioc_);
        beast::error_code probe_ec;
        probe.connect(asio::local::stream_protocol::endpoint(path), probe_ec);
        if (!probe_ec)
          return Status::IOError("prefetch.control_socket: " + path +
                                 " is in use by a running daemon (same volName?)");
        ::unlink(path.c_str());
      }
      asio::local::stream_protocol::endpoint ep(path);
      unix_acceptor_.open(ep.protocol(), ec);
      if (!ec) unix_acceptor_.bind(ep, ec);
      if (!ec) unix_acceptor_.listen(asio::socket_base::max_listen_connections, ec);
      if (ec)
        return Status::IOError("prefetch.control_socket: cannot listen on " + path + ": " +
                               ec.message());
      bound_unix_ = true;
      // Any local user may connect: each request is checked with that user's own rights.
      // Not through a symlink planted at the name meanwhile (glibc refuses one here).
      ::fchmodat(AT_FDCWD, path.c_str(), 0666, AT_SYMLINK_NOFOLLOW);
      Accept(unix_acceptor_, &unix_connections_, options_.max_connections_unix);
    }
    if (options_.prof_port != 0) {
      asio::ip::tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), options_.prof_port);
      tcp_acceptor_.open(ep.protocol(), ec);
      if (!ec) tcp_acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
      if (!ec) tcp_acceptor_.bind(ep, ec);
      if (!ec) tcp_acceptor_.listen(asio::socket_base::max_listen_connections, ec);
      if (ec)
        return Status::IOError("profPort: cannot listen on 127.0.0.1:" +
                               std::to_string(options_.prof_port) + ": " + ec.message());
      Accept(tcp_acceptor_, &tcp_connections_, options_.max_connections_tcp);
    }
    thread_ = std::thread([this] { ioc_.run(); });
    return Status::OK();
  }

  // Answers `req` from `caller`, calling `done` on the Asio thread. `sock`: the connection's
  // descriptor, which a handler may write a streamed reply on (nothing else uses it
  // meanwhile). `can_pass_fd`: the request came over the unix socket.
  void Dispatch(Request req, const Caller& caller, const asio::any_io_executor& ex, Done done,
                bool can_pass_fd, int sock) {
    auto finish = [ex, done = std::move(done)](Reply r) mutable {
      asio::post(ex, [r = std::move(r), done = std::move(done)]() mutable { done(std::move(r)); });
    };
    auto run = [this, caller, sock, can_pass_fd, finish = std::move(finish)](Request& rq) mutable {
      Reply r;
      try {
        r = Handle(rq, caller, can_pass_fd, sock);
      } catch (const std::exception& e) {  // e.g. bad_alloc: fail this request only
        r = Reply{Error(http::status::internal_server_error, e.what(), rq.version())};
      }
      const bool big = rq.body().size() >= (1u << 20) || r.sent;
      rq.body().clear();  // free the body before the reply goes out
      rq.body().shrink_to_fit();
      if (big) TrimMemory();
      finish(std::move(r));
    };
    const std::string_view target(req.target().data(), req.target().size());
    // Opens of big files take long: their own threads, so /batchdownload and /v1/warmup
    // never queue behind them (nor they behind those).
    asio::thread_pool& pool = target == "/v1/files/open" ? open_pool_
                              : (target == "/batchdownload/path" || target == "/v1/warmup")
                                  ? pool_
                                  : api_pool_;
    asio::post(pool, [req = std::move(req), run = std::move(run)]() mutable { run(req); });
  }

  // Runs `fn` on the threads of /v1/files/open (work that may block on a client).
  void RunBlocking(std::function<void()> fn) { asio::post(open_pool_, std::move(fn)); }

  // Takes `bytes` of the body memory budget for `uid`; false if it is in use. One user may
  // hold at most half of it (at least one body), so one slow sender cannot take it all.
  bool ReserveBody(uid_t uid, uint64_t bytes) {
    std::lock_guard<std::mutex> l(body_mu_);
    const uint64_t per_user = std::max(options_.body_memory_bytes / 2, options_.max_body_bytes);
    uint64_t& mine = body_by_uid_[uid];
    if (body_bytes_ + bytes > options_.body_memory_bytes || mine + bytes > per_user) {
      if (mine == 0) body_by_uid_.erase(uid);
      return false;
    }
    body_bytes_ += bytes;
    mine += bytes;
    return true;
  }
  void ReleaseBody(uid_t uid, uint64_t bytes) {
    std::lock_guard<std::mutex> l(body_mu_);
    body_bytes_ -= bytes;
    auto it = body_by_uid_.find(uid);
    if (it != body_by_uid_.end() && (it->second -= bytes) == 0) body_by_uid_.erase(it);
  }

  void ConnectionClosed(uid_t uid, int* listener_count) {
    std::lock_guard<std::mutex> l(conn_mu_);
    --*listener_count;
    auto it = per_uid_.find(uid);
    if (it != per_uid_.end() && --it->second == 0) per_uid_.erase(it);
  }

  const Options& options() const { return options_; }

  enum Refuse {
    kUnknownPeer = 0,
    kListenerFull,
    kUserFull,
    kBusy,
    kTooLarge,
    kBadJson,
    kNotAllowed
  };
  static constexpr int kRefuseReasons = 7;
  static constexpr const char* kRefuseNames[kRefuseReasons] = {
      "unknown_peer", "listener_full", "user_full",      "busy",
      "too_large",    "bad_json",      "not_allow_other"};
  void CountRefused(Refuse r) {
    refused_counts_[r]++;
    if (refused_[r]) refused_[r]->Increment();
  }

 private:
  template <typename Acceptor>
  void Accept(Acceptor& acceptor, int* count, int max) {
    acceptor.async_accept([this, &acceptor, count, max](beast::error_code ec, auto socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {  // e.g. out of file descriptors: retry later rather than spin
        auto timer = std::make_shared<asio::steady_timer>(ioc_, std::chrono::milliseconds(100));
        timer->async_wait([this, &acceptor, timer, count, max](beast::error_code) {
          Accept(acceptor, count, max);
        });
        return;
      }
      using Protocol = typename std::decay_t<decltype(socket)>::protocol_type;
      constexpr bool kUnix = std::is_same_v<Protocol, asio::local::stream_protocol>;
      Result<Caller> caller =
          kUnix ? UnixPeer(socket.native_handle()) : TcpPeer(socket.native_handle());
      std::optional<Refuse> refuse;
      if (!caller.ok()) {
        refuse = kUnknownPeer;
        CTFS_LOG(kWarn) << "control connection refused: " << caller.status().ToString();
      } else if (!options_.others_may_use && !caller->IsRoot()) {
        refuse = kNotAllowed;  // the mount has no allow_other: the kernel refuses them too
      } else {
        std::lock_guard<std::mutex> l(conn_mu_);
        int& mine = per_uid_[caller->uid];
        if (*count >= max)
          refuse = kListenerFull;
        else if (mine >= options_.max_connections_per_uid)
          refuse = kUserFull;
        if (!refuse) {
          ++*count;
          ++mine;
        } else if (mine == 0) {
          per_uid_.erase(caller->uid);
        }
      }
      if (refuse) {
        CountRefused(*refuse);
        if (*refuse != kUnknownPeer)
          CTFS_LOG(kWarn) << "control connection of uid " << caller->uid
                          << " refused: " << kRefuseNames[*refuse];
        beast::error_code ignored;
        socket.close(ignored);
      } else {
        std::make_shared<Session<Protocol>>(std::move(socket), this, std::move(caller).value(),
                                            count)
            ->Start();
      }
      Accept(acceptor, count, max);
    });
  }

  // Gives freed heap back to the system after a large request, at most twice a second.
  void TrimMemory() {
    const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    int64_t last = last_trim_.load();
    if (now - last < 500'000'000 || !last_trim_.compare_exchange_strong(last, now)) return;
    ::malloc_trim(0);
  }

  // The JSON body of `req`, within the shape limits (a discarded value if it is not JSON);
  // nothing, and why, when it is over them.
  std::optional<json> ParseBody(const Request& req, std::string* why) {
    Status shape = CheckJsonShape(req.body(), options_.max_json_depth, options_.max_json_elements);
    if (!shape.ok()) {
      CountRefused(kBadJson);
      *why = "body refused: " + shape.message();
      return std::nullopt;
    }
    return json::parse(req.body(), nullptr, false);
  }

  Reply Handle(Request& req, const Caller& caller, bool can_pass_fd, int sock) {
    const unsigned v = req.version();
    const std::string target(req.target());
    const auto method = req.method();
    const std::string streams = "/v1/streams";
    if (target == "/v1/files/open") {
      if (method != http::verb::post)
        return {Error(http::status::method_not_allowed, "use POST", v)};
      if (!can_pass_fd)
        return {Error(http::status::bad_request,
                      "/v1/files/open passes a file descriptor: use the unix control socket", v)};
      if (!opener_)
        return {Error(http::status::not_implemented, "this daemon cannot open files", v)};
      Reply r;
      r.res = OpenFile(req, caller, &r.fd);
      return r;
    }
    if (target == "/batchdownload/path" || target == "/v1/warmup") {
      if (method != http::verb::post)
        return {Error(http::status::method_not_allowed, "use POST", v)};
      if (target == "/v1/warmup") return {Warmup(req, caller)};
      return BatchDownload(req, caller, sock);
    }
    if (target == "/v1/stats") {
      if (method != http::verb::get) return {Error(http::status::method_not_allowed, "use GET", v)};
      return {JsonResponse(http::status::ok, StatsJson(caller), v)};
    }
    if (target == streams) {
      if (method != http::verb::post)
        return {Error(http::status::method_not_allowed, "use POST", v)};
      return {CreateStream(req, caller)};
    }
    if (target.rfind(streams + "/", 0) == 0) {
      std::string rest = target.substr(streams.size() + 1);
      const std::string suffix = "/paths";
      if (rest.size() > suffix.size() &&
          rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) == 0) {
        if (method != http::verb::post)
          return {Error(http::status::method_not_allowed, "use POST", v)};
        return {PublishPaths(req, caller, rest.substr(0, rest.size() - suffix.size()))};
      }
      if (rest.find('/') == std::string::npos && !rest.empty()) {
        if (method != http::verb::delete_)
          return {Error(http::status::method_not_allowed, "use DELETE", v)};
        const Prefetcher::Op op = prefetcher_->DeleteStreamAs(caller.uid, rest);
        if (op != Prefetcher::Op::kOk) return {StreamError(op, rest, v)};
        Response res{http::status::no_content, v};
        res.prepare_payload();
        return {res};
      }
    }
    if (target == "/prefetch/read/path") {
      if (method != http::verb::post)
        return {Error(http::status::method_not_allowed, "use POST", v)};
      return {LegacyPrefetch(req, caller)};
    }
    if (target == "/register/pid" || target == "/unregister/pid") {
      if (method != http::verb::post)
        return {Error(http::status::method_not_allowed, "use POST", v)};
      std::string why;
      std::optional<json> body = ParseBody(req, &why);
      if (!body) return {Error(http::status::bad_request, why, v)};
      if (!body->is_array())
        return {Error(http::status::bad_request, "body must be a JSON array of pids", v)};
      for (const auto& pid : *body)
        if (!pid.is_number_integer())
          return {Error(http::status::bad_request, "pids must be integers", v)};
      CTFS_LOG(kDebug) << target.substr(1) << ": " << body->size() << " pids from uid "
                       << caller.uid;
      return {Text(http::status::ok, "ok\n", v)};
    }
    // A route this daemon does not have: a client may fall back to another way.
    return {ErrorFrom(http::status::not_found, Status::NotSupported("no route " + target), v)};
  }

  // Whose read permission a stream's fetches are checked against: none for root, or where
  // the store has no owners.
  std::shared_ptr<const Caller> ReaderFor(const Caller& caller) const {
    if (caller.IsRoot() || options_.resolver == nullptr || !options_.resolver->checks_store())
      return nullptr;
    return std::make_shared<const Caller>(caller);
  }

  Response StreamError(Prefetcher::Op op, const std::string& id, unsigned v) {
    switch (op) {
      case Prefetcher::Op::kForbidden:
        return Error(http::status::forbidden, "stream " + id + " belongs to another user", v);
      case Prefetcher::Op::kFull:
        return Error(http::status::too_many_requests,
                     "too many queued paths for this user (prefetch.max_queued_paths_per_uid)", v);
      default:
        return Error(http::status::not_found, "unknown stream " + id, v);
    }
  }

  Response CreateStream(const Request& req, const Caller& caller) {
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
    const std::string id = prefetcher_->CreateStream(name, pid, caller.uid, ReaderFor(caller));
    if (id.empty())
      return Error(http::status::too_many_requests,
                   "too many streams for this user (prefetch.max_streams_per_uid)", v);
    return JsonResponse(http::status::created, json{{"id", id}}, v);
  }

  void CountRejected(Reject r) {
    rejected_counts_[static_cast<int>(r)]++;
    if (rejected_[static_cast<int>(r)]) rejected_[static_cast<int>(r)]->Increment();
  }

  // The store path of request path `p` as `caller` may read it (resolved beneath the root);
  // an error, counted, otherwise. `fresh`: the request hands out bytes, so nothing cached.
  Result<PathResolver::Resolved> Check(const std::string& p, const Caller& caller, bool fresh,
                                       PathResolver::Depth depth = PathResolver::Depth::kFile) {
    Result<std::string> sp = p.size() > 4096
                                 ? Result<std::string>(Status::NameTooLong("path over 4096 bytes"))
                                 : ToStorePath(options_.mount_point, p);
    if (!sp.ok()) {
      CountRejected(Reject::kOutside);
      return sp.status();
    }
    if (options_.resolver == nullptr) return PathResolver::Resolved{sp.value(), {}};
    Reject why = Reject::kNone;
    Result<PathResolver::Resolved> r = options_.resolver->Resolve(*sp, caller, fresh, &why, depth);
    if (!r.ok()) {
      CountRejected(why);
      // Say what a user may know: the path asked for, not where the store keeps it.
      const Status& s = r.status();
      if (why == Reject::kNotFound) return Status::NotFound(p + ": no such file");
      if (why == Reject::kPermission) return Status::PermissionDenied(p + ": permission denied");
      if (why == Reject::kNotFile) return Status::IsDirectory(p + ": not a regular file");
      if (why == Reject::kSymlink || why == Reject::kLoop) {
        const size_t colon = s.message().find(": ");
        return Status::PermissionDenied(
            p + ": " + (colon == std::string::npos ? s.message() : s.message().substr(colon + 2)));
      }
      return Status::IOError(p + ": the store failed");
    }
    return r;
  }

  // Converts `paths` (a JSON array) to store paths beneath directories the caller may search;
  // counts rejected ones. The files themselves are checked when fetched (the stream's reader).
  std::optional<std::vector<std::string>> StorePaths(
      const json& paths, const Caller& caller, uint64_t* rejected, std::string* why,
      PathResolver::Depth depth = PathResolver::Depth::kDirectories, bool fresh = false) {
    if (!paths.is_array()) {
      *why = "paths must be an array of strings";
      return std::nullopt;
    }
    std::vector<std::string> out;
    out.reserve(paths.size());
    for (const auto& p : paths) {
      if (!p.is_string()) {
        *why = "paths must be an array of strings";
        return std::nullopt;
      }
      Result<PathResolver::Resolved> r =
          Check(p.get_ref<const std::string&>(), caller, fresh, depth);
      if (r.ok()) {
        out.push_back(std::move(r->path));
      } else {
        ++*rejected;
        *why = r.status().message();
      }
    }
    return out;
  }

  // The store paths of a {"paths": [...]} body; nothing (and `why`) if the body is malformed.
  std::optional<std::vector<std::string>> PathsBody(
      const Request& req, const Caller& caller, uint64_t* rejected, std::string* why,
      PathResolver::Depth depth = PathResolver::Depth::kDirectories, bool fresh = false) {
    std::optional<json> body = ParseBody(req, why);
    if (!body) return std::nullopt;
    if (!body->is_object() || !body->contains("paths")) {
      *why = "body must be {\"paths\": [...]}";
      return std::nullopt;
    }
    return StorePaths((*body)["paths"], caller, rejected, why, depth, fresh);
  }

  Response PublishPaths(const Request& req, const Caller& caller, const std::string& id) {
    const unsigned v = req.version();
    if (Prefetcher::Op op = prefetcher_->CheckStream(caller.uid, id); op != Prefetcher::Op::kOk)
      return StreamError(op, id, v);
    uint64_t rejected = 0;
    std::string why;
    std::optional<std::vector<std::string>> paths = PathsBody(req, caller, &rejected, &why);
    if (!paths) return Error(http::status::bad_request, why, v);
    if (paths->empty() && rejected > 0) return Error(http::status::unprocessable_entity, why, v);
    const Prefetcher::Op op = prefetcher_->PublishAs(caller.uid, id, *paths);
    if (op != Prefetcher::Op::kOk) return StreamError(op, id, v);
    return JsonResponse(http::status::accepted,
                        json{{"accepted", paths->size()}, {"rejected", rejected}}, v);
  }

  Response LegacyPrefetch(const Request& req, const Caller& caller) {
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
    {
      // One legacy stream per user: users never share a stream.
      std::lock_guard<std::mutex> l(legacy_mu_);
      std::string& id = legacy_streams_[caller.uid];
      // The original package expects "prefetching." whatever happens: past the per-user
      // limits, as many paths as fit are published (prefetching is best effort).
      size_t taken = 0;
      Prefetcher::Op op = id.empty() ? Prefetcher::Op::kNotFound
                                     : prefetcher_->PublishAs(caller.uid, id, all, true, &taken);
      if (op == Prefetcher::Op::kNotFound) {
        id = prefetcher_->CreateStream("cube_torch legacy", 0, caller.uid, ReaderFor(caller));
        if (id.empty()) {
          legacy_streams_.erase(caller.uid);
          return StreamError(Prefetcher::Op::kFull, "legacy", v);
        }
        op = prefetcher_->PublishAs(caller.uid, id, all, true, &taken);
      }
      if (op == Prefetcher::Op::kFull || taken < all.size()) {
        if (dropped_warnings_++ < 3 || dropped_warnings_ % 1000 == 0)
          CTFS_LOG(kWarn) << "legacy prefetch of uid " << caller.uid << ": " << all.size() - taken
                          << " paths over the queued-path limits dropped";
      } else if (op != Prefetcher::Op::kOk) {
        return StreamError(op, id, v);
      }
    }
    return Text(http::status::ok, "prefetching.\n", v);
  }

  // Streams the reply with chunked transfer encoding straight from the caches: memory held is
  // one chunk of the file being sent plus a small buffer, whatever the reply's size.
  Reply BatchDownload(Request& req, const Caller& caller, int sock) {
    const unsigned v = req.version();
    std::string why;
    std::optional<json> body = ParseBody(req, &why);
    if (!body) return {Error(http::status::bad_request, why, v)};
    if (!body->is_array())
      return {Error(http::status::bad_request, "body must be [[path, ...]]", v)};
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
    // data, all big-endian. A file that cannot be read is sent with no data.
    std::string frame;
    PutU64(frame, 0);
    PutU64(frame, paths.size());
    if (!out.Write(frame.data(), frame.size())) return Reply{{}, -1, true, false};
    uint64_t warned = 0;
    for (const auto& p : paths) {
      Result<PathResolver::Resolved> r = Check(p, caller, /*fresh=*/true);
      auto entry_head = [&](uint64_t len) {
        frame.clear();
        PutU64(frame, p.size());
        frame += p;
        PutU64(frame, len);
        return out.Write(frame.data(), frame.size());
      };
      bool started = false;
      Status s = r.status();
      if (r.ok()) {
        s = reader_(r->path, r->attr, [&](const char* data, size_t len) -> Status {
          if (!started) {
            if (!entry_head(r->attr.size)) return Status::IOError("client stopped reading");
            started = true;
          }
          if (!out.Write(data, len)) return Status::IOError("client stopped reading");
          return Status::OK();
        });
      }
      if (started && !s.ok()) {  // the length is out: the reply cannot go on
        CTFS_LOG(kWarn) << "batchdownload aborted in " << p << ": " << s.ToString();
        return Reply{{}, -1, true, false};
      }
      if (!s.ok() && warned++ < 3) CTFS_LOG(kWarn) << "batchdownload " << p << ": " << s.ToString();
      if (!started && !entry_head(0)) return Reply{{}, -1, true, false};
    }
    if (!out.Finish()) return Reply{{}, -1, true, false};
    return Reply{{}, -1, true, keep_alive};
  }

  // Buffers small writes and sends them, and large ones directly, as HTTP chunks on a
  // non-blocking socket, waiting at most `timeout_s` for the client to take more bytes.
  // A client must take the reply at kMinReplyRate on average after the first `timeout_s`:
  // one that reads a byte now and then cannot hold a worker thread (and a cached chunk).
  static constexpr double kMinReplyRate = 1 << 20;  // bytes a second
  class ChunkedWriter {
   public:
    ChunkedWriter(int sock, double timeout_s, bool chunked)
        : sock_(sock),
          chunked_(chunked),
          grace_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
              std::chrono::duration<double>(timeout_s))),
          start_(std::chrono::steady_clock::now()) {}
    bool Raw(const std::string& s) { return Send(s.data(), s.size()); }
    bool Write(const char* data, size_t len) {
      if (buf_.size() + len <= kSendBuffer) {
        buf_.append(data, len);
        return true;
      }
      return Flush() && Chunk(data, len);
    }
    bool Flush() {
      if (buf_.empty()) return true;
      const bool ok = Chunk(buf_.data(), buf_.size());
      buf_.clear();
      return ok;
    }
    bool Finish() { return Flush() && (!chunked_ || Send("0\r\n\r\n", 5)); }

   private:
    bool Chunk(const char* data, size_t len) {
      if (!chunked_) return Send(data, len);
      char size_line[24];
      const int n = std::snprintf(size_line, sizeof(size_line), "%zx\r\n", len);
      return Send(size_line, static_cast<size_t>(n)) && Send(data, len) && Send("\r\n", 2);
    }
    bool Send(const char* data, size_t len) {
      size_t done = 0;
      while (done < len) {
        const ssize_t n = ::send(sock_, data + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          done += static_cast<size_t>(n);
          sent_ += static_cast<uint64_t>(n);
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno != EAGAIN) return false;
        // The deadline grows with what the client took, not with each byte it takes.
        const auto deadline = start_ + grace_ +
                              std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                  std::chrono::duration<double>(sent_ / kMinReplyRate));
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) return false;  // too slow a client: the reply is cut
        pollfd p{sock_, POLLOUT, 0};
        if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000))) < 0 &&
            errno != EINTR)
          return false;
      }
      return true;
    }
    const int sock_;
    const bool chunked_;
    const std::chrono::steady_clock::duration grace_;
    const std::chrono::steady_clock::time_point start_;
    uint64_t sent_ = 0;
    std::string buf_;
  };

  Response Warmup(const Request& req, const Caller& caller) {
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

  // POST /v1/files/open {"path": str}: the file made resident, and its descriptor in *fd.
  Response OpenFile(const Request& req, const Caller& caller, int* fd) {
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
    if (f.ok() && sp->attr.mode != 0 &&
        (f->size != sp->attr.size || f->mtime_ns != sp->attr.mtime_ns)) {
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

  // Counters; a user other than root sees only its own streams.
  json StatsJson(const Caller& caller) {
    Stats s = caller.IsRoot() ? prefetcher_->GetStats() : prefetcher_->GetStats(caller.uid);
    json streams = json::array();
    for (const auto& st : s.streams) {
      streams.push_back({{"id", st.id},
                         {"name", st.name},
                         {"pid", st.pid},
                         {"uid", st.uid},
                         {"published", st.published},
                         {"read", st.read},
                         {"skipped", st.skipped},
                         {"queued", st.queued},
                         {"fetched", st.fetched},
                         {"failed", st.failed},
                         {"evicted_unread", st.evicted_unread},
                         {"reads", CountsJson(st.reads)},
                         {"hit_ratio", RatioJson(st.reads)}});
    }
    json rejected = json::object();
    for (int r = 1; r < kRejectReasons; ++r)
      rejected[RejectName(static_cast<Reject>(r))] = rejected_counts_[r].load();
    json refused = json::object();
    for (int r = 0; r < kRefuseReasons; ++r) refused[kRefuseNames[r]] = refused_counts_[r].load();
    return json{{"global",
                 {{"reads", CountsJson(s.reads)},
                  {"hit_ratio", RatioJson(s.reads)},
                  {"prefetch",
                   {{"fetched", s.fetched},
                    {"failed", s.failed},
                    {"evicted_unread", s.evicted_unread},
                    {"preempted", s.preempted},
                    {"denied", s.denied},
                    {"page_resident", s.page_resident},
                    {"probed_absent", s.probed_absent},
                    {"page_drops", s.page_drops},
                    {"page_pressure", s.page_pressure},
                    {"warmed", s.warmed},
                    {"cached", s.cached},
                    {"resident_marks", s.resident_marks},
                    {"inflight", s.inflight},
                    {"window_files", s.window_files},
                    {"window_bytes", s.window_bytes},
                    {"window_budget_bytes", s.window_budget_bytes}}},
                  {"cache", {{"ram_bytes", ram_->bytes() + s.window_bytes}}},
                  {"files_open",
                   {{"opened", files_opened_.load()},
                    {"failed", files_open_failed_.load()},
                    {"store_files", files_open_store_.load()},
                    {"bytes", files_open_bytes_.load()}}},
                  {"control", {{"rejected_paths", rejected}, {"refused", refused}}}}},
                {"streams", streams}};
  }

  const Options options_;
  Prefetcher* const prefetcher_;
  cache::RamCache* const ram_;
  const FileReader reader_;
  Warmer* const warmer_;
  const FileOpener opener_;
  std::atomic<uint64_t> files_opened_{0}, files_open_failed_{0}, files_open_bytes_{0},
      files_open_store_{0};
  std::mutex body_mu_;  // guards the body budget
  uint64_t body_bytes_ = 0;
  std::unordered_map<uid_t, uint64_t> body_by_uid_;
  uint64_t dropped_warnings_ = 0;  // guarded by legacy_mu_
  std::atomic<int64_t> last_trim_{0};
  std::atomic<uint64_t> rejected_counts_[kRejectReasons] = {};
  std::atomic<uint64_t> refused_counts_[kRefuseReasons] = {};
  prometheus::Counter* rejected_[kRejectReasons] = {};
  prometheus::Counter* refused_[kRefuseReasons] = {};
  std::mutex conn_mu_;  // guards the connection counts
  int unix_connections_ = 0, tcp_connections_ = 0;
  std::unordered_map<uid_t, int> per_uid_;
  asio::io_context ioc_;
  asio::thread_pool pool_;       // /batchdownload, /v1/warmup
  asio::thread_pool api_pool_;   // the other requests
  asio::thread_pool open_pool_;  // /v1/files/open
  asio::local::stream_protocol::acceptor unix_acceptor_;
  asio::ip::tcp::acceptor tcp_acceptor_;
  std::thread thread_;
  bool bound_unix_ = false;                                // the socket file is ours to remove
  std::mutex legacy_mu_;                                   // guards legacy_streams_
  std::unordered_map<uid_t, std::string> legacy_streams_;  // per user, for the legacy endpoint
};

template <typename Protocol>
Session<Protocol>::~Session() {
  ReleaseBody();
  server_->ConnectionClosed(caller_.uid, listener_count_);
}

template <typename Protocol>
void Session<Protocol>::ReleaseBody() {
  if (body_reserved_ > 0) server_->ReleaseBody(caller_.uid, body_reserved_);
  body_reserved_ = 0;
}

template <typename Protocol>
void Session<Protocol>::Close() {
  beast::error_code ignored;
  stream_.socket().shutdown(Protocol::socket::shutdown_both, ignored);
}

template <typename Protocol>
void Session<Protocol>::Read() {
  ReleaseBody();
  parser_.emplace();
  parser_->body_limit(server_->options().max_body_bytes);
  parser_->header_limit(64 * 1024);
  // The whole request, header and body, must come within the idle timeout.
  stream_.expires_after(
      std::chrono::milliseconds(static_cast<int64_t>(server_->options().idle_timeout_s * 1000)));
  http::async_read_header(
      stream_, buffer_, *parser_,
      [self = this->shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
}

template <typename Protocol>
void Session<Protocol>::OnHeader(beast::error_code ec) {
  if (ec) return OnRead(ec);
  // Reserve the body's memory before reading it: all bodies being handled at once stay
  // within body_memory_bytes. A body of unknown length reserves the most it may be.
  const uint64_t max = server_->options().max_body_bytes;
  const auto len = parser_->content_length();
  const uint64_t want = len ? *len : (parser_->chunked() ? max : 0);
  if (want > max) {
    server_->CountRefused(ServerImpl::kTooLarge);
    return Write(
        Error(http::status::payload_too_large, "body over " + std::to_string(max) + " bytes", 11),
        false);
  }
  if (want > 0 && !server_->ReserveBody(caller_.uid, want)) {
    server_->CountRefused(ServerImpl::kBusy);
    return Write(Error(http::status::service_unavailable,
                       "busy: the server's request memory is in use; retry", 11),
                 false);
  }
  body_reserved_ = want;
  http::async_read(
      stream_, buffer_, *parser_,
      [self = this->shared_from_this()](beast::error_code ec2, size_t) { self->OnRead(ec2); });
}

template <typename Protocol>
void Session<Protocol>::OnRead(beast::error_code ec) {
  if (ec == http::error::body_limit) {
    server_->CountRefused(ServerImpl::kTooLarge);
    Write(Error(http::status::payload_too_large, "body over the limit", 11), false);
    return;
  }
  if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
      ec == beast::error::timeout || ec == asio::error::eof ||
      ec == asio::error::connection_reset || ec == asio::error::operation_aborted) {
    Close();
    return;
  }
  if (ec) {  // anything else the parser rejected
    Write(Error(http::status::bad_request, "malformed request: " + ec.message(), 11), false);
    return;
  }
  stream_.expires_never();  // the handler may take long; the reply sets its own limit
  Request req = parser_->release();
  const bool keep_alive = req.keep_alive();
  server_->Dispatch(
      std::move(req), caller_, stream_.get_executor(),
      [self = this->shared_from_this(), keep_alive](Reply r) {
        if (r.sent) {
          if (r.reuse) return self->Read();
          return self->Close();
        }
        if (r.fd >= 0) return self->WriteWithFd(std::move(r.res), r.fd);
        self->Write(std::move(r.res), keep_alive);
      },
      std::is_same_v<Protocol, asio::local::stream_protocol>, stream_.socket().native_handle());
}

// Sends `wire` on `sock` with `fd` attached to its first bytes (SCM_RIGHTS). Blocks up to
// 2 s on a client that stopped reading. False if the reply did not go out whole.
bool SendWithFd(int sock, const std::string& wire, int fd) {
  size_t sent = 0;
  bool fd_sent = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (sent < wire.size() && std::chrono::steady_clock::now() < deadline) {
    iovec iov{const_cast<char*>(wire.data() + sent), wire.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (!fd_sent) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      pollfd p{sock, POLLOUT, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    if (n < 0) return false;
    fd_sent = true;
    sent += static_cast<size_t>(n);
  }
  return sent == wire.size();
}

template <typename Protocol>
void Session<Protocol>::WriteWithFd(Response res, int fd) {
  res.keep_alive(false);
  std::ostringstream os;
  os << res;
  // The send may block on a client that stopped reading: not on the Asio thread. No
  // operation is pending on this socket meanwhile, so the other thread may use it.
  server_->RunBlocking([self = this->shared_from_this(), wire = os.str(), fd] {
    SendWithFd(self->stream_.socket().native_handle(), wire, fd);
    ::close(fd);
    asio::post(self->stream_.get_executor(), [self] { self->Close(); });
  });
}

template <typename Protocol>
void Session<Protocol>::Write(Response res, bool keep_alive) {
  res.keep_alive(keep_alive);
  auto sp = std::make_shared<Response>(std::move(res));
  stream_.expires_after(
      std::chrono::milliseconds(static_cast<int64_t>(server_->options().idle_timeout_s * 1000)));
  http::async_write(
      stream_, *sp,
      [self = this->shared_from_this(), sp, keep_alive](beast::error_code ec, size_t) {
        if (ec || !keep_alive) return self->Close();
        self->Read();
      });
}

}  // namespace

Result<std::unique_ptr<ControlServer>> ControlServer::Start(const Options& options,
                                                            Prefetcher* prefetcher,
                                                            cache::RamCache* ram, FileReader reader,
                                                            Warmer* warmer, FileOpener opener) {
  auto server = std::make_unique<ServerImpl>(options, prefetcher, ram, std::move(reader), warmer,
                                             std::move(opener));
  Status s = server->Listen();
  if (!s.ok()) return s;
  return std::unique_ptr<ControlServer>(std::move(server));
}

}  // namespace cubetorchfs::control
