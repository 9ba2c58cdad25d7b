#include "conf/config.h"

#include <gtest/gtest.h>

namespace cubetorchfs::conf {
namespace {

const char* kMinimal = R"({"volName": "v", "backend": {"type": "posix", "root": "/data"}})";

TEST(ParseSizeTest, AcceptsBytesAndUnits) {
  EXPECT_EQ(ParseSize("4096").value(), 4096u);
  EXPECT_EQ(ParseSize("4KiB").value(), 4096u);
  EXPECT_EQ(ParseSize("4MiB").value(), 4u << 20);
  EXPECT_EQ(ParseSize(" 1.5 GiB ").value(), 3ull << 29);
  EXPECT_EQ(ParseSize("2TiB").value(), 2ull << 40);
  EXPECT_EQ(ParseSize("64mb").value(), 64u << 20);
}

TEST(ParseSizeTest, RejectsNonsense) {
  for (const char* bad : {"", "-1", "abc", "4XB", "1.2.3MiB", "0.5B", "99999999999TiB"}) {
    EXPECT_FALSE(ParseSize(bad).ok()) << bad;
  }
}

TEST(ConfigTest, MinimalJsonGetsDefaults) {
  Result<Config> c = ParseConfig(kMinimal);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->vol_name, "v");
  EXPECT_EQ(c->backend.root, "/data");
  EXPECT_EQ(c->cache.memory_bytes, 4ull << 30);
  EXPECT_EQ(c->cache.chunk_bytes, 4ull << 20);
  EXPECT_DOUBLE_EQ(c->fuse.attr_timeout_s, 1.0);
  EXPECT_FALSE(c->fuse.keep_cache);
  EXPECT_FALSE(c->backend.inject.enabled);
}

TEST(ConfigTest, FullJsonFromTheInterfaceDoc) {
  Result<Config> c = ParseConfig(R"({
    "volName": "ltptest", "mountPoint": "/cfs/mnt", "logDir": "/cfs/log", "logLevel": "info",
    "exporterPort": 9500, "profPort": "17410", "profile": "ai_prefetch",
    "masterAddr": "10.0.0.1:17010", "owner": "ltptest",
    "backend": {"type": "posix", "root": "/data/train",
                "inject": {"latency_us": 300, "error_rate": 0.25, "seed": 7}},
    "cache": {"memory_bytes": "4GiB", "disk_dir": "", "disk_bytes": 0, "chunk_bytes": "4MiB"},
    "prefetch": {"enabled": true, "max_inflight": 64, "window_files": 4096,
                 "window_bytes": "1GiB", "evict_after_read": true, "control_socket": ""},
    "fuse": {"read_only": false, "entry_timeout_s": 300, "attr_timeout_s": 300,
             "negative_timeout_s": 5, "max_read": "1MiB"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->exporter_port, 9500);
  EXPECT_EQ(c->prof_port, 17410);
  EXPECT_EQ(c->mount_point, "/cfs/mnt");
  EXPECT_TRUE(c->backend.inject.enabled);
  EXPECT_EQ(c->backend.inject.latency_us, 300u);
  EXPECT_DOUBLE_EQ(c->backend.inject.error_rate, 0.25);
  EXPECT_EQ(c->backend.inject.seed, 7u);
  EXPECT_EQ(c->prefetch.window_bytes, 1ull << 30);
  EXPECT_TRUE(c->fuse.keep_cache);  // from the profile
  EXPECT_TRUE(c->unknown_top_level_keys.empty());
}

TEST(ConfigTest, YamlIsReadToo) {
  Result<Config> c = ParseConfig(
      "volName: y\nbackend:\n  root: /d\ncache:\n  memory_bytes: 64MiB\nprofile: ai_prefetch\n");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->cache.memory_bytes, 64u << 20);
  EXPECT_DOUBLE_EQ(c->fuse.entry_timeout_s, 300);
  EXPECT_DOUBLE_EQ(c->fuse.negative_timeout_s, 5);
}

TEST(ConfigTest, ExplicitTimeoutsBeatTheProfile) {
  Result<Config> c = ParseConfig(
      R"({"volName": "v", "profile": "ai_prefetch", "backend": {"root": "/d"},
          "fuse": {"attr_timeout_s": 0}})");
  ASSERT_TRUE(c.ok());
  EXPECT_DOUBLE_EQ(c->fuse.attr_timeout_s, 0);
  EXPECT_DOUBLE_EQ(c->fuse.entry_timeout_s, 300);
}

TEST(ConfigTest, CubeFsKeysMapOntoFuseOptions) {
  Result<Config> c = ParseConfig(
      R"({"volName": "v", "backend": {"root": "/d"}, "rdonly": "true", "attrValid": "30",
          "lookupValid": "20", "enSyncWrite": "false"})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->fuse.read_only);
  EXPECT_DOUBLE_EQ(c->fuse.attr_timeout_s, 30);
  EXPECT_DOUBLE_EQ(c->fuse.entry_timeout_s, 20);
  EXPECT_TRUE(c->unknown_top_level_keys.empty());
}

TEST(ConfigTest, UnknownTopLevelKeysAreCollectedNotFatal) {
  Result<Config> c =
      ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}, "bogus": 1, "zzz": 2})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->unknown_top_level_keys, (std::vector<std::string>{"bogus", "zzz"}));
}

