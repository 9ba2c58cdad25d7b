// libFuzzer target: the control server's routes (control/control_routes.cc), driven as a
// connection drives them: a request read by Beast's parser with the server's limits and
// framing checks, handed to ServerImpl::Dispatch, answered on the worker threads. Behind it the
// world of tests/control/route_world.h: a real Prefetcher (its jobs run in this thread, a few
// per input), PathResolver, NVMe tier, Warmer and ModelFetcher over a posix store that holds
// what an attacker aims at.
//
// Input: up to 8 requests, separated by "\n--\n", each one byte of settings, then
// "METHOD TARGET\n" and the body. The settings pick the caller (root, a stranger, a member of
// the files' group, a second stranger), HTTP/1.0 or 1.1, the unix socket or the TCP port (which
// may not pass descriptors), and "Connection: close". "{id}" in a target stands for the stream
// the input created last. The harness adds Host and Content-Length, so that mutations of the
// body keep a request.
//
// Besides crashes, leaks and UBSan reports: no handler throws (a 500), every JSON reply parses,
// a streamed /batchdownload reply is well framed, no byte of a file only root may read reaches
// any other caller (in a /batchdownload reply or through a descriptor), /v1/stats shows a user
// other than root only its own streams, and no such user publishes to or deletes another's.
//
// State: each input's streams are deleted after it, so inputs do not fill the per-user limits
// (2 streams, 8 queued paths a user, 12 in all, 64 JSON values a body: small, so that inputs
// reach them). The resolver's attribute cache and the NVMe tier keep what earlier inputs put
// there.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <prometheus/registry.h>
#include <boost/asio.hpp>
#include <boost/beast/_experimental/test/stream.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>

#include "cache/disk_cache.h"
#include "cache/ram_cache.h"
#include "cfs_client/backend.h"
#include "common/clock.h"
#include "common/logging.h"
#include "control/control_server.h"
#include "control/http_framing.h"
#include "control/server_impl.h"
#include "prefetch/access.h"
#include "prefetch/model_fetch.h"
#include "prefetch/prefetcher.h"
#include "prefetch/warmer.h"
#include "tests/control/route_world.h"

namespace {

namespace fs = std::filesystem;
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using json = nlohmann::json;
using namespace cubetorchfs;
using control::ControlServer;
using control::detail::Reply;
using control::detail::Request;
using control::detail::ServerImpl;
using prefetch::Caller;

using control::testing::kSecret;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_control_routes: invariant broken: %s\n", what.c_str());
  std::abort();
}

void Check(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

// The world of tests/control/route_world.h, its server, and where replies come back.
struct World : control::testing::RouteWorld {
  std::unique_ptr<ServerImpl> server;
  asio::io_context ioc;  // where replies come back, as on the server's Asio thread
  std::unique_ptr<asio::executor_work_guard<asio::io_context::executor_type>> work;

  World() : RouteWorld(/*log_to_file=*/true) {
    server = MakeServer(ServerOptions());
    work = std::make_unique<asio::executor_work_guard<asio::io_context::executor_type>>(
        ioc.get_executor());
  }
};

World& TheWorld() {
  // Never destroyed: its threads run until exit. Its directory goes at a normal exit.
  static World* world = [] {
    World* w = new World();
    static const fs::path dir = w->dir;
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(dir, ec);
    });
    return w;
  }();
  return *world;
}

// Reads `fd` until end of file.
std::string ReadAll(int fd) {
  std::string out;
  char buf[64 << 10];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      return out;
    }
  }
}

uint64_t GetU64(std::string_view s, size_t* at) {
  Check(*at + 8 <= s.size(), "batchdownload reply: frame cut short");
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(s[(*at)++]);
  return v;
}

