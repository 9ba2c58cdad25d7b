// The portable (CUDA-shared) AES core against OpenSSL.
#include "cuda/aes_core.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "crypto/aes_ctr.h"
#include "cuda/aes_ctr_gpu.h"
#include "cuda/aes_ctr_portable.h"
#include "tests/crypto/test_helpers.h"
#include "tests/cuda/cuda_test_util.h"

namespace cubetorchfs::cuda {
namespace {

using crypto::testing::RandomBytes;
using crypto::testing::RandomIv;
using crypto::testing::RandomKey;

TEST(AesCoreTest, Fips197Vectors) {
  // FIPS-197 appendix C.1 and C.3.
  uint8_t key[32];
  for (int i = 0; i < 32; ++i) key[i] = static_cast<uint8_t>(i);
  uint8_t block[16];
  for (int i = 0; i < 16; ++i) block[i] = static_cast<uint8_t>(i * 0x11);
  const uint8_t want128[16] = {0x69, 0xc4, 0xe0, 0xd8, 0x6a, 0x7b, 0x04, 0x30,
                               0xd8, 0xcd, 0xb7, 0x80, 0x70, 0xb4, 0xc5, 0x5a};
  const uint8_t want256[16] = {0x8e, 0xa2, 0xb7, 0xca, 0x51, 0x67, 0x45, 0xbf,
                               0xea, 0xfc, 0x49, 0x90, 0x4b, 0x49, 0x60, 0x89};
  AesRoundKeys rk;
  uint8_t out[16];
  AesExpandKey(kAesSbox, key, 16, &rk);
  AesEncryptBlock(kAesSbox, rk, block, out);
  EXPECT_EQ(0, std::memcmp(out, want128, 16));
  AesExpandKey(kAesSbox, key, 32, &rk);
  AesEncryptBlock(kAesSbox, rk, block, out);
  EXPECT_EQ(0, std::memcmp(out, want256, 16));
}

void CheckAgainstOpenssl(std::mt19937_64& rng, size_t key_len, const crypto::Iv& iv,
                         uint64_t base_offset, size_t size, int trials) {
  crypto::Key key = RandomKey(rng, key_len);
  auto plain = RandomBytes(rng, size);
  for (int t = 0; t < trials; ++t) {
    uint64_t off = base_offset + rng() % size;
    size_t len = rng() % (std::min<size_t>(size, 300) + 1);
    std::vector<uint8_t> a(plain.begin(), plain.begin() + len);
    auto b = a;
    ASSERT_TRUE(crypto::CtrXorAt(key, iv, off, a.data(), a.size()).ok());
    ASSERT_TRUE(CtrXorAtPortable(key.data(), key.size(), iv.data(), off, b.data(), b.size()).ok());
    ASSERT_EQ(a, b) << "key " << key_len << " off " << off << " len " << len;
  }
}

TEST(AesCoreTest, MatchesOpensslOnRandomInputs) {
  std::mt19937_64 rng(10);
  for (int i = 0; i < 20; ++i) {
    for (size_t key_len : {16, 32}) {
      CheckAgainstOpenssl(rng, key_len, RandomIv(rng), rng() >> 4, 1 << 12, 10);
    }
  }
}

TEST(AesCoreTest, CounterCarryAcross2To64) {
  std::mt19937_64 rng(11);
  crypto::Iv iv = RandomIv(rng);
  for (int i = 8; i < 16; ++i) iv[i] = 0xff;  // low 64 bits all ones
  for (size_t key_len : {16, 32}) CheckAgainstOpenssl(rng, key_len, iv, 0, 256, 100);
}

TEST(AesCoreTest, CounterWrapAt2To128) {
  std::mt19937_64 rng(12);
  crypto::Iv iv;
  iv.fill(0xff);
  iv[15] = 0xfd;
  for (size_t key_len : {16, 32}) CheckAgainstOpenssl(rng, key_len, iv, 0, 256, 100);
}

TEST(AesCoreTest, RejectsBadKeyLength) {
  uint8_t key[24] = {}, iv[16] = {}, data[4] = {};
  EXPECT_FALSE(CtrXorAtPortable(key, 24, iv, 0, data, 4).ok());
  EXPECT_FALSE(CtrXorAtWords(key, 24, iv, 0, data, 4).ok());
}

// The kernel's word rounds give the FIPS-197 answers too.
TEST(AesCoreTest, WordRoundsMatchFips197) {
  uint8_t key[32];
  for (int i = 0; i < 32; ++i) key[i] = static_cast<uint8_t>(i);
  uint32_t t0[256];
  for (unsigned x = 0; x < 256; ++x) t0[x] = AesT0Entry(kAesSbox, x);
  auto lookup = [&t0](unsigned x) { return t0[x]; };
  const uint32_t plain[4] = {0x00112233, 0x44556677, 0x8899aabb, 0xccddeeff};
  AesRoundKeys rk;
  AesWordKeys wk;
  AesExpandKey(kAesSbox, key, 16, &rk);
  AesWordKeysFrom(rk, &wk);
  uint32_t s[4] = {plain[0], plain[1], plain[2], plain[3]};
  AesEncryptWords<10>(lookup, wk, s);
  EXPECT_EQ(s[0], 0x69c4e0d8u);
  EXPECT_EQ(s[3], 0x70b4c55au);
  AesExpandKey(kAesSbox, key, 32, &rk);
  AesWordKeysFrom(rk, &wk);
  for (int i = 0; i < 4; ++i) s[i] = plain[i];
  AesEncryptWords<14>(lookup, wk, s);
  EXPECT_EQ(s[0], 0x8ea2b7cau);
  EXPECT_EQ(s[3], 0x4b496089u);
}

// The kernel's method (word rounds, 64-bit counter halves, chunks aligned in memory with the
// keystream shifted across two blocks) equals OpenSSL for every address and offset alignment,
// both key sizes, and counters that carry across 2^64 and wrap at 2^128.
TEST(AesCoreTest, KernelMethodMatchesOpensslAtEveryAlignment) {
  std::mt19937_64 rng(14);
  std::vector<crypto::Iv> ivs{RandomIv(rng), RandomIv(rng)};
  ivs[1].fill(0xff);  // low and high halves all ones: carries across 2^64 and wraps at 2^128
  ivs[1][15] = 0xfd;
  crypto::Iv carry = RandomIv(rng);
  for (int i = 8; i < 16; ++i) carry[i] = 0xff;
  ivs.push_back(carry);
  auto buffer = RandomBytes(rng, 4096 + 64);
  for (size_t key_len : {16, 32}) {
    crypto::Key key = RandomKey(rng, key_len);
    for (const crypto::Iv& iv : ivs) {
      for (unsigned misalign = 0; misalign < 16; ++misalign) {
        for (uint64_t off_mod : {0u, 1u, 7u, 8u, 15u}) {
          for (size_t len : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{33},
                             size_t(rng() % 4096)}) {
            const uint64_t off = (rng() % 64) * 16 + off_mod;
            std::vector<uint8_t> a(buffer.begin(), buffer.begin() + len);
            ASSERT_TRUE(crypto::CtrXorAt(key, iv, off, a.data(), a.size()).ok());
            // The bytes around the range must stay as they were.
            std::vector<uint8_t> b = buffer;
            uint8_t* p = b.data() + 16 - reinterpret_cast<uintptr_t>(b.data()) % 16 + misalign;
            std::copy(buffer.begin(), buffer.begin() + len, p);
            const std::vector<uint8_t> before = b;
            ASSERT_TRUE(CtrXorAtWords(key.data(), key.size(), iv.data(), off, p, len).ok());
            ASSERT_TRUE(std::equal(a.begin(), a.end(), p))
                << "key " << key_len << " misalign " << misalign << " off " << off << " len "
                << len;
            const size_t at = static_cast<size_t>(p - b.data());
            ASSERT_TRUE(std::equal(b.begin(), b.begin() + at, before.begin()));
            ASSERT_TRUE(std::equal(b.begin() + at + len, b.end(), before.begin() + at + len));
          }
        }
      }
    }
  }
}

// A large offset (block numbers past 2^32) and a long range through the kernel's method.
TEST(AesCoreTest, KernelMethodAtLargeOffsets) {
  std::mt19937_64 rng(15);
  for (size_t key_len : {16, 32}) {
    crypto::Key key = RandomKey(rng, key_len);
    crypto::Iv iv = RandomIv(rng);
    for (int i = 8; i < 16; ++i) iv[i] = 0xff;
    iv[15] = 0x00;  // the carry into the high half comes 256 blocks in
    auto plain = RandomBytes(rng, (1 << 16) + 3);
    const uint64_t off = (uint64_t{1} << 40) + 5;
    auto a = plain, b = plain;
    ASSERT_TRUE(crypto::CtrXorAt(key, iv, off, a.data(), a.size()).ok());
    ASSERT_TRUE(CtrXorAtWords(key.data(), key.size(), iv.data(), off, b.data(), b.size()).ok());
    EXPECT_EQ(a, b);
  }
}

using cuda::testing::NoCudaDeviceReason;

// On a machine with CUDA and a GPU, the kernel equals OpenSSL. It is skipped only where the
// binary has no CUDA or the machine has no device or driver; every other error fails.
TEST(AesCoreTest, GpuKernelMatchesOpensslOrSaysWhyNot) {
  std::mt19937_64 rng(13);
  crypto::Key key = RandomKey(rng, 16);
  crypto::Iv iv = RandomIv(rng);
  for (int i = 8; i < 16; ++i) iv[i] = 0xff;
  auto plain = RandomBytes(rng, (1 << 20) + 5);
  if (!AesCtrGpuBuilt()) {
    auto copy = plain;
    Status s = CtrXorViaDevice(key.data(), key.size(), iv.data(), 0, copy.data(), copy.size());
    EXPECT_EQ(s.code(), Status::Code::kNotSupported);
    EXPECT_NE(s.message().find("built without CUDA"), std::string::npos);
    EXPECT_EQ(copy, plain) << "the stub must not touch the data";
    GTEST_SKIP() << "built without CUDA";
  }
  const std::string no_device = NoCudaDeviceReason();
  if (!no_device.empty()) GTEST_SKIP() << "no CUDA device or driver: " << no_device;
  // Offsets 0 and 32 take the kernel's aligned 16-byte path, 7 and 4101 the byte path.
  for (uint64_t off : {uint64_t{0}, uint64_t{7}, uint64_t{32}, uint64_t{4101}}) {
    auto gpu = plain;
    Status s = CtrXorViaDevice(key.data(), key.size(), iv.data(), off, gpu.data(), gpu.size());
    ASSERT_TRUE(s.ok()) << "a device is present, so this is a failure, not a skip: " << s.ToString()
                        << " (offset " << off << ")";
    auto cpu = plain;
    ASSERT_TRUE(crypto::CtrXorAt(key, iv, off, cpu.data(), cpu.size()).ok());
    EXPECT_EQ(cpu, gpu) << "offset " << off;
  }
}

}  // namespace
}  // namespace cubetorchfs::cuda
