#include "prefetch/control_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "common/logging.h"

namespace cubetorchfs::prefetch {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using json = nlohmann::json;
using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

namespace {

constexpr uint64_t kMaxBody = 16ull << 20;
constexpr std::chrono::seconds kIdleTimeout{30};
constexpr int kMaxConnections = 256;
// One /batchdownload reply is built in memory.
constexpr uint64_t kMaxBatchReply = 256ull << 20;
// Threads for requests that touch file data (/batchdownload, /v1/warmup). Each builds at
// most one reply of kMaxBatchReply for /batchdownload.
constexpr int kPoolThreads = 8;

Response JsonResponse(http::status status, const json& body, unsigned version) {
  Response res{status, version};
  res.set(http::field::content_type, "application/json");
  res.body() = body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  res.prepare_payload();
  return res;
}

Response Error(http::status status, const std::string& msg, unsigned version) {
  return JsonResponse(status, json{{"error", msg}}, version);
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
  for (int shift = 56; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
}

}  // namespace

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

// One HTTP connection on either listener.
template <typename Protocol>
class Session : public std::enable_shared_from_this<Session<Protocol>> {
 public:
  using Stream = beast::basic_stream<Protocol>;
  Session(typename Protocol::socket socket, ServerImpl* server)
      : stream_(std::move(socket)), server_(server) {}
  ~Session();

  void Start();

 private:
  void Read();
  void OnRead(beast::error_code ec);
  void Write(Response res, bool keep_alive);
  // Sends `res` with `fd` attached (SCM_RIGHTS), closes `fd` and the connection.
  void WriteWithFd(Response res, int fd);

  Stream stream_;
  ServerImpl* server_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
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
        open_pool_(kPoolThreads),
        unix_acceptor_(ioc_),
        tcp_acceptor_(ioc_) {}

  ~ServerImpl() override {
    ioc_.stop();
    if (thread_.joinable()) thread_.join();
    pool_.join();
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
      if (ec) return Status::IOError("prefetch.control_socket: cannot listen on " + path + ": " + ec.message());
      bound_unix_ = true;
      ::chmod(path.c_str(), 0660);
      Accept(unix_acceptor_);
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
      Accept(tcp_acceptor_);
    }
    thread_ = std::thread([this] { ioc_.run(); });
    return Status::OK();
  }

  // Answers `req`, calling `done` with the response (and a descriptor to attach, or -1) on the
  // Asio thread. `can_pass_fd`: the request came over the unix socket.
  void Dispatch(Request req, const asio::any_io_executor& ex,
                std::function<void(Response, int)> done, bool can_pass_fd) {
    if (req.target() == "/v1/files/open") {
      const unsigned v = req.version();
      if (req.method() != http::verb::post)
        return done(Error(http::status::method_not_allowed, "use POST", v), -1);
      if (!can_pass_fd)
        return done(Error(http::status::bad_request,
                          "/v1/files/open passes a file descriptor: use the unix control socket", v),
                    -1);
      if (!opener_)
        return done(Error(http::status::not_implemented, "this daemon cannot open files", v), -1);
      // Own threads: opens of big files take long and must not queue /batchdownload and
      // /v1/warmup behind them (nor those these).
      asio::post(open_pool_, [this, req = std::move(req), ex, done = std::move(done)]() mutable {
        Response res;
        int fd = -1;
        try {
          res = OpenFile(req, &fd);
        } catch (const std::exception& e) {
          res = Error(http::status::internal_server_error, e.what(), req.version());
        }
        asio::post(ex, [res = std::move(res), fd, done = std::move(done)]() mutable {
          done(std::move(res), fd);
        });
      });
      return;
    }
    if (req.method() == http::verb::post &&
        (req.target() == "/batchdownload/path" || req.target() == "/v1/warmup")) {
      // Reads file data: off the Asio thread.
      asio::post(pool_, [this, req = std::move(req), ex, done = std::move(done)]() mutable {
        Response res;
        try {
          res = req.target() == "/v1/warmup" ? Warmup(req) : BatchDownload(req);
        } catch (const std::exception& e) {  // e.g. bad_alloc: fail this request only
          res = Error(http::status::internal_server_error, e.what(), req.version());
        }
        asio::post(ex, [res = std::move(res), done = std::move(done)]() mutable { done(std::move(res), -1); });
      });
      return;
    }
    done(Handle(req), -1);
  }

