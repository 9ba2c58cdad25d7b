#include "crypto/key_source.h"

#include <curl/curl.h>
#include <openssl/crypto.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>

#include "crypto/base64.h"

namespace cubetorchfs::crypto {

namespace {

using nlohmann::json;

// A std::string whose bytes are wiped when it goes away (holds key material).
class SecretString {
 public:
  SecretString() = default;
  explicit SecretString(std::string s) : s_(std::move(s)) {}
  SecretString(const SecretString&) = delete;
  SecretString& operator=(const SecretString&) = delete;
  ~SecretString() { OPENSSL_cleanse(s_.data(), s_.size()); }
  std::string& get() { return s_; }

 private:
  std::string s_;
};

struct CurlDeleter {
  void operator()(CURL* c) const { curl_easy_cleanup(c); }
};
struct SlistDeleter {
  void operator()(curl_slist* l) const { curl_slist_free_all(l); }
};

size_t AppendBody(char* ptr, size_t size, size_t nmemb, void* userdata) {
  auto* body = static_cast<std::string*>(userdata);
  const size_t n = size * nmemb;
  // Keep at most 1 MiB; a key reply is tiny. Reallocation could leave copies of key bytes in
  // freed memory, so reserve once up front (see the caller) and refuse to grow past it.
  if (body->size() + n > body->capacity()) return 0;
  body->append(ptr, n);
  return n;
}

std::optional<std::string> DefaultGetenv(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

std::optional<std::string> Getenv(const KeySourceOptions& options, const std::string& name) {
  return options.getenv ? options.getenv(name) : DefaultGetenv(name);
}

// Decodes a base64 key; the message names `what` but never the value.
Result<Key> DecodeKey(const std::string& b64, const std::string& what) {
  auto bytes = Base64Decode(b64, what);
  if (!bytes.ok()) return bytes.status();
  SecretString raw(std::move(bytes.value()));
  if (raw.get().size() != 16 && raw.get().size() != 32) {
    return Status::InvalidArgument(what + " decodes to " + std::to_string(raw.get().size()) +
                                   " bytes; an AES key is 16 or 32 bytes");
  }
  return Key::FromBytes(raw.get());
}

Result<Iv> DecodeIv(const std::string& b64, const std::string& what) {
  auto bytes = Base64Decode(b64, what);
  if (!bytes.ok()) return bytes.status();
  if (bytes->size() != kIvSize) {
    return Status::InvalidArgument(what + " decodes to " + std::to_string(bytes->size()) +
                                   " bytes; the IV is 16 bytes");
  }
  Iv iv;
  std::memcpy(iv.data(), bytes->data(), kIvSize);
  return iv;
}

bool SocketExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

}  // namespace

Result<KeyMaterial> KeyFromDatapipeSocket(const std::string& socket_path,
                                          const KeySourceOptions& options) {
  std::unique_ptr<CURL, CurlDeleter> curl(curl_easy_init());
  if (!curl) return Status::IOError("datapipe key socket: curl_easy_init failed");
  std::unique_ptr<curl_slist, SlistDeleter> headers(
      curl_slist_append(nullptr, "X-Datapipe-Task-Type: encrypt-key"));
  if (!headers) return Status::IOError("datapipe key socket: out of memory");
  SecretString body;
  body.get().reserve(1 << 20);
  CURL* c = curl.get();
  curl_easy_setopt(c, CURLOPT_UNIX_SOCKET_PATH, socket_path.c_str());
  curl_easy_setopt(c, CURLOPT_URL, options.socket_url.c_str());
  curl_easy_setopt(c, CURLOPT_HTTPGET, 1L);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers.get());
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, &AppendBody);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &body.get());
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, options.socket_timeout_ms);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_PROXY, "");
  const CURLcode rc = curl_easy_perform(c);
  if (rc != CURLE_OK) {
    return Status::IOError("datapipe key socket " + socket_path + ": " + curl_easy_strerror(rc));
  }
  long http_code = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http_code);
  if (http_code != 200) {
    return Status::IOError("datapipe key socket " + socket_path + ": HTTP " +
                           std::to_string(http_code));
  }
  json j = json::parse(body.get(), nullptr, /*allow_exceptions=*/false);
  struct JsonWiper {  // the parsed JSON holds the key too
    json& j;
    ~JsonWiper() {
      if (j.is_object()) {
        for (auto& [k, v] : j.items()) {
          if (v.is_string()) {
            auto& s = v.get_ref<std::string&>();
            OPENSSL_cleanse(s.data(), s.size());
          }
        }
      }
    }
  } wiper{j};
  if (j.is_discarded() || !j.is_object()) {
    return Status::Corruption("datapipe key socket " + socket_path +
                              ": reply is not a JSON object");
  }
  auto key = j.find("Key");
  if (key == j.end() || !key->is_string()) {
    return Status::Corruption("datapipe key socket " + socket_path +
                              ": reply has no string field 'Key'");
  }
  KeyMaterial out;
  out.source = "DATAPIPE_SOCKET_PATH";
  auto k = DecodeKey(key->get_ref<const std::string&>(), "datapipe reply field 'Key'");
  if (!k.ok()) return k.status();
  out.key = k.value();
  auto iv = j.find("IV");
  if (iv != j.end() && iv->is_string() && !iv->get_ref<const std::string&>().empty()) {
    auto v = DecodeIv(iv->get_ref<const std::string&>(), "datapipe reply field 'IV'");
    if (!v.ok()) return v.status();
    out.iv = v.value();
  }
  return out;
}

