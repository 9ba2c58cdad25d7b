#include "control/control_client.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <optional>

namespace cubetorchfs::control {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;

struct ControlClient::Impl {
  std::string path;
  asio::io_context ioc;
  std::optional<beast::basic_stream<asio::local::stream_protocol>> stream;
  beast::flat_buffer buffer;
};

ControlClient::ControlClient(std::string socket_path) : impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(socket_path);
}

ControlClient::~ControlClient() = default;

Result<HttpReply> ControlClient::Call(const std::string& method, const std::string& target,
                                      const std::string& body) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    beast::error_code ec;
    if (!impl_->stream) {
      impl_->stream.emplace(impl_->ioc);
      impl_->stream->expires_never();
      impl_->stream->socket().connect(asio::local::stream_protocol::endpoint(impl_->path), ec);
      if (ec) {
        impl_->stream.reset();
        return Status::IOError(impl_->path + ": " + ec.message());
      }
      impl_->buffer.clear();
    }
    http::request<http::string_body> req{http::string_to_verb(method), target, 11};
    req.set(http::field::host, "localhost");
    req.set(http::field::content_type, "application/json");
    req.keep_alive(true);
    req.body() = body;
    req.prepare_payload();
    http::write(impl_->stream->socket(), req, ec);
    http::response_parser<http::string_body> parser;
    parser.body_limit(1ull << 30);
    if (!ec) http::read(impl_->stream->socket(), impl_->buffer, parser, ec);
    if (ec) {
      impl_->stream.reset();
      if (attempt == 0) continue;  // the server may have closed an idle connection
      return Status::IOError(impl_->path + ": " + ec.message());
    }
    auto res = parser.release();
    if (!res.keep_alive()) impl_->stream.reset();
    return HttpReply{static_cast<int>(res.result_int()), std::move(res.body())};
  }
  return Status::IOError(impl_->path + ": no reply");
}

}  // namespace cubetorchfs::control
