// The S3 backend's HTTP transport: one request at a time per caller, signed by libcurl
// (SigV4), on an easy handle from a pool of at most `max_connections` that keep their
// connections open and share one DNS and TLS-session cache; failed attempts (connection
// errors, timeouts, 5xx, 429) are retried `retries` times with exponential backoff and
// jitter. The only file that includes curl is s3_transport.cc.
//
// Thread safety: Execute may be called from any number of threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "conf/options.h"

namespace cubetorchfs::cfs_client::s3 {

inline constexpr size_t kMaxListReplyBytes = 64u << 20;  // a 1000-key page is well under 1 MiB

// One HTTP request and where its reply goes.
struct Request {
  const char* op = "GET";        // for messages: HEAD, GET, LIST, PUT, POST, DELETE, COPY
  const char* method = nullptr;  // PUT, POST, DELETE; null: GET (or HEAD with `head`)
  std::string key;               // for messages; "" for the bucket
  std::string url;
  bool head = false;
  std::string range;  // "FIRST-LAST" or ""
  uint64_t range_first = 0;
  char* buf = nullptr;  // a 2xx body goes here (at most `cap` bytes) ...
  size_t cap = 0;
  size_t text_cap = kMaxListReplyBytes;  // ... or, without buf, into Reply::text
  // A body to send: `upload_fd` from `upload_offset` for `upload_len` bytes, else `body`.
  int upload_fd = -1;
  uint64_t upload_offset = 0;
  uint64_t upload_len = 0;
  std::string body;
  std::vector<std::string> extra_headers;  // "Name: value"
  // false: a 5xx reply is returned at once, not retried (the caller has a better guess).
  bool retry_server_errors = true;
};

struct Reply {
  long status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-case
  std::string text;   // a body without Request::buf, or an error body (capped)
  size_t bytes = 0;   // bytes stored into Request::buf
  uint64_t skip = 0;  // bytes still to drop (a 200 reply to a ranged request)
  bool body_started = false;
  bool empty_object = false;  // a 206 reply for an object of 0 bytes: stopped after headers
  bool too_big = false;

  const std::string* Header(std::string_view name) const {
    for (const auto& [k, v] : headers)
      if (k == name) return &v;
    return nullptr;
  }
};

// Who signs: credentials are passed to libcurl only, never logged or put in a message. An
// empty access key sends requests unsigned.
struct Credentials {
  std::string access_key;
  std::string secret_key;
  std::string session_token;
};

class Transport {
 public:
  // Initializes libcurl (once per process). Fails if it cannot.
  static Result<std::unique_ptr<Transport>> New(const conf::S3Options& opts, Credentials creds);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Runs `req`, retrying what is worth retrying. A reply of any HTTP status is returned; an
  // error means no reply came (or only retryable ones, `retries` + 1 times).
  Result<Reply> Execute(const Request& req);
  // Whether requests are signed (an access key was given).
  bool signs() const;

 private:
  Transport();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cubetorchfs::cfs_client::s3
