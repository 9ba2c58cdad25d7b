#include "conf/config.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <ostream>
#include <string>

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
                 "window_bytes": "1GiB", "evict_after_read": true, "trust_page_cache": false,
                 "restore_pages": false,
                 "control_socket": ""},
    "fuse": {"read_only": false, "entry_timeout_s": 300, "attr_timeout_s": 300,
             "negative_timeout_s": 5, "max_read": "1MiB"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->prefetch.trust_page_cache);
  EXPECT_EQ(c->prefetch.restore_pages, PrefetchOptions::RestorePages::kNever);
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

TEST(ConfigTest, TheCacheIsDurableUnlessSaidOtherwise) {
  Result<Config> d = ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}})");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->cache.durable);
  Result<Config> c =
      ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"durable": false}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->cache.durable);
  Result<Config> bad =
      ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"durable": "maybe"}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cache.durable"), std::string::npos)
      << bad.status().message();
}

TEST(ConfigTest, FlushOnCloseAndWriteBackIdle) {
  Result<Config> d = ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}})");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->fuse.flush_on_close);
  EXPECT_DOUBLE_EQ(d->fuse.write_back_idle_s, 1.0);
  EXPECT_FALSE(d->prefetch.evict_after_read);
  EXPECT_TRUE(d->prefetch.trust_page_cache);
  EXPECT_EQ(d->prefetch.restore_pages, PrefetchOptions::RestorePages::kAuto);
  Result<Config> c = ParseConfig(
      R"({"volName": "v", "backend": {"root": "/d"},
          "fuse": {"flush_on_close": false, "write_back_idle_s": 0.25}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->fuse.flush_on_close);
  EXPECT_DOUBLE_EQ(c->fuse.write_back_idle_s, 0.25);
  Result<Config> bad = ParseConfig(
      R"({"volName": "v", "backend": {"root": "/d"}, "fuse": {"write_back_idle_s": 0}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fuse.write_back_idle_s"), std::string::npos)
      << bad.status().ToString();
}

TEST(ConfigTest, FuseIoUringIsAutoOnOrOff) {
  using IoUring = FuseOptions::IoUring;
  Result<Config> d = ParseConfig(kMinimal);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->fuse.io_uring, IoUring::kAuto);
  for (const auto& [text, want] :
       {std::pair{"\"auto\"", IoUring::kAuto}, std::pair{"\"on\"", IoUring::kOn},
        std::pair{"true", IoUring::kOn}, std::pair{"\"off\"", IoUring::kOff},
        std::pair{"false", IoUring::kOff}}) {
    Result<Config> c = ParseConfig(std::string(R"({"volName": "v", "backend": {"root": "/d"},
        "fuse": {"io_uring": )") + text +
                                   "}}");
    ASSERT_TRUE(c.ok()) << text << ": " << c.status().ToString();
    EXPECT_EQ(c->fuse.io_uring, want) << text;
  }
  Result<Config> bad =
      ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}, "fuse": {"io_uring": "fast"}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fuse.io_uring"), std::string::npos)
      << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("auto, on or off"), std::string::npos);
}

TEST(ConfigTest, UnknownTopLevelKeysAreCollectedNotFatal) {
  Result<Config> c =
      ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}, "bogus": 1, "zzz": 2})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->unknown_top_level_keys, (std::vector<std::string>{"bogus", "zzz"}));
}

