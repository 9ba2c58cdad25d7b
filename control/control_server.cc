// The control server's transport (server_impl.h declares what both files share): the
// listeners and the Asio thread, accepting connections from known users within the connection
// limits, reading requests within the body memory budget, handing them to the worker threads
// (ServerImpl::Dispatch; the routes are in control_routes.cc) and writing the replies, a
// descriptor attached (SCM_RIGHTS) or streamed (ChunkedWriter). Also the response helpers.
#include "control/control_server.h"

#include <fcntl.h>
#include <malloc.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "common/logging.h"
#include "common/private_dir.h"
#include "common/unique_fd.h"
#include "control/http_framing.h"
#include "control/routes.h"
#include "control/server_impl.h"

namespace cubetorchfs::control::detail {

namespace {

// Threads for requests that touch file data (/batchdownload, /v1/warmup, /v1/files/open).
// A /batchdownload reply holds at most one cached chunk at a time while it is sent.
constexpr int kPoolThreads = 8;
// Threads for the other requests (JSON parsing and path checks).
constexpr int kApiThreads = 2;

}  // namespace

Response JsonResponse(http::status status, const json& body, unsigned version) {
  Response res{status, version};
  res.set(http::field::content_type, "application/json");
  res.body() = body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  res.prepare_payload();
  return res;
}

json ErrorJson(const Status& s) {
  return json{
      {"error", s.message()}, {"code", std::string(CodeName(s.code()))}, {"errno", ToErrno(s)}};
}

Response ErrorFrom(http::status status, const Status& s, unsigned version) {
  return JsonResponse(status, ErrorJson(s), version);
}

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

ServerImpl::ServerImpl(const Options& options, Prefetcher* prefetcher, FileReader reader,
                       Warmer* warmer, FileOpener opener)
    : options_(options),
      prefetcher_(prefetcher),
      reader_(std::move(reader)),
      warmer_(warmer),
      opener_(std::move(opener)),
      lists_(options.lists, SystemClock()),
      batch_memory_(BatchMemory::Options{
          .bytes_per_uid = options.batch_memory_bytes_per_uid,
          .available = options.available_memory
                           ? options.available_memory
                           : std::function<uint64_t()>(&prefetch::ModelFetcher::AvailableMemory),
          .fresh_above = kBatchUnchecked}),
      pool_(kPoolThreads),
      api_pool_(kApiThreads),
      open_pool_(kPoolThreads),
      unix_acceptor_(ioc_),
      tcp_acceptor_(ioc_),
      metrics_acceptor_(ioc_) {
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

ServerImpl::~ServerImpl() {
  ioc_.stop();
  if (thread_.joinable()) thread_.join();
  pool_.join();
  api_pool_.join();
  open_pool_.join();
  if (bound_unix_) ::unlink(options_.socket_path.c_str());
}

Status ServerImpl::Listen() {
  // Sockets not handed over are bound here (a daemon without a supervisor, the unit tests).
  Listeners own;
  const bool bind_unix = options_.unix_fd < 0 && !options_.socket_path.empty();
  const bool bind_prof = options_.prof_fd < 0 && options_.prof_port != 0;
  const bool bind_metrics = options_.metrics_fd < 0 && options_.metrics_port != 0;
  auto bind_one = [&](const std::string& path, uint16_t prof, uint16_t metrics) -> Status {
    Result<Listeners> b = BindListeners(path, prof, metrics);
    if (!b.ok()) {
      if (!options_.tolerate_listen_errors) return b.status();
      CTFS_LOG(kError) << b.status().message() << "; serving the mount without it";
      return Status::OK();
    }
    if (b->unix_fd >= 0) own.unix_fd = b->unix_fd;
    if (b->prof_fd >= 0) own.prof_fd = b->prof_fd;
    if (b->metrics_fd >= 0) own.metrics_fd = b->metrics_fd;
    return Status::OK();
  };
  auto close_own = [&own] {
    for (int fd : {own.unix_fd, own.prof_fd, own.metrics_fd})
      if (fd >= 0) ::close(fd);
  };
  for (Status s : {bind_unix ? bind_one(options_.socket_path, 0, 0) : Status::OK(),
                   bind_prof ? bind_one("", options_.prof_port, 0) : Status::OK(),
                   bind_metrics ? bind_one("", 0, options_.metrics_port) : Status::OK()}) {
    if (!s.ok()) {
      close_own();
      return s;
    }
  }
  bound_unix_ = own.unix_fd >= 0;
  const int unix_fd = options_.unix_fd >= 0 ? options_.unix_fd : own.unix_fd;
  const int prof_fd = options_.prof_fd >= 0 ? options_.prof_fd : own.prof_fd;
  const int metrics_fd = options_.metrics_fd >= 0 ? options_.metrics_fd : own.metrics_fd;
  beast::error_code ec;
  if (unix_fd >= 0) {
    unix_acceptor_.assign(asio::local::stream_protocol(), unix_fd, ec);
    if (ec) return Status::IOError("prefetch.control_socket: " + ec.message());
    Accept(unix_acceptor_, &unix_connections_, options_.max_connections_unix);
  }
  if (prof_fd >= 0) {
    tcp_acceptor_.assign(asio::ip::tcp::v4(), prof_fd, ec);
    if (ec) return Status::IOError("profPort: " + ec.message());
    Accept(tcp_acceptor_, &tcp_connections_, options_.max_connections_tcp);
  }
  if (metrics_fd >= 0) {
    metrics_acceptor_.assign(asio::ip::tcp::v4(), metrics_fd, ec);
    if (ec) return Status::IOError("exporterPort: " + ec.message());
    Accept(metrics_acceptor_, &metrics_connections_, options_.max_connections_tcp);
  }
  thread_ = std::thread([this] { ioc_.run(); });
  return Status::OK();
}

Response ServerImpl::HandleMetrics(const Request& req) {
  const std::string_view target(req.target().data(), req.target().size());
  const bool get = req.method() == http::verb::get;
  if (target == "/healthz") {
    if (!get) return Error(http::status::method_not_allowed, "GET only", req.version());
    if (!options_.health) return Error(http::status::not_implemented, "no health", req.version());
    const json report = options_.health(/*details=*/false);
    const bool healthy = report.value("healthy", false);
    return JsonResponse(healthy ? http::status::ok : http::status::service_unavailable, report,
                        req.version());
  }
  if (target == "/metrics") {
    if (!get) return Error(http::status::method_not_allowed, "GET only", req.version());
    std::string text;
    if (options_.registry != nullptr)
      text = prometheus::TextSerializer().Serialize(options_.registry->Collect());
    Response res = Text(http::status::ok, text, req.version());
    res.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
    return res;
  }
  return Error(http::status::not_found, "the metrics port serves /metrics and /healthz",
               req.version());
}

void ServerImpl::Dispatch(Request req, const Caller& caller, const asio::any_io_executor& ex,
                          Done done, bool can_pass_fd, int sock) {
  auto finish = [ex, done = std::move(done)](Reply r) mutable {
    asio::post(ex, [r = std::move(r), done = std::move(done)]() mutable { done(std::move(r)); });
  };
  // The route, matched once: it picks the threads (routes.h: Pool; an unknown route is
  // answered on the API's) and the handler.
  RouteMatch m =
      MatchRoute(req.method(), std::string_view(req.target().data(), req.target().size()));
  const Pool which = m.route != nullptr ? m.route->pool : Pool::kApi;
  auto run = [this, caller, sock, can_pass_fd, m = std::move(m),
              finish = std::move(finish)](Request& rq) mutable {
    Reply r;
    try {
      r = Handle(rq, m, caller, can_pass_fd, sock);
    } catch (const std::exception& e) {  // e.g. bad_alloc: fail this request only
      r = Reply{Error(http::status::internal_server_error, e.what(), rq.version())};
    }
    const bool big = rq.body().size() >= (1u << 20) || r.sent;
    rq.body().clear();  // free the body before the reply goes out
    rq.body().shrink_to_fit();
    if (big) TrimMemory();
    finish(std::move(r));
  };
  asio::thread_pool& pool = which == Pool::kOpen   ? open_pool_
                            : which == Pool::kData ? pool_
                                                   : api_pool_;
  asio::post(pool, [req = std::move(req), run = std::move(run)]() mutable { run(req); });
}

bool ServerImpl::ReserveBody(uid_t uid, uint64_t bytes) {
  MutexLock l(body_mu_);
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

void ServerImpl::ReleaseBody(uid_t uid, uint64_t bytes) {
  MutexLock l(body_mu_);
  body_bytes_ -= bytes;
  auto it = body_by_uid_.find(uid);
  if (it != body_by_uid_.end() && (it->second -= bytes) == 0) body_by_uid_.erase(it);
}

void ServerImpl::ConnectionClosed(uid_t uid, int* listener_count) {
  MutexLock l(conn_mu_);
  --*listener_count;
  auto it = per_uid_.find(uid);
  if (it != per_uid_.end() && --it->second == 0) per_uid_.erase(it);
}

void ServerImpl::CountRefused(Refuse r) {
  refused_counts_[r]++;
  if (refused_[r]) refused_[r]->Increment();
}

template <typename Acceptor>
void ServerImpl::Accept(Acceptor& acceptor, int* count, int max) {
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
    } else if (!options_.others_may_use && !caller->IsRoot() && !IsMetricsListener(count)) {
      refuse = kNotAllowed;  // the mount has no allow_other: the kernel refuses them too
    } else {
      MutexLock l(conn_mu_);
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
      std::make_shared<Session<Protocol>>(std::move(socket), this, std::move(caller).value(), count)
          ->Start();
    }
    Accept(acceptor, count, max);
  });
}

