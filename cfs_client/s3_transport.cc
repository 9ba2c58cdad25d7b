#include "cfs_client/s3_transport.h"

#include <curl/curl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "cfs_client/s3_protocol.h"
#include "common/logging.h"
#include "common/thread_annotations.h"
#include "common/version.h"

namespace cubetorchfs::cfs_client::s3 {
namespace {

// SHA-256 of an empty payload, for GET and HEAD. S3 requires the header, and curl 7.88 signs
// it when given (it does not add it by itself).
constexpr char kEmptyPayloadSha256[] =
    "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr size_t kMaxErrorBodyBytes = 64u << 10;
constexpr uint64_t kBackoffBaseMs = 50;
constexpr uint64_t kBackoffMaxMs = 2000;

struct EasyDeleter {
  void operator()(CURL* h) const { curl_easy_cleanup(h); }
};
using EasyPtr = std::unique_ptr<CURL, EasyDeleter>;

struct SlistDeleter {
  void operator()(curl_slist* l) const { curl_slist_free_all(l); }
};
using SlistPtr = std::unique_ptr<curl_slist, SlistDeleter>;

// libcurl's global state, initialized once before the first handle (curl_global_init is not
// thread-safe in 7.88) and never torn down: the process exits with it.
Status InitCurlOnce() {
  static CURLcode rc = curl_global_init(CURL_GLOBAL_ALL);
  if (rc != CURLE_OK)
    return Status::IOError(std::string("libcurl initialization failed: ") + curl_easy_strerror(rc));
  return Status::OK();
}

// A share handle for the DNS cache and TLS sessions of all easy handles of one backend.
class Share {
 public:
  Share() : sh_(curl_share_init()) {
    if (!sh_) return;
    curl_share_setopt(sh_, CURLSHOPT_LOCKFUNC, &Share::Lock);
    curl_share_setopt(sh_, CURLSHOPT_UNLOCKFUNC, &Share::Unlock);
    curl_share_setopt(sh_, CURLSHOPT_USERDATA, this);
    curl_share_setopt(sh_, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    curl_share_setopt(sh_, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  }
  ~Share() {
    if (sh_) curl_share_cleanup(sh_);
  }
  Share(const Share&) = delete;
  Share& operator=(const Share&) = delete;
  CURLSH* get() const { return sh_; }

 private:
  static void Lock(CURL*, curl_lock_data data, curl_lock_access, void* self) {
    static_cast<Share*>(self)->mu_[data % CURL_LOCK_DATA_LAST].lock();
  }
  static void Unlock(CURL*, curl_lock_data data, void* self) {
    static_cast<Share*>(self)->mu_[data % CURL_LOCK_DATA_LAST].unlock();
  }

  CURLSH* const sh_;
  std::mutex mu_[CURL_LOCK_DATA_LAST];  // one per kind of shared data, taken by libcurl
};

// At most `max` easy handles, created on demand and reused: a handle keeps its connection
// alive between requests, so reuse is what saves the TCP (and TLS) handshakes.
class HandlePool {
 public:
  explicit HandlePool(size_t max) : max_(max) {}

  // An easy handle, for one request at a time; waits while `max` are in use.
  class Lease {
   public:
    Lease(HandlePool* pool, EasyPtr h) : pool_(pool), h_(std::move(h)) {}
    Lease(Lease&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)), h_(std::move(o.h_)) {}
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (pool_) pool_->Release(std::move(h_));
    }
    CURL* get() const { return h_.get(); }

   private:
    HandlePool* pool_;
    EasyPtr h_;
  };

  Result<Lease> Acquire() EXCLUDES(mu_) {
    MutexLock l(mu_);
    while (idle_.empty() && created_ >= max_) cv_.Wait();
    if (!idle_.empty()) {
      EasyPtr h = std::move(idle_.back());
      idle_.pop_back();
      return Lease(this, std::move(h));
    }
    EasyPtr h(curl_easy_init());
    if (!h) return Status::IOError("s3: curl_easy_init failed");
    ++created_;
    return Lease(this, std::move(h));
  }

 private:
  void Release(EasyPtr h) EXCLUDES(mu_) {
    {
      MutexLock l(mu_);
      if (h) {
        idle_.push_back(std::move(h));
      } else {
        --created_;
      }
    }
    cv_.Signal();
  }

