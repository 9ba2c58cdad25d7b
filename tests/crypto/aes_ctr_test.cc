#include "crypto/aes_ctr.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tests/crypto/test_helpers.h"

namespace cubetorchfs::crypto {
namespace {

using testing::Hex;
using testing::RandomBytes;
using testing::RandomIv;
using testing::RandomKey;

// OpenSSL one-shot CTR from offset 0 (the reference).
std::vector<uint8_t> OneShot(const Key& key, const Iv& iv, std::vector<uint8_t> data) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  EXPECT_EQ(1, EVP_EncryptInit_ex(ctx, key.size() == 16 ? EVP_aes_128_ctr() : EVP_aes_256_ctr(),
                                  nullptr, key.data(), iv.data()));
  int n = 0;
  EXPECT_EQ(1, EVP_EncryptUpdate(ctx, data.data(), &n, data.data(), static_cast<int>(data.size())));
  EVP_CIPHER_CTX_free(ctx);
  return data;
}

TEST(AesCtrTest, KeyRejectsBadLengths) {
  uint8_t bytes[32] = {};
  EXPECT_FALSE(Key::FromBytes(bytes, 0).ok());
  EXPECT_FALSE(Key::FromBytes(bytes, 24).ok());
  EXPECT_TRUE(Key::FromBytes(bytes, 16).ok());
  EXPECT_TRUE(Key::FromBytes(bytes, 32).ok());
  uint8_t data[4] = {};
  EXPECT_EQ(CtrXorAt(Key(), Iv{}, 0, data, 4).code(), Status::Code::kInvalidArgument);
}

TEST(AesCtrTest, CounterCarriesAcrossAllBytes) {
  Iv iv{};
  for (int i = 8; i < 16; ++i) iv[i] = 0xff;
  Iv c = CounterAt(iv, 1);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(c[i], 0);
  EXPECT_EQ(c[7], 1);
  for (int i = 8; i < 16; ++i) EXPECT_EQ(c[i], 0);
  Iv all_ff;
  all_ff.fill(0xff);
  EXPECT_EQ(CounterAt(all_ff, 1), Iv{});  // wraps at 2^128
  Iv three = CounterAt(all_ff, 4);
  EXPECT_EQ(three[15], 3);
}

TEST(AesCtrTest, OffsetZeroEqualsOneShot) {
  std::mt19937_64 rng(1);
  for (size_t key_len : {16, 32}) {
    Key key = RandomKey(rng, key_len);
    Iv iv = RandomIv(rng);
    auto plain = RandomBytes(rng, 4099);
    auto data = plain;
    ASSERT_TRUE(CtrXorAt(key, iv, 0, data.data(), data.size()).ok());
    EXPECT_EQ(data, OneShot(key, iv, plain));
    ASSERT_TRUE(CtrXorAt(key, iv, 0, data.data(), data.size()).ok());
    EXPECT_EQ(data, plain);  // CTR is its own inverse
  }
}

TEST(AesCtrTest, RandomRangesDecryptIndependently) {
  std::mt19937_64 rng(2);
  for (size_t key_len : {16, 32}) {
    for (int carry_case = 0; carry_case < 3; ++carry_case) {
      Key key = RandomKey(rng, key_len);
      Iv iv = RandomIv(rng);
      if (carry_case == 1) {  // low 64 bits about to carry into the high 64
        for (int i = 8; i < 16; ++i) iv[i] = 0xff;
        iv[15] = 0xf0;
      } else if (carry_case == 2) {  // about to wrap at 2^128
        iv.fill(0xff);
        iv[15] = 0xf8;
      }
      auto plain = RandomBytes(rng, 1 << 14);
      auto cipher = OneShot(key, iv, plain);
      for (int trial = 0; trial < 200; ++trial) {
        size_t off = rng() % plain.size();
        size_t len = rng() % (plain.size() - off + 1);
        std::vector<uint8_t> piece(cipher.begin() + off, cipher.begin() + off + len);
        ASSERT_TRUE(CtrXorAt(key, iv, off, piece.data(), piece.size()).ok());
        ASSERT_TRUE(std::equal(piece.begin(), piece.end(), plain.begin() + off))
            << "key " << key_len << " case " << carry_case << " off " << off << " len " << len;
      }
    }
  }
}

TEST(AesCtrTest, ParallelEqualsSerial) {
  std::mt19937_64 rng(3);
  Key key = RandomKey(rng, 32);
  Iv iv = RandomIv(rng);
  auto plain = RandomBytes(rng, (3 << 20) + 77);
  for (uint64_t off : {uint64_t{0}, uint64_t{5}, uint64_t{16}, uint64_t{1} << 40 | 13}) {
    for (int threads : {1, 2, 3, 7, 100}) {
      auto serial = plain;
      auto parallel = plain;
      ASSERT_TRUE(CtrXorAt(key, iv, off, serial.data(), serial.size()).ok());
      ASSERT_TRUE(CtrXorParallel(key, iv, off, parallel.data(), parallel.size(), threads).ok());
      ASSERT_EQ(serial, parallel) << "off " << off << " threads " << threads;
    }
  }
}

// Ciphertext from the openssl command-line tool equals ours, at every offset.
TEST(AesCtrTest, MatchesOpensslCli) {
  if (std::system("openssl version >/dev/null 2>&1") != 0) GTEST_SKIP() << "no openssl CLI";
  std::mt19937_64 rng(4);
  for (size_t key_len : {16, 32}) {
    Key key = RandomKey(rng, key_len);
    Iv iv = RandomIv(rng);
    auto plain = RandomBytes(rng, 10000);
    const std::string path = ::testing::TempDir() + "/ctfs_crypto_plain_" +
                             std::to_string(::getpid()) + "_" + std::to_string(key_len);
    {
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(plain.data()), plain.size());
    }
    const std::string cmd = std::string("openssl enc -aes-") + (key_len == 16 ? "128" : "256") +
                            "-ctr -K " + Hex(key.data(), key.size()) + " -iv " +
                            Hex(iv.data(), iv.size()) + " -nosalt -in " + path;
    FILE* p = ::popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::vector<uint8_t> cli(plain.size() + 64);
    size_t n = std::fread(cli.data(), 1, cli.size(), p);
    ASSERT_EQ(::pclose(p), 0);
    std::remove(path.c_str());
    cli.resize(n);
    ASSERT_EQ(cli.size(), plain.size());
    auto ours = plain;
    ASSERT_TRUE(CtrXorAt(key, iv, 0, ours.data(), ours.size()).ok());
    EXPECT_EQ(ours, cli);
    for (uint64_t off : {1, 15, 16, 17, 4097}) {
      std::vector<uint8_t> piece(cli.begin() + off, cli.end());
      ASSERT_TRUE(CtrXorAt(key, iv, off, piece.data(), piece.size()).ok());
      EXPECT_TRUE(std::equal(piece.begin(), piece.end(), plain.begin() + off)) << off;
    }
  }
}

}  // namespace
}  // namespace cubetorchfs::crypto
