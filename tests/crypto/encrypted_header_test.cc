#include "crypto/encrypted_header.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "crypto/base64.h"

namespace cubetorchfs::crypto {
namespace {

const uint8_t* Bytes(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

// A header block with the magic and the given JSON text.
std::string Block(const std::string& json) {
  std::string out(kEncryptedHeaderSize, '\0');
  std::memcpy(out.data(), kEncryptedHeaderMagic.data(), kEncryptedHeaderMagic.size());
  std::memcpy(out.data() + 16, json.data(), json.size());
  return out;
}

const std::string kIvB64 = "AAECAwQFBgcICQoLDA0ODw==";  // bytes 0..15

TEST(Base64Test, RoundTripsAllPaddings) {
  for (const std::string& s :
       std::vector<std::string>{"", "a", "ab", "abc", "abcd", std::string("\0\xff\x10", 3)}) {
    auto d = Base64Decode(Base64Encode(s), "x");
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(*d, s);
  }
  EXPECT_EQ(Base64Encode("ab"), "YWI=");
  EXPECT_FALSE(Base64Decode("abc", "x").ok());
  EXPECT_FALSE(Base64Decode("a*c=", "x").ok());
}

TEST(EncryptedHeaderTest, RoundTrip) {
  auto h = NewEncryptedHeader(CipherMode::kCtr256, 1700000000);
  ASSERT_TRUE(h.ok());
  h->meta_data_key = "opaque";
  h->extra["ctfs_tag"] = "\"abc\"";
  auto bytes = SerializeEncryptedHeader(*h);
  ASSERT_TRUE(bytes.ok());
  ASSERT_EQ(bytes->size(), kEncryptedHeaderSize);
  EXPECT_TRUE(HasEncryptedHeaderMagic(Bytes(*bytes), bytes->size()));
  auto parsed = ParseEncryptedHeader(Bytes(*bytes), bytes->size());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->mode, CipherMode::kCtr256);
  EXPECT_EQ(parsed->iv, h->iv);
  EXPECT_EQ(parsed->meta_data_key, "opaque");
  EXPECT_EQ(parsed->file_timestamp, 1700000000);
  EXPECT_EQ(parsed->extra, h->extra);
}

TEST(EncryptedHeaderTest, FreshIvPerHeader) {
  auto a = NewEncryptedHeader(CipherMode::kCtr128, 0);
  auto b = NewEncryptedHeader(CipherMode::kCtr128, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->iv, b->iv);
}

TEST(EncryptedHeaderTest, ParsesVeturboioStyleHeader) {
  auto block = Block(R"({"mode": "CTR-128", "iv": ")" + kIvB64 +
                     R"(", "meta_data_key": "", "file_timestamp": 12, "future": [1, 2]})");
  auto h = ParseEncryptedHeader(Bytes(block), block.size());
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->mode, CipherMode::kCtr128);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(h->iv[i], i);
  EXPECT_FALSE(h->meta_data_key.has_value());  // empty means absent
  EXPECT_EQ(h->file_timestamp, 12);
  EXPECT_EQ(h->extra.at("future"), "[1,2]");
}

void ExpectBad(const std::string& block, const std::string& needle) {
  auto h = ParseEncryptedHeader(Bytes(block), block.size());
  ASSERT_FALSE(h.ok()) << needle;
  EXPECT_EQ(h.status().code(), Status::Code::kCorruption);
  EXPECT_NE(h.status().message().find(needle), std::string::npos) << h.status().message();
}

TEST(EncryptedHeaderTest, BadHeadersNameTheProblem) {
  std::string good = Block(R"({"mode":"CTR-128","iv":")" + kIvB64 + R"("})");
  ExpectBad(good.substr(0, 1000), "truncated");
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  ExpectBad(bad_magic, "magic");
  ExpectBad(Block("{not json"), "does not parse");
  ExpectBad(Block("[1]"), "not an object");
  ExpectBad(Block(R"({"iv":")" + kIvB64 + R"("})"), "'mode' is missing");
  ExpectBad(Block(R"({"mode":"CBC","iv":")" + kIvB64 + R"("})"), "'mode'");
  ExpectBad(Block(R"({"mode":"CTR-256"})"), "'iv' is missing");
  ExpectBad(Block(R"({"mode":"CTR-256","iv":"AAAA"})"), "expected 16");
  ExpectBad(Block(R"({"mode":"CTR-256","iv":"!!!!"})"), "'iv'");
  ExpectBad(Block(R"({"mode":"CTR-256","iv":")" + kIvB64 + R"(","file_timestamp":"x"})"),
            "file_timestamp");
  std::string trailing = good;
  trailing[kEncryptedHeaderSize - 1] = 'x';
  ExpectBad(trailing, "zero padding");
}

TEST(EncryptedHeaderTest, SerializeRejectsBadExtras) {
  EncryptedHeader h;
  h.extra["mode"] = "\"x\"";
  EXPECT_FALSE(SerializeEncryptedHeader(h).ok());
  h.extra.clear();
  h.extra["x"] = "{bad";
  EXPECT_FALSE(SerializeEncryptedHeader(h).ok());
  h.extra.clear();
  h.extra["big"] = "\"" + std::string(kEncryptedHeaderSize, 'a') + "\"";
  EXPECT_FALSE(SerializeEncryptedHeader(h).ok());
}

}  // namespace
}  // namespace cubetorchfs::crypto
