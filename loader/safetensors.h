// The safetensors header parser: validates a file's 8-byte length and JSON header and returns
// where each tensor's bytes lie.
//
// Format: 8 bytes little-endian N, then N bytes of UTF-8 JSON, then the data section. The JSON
// maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
// the data section, which starts at byte 8 + N) and may hold "__metadata__" (string → string).
//
// Every rule of docs/formats.md ("safetensors: the rules the parser enforces") is checked; a
// violation is a Status::Corruption whose message reads
//   "safetensors: rule <rule-id>: [tensor '<name>': ]<detail>"
// with the rule ids listed below (kRule*), so callers and tests can tell the rules apart.
//
// Two ways to call it:
//   1. Read the first 8 bytes, call HeaderLength() to learn N (validated against the file
//      size), read bytes [8, 8 + N) and call ParseHeaderJson().
//   2. Read a prefix of the file (e.g. the first 1 MiB) and call ParseSafetensorsHeader(); if the
//      prefix is too short it returns InvalidArgument naming how many bytes are needed (also
//      available as 8 + HeaderLength()).
//
// Thread safety: all functions are pure; call them from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace cubetorchfs::loader {

// The element types of the format. Sizes are in bits because F6_* and F4 are sub-byte.
enum class Dtype : uint8_t {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kU64,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kC64,
  kF8_E4M3,
  kF8_E5M2,
  kF8_E8M0,
  kF8_E4M3FNUZ,
  kF8_E5M2FNUZ,
  kF6_E2M3,
  kF6_E3M2,
  kF4,
};
inline constexpr int kNumDtypes = static_cast<int>(Dtype::kF4) + 1;

// The name the format uses ("F32", "BF16", ...).
const char* DtypeName(Dtype dtype);
// Size of one element in bits (BOOL: 8, F6_*: 6, F4: 4, C64: 64).
uint32_t DtypeBits(Dtype dtype);
// "F32" → Dtype::kF32. Exact, case-sensitive match; anything else → InvalidArgument.
Result<Dtype> ParseDtype(std::string_view name);

// Limit on N from the reference implementation (100,000,000 bytes).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<uint64_t> shape;  // empty: a 0-dim (scalar) tensor
  uint64_t begin = 0;           // relative to Header::data_offset
  uint64_t end = 0;             // exclusive; end - begin == NumBytes
  uint64_t num_bytes() const { return end - begin; }
};

struct Header {
  std::map<std::string, std::string> metadata;  // "__metadata__", empty when absent
  std::vector<TensorInfo> tensors;              // sorted by begin (ties: by name)
  uint64_t header_len = 0;                      // N
  uint64_t data_offset = 0;                     // 8 + N: where the data section starts
};

// Rule ids used in error messages, one per rule.
inline constexpr const char* kRuleLengthPrefix = "length-prefix";       // 8-byte LE N exists
inline constexpr const char* kRuleHeaderLimit = "header-size-limit";    // N <= 100,000,000
inline constexpr const char* kRuleHeaderInFile = "header-within-file";  // 8 + N <= file size
inline constexpr const char* kRuleUtf8Json = "header-utf8-json";        // valid UTF-8 JSON
inline constexpr const char* kRuleJsonObject = "header-json-object";    // top level is an object
inline constexpr const char* kRuleUniqueKeys = "unique-keys";           // no duplicate keys
inline constexpr const char* kRuleEntryKeys = "entry-keys";      // exactly dtype/shape/data_offsets
inline constexpr const char* kRuleKnownDtype = "known-dtype";    // dtype a known string
inline constexpr const char* kRuleShape = "shape-integers";      // shape: non-negative integers
inline constexpr const char* kRuleDataOffsets = "data-offsets";  // [begin, end], begin <= end
inline constexpr const char* kRuleMetadata = "metadata-strings";  // __metadata__: str → str
inline constexpr const char* kRuleFirstOffset = "offsets-start-at-zero";
inline constexpr const char* kRuleContiguous = "offsets-contiguous";   // no gaps, no overlaps
inline constexpr const char* kRuleSizeOverflow = "size-overflow";      // shape product overflows
inline constexpr const char* kRuleByteAligned = "byte-aligned-size";   // sub-byte: bits % 8 == 0
inline constexpr const char* kRuleSizeMatches = "size-matches-shape";  // end-begin == bytes
inline constexpr const char* kRuleDataEndsAtEof = "data-ends-at-eof";

// Reads N from the first 8 bytes and checks N <= kMaxHeaderBytes and 8 + N <= file_size.
// REQUIRES: first8 points to at least first8_len bytes. file_size < 8 → Corruption (rule
// length-prefix); first8_len < 8 with a longer file → InvalidArgument "need 8 bytes".
Result<uint64_t> HeaderLength(const uint8_t* first8, size_t first8_len, uint64_t file_size);

// Parses and validates the N-byte JSON header (bytes [8, 8 + N) of a file of file_size bytes).
// REQUIRES: 8 + header_len <= file_size (as HeaderLength checks; otherwise Corruption).
Result<Header> ParseHeaderJson(const uint8_t* header, size_t header_len, uint64_t file_size);

// Both steps over a prefix of the file. If prefix_len < 8 + N (and the length itself is
// valid) → InvalidArgument "safetensors: need <8+N> bytes of the file, got <prefix_len>".
Result<Header> ParseSafetensorsHeader(const uint8_t* prefix, size_t prefix_len, uint64_t file_size);

}  // namespace cubetorchfs::loader