// Checks a streamed /batchdownload reply: framed whole, and nothing only root may read in it
// unless `root` asked.
void CheckBatchReply(const std::string& wire, bool http11, bool root) {
  const size_t head_end = wire.find("\r\n\r\n");
  Check(head_end != std::string::npos, "batchdownload reply without a header");
  Check(wire.rfind(http11 ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.0 200 OK\r\n", 0) == 0,
        "batchdownload reply: bad status line");
  std::string body;
  if (http11) {  // chunked
    size_t at = head_end + 4;
    for (;;) {
      const size_t eol = wire.find("\r\n", at);
      Check(eol != std::string::npos, "batchdownload reply: chunk size line cut");
      const uint64_t len = std::stoull(wire.substr(at, eol - at), nullptr, 16);
      at = eol + 2;
      if (len == 0) {
        Check(wire.compare(at, std::string::npos, "\r\n") == 0, "batchdownload: bad last chunk");
        break;
      }
      Check(at + len + 2 <= wire.size(), "batchdownload reply: chunk cut");
      body.append(wire, at, len);
      Check(wire.compare(at + len, 2, "\r\n") == 0, "batchdownload reply: chunk not ended");
      at += len + 2;
    }
  } else {
    body = wire.substr(head_end + 4);
  }
  size_t at = 0;
  Check(GetU64(body, &at) == 0, "batchdownload reply: version not 0");
  const uint64_t count = GetU64(body, &at);
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t path_len = GetU64(body, &at);
    Check(path_len <= body.size() - at, "batchdownload reply: path cut");
    at += path_len;
    const uint64_t data_len = GetU64(body, &at);
    Check(data_len <= body.size() - at, "batchdownload reply: data cut");
    if (!root && std::string_view(body).substr(at, data_len).find(kSecret) != std::string::npos)
      Fail("batchdownload sent a file only root may read to another user");
    at += data_len;
  }
  Check(at == body.size(), "batchdownload reply: bytes after the last file");
}

// The request of `input` as the server's reader would hand it on; nothing if it refuses it.
std::optional<Request> ReadRequest(uint8_t settings, std::string_view rest) {
  const size_t eol = rest.find('\n');
  if (eol == std::string_view::npos) return std::nullopt;
  const std::string_view line = rest.substr(0, eol);
  const size_t sp = line.find(' ');
  if (sp == std::string_view::npos) return std::nullopt;
  const std::string_view body = rest.substr(eol + 1);
  std::string wire;
  wire.reserve(rest.size() + 100);
  wire.append(line.substr(0, sp)).append(" ").append(line.substr(sp + 1));
  wire += (settings & 4) ? " HTTP/1.0\r\n" : " HTTP/1.1\r\n";
  wire += "Host: localhost\r\n";
  if (settings & 16) wire += "Connection: close\r\n";
  wire += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
  wire.append(body);

  asio::io_context ioc;
  beast::test::stream client(ioc, beast::string_view(wire.data(), wire.size()));
  client.close_remote();
  beast::flat_buffer buffer;
  http::request_parser<http::string_body> parser;
  parser.body_limit(ControlServer::Options{}.max_body_bytes);
  parser.header_limit(control::detail::kMaxHeaderBytes);
  beast::error_code ec;
  http::read_header(client, buffer, parser, ec);
  if (ec) return std::nullopt;
  bool unsupported = false;
  if (!control::detail::FramingProblem(parser.get(), parser.chunked(), &unsupported).empty())
    return std::nullopt;
  http::read(client, buffer, parser, ec);
  if (ec) return std::nullopt;
  return parser.release();
}

// The stream an input created last: its id, put in place of "{id}" in a target, and owner.
struct LastStream {
  std::string id = "0";
  uid_t owner = 0;
};