  const size_t max_;
  Mutex mu_;          // guards idle_ and created_
  CondVar cv_{&mu_};  // signalled when a handle comes back
  std::vector<EasyPtr> idle_ GUARDED_BY(mu_);
  size_t created_ GUARDED_BY(mu_) = 0;  // handles alive, idle or leased
};

// Where an upload's next bytes come from (one per attempt).
struct UploadSource {
  const Request* req;
  uint64_t sent = 0;
  bool failed = false;
};

size_t OnUpload(char* out, size_t size, size_t n, void* userdata) {
  auto* u = static_cast<UploadSource*>(userdata);
  const uint64_t left = u->req->upload_len - u->sent;
  const size_t want = static_cast<size_t>(std::min<uint64_t>(left, size * n));
  if (want == 0) return 0;
  ssize_t got;
  do {
    got =
        ::pread(u->req->upload_fd, out, want, static_cast<off_t>(u->req->upload_offset + u->sent));
  } while (got < 0 && errno == EINTR);
  if (got <= 0) {  // the staging file shrank or failed under us
    u->failed = true;
    return CURL_READFUNC_ABORT;
  }
  u->sent += static_cast<uint64_t>(got);
  return static_cast<size_t>(got);
}

struct Transfer {
  const Request* req;
  Reply* reply;
  CURL* h;
};

size_t OnHeader(char* data, size_t size, size_t n, void* userdata) {
  auto* t = static_cast<Transfer*>(userdata);
  std::string_view line(data, size * n);
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
  if (line.substr(0, 5) == "HTTP/") {  // a new reply (after a 100 Continue, say)
    t->reply->headers.clear();
    size_t sp = line.find(' ');
    t->reply->status = sp == std::string_view::npos ? 0 : std::atol(line.data() + sp + 1);
    return size * n;
  }
  if (line.empty()) {  // end of the headers
    // A server may answer a ranged GET of an empty object with "Content-Range: bytes 0-0/0"
    // and a Content-Length of 1 it never sends; the object has no bytes, so stop here.
    const std::string* cr = t->reply->Header("content-range");
    if (t->reply->status == 206 && cr && cr->size() > 2 && cr->substr(cr->size() - 2) == "/0") {
      t->reply->empty_object = true;
      return 0;  // aborts the transfer (CURLE_WRITE_ERROR), handled by the caller
    }
    return size * n;
  }
  size_t colon = line.find(':');
  if (colon == std::string_view::npos) return size * n;
  std::string name(line.substr(0, colon));
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
  t->reply->headers.emplace_back(std::move(name), std::string(value));
  return size * n;
}

// A PUT body from Request::body.
size_t OnStringUpload(char* out, size_t size, size_t n, void* userdata) {
  auto* u = static_cast<UploadSource*>(userdata);
  const std::string& body = u->req->body;
  const size_t want = static_cast<size_t>(std::min<uint64_t>(body.size() - u->sent, size * n));
  std::memcpy(out, body.data() + u->sent, want);
  u->sent += want;
  return want;
}

size_t OnBody(char* data, size_t size, size_t n, void* userdata) {
  auto* t = static_cast<Transfer*>(userdata);
  const size_t total = size * n;
  Reply* r = t->reply;
  const bool success = r->status >= 200 && r->status < 300;
  if (!success || !t->req->buf) {
    const size_t cap = success ? t->req->text_cap : kMaxErrorBodyBytes;
    if (r->text.size() + total > cap) {
      if (success) {
        r->too_big = true;
        return 0;  // aborts the transfer
      }
      r->text.append(data, cap - std::min(cap, r->text.size()));
      return total;
    }
    r->text.append(data, total);
    return total;
  }
  if (!r->body_started) {
    r->body_started = true;
    // A server that ignores Range sends the whole object from byte 0.
    if (r->status == 200 && !t->req->range.empty()) r->skip = t->req->range_first;
  }
  std::string_view chunk(data, total);
  const size_t dropped = static_cast<size_t>(std::min<uint64_t>(r->skip, chunk.size()));
  r->skip -= dropped;
  chunk.remove_prefix(dropped);
  const size_t keep = std::min(chunk.size(), t->req->cap - r->bytes);
  std::memcpy(t->req->buf + r->bytes, chunk.data(), keep);
  r->bytes += keep;
  return total;  // bytes past `cap` are not ours to keep; dropping them is not an error
}

// Connection-level failures worth another try.
bool RetryableCurl(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

double Jitter() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return std::uniform_real_distribution<double>(0, 1)(rng);
}

}  // namespace

struct Transport::Impl {
  Impl(const conf::S3Options& opts, Credentials creds)
      : opts_(opts),
        access_key_(std::move(creds.access_key)),
        secret_key_(std::move(creds.secret_key)),
        session_token_(std::move(creds.session_token)),
        sigv4_("aws:amz:" + opts.region + ":s3"),
        user_agent_(std::string("cubetorchfs/") + CUBETORCHFS_VERSION),
        pool_(opts.max_connections) {
    headers_.reset(curl_slist_append(nullptr, kEmptyPayloadSha256));
    if (!session_token_.empty()) {
      std::string h = "x-amz-security-token: " + session_token_;
      curl_slist_append(headers_.get(), h.c_str());
    }
  }

  std::string Show(const std::string& key) const {
    return key.empty() ? opts_.bucket : opts_.bucket + "/" + key;
  }
  Status Error(const Request& req, const Reply& reply) const {
    return s3::HttpError(req.op, opts_.bucket, req.key, reply.status, reply.text);
  }

