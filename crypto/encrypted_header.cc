#include "crypto/encrypted_header.h"

#include <openssl/rand.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "crypto/base64.h"

namespace cubetorchfs::crypto {

namespace {

using nlohmann::json;

constexpr std::string_view kStandardFields[] = {"mode", "iv", "meta_data_key", "file_timestamp"};

bool IsStandardField(std::string_view name) {
  return std::find(std::begin(kStandardFields), std::end(kStandardFields), name) !=
         std::end(kStandardFields);
}

Status Bad(std::string_view what) {
  return Status::Corruption("encrypted header: " + std::string(what));
}

}  // namespace

std::string_view CipherModeName(CipherMode mode) {
  return mode == CipherMode::kCtr256 ? "CTR-256" : "CTR-128";
}

size_t CipherModeKeySize(CipherMode mode) { return mode == CipherMode::kCtr256 ? 32 : 16; }

bool HasEncryptedHeaderMagic(const uint8_t* data, size_t len) {
  return len >= kEncryptedHeaderMagic.size() &&
         std::memcmp(data, kEncryptedHeaderMagic.data(), kEncryptedHeaderMagic.size()) == 0;
}

Result<EncryptedHeader> ParseEncryptedHeader(const uint8_t* data, size_t len) {
  if (len < kEncryptedHeaderSize) {
    return Bad("truncated: " + std::to_string(len) + " bytes, the header is " +
               std::to_string(kEncryptedHeaderSize));
  }
  if (!HasEncryptedHeaderMagic(data, len)) return Bad("bad magic (expected Byte3ncryptM0del)");
  const char* begin = reinterpret_cast<const char*>(data) + kEncryptedHeaderMagic.size();
  const char* end = reinterpret_cast<const char*>(data) + kEncryptedHeaderSize;
  const char* nul = std::find(begin, end, '\0');
  // Everything after the JSON must be zero padding.
  if (std::any_of(nul, end, [](char c) { return c != '\0'; })) {
    return Bad("bytes after the JSON are not zero padding");
  }
  json j = json::parse(begin, nul, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("the JSON does not parse");
  if (!j.is_object()) return Bad("the JSON is not an object");

  EncryptedHeader h;
  auto mode = j.find("mode");
  if (mode == j.end()) return Bad("field 'mode' is missing");
  if (!mode->is_string()) return Bad("field 'mode' is not a string");
  const std::string& mode_name = mode->get_ref<const std::string&>();
  if (mode_name == "CTR-128") {
    h.mode = CipherMode::kCtr128;
  } else if (mode_name == "CTR-256") {
    h.mode = CipherMode::kCtr256;
  } else {
    return Bad("field 'mode' is '" + mode_name.substr(0, 32) + "', expected CTR-128 or CTR-256");
  }

  auto iv = j.find("iv");
  if (iv == j.end()) return Bad("field 'iv' is missing");
  if (!iv->is_string()) return Bad("field 'iv' is not a string");
  auto iv_bytes = Base64Decode(iv->get_ref<const std::string&>(), "field 'iv'");
  if (!iv_bytes.ok()) return Bad(iv_bytes.status().message());
  if (iv_bytes->size() != kIvSize) {
    return Bad("field 'iv' decodes to " + std::to_string(iv_bytes->size()) + " bytes, expected 16");
  }
  std::memcpy(h.iv.data(), iv_bytes->data(), kIvSize);

  auto mdk = j.find("meta_data_key");
  if (mdk != j.end() && !mdk->is_null()) {
    if (!mdk->is_string()) return Bad("field 'meta_data_key' is not a string");
    if (!mdk->get_ref<const std::string&>().empty()) {
      h.meta_data_key = mdk->get<std::string>();
    }
  }

  auto ts = j.find("file_timestamp");
  if (ts != j.end() && !ts->is_null()) {
    if (!ts->is_number()) return Bad("field 'file_timestamp' is not a number");
    h.file_timestamp =
        ts->is_number_float() ? static_cast<int64_t>(ts->get<double>()) : ts->get<int64_t>();
  }

  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!IsStandardField(it.key())) h.extra[it.key()] = it.value().dump();
  }
  return h;
}

Result<EncryptedHeader> NewEncryptedHeader(CipherMode mode, int64_t file_timestamp) {
  EncryptedHeader h;
  h.mode = mode;
  h.file_timestamp = file_timestamp;
  if (RAND_bytes(h.iv.data(), static_cast<int>(h.iv.size())) != 1) {
    return Status::IOError("encrypted header: RAND_bytes failed to make an IV");
  }
  return h;
}

Result<std::string> SerializeEncryptedHeader(const EncryptedHeader& header) {
  json j = json::object();
  j["mode"] = std::string(CipherModeName(header.mode));
  j["iv"] = Base64Encode(
      std::string_view(reinterpret_cast<const char*>(header.iv.data()), header.iv.size()));
  if (header.meta_data_key) j["meta_data_key"] = *header.meta_data_key;
  j["file_timestamp"] = header.file_timestamp;
  for (const auto& [name, value] : header.extra) {
    if (IsStandardField(name)) {
      return Status::InvalidArgument("encrypted header: extra field '" + name +
                                     "' would replace a standard field");
    }
    json v = json::parse(value, nullptr, /*allow_exceptions=*/false);
    if (v.is_discarded()) {
      return Status::InvalidArgument("encrypted header: extra field '" + name +
                                     "' is not valid JSON");
    }
    j[name] = std::move(v);
  }
  // ensure_ascii keeps the text pure ASCII (valid UTF-8, no NUL bytes inside strings).
  const std::string text = j.dump(-1, ' ', /*ensure_ascii=*/true);
  if (kEncryptedHeaderMagic.size() + text.size() > kEncryptedHeaderSize) {
    return Status::InvalidArgument("encrypted header: JSON of " + std::to_string(text.size()) +
                                   " bytes does not fit in the header");
  }
  std::string out(kEncryptedHeaderSize, '\0');
  std::memcpy(out.data(), kEncryptedHeaderMagic.data(), kEncryptedHeaderMagic.size());
  std::memcpy(out.data() + kEncryptedHeaderMagic.size(), text.data(), text.size());
  return out;
}

}  // namespace cubetorchfs::crypto