void ServerImpl::TrimMemory() {
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  int64_t last = last_trim_.load();
  if (now - last < 500'000'000 || !last_trim_.compare_exchange_strong(last, now)) return;
  ::malloc_trim(0);
}

bool ChunkedWriter::Chunk(const char* data, size_t len) {
  if (!chunked_) return Send(data, len);
  char size_line[24];
  const int n = std::snprintf(size_line, sizeof(size_line), "%zx\r\n", len);
  return Send(size_line, static_cast<size_t>(n)) && Send(data, len) && Send("\r\n", 2);
}

bool ChunkedWriter::Send(const char* data, size_t len) {
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
  parser_->header_limit(kMaxHeaderBytes);
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
  bool unsupported = false;
  const std::string framing = FramingProblem(parser_->get(), parser_->chunked(), &unsupported);
  if (!framing.empty()) {
    server_->CountRefused(ServerImpl::kBadFraming);
    return Write(
        Error(unsupported ? http::status::not_implemented : http::status::bad_request, framing, 11),
        false);
  }
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
  header_fields_ = FieldCount(parser_->get());
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
    if (ec == http::error::bad_transfer_encoding || ec == http::error::bad_content_length)
      server_->CountRefused(ServerImpl::kBadFraming);
    Write(Error(http::status::bad_request, "malformed request: " + ec.message(), 11), false);
    return;
  }
  if (FieldCount(parser_->get()) != header_fields_) {
    server_->CountRefused(ServerImpl::kBadFraming);
    Write(Error(http::status::bad_request, "trailer fields after a chunked body are not accepted",
                11),
          false);
    return;
  }
  stream_.expires_never();  // the handler may take long; the reply sets its own limit
  Request req = parser_->release();
  const bool keep_alive = req.keep_alive();
  if (server_->IsMetricsListener(listener_count_)) {
    // Metrics and health only; answered on an API worker (a scrape serializes the registry).
    server_->RunApi([self = this->shared_from_this(), req = std::move(req), keep_alive]() mutable {
      Response res = self->server_->HandleMetrics(req);
      asio::post(self->stream_.get_executor(), [self, res = std::move(res), keep_alive]() mutable {
        self->Write(std::move(res), keep_alive);
      });
    });
    return;
  }
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

