// Integrity tag over the ciphertext of an encrypted model file — OUR EXTENSION to the
// veTurboIO format (veTurboIO readers ignore it). Encrypt-then-MAC, keyed by the data key, so a
// flipped, truncated, appended or reordered byte anywhere in the payload is a clear Corruption
// error instead of silently wrong weights.
//
// Definition (u64 is 8 bytes big-endian, u32 4 bytes big-endian):
//   mac_key      = HMAC-SHA256(data_key, "cubetorchfs-integrity-v2" | iv)      (32 bytes)
//   chunk_tag[i] = GMAC-AES-256(mac_key, nonce = u32(0) | u64(i),
//                               aad = "ctfs-chunk" | u64(payload_size) | u64(chunk_size) |
//                                     ciphertext[i*chunk_size, min((i+1)*chunk_size, size)))
//                                                                               (16 bytes)
//   tag          = HMAC-SHA256(mac_key, "ctfs-root" | iv | u64(payload_size) | u64(chunk_size) |
//                              chunk_tag[0] | chunk_tag[1] | ...)               (32 bytes)
// The MAC key is per file (the IV is fresh for every file written), so GMAC nonces, which are
// the chunk indexes, never repeat under one key. GMAC runs on the AES and carry-less multiply
// instructions (several times the speed of HMAC-SHA256 with SHA-NI: bench/crypto_bench), and chunk
// tags are independent, so verification runs in parallel chunks, in the thread that read each
// chunk, while the chunk is still in its cache (ChunkMac takes it in pieces).
// Stored in the header as
//   "cubetorchfs_integrity": {"alg": "GMAC-AES256-chunked-v2", "chunk_size": N, "tag": b64}
//
// Thread safety: reentrant; IntegrityKey is an immutable value once made; a ChunkMac is used
// by one thread.
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
inline constexpr std::string_view kIntegrityAlg = "GMAC-AES256-chunked-v2";
inline constexpr uint64_t kDefaultIntegrityChunk = uint64_t{4} << 20;
inline constexpr size_t kTagSize = 32;

inline constexpr size_t kChunkTagSize = 16;

using Tag = std::array<uint8_t, kTagSize>;
using ChunkTagValue = std::array<uint8_t, kChunkTagSize>;

// The MAC key derived from a data key. Wiped when destroyed.
class IntegrityKey {
 public:
  ~IntegrityKey();
  IntegrityKey(const IntegrityKey& other) = default;
  IntegrityKey& operator=(const IntegrityKey& other) = default;
  static Result<IntegrityKey> Derive(const Key& data_key, const Iv& iv);
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

// The tag of one chunk, fed in pieces in order: Begin, Update..., Finish. Finish fails
// (InvalidArgument) unless exactly the chunk's length was fed.
class ChunkMac {
 public:
  ChunkMac();
  ~ChunkMac();
  ChunkMac(const ChunkMac&) = delete;
  ChunkMac& operator=(const ChunkMac&) = delete;
  Status Begin(const IntegrityKey& key, const IntegrityParams& params, uint64_t index);
  Status Update(const uint8_t* data, size_t len);
  Result<ChunkTagValue> Finish();

 private:
  struct Ctx;
  Ctx* ctx_;
  uint64_t index_ = 0;
  uint64_t want_ = 0;
  uint64_t fed_ = 0;
};

// Tag of chunk `index`, whose ciphertext is chunk[0, len). REQUIRES len is that chunk's exact
// length (InvalidArgument otherwise).
Result<ChunkTagValue> ChunkTag(const IntegrityKey& key, const IntegrityParams& params,
                               uint64_t index, const uint8_t* chunk, size_t len);

// The file tag from all chunk tags in order (InvalidArgument if the count is wrong).
Result<Tag> CombineChunkTags(const IntegrityKey& key, const IntegrityParams& params,
                             const std::vector<ChunkTagValue>& chunk_tags);

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
