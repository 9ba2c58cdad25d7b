// The s3 backend's protocol logic, without a server: keys and URLs, the ListObjectsV2 reply,
// dates, versions, errors and backoff. The requests themselves are covered by
// tests/integration/test_s3.py against a real S3 server.

#include <gtest/gtest.h>

#include "cfs_client/backend.h"
#include "cfs_client/s3_protocol.h"

namespace cubetorchfs::cfs_client::s3 {
namespace {

TEST(S3KeysTest, PathsMapOntoKeysUnderThePrefix) {
  EXPECT_EQ(ObjectKey("", "a/b.jpg"), "a/b.jpg");
  EXPECT_EQ(ObjectKey("data/train", "a/b.jpg"), "data/train/a/b.jpg");
  EXPECT_EQ(ObjectKey("data", ""), "data");
  EXPECT_EQ(DirKeyPrefix("", ""), "");
  EXPECT_EQ(DirKeyPrefix("", "a"), "a/");
  EXPECT_EQ(DirKeyPrefix("data", ""), "data/");
  EXPECT_EQ(DirKeyPrefix("data", "a/b"), "data/a/b/");
}

TEST(S3KeysTest, EntryNamesComeFromKeysAndCommonPrefixes) {
  EXPECT_EQ(EntryName("", "x.jpg"), "x.jpg");
  EXPECT_EQ(EntryName("d/", "d/x.jpg"), "x.jpg");
  EXPECT_EQ(EntryName("d/", "d/sub/"), "sub");  // a common prefix
  EXPECT_EQ(EntryName("d/", "d/"), "");         // the directory's own marker
  EXPECT_EQ(EntryName("d/", "d//"), "");        // an empty segment: "d//x"
  EXPECT_EQ(EntryName("d/", "d/../"), "");      // not representable as a name
  EXPECT_EQ(EntryName("d/", "d/."), "");
  EXPECT_EQ(EntryName("d/", "e/x"), "");       // outside the directory
  EXPECT_EQ(EntryName("", "a b/€.txt/"), "");  // a slash inside the name
  EXPECT_EQ(EntryName("", "a b€/"), "a b€");
}

TEST(S3UrlTest, EncodesEachSegmentAndKeepsSlashes) {
  EXPECT_EQ(UriEncode("a b/€x+y=z~._-", true), "a%20b/%E2%82%ACx%2By%3Dz~._-");
  EXPECT_EQ(UriEncode("a/b", false), "a%2Fb");
  EXPECT_EQ(UriEncode("", true), "");
}

TEST(S3UrlTest, DecodesUrlEncodedKeys) {
  EXPECT_EQ(UrlDecode("a+b%2Fc%E2%82%AC"), "a b/c€");
  EXPECT_EQ(UrlDecode("100%25"), "100%");
  EXPECT_EQ(UrlDecode("bad%zz%4"), "bad%zz%4");  // malformed escapes stay as they are
}

TEST(S3UrlTest, PathStyleAndVirtualHostedUrls) {
  Result<Endpoint> e = ParseEndpoint("http://127.0.0.1:4568");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(ObjectUrl(*e, "bkt", true, "a b/c.jpg"), "http://127.0.0.1:4568/bkt/a%20b/c.jpg");
  EXPECT_EQ(ObjectUrl(*e, "bkt", true, ""), "http://127.0.0.1:4568/bkt");
  Result<Endpoint> aws = ParseEndpoint("https://s3.us-west-2.amazonaws.com/");
  ASSERT_TRUE(aws.ok());
  EXPECT_EQ(ObjectUrl(*aws, "bkt", false, "k/€"),
            "https://bkt.s3.us-west-2.amazonaws.com/k/%E2%82%AC");
  EXPECT_EQ(ObjectUrl(*aws, "bkt", false, ""), "https://bkt.s3.us-west-2.amazonaws.com/");
  Result<Endpoint> based = ParseEndpoint("http://gw:80/s3/");
  ASSERT_TRUE(based.ok());
  EXPECT_EQ(ObjectUrl(*based, "b", true, "k"), "http://gw:80/s3/b/k");
  EXPECT_FALSE(ParseEndpoint("ftp://x").ok());
  EXPECT_FALSE(ParseEndpoint("http://").ok());
  EXPECT_FALSE(ParseEndpoint("127.0.0.1:9000").ok());
}

TEST(S3UrlTest, ListQueryIsInCanonicalOrderAndEncoding) {
  EXPECT_EQ(ListQuery("", "", 1000),
            "delimiter=%2F&encoding-type=url&list-type=2&max-keys=1000&prefix=");
  EXPECT_EQ(ListQuery("a b/", "tok+/=", 1),
            "continuation-token=tok%2B%2F%3D&delimiter=%2F&encoding-type=url&list-type=2&"
            "max-keys=1&prefix=a%20b%2F");
  // Plain listings (a store whose url-encoded ones cannot be trusted) ask for no encoding.
  EXPECT_EQ(ListQuery("d/", "", 2, /*url_encoding=*/false),
            "delimiter=%2F&list-type=2&max-keys=2&prefix=d%2F");
}

TEST(S3XmlTest, UnescapesEntitiesAndCharacterReferences) {
  EXPECT_EQ(XmlUnescape("a&amp;b&lt;c&gt;&quot;&apos;").value(), "a&b<c>\"'");
  EXPECT_EQ(XmlUnescape("&#65;&#x42;&#x20AC;&#x1F600;").value(), "AB€\xF0\x9F\x98\x80");
  EXPECT_FALSE(XmlUnescape("&bogus;").ok());
  EXPECT_FALSE(XmlUnescape("a & b").ok());
  EXPECT_FALSE(XmlUnescape("&#0;").ok());
  EXPECT_FALSE(XmlUnescape("&#xD800;").ok());
}

constexpr char kPage[] = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>bkt</Name><Prefix>d/</Prefix><KeyCount>3</KeyCount><MaxKeys>1000</MaxKeys>
  <Delimiter>/</Delimiter><IsTruncated>true</IsTruncated>
  <Contents><Key>d/a &amp; b.jpg</Key><LastModified>2009-10-12T17:50:30.123Z</LastModified>
    <ETag>&quot;fba9dede5f27731c9771645a39863328&quot;</ETag><Size>434234</Size>
    <Owner><ID>x</ID><DisplayName>y</DisplayName></Owner><StorageClass>STANDARD</StorageClass>
  </Contents>
  <Contents><Key>d/empty</Key><LastModified>2009-10-12T17:50:31Z</LastModified>
    <ETag>"d41d8cd98f00b204e9800998ecf8427e"</ETag><Size>0</Size></Contents>
  <CommonPrefixes><Prefix>d/sub/</Prefix></CommonPrefixes>
  <CommonPrefixes><Prefix>d/&#x20AC;/</Prefix></CommonPrefixes>
  <NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
</ListBucketResult>)";

TEST(S3XmlTest, ParsesAListObjectsV2Page) {
  Result<ListPage> page = ParseListObjectsV2(kPage);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  ASSERT_EQ(page->objects.size(), 2u);
  EXPECT_EQ(page->objects[0].key, "d/a & b.jpg");
  EXPECT_EQ(page->objects[0].size, 434234u);
  EXPECT_EQ(page->objects[0].last_modified_s, 1255369830);
  EXPECT_EQ(page->objects[0].etag, "\"fba9dede5f27731c9771645a39863328\"");
  EXPECT_EQ(page->objects[1].key, "d/empty");
  EXPECT_EQ(page->objects[1].size, 0u);
  EXPECT_EQ(page->common_prefixes, (std::vector<std::string>{"d/sub/", "d/€/"}));
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_token, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=");
}

TEST(S3XmlTest, DecodesUrlEncodedKeysOnlyWhenTheReplySaysSo) {
  const char* encoded = R"(<ListBucketResult><Prefix>a+b%2F</Prefix>
    <Contents><Key>a+b%2F%E2%82%AC+%2B.txt</Key><Size>1</Size></Contents>
    <CommonPrefixes><Prefix>a+b%2Fsub%2F</Prefix></CommonPrefixes>
    <EncodingType>url</EncodingType><IsTruncated>false</IsTruncated></ListBucketResult>)";
  Result<ListPage> page = ParseListObjectsV2(encoded);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(page->objects.at(0).key, "a b/€ +.txt");
  EXPECT_EQ(page->common_prefixes.at(0), "a b/sub/");
  EXPECT_TRUE(page->url_encoded);
  // A server that ignores encoding-type sends keys plain: they stay as they are.
  const char* plain = R"(<ListBucketResult><Contents><Key>a+b%2F c</Key><Size>1</Size>
    </Contents><IsTruncated>false</IsTruncated></ListBucketResult>)";
  EXPECT_EQ(ParseListObjectsV2(plain)->objects.at(0).key, "a+b%2F c");
  EXPECT_FALSE(ParseListObjectsV2(plain)->url_encoded);  // the backend then lists plainly
}

