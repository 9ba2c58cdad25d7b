// Internal to control/: shared by control_server.cc and control_routes.cc, never installed.
// The control server's class (ServerImpl), one connection (Session), what a request handler
// gives back (Reply), the writer of streamed replies (ChunkedWriter) and the small response
// helpers. control_server.cc holds the transport (listeners, connections, memory and
// connection limits); control_routes.cc the request handling (the routes and their checks).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/thread_annotations.h"
#include "control/batch_memory.h"
#include "control/control_server.h"
#include "control/routes.h"

namespace prometheus {
class Counter;
}

namespace cubetorchfs::control::detail {

using prefetch::Caller;
using prefetch::kRejectReasons;
using prefetch::MayAccess;
using prefetch::PathResolver;
using prefetch::Prefetcher;
using prefetch::ReadCounts;
using prefetch::Reject;
using prefetch::Stats;
using prefetch::StreamStats;
using prefetch::TcpPeer;
using prefetch::UnixPeer;
using prefetch::Warmer;
using prefetch::WarmResult;

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using json = nlohmann::json;
using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

// /batchdownload sends what it has gathered when this much is buffered.
constexpr size_t kSendBuffer = 64 << 10;

Response JsonResponse(http::status status, const json& body, unsigned version);
// An error reply: {"error": message, "code": the status code's wire name, "errno": n}
// (docs/errors.md). Clients map the code back to the same Status (Status::FromWire).
Response ErrorFrom(http::status status, const Status& s, unsigned version);
// That reply's body: also what a batch says of each file it could not give.
json ErrorJson(const Status& s);
// The 429 text of a publish refused by limit `r`: which limit, and what the user holds.
std::string FullMessage(const prefetch::QueuedPaths::Refusal& r);
// An error of the request itself: the code follows the HTTP status.
Response Error(http::status status, const std::string& msg, unsigned version);
Response Text(http::status status, const std::string& body, unsigned version);

class ServerImpl;

// What a handler gives back: a response to send, or word that it sent the reply itself.
struct Reply {
  Response res;
  int fd = -1;         // a descriptor to attach (SCM_RIGHTS), or -1
  bool sent = false;   // the handler wrote the whole reply on the socket itself
  bool reuse = false;  // with `sent`: the connection may carry another request
};
using Done = std::function<void(Reply)>;

// One HTTP connection on either listener, from a known user. Defined in control_server.cc,
// the only place one is made.
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
  size_t header_fields_ = 0;    // FieldCount after the header: trailers would add to it
};

// Buffers small writes and sends them, and large ones directly, as HTTP chunks on a
// non-blocking socket, waiting at most `timeout_s` for the client to take more bytes.
// A client must take the reply at kMinReplyRate on average after the first `timeout_s`:
// one that reads a byte now and then cannot hold a worker thread (and a cached chunk).
class ChunkedWriter {
 public:
  static constexpr double kMinReplyRate = 1 << 20;  // bytes a second
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
  bool Chunk(const char* data, size_t len);
  bool Send(const char* data, size_t len);

  const int sock_;
  const bool chunked_;
  const std::chrono::steady_clock::duration grace_;
  const std::chrono::steady_clock::time_point start_;
  uint64_t sent_ = 0;
  std::string buf_;
};

class ServerImpl final : public ControlServer {
 public:
  ServerImpl(const Options& options, Prefetcher* prefetcher, FileReader reader, Warmer* warmer,
             FileOpener opener);
  ~ServerImpl() override;

  Status Listen();

  // Answers `req` from `caller`, calling `done` on the Asio thread. `sock`: the connection's
  // descriptor, which a handler may write a streamed reply on (nothing else uses it
  // meanwhile). `can_pass_fd`: the request came over the unix socket.
  void Dispatch(Request req, const Caller& caller, const asio::any_io_executor& ex, Done done,
                bool can_pass_fd, int sock);

  // Runs `fn` on the threads of /v1/files/open (work that may block on a client).
  void RunBlocking(std::function<void()> fn) { asio::post(open_pool_, std::move(fn)); }
  // Runs `fn` on the API's threads.
  void RunApi(std::function<void()> fn) { asio::post(api_pool_, std::move(fn)); }

  // Takes `bytes` of the body memory budget for `uid`; false if it is in use. One user may
  // hold at most half of it (at least one body), so one slow sender cannot take it all.
  bool ReserveBody(uid_t uid, uint64_t bytes);
  void ReleaseBody(uid_t uid, uint64_t bytes);

