#include "crypto/integrity.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <system_error>
#include <thread>

#include "common/parallel.h"
#include "common/thread_annotations.h"
#include "crypto/base64.h"

namespace cubetorchfs::crypto {

namespace {

using nlohmann::json;

struct MacDeleter {
  void operator()(EVP_MAC* m) const { EVP_MAC_free(m); }
};
struct MacCtxDeleter {
  void operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }
};

// One HMAC-SHA256 computation (RAII over EVP_MAC / EVP_MAC_CTX).
class Hmac {
 public:
  Status Init(const uint8_t* key, size_t key_len) {
    mac_.reset(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
    if (!mac_) return Status::IOError("integrity: HMAC unavailable in OpenSSL");
    ctx_.reset(EVP_MAC_CTX_new(mac_.get()));
    if (!ctx_) return Status::IOError("integrity: EVP_MAC_CTX_new failed");
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                           OSSL_PARAM_construct_end()};
    if (EVP_MAC_init(ctx_.get(), key, key_len, params) != 1) {
      return Status::IOError("integrity: EVP_MAC_init failed");
    }
    return Status::OK();
  }
  Status Update(const void* data, size_t len) {
    if (EVP_MAC_update(ctx_.get(), static_cast<const unsigned char*>(data), len) != 1) {
      return Status::IOError("integrity: EVP_MAC_update failed");
    }
    return Status::OK();
  }
  Status UpdateU64(uint64_t v) {
    uint8_t b[8];
    for (int i = 7; i >= 0; --i, v >>= 8) b[i] = static_cast<uint8_t>(v);
    return Update(b, sizeof(b));
  }
  Status Final(uint8_t* out32) {
    size_t n = 0;
    if (EVP_MAC_final(ctx_.get(), out32, &n, kTagSize) != 1 || n != kTagSize) {
      return Status::IOError("integrity: EVP_MAC_final failed");
    }
    return Status::OK();
  }

 private:
  std::unique_ptr<EVP_MAC, MacDeleter> mac_;
  std::unique_ptr<EVP_MAC_CTX, MacCtxDeleter> ctx_;
};

Status UpdatePrefix(Hmac& h, std::string_view label, const IntegrityParams& p) {
  CTFS_RETURN_IF_ERROR(h.Update(label.data(), label.size()));
  CTFS_RETURN_IF_ERROR(h.Update(p.iv.data(), p.iv.size()));
  CTFS_RETURN_IF_ERROR(h.UpdateU64(p.payload_size));
  return h.UpdateU64(p.chunk_size);
}

uint64_t ChunkLength(const IntegrityParams& p, uint64_t index) {
  const uint64_t begin = index * p.chunk_size;
  return std::min(p.chunk_size, p.payload_size - begin);
}

}  // namespace

IntegrityKey::~IntegrityKey() { OPENSSL_cleanse(bytes_.data(), bytes_.size()); }

Result<IntegrityKey> IntegrityKey::Derive(const Key& data_key, const Iv& iv) {
  if (data_key.empty()) return Status::InvalidArgument("integrity: no key");
  Hmac h;
  CTFS_RETURN_IF_ERROR(h.Init(data_key.data(), data_key.size()));
  constexpr std::string_view kLabel = "cubetorchfs-integrity-v2";
  CTFS_RETURN_IF_ERROR(h.Update(kLabel.data(), kLabel.size()));
  CTFS_RETURN_IF_ERROR(h.Update(iv.data(), iv.size()));
  IntegrityKey k;
  CTFS_RETURN_IF_ERROR(h.Final(k.bytes_.data()));
  return k;
}

uint64_t IntegrityChunkCount(const IntegrityParams& params) {
  if (params.chunk_size == 0) return 0;
  return params.payload_size / params.chunk_size +
         (params.payload_size % params.chunk_size != 0 ? 1 : 0);
}

struct ChunkMac::Ctx {
  EVP_CIPHER_CTX* gcm = nullptr;
};

ChunkMac::ChunkMac() : ctx_(new Ctx) {}

ChunkMac::~ChunkMac() {
  if (ctx_->gcm != nullptr) EVP_CIPHER_CTX_free(ctx_->gcm);  // wipes the key schedule
  delete ctx_;
}

