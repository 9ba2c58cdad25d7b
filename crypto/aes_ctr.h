// AES-CTR for veTurboIO-compatible encrypted model files (docs/formats.md, "Encrypted model
// files"): AES-128 or AES-256 in counter mode where the counter for payload byte offset `o` is
// the 16-byte IV plus `o / 16`, read as one 128-bit big-endian integer with carry (wrapping at
// 2^128). Any byte range at any offset therefore encrypts/decrypts independently; CTR is its own
// inverse, so the same call does both.
//
// Thread safety: all functions are reentrant (each call owns its own EVP_CIPHER_CTX); Key and
// Iv are plain values. Key material is wiped (OPENSSL_cleanse) when a Key is destroyed or
// overwritten; it is never logged.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace cubetorchfs::crypto {

inline constexpr size_t kAesBlockSize = 16;
inline constexpr size_t kIvSize = 16;

using Iv = std::array<uint8_t, kIvSize>;

// An AES key of 16 (AES-128) or 32 (AES-256) bytes. Copies are independent; every copy wipes
// its bytes when destroyed.
class Key {
 public:
  Key() = default;
  Key(const Key& other);
  Key& operator=(const Key& other);
  ~Key();

  // REQUIRES nothing; returns InvalidArgument unless len is 16 or 32.
  static Result<Key> FromBytes(const uint8_t* data, size_t len);
  static Result<Key> FromBytes(std::string_view bytes) {
    return FromBytes(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }

  const uint8_t* data() const { return bytes_.data(); }
  size_t size() const { return size_; }  // 0 for a default-constructed (empty) key
  bool empty() const { return size_ == 0; }

 private:
  std::array<uint8_t, 32> bytes_{};
  size_t size_ = 0;
};

// The counter block for block index `block`: iv + block as a 128-bit big-endian integer,
// carrying across all 16 bytes and wrapping at 2^128.
Iv CounterAt(const Iv& iv, uint64_t block);

// XORs data[0, len) with the keystream at payload offsets [offset, offset + len) — encrypts or
// decrypts in place. Returns InvalidArgument for an empty key, IOError if OpenSSL fails.
Status CtrXorAt(const Key& key, const Iv& iv, uint64_t offset, uint8_t* data, size_t len);

// Same result as CtrXorAt, with the range split into block-aligned chunks processed by up to
// `threads` threads (each with its own cipher context). threads <= 1 runs inline. Small ranges
// run inline whatever `threads` says.
Status CtrXorParallel(const Key& key, const Iv& iv, uint64_t offset, uint8_t* data, size_t len,
                      int threads);

}  // namespace cubetorchfs::crypto
