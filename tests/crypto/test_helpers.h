// Helpers shared by the crypto tests.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "crypto/aes_ctr.h"

namespace cubetorchfs::crypto::testing {

inline std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

inline Key RandomKey(std::mt19937_64& rng, size_t len) {
  auto bytes = RandomBytes(rng, len);
  return Key::FromBytes(bytes.data(), bytes.size()).value();
}

inline Iv RandomIv(std::mt19937_64& rng) {
  Iv iv;
  for (auto& b : iv) b = static_cast<uint8_t>(rng());
  return iv;
}

inline std::string Hex(const uint8_t* p, size_t n) {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += kDigits[p[i] >> 4];
    s += kDigits[p[i] & 15];
  }
  return s;
}

}  // namespace cubetorchfs::crypto::testing
