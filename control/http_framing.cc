#include "control/http_framing.h"

#include <cctype>
#include <iterator>

namespace cubetorchfs::control::detail {

namespace http = boost::beast::http;

std::string FramingProblem(const http::request_header<>& h, bool chunked, bool* unsupported) {
  *unsupported = false;
  if (h.version() >= 11 && h.count(http::field::host) == 0) return "HTTP/1.1 without Host";
  if (h.count(http::field::host) > 1) return "more than one Host header";
  const size_t lengths = h.count(http::field::content_length);
  if (lengths > 1) return "more than one Content-Length header";
  if (h.count(http::field::transfer_encoding) > 0) {
    if (lengths > 0) return "both Content-Length and Transfer-Encoding";
    std::string codings;
    for (auto it = h.find(http::field::transfer_encoding);
         it != h.end() && it->name() == http::field::transfer_encoding; ++it) {
      if (!codings.empty()) codings += ", ";
      codings += std::string(it->value());
    }
    // Only "chunked" alone: no other coding (gzip, ...) is decoded here.
    std::string bare;
    for (char c : codings)
      if (c != ' ' && c != '\t')
        bare += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (!chunked || bare != "chunked") {
      *unsupported = true;
      return "Transfer-Encoding \"" + codings.substr(0, 64) + "\" is not supported (only chunked)";
    }
  }
  return "";
}

size_t FieldCount(const http::request_header<>& h) {
  return static_cast<size_t>(std::distance(h.begin(), h.end()));
}

}  // namespace cubetorchfs::control::detail
