#include "loader/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace cubetorchfs::loader {
namespace {

// A whole file: 8-byte LE length of `header`, the header, then `data_bytes` bytes of data.
std::string MakeFile(const std::string& header, uint64_t data_bytes) {
  std::string f;
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  f += header;
  f.append(data_bytes, '\x5a');
  return f;
}

std::string LengthPrefix(uint64_t n) {
  std::string f;
  for (int i = 0; i < 8; ++i) f.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return f;
}

std::string Entry(const std::string& dtype, const std::string& shape, uint64_t begin,
                  uint64_t end) {
  return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":[)" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

Result<Header> Parse(const std::string& file) {
  return ParseSafetensorsHeader(reinterpret_cast<const uint8_t*>(file.data()), file.size(),
                                file.size());
}

// Parses `header` followed by `data_bytes` bytes and expects a Corruption naming `rule` (and
// `tensor` when given).
void ExpectRule(const std::string& header, uint64_t data_bytes, const char* rule,
                const std::string& tensor = "") {
  SCOPED_TRACE(header);
  Result<Header> h = Parse(MakeFile(header, data_bytes));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Status::Code::kCorruption) << h.status().ToString();
  EXPECT_NE(h.status().message().find(std::string("rule ") + rule), std::string::npos)
      << h.status().message();
  if (!tensor.empty()) {
    EXPECT_NE(h.status().message().find("'" + tensor + "'"), std::string::npos)
        << h.status().message();
  }
}

TEST(SafetensorsTest, ValidFileByHand) {
  const std::string header = R"({"b":)" + Entry("F32", "[2,3]", 8, 32) +
                             R"(,"__metadata__":{"format":"pt","x":"y"},"a":)" +
                             Entry("I64", "[1]", 0, 8) + "}";
  const std::string file = MakeFile(header, 32);
  Result<Header> h = Parse(file);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->header_len, header.size());
  EXPECT_EQ(h->data_offset, 8 + header.size());
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->tensors[0].dtype, Dtype::kI64);
  EXPECT_EQ(h->tensors[0].shape, std::vector<uint64_t>({1}));
  EXPECT_EQ(h->tensors[0].begin, 0u);
  EXPECT_EQ(h->tensors[0].end, 8u);
  EXPECT_EQ(h->tensors[1].name, "b");
  EXPECT_EQ(h->tensors[1].dtype, Dtype::kF32);
  EXPECT_EQ(h->tensors[1].shape, std::vector<uint64_t>({2, 3}));
  EXPECT_EQ(h->tensors[1].begin, 8u);
  EXPECT_EQ(h->tensors[1].end, 32u);
  EXPECT_EQ(h->tensors[1].num_bytes(), 24u);
  EXPECT_EQ(h->metadata.size(), 2u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
}

TEST(SafetensorsTest, TwoStepApi) {
  const std::string header = R"({"t":)" + Entry("U8", "[4]", 0, 4) + "}";
  const std::string file = MakeFile(header, 4);
  const auto* p = reinterpret_cast<const uint8_t*>(file.data());
  Result<uint64_t> n = HeaderLength(p, 8, file.size());
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, header.size());
  Result<Header> h = ParseHeaderJson(p + 8, *n, file.size());
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->tensors.size(), 1u);
}

TEST(SafetensorsTest, ShortPrefixSaysHowManyBytesAreNeeded) {
  const std::string header = R"({"t":)" + Entry("U8", "[4]", 0, 4) + "}";
  const std::string file = MakeFile(header, 4);
  Result<Header> h =
      ParseSafetensorsHeader(reinterpret_cast<const uint8_t*>(file.data()), 10, file.size());
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(h.status().message().find("need " + std::to_string(8 + header.size()) + " bytes"),
            std::string::npos)
      << h.status().message();
}

TEST(SafetensorsTest, NoTensorsMeansEmptyDataSection) {
  Result<Header> h = Parse(MakeFile("{}", 0));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_TRUE(h->tensors.empty());
  h = Parse(MakeFile(R"({"__metadata__":{}})", 0));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ExpectRule("{}", 1, kRuleDataEndsAtEof);
}