  std::atomic<int> connections{0};

  // Runs `fn` on the threads of /v1/files/open (work that may block on a client).
  void RunBlocking(std::function<void()> fn) { asio::post(open_pool_, std::move(fn)); }

 private:
  template <typename Acceptor>
  void Accept(Acceptor& acceptor) {
    acceptor.async_accept([this, &acceptor](beast::error_code ec, auto socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {  // e.g. out of file descriptors: retry later rather than spin
        auto timer = std::make_shared<asio::steady_timer>(ioc_, std::chrono::milliseconds(100));
        timer->async_wait([this, &acceptor, timer](beast::error_code) { Accept(acceptor); });
        return;
      }
      {
        using Protocol = typename std::decay_t<decltype(socket)>::protocol_type;
        if (connections.load() >= kMaxConnections) {
          beast::error_code ignored;
          socket.close(ignored);
        } else {
          std::make_shared<Session<Protocol>>(std::move(socket), this)->Start();
        }
      }
      Accept(acceptor);
    });
  }

  Response Handle(const Request& req) {
    const unsigned v = req.version();
    const std::string target(req.target());
    const auto method = req.method();
    const std::string streams = "/v1/streams";
    if (target == "/v1/stats") {
      if (method != http::verb::get) return Error(http::status::method_not_allowed, "use GET", v);
      return JsonResponse(http::status::ok, StatsJson(), v);
    }
    if (target == streams) {
      if (method != http::verb::post) return Error(http::status::method_not_allowed, "use POST", v);
      return CreateStream(req);
    }
    if (target.rfind(streams + "/", 0) == 0) {
      std::string rest = target.substr(streams.size() + 1);
      const std::string suffix = "/paths";
      if (rest.size() > suffix.size() && rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) == 0) {
        if (method != http::verb::post) return Error(http::status::method_not_allowed, "use POST", v);
        return PublishPaths(req, rest.substr(0, rest.size() - suffix.size()));
      }
      if (rest.find('/') == std::string::npos && !rest.empty()) {
        if (method != http::verb::delete_) return Error(http::status::method_not_allowed, "use DELETE", v);
        if (!prefetcher_->DeleteStream(rest)) return Error(http::status::not_found, "unknown stream " + rest, v);
        Response res{http::status::no_content, v};
        res.prepare_payload();
        return res;
      }
    }
    if (target == "/prefetch/read/path") {
      if (method != http::verb::post) return Error(http::status::method_not_allowed, "use POST", v);
      return LegacyPrefetch(req);
    }
    if (target == "/register/pid" || target == "/unregister/pid") {
      if (method != http::verb::post) return Error(http::status::method_not_allowed, "use POST", v);
      json body = json::parse(req.body(), nullptr, false);
      if (!body.is_array()) return Error(http::status::bad_request, "body must be a JSON array of pids", v);
      for (const auto& pid : body)
        if (!pid.is_number_integer()) return Error(http::status::bad_request, "pids must be integers", v);
      CTFS_LOG(kInfo) << target.substr(1) << " " << body.dump();
      return Text(http::status::ok, "ok\n", v);
    }
    return Error(http::status::not_found, "no route " + target, v);
  }

