// Integrity tag over the ciphertext of an encrypted model file — OUR EXTENSION to the
// veTurboIO format (veTurboIO readers ignore it). Encrypt-then-MAC, keyed by the data key, so a
// flipped, truncated, appended or reordered byte anywhere in the payload is a clear Corruption
// error instead of silently wrong weights.
//
// Definition (all HMAC-SHA256; u64 is 8 bytes big-endian):
//   mac_key      = HMAC(data_key, "cubetorchfs-integrity-v1")
//   chunk_tag[i] = HMAC(mac_key, "ctfs-chunk" | iv | u64(payload_size) | u64(chunk_size) |
//                                u64(i) | ciphertext[i*chunk_size, min((i+1)*chunk_size, size)))
//   tag          = HMAC(mac_key, "ctfs-root" | iv | u64(payload_size) | u64(chunk_size) |
//                                chunk_tag[0] | chunk_tag[1] | ...)
// Chunk tags are independent, so verification runs in parallel chunks (a reader can compute
// the tag of each chunk in the thread that read it, then combine). Stored in the header as
//   "cubetorchfs_integrity": {"alg": "HMAC-SHA256-chunked-v1", "chunk_size": N, "tag": b64}
//
// Thread safety: reentrant; IntegrityKey is an immutable value once made.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "crypto/aes_ctr.h"
#include "crypto/encrypted_header.h"

namespace cubetorchfs::crypto {

inline constexpr std::string_view kIntegrityField = "cubetorchfs_integrity";
inline constexpr std::string_view kIntegrityAlg = "HMAC-SHA256-chunked-v1";
inline constexpr uint64_t kDefaultIntegrityChunk = uint64_t{4} << 20;
inline constexpr size_t kTagSize = 32;

using Tag = std::array<uint8_t, kTagSize>;

// The MAC key derived from a data key. Wiped when destroyed.
class IntegrityKey {
 public:
  ~IntegrityKey();
  IntegrityKey(const IntegrityKey& other) = default;
  IntegrityKey& operator=(const IntegrityKey& other) = default;
  static Result<IntegrityKey> Derive(const Key& data_key);
  const uint8_t* data() const { return bytes_.data(); }

 private:
  IntegrityKey() = default;
  std::array<uint8_t, 32> bytes_{};
};

// What the tag covers besides the bytes.
struct IntegrityParams {
  Iv iv{};
  uint64_t payload_size = 0;
  uint64_t chunk_size = kDefaultIntegrityChunk;  // Default: 4 MiB; must be > 0
};

// Number of chunks of a payload (0 for an empty one).
uint64_t IntegrityChunkCount(const IntegrityParams& params);

// Tag of chunk `index`, whose ciphertext is chunk[0, len). REQUIRES len is that chunk's exact
// length (InvalidArgument otherwise).
Result<Tag> ChunkTag(const IntegrityKey& key, const IntegrityParams& params, uint64_t index,
                     const uint8_t* chunk, size_t len);

// The file tag from all chunk tags in order (InvalidArgument if the count is wrong).
Result<Tag> CombineChunkTags(const IntegrityKey& key, const IntegrityParams& params,
                             const std::vector<Tag>& chunk_tags);

// The file tag of a whole ciphertext in memory, chunks spread over up to `threads` threads.
// params.payload_size must equal len.
Result<Tag> ComputeIntegrityTag(const Key& data_key, const IntegrityParams& params,
                                const uint8_t* ciphertext, size_t len, int threads);

// Constant-time comparison; Corruption "integrity check failed ..." on mismatch.
Status CheckIntegrityTag(const Tag& computed, const Tag& expected);

// ComputeIntegrityTag + CheckIntegrityTag.
Status VerifyIntegrity(const Key& data_key, const IntegrityParams& params,
                       const uint8_t* ciphertext, size_t len, const Tag& expected, int threads);

// The header field: what to store and how to read it back.
struct IntegrityField {
  uint64_t chunk_size = kDefaultIntegrityChunk;
  Tag tag{};
};
// Sets header->extra[kIntegrityField].
void SetIntegrityField(EncryptedHeader* header, const IntegrityField& field);
// nullopt when the header has no integrity field; Corruption if it is malformed or names an
// unknown algorithm.
Result<std::optional<IntegrityField>> GetIntegrityField(const EncryptedHeader& header);

}  // namespace cubetorchfs::crypto