namespace {

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

}  // namespace

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

}  // namespace cubetorchfs::control::detail

namespace cubetorchfs::control {

namespace {

// How long a new daemon waits for the one before it (same control socket) to let it go.
constexpr auto kSocketReleaseWait = std::chrono::seconds(5);

// A close-on-exec TCP socket listening on 127.0.0.1:`port`; the error names `key`.
Result<int> ListenLoopback(uint16_t port, const char* key) {
  const std::string where =
      std::string(key) + ": cannot listen on 127.0.0.1:" + std::to_string(port) + ": ";
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Status::IOError(where + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 ||
      ::listen(fd.get(), SOMAXCONN) != 0)
    return Status::IOError(where + std::strerror(errno));
  return fd.release();
}

// A close-on-exec unix socket listening at `path` (mode 0666), its directory made as the
// daemon's; a socket a running daemon still answers on is never taken.
Result<int> ListenUnix(const std::string& path) {
  // Other users reach the socket (0755), and it is made as root: not through a link, not in a
  // directory another user could swap or fill.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  CTFS_RETURN_IF_ERROR(EnsureDaemonDir(dir.empty() ? "." : dir, "prefetch.control_socket",
                                       "the control socket", CreateDir::kWithParents, 0755));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof a.sun_path)
    return Status::InvalidArgument("prefetch.control_socket: " + path + " is too long");
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  const auto* addr = reinterpret_cast<const sockaddr*>(&a);
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    // A daemon whose mount was just unmounted still answers while it shuts down: a mount right
    // after an umount waits for it, up to kSocketReleaseWait.
    const auto give_up = std::chrono::steady_clock::now() + kSocketReleaseWait;
    for (;;) {
      UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (probe.get() < 0 || ::connect(probe.get(), addr, sizeof a) != 0) break;
      if (std::chrono::steady_clock::now() >= give_up)
        return Status::IOError("prefetch.control_socket: " + path +
                               " is in use by a running daemon (same volName?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::unlink(path.c_str());
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0 || ::bind(fd.get(), addr, sizeof a) != 0 || ::listen(fd.get(), SOMAXCONN) != 0)
    return Status::IOError("prefetch.control_socket: cannot listen on " + path + ": " +
                           std::strerror(errno));
  // Any local user may connect: each request is checked with that user's own rights. Not
  // through a symlink planted at the name meanwhile (glibc refuses one here).
  ::fchmodat(AT_FDCWD, path.c_str(), 0666, AT_SYMLINK_NOFOLLOW);
  return fd.release();
}

}  // namespace

