// Integrity MAC throughput: the chunk GMAC of crypto/integrity.h against HMAC-SHA256 (OpenSSL)
// over the same buffer, one thread, rounds alternating GMAC, HMAC, GMAC, ... Prints the median
// and min-max GB/s of each, the CPU's relevant instructions, and a last line
// `ratio: GMAC/HMAC-SHA256 = X`. The figure docs/models.md quotes (5.3x on 2026-11-23).
//
//   build-dir/bin/crypto_bench [--mib 256] [--rounds 5] [--chunk-mib 4]
//
// Built by `cmake --build BUILD --target crypto_bench` (not part of the default build or the
// tests). Both MACs run over the same random bytes, in the same chunk size (the GMAC as
// ChunkTag per chunk, exactly what the loader does; HMAC-SHA256 one MAC per chunk too), from
// memory that was touched before timing.

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "crypto/aes_ctr.h"
#include "crypto/integrity.h"

namespace {

using cubetorchfs::crypto::ChunkTag;
using cubetorchfs::crypto::IntegrityKey;
using cubetorchfs::crypto::IntegrityParams;
using cubetorchfs::crypto::Iv;
using cubetorchfs::crypto::Key;

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "crypto_bench: %s\n", why.c_str());
  std::exit(2);
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// GMAC of every chunk of buf; returns seconds. `sink` keeps the tags observable.
double RunGmac(const IntegrityKey& key, const IntegrityParams& params, const uint8_t* buf,
               uint8_t* sink) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t chunks = cubetorchfs::crypto::IntegrityChunkCount(params);
  for (uint64_t i = 0; i < chunks; ++i) {
    const uint64_t begin = i * params.chunk_size;
    const uint64_t len = std::min(params.chunk_size, params.payload_size - begin);
    auto tag = ChunkTag(key, params, i, buf + begin, len);
    if (!tag.ok()) Die("GMAC: " + tag.status().ToString());
    *sink ^= (*tag)[0];
  }
  return Seconds(start);
}

// HMAC-SHA256 of every chunk of buf under `mac_key`; returns seconds.
double RunHmac(const uint8_t* mac_key, const IntegrityParams& params, const uint8_t* buf,
               uint8_t* sink) {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (mac == nullptr) Die("HMAC unavailable in OpenSSL");
  char digest[] = "SHA256";
  OSSL_PARAM params_sha[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                             OSSL_PARAM_construct_end()};
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t begin = 0; begin < params.payload_size; begin += params.chunk_size) {
    const uint64_t len = std::min(params.chunk_size, params.payload_size - begin);
    EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(mac);
    unsigned char out[32];
    size_t n = 0;
    if (ctx == nullptr || EVP_MAC_init(ctx, mac_key, 32, params_sha) != 1 ||
        EVP_MAC_update(ctx, buf + begin, len) != 1 || EVP_MAC_final(ctx, out, &n, sizeof(out)) != 1)
      Die("HMAC-SHA256 failed");
    EVP_MAC_CTX_free(ctx);
    *sink ^= out[0];
  }
  const double s = Seconds(start);
  EVP_MAC_free(mac);
  return s;
}

std::string CpuFlags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::string w, out;
    while (words >> w) {
      for (const char* want :
           {"aes", "pclmulqdq", "vaes", "vpclmulqdq", "sha_ni", "avx2", "avx512f"})
        if (w == want) out += (out.empty() ? "" : " ") + w;
    }
    return out.empty() ? "(none of aes, pclmulqdq, vaes, vpclmulqdq, sha_ni, avx2, avx512f)" : out;
  }
  return "(unknown)";
}

struct Summary {
  double median, lo, hi;
};
Summary Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  const double med = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  return {med, v.front(), v.back()};
}