TEST(ConfigTest, CubefsBackendTakesTheCubeFsClientKeys) {
  // A CubeFS client config with backend.type cubefs added.
  Result<Config> c = ParseConfig(R"({"masterAddr": "10.0.0.1:17010,10.0.0.2:17010",
      "volName": "ltptest", "owner": "ltptest", "accessKey": "AK", "secretKey": "SK",
      "logDir": "/var/log/cfs", "logLevel": "warn", "followerRead": "true", "rdonly": false,
      "mountPoint": "/cfs/mnt", "backend": {"type": "cubefs"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const CubefsOptions& o = c->backend.cubefs;
  EXPECT_EQ(o.master_addr, "10.0.0.1:17010,10.0.0.2:17010");
  EXPECT_EQ(o.volume, "ltptest");
  EXPECT_EQ(o.access_key, "AK");
  EXPECT_EQ(o.secret_key, "SK");
  EXPECT_TRUE(c->unknown_top_level_keys.empty());  // owner: a CubeFS client key, accepted
  EXPECT_EQ(o.log_dir, "/var/log/cfs");
  EXPECT_EQ(o.log_level, "warn");
  EXPECT_TRUE(o.follower_read);
  EXPECT_FALSE(o.remote_cache);
  EXPECT_EQ(o.lib, "");
  EXPECT_TRUE(c->unknown_top_level_keys.empty());
  c = ParseConfig(R"({"masterAddr": "h:1", "volName": "mine", "accessKey": "a", "secretKey": "s",
      "backend": {"type": "cubefs", "cubefs": {"lib": "/opt/libcfs.so", "volume": "theirs"}}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend.cubefs.volume, "theirs");
  EXPECT_EQ(c->backend.cubefs.lib, "/opt/libcfs.so");
  c = ParseConfig(R"({"masterAddr": "h:1", "volName": "v", "accessKey": "a", "secretKey": "s",
      "backend": {"type": "cubefs", "cubefs": {"remote_cache": true}}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->backend.cubefs.remote_cache);
  c = ParseConfig(R"({"masterAddr": "h:1", "volName": "v", "accessKey": "a", "secretKey": "s",
      "backend": {"type": "cubefs", "cubefs": {"remote_cache": "sometimes"}}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("backend.cubefs.remote_cache"), std::string::npos)
      << c.status().ToString();
}

TEST(ConfigTest, BackendTypeParsesEachKnownName) {
  for (BackendType t :
       {BackendType::kPosix, BackendType::kS3, BackendType::kCubefs, BackendType::kSynthetic}) {
    Result<BackendType> parsed = ParseBackendType(BackendTypeName(t));
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_STREQ(BackendTypeName(BackendType::kCubefs), "cubefs");
  Result<Config> c = ParseConfig(kMinimal);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend.type, BackendType::kPosix);  // the default
}

TEST(ConfigTest, UnknownBackendTypeNamesTheKey) {
  Result<BackendType> t = ParseBackendType("nfs");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(),
            "backend.type: unknown backend \"nfs\" (known: posix, s3, cubefs, synthetic)");
  EXPECT_FALSE(ParseBackendType("S3").ok());  // names are case-sensitive
  Result<Config> c = ParseConfig(R"({"volName": "v", "backend": {"type": "nfs", "root": "/d"}})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(
                "backend.type: unknown backend \"nfs\" (known: posix, s3, cubefs, synthetic)"),
            std::string::npos)
      << c.status().message();
}

TEST(ConfigTest, S3BackendWithDefaults) {
  Result<Config> c = ParseConfig(
      R"({"volName": "ltptest", "backend": {"type": "s3", "endpoint": "http://127.0.0.1:4568/"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const S3Options& s3 = c->backend.s3;
  EXPECT_EQ(c->backend.type, BackendType::kS3);
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
// gtest prints a failing case by its key, not as bytes.
void PrintTo(const BadCase& c, std::ostream* os) { *os << c.key; }
// Test names: the key, then the case's index (a key may fail in more than one way).
std::string CaseName(const ::testing::TestParamInfo<BadCase>& info) {
  std::string name;
  for (const char* p = info.param.key; *p != '\0'; ++p)
    name += std::isalnum(static_cast<unsigned char>(*p)) ? *p : '_';
  return name + "_" + std::to_string(info.index);
}

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
        BadCase{R"({"volName": "v", "backend": {"type": "synthetic", "root": "/d"}})",
                "backend.root"},
        BadCase{R"({"volName": "v", "backend": {"type": "synthetic", "synthetic": {"dirs": 0}}})",
                "backend.synthetic.dirs"},
        BadCase{R"({"volName": "v", "backend": {"type": "synthetic",
                   "synthetic": {"min_bytes": "2KiB", "max_bytes": "1KiB"}}})",
                "backend.synthetic.min_bytes"},
        BadCase{R"({"volName": "v", "backend": {"type": "synthetic",
                   "synthetic": {"dirs": 1000000, "files_per_dir": 100000}}})",
                "backend.synthetic.files_per_dir"},
        BadCase{R"({"volName": "v", "backend": {"type": "synthetic", "synthetic": {"file": 1}}})",
                "backend.synthetic.file"},
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
        BadCase{R"({"volName": "v", "backend": {"type": "cubefs"}})", "masterAddr"},
        BadCase{R"({"volName": "v", "masterAddr": "h", "backend": {"type": "cubefs"}})",
                "masterAddr"},
        BadCase{R"({"volName": "v", "masterAddr": "h:1 ", "backend": {"type": "cubefs"}})",
                "masterAddr"},
        BadCase{R"({"volName": "v", "masterAddr": "h:1", "backend": {"type": "cubefs"}})",
                "accessKey"},
        BadCase{R"({"volName": "v", "masterAddr": "h:1", "accessKey": "a",
                    "backend": {"type": "cubefs"}})",
                "secretKey"},
        BadCase{R"({"volName": "v", "masterAddr": "h:1", "accessKey": "a", "secretKey": "s",
                    "backend": {"type": "cubefs", "root": "/d"}})",
                "backend.root"},
        BadCase{R"({"volName": "v", "masterAddr": "h:1", "accessKey": "a", "secretKey": "s",
                    "backend": {"type": "cubefs", "endpoint": "http://h"}})",
                "backend.endpoint"},
        BadCase{R"({"volName": "v", "masterAddr": "h:1", "accessKey": "a", "secretKey": "s",
                    "backend": {"type": "cubefs", "cubefs": {"libb": "x"}}})",
                "backend.cubefs.libb"},
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
                "backend.endpont"}),
    CaseName);

