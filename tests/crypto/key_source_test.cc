#include "crypto/key_source.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>

#include "crypto/base64.h"

namespace cubetorchfs::crypto {
namespace {

std::string B64(const std::string& raw) { return Base64Encode(raw); }

// An environment for KeySourceOptions::getenv.
KeySourceOptions WithEnv(std::map<std::string, std::string> env) {
  KeySourceOptions o;
  o.getenv = [env = std::move(env)](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  return o;
}

const std::string kKey16(16, '\x11');
const std::string kKey32(32, '\x22');
const std::string kIv(16, '\x33');

// A one-request HTTP server on a unix socket, answering with `body` and remembering the
// request it got.
class UnixHttpServer {
 public:
  UnixHttpServer(std::string body, int status = 200) {
    path_ = ::testing::TempDir() + "/ctfs_dp_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter_++) + ".sock";
    ::unlink(path_.c_str());
    fd_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 4), 0);
    thread_ = std::thread([this, body = std::move(body), status] {
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      char buf[4096];
      while (request_.find("\r\n\r\n") == std::string::npos) {
        ssize_t n = ::read(c, buf, sizeof(buf));
        if (n <= 0) break;
        request_.append(buf, n);
      }
      std::string reply =
          "HTTP/1.1 " + std::to_string(status) +
          " X\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
          "\r\nConnection: close\r\n\r\n" + body;
      (void)!::write(c, reply.data(), reply.size());
      ::close(c);
    });
  }
  ~UnixHttpServer() {
    ::shutdown(fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  // The request the server got; waits for the server thread (call after the client returned).
  const std::string& request() {
    if (thread_.joinable()) thread_.join();
    return request_;
  }

 private:
  static inline int counter_ = 0;
  std::string path_;
  int fd_ = -1;
  std::thread thread_;
  std::string request_;
};

TEST(KeySourceTest, MetaDataKeyNeedsKms) {
  EncryptedHeader h;
  h.meta_data_key = "ciphertext";
  auto r = ResolveKey(&h, WithEnv({{"VETURBOIO_KEY", B64(kKey16)}}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kNotSupported);
  EXPECT_NE(r.status().message().find("meta_data_key needs a KMS, which is not available here"),
            std::string::npos);
}

TEST(KeySourceTest, FromEnvironment) {
  auto r =
      ResolveKey(nullptr, WithEnv({{"VETURBOIO_KEY", B64(kKey32)}, {"VETURBOIO_IV", B64(kIv)}}));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->source, "VETURBOIO_KEY");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(r->key.data()), r->key.size()), kKey32);
  ASSERT_TRUE(r->iv.has_value());
  EXPECT_EQ(std::string(r->iv->begin(), r->iv->end()), kIv);
}

TEST(KeySourceTest, FromProcessEnvironment) {
  ::setenv("VETURBOIO_KEY", B64(kKey16).c_str(), 1);
  ::setenv("VETURBOIO_IV", B64(kIv).c_str(), 1);
  ::unsetenv("DATAPIPE_SOCKET_PATH");
  auto p = ResolveCipherParams(nullptr);
  ::unsetenv("VETURBOIO_KEY");
  ::unsetenv("VETURBOIO_IV");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->key.size(), 16u);
  EXPECT_EQ(std::string(p->iv.begin(), p->iv.end()), kIv);
}

TEST(KeySourceTest, EnvironmentErrorsNeverEchoTheKey) {
  auto r = ResolveKey(nullptr, WithEnv({{"VETURBOIO_KEY", B64("short-secret")}}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find("short-secret"), std::string::npos);
  EXPECT_NE(r.status().message().find("VETURBOIO_KEY"), std::string::npos);
  EXPECT_FALSE(ResolveKey(nullptr, WithEnv({{"VETURBOIO_KEY", "%%%%"}})).ok());
  EXPECT_FALSE(
      ResolveKey(nullptr, WithEnv({{"VETURBOIO_KEY", B64(kKey16)}, {"VETURBOIO_IV", B64("x")}}))
          .ok());
}

TEST(KeySourceTest, NoSourceIsNotFound) {
  auto r = ResolveKey(nullptr, WithEnv({}));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().IsNotFound());
  // A socket path naming nothing falls through to the environment.
  auto e = ResolveKey(nullptr, WithEnv({{"DATAPIPE_SOCKET_PATH", "/nonexistent/dp.sock"},
                                        {"VETURBOIO_KEY", B64(kKey16)}}));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->source, "VETURBOIO_KEY");
}

TEST(KeySourceTest, CipherParamsChecks) {
  EncryptedHeader h;
  h.mode = CipherMode::kCtr256;
  h.iv.fill(7);
  // Key size must match the header's mode.
  auto bad = ResolveCipherParams(&h, WithEnv({{"VETURBOIO_KEY", B64(kKey16)}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("CTR-256"), std::string::npos);
  // The header's IV wins over the source's.
  auto good = ResolveCipherParams(
      &h, WithEnv({{"VETURBOIO_KEY", B64(kKey32)}, {"VETURBOIO_IV", B64(kIv)}}));
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good->iv, h.iv);
  // Headerless needs an IV from the source.
  EXPECT_FALSE(ResolveCipherParams(nullptr, WithEnv({{"VETURBOIO_KEY", B64(kKey32)}})).ok());
}

TEST(KeySourceTest, FromDatapipeSocket) {
  UnixHttpServer server(R"({"Key": ")" + B64(kKey32) + R"(", "IV": ")" + B64(kIv) + R"("})");
  // The socket comes before the environment.
  auto r = ResolveKey(
      nullptr, WithEnv({{"DATAPIPE_SOCKET_PATH", server.path()}, {"VETURBOIO_KEY", B64(kKey16)}}));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->source, "DATAPIPE_SOCKET_PATH");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(r->key.data()), r->key.size()), kKey32);
  ASSERT_TRUE(r->iv.has_value());
  EXPECT_EQ(std::string(r->iv->begin(), r->iv->end()), kIv);
  EXPECT_EQ(server.request().rfind("GET ", 0), 0u) << server.request();
  EXPECT_NE(server.request().find("X-Datapipe-Task-Type: encrypt-key\r\n"), std::string::npos)
      << server.request();
}

TEST(KeySourceTest, DatapipeSocketBadReplies) {
  {
    UnixHttpServer server("not json");
    auto r = KeyFromDatapipeSocket(server.path());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Status::Code::kCorruption);
  }
  {
    UnixHttpServer server(R"({"IV": "x"})");
    auto r = KeyFromDatapipeSocket(server.path());
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("'Key'"), std::string::npos);
  }
  {
    UnixHttpServer server("{}", 500);
    auto r = KeyFromDatapipeSocket(server.path());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Status::Code::kIOError);
  }
}

}  // namespace
}  // namespace cubetorchfs::crypto