Status ChunkMac::Begin(const IntegrityKey& key, const IntegrityParams& params, uint64_t index) {
  if (params.chunk_size == 0) return Status::InvalidArgument("integrity: chunk size is 0");
  if (index >= IntegrityChunkCount(params)) {
    return Status::InvalidArgument("integrity: chunk " + std::to_string(index) +
                                   " is past the end of the payload");
  }
  if (ctx_->gcm == nullptr) ctx_->gcm = EVP_CIPHER_CTX_new();
  if (ctx_->gcm == nullptr) return Status::IOError("integrity: EVP_CIPHER_CTX_new failed");
  uint8_t nonce[12] = {};
  for (int i = 0; i < 8; ++i) nonce[4 + i] = static_cast<uint8_t>(index >> (56 - 8 * i));
  if (EVP_EncryptInit_ex(ctx_->gcm, EVP_aes_256_gcm(), nullptr, key.data(), nonce) != 1)
    return Status::IOError("integrity: GMAC init failed");
  index_ = index;
  want_ = ChunkLength(params, index);
  fed_ = 0;
  uint8_t prefix[10 + 16];
  std::memcpy(prefix, "ctfs-chunk", 10);
  for (int i = 0; i < 8; ++i) {
    prefix[10 + i] = static_cast<uint8_t>(params.payload_size >> (56 - 8 * i));
    prefix[18 + i] = static_cast<uint8_t>(params.chunk_size >> (56 - 8 * i));
  }
  int outl = 0;
  if (EVP_EncryptUpdate(ctx_->gcm, nullptr, &outl, prefix, sizeof(prefix)) != 1)
    return Status::IOError("integrity: GMAC update failed");
  return Status::OK();
}