Result<KeyMaterial> KeyFromEnv(const KeySourceOptions& options) {
  std::optional<std::string> key_b64 = Getenv(options, "VETURBOIO_KEY");
  if (!key_b64 || key_b64->empty()) return Status::NotFound("VETURBOIO_KEY is not set");
  SecretString wipe(std::move(*key_b64));
  KeyMaterial out;
  out.source = "VETURBOIO_KEY";
  auto k = DecodeKey(wipe.get(), "VETURBOIO_KEY");
  if (!k.ok()) return k.status();
  out.key = k.value();
  std::optional<std::string> iv_b64 = Getenv(options, "VETURBOIO_IV");
  if (iv_b64 && !iv_b64->empty()) {
    auto v = DecodeIv(*iv_b64, "VETURBOIO_IV");
    if (!v.ok()) return v.status();
    out.iv = v.value();
  }
  return out;
}

Result<KeyMaterial> ResolveKey(const EncryptedHeader* header, const KeySourceOptions& options) {
  if (header != nullptr && header->meta_data_key) {
    return Status::NotSupported(
        "encrypted file: meta_data_key needs a KMS, which is not available here");
  }
  std::optional<std::string> socket = Getenv(options, "DATAPIPE_SOCKET_PATH");
  if (socket && !socket->empty() && SocketExists(*socket)) {
    return KeyFromDatapipeSocket(*socket, options);
  }
  auto env = KeyFromEnv(options);
  if (env.ok() || !env.status().IsNotFound()) return env;
  return Status::NotFound(
      "encrypted file: no key source (no meta_data_key in the header, DATAPIPE_SOCKET_PATH " +
      std::string(socket && !socket->empty() ? "names no socket" : "is not set") +
      ", VETURBOIO_KEY is not set)");
}

Result<CipherParams> ResolveCipherParams(const EncryptedHeader* header,
                                         const KeySourceOptions& options) {
  auto material = ResolveKey(header, options);
  if (!material.ok()) return material.status();
  CipherParams p;
  p.key = material->key;
  if (header != nullptr) {
    if (material->key.size() != CipherModeKeySize(header->mode)) {
      return Status::InvalidArgument("encrypted file: the key from " + material->source + " is " +
                                     std::to_string(material->key.size()) +
                                     " bytes but the header's mode " +
                                     std::string(CipherModeName(header->mode)) + " needs " +
                                     std::to_string(CipherModeKeySize(header->mode)));
    }
    p.iv = header->iv;
  } else if (material->iv) {
    p.iv = *material->iv;
  } else {
    return Status::InvalidArgument("encrypted file without a header: " + material->source +
                                   " gave no IV (set VETURBOIO_IV or send \"IV\")");
  }
  return p;
}

}  // namespace cubetorchfs::crypto