TEST(S3XmlTest, EmptySelfClosingAndCdataElements) {
  Result<ListPage> page = ParseListObjectsV2(
      "<ListBucketResult><Prefix/><IsTruncated>false</IsTruncated><!-- note -->"
      "<Contents><Key><![CDATA[x<y]]></Key><Size>5</Size></Contents></ListBucketResult>");
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(page->objects.at(0).key, "x<y");
  EXPECT_FALSE(page->truncated);
}

TEST(S3XmlTest, RejectsMalformedReplies) {
  for (const char* bad : {
           "",
           "<ListBucketResult>",
           "<ListBucketResult><Contents></ListBucketResult>",
           "<ListBucketResult><Contents><Size>12x</Size></Contents></ListBucketResult>",
           "<ListBucketResult><Contents><Key>&nope;</Key></Contents></ListBucketResult>",
           "<Error><Code>NoSuchBucket</Code></Error>",
           "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
           "<ListBucketResult></ListBucketResult><ListBucketResult></ListBucketResult>",
           "not xml at all",
       }) {
    EXPECT_FALSE(ParseListObjectsV2(bad).ok()) << bad;
  }
}

TEST(S3XmlTest, ErrorRepliesAreSummarized) {
  const char* body = R"(<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message>
<BucketName>nope</BucketName></Error>)";
  EXPECT_EQ(ErrorCode(body), "NoSuchBucket");
  EXPECT_EQ(ErrorSummary(body), "NoSuchBucket: The specified bucket does not exist");
  EXPECT_EQ(ErrorSummary(""), "");
  EXPECT_EQ(ErrorSummary("<html>502 Bad Gateway</html>"), "");
}