Status ChunkMac::Update(const uint8_t* data, size_t len) {
  if (ctx_->gcm == nullptr) return Status::InvalidArgument("integrity: Update before Begin");
  while (len > 0) {  // EVP takes int lengths
    const int n = static_cast<int>(std::min<size_t>(len, 1u << 30));
    int outl = 0;
    if (EVP_EncryptUpdate(ctx_->gcm, nullptr, &outl, data, n) != 1)
      return Status::IOError("integrity: GMAC update failed");
    data += n;
    len -= static_cast<size_t>(n);
    fed_ += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

Result<ChunkTagValue> ChunkMac::Finish() {
  if (ctx_->gcm == nullptr) return Status::InvalidArgument("integrity: Finish before Begin");
  if (fed_ != want_) {
    return Status::InvalidArgument("integrity: chunk " + std::to_string(index_) + " of " +
                                   std::to_string(fed_) + " bytes does not fit the payload");
  }
  int outl = 0;
  uint8_t none[16];
  ChunkTagValue t;
  if (EVP_EncryptFinal_ex(ctx_->gcm, none, &outl) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_->gcm, EVP_CTRL_GCM_GET_TAG, static_cast<int>(t.size()), t.data()) !=
          1)
    return Status::IOError("integrity: GMAC final failed");
  return t;
}

Result<ChunkTagValue> ChunkTag(const IntegrityKey& key, const IntegrityParams& params,
                               uint64_t index, const uint8_t* chunk, size_t len) {
  ChunkMac mac;
  CTFS_RETURN_IF_ERROR(mac.Begin(key, params, index));
  CTFS_RETURN_IF_ERROR(mac.Update(chunk, len));
  return mac.Finish();
}

Result<Tag> CombineChunkTags(const IntegrityKey& key, const IntegrityParams& params,
                             const std::vector<ChunkTagValue>& chunk_tags) {
  if (params.chunk_size == 0) return Status::InvalidArgument("integrity: chunk size is 0");
  if (chunk_tags.size() != IntegrityChunkCount(params)) {
    return Status::InvalidArgument("integrity: " + std::to_string(chunk_tags.size()) +
                                   " chunk tags for " +
                                   std::to_string(IntegrityChunkCount(params)) + " chunks");
  }
  Hmac h;
  CTFS_RETURN_IF_ERROR(h.Init(key.data(), kTagSize));
  CTFS_RETURN_IF_ERROR(UpdatePrefix(h, "ctfs-root", params));
  for (const ChunkTagValue& t : chunk_tags) CTFS_RETURN_IF_ERROR(h.Update(t.data(), t.size()));
  Tag out;
  CTFS_RETURN_IF_ERROR(h.Final(out.data()));
  return out;
}

Result<Tag> ComputeIntegrityTag(const Key& data_key, const IntegrityParams& params,
                                const uint8_t* ciphertext, size_t len, int threads) {
  if (params.payload_size != len) {
    return Status::InvalidArgument("integrity: payload_size " +
                                   std::to_string(params.payload_size) + " but " +
                                   std::to_string(len) + " bytes given");
  }
  if (params.chunk_size == 0) return Status::InvalidArgument("integrity: chunk size is 0");
  auto key = IntegrityKey::Derive(data_key, params.iv);
  if (!key.ok()) return key.status();
  const uint64_t n = IntegrityChunkCount(params);
  std::vector<ChunkTagValue> tags(n);
  std::atomic<uint64_t> next{0};
  Mutex error_mu;
  Status error;  // the first failure; the others stop taking chunks
  auto work = [&] {
    for (uint64_t i = next++; i < n; i = next++) {
      const uint64_t begin = i * params.chunk_size;
      auto t = ChunkTag(*key, params, i, ciphertext + begin, ChunkLength(params, i));
      if (!t.ok()) {
        MutexLock l(error_mu);
        if (error.ok()) error = t.status();
        next = n;
        return;
      }
      tags[i] = *t;
    }
  };
  RunOnThreads(static_cast<int>(std::min<uint64_t>(std::max(threads, 1), n)), work);
  CTFS_RETURN_IF_ERROR(error);
  return CombineChunkTags(*key, params, tags);
}

Status CheckIntegrityTag(const Tag& computed, const Tag& expected) {
  if (CRYPTO_memcmp(computed.data(), expected.data(), kTagSize) != 0) {
    return Status::Corruption(
        "integrity check failed: the encrypted payload was modified, truncated or decrypted "
        "with the wrong key");
  }
  return Status::OK();
}

Status VerifyIntegrity(const Key& data_key, const IntegrityParams& params,
                       const uint8_t* ciphertext, size_t len, const Tag& expected, int threads) {
  auto computed = ComputeIntegrityTag(data_key, params, ciphertext, len, threads);
  if (!computed.ok()) return computed.status();
  return CheckIntegrityTag(*computed, expected);
}

void SetIntegrityField(EncryptedHeader* header, const IntegrityField& field) {
  json j = {{"alg", std::string(kIntegrityAlg)},
            {"chunk_size", field.chunk_size},
            {"tag", Base64Encode(std::string_view(reinterpret_cast<const char*>(field.tag.data()),
                                                  field.tag.size()))}};
  header->extra[std::string(kIntegrityField)] = j.dump();
}

Result<std::optional<IntegrityField>> GetIntegrityField(const EncryptedHeader& header) {
  auto it = header.extra.find(std::string(kIntegrityField));
  if (it == header.extra.end()) return std::optional<IntegrityField>();
  auto bad = [](std::string_view what) {
    return Status::Corruption("encrypted header: field 'cubetorchfs_integrity': " +
                              std::string(what));
  };
  json j = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  auto alg = j.find("alg");
  if (alg == j.end() || !alg->is_string()) return bad("no string 'alg'");
  if (alg->get_ref<const std::string&>() != kIntegrityAlg) {
    return bad("unknown algorithm (this reader knows " + std::string(kIntegrityAlg) + ")");
  }
  auto chunk = j.find("chunk_size");
  if (chunk == j.end() || !chunk->is_number_unsigned() || chunk->get<uint64_t>() == 0) {
    return bad("'chunk_size' is not a positive integer");
  }
  auto tag = j.find("tag");
  if (tag == j.end() || !tag->is_string()) return bad("no string 'tag'");
  auto bytes = Base64Decode(tag->get_ref<const std::string&>(), "tag");
  if (!bytes.ok() || bytes->size() != kTagSize) return bad("'tag' is not base64 of 32 bytes");
  IntegrityField f;
  f.chunk_size = chunk->get<uint64_t>();
  std::memcpy(f.tag.data(), bytes->data(), kTagSize);
  return std::optional<IntegrityField>(f);
}

}  // namespace cubetorchfs::crypto