  Response CreateStream(const Request& req) {
    const unsigned v = req.version();
    json body = json::parse(req.body(), nullptr, false);
    if (!body.is_object()) return Error(http::status::bad_request, "body must be a JSON object", v);
    std::string name = "stream";
    int pid = 0;
    if (body.contains("name")) {
      if (!body["name"].is_string()) return Error(http::status::bad_request, "\"name\" must be a string", v);
      name = body["name"].get<std::string>();
    }
    if (body.contains("pid")) {
      if (!body["pid"].is_number_integer()) return Error(http::status::bad_request, "\"pid\" must be an integer", v);
      pid = body["pid"].get<int>();
    }
    return JsonResponse(http::status::created, json{{"id", prefetcher_->CreateStream(name, pid)}}, v);
  }

  // Converts `paths` (a JSON array) to store paths; counts rejected ones.
  std::optional<std::vector<std::string>> StorePaths(const json& paths, uint64_t* rejected,
                                                     std::string* why) {
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
      Result<std::string> sp = ToStorePath(options_.mount_point, p.get<std::string>());
      if (sp.ok()) {
        out.push_back(std::move(sp).value());
      } else {
        ++*rejected;
        *why = sp.status().message();
      }
    }
    return out;
  }

  // The store paths of a {"paths": [...]} body; nothing (and `why`) if the body is malformed.
  std::optional<std::vector<std::string>> PathsBody(const Request& req, uint64_t* rejected,
                                                    std::string* why) {
    json body = json::parse(req.body(), nullptr, false);
    if (!body.is_object() || !body.contains("paths")) {
      *why = "body must be {\"paths\": [...]}";
      return std::nullopt;
    }
    return StorePaths(body["paths"], rejected, why);
  }

  Response PublishPaths(const Request& req, const std::string& id) {
    const unsigned v = req.version();
    uint64_t rejected = 0;
    std::string why;
    std::optional<std::vector<std::string>> paths = PathsBody(req, &rejected, &why);
    if (!paths) return Error(http::status::bad_request, why, v);
    if (paths->empty() && rejected > 0) return Error(http::status::unprocessable_entity, why, v);
    if (!prefetcher_->Publish(id, *paths)) return Error(http::status::not_found, "unknown stream " + id, v);
    return JsonResponse(http::status::accepted, json{{"accepted", paths->size()}, {"rejected", rejected}}, v);
  }

  Response LegacyPrefetch(const Request& req) {
    const unsigned v = req.version();
    json body = json::parse(req.body(), nullptr, false);
    if (!body.is_array()) return Error(http::status::bad_request, "body must be [[path, ...], ...]", v);
    std::vector<std::string> all;
    for (const auto& group : body) {
      uint64_t rejected = 0;
      std::string why;
      std::optional<std::vector<std::string>> paths = StorePaths(group, &rejected, &why);
      if (!paths) return Error(http::status::bad_request, why, v);
      all.insert(all.end(), paths->begin(), paths->end());
    }
    {
      std::lock_guard<std::mutex> l(legacy_mu_);
      if (legacy_stream_.empty() || !prefetcher_->Publish(legacy_stream_, all)) {
        legacy_stream_ = prefetcher_->CreateStream("cube_torch legacy", 0);
        prefetcher_->Publish(legacy_stream_, all);
      }
    }
    return Text(http::status::ok, "prefetching.\n", v);
  }

  Response BatchDownload(const Request& req) {
    const unsigned v = req.version();
    json body = json::parse(req.body(), nullptr, false);
    if (!body.is_array()) return Error(http::status::bad_request, "body must be [[path, ...]]", v);
    std::vector<std::string> paths;
    for (const auto& group : body) {
      if (!group.is_array()) return Error(http::status::bad_request, "body must be [[path, ...]]", v);
      for (const auto& p : group) {
        if (!p.is_string()) return Error(http::status::bad_request, "paths must be strings", v);
        paths.push_back(p.get<std::string>());
      }
    }
    // Framing: u64 version=0, u64 count, then per file u64 path_len | path | u64 data_len |
    // data, all big-endian. A file that cannot be read is sent with no data.
    std::string out;
    PutU64(out, 0);
    PutU64(out, paths.size());
    for (const auto& p : paths) {
      std::string data;
      Result<std::string> sp = ToStorePath(options_.mount_point, p);
      if (sp.ok()) {
        const uint64_t used = out.size() + 16 + p.size();
        if (used >= kMaxBatchReply)
          return Error(http::status::payload_too_large, "reply would exceed 256 MiB", v);
        Result<std::string> r = reader_(sp.value(), kMaxBatchReply - used);
        if (r.ok()) data = std::move(r).value();
        else CTFS_LOG(kWarn) << "batchdownload " << p << ": " << r.status().ToString();
      }
      PutU64(out, p.size());
      out += p;
      PutU64(out, data.size());
      out += data;
    }
    Response res{http::status::ok, v};
    res.set(http::field::content_type, "application/octet-stream");
    res.body() = std::move(out);
    res.prepare_payload();
    return res;
  }

  Response Warmup(const Request& req) {
    const unsigned v = req.version();
    if (warmer_ == nullptr)
      return Error(http::status::unprocessable_entity,
                   "no NVMe tier configured (cache.disk_dir): nothing to warm", v);
    uint64_t rejected = 0;
    std::string why;
    std::optional<std::vector<std::string>> paths = PathsBody(req, &rejected, &why);
    if (!paths) return Error(http::status::bad_request, why, v);
    uint64_t fetched = 0, skipped = 0, failed = rejected, bytes = 0;
    json errors = json::array();
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
                        json{{"fetched", fetched}, {"skipped", skipped}, {"failed", failed},
                             {"bytes", bytes}, {"errors", errors}},
                        v);
  }

  // POST /v1/files/open {"path": str}: the file made resident, and its descriptor in *fd.
  Response OpenFile(const Request& req, int* fd) {
    const unsigned v = req.version();
    json body = json::parse(req.body(), nullptr, false);
    if (!body.is_object() || !body.contains("path") || !body["path"].is_string())
      return Error(http::status::bad_request, "body must be {\"path\": str}", v);
    Result<std::string> sp = ToStorePath(options_.mount_point, body["path"].get<std::string>());
    if (!sp.ok()) return Error(http::status::unprocessable_entity, sp.status().message(), v);
    Result<OpenedFile> f = opener_(*sp);
    if (!f.ok()) {
      files_open_failed_++;
      const Status& s = f.status();
      if (s.IsNotFound()) CTFS_LOG(kDebug) << "files/open " << *sp << ": " << s.ToString();
      else CTFS_LOG(kWarn) << "files/open " << *sp << ": " << s.ToString();
      http::status code = s.IsNotFound() ? http::status::not_found
                          : s.code() == Status::Code::kInvalidArgument ? http::status::bad_request
                          : s.IsStale() ? http::status::conflict
                                        : http::status::service_unavailable;
      return Error(code, s.message(), v);
    }
    files_opened_++;
    files_open_bytes_ += f->size;
    if (f->store_file) files_open_store_++;
    *fd = f->fd;
    return JsonResponse(http::status::ok,
                        json{{"size", f->size},
                             {"mtime_ns", f->mtime_ns},
                             {"kind", f->store_file ? "store" : "memory"},
                             {"bytes", {{"ram", f->ram_bytes}, {"disk", f->disk_bytes},
                                        {"backend", f->backend_bytes}}}},
                        v);
  }

  json StatsJson() {
    Stats s = prefetcher_->GetStats();
    json streams = json::array();
    for (const auto& st : s.streams) {
      streams.push_back({{"id", st.id},
                         {"name", st.name},
                         {"pid", st.pid},
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
    return json{{"global",
                 {{"reads", CountsJson(s.reads)},
                  {"hit_ratio", RatioJson(s.reads)},
                  {"prefetch",
                   {{"fetched", s.fetched},
                    {"failed", s.failed},
                    {"evicted_unread", s.evicted_unread},
                    {"inflight", s.inflight},
                    {"window_files", s.window_files},
                    {"window_bytes", s.window_bytes},
                    {"window_budget_bytes", s.window_budget_bytes}}},
                  {"cache", {{"ram_bytes", ram_->bytes() + s.window_bytes}}},
                  {"files_open",
                   {{"opened", files_opened_.load()},
                    {"failed", files_open_failed_.load()},
                    {"store_files", files_open_store_.load()},
                    {"bytes", files_open_bytes_.load()}}}}},
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
  asio::io_context ioc_;
  asio::thread_pool pool_;
  asio::thread_pool open_pool_;  // /v1/files/open
  asio::local::stream_protocol::acceptor unix_acceptor_;
  asio::ip::tcp::acceptor tcp_acceptor_;
  std::thread thread_;
  bool bound_unix_ = false;     // the socket file is ours to remove
  std::mutex legacy_mu_;        // guards legacy_stream_
  std::string legacy_stream_;   // the stream the legacy endpoint publishes into
};

template <typename Protocol>
Session<Protocol>::~Session() {
  server_->connections--;
}

template <typename Protocol>
void Session<Protocol>::Start() {
  server_->connections++;
  Read();
}

template <typename Protocol>
void Session<Protocol>::Read() {
  parser_.emplace();
  parser_->body_limit(kMaxBody);
  parser_->header_limit(64 * 1024);
  stream_.expires_after(kIdleTimeout);
  http::async_read(stream_, buffer_, *parser_,
                   [self = this->shared_from_this()](beast::error_code ec, size_t) {
                     self->OnRead(ec);
                   });
}

template <typename Protocol>
void Session<Protocol>::OnRead(beast::error_code ec) {
  if (ec == http::error::body_limit) {
    Write(Error(http::status::payload_too_large, "body over 16 MiB", 11), false);
    return;
  }
  if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
      ec == beast::error::timeout || ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::operation_aborted) {
    beast::error_code ignored;
    stream_.socket().shutdown(Protocol::socket::shutdown_both, ignored);
    return;
  }
  if (ec) {  // anything else the parser rejected
    Write(Error(http::status::bad_request, "malformed request: " + ec.message(), 11), false);
    return;
  }
  Request req = parser_->release();
  const bool keep_alive = req.keep_alive();
  server_->Dispatch(
      std::move(req), stream_.get_executor(),
      [self = this->shared_from_this(), keep_alive](Response res, int fd) {
        if (fd >= 0) return self->WriteWithFd(std::move(res), fd);
        self->Write(std::move(res), keep_alive);
      },
      std::is_same_v<Protocol, asio::local::stream_protocol>);
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
    asio::post(self->stream_.get_executor(), [self] {
      beast::error_code ignored;
      self->stream_.socket().shutdown(Protocol::socket::shutdown_both, ignored);
    });
  });
}

template <typename Protocol>
void Session<Protocol>::Write(Response res, bool keep_alive) {
  res.keep_alive(keep_alive);
  auto sp = std::make_shared<Response>(std::move(res));
  stream_.expires_after(kIdleTimeout);
  http::async_write(stream_, *sp,
                    [self = this->shared_from_this(), sp, keep_alive](beast::error_code ec, size_t) {
                      if (ec || !keep_alive) {
                        beast::error_code ignored;
                        self->stream_.socket().shutdown(Protocol::socket::shutdown_both, ignored);
                        return;
                      }
                      self->Read();
                    });
}

}  // namespace

Result<std::unique_ptr<ControlServer>> ControlServer::Start(const Options& options,
                                                            Prefetcher* prefetcher,
                                                            cache::RamCache* ram,
                                                            FileReader reader, Warmer* warmer,
                                                            FileOpener opener) {
  auto server = std::make_unique<ServerImpl>(options, prefetcher, ram, std::move(reader), warmer,
                                             std::move(opener));
  Status s = server->Listen();
  if (!s.ok()) return s;
  return std::unique_ptr<ControlServer>(std::move(server));
}

}  // namespace cubetorchfs::prefetch