TEST(SafetensorsTest, Metadata) {
  Result<Header> h =
      Parse(MakeFile(R"({"__metadata__":{"k":"v","unicode":"\u00e9\u4e2d","empty":""},"t":)" +
                         Entry("BOOL", "[2]", 0, 2) + "}",
                     2));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->metadata.at("k"), "v");
  EXPECT_EQ(h->metadata.at("unicode"), "\xc3\xa9\xe4\xb8\xad");
  EXPECT_EQ(h->metadata.at("empty"), "");
  EXPECT_EQ(h->tensors.size(), 1u);
}

TEST(SafetensorsTest, WhitespacePadding) {
  const std::string body = R"({"t":)" + Entry("F16", "[2]", 0, 4) + "}";
  for (const std::string& header :
       {"  \n\t" + body, body + "        ", "\r\n " + body + " \n  ", body + std::string(7, ' ')}) {
    Result<Header> h = Parse(MakeFile(header, 4));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(h->data_offset, 8 + header.size());
  }
}

TEST(SafetensorsTest, AllDtypesParse) {
  for (int i = 0; i < kNumDtypes; ++i) {
    const Dtype d = static_cast<Dtype>(i);
    SCOPED_TRACE(DtypeName(d));
    Result<Dtype> back = ParseDtype(DtypeName(d));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, d);
    const uint64_t bytes = 8 * DtypeBits(d) / 8;  // 8 elements: whole bytes for every dtype
    Result<Header> h =
        Parse(MakeFile(R"({"t":)" + Entry(DtypeName(d), "[2,4]", 0, bytes) + "}", bytes));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(h->tensors[0].dtype, d);
    EXPECT_EQ(h->tensors[0].num_bytes(), bytes);
  }
  EXPECT_EQ(DtypeBits(Dtype::kF4), 4u);
  EXPECT_EQ(DtypeBits(Dtype::kF6_E2M3), 6u);
  EXPECT_EQ(DtypeBits(Dtype::kC64), 64u);
  EXPECT_EQ(DtypeBits(Dtype::kBool), 8u);
  EXPECT_FALSE(ParseDtype("f32").ok());
  EXPECT_FALSE(ParseDtype("").ok());
  EXPECT_FALSE(ParseDtype("C128").ok());
}

TEST(SafetensorsTest, ZeroDimAndEmptyTensors) {
  // A scalar (shape []) holds one element; shapes with a 0 hold none and may share an offset.
  const std::string header =
      R"({"scalar":)" + Entry("F64", "[]", 0, 8) + R"(,"e1":)" + Entry("F32", "[0]", 8, 8) +
      R"(,"e2":)" + Entry("I32", "[3,0,5]", 8, 8) + R"(,"last":)" + Entry("U16", "[1]", 8, 10) +
      R"(,"e3":)" + Entry("F4", "[0]", 10, 10) + "}";
  Result<Header> h = Parse(MakeFile(header, 10));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 5u);
  EXPECT_EQ(h->tensors[0].name, "scalar");
  EXPECT_TRUE(h->tensors[0].shape.empty());
  EXPECT_EQ(h->tensors[1].name, "e1");
  EXPECT_EQ(h->tensors[2].name, "e2");
  EXPECT_EQ(h->tensors[3].name, "last");
  EXPECT_EQ(h->tensors[4].name, "e3");
  EXPECT_EQ(h->tensors[4].num_bytes(), 0u);
}

TEST(SafetensorsTest, FiveHundredTensorsInAnyJsonOrder) {
  std::vector<int> order(500);
  for (int i = 0; i < 500; ++i) order[i] = i;
  std::mt19937 rng(42);
  std::shuffle(order.begin(), order.end(), rng);
  std::string header = "{";
  for (int i : order) {
    if (header.size() > 1) header += ",";
    // Tensor i has i+1 F32 elements; its offset is the sum of the earlier sizes.
    const uint64_t begin = 4ull * i * (i + 1) / 2;
    header += "\"layer." + std::to_string(i) + ".weight\":" +
              Entry("F32", "[" + std::to_string(i + 1) + "]", begin, begin + 4ull * (i + 1));
  }
  header += "}";
  const uint64_t total = 4ull * 500 * 501 / 2;
  Result<Header> h = Parse(MakeFile(header, total));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 500u);
  for (int i = 0; i < 500; ++i) {
    EXPECT_EQ(h->tensors[i].name, "layer." + std::to_string(i) + ".weight");
    EXPECT_EQ(h->tensors[i].shape[0], static_cast<uint64_t>(i + 1));
  }
  EXPECT_EQ(h->tensors.back().end, total);
}

