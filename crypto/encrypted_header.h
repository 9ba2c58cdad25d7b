// The veTurboIO encrypted-file header (docs/formats.md, "Encrypted model files"): 262,144 bytes,
// the 16-byte magic "Byte3ncryptM0del", then UTF-8 JSON zero-padded to the end, with `mode`
// ("CTR-128"/"CTR-256"), `iv` (base64 of 16 bytes), `meta_data_key` (optional, KMS ciphertext
// of the data key) and `file_timestamp` (int). Unknown fields are kept as raw JSON in `extra`
// (our extensions, e.g. an integrity tag, live there) and written back.
//
// Thread safety: plain values and reentrant functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "crypto/aes_ctr.h"

namespace cubetorchfs::crypto {

inline constexpr size_t kEncryptedHeaderSize = 262144;
inline constexpr std::string_view kEncryptedHeaderMagic = "Byte3ncryptM0del";

enum class CipherMode { kCtr128, kCtr256 };

std::string_view CipherModeName(CipherMode mode);  // "CTR-128" / "CTR-256"
size_t CipherModeKeySize(CipherMode mode);         // 16 / 32

struct EncryptedHeader {
  CipherMode mode = CipherMode::kCtr128;
  Iv iv{};
  std::optional<std::string> meta_data_key;  // absent when the key comes from elsewhere
  int64_t file_timestamp = 0;
  // Fields this reader does not know: name -> the value as JSON text (e.g. "\"abc\"", "12").
  std::map<std::string, std::string> extra;
};

// True if `data` starts with the header magic (len >= 16).
bool HasEncryptedHeaderMagic(const uint8_t* data, size_t len);

// Parses a header from the first bytes of a file. REQUIRES len >= kEncryptedHeaderSize (else
// Corruption "truncated"). Corruption with a message naming the problem: bad magic, JSON that
// does not parse, missing or mistyped mode/iv, unknown mode, an IV that is not 16 bytes.
Result<EncryptedHeader> ParseEncryptedHeader(const uint8_t* data, size_t len);

// A header for a new file: `mode`, a fresh random IV (RAND_bytes), `file_timestamp` as given.
// IOError if the random generator fails.
Result<EncryptedHeader> NewEncryptedHeader(CipherMode mode, int64_t file_timestamp);

// Serializes to exactly kEncryptedHeaderSize bytes. InvalidArgument if the JSON does not fit
// or an `extra` value is not valid JSON or names a standard field.
Result<std::string> SerializeEncryptedHeader(const EncryptedHeader& header);

}  // namespace cubetorchfs::crypto
