// libFuzzer target: the control server's request reading, as Session does it
// (control/control_server.cc): Beast's request_parser with the server's header and body
// limits, the header read first, the framing checks (FramingProblem), the body size check,
// then the body, and, while the client keeps the connection alive, the next request on the
// same connection and buffer.
//
// Input: one byte of settings, then the bytes a client sends. The settings pick how many
// bytes each read returns (the parser sees the request in pieces as a socket delivers it) and
// the body limit (the default 16 MiB, or 1 KiB as a small control.max_body_bytes).
//
// Besides crashes, leaks and UBSan reports, a request the server would hand to its handlers
// must be framed one way only: a body of exactly Content-Length bytes, or chunked with
// Transfer-Encoding "chunked" alone, or no body; one Host for HTTP/1.1; a body within limits.
#include <boost/asio/io_context.hpp>
#include <boost/beast/_experimental/test/stream.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "control/control_server.h"
#include "control/http_framing.h"

namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using cubetorchfs::control::ControlServer;
using cubetorchfs::control::detail::FieldCount;
using cubetorchfs::control::detail::FramingProblem;
using cubetorchfs::control::detail::kMaxHeaderBytes;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "fuzz_http_request: invariant broken: %s\n", what);
  std::abort();
}

constexpr size_t kReadSizes[8] = {1, 2, 3, 7, 16, 100, 4096, 65536};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t settings = data[0];
  const std::string_view wire(reinterpret_cast<const char*>(data + 1), size - 1);
  const uint64_t max_body = (settings & 8) ? 1024 : ControlServer::Options{}.max_body_bytes;

  boost::asio::io_context ioc;
  beast::test::stream client(ioc, beast::string_view(wire.data(), wire.size()));
  client.close_remote();  // the client has sent all it will: then end of stream
  client.read_size(kReadSizes[settings & 7]);
  beast::flat_buffer buffer;

  // At most a few requests on one connection: enough to see one framed inside another.
  for (int n = 0; n < 8; ++n) {
    http::request_parser<http::string_body> parser;
    parser.body_limit(max_body);
    parser.header_limit(kMaxHeaderBytes);
    beast::error_code ec;
    http::read_header(client, buffer, parser, ec);
    if (ec) return 0;  // the server replies 400 or 413, or just closes, and stops reading
    bool unsupported = false;
    const std::string framing = FramingProblem(parser.get(), parser.chunked(), &unsupported);
    if (!framing.empty()) return 0;  // 400 or 501, connection closed
    const auto len = parser.content_length();
    const uint64_t want = len ? *len : (parser.chunked() ? max_body : 0);
    if (want > max_body) return 0;  // 413, connection closed
    const size_t fields = FieldCount(parser.get());
    http::read(client, buffer, parser, ec);
    if (ec) return 0;
    if (FieldCount(parser.get()) != fields) return 0;  // trailers: 400, connection closed

    // What the handlers would get.
    const bool chunked = parser.chunked();
    http::request<http::string_body> req = parser.release();
    const size_t body = req.body().size();
    if (body > max_body) Fail("body over the limit");
    if (req.version() >= 11 && req.count(http::field::host) != 1) Fail("HTTP/1.1 without one Host");
    if (req.count(http::field::host) > 1) Fail("several Host headers");
    if (req.count(http::field::content_length) > 1) Fail("several Content-Length headers");
    const bool has_te = req.count(http::field::transfer_encoding) > 0;
    if (has_te != chunked) Fail("Transfer-Encoding without chunked framing, or the reverse");
    if (has_te && req.count(http::field::content_length) > 0)
      Fail("Content-Length beside Transfer-Encoding");
    if (!chunked && len && *len != body) Fail("body not of Content-Length bytes");
    if (!chunked && !len && body != 0) Fail("a body without Content-Length or chunked");
    if (req.target().empty()) Fail("empty target");
    if (!req.keep_alive()) return 0;  // the server closes after its reply
  }
  return 0;
}