TEST(S3AttrTest, ParsesDates) {
  EXPECT_EQ(ParseHttpDate("Mon, 12 Oct 2009 17:50:30 GMT").value(), 1255369830);
  EXPECT_FALSE(ParseHttpDate("Mon, 12 Foo 2009 17:50:30 GMT").ok());
  EXPECT_FALSE(ParseHttpDate("yesterday").ok());
  EXPECT_EQ(ParseIsoTime("2009-10-12T17:50:30.999Z").value(), 1255369830);
  EXPECT_EQ(ParseIsoTime("2009-10-12T17:50:30Z").value(), 1255369830);
  EXPECT_FALSE(ParseIsoTime("2009-10-12T17:50:30+02:00").ok());
  EXPECT_FALSE(ParseIsoTime("2009-13-12T17:50:30Z").ok());
}

TEST(S3AttrTest, VersionFollowsTheEtagWithinTheSameSecond) {
  EXPECT_EQ(NormalizeEtag("\"abc\""), "abc");
  EXPECT_EQ(NormalizeEtag("W/\"abc\""), "abc");
  EXPECT_EQ(NormalizeEtag("abc"), "abc");
  const int64_t a = ObjectMtimeNs(1000, "\"abc\"");
  EXPECT_EQ(a, ObjectMtimeNs(1000, "abc"));  // a listing and a HEAD agree
  EXPECT_NE(a, ObjectMtimeNs(1000, "\"abd\""));
  EXPECT_EQ(a / 1'000'000'000, 1000);  // the seconds are the real Last-Modified
  EXPECT_EQ(ObjectMtimeNs(1001, "\"abc\"") - a, 1'000'000'000);
}

TEST(S3AttrTest, ParsesContentRange) {
  Result<ContentRange> r = ParseContentRange("bytes 100-199/1000");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->has_range);
  EXPECT_EQ(r->first, 100u);
  EXPECT_EQ(r->last, 199u);
  EXPECT_EQ(r->total, 1000u);
  Result<ContentRange> unsatisfied = ParseContentRange("bytes */1000");
  ASSERT_TRUE(unsatisfied.ok());
  EXPECT_FALSE(unsatisfied->has_range);
  EXPECT_EQ(unsatisfied->total, 1000u);
  for (const char* bad : {"bytes 0-10/*", "bytes 5-4/10", "bytes 0-10/10", "0-1/2", "bytes x"})
    EXPECT_FALSE(ParseContentRange(bad).ok()) << bad;
}

TEST(S3ErrorTest, HttpStatusesMapOntoStatusCodes) {
  const char* body = "<Error><Code>NoSuchKey</Code><Message>gone</Message></Error>";
  Status nf = HttpError("GET", "bkt", "a/b", 404, body);
  EXPECT_TRUE(nf.IsNotFound());
  EXPECT_EQ(nf.message(), "s3 GET bkt/a/b: HTTP 404 (NoSuchKey: gone)");
  EXPECT_EQ(HttpError("HEAD", "bkt", "k", 403, "").code(), Status::Code::kPermissionDenied);
  EXPECT_TRUE(HttpError("GET", "bkt", "k", 412, "").IsStale());
  Status other = HttpError("LIST", "bkt", "", 500, "");
  EXPECT_EQ(other.code(), Status::Code::kIOError);
  EXPECT_EQ(other.message(), "s3 LIST bkt: HTTP 500");
}

TEST(S3ErrorTest, RetriesServerErrorsAndThrottlingOnly) {
  EXPECT_TRUE(RetryableHttp(500, ""));
  EXPECT_TRUE(RetryableHttp(503, "SlowDown"));
  EXPECT_TRUE(RetryableHttp(429, ""));
  EXPECT_TRUE(RetryableHttp(400, "RequestTimeout"));
  EXPECT_FALSE(RetryableHttp(404, "NoSuchKey"));
  EXPECT_FALSE(RetryableHttp(403, "AccessDenied"));
  EXPECT_FALSE(RetryableHttp(200, ""));
}

TEST(S3ErrorTest, BackoffGrowsExponentiallyWithJitterAndACap) {
  EXPECT_EQ(BackoffMs(1, 50, 2000, 0.0), 25u);
  EXPECT_EQ(BackoffMs(1, 50, 2000, 0.999), 49u);
  EXPECT_EQ(BackoffMs(2, 50, 2000, 0.0), 50u);
  EXPECT_EQ(BackoffMs(3, 50, 2000, 0.0), 100u);
  EXPECT_EQ(BackoffMs(30, 50, 2000, 0.0), 1000u);  // capped at 2000, half of it fixed
  EXPECT_LE(BackoffMs(30, 50, 2000, 1.0), 2000u);
}

TEST(S3BackendTest, ConstructionNeedsNoServerAndReadLinkIsNotSupported) {
  conf::S3Options opts;
  opts.endpoint = "http://127.0.0.1:9";
  opts.bucket = "bkt";
  opts.access_key = "AK";
  opts.secret_key = "SK";
  Result<std::unique_ptr<Backend>> b = NewS3Backend(opts);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*b)->ReadLink("x").status().code(), Status::Code::kNotSupported);
  Result<FsStats> fs = (*b)->StatFs();
  ASSERT_TRUE(fs.ok());
  EXPECT_GT(fs->blocks_avail, 0u);
}

TEST(S3BackendTest, AnUnreachableEndpointIsAnIOErrorAndTheCheckNamesTheKey) {
  conf::S3Options opts;
  opts.endpoint = "http://127.0.0.1:9";  // discard: nothing listens there
  opts.bucket = "bkt";
  opts.retries = 1;
  opts.timeout_ms = 2000;
  Result<std::unique_ptr<Backend>> b = NewS3Backend(opts);
  ASSERT_TRUE(b.ok());
  Result<FileAttr> st = (*b)->Stat("a");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), Status::Code::kIOError) << st.status().ToString();
  Status check = CheckS3Backend(opts);
  ASSERT_FALSE(check.ok());
  EXPECT_EQ(check.message().rfind("backend.endpoint: ", 0), 0u) << check.message();
}

}  // namespace
}  // namespace cubetorchfs::cfs_client::s3