TEST(ConfigTest, ControlAndPerUserLimits) {
  Result<Config> c = ParseConfig(R"({"volName": "v", "backend": {"type": "posix", "root": "/d"},
      "prefetch": {"max_streams_per_uid": 8, "max_queued_paths_per_uid": 1000,
                   "max_queued_paths": 5000, "max_queued_path_bytes_per_uid": "1MiB",
                   "max_queued_path_bytes": 3000000},
      "control": {"max_body_bytes": "1MiB", "body_memory_bytes": "4MiB",
                  "max_json_elements": 100, "max_json_depth": 4, "max_connections_unix": 10,
                  "max_connections_tcp": 0, "max_connections_per_uid": 2,
                  "idle_timeout_s": 5}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->prefetch.max_streams_per_uid, 8u);
  EXPECT_EQ(c->prefetch.max_queued_paths_per_uid, 1000u);
  EXPECT_EQ(c->prefetch.max_queued_paths, 5000u);
  EXPECT_EQ(c->prefetch.max_queued_path_bytes_per_uid, 1u << 20);
  EXPECT_EQ(c->prefetch.max_queued_path_bytes, 3000000u);
  EXPECT_EQ(c->control.max_body_bytes, 1u << 20);
  EXPECT_EQ(c->control.body_memory_bytes, 4u << 20);
  EXPECT_EQ(c->control.max_json_elements, 100u);
  EXPECT_EQ(c->control.max_json_depth, 4u);
  EXPECT_EQ(c->control.max_connections_unix, 10u);
  EXPECT_EQ(c->control.max_connections_tcp, 0u);
  EXPECT_EQ(c->control.max_connections_per_uid, 2u);
  EXPECT_DOUBLE_EQ(c->control.idle_timeout_s, 5);
  Result<Config> d = ParseConfig(kMinimal);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->control.max_connections_per_uid, 64u);
  EXPECT_EQ(d->control.body_memory_bytes, 32u << 20);
  EXPECT_EQ(d->prefetch.max_queued_path_bytes_per_uid, 32u << 20);
  EXPECT_EQ(d->prefetch.max_queued_path_bytes, 64u << 20);
  for (const char* bad :
       {R"({"volName": "v", "backend": {"root": "/d"}, "control": {"max_body_bytes": 0}})",
        R"({"volName": "v", "backend": {"root": "/d"}, "control": {"body_memory_bytes": "5GiB"}})",
        R"({"volName": "v", "backend": {"root": "/d"}, "control": {"max_connections_unix": 0}})",
        R"({"volName": "v", "backend": {"root": "/d"}, "control": {"body_memory_bytes": "1MiB"}})",
        R"({"volName": "v", "backend": {"root": "/d"}, "control": {"idle_timeout_s": 0}})",
        R"({"volName": "v", "backend": {"root": "/d"}, "control": {"max_conns": 1}})",
        R"({"volName": "v", "backend": {"root": "/d"}, "prefetch": {"max_queued_paths": 0}})",
        R"({"volName": "v", "backend": {"root": "/d"},
            "prefetch": {"max_queued_path_bytes": "32KiB"}})",
        R"({"volName": "v", "backend": {"root": "/d"},
            "prefetch": {"max_queued_path_bytes_per_uid": "5GiB"}})",
        R"({"volName": "v", "backend": {"root": "/d"},
            "prefetch": {"max_queued_path_bytes_per_uid": "lots"}})",
        R"({"volName": "v", "backend": {"root": "/d"},
            "prefetch": {"max_queued_path_bytes": [1]}})"}) {
    Result<Config> e = ParseConfig(bad);
    EXPECT_FALSE(e.ok()) << bad;
    if (!e.ok()) {
      const std::string& m = e.status().message();
      EXPECT_TRUE(m.rfind("control.", 0) == 0 || m.rfind("prefetch.", 0) == 0) << m;
    }
  }
}

