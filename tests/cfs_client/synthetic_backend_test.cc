#include <gtest/gtest.h>
#include <sys/stat.h>

#include <set>
#include <string>

#include "cfs_client/backend.h"
#include "tests/test_util.h"

namespace cubetorchfs::cfs_client {
namespace {

std::unique_ptr<Backend> Make(uint64_t dirs, uint64_t files, uint64_t lo = 1000, uint64_t hi = 3000,
                              uint64_t seed = 1) {
  conf::SyntheticOptions o;
  o.dirs = dirs;
  o.files_per_dir = files;
  o.min_bytes = lo;
  o.max_bytes = hi;
  o.seed = seed;
  return NewSyntheticBackend(o);
}

std::string ReadAll(Backend& b, const std::string& path) {
  FileAttr a = b.Stat(path).value();
  std::string out(a.size, '\0');
  EXPECT_EQ(b.Read(path, a.Version(), 0, out.size(), out.data()).value(), a.size);
  return out;
}

TEST(SyntheticBackendTest, NamesTheTreeItsShapeSays) {
  auto b = Make(3, 5);
  EXPECT_TRUE(b->Stat("").value().IsDir());
  EXPECT_TRUE(b->Stat("n00000002").value().IsDir());
  FileAttr f = b->Stat("n00000002/n00000002_4.JPEG").value();
  EXPECT_TRUE(f.IsRegular());
  EXPECT_EQ(f.mode & 07777, 0444u);
  EXPECT_GE(f.size, 1000u);
  EXPECT_LE(f.size, 3000u);
  for (const char* missing :
       {"n00000003", "n0000002", "n000000002", "x00000002", "n00000002/n00000002_5.JPEG",
        "n00000002/n00000002_04.JPEG", "n00000002/n00000001_4.JPEG", "n00000002/n00000002_4.jpeg",
        "n00000002/n00000002_.JPEG", "n00000002/n00000002_-1.JPEG", "n00000002/other"})
    EXPECT_EQ(b->Stat(missing).status().code(), Status::Code::kNotFound) << missing;
  EXPECT_EQ(b->Stat("n00000002/n00000002_4.JPEG/x").status().code(), Status::Code::kNotDirectory);
  EXPECT_EQ(b->Stat("n00000002/nope/x").status().code(), Status::Code::kNotFound);
}

TEST(SyntheticBackendTest, ListingsAgreeWithStat) {
  auto b = Make(3, 5);
  auto root = b->List("").value();
  ASSERT_EQ(root.size(), 3u);
  EXPECT_EQ(root[1].name, "n00000001");
  auto dir = b->List("n00000001").value();
  ASSERT_EQ(dir.size(), 5u);
  std::set<uint64_t> sizes;
  for (const auto& e : dir) {
    FileAttr a = b->Stat("n00000001/" + e.name).value();
    EXPECT_EQ(a.Version(), e.attr.Version()) << e.name;
    sizes.insert(a.size);
  }
  EXPECT_GT(sizes.size(), 1u) << "sizes vary from file to file";
  EXPECT_EQ(b->List("n00000001/n00000001_0.JPEG").status().code(), Status::Code::kNotDirectory);
}

TEST(SyntheticBackendTest, BytesDeriveFromPathAndOffsetAndVersionsAreChecked) {
  auto b = Make(2, 2, 5000, 5000);
  const std::string a = ReadAll(*b, "n00000000/n00000000_0.JPEG");
  EXPECT_EQ(a, ReadAll(*b, "n00000000/n00000000_0.JPEG"));
  EXPECT_NE(a, ReadAll(*b, "n00000000/n00000000_1.JPEG"));
  EXPECT_NE(a, ReadAll(*b, "n00000001/n00000001_0.JPEG"));
  FileAttr attr = b->Stat("n00000000/n00000000_0.JPEG").value();
  char part[100];
  EXPECT_EQ(b->Read("n00000000/n00000000_0.JPEG", attr.Version(), 1234, 100, part).value(), 100u);
  EXPECT_EQ(std::string(part, 100), a.substr(1234, 100));
  EXPECT_EQ(b->Read("n00000000/n00000000_0.JPEG", attr.Version(), 4990, 100, part).value(), 10u);
  EXPECT_EQ(b->Read("n00000000/n00000000_0.JPEG", {attr.size + 1, attr.mtime_ns}, 0, 10, part)
                .status()
                .code(),
            Status::Code::kStale);
  // Another seed is another version of every file.
  auto other = Make(2, 2, 5000, 5000, 2);
  EXPECT_NE(other->Stat("n00000000/n00000000_0.JPEG").value().Version(), attr.Version());
  char buf[6000];
  Backend::Fetched got = b->StatRead("n00000000/n00000000_0.JPEG", sizeof(buf), buf).value();
  EXPECT_EQ(got.bytes, 5000u);
  EXPECT_EQ(std::string(buf, got.bytes), a);
}

TEST(SyntheticBackendTest, EveryChangeIsRefusedAsReadOnly) {
  auto b = Make(1, 1);
  EXPECT_EQ(b->OpenWrite("n00000000/new", {}).status().code(), Status::Code::kReadOnly);
  EXPECT_EQ(b->Mkdir("d", 0755, -1, -1).status().code(), Status::Code::kReadOnly);
  EXPECT_EQ(b->Unlink("n00000000/n00000000_0.JPEG").code(), Status::Code::kReadOnly);
  EXPECT_EQ(b->Rename("n00000000", "x", false).code(), Status::Code::kReadOnly);
  EXPECT_EQ(b->SetAttr("n00000000", {}).status().code(), Status::Code::kReadOnly);
}

TEST(SyntheticBackendTest, AHundredMillionFilesCostNothingUntilListed) {
  auto b = Make(100'000, 1'000);
  EXPECT_TRUE(b->Stat("n00099999/n00099999_999.JPEG").value().IsRegular());
  EXPECT_EQ(b->StatFs().value().files, 100'000'000ull + 100'000 + 1);
  EXPECT_EQ(b->List("").value().size(), 100'000u);
  EXPECT_EQ(b->List("n00012345").value().size(), 1'000u);
  // A page at a time, as an open directory is read.
  EXPECT_EQ(testing::ListInPages(*b, "", 4096).size(), 100'000u);
  EXPECT_EQ(testing::ListInPages(*b, "n00012345", 333).size(), 1'000u);
  EXPECT_EQ(b->ListPages("n00012345/n00012345_1.JPEG").status().code(),
            Status::Code::kNotDirectory);
}

}  // namespace
}  // namespace cubetorchfs::cfs_client