// ---- One crafted file per rule ----

TEST(SafetensorsRuleTest, LengthPrefix) {
  const std::string tiny = "abc";
  Result<Header> h = Parse(tiny);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find(std::string("rule ") + kRuleLengthPrefix), std::string::npos);
  EXPECT_FALSE(Parse("").ok());
  // Fewer than 8 bytes given of a longer file: the caller must read more, not a corrupt file.
  const std::string file = MakeFile("{}", 0);
  h = ParseSafetensorsHeader(reinterpret_cast<const uint8_t*>(file.data()), 4, file.size());
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(h.status().message().find("need 8 bytes"), std::string::npos);
}

TEST(SafetensorsRuleTest, HeaderSizeLimitAndHugeN) {
  for (uint64_t n : {kMaxHeaderBytes + 1, uint64_t{1} << 40, ~uint64_t{0}}) {
    const std::string prefix = LengthPrefix(n);
    // Claim a file big enough that only the limit is broken.
    Result<uint64_t> len =
        HeaderLength(reinterpret_cast<const uint8_t*>(prefix.data()), 8, ~uint64_t{0});
    ASSERT_FALSE(len.ok());
    EXPECT_EQ(len.status().code(), Status::Code::kCorruption);
    EXPECT_NE(len.status().message().find(std::string("rule ") + kRuleHeaderLimit),
              std::string::npos)
        << len.status().message();
    Result<Header> h = Parse(prefix + "{}");
    ASSERT_FALSE(h.ok());
    EXPECT_NE(h.status().message().find(kRuleHeaderLimit), std::string::npos);
  }
  // Exactly the limit is allowed by the length check (the file must then be that big).
  const std::string prefix = LengthPrefix(kMaxHeaderBytes);
  EXPECT_TRUE(
      HeaderLength(reinterpret_cast<const uint8_t*>(prefix.data()), 8, 8 + kMaxHeaderBytes).ok());
}

TEST(SafetensorsRuleTest, HeaderWithinFile) {
  std::string file = LengthPrefix(100) + "{}";
  Result<Header> h = Parse(file);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find(std::string("rule ") + kRuleHeaderInFile), std::string::npos)
      << h.status().message();
  // The JSON step checks it too.
  h = ParseHeaderJson(reinterpret_cast<const uint8_t*>("{}"), 2, 9);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find(kRuleHeaderInFile), std::string::npos);
}

TEST(SafetensorsRuleTest, HeaderIsUtf8Json) {
  ExpectRule("", 0, kRuleUtf8Json);
  ExpectRule("{", 0, kRuleUtf8Json);
  ExpectRule(R"({"a":)", 0, kRuleUtf8Json);
  ExpectRule("{} x", 0, kRuleUtf8Json);                    // trailing garbage
  ExpectRule(std::string("{}\0\0", 4), 0, kRuleUtf8Json);  // NUL padding is not whitespace
  // Regression: nlohmann's lexer stops at a NUL, so "{}\0<garbage>" used to parse as "{}".
  ExpectRule(std::string("{}\0xyz\xff", 7), 0, kRuleUtf8Json);
  ExpectRule(std::string("{\"a\":\0}", 7), 0, kRuleUtf8Json);
  ExpectRule("{/*c*/}", 0, kRuleUtf8Json);         // no comments
  ExpectRule("\xEF\xBB\xBF{}", 0, kRuleUtf8Json);  // no byte-order mark
  // Invalid UTF-8: a lone continuation byte, an overlong encoding, a truncated sequence,
  // a UTF-16 surrogate encoded in UTF-8, in names and in metadata values.
  for (const std::string& bad :
       std::initializer_list<std::string>{"\x80", "\xC0\xAF", "\xE4\xB8", "\xED\xA0\x80", "\xFF"}) {
    ExpectRule("{\"" + bad + "\":" + Entry("U8", "[0]", 0, 0) + "}", 0, kRuleUtf8Json);
    ExpectRule(R"({"__metadata__":{"k":")" + bad + "\"}}", 0, kRuleUtf8Json);
  }
  std::string with_nul = std::string("{\"a\0b\":1}", 10);
  ExpectRule(with_nul, 0, kRuleUtf8Json);  // control characters must be escaped
}

