#include "crypto/integrity.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "tests/crypto/test_helpers.h"

namespace cubetorchfs::crypto {
namespace {

using testing::RandomBytes;
using testing::RandomIv;
using testing::RandomKey;

IntegrityParams Params(const Iv& iv, size_t size, uint64_t chunk) {
  IntegrityParams p;
  p.iv = iv;
  p.payload_size = size;
  p.chunk_size = chunk;
  return p;
}

TEST(IntegrityTest, ParallelEqualsSerialAndChunkwise) {
  std::mt19937_64 rng(20);
  Key key = RandomKey(rng, 16);
  Iv iv = RandomIv(rng);
  auto data = RandomBytes(rng, 100000);
  auto p = Params(iv, data.size(), 4096);
  auto serial = ComputeIntegrityTag(key, p, data.data(), data.size(), 1);
  ASSERT_TRUE(serial.ok()) << serial.status().ToString();
  for (int threads : {2, 3, 8, 64}) {
    auto par = ComputeIntegrityTag(key, p, data.data(), data.size(), threads);
    ASSERT_TRUE(par.ok());
    EXPECT_EQ(*par, *serial) << threads;
  }
  // A reader computing each chunk's tag on its own gets the same file tag.
  auto mac_key = IntegrityKey::Derive(key, iv);
  ASSERT_TRUE(mac_key.ok());
  std::vector<ChunkTagValue> tags;
  for (uint64_t i = 0; i < IntegrityChunkCount(p); ++i) {
    const size_t begin = i * 4096, len = std::min<size_t>(4096, data.size() - begin);
    auto t = ChunkTag(*mac_key, p, i, data.data() + begin, len);
    ASSERT_TRUE(t.ok());
    tags.push_back(*t);
  }
  auto combined = CombineChunkTags(*mac_key, p, tags);
  ASSERT_TRUE(combined.ok());
  EXPECT_EQ(*combined, *serial);
  EXPECT_TRUE(VerifyIntegrity(key, p, data.data(), data.size(), *serial, 4).ok());
  // Fed in uneven pieces, a chunk's tag is the same; fed short or long, it is refused.
  ChunkMac mac;
  ASSERT_TRUE(mac.Begin(*mac_key, p, 3).ok());
  for (size_t at = 3 * 4096; at < 4 * 4096; at += 1000)
    ASSERT_TRUE(mac.Update(data.data() + at, std::min<size_t>(1000, 4 * 4096 - at)).ok());
  auto pieces = mac.Finish();
  ASSERT_TRUE(pieces.ok());
  EXPECT_EQ(*pieces, tags[3]);
  ASSERT_TRUE(mac.Begin(*mac_key, p, 3).ok());
  ASSERT_TRUE(mac.Update(data.data(), 4095).ok());
  EXPECT_EQ(mac.Finish().status().code(), Status::Code::kInvalidArgument);
  // The MAC key is per file: the same key and bytes under another IV give other chunk tags
  // (so GMAC nonces, the chunk indexes, never repeat under one MAC key).
  auto other_key = IntegrityKey::Derive(key, RandomIv(rng));
  ASSERT_TRUE(other_key.ok());
  EXPECT_NE(*ChunkTag(*other_key, p, 0, data.data(), 4096), tags[0]);
}

TEST(IntegrityTest, DetectsTampering) {
  std::mt19937_64 rng(21);
  Key key = RandomKey(rng, 32);
  Iv iv = RandomIv(rng);
  auto data = RandomBytes(rng, 50000);
  auto p = Params(iv, data.size(), 1000);
  auto tag = ComputeIntegrityTag(key, p, data.data(), data.size(), 3);
  ASSERT_TRUE(tag.ok());
  for (int trial = 0; trial < 20; ++trial) {
    auto bad = data;
    bad[rng() % bad.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    Status s = VerifyIntegrity(key, p, bad.data(), bad.size(), *tag, 3);
    ASSERT_EQ(s.code(), Status::Code::kCorruption);
    EXPECT_NE(s.message().find("integrity check failed"), std::string::npos);
  }
  // Truncated, with the size it now has.
  auto p_short = Params(iv, data.size() - 1, 1000);
  EXPECT_FALSE(VerifyIntegrity(key, p_short, data.data(), data.size() - 1, *tag, 3).ok());
  // Another key, IV or chunk size.
  EXPECT_FALSE(VerifyIntegrity(RandomKey(rng, 32), p, data.data(), data.size(), *tag, 3).ok());
  EXPECT_FALSE(VerifyIntegrity(key, Params(RandomIv(rng), data.size(), 1000), data.data(),
                               data.size(), *tag, 3)
                   .ok());
  EXPECT_FALSE(
      VerifyIntegrity(key, Params(iv, data.size(), 2000), data.data(), data.size(), *tag, 3).ok());
  // Two chunks swapped.
  auto swapped = data;
  std::swap_ranges(swapped.begin(), swapped.begin() + 1000, swapped.begin() + 1000);
  EXPECT_FALSE(VerifyIntegrity(key, p, swapped.data(), swapped.size(), *tag, 3).ok());
}

TEST(IntegrityTest, EmptyPayloadAndBadArguments) {
  std::mt19937_64 rng(22);
  Key key = RandomKey(rng, 16);
  Iv iv = RandomIv(rng);
  auto empty = ComputeIntegrityTag(key, Params(iv, 0, 4096), nullptr, 0, 4);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(VerifyIntegrity(key, Params(iv, 0, 4096), nullptr, 0, *empty, 1).ok());
  uint8_t b[4] = {};
  EXPECT_FALSE(ComputeIntegrityTag(key, Params(iv, 4, 0), b, 4, 1).ok());
  EXPECT_FALSE(ComputeIntegrityTag(key, Params(iv, 5, 16), b, 4, 1).ok());
  EXPECT_FALSE(ComputeIntegrityTag(Key(), Params(iv, 4, 16), b, 4, 1).ok());
}

TEST(IntegrityTest, HeaderFieldRoundTrip) {
  auto h = NewEncryptedHeader(CipherMode::kCtr128, 5);
  ASSERT_TRUE(h.ok());
  auto none = GetIntegrityField(*h);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  IntegrityField f;
  f.chunk_size = 1 << 20;
  for (size_t i = 0; i < kTagSize; ++i) f.tag[i] = static_cast<uint8_t>(i * 7);
  SetIntegrityField(&*h, f);
  auto bytes = SerializeEncryptedHeader(*h);
  ASSERT_TRUE(bytes.ok());
  auto parsed =
      ParseEncryptedHeader(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size());
  ASSERT_TRUE(parsed.ok());
  auto got = GetIntegrityField(*parsed);
  ASSERT_TRUE(got.ok());
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->chunk_size, f.chunk_size);
  EXPECT_EQ((*got)->tag, f.tag);

  EncryptedHeader bad;
  bad.extra[std::string(kIntegrityField)] = R"({"alg":"MD5","chunk_size":1,"tag":""})";
  EXPECT_EQ(GetIntegrityField(bad).status().code(), Status::Code::kCorruption);
  // The first format, HMAC over whole chunks, is no longer read: a clear error names it.
  bad.extra[std::string(kIntegrityField)] =
      R"({"alg":"HMAC-SHA256-chunked-v1","chunk_size":4,"tag":"AAAA"})";
  EXPECT_EQ(GetIntegrityField(bad).status().code(), Status::Code::kCorruption);
  bad.extra[std::string(kIntegrityField)] =
      R"({"alg":"GMAC-AES256-chunked-v2","chunk_size":0,"tag":""})";
  EXPECT_FALSE(GetIntegrityField(bad).ok());
  bad.extra[std::string(kIntegrityField)] =
      R"({"alg":"GMAC-AES256-chunked-v2","chunk_size":4,"tag":"AAAA"})";
  EXPECT_FALSE(GetIntegrityField(bad).ok());
}

}  // namespace
}  // namespace cubetorchfs::crypto
