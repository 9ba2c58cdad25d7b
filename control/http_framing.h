// The control server's HTTP framing rules, apart from its transport so that they can be
// tested and fuzzed on their own (tests/fuzz/fuzz_http_request.cc): the parser's header limit
// and the checks of how a request's header frames its body.
#pragma once

#include <boost/beast/http.hpp>
#include <cstdint>
#include <string>

namespace cubetorchfs::control::detail {

// The most bytes a request's start line and header fields may take (the parser's
// header_limit); the body's limit is ControlServer::Options::max_body_bytes.
constexpr uint32_t kMaxHeaderBytes = 64 * 1024;

// Why a request's header frames its body ambiguously (RFC 9112, sections 3.2 and 6), or ""
// when it does not: a peer that frames a body differently from us could smuggle a second
// request inside it. `chunked`: the parser took the body as chunked. `unsupported`: the fault
// is a transfer coding we do not implement (501).
std::string FramingProblem(const boost::beast::http::request_header<>& h, bool chunked,
                           bool* unsupported);

// The number of header fields of `h`. Taken after the header and again after the body: a
// chunked body may end in trailer fields, which the parser adds to the header (a second Host,
// a Content-Length...). A request whose count grew is refused: trailers are not accepted, so
// no field can arrive after FramingProblem checked the header.
size_t FieldCount(const boost::beast::http::request_header<>& h);

}  // namespace cubetorchfs::control::detail