TEST(ConfigTest, LoadConfigNamesAMissingFile) {
  Result<Config> c = LoadConfig("/nonexistent/cubetorchfs.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/cubetorchfs.json"), std::string::npos);
}

// ---------------------------------------------------------------------------- hardening

// The error of `text`, which must be refused.
std::string ErrorOf(const std::string& text) {
  Result<Config> c = ParseConfig(text);
  EXPECT_FALSE(c.ok()) << text.substr(0, 200);
  return c.ok() ? std::string() : c.status().message();
}

bool StartsWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

std::string WithVolName(const std::string& vol) {
  return "{\"volName\": \"" + vol + "\", \"backend\": {\"root\": \"/d\"}}";
}

TEST(ConfigHardeningTest, AValueInAnErrorIsEscapedOnce) {
  // logDir holds a backslash and a control byte (\u0001 in JSON).
  const std::string text =
      R"({"volName": "v", "backend": {"root": "/d"}, "logDir": "/a\\b\u0001c"})";
  EXPECT_NE(ErrorOf(text).find(R"("/a\\b\x01c")"), std::string::npos) << ErrorOf(text);
  // Read from a file, the same message.
  const std::string path = ::testing::TempDir() + "/escape_once.json";
  std::ofstream(path) << text;
  Result<Config> loaded = LoadConfig(path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find(R"("/a\\b\x01c")"), std::string::npos)
      << loaded.status().message();
}

TEST(ConfigHardeningTest, VolNameMustBeShortAndPlain) {
  for (const std::string& bad :
       {std::string("a,ro,allow_other"), std::string(65, 'v'), std::string(200, 'v'),
        std::string("a b"), std::string("a\\nb"), std::string("a\\u0000b"), std::string("a=b"),
        std::string("caf\xc3\xa9"), std::string("a/b"), std::string(".."), std::string("-rf"),
        std::string("-")}) {
    std::string err = ErrorOf(WithVolName(bad));
    EXPECT_TRUE(StartsWith(err, "volName: ")) << bad << " -> " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
  EXPECT_NE(ErrorOf(WithVolName("a,ro,allow_other")).find("A-Z a-z 0-9 . _ -"), std::string::npos);
  EXPECT_NE(ErrorOf(WithVolName(std::string(200, 'v'))).find("200 bytes"), std::string::npos);
  EXPECT_NE(ErrorOf(WithVolName("-rf")).find("must not start with '-'"), std::string::npos);
  for (const std::string& good :
       {std::string(64, 'v'), std::string("ltp-test_1.2"), std::string("A9"), std::string("a-")}) {
    Result<Config> c = ParseConfig(WithVolName(good));
    ASSERT_TRUE(c.ok()) << good << ": " << c.status().ToString();
    EXPECT_EQ(c->vol_name, good);
  }
}

TEST(ConfigHardeningTest, ControlSocketPathMustFitSunPath) {
  auto with_socket = [](const std::string& path) {
    return R"({"volName": "v", "backend": {"root": "/d"}, "prefetch": {"control_socket": ")" +
           path + "\"}}";
  };
  const std::string dir = "/run/x/";
  std::string err = ErrorOf(with_socket(dir + std::string(108 - dir.size(), 's')));  // 108 bytes
  EXPECT_TRUE(StartsWith(err, "prefetch.control_socket: ")) << err;
  EXPECT_NE(err.find("107"), std::string::npos) << err;
  err = ErrorOf(with_socket("/" + std::string(199, 's')));
  EXPECT_TRUE(StartsWith(err, "prefetch.control_socket: ")) << err;
  EXPECT_NE(err.find("200 bytes"), std::string::npos) << err;

  Result<Config> c = ParseConfig(with_socket(dir + std::string(107 - dir.size(), 's')));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(ControlSocketPath(*c).size(), 107u);
  // The default path, from the longest volName, fits.
  c = ParseConfig(WithVolName(std::string(64, 'v')));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ControlSocketPath(*c), "/run/cubetorchfs/" + std::string(64, 'v') + ".sock");
}

