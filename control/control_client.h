// A small blocking client of the control API (used by `cubetorchfs warmup`).
//
// One connection per object, reused across requests (HTTP/1.1 keep-alive); not thread-safe:
// give each thread its own.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"

namespace cubetorchfs::control {

struct HttpReply {
  int status = 0;
  std::string body;
};

class ControlClient {
 public:
  explicit ControlClient(std::string socket_path);
  ~ControlClient();
  // Sends one request; reconnects once if the kept-alive connection was closed.
  Result<HttpReply> Call(const std::string& method, const std::string& target,
                         const std::string& body);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cubetorchfs::control
