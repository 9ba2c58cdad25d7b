#include "crypto/base64.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <limits>

namespace cubetorchfs::crypto {

std::string Base64Encode(std::string_view bytes) {
  if (bytes.empty()) return {};
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()),
                                static_cast<int>(bytes.size()));
  out.resize(n);
  return out;
}

Result<std::string> Base64Decode(std::string_view text, std::string_view what) {
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  if (text.empty()) return std::string();
  if (text.size() % 4 != 0 || text.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return Status::InvalidArgument(std::string(what) + ": not valid base64 (length " +
                                   std::to_string(text.size()) + " is not a multiple of 4)");
  }
  std::string out(text.size() / 4 * 3, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0) {
    OPENSSL_cleanse(out.data(), out.size());
    return Status::InvalidArgument(std::string(what) + ": not valid base64");
  }
  // EVP_DecodeBlock counts the zero bytes that stand for '=' padding; drop them.
  size_t pad = 0;
  if (text.back() == '=') ++pad;
  if (text.size() >= 2 && text[text.size() - 2] == '=') ++pad;
  out.resize(static_cast<size_t>(n) - pad);
  return out;
}

}  // namespace cubetorchfs::crypto