TEST(ConfigHardeningTest, DuplicateKeysAreErrorsAtEveryLevel) {
  struct Case {
    std::string text;
    std::string key;
  };
  for (const Case& tc : std::vector<Case>{
           {R"({"volName": "a", "volName": "b", "backend": {"root": "/d"}})", "volName"},
           {R"({"volName": "v", "backend": {"root": "/d", "root": "/e"}})", "backend.root"},
           {R"({"volName": "v", "backend": {"root": "/d", "inject": {"seed": 1, "seed": 2}}})",
            "backend.inject.seed"},
           {R"({"volName": "v", "backend": {"root": "/d"}, "owner": "x", "owner": "y"})", "owner"},
           {R"({"volName": "v", "backend": {"root": "/d"}, "x": [{"k": 1}, {"k": 1, "k": 2}]})",
            "x[1].k"},
           {"volName: v\nbackend:\n  root: /d\ncache:\n  memory_bytes: 1GiB\n"
            "  memory_bytes: 2GiB\n",
            "cache.memory_bytes"},
           {"volName: v\nbackend: {root: /d, root: /e}\n", "backend.root"},
           {"volName: v\nbackend:\n  root: /d\n\"volName\": w\n", "volName"},  // quoted = plain
           {"volName: v\nbackend:\n  root: /d\nbackend:\n  root: /e\n", "backend"},
       }) {
    std::string err = ErrorOf(tc.text);
    EXPECT_TRUE(StartsWith(err, tc.key + ": duplicate key")) << tc.text << " -> " << err;
  }
  EXPECT_NE(ErrorOf("volName: v\nbackend:\n  root: /d\nvolName: w\n").find("lines 1 and 4"),
            std::string::npos);
  // The same key in different maps is fine.
  Result<Config> c = ParseConfig(
      R"({"volName": "v", "backend": {"root": "/d"}, "x": [{"k": 1}, {"k": 2}], "k": 3})");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
}

TEST(ConfigHardeningTest, KeysMustBePlainStringsInOneDocument) {
  EXPECT_TRUE(StartsWith(ErrorOf("volName: v\nbackend: {root: /d}\n? [a, b]\n: 1\n"), "config: "));
  EXPECT_TRUE(StartsWith(ErrorOf("volName: v\nbackend: {root: /d}\n~: 1\n"), "config: "));
  EXPECT_TRUE(StartsWith(ErrorOf("volName: v\nbackend: {root: /d, \"a\\nb\": 1}\n"),
                         "backend.a\\nb: a key must not contain control characters"));
  std::string err = ErrorOf("volName: v\nbackend: {root: /d}\n---\nvolName: w\n");
  EXPECT_NE(err.find("second YAML document"), std::string::npos) << err;
  // An empty document after "---" is harmless.
  EXPECT_TRUE(ParseConfig("volName: v\nbackend: {root: /d}\n---\n").ok());
}