// Sends one request to the server as `settings` say, and checks the reply.
void RunRequest(World& w, uint8_t settings, std::string_view text, LastStream* stream) {
  std::string with_id(text.substr(0, text.find('\n')));
  const size_t at = with_id.find("{id}");
  const bool names_stream = at != std::string::npos;
  if (names_stream) with_id.replace(at, 4, stream->id);
  if (const size_t eol = text.find('\n'); eol != std::string_view::npos)
    with_id.append(text.substr(eol));
  std::optional<Request> req = ReadRequest(settings, with_id);
  if (!req) return;
  const Caller& caller = w.callers[settings & 3];
  const bool can_pass_fd = (settings & 8) == 0;  // the unix socket
  const bool http11 = req->version() == 11;
  const bool batch = req->target() == "/batchdownload/path";

  // The connection. /batchdownload/path streams its reply on it: a thread takes what it sends
  // (one for every request would cost a third of the executions a second). Anything another
  // route wrote there is read after the reply, and is a failure.
  int sv[2];
  Check(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
  std::string streamed;
  std::thread client;
  if (batch) client = std::thread([&streamed, fd = sv[1]] { streamed = ReadAll(fd); });

  Reply reply;
  bool answered = false;
  w.server->Dispatch(
      std::move(*req), caller, w.ioc.get_executor(),
      [&](Reply r) {
        reply = std::move(r);
        answered = true;
      },
      can_pass_fd, sv[0]);
  while (!answered) w.ioc.run_one();
  ::shutdown(sv[0], SHUT_WR);
  if (batch)
    client.join();
  else
    streamed = ReadAll(sv[1]);
  ::close(sv[0]);
  ::close(sv[1]);

  if (reply.sent) {
    Check(batch, "a reply streamed by a route other than /batchdownload/path");
    CheckBatchReply(streamed, http11, caller.IsRoot());
  } else {
    Check(streamed.empty(), "bytes on the connection beside a reply");
    const unsigned status = reply.res.result_int();
    if (status == 500) Fail("a handler threw: " + reply.res.body());
    Check(reply.res.version() == (http11 ? 11u : 10u), "reply in another HTTP version");
    if (reply.res[http::field::content_type] == "application/json") {
      const json body = json::parse(reply.res.body(), nullptr, false);
      Check(!body.is_discarded(), "reply not JSON");
      if (status == 201 && body.contains("id") && body["id"].is_string()) {
        stream->id = body["id"].get<std::string>();
        stream->owner = caller.uid;
      }
      // A user other than root sees only its own streams.
      if (status == 200 && !caller.IsRoot() && body.contains("streams"))
        for (const auto& st : body["streams"])
          Check(st.value("uid", caller.uid) == caller.uid, "/v1/stats showed another's stream");
    }
    // Streams belong to their creator: another user (not root) gets nothing done with one.
    if (names_stream && stream->id != "0" && !caller.IsRoot() && caller.uid != stream->owner &&
        status < 300)
      Fail("a user acted on another user's stream: " + std::string(text.substr(0, 80)));
  }
  if (reply.fd >= 0) {
    Check(can_pass_fd, "a descriptor for a TCP caller");
    std::string bytes(64 << 10, '\0');
    const ssize_t n = ::pread(reply.fd, bytes.data(), bytes.size(), 0);
    if (!caller.IsRoot() && n > 0 &&
        std::string_view(bytes.data(), static_cast<size_t>(n)).find(kSecret) !=
            std::string_view::npos)
      Fail("/v1/files/open handed a file only root may read to another user");
    ::close(reply.fd);
  }
}

}  // namespace

// Input: up to kMaxRequests requests separated by kSeparator, each a settings byte then
// "METHOD TARGET\n" and the body.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr std::string_view kSeparator = "\n--\n";
  constexpr int kMaxRequests = 8;
  World& w = TheWorld();
  std::string_view input(reinterpret_cast<const char*>(data), size);
  LastStream stream;
  for (int n = 0; n < kMaxRequests && !input.empty(); ++n) {
    const size_t end = input.find(kSeparator);
    const std::string_view one = input.substr(0, end);
    input =
        end == std::string_view::npos ? std::string_view() : input.substr(end + kSeparator.size());
    if (one.empty()) continue;
    RunRequest(w, static_cast<uint8_t>(one[0]), one.substr(1), &stream);
  }
  // Some of the queued fetches, then forget this input's streams.
  for (int i = 0; i < 4 && w.prefetcher->RunOneJob(); ++i) {
  }
  for (const auto& s : w.prefetcher->GetStats().streams) w.prefetcher->DeleteStream(s.id);
  return 0;
}
