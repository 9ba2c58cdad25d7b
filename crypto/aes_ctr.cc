#include "crypto/aes_ctr.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "common/parallel.h"

namespace cubetorchfs::crypto {

namespace {

struct CipherCtxDeleter {
  void operator()(EVP_CIPHER_CTX* ctx) const { EVP_CIPHER_CTX_free(ctx); }
};
// RAII owner of an EVP_CIPHER_CTX (freeing it also wipes the expanded key schedule).
using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, CipherCtxDeleter>;

// EVP_EncryptUpdate takes an int length; feed it at most this much at a time (block-aligned so
// the cipher's internal keystream position stays consistent across calls either way).
constexpr size_t kMaxUpdate = size_t{1} << 30;

// Below this, threads cost more than they save.
constexpr size_t kMinParallelBytes = size_t{1} << 20;
constexpr size_t kMinChunkBytes = size_t{256} << 10;

}  // namespace

Key::Key(const Key& other) : bytes_(other.bytes_), size_(other.size_) {}

Key& Key::operator=(const Key& other) {
  if (this != &other) {
    OPENSSL_cleanse(bytes_.data(), bytes_.size());
    bytes_ = other.bytes_;
    size_ = other.size_;
  }
  return *this;
}

Key::~Key() { OPENSSL_cleanse(bytes_.data(), bytes_.size()); }

Result<Key> Key::FromBytes(const uint8_t* data, size_t len) {
  if (len != 16 && len != 32) {
    return Status::InvalidArgument("AES key must be 16 or 32 bytes, got " + std::to_string(len));
  }
  Key k;
  std::memcpy(k.bytes_.data(), data, len);
  k.size_ = len;
  return k;
}

Iv CounterAt(const Iv& iv, uint64_t block) {
  Iv out = iv;
  uint64_t carry = block;
  for (int i = kIvSize - 1; i >= 0 && carry != 0; --i) {
    uint64_t sum = uint64_t{out[i]} + (carry & 0xff);
    out[i] = static_cast<uint8_t>(sum);
    carry = (carry >> 8) + (sum >> 8);
  }
  return out;
}

Status CtrXorAt(const Key& key, const Iv& iv, uint64_t offset, uint8_t* data, size_t len) {
  if (key.empty()) return Status::InvalidArgument("AES-CTR: no key");
  if (len == 0) return Status::OK();
  const EVP_CIPHER* cipher = key.size() == 16 ? EVP_aes_128_ctr() : EVP_aes_256_ctr();
  CipherCtx ctx(EVP_CIPHER_CTX_new());
  if (!ctx) return Status::IOError("AES-CTR: EVP_CIPHER_CTX_new failed");
  const Iv counter = CounterAt(iv, offset / kAesBlockSize);
  if (EVP_EncryptInit_ex(ctx.get(), cipher, nullptr, key.data(), counter.data()) != 1) {
    return Status::IOError("AES-CTR: EVP_EncryptInit_ex failed");
  }
  int out_len = 0;
  // Skip the first offset % 16 keystream bytes by encrypting a throwaway partial block.
  const size_t skip = offset % kAesBlockSize;
  if (skip != 0) {
    uint8_t scratch[kAesBlockSize] = {};
    if (EVP_EncryptUpdate(ctx.get(), scratch, &out_len, scratch, static_cast<int>(skip)) != 1) {
      return Status::IOError("AES-CTR: EVP_EncryptUpdate failed");
    }
  }
  size_t done = 0;
  while (done < len) {
    const size_t n = std::min(len - done, kMaxUpdate);
    if (EVP_EncryptUpdate(ctx.get(), data + done, &out_len, data + done, static_cast<int>(n)) !=
            1 ||
        static_cast<size_t>(out_len) != n) {
      return Status::IOError("AES-CTR: EVP_EncryptUpdate failed");
    }
    done += n;
  }
  return Status::OK();
}

Status CtrXorParallel(const Key& key, const Iv& iv, uint64_t offset, uint8_t* data, size_t len,
                      int threads) {
  if (threads <= 1 || len < kMinParallelBytes) return CtrXorAt(key, iv, offset, data, len);
  // No chunk smaller than kMinChunkBytes: more threads than that would cost more than they save.
  threads = static_cast<int>(std::min<size_t>(threads, len / kMinChunkBytes));
  if (threads <= 1) return CtrXorAt(key, iv, offset, data, len);
  // Chunks end on block boundaries of the payload so each starts on a fresh counter block
  // (not required for correctness, but it avoids the partial-block skip in every chunk).
  size_t chunk = (len + threads - 1) / threads;
  chunk = (chunk + kAesBlockSize - 1) / kAesBlockSize * kAesBlockSize;
  // The first chunk absorbs the misalignment so the others start block-aligned.
  const size_t head = (kAesBlockSize - offset % kAesBlockSize) % kAesBlockSize;
  std::vector<std::pair<size_t, size_t>> ranges;  // [begin, end) of each chunk
  for (size_t begin = 0; begin < len && ranges.size() < static_cast<size_t>(threads);) {
    size_t end = ranges.empty() ? std::min(len, chunk + head) : std::min(len, begin + chunk);
    if (ranges.size() + 1 == static_cast<size_t>(threads)) end = len;
    ranges.emplace_back(begin, end);
    begin = end;
  }
  std::vector<Status> results(ranges.size());
  std::atomic<size_t> next{0};
  RunOnThreads(static_cast<int>(ranges.size()), [&] {
    for (size_t t = next++; t < ranges.size(); t = next++) {
      const auto [begin, end] = ranges[t];
      results[t] = CtrXorAt(key, iv, offset + begin, data + begin, end - begin);
    }
  });
  for (auto& s : results) {
    if (!s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace cubetorchfs::crypto