TEST(SafetensorsRuleTest, HeaderIsJsonObject) {
  ExpectRule("[]", 0, kRuleJsonObject);
  ExpectRule("1", 0, kRuleJsonObject);
  ExpectRule("\"s\"", 0, kRuleJsonObject);
  ExpectRule("null", 0, kRuleJsonObject);
}

TEST(SafetensorsRuleTest, UniqueNames) {
  ExpectRule(R"({"w":)" + Entry("U8", "[1]", 0, 1) + R"(,"w":)" + Entry("U8", "[1]", 1, 2) + "}", 2,
             kRuleUniqueKeys, "w");
  ExpectRule(R"({"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1,
             kRuleUniqueKeys, "w");
  ExpectRule(R"({"__metadata__":{"k":"a","k":"b"}})", 0, kRuleUniqueKeys);
}

TEST(SafetensorsRuleTest, EntryKeys) {
  ExpectRule(R"({"w":5})", 0, kRuleEntryKeys, "w");
  ExpectRule(R"({"w":[]})", 0, kRuleEntryKeys, "w");
  ExpectRule(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", 1, kRuleEntryKeys, "w");
  ExpectRule(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", 1, kRuleEntryKeys, "w");
  ExpectRule(R"({"w":{"dtype":"U8","shape":[1]}})", 1, kRuleEntryKeys, "w");
  ExpectRule(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", 1,
             kRuleEntryKeys, "w");
}

TEST(SafetensorsRuleTest, KnownDtype) {
  ExpectRule(R"({"w":)" + Entry("F128", "[1]", 0, 16) + "}", 16, kRuleKnownDtype, "w");
  ExpectRule(R"({"w":)" + Entry("f32", "[1]", 0, 4) + "}", 4, kRuleKnownDtype, "w");
  ExpectRule(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", 1, kRuleKnownDtype, "w");
  ExpectRule(R"({"w":{"dtype":null,"shape":[1],"data_offsets":[0,1]}})", 1, kRuleKnownDtype, "w");
}

TEST(SafetensorsRuleTest, ShapeIntegers) {
  for (const char* shape : {"[-1]", "[1.5]", "[1e3]", "[\"2\"]", "[null]", "3", "{}", "[[1]]",
                            "[18446744073709551616]"}) {
    ExpectRule(R"({"w":{"dtype":"U8","shape":)" + std::string(shape) + R"(,"data_offsets":[0,1]}})",
               1, kRuleShape, "w");
  }
}

TEST(SafetensorsRuleTest, DataOffsets) {
  for (const char* offsets : {"[0]", "[0,1,2]", "[-1,0]", "[0,\"1\"]", "[0,1.0]", "{}", "1", "null",
                              "[]", "[0,18446744073709551616]"}) {
    ExpectRule(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":)" + std::string(offsets) + "}}", 1,
               kRuleDataOffsets, "w");
  }
  ExpectRule(R"({"w":)" + Entry("U8", "[0]", 5, 3) + "}", 0, kRuleDataOffsets, "w");  // begin>end
}

TEST(SafetensorsRuleTest, MetadataStrings) {
  ExpectRule(R"({"__metadata__":{"k":1}})", 0, kRuleMetadata);
  ExpectRule(R"({"__metadata__":{"k":null}})", 0, kRuleMetadata);
  ExpectRule(R"({"__metadata__":{"k":{"a":"b"}}})", 0, kRuleMetadata);
  ExpectRule(R"({"__metadata__":[]})", 0, kRuleMetadata);
  ExpectRule(R"({"__metadata__":"x"})", 0, kRuleMetadata);
  // null reads as "no metadata", as in the reference implementation.
  EXPECT_TRUE(Parse(MakeFile(R"({"__metadata__":null})", 0)).ok());
}

TEST(SafetensorsRuleTest, FirstTensorBeginsAtZero) {
  ExpectRule(R"({"w":)" + Entry("U8", "[4]", 4, 8) + "}", 8, kRuleFirstOffset, "w");
}

TEST(SafetensorsRuleTest, NoGapsNoOverlaps) {
  // A gap between a (ends at 4) and b (begins at 6).
  ExpectRule(R"({"a":)" + Entry("U8", "[4]", 0, 4) + R"(,"b":)" + Entry("U8", "[4]", 6, 10) + "}",
             10, kRuleContiguous, "b");
  // b overlaps a.
  ExpectRule(R"({"a":)" + Entry("U8", "[4]", 0, 4) + R"(,"b":)" + Entry("U8", "[4]", 2, 6) + "}", 6,
             kRuleContiguous, "b");
  // Two tensors over the same bytes.
  ExpectRule(R"({"a":)" + Entry("U8", "[4]", 0, 4) + R"(,"b":)" + Entry("U8", "[4]", 0, 4) + "}", 4,
             kRuleContiguous);
}

TEST(SafetensorsRuleTest, SizeMatchesShape) {
  ExpectRule(R"({"w":)" + Entry("F32", "[2]", 0, 4) + "}", 4, kRuleSizeMatches, "w");
  ExpectRule(R"({"w":)" + Entry("F32", "[2]", 0, 12) + "}", 12, kRuleSizeMatches, "w");
  ExpectRule(R"({"w":)" + Entry("F32", "[]", 0, 0) + "}", 0, kRuleSizeMatches, "w");  // scalar
  ExpectRule(R"({"w":)" + Entry("F32", "[0]", 0, 4) + "}", 4, kRuleSizeMatches, "w");
  ExpectRule(R"({"w":)" + Entry("F4", "[4]", 0, 4) + "}", 4, kRuleSizeMatches, "w");  // 2 bytes
}

TEST(SafetensorsRuleTest, SubByteSizesAreWholeBytes) {
  ExpectRule(R"({"w":)" + Entry("F4", "[3]", 0, 2) + "}", 2, kRuleByteAligned, "w");
  ExpectRule(R"({"w":)" + Entry("F6_E3M2", "[2]", 0, 2) + "}", 2, kRuleByteAligned, "w");
  // 4 F6 values are 24 bits = 3 bytes.
  EXPECT_TRUE(Parse(MakeFile(R"({"w":)" + Entry("F6_E2M3", "[4]", 0, 3) + "}", 3)).ok());
}

TEST(SafetensorsRuleTest, ShapeProductOverflow) {
  // 2^32 * 2^32 elements overflow 64 bits; 2^62 F32 elements overflow when counted in bits.
  ExpectRule(R"({"w":)" + Entry("U8", "[4294967296,4294967296]", 0, 0) + "}", 0, kRuleSizeOverflow,
             "w");
  ExpectRule(R"({"w":)" + Entry("F32", "[4611686018427387904]", 0, 0) + "}", 0, kRuleSizeOverflow,
             "w");
  ExpectRule(R"({"w":)" + Entry("U8", "[18446744073709551615,2]", 0, 0) + "}", 0, kRuleSizeOverflow,
             "w");
  // The product is checked left to right, so [2^63, 2, 0] overflows before reaching the 0:
  // an error, as in the reference implementation (checked_mul over the dimensions).
  ExpectRule(R"({"w":)" + Entry("U8", "[9223372036854775808,2,0]", 0, 0) + "}", 0,
             kRuleSizeOverflow, "w");
}

TEST(SafetensorsRuleTest, DataEndsAtEndOfFile) {
  ExpectRule(R"({"w":)" + Entry("U8", "[4]", 0, 4) + "}", 5, kRuleDataEndsAtEof, "w");
  ExpectRule(R"({"w":)" + Entry("U8", "[4]", 0, 4) + "}", 3, kRuleDataEndsAtEof, "w");
  // Offsets far past the end of the file, with a matching huge shape.
  ExpectRule(R"({"w":)" + Entry("U8", "[1099511627776]", 0, 1099511627776) + "}", 0,
             kRuleDataEndsAtEof, "w");
}

TEST(SafetensorsRuleTest, LongNamesAreCutInMessages) {
  const std::string name(5000, 'n');
  Result<Header> h = Parse(MakeFile("{\"" + name + "\":" + Entry("Q", "[1]", 0, 1) + "}", 1));
  ASSERT_FALSE(h.ok());
  EXPECT_LT(h.status().message().size(), 500u);
}

}  // namespace
}  // namespace cubetorchfs::loader