uint64_t ArgValue(int argc, char** argv, int* i) {
  if (*i + 1 >= argc) Die(std::string(argv[*i]) + " needs a value");
  char* end = nullptr;
  const unsigned long long v = std::strtoull(argv[++*i], &end, 10);
  if (*end != '\0' || v == 0) Die(std::string(argv[*i - 1]) + ": not a positive integer");
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 256, rounds = 5, chunk_mib = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib") {
      mib = ArgValue(argc, argv, &i);
    } else if (a == "--rounds") {
      rounds = ArgValue(argc, argv, &i);
    } else if (a == "--chunk-mib") {
      chunk_mib = ArgValue(argc, argv, &i);
    } else if (a == "-h" || a == "--help") {
      std::printf(
          "usage: crypto_bench [--mib 256] [--rounds 5] [--chunk-mib 4]\n"
          "GMAC (crypto/integrity.h chunk tags) vs HMAC-SHA256 over the same buffer, one "
          "thread; last line: ratio: GMAC/HMAC-SHA256\n");
      return 0;
    } else {
      Die("unknown argument " + a + " (try --help)");
    }
  }

  const size_t size = static_cast<size_t>(mib) << 20;
  std::vector<uint8_t> buf(size);
  for (size_t off = 0; off < size; off += 1 << 20) {  // random bytes; every page touched
    if (RAND_bytes(buf.data() + off, static_cast<int>(std::min<size_t>(1 << 20, size - off))) != 1)
      Die("RAND_bytes failed");
  }
  uint8_t key_bytes[32], mac_key[32];
  Iv iv{};
  if (RAND_bytes(key_bytes, sizeof(key_bytes)) != 1 || RAND_bytes(mac_key, sizeof(mac_key)) != 1 ||
      RAND_bytes(iv.data(), static_cast<int>(iv.size())) != 1)
    Die("RAND_bytes failed");
  auto data_key = Key::FromBytes(key_bytes, sizeof(key_bytes));
  if (!data_key.ok()) Die(data_key.status().ToString());
  auto key = IntegrityKey::Derive(*data_key, iv);
  if (!key.ok()) Die(key.status().ToString());
  IntegrityParams params;
  params.iv = iv;
  params.payload_size = size;
  params.chunk_size = chunk_mib << 20;

  uint8_t sink = 0;
  RunGmac(*key, params, buf.data(), &sink);  // warm-up: code, key schedules, page tables
  RunHmac(mac_key, params, buf.data(), &sink);
  std::vector<double> gmac, hmac;  // GB/s
  for (uint64_t r = 0; r < rounds; ++r) {
    gmac.push_back(static_cast<double>(size) / RunGmac(*key, params, buf.data(), &sink) / 1e9);
    hmac.push_back(static_cast<double>(size) / RunHmac(mac_key, params, buf.data(), &sink) / 1e9);
    std::fprintf(stderr, "[crypto_bench] round %llu: GMAC %.2f GB/s, HMAC-SHA256 %.2f GB/s\n",
                 static_cast<unsigned long long>(r + 1), gmac.back(), hmac.back());
  }
  const Summary g = Summarize(gmac), h = Summarize(hmac);
  std::printf(
      "crypto_bench - one thread, %llu MiB of random bytes in %llu MiB chunks, %llu rounds, "
      "median (min-max); CPU flags: %s\n",
      static_cast<unsigned long long>(mib), static_cast<unsigned long long>(chunk_mib),
      static_cast<unsigned long long>(rounds), CpuFlags().c_str());
  std::printf("GMAC-AES-256 (ChunkTag)  %6.2f GB/s  (%.2f-%.2f)\n", g.median, g.lo, g.hi);
  std::printf("HMAC-SHA256 (OpenSSL)    %6.2f GB/s  (%.2f-%.2f)\n", h.median, h.lo, h.hi);
  std::fprintf(stderr, "[crypto_bench] tag byte sink %u\n", static_cast<unsigned>(sink));
  std::printf("ratio: GMAC/HMAC-SHA256 = %.2f\n", g.median / h.median);
  return 0;
}