Result<Listeners> BindListeners(const std::string& socket_path, uint16_t prof_port,
                                uint16_t metrics_port) {
  Listeners l;
  auto fail = [&l](const Status& s) -> Result<Listeners> {
    for (int fd : {l.unix_fd, l.prof_fd, l.metrics_fd})
      if (fd >= 0) ::close(fd);
    return s;
  };
  if (!socket_path.empty()) {
    Result<int> fd = ListenUnix(socket_path);
    if (!fd.ok()) return fail(fd.status());
    l.unix_fd = *fd;
  }
  if (prof_port != 0) {
    Result<int> fd = ListenLoopback(prof_port, "profPort");
    if (!fd.ok()) return fail(fd.status());
    l.prof_fd = *fd;
  }
  if (metrics_port != 0) {
    Result<int> fd = ListenLoopback(metrics_port, "exporterPort");
    if (!fd.ok()) return fail(fd.status());
    l.metrics_fd = *fd;
  }
  return l;
}

Result<std::unique_ptr<ControlServer>> ControlServer::Start(const Options& options,
                                                            prefetch::Prefetcher* prefetcher,
                                                            FileReader reader,
                                                            prefetch::Warmer* warmer,
                                                            FileOpener opener) {
  auto server = std::make_unique<detail::ServerImpl>(options, prefetcher, std::move(reader), warmer,
                                                     std::move(opener));
  Status s = server->Listen();
  if (!s.ok()) return s;
  return std::unique_ptr<ControlServer>(std::move(server));
}

}  // namespace cubetorchfs::control