TEST(ConfigHardeningTest, AliasesCannotBlowUpTheKeyCheck) {
  // "Billion laughs": 10^20 leaves if the alias tree were walked; the event scan sees ~200.
  std::string text = "volName: v\nbackend: {root: /d}\nl0: &l0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 20; ++i) {
    std::string name("l"), prev("*l");
    name += std::to_string(i);
    prev += std::to_string(i - 1);
    text += name;
    text += ": &";
    text += name;
    text += " [";
    for (int j = 0; j < 10; ++j) {
      if (j > 0) text += ", ";
      text += prev;
    }
    text += "]\n";
  }
  const auto start = std::chrono::steady_clock::now();
  Result<Config> c = ParseConfig(text);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(ConfigHardeningTest, StringValuesMustNotHoldControlCharacters) {
  struct Case {
    std::string text;
    std::string key;
  };
  for (const Case& tc : std::vector<Case>{
           {R"({"volName": "v", "backend": {"root": "/d\nx"}})", "backend.root"},
           {R"({"volName": "v", "mountPoint": "/m\u0000/x", "backend": {"root": "/d"}})",
            "mountPoint"},
           {R"({"volName": "v", "logDir": "/l\r", "backend": {"root": "/d"}})", "logDir"},
           {R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"disk_dir": "/n\t",
               "disk_bytes": "1GiB"}})",
            "cache.disk_dir"},
           {R"({"volName": "v", "backend": {"root": "/d"},
               "prefetch": {"control_socket": "/s\n.sock"}})",
            "prefetch.control_socket"},
           {R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
               "access_key": "AK\r\nX-Injected: 1", "secret_key": "SK"}})",
            "backend.access_key"},
           {R"({"volName": "v", "backend": {"type": "s3", "endpoint": "http://h",
               "staging_dir": "/s\u001b[2J"}})",
            "backend.staging_dir"},
       }) {
    std::string err = ErrorOf(tc.text);
    EXPECT_TRUE(StartsWith(err, tc.key + ": must not contain control characters"))
        << tc.text << " -> " << err;
    for (char ch : err) EXPECT_FALSE(static_cast<unsigned char>(ch) < 0x20) << err;
  }
  // Commas are fine in paths (they never reach the mount options).
  EXPECT_TRUE(ParseConfig(R"({"volName": "v", "backend": {"root": "/d,ro"}})").ok());
}

TEST(ConfigHardeningTest, ErrorsAreOneBoundedLine) {
  std::string err = ErrorOf(
      R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"memory_bytes": "1\nfake: line"}})");
  EXPECT_TRUE(StartsWith(err, "cache.memory_bytes: ")) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  err = ErrorOf(R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"memory_bytes": ")" +
                std::string(100000, '9') + "X\"}}");
  EXPECT_TRUE(StartsWith(err, "cache.memory_bytes: ")) << err.substr(0, 100);
  EXPECT_LT(err.size(), 1200u);
}

TEST(ConfigHardeningTest, MemoryBudgetAbovePhysicalMemoryIsAWarningOnly) {
  ASSERT_GT(PhysicalMemoryBytes(), 0u);
  Result<Config> c = ParseConfig(
      R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"memory_bytes": "16384TiB"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_TRUE(StartsWith(c->warnings[0], "cache.memory_bytes: ")) << c->warnings[0];
  EXPECT_NE(c->warnings[0].find("physical memory"), std::string::npos);
  c = ParseConfig(
      R"({"volName": "v", "backend": {"root": "/d"}, "cache": {"memory_bytes": "64MiB"}})");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->warnings.empty());
}

// A scratch directory removed with its contents after the test.
class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ctfs_config_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::string cmd = "rm -rf '" + dir_ + "'";
    ASSERT_EQ(std::system(cmd.c_str()), 0);
  }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(ConfigFileTest, RefusesWhatIsNotARegularFile) {
  for (const std::string& path : {std::string("/dev/zero"), std::string("/dev/null"), dir_}) {
    Result<Config> c = LoadConfig(path);
    ASSERT_FALSE(c.ok()) << path;
    EXPECT_TRUE(StartsWith(c.status().message(), path + ": cannot read config: not a regular file"))
        << c.status().message();
  }
}

TEST_F(ConfigFileTest, AFifoIsRefusedWithoutBlocking) {
  const std::string fifo = dir_ + "/config.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto result = std::async(std::launch::async, [&] { return LoadConfig(fifo); });
  if (result.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // unblocks the reader
    if (w >= 0) ::close(w);
    FAIL() << "LoadConfig blocked on a FIFO";
  }
  Result<Config> c = result.get();
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("not a regular file (a FIFO)"), std::string::npos)
      << c.status().message();
}

TEST_F(ConfigFileTest, RefusesAFileAboveOneMebibyte) {
  std::string text = kMinimal;
  text += "\n#" + std::string(kMaxConfigBytes - text.size() - 3, 'x') + "\n";
  ASSERT_EQ(text.size(), kMaxConfigBytes);
  Result<Config> c = LoadConfig(Write("exact.json", text));
  EXPECT_TRUE(c.ok()) << c.status().ToString();  // exactly 1 MiB is fine

  const std::string big = Write("big.json", text + "#");
  c = LoadConfig(big);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), big + ": cannot read config: larger than 1 MiB");
  c = LoadConfig(Write("huge.json", std::string(2u << 20, ' ')));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("larger than 1 MiB"), std::string::npos);
}