  // `listener_count`: unix_connections_, tcp_connections_ or metrics_connections_ (taken
  // under conn_mu_).
  void ConnectionClosed(uid_t uid, int* listener_count);
  // Whether connections counted in `listener_count` came to the metrics port.
  bool IsMetricsListener(const int* listener_count) const {
    return listener_count == &metrics_connections_;
  }
  // GET /metrics and GET /healthz, the metrics port's only routes (anything else 404).
  Response HandleMetrics(const Request& req);

  // Answers `req` from `caller` on this thread, through the route table (routes.h): what
  // Dispatch runs on a worker. `sock` and `can_pass_fd` as for Dispatch. Public for the unit
  // tests of the routes.
  Reply Handle(Request& req, const Caller& caller, bool can_pass_fd, int sock);
  // The same for a request whose route is already matched (Dispatch matches it once, to pick
  // the threads).
  Reply Handle(Request& req, const RouteMatch& m, const Caller& caller, bool can_pass_fd, int sock);

  const Options& options() const { return options_; }

  enum Refuse {
    kUnknownPeer = 0,
    kListenerFull,
    kUserFull,
    kBusy,
    kTooLarge,
    kBadJson,
    kNotAllowed,
    kBadFraming
  };
  static constexpr int kRefuseReasons = 8;
  static constexpr const char* kRefuseNames[kRefuseReasons] = {
      "unknown_peer", "listener_full", "user_full",       "busy",
      "too_large",    "bad_json",      "not_allow_other", "bad_framing"};
  void CountRefused(Refuse r);

 private:
  // The transport (control_server.cc).
  template <typename Acceptor>
  void Accept(Acceptor& acceptor, int* count, int max);
  // Gives freed heap back to the system after a large request, at most twice a second.
  void TrimMemory();

  // Request handling (control_routes.cc).
  // The JSON body of `req`, within the shape limits (a discarded value if it is not JSON);
  // nothing, and why, when it is over them.
  std::optional<json> ParseBody(const Request& req, std::string* why);
  // Whose read permission a stream's fetches are checked against: none for root, or where
  // the store has no owners.
  std::shared_ptr<const Caller> ReaderFor(const Caller& caller) const;
  // The reply to a stream request refused with `op`; for kFull, `refusal` names the limit.
  Response StreamError(Prefetcher::Op op, const std::string& id, unsigned v,
                       const Prefetcher::Refusal& refusal = {});
  Response StreamsFull(unsigned v);  // 429: the caller has prefetch.max_streams_per_uid
  Response CreateStream(const Request& req, const Caller& caller);
  Response DeleteStream(const Caller& caller, const std::string& id, unsigned v);
  Response Health(const Caller& caller, unsigned v);   // GET /v1/health
  Response Upgrade(const Caller& caller, unsigned v);  // POST /v1/admin/upgrade
  // POST /register/pid and /unregister/pid: checked and logged, nothing else.
  Response RegisterPids(const Request& req, const Caller& caller, std::string_view route);
  void CountRejected(Reject r);
  // The store path of request path `p` as `caller` may read it (resolved beneath the root);
  // an error, counted, otherwise. `fresh`: the request hands out bytes, so nothing cached.
  // `searched`: the directories this request found searchable so far (PathResolver::Searched).
  Result<PathResolver::Resolved> Check(const std::string& p, const Caller& caller, bool fresh,
                                       PathResolver::Depth depth = PathResolver::Depth::kFile,
                                       PathResolver::Searched* searched = nullptr);
  // A file a request hands the caller the bytes of (/v1/files/batch, /batchdownload/path),
  // checked as the mount checks an open: the attributes the mount holds, else fresh ones (a
  // store that is not checked); a regular file the caller may read, or why not.
  Result<PathResolver::Resolved> CheckToRead(const std::string& p, const Caller& caller,
                                             PathResolver::Searched* searched);
  // Has the resolver ask the store, a few at a time, for the directories of `paths` it holds
  // no attributes of (PathResolver::Warm): a request of files of many new directories.
  void WarmDirectories(const json& paths);
  // Converts `paths` (a JSON array) to store paths beneath directories the caller may search;
  // counts rejected ones. The files themselves are checked when fetched (the stream's reader).
  std::optional<std::vector<std::string>> StorePaths(
      const json& paths, const Caller& caller, uint64_t* rejected, std::string* why,
      PathResolver::Depth depth = PathResolver::Depth::kDirectories, bool fresh = false);
  // The store paths of a {"paths": [...]} body; nothing (and `why`) if the body is malformed.
  // `object`, if not null, receives the body.
  std::optional<std::vector<std::string>> PathsBody(
      const Request& req, const Caller& caller, uint64_t* rejected, std::string* why,
      PathResolver::Depth depth = PathResolver::Depth::kDirectories, bool fresh = false,
      json* object = nullptr);
  Response PublishPaths(const Request& req, const Caller& caller, const std::string& id);
  // POST /v1/streams/{id}/positions: an 8-byte `unread` then 4-byte positions in the stream's
  // list, little-endian.
  Response PublishPositions(const Request& req, const Caller& caller, const std::string& id);
  // POST /v1/lists (`id` empty: a new list) and POST /v1/lists/{id}: NUL-separated paths.
  Response AppendList(const Request& req, const Caller& caller, const std::string& id);
  Response ListError(prefetch::FileLists::Op op, const std::string& id, unsigned v,
                     const std::string& why = "");
  Response LegacyPrefetch(const Request& req, const Caller& caller);
  // Publishes store paths `all` to the caller's legacy stream (`batch`: the one whose files
  // /batchdownload/path sends). An error to answer, if any (none for `batch`: best effort).
  std::optional<Response> PublishLegacy(const Caller& caller, const std::vector<std::string>& all,
                                        bool batch, unsigned v);
  // Streams the reply with chunked transfer encoding straight from the caches: memory held is
  // one chunk of the file being sent plus a small buffer, whatever the reply's size.
  Reply BatchDownload(Request& req, const Caller& caller, int sock);
  Response Warmup(const Request& req, const Caller& caller);
  // POST /v1/files/open {"path": str}: the file made resident, and its descriptor in *fd.
  Response OpenFile(const Request& req, const Caller& caller, int* fd);
  // POST /v1/files/batch (batch_files.cc): the files named, in one sealed memory file.
  static constexpr size_t kMaxBatchFiles = 4096;
  // POST /v1/files/batch writes its memory file in pieces of about this size.
  static constexpr size_t kBatchGather = 1 << 20;
  // A batch this small is checked against a reading of the memory left at most 100 ms old
  // (less what batches took since); a larger one against a fresh one.
  static constexpr uint64_t kBatchUnchecked = 4 << 20;
  Response BatchFiles(const Request& req, const Caller& caller, int* fd);
  // Counters; a user other than root sees only its own streams.
  json StatsJson(const Caller& caller);