  Result<Reply> Execute(const Request& req) {
    Status last;
    for (uint32_t attempt = 0; attempt <= opts_.retries; ++attempt) {
      if (attempt > 0) {
        const uint64_t ms = s3::BackoffMs(attempt, kBackoffBaseMs, kBackoffMaxMs, Jitter());
        CTFS_LOG(kDebug) << "s3 " << req.op << " " << Show(req.key) << ": retry " << attempt
                         << " in " << ms << " ms after " << last.message();
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      }
      CTFS_ASSIGN_OR_RETURN(HandlePool::Lease lease, pool_.Acquire());
      Reply reply;
      char errbuf[CURL_ERROR_SIZE] = {};
      CURLcode rc = Perform(lease.get(), req, &reply, errbuf);
      if (rc == CURLE_WRITE_ERROR && reply.empty_object) rc = CURLE_OK;
      if (rc != CURLE_OK) {
        std::string why = errbuf[0] ? errbuf : curl_easy_strerror(rc);
        if (reply.too_big) why = "reply larger than " + std::to_string(req.text_cap) + " bytes";
        last = Status::IOError("s3 " + std::string(req.op) + " " + Show(req.key) + ": " + why);
        if (!RetryableCurl(rc)) return last;
        continue;
      }
      if (!req.retry_server_errors && reply.status >= 500) return reply;
      if (s3::RetryableHttp(reply.status, s3::ErrorCode(reply.text))) {
        last = Error(req, reply);
        continue;
      }
      return reply;
    }
    return Status::IOError(last.message() + " (after " + std::to_string(opts_.retries + 1) +
                           " attempts)");
  }

  // One attempt of `req` on easy handle `h`.
  CURLcode Perform(CURL* h, const Request& req, Reply* reply, char* errbuf) {
    curl_easy_reset(h);  // keeps the handle's live connection and caches
    Transfer t{&req, reply, h};
    curl_easy_setopt(h, CURLOPT_URL, req.url.c_str());
    curl_easy_setopt(h, CURLOPT_SHARE, share_.get());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_USERAGENT, user_agent_.c_str());
    SlistPtr write_headers;
    UploadSource upload{&req};
    if (req.method != nullptr) {
      // A request with a body (or none, for DELETE): its own headers.
      write_headers.reset(curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD"));
      if (!session_token_.empty())
        curl_slist_append(write_headers.get(), ("x-amz-security-token: " + session_token_).c_str());
      for (const std::string& hdr : req.extra_headers)
        curl_slist_append(write_headers.get(), hdr.c_str());
      const std::string_view m = req.method;
      // A POST body is XML (CompleteMultipartUpload); without this libcurl says it is a form
      // (application/x-www-form-urlencoded), and servers that parse forms (moto) lose it.
      if (m == "POST") curl_slist_append(write_headers.get(), "Content-Type: application/xml");
      curl_easy_setopt(h, CURLOPT_HTTPHEADER, write_headers.get());
      if (m == "PUT") {
        curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
        const uint64_t len = req.upload_fd >= 0 ? req.upload_len : req.body.size();
        curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(len));
        if (req.upload_fd >= 0) {
          curl_easy_setopt(h, CURLOPT_READFUNCTION, &OnUpload);
          curl_easy_setopt(h, CURLOPT_READDATA, &upload);
        } else {
          curl_easy_setopt(h, CURLOPT_READFUNCTION, &OnStringUpload);
          curl_easy_setopt(h, CURLOPT_READDATA, &upload);
        }
      } else if (m == "POST") {
        curl_easy_setopt(h, CURLOPT_POST, 1L);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, req.body.c_str());
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
      } else {
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, req.method);
      }
    } else {
      curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers_.get());
    }
    if (!access_key_.empty()) {
      curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4_.c_str());
      curl_easy_setopt(h, CURLOPT_USERNAME, access_key_.c_str());
      curl_easy_setopt(h, CURLOPT_PASSWORD, secret_key_.c_str());
    }
    const long timeout_ms = static_cast<long>(opts_.timeout_ms);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    if (req.head) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    if (!req.range.empty()) curl_easy_setopt(h, CURLOPT_RANGE, req.range.c_str());
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &OnHeader);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &OnBody);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &t);
    return curl_easy_perform(h);
  }

  const conf::S3Options opts_;
  const std::string access_key_;
  const std::string secret_key_;
  const std::string session_token_;
  const std::string sigv4_;
  const std::string user_agent_;
  SlistPtr headers_;  // the same for every GET and HEAD; read-only once built
  Share share_;
  HandlePool pool_;
};

Transport::Transport() = default;
Transport::~Transport() = default;

Result<std::unique_ptr<Transport>> Transport::New(const conf::S3Options& opts, Credentials creds) {
  CTFS_RETURN_IF_ERROR(InitCurlOnce());
  std::unique_ptr<Transport> t(new Transport());
  t->impl_ = std::make_unique<Impl>(opts, std::move(creds));
  return t;
}

Result<Reply> Transport::Execute(const Request& req) { return impl_->Execute(req); }

bool Transport::signs() const { return !impl_->access_key_.empty(); }

}  // namespace cubetorchfs::cfs_client::s3
