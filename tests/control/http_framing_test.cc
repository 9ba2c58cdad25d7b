#include "control/http_framing.h"

#include <gtest/gtest.h>

#include <boost/beast/http.hpp>
#include <string>

namespace cubetorchfs::control::detail {
namespace {

namespace http = boost::beast::http;

// The framing verdict on the header of `wire`, as the server reads it (the parser's own
// errors as "parser: ...").
std::string Verdict(const std::string& wire, bool* unsupported) {
  http::request_parser<http::string_body> parser;
  parser.header_limit(kMaxHeaderBytes);
  parser.eager(false);
  boost::beast::error_code ec;
  parser.put(boost::asio::buffer(wire), ec);
  if (ec) return "parser: " + ec.message();
  if (!parser.is_header_done()) return "parser: header not done";
  return FramingProblem(parser.get(), parser.chunked(), unsupported);
}

TEST(HttpFramingTest, OneWayToFrameABodyOnly) {
  bool unsupported = true;
  EXPECT_EQ(
      Verdict("POST /v1/streams HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n", &unsupported),
      "");
  EXPECT_FALSE(unsupported);
  EXPECT_EQ(
      Verdict("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n", &unsupported),
      "");
  EXPECT_EQ(Verdict("GET /v1/stats HTTP/1.0\r\n\r\n", &unsupported), "");  // 1.0 needs no Host

  EXPECT_EQ(Verdict("GET /v1/stats HTTP/1.1\r\n\r\n", &unsupported), "HTTP/1.1 without Host");
  EXPECT_EQ(Verdict("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", &unsupported),
            "more than one Host header");
  EXPECT_EQ(Verdict("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
                    &unsupported),
            "more than one Content-Length header");
  EXPECT_FALSE(unsupported);

  // Transfer codings other than chunked alone: 501.
  EXPECT_NE(Verdict("POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n", &unsupported),
            "");
  EXPECT_TRUE(unsupported);
  EXPECT_NE(Verdict("POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n"
                    "Transfer-Encoding: gzip\r\n\r\n",
                    &unsupported),
            "");
  EXPECT_TRUE(unsupported);
}

}  // namespace
}  // namespace cubetorchfs::control::detail