  const Options options_;
  Prefetcher* const prefetcher_;
  const FileReader reader_;
  Warmer* const warmer_;
  const FileOpener opener_;
  prefetch::FileLists lists_;
  std::atomic<uint64_t> files_opened_{0}, files_open_failed_{0}, files_open_bytes_{0},
      files_open_store_{0};
  // POST /v1/files/batch: requests answered, files and bytes given, requests refused for
  // want of memory.
  std::atomic<uint64_t> batches_{0}, batch_files_{0}, batch_bytes_{0}, batch_refused_{0};
  // What the memory files handed out hold until their pages are gone, per user.
  BatchMemory batch_memory_;
  Mutex body_mu_;  // the body memory budget
  uint64_t body_bytes_ GUARDED_BY(body_mu_) = 0;
  std::unordered_map<uid_t, uint64_t> body_by_uid_ GUARDED_BY(body_mu_);
  std::atomic<int64_t> last_trim_{0};
  std::atomic<uint64_t> rejected_counts_[kRejectReasons] = {};
  std::atomic<uint64_t> refused_counts_[kRefuseReasons] = {};
  prometheus::Counter* rejected_[kRejectReasons] = {};
  prometheus::Counter* refused_[kRefuseReasons] = {};
  Mutex conn_mu_;  // the connection counts
  int unix_connections_ GUARDED_BY(conn_mu_) = 0;
  int tcp_connections_ GUARDED_BY(conn_mu_) = 0;
  int metrics_connections_ GUARDED_BY(conn_mu_) = 0;
  std::unordered_map<uid_t, int> per_uid_ GUARDED_BY(conn_mu_);
  asio::io_context ioc_;
  asio::thread_pool pool_;       // /batchdownload, /v1/warmup
  asio::thread_pool api_pool_;   // the other requests
  asio::thread_pool open_pool_;  // /v1/files/open
  asio::local::stream_protocol::acceptor unix_acceptor_;
  asio::ip::tcp::acceptor tcp_acceptor_;
  asio::ip::tcp::acceptor metrics_acceptor_;
  std::thread thread_;
  bool bound_unix_ = false;  // the socket file is ours to remove
  // The legacy endpoint's streams, one per user, and its warnings. Taken before the
  // prefetcher's lock (a publish runs under it).
  Mutex legacy_mu_;
  std::unordered_map<uid_t, std::string> legacy_streams_ GUARDED_BY(legacy_mu_);
  std::unordered_map<uid_t, std::string> legacy_batch_streams_ GUARDED_BY(legacy_mu_);
  uint64_t dropped_warnings_ GUARDED_BY(legacy_mu_) = 0;
};

}  // namespace cubetorchfs::control::detail
