#include "loader/safetensors.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>

namespace cubetorchfs::loader {
namespace {

using json = nlohmann::json;

struct DtypeDesc {
  Dtype dtype;
  const char* name;
  uint32_t bits;
};

// Indexed by Dtype's value (checked by a static_assert below).
constexpr DtypeDesc kDtypes[] = {
    {Dtype::kBool, "BOOL", 8},
    {Dtype::kU8, "U8", 8},
    {Dtype::kI8, "I8", 8},
    {Dtype::kU16, "U16", 16},
    {Dtype::kI16, "I16", 16},
    {Dtype::kU32, "U32", 32},
    {Dtype::kI32, "I32", 32},
    {Dtype::kU64, "U64", 64},
    {Dtype::kI64, "I64", 64},
    {Dtype::kF16, "F16", 16},
    {Dtype::kBF16, "BF16", 16},
    {Dtype::kF32, "F32", 32},
    {Dtype::kF64, "F64", 64},
    {Dtype::kC64, "C64", 64},
    {Dtype::kF8_E4M3, "F8_E4M3", 8},
    {Dtype::kF8_E5M2, "F8_E5M2", 8},
    {Dtype::kF8_E8M0, "F8_E8M0", 8},
    {Dtype::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {Dtype::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {Dtype::kF6_E2M3, "F6_E2M3", 6},
    {Dtype::kF6_E3M2, "F6_E3M2", 6},
    {Dtype::kF4, "F4", 4},
};
static_assert(std::size(kDtypes) == kNumDtypes);

constexpr bool DtypeTableInOrder() {
  for (int i = 0; i < kNumDtypes; ++i) {
    if (static_cast<int>(kDtypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(DtypeTableInOrder());

constexpr char kMetadataKey[] = "__metadata__";
// Names in messages are cut to this many bytes (a fuzzed name may be megabytes long).
constexpr size_t kMaxNameInMessage = 200;

std::string Quote(std::string_view name) {
  std::string out = "'";
  out.append(name.substr(0, kMaxNameInMessage));
  if (name.size() > kMaxNameInMessage) out += "...";
  out += "'";
  return out;
}

Status Corrupt(const char* rule, std::string_view detail) {
  std::string msg = "safetensors: rule ";
  msg += rule;
  msg += ": ";
  msg += detail;
  return Status::Corruption(msg);
}

Status CorruptTensor(const char* rule, std::string_view tensor, std::string_view detail) {
  std::string msg = "tensor " + Quote(tensor) + ": ";
  msg += detail;
  return Corrupt(rule, msg);
}

// A JSON integer >= 0 that fits in 64 bits (nlohmann stores larger ones as floats).
bool AsNonNegativeInt(const json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {  // "-0"
    *out = 0;
    return true;
  }
  return false;
}

// nlohmann keeps the last of duplicate keys silently; this callback notices them. The first
// duplicate found is kept for the error message.
class DuplicateKeyFinder {
 public:
  bool OnEvent(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys_.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys_.empty()) keys_.pop_back();
        break;
      case json::parse_event_t::key: {
        if (keys_.empty() || !parsed.is_string()) break;
        const std::string& key = parsed.get_ref<const std::string&>();
        if (keys_.size() == 1) top_key_ = key;
        if (!found_ && !keys_.back().insert(key).second) {
          found_ = true;
          at_top_ = keys_.size() == 1;
          dup_key_ = key;
          dup_parent_ = top_key_;
        }
        break;
      }
      default:
        break;
    }
    return true;
  }

  Status Check() const {
    if (!found_) return Status::OK();
    if (at_top_) {
      return Corrupt(kRuleUniqueKeys, "duplicate tensor name " + Quote(dup_key_));
    }
    return CorruptTensor(kRuleUniqueKeys, dup_parent_, "duplicate key " + Quote(dup_key_));
  }

 private:
  std::vector<std::unordered_set<std::string>> keys_;  // one set per open object
  std::string top_key_;                                // the current top-level key
  bool found_ = false;
  bool at_top_ = false;
  std::string dup_key_;
  std::string dup_parent_;
};

Status ParseMetadata(const json& j, std::map<std::string, std::string>* out) {
  // The reference implementation reads "__metadata__": null as no metadata.
  if (j.is_null()) return Status::OK();
  if (!j.is_object()) {
    return Corrupt(kRuleMetadata, "__metadata__ must be an object mapping strings to strings");
  }
  for (const auto& [key, value] : j.items()) {
    if (!value.is_string()) {
      return Corrupt(kRuleMetadata, "__metadata__ value of key " + Quote(key) + " is not a string");
    }
    out->emplace(key, value.get<std::string>());
  }
  return Status::OK();
}

// Validates one entry's keys and types and fills dtype/shape/begin/end.
Status ParseEntry(const std::string& name, const json& j, TensorInfo* t) {
  if (!j.is_object()) {
    return CorruptTensor(kRuleEntryKeys, name,
                         "entry must be an object {\"dtype\", \"shape\", \"data_offsets\"}");
  }
  const json* dtype = nullptr;
  const json* shape = nullptr;
  const json* offsets = nullptr;
  for (const auto& [key, value] : j.items()) {
    if (key == "dtype") {
      dtype = &value;
    } else if (key == "shape") {
      shape = &value;
    } else if (key == "data_offsets") {
      offsets = &value;
    } else {
      return CorruptTensor(
          kRuleEntryKeys, name,
          "unknown key " + Quote(key) + " (entries have exactly dtype, shape and data_offsets)");
    }
  }
  if (dtype == nullptr) return CorruptTensor(kRuleEntryKeys, name, "missing key 'dtype'");
  if (shape == nullptr) return CorruptTensor(kRuleEntryKeys, name, "missing key 'shape'");
  if (offsets == nullptr) {
    return CorruptTensor(kRuleEntryKeys, name, "missing key 'data_offsets'");
  }

  if (!dtype->is_string()) return CorruptTensor(kRuleKnownDtype, name, "dtype is not a string");
  const std::string& dtype_name = dtype->get_ref<const std::string&>();
  Result<Dtype> parsed = ParseDtype(dtype_name);
  if (!parsed.ok()) {
    return CorruptTensor(kRuleKnownDtype, name, "unknown dtype " + Quote(dtype_name));
  }
  t->dtype = *parsed;

  if (!shape->is_array()) {
    return CorruptTensor(kRuleShape, name, "shape is not an array of non-negative integers");
  }
  t->shape.reserve(shape->size());
  for (const json& dim : *shape) {
    uint64_t d = 0;
    if (!AsNonNegativeInt(dim, &d)) {
      return CorruptTensor(kRuleShape, name,
                           "shape element " + dim.dump() + " is not a non-negative integer");
    }
    t->shape.push_back(d);
  }

  if (!offsets->is_array() || offsets->size() != 2 || !AsNonNegativeInt((*offsets)[0], &t->begin) ||
      !AsNonNegativeInt((*offsets)[1], &t->end)) {
    return CorruptTensor(kRuleDataOffsets, name,
                         "data_offsets must be [begin, end], two non-negative integers");
  }
  if (t->begin > t->end) {
    return CorruptTensor(
        kRuleDataOffsets, name,
        "data_offsets begin " + std::to_string(t->begin) + " > end " + std::to_string(t->end));
  }
  return Status::OK();
}

// end - begin must equal product(shape) * element size, computed without overflow.
Status CheckSize(const TensorInfo& t) {
  uint64_t elements = 1;
  for (uint64_t d : t.shape) {
    if (__builtin_mul_overflow(elements, d, &elements)) {
      return CorruptTensor(kRuleSizeOverflow, t.name, "the product of the shape overflows 64 bits");
    }
  }
  uint64_t bits = 0;
  if (__builtin_mul_overflow(elements, uint64_t{DtypeBits(t.dtype)}, &bits)) {
    return CorruptTensor(kRuleSizeOverflow, t.name, "elements x element size overflows 64 bits");
  }
  if (bits % 8 != 0) {
    return CorruptTensor(kRuleByteAligned, t.name,
                         std::to_string(elements) + " elements of " + DtypeName(t.dtype) + " are " +
                             std::to_string(bits) + " bits, not a whole number of bytes");
  }
  const uint64_t bytes = bits / 8;
  if (t.end - t.begin != bytes) {
    return CorruptTensor(kRuleSizeMatches, t.name,
                         "data_offsets span " + std::to_string(t.end - t.begin) +
                             " bytes but shape and dtype need " + std::to_string(bytes));
  }
  return Status::OK();
}

Result<Header> ParseHeaderJsonImpl(const uint8_t* header, size_t header_len, uint64_t file_size) {
  if (header_len > kMaxHeaderBytes) {
    return Corrupt(kRuleHeaderLimit,
                   "header length " + std::to_string(header_len) + " exceeds 100,000,000 bytes");
  }
  if (file_size < 8 || header_len > file_size - 8) {
    return Corrupt(kRuleHeaderInFile, "8 + header length " + std::to_string(header_len) +
                                          " exceeds the file size " + std::to_string(file_size));
  }
  const char* text = reinterpret_cast<const char*>(header);
  // nlohmann skips a UTF-8 byte-order mark; the reference implementation (serde_json) does not.
  if (header_len >= 3 && static_cast<unsigned char>(text[0]) == 0xEF &&
      static_cast<unsigned char>(text[1]) == 0xBB && static_cast<unsigned char>(text[2]) == 0xBF) {
    return Corrupt(kRuleUtf8Json, "the header starts with a byte-order mark");
  }
  // nlohmann's lexer ends the input at a NUL byte (for C strings), which would accept
  // "{}\0<anything>". Valid JSON never holds a raw NUL (not whitespace; escaped in strings).
  if (std::memchr(text, '\0', header_len) != nullptr) {
    return Corrupt(kRuleUtf8Json, "the header holds a NUL byte, which JSON does not allow");
  }

  DuplicateKeyFinder dups;
  json root = json::parse(
      text, text + header_len,
      [&dups](int depth, json::parse_event_t event, json& parsed) {
        return dups.OnEvent(depth, event, parsed);
      },
      /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return Corrupt(kRuleUtf8Json, "the header is not valid UTF-8 JSON");
  }
  if (!root.is_object()) {
    return Corrupt(kRuleJsonObject, "the header is JSON but not an object");
  }
  CTFS_RETURN_IF_ERROR(dups.Check());

  Header h;
  h.header_len = header_len;
  h.data_offset = 8 + header_len;
  h.tensors.reserve(root.size());
  for (const auto& [name, value] : root.items()) {
    if (name == kMetadataKey) {
      CTFS_RETURN_IF_ERROR(ParseMetadata(value, &h.metadata));
      continue;
    }
    TensorInfo t;
    t.name = name;
    CTFS_RETURN_IF_ERROR(ParseEntry(name, value, &t));
    h.tensors.push_back(std::move(t));
  }

  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin != expected) {
      if (&t == &h.tensors.front()) {
        return CorruptTensor(
            kRuleFirstOffset, t.name,
            "the first tensor (by offset) begins at " + std::to_string(t.begin) + ", not 0");
      }
      const TensorInfo& prev = (&t)[-1];
      return CorruptTensor(kRuleContiguous, t.name,
                           "begins at " + std::to_string(t.begin) + " but the previous tensor " +
                               Quote(prev.name) + " ends at " + std::to_string(expected) +
                               (t.begin > expected ? " (a gap)" : " (an overlap)"));
    }
    CTFS_RETURN_IF_ERROR(CheckSize(t));
    expected = t.end;
  }
  const uint64_t data_size = file_size - h.data_offset;  // >= 0: checked above
  if (expected != data_size) {
    std::string detail = "the tensors end at data offset " + std::to_string(expected) +
                         " but the data section is " + std::to_string(data_size) + " bytes";
    if (h.tensors.empty()) return Corrupt(kRuleDataEndsAtEof, detail);
    return CorruptTensor(kRuleDataEndsAtEof, h.tensors.back().name, detail);
  }
  return h;
}

}  // namespace

const char* DtypeName(Dtype dtype) {
  const int i = static_cast<int>(dtype);
  if (i < 0 || i >= kNumDtypes) return "?";
  return kDtypes[i].name;
}

uint32_t DtypeBits(Dtype dtype) {
  const int i = static_cast<int>(dtype);
  if (i < 0 || i >= kNumDtypes) return 0;
  return kDtypes[i].bits;
}

Result<Dtype> ParseDtype(std::string_view name) {
  for (const DtypeDesc& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  return Status::InvalidArgument("unknown safetensors dtype " + Quote(name));
}

Result<uint64_t> HeaderLength(const uint8_t* first8, size_t first8_len, uint64_t file_size) {
  if (file_size < 8) {
    return Corrupt(kRuleLengthPrefix, "the file is " + std::to_string(file_size) +
                                          " bytes, shorter than the 8-byte header length");
  }
  if (first8_len < 8) {
    return Status::InvalidArgument("safetensors: need 8 bytes of the file, got " +
                                   std::to_string(first8_len));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  if (n > kMaxHeaderBytes) {
    return Corrupt(kRuleHeaderLimit,
                   "header length " + std::to_string(n) + " exceeds 100,000,000 bytes");
  }
  if (n > file_size - 8) {
    return Corrupt(kRuleHeaderInFile, "8 + header length " + std::to_string(n) +
                                          " exceeds the file size " + std::to_string(file_size));
  }
  return n;
}

Result<Header> ParseHeaderJson(const uint8_t* header, size_t header_len, uint64_t file_size) {
  // Exceptions never cross the component: with allow_exceptions=false nlohmann reports parse
  // errors as a discarded value; what is left is running out of memory.
  try {
    return ParseHeaderJsonImpl(header, header_len, file_size);
  } catch (const std::bad_alloc&) {
    return Status::IOError("safetensors: out of memory parsing the header");
  } catch (const std::exception& e) {
    return Corrupt(kRuleUtf8Json, std::string("the header could not be parsed: ") + e.what());
  }
}

Result<Header> ParseSafetensorsHeader(const uint8_t* prefix, size_t prefix_len,
                                      uint64_t file_size) {
  CTFS_ASSIGN_OR_RETURN(uint64_t n, HeaderLength(prefix, prefix_len, file_size));
  const uint64_t need = 8 + n;
  if (prefix_len < need) {
    return Status::InvalidArgument("safetensors: need " + std::to_string(need) +
                                   " bytes of the file, got " + std::to_string(prefix_len));
  }
  return ParseHeaderJson(prefix + 8, n, file_size);
}

}  // namespace cubetorchfs::loader