TEST_F(ConfigFileTest, FollowsASymlinkToARegularFile) {
  const std::string target = Write("real.json", kMinimal);
  const std::string link = dir_ + "/link.json";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  Result<Config> c = LoadConfig(link);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->vol_name, "v");
  // A symlink to a device is still refused.
  const std::string dev_link = dir_ + "/zero.json";
  ASSERT_EQ(::symlink("/dev/zero", dev_link.c_str()), 0);
  EXPECT_FALSE(LoadConfig(dev_link).ok());
}

TEST_F(ConfigFileTest, LoadedErrorsAreOneLineToo) {
  const std::string path =
      Write("dup.yaml", "volName: v\nbackend: {root: /d}\nvolName: \"x\\ny\"\n");
  Result<Config> c = LoadConfig(path);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(StartsWith(c.status().message(), "volName: duplicate key")) << c.status().message();
  EXPECT_EQ(c.status().message().find('\n'), std::string::npos);
}

TEST(ConfigTest, InjectStoreLimits) {
  Result<Config> c = ParseConfig(R"({"volName": "v", "backend": {"root": "/d", "inject":
      {"latency_us": 300, "max_concurrency": 64, "bandwidth_bytes_s": 1000000000}}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend.inject.max_concurrency, 64u);
  EXPECT_EQ(c->backend.inject.bandwidth_bytes_s, 1'000'000'000u);

  c = ParseConfig(R"({"volName": "v", "backend": {"root": "/d", "inject":
      {"bandwidth_bytes_s": "1GiB"}}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend.inject.bandwidth_bytes_s, 1ull << 30);
  EXPECT_EQ(c->backend.inject.max_concurrency, 0u);  // default: unlimited

  c = ParseConfig(R"({"volName": "v", "backend": {"root": "/d", "inject": {"latency_us": 1}}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend.inject.max_concurrency, 0u);
  EXPECT_EQ(c->backend.inject.bandwidth_bytes_s, 0u);
}

TEST(ConfigTest, BadInjectStoreLimitsNameTheKey) {
  for (const char* inject : {R"({"max_concurrency": -1})", R"({"max_concurrency": 1.5})",
                             R"({"max_concurrency": "many"})", R"({"max_concurrency": 2000000})",
                             R"({"max_concurrency": [1]})"}) {
    Result<Config> c = ParseConfig(std::string(R"({"volName": "v", "backend": {"root": "/d", )") +
                                   R"("inject": )" + inject + "}}");
    ASSERT_FALSE(c.ok()) << inject;
    EXPECT_EQ(c.status().message().rfind("backend.inject.max_concurrency", 0), 0u)
        << c.status().message();
  }
  for (const char* inject :
       {R"({"bandwidth_bytes_s": -5})", R"({"bandwidth_bytes_s": "fast"})",
        R"({"bandwidth_bytes_s": "1XB"})", R"({"bandwidth_bytes_s": "2048TiB"})",
        R"({"bandwidth_bytes_s": "1e9"})"}) {
    Result<Config> c = ParseConfig(std::string(R"({"volName": "v", "backend": {"root": "/d", )") +
                                   R"("inject": )" + inject + "}}");
    ASSERT_FALSE(c.ok()) << inject;
    EXPECT_EQ(c.status().message().rfind("backend.inject.bandwidth_bytes_s", 0), 0u)
        << c.status().message();
  }
}

TEST(ConfigTest, FuseReadAheadIsASizeAndBadOnesNameTheKey) {
  Result<Config> d = ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}})");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->fuse.read_ahead_bytes, 8u << 20);
  Result<Config> c =
      ParseConfig(R"({"volName": "v", "backend": {"root": "/d"}, "fuse": {"read_ahead": "2MiB"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->fuse.read_ahead_bytes, 2u << 20);
  for (const char* bad : {R"("1000")", R"("128MiB")", "-1", R"("lots")"}) {
    Result<Config> b = ParseConfig(
        std::string(R"({"volName": "v", "backend": {"root": "/d"}, "fuse": {"read_ahead": )") +
        bad + "}}");
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_EQ(b.status().message().rfind("fuse.read_ahead", 0), 0u) << b.status().message();
  }
}

}  // namespace
}  // namespace cubetorchfs::conf