TEST(ConfigTest, S3BackendWithDefaults) {
  Result<Config> c = ParseConfig(
      R"({"volName": "ltptest", "backend": {"type": "s3", "endpoint": "http://127.0.0.1:4568/"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const S3Options& s3 = c->backend.s3;
  EXPECT_EQ(c->backend.type, "s3");
  EXPECT_EQ(s3.endpoint, "http://127.0.0.1:4568");  // trailing '/' dropped
  EXPECT_EQ(s3.bucket, "ltptest");                  // the volume is the bucket
  EXPECT_EQ(s3.region, "us-east-1");
  EXPECT_EQ(s3.prefix, "");
  EXPECT_TRUE(s3.path_style);
  EXPECT_EQ(s3.access_key, "");
  EXPECT_EQ(s3.timeout_ms, 30000u);
  EXPECT_EQ(s3.retries, 4u);
  EXPECT_EQ(s3.max_connections, 64u);
}

TEST(ConfigTest, S3BackendWithEveryKey) {
  Result<Config> c = ParseConfig(
      "volName: v\n"
      "backend:\n"
      "  type: s3\n"
      "  endpoint: https://s3.us-west-2.amazonaws.com\n"
      "  bucket: datasets\n"
      "  region: us-west-2\n"
      "  prefix: imagenet/train/\n"
      "  path_style: false\n"
      "  access_key: AKIDEXAMPLE\n"
      "  secret_key: wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY\n"
      "  timeout_ms: 5000\n"
      "  retries: 2\n"
      "  max_connections: 16\n"
      "  staging_dir: /nvme/staging\n"
      "  multipart_bytes: 64MiB\n"
      "  inject: {latency_us: 10}\n");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const S3Options& s3 = c->backend.s3;
  EXPECT_EQ(s3.bucket, "datasets");
  EXPECT_EQ(s3.region, "us-west-2");
  EXPECT_EQ(s3.prefix, "imagenet/train");  // trailing '/' dropped
  EXPECT_FALSE(s3.path_style);
  EXPECT_EQ(s3.access_key, "AKIDEXAMPLE");
  EXPECT_EQ(s3.secret_key, "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY");
  EXPECT_EQ(s3.timeout_ms, 5000u);
  EXPECT_EQ(s3.retries, 2u);
  EXPECT_EQ(s3.max_connections, 16u);
  EXPECT_EQ(s3.staging_dir, "/nvme/staging");
  EXPECT_EQ(s3.multipart_bytes, 64ull << 20);
  EXPECT_TRUE(c->backend.inject.enabled);
}

// Each bad config fails with a message that starts with the key path.
struct BadCase {
  const char* text;
  const char* key;
};

class BadConfigTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfigTest, NamesTheKey) {
  Result<Config> c = ParseConfig(GetParam().text);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message().rfind(GetParam().key, 0), 0u) << c.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    Keys, BadConfigTest,
    ::testing::Values(
        BadCase{R"({"backend": {"root": "/d"}})", "volName"},
        BadCase{R"({"volName": "v"})", "backend.root"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d", "rooot": 1}})", "backend.rooot"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"bogus": 1}})",
                "cache.bogus"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"memory_bytes": "4XB"}})",
                "cache.memory_bytes"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"memory_bytes": -5}})",
                "cache.memory_bytes"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"chunk_bytes": "1KiB"}})",
                "cache.chunk_bytes"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d", "type": "nfs"}})", "backend.type"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                                                "multipart_bytes": "1MiB"}})",
                "backend.multipart_bytes"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d", "inject": {"error_rate": 2}}})",
                "backend.inject.error_rate"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "fuse": {"attr_timeout_s": "x"}})",
                "fuse.attr_timeout_s"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "fuse": {"read_only": "maybe"}})",
                "fuse.read_only"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "prefetch": {"max_inflight": 0}})",
                "prefetch.max_inflight"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "exporterPort": 70000})",
                "exporterPort"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "logLevel": "loud"})", "logLevel"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"}, "profile": "fast"})", "profile"},
        BadCase{R"({"volName": "v", "backend": "posix"})", "backend"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d"},)", "config"},
        BadCase{"[1, 2]", "config"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3"}})", "backend.endpoint"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "127.0.0.1:9000"}})",
                "backend.endpoint"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "ftp://h"}})",
                "backend.endpoint"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://"}})",
                "backend.endpoint"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h?x=1"}})",
                "backend.endpoint"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "root": "/d"}})",
                "backend.root"},
        BadCase{R"({"volName": "v", "backend": {"root": "/d", "endpoint": "http://h"}})",
                "backend.endpoint"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "bucket": "a/b"}})",
                "backend.bucket"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "prefix": "/abs"}})",
                "backend.prefix"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "region": "us east"}})",
                "backend.region"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "access_key": "AK"}})",
                "backend.secret_key"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "secret_key": "SK"}})",
                "backend.access_key"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "path_style": "sometimes"}})",
                "backend.path_style"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "timeout_ms": 0}})",
                "backend.timeout_ms"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "retries": 100}})",
                "backend.retries"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "max_connections": 0}})",
                "backend.max_connections"},
        BadCase{R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
                    "endpont": "x"}})",
                "backend.endpont"}));

TEST(ConfigTest, LoadConfigNamesAMissingFile) {
  Result<Config> c = LoadConfig("/nonexistent/cubetorchfs.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/cubetorchfs.json"), std::string::npos);
}

}  // namespace
}  // namespace cubetorchfs::conf
