#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>

#include <filesystem>
#include <fstream>

#include "cfs_client/backend.h"
#include "tests/test_util.h"

namespace cubetorchfs::cfs_client {
namespace {

namespace fs = std::filesystem;

class PosixBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("ctfs_posix_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "dir" / "sub");
    Write("dir/file", "hello world");
    Write("empty", "");
    fs::create_symlink("dir/file", root_ / "link");
    auto b = NewPosixBackend(root_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    backend_ = std::move(b).value();
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const std::string& rel, const std::string& data) {
    std::ofstream(root_ / rel, std::ios::binary) << data;
  }

  fs::path root_;
  std::unique_ptr<Backend> backend_;
};

TEST_F(PosixBackendTest, StatDistinguishesTypesWithoutFollowingLinks) {
  EXPECT_TRUE(backend_->Stat("")->IsDir());
  EXPECT_TRUE(backend_->Stat("dir")->IsDir());
  EXPECT_TRUE(backend_->Stat("dir/file")->IsRegular());
  EXPECT_EQ(backend_->Stat("dir/file")->size, 11u);
  EXPECT_TRUE(backend_->Stat("link")->IsSymlink());
  EXPECT_EQ(backend_->ReadLink("link").value(), "dir/file");
}

TEST_F(PosixBackendTest, MissingPathsAreNotFound) {
  EXPECT_EQ(backend_->Stat("nope").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(backend_->List("nope").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(backend_->Stat("dir/file/x").status().code(), Status::Code::kNotDirectory);
}

// A directory read a page at a time holds its descriptor open between pages and lists every
// entry once; a name removed between pages is not listed.
TEST_F(PosixBackendTest, ListsInPages) {
  fs::create_directories(root_ / "flat");
  for (int i = 0; i < 1000; ++i) std::ofstream(root_ / "flat" / std::to_string(i)) << i;
  EXPECT_EQ(testing::ListInPages(*backend_, "flat", 64).size(), 1000u);
  EXPECT_EQ(testing::ListInPages(*backend_, "flat", 1000).size(), 1000u);
  EXPECT_EQ(testing::ListInPages(*backend_, "flat", 5000).size(), 1000u);
  EXPECT_EQ(backend_->ListPages("nope").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(backend_->ListPages("flat/1").status().code(), Status::Code::kNotDirectory);
}

TEST_F(PosixBackendTest, ListReturnsEntriesWithAttributes) {
  auto entries = backend_->List("");
  ASSERT_TRUE(entries.ok());
  std::map<std::string, FileAttr> by_name;
  for (const auto& e : *entries) by_name[e.name] = e.attr;
  EXPECT_EQ(by_name.size(), 3u);
  EXPECT_TRUE(by_name.at("dir").IsDir());
  EXPECT_TRUE(by_name.at("link").IsSymlink());
  EXPECT_EQ(by_name.at("empty").size, 0u);
}

TEST_F(PosixBackendTest, ReadsRangesAndShortAtEnd) {
  FileVersion v = backend_->Stat("dir/file")->Version();
  char buf[32] = {};
  EXPECT_EQ(backend_->Read("dir/file", v, 6, 5, buf).value(), 5u);
  EXPECT_EQ(std::string(buf, 5), "world");
  EXPECT_EQ(backend_->Read("dir/file", v, 6, 32, buf).value(), 5u);
  EXPECT_EQ(backend_->Read("dir/file", v, 100, 4, buf).value(), 0u);
}

TEST_F(PosixBackendTest, ReadOfAChangedFileIsStale) {
  FileVersion v = backend_->Stat("dir/file")->Version();
  Write("dir/file", "a different, longer content");
  char buf[64];
  EXPECT_TRUE(backend_->Read("dir/file", v, 0, 11, buf).status().IsStale());
}

TEST_F(PosixBackendTest, ReadOfADirectoryFails) {
  FileVersion v = backend_->Stat("dir")->Version();
  char buf[8];
  EXPECT_FALSE(backend_->Read("dir", v, 0, 8, buf).ok());
}

TEST_F(PosixBackendTest, StatFsAnswers) {
  auto s = backend_->StatFs();
  ASSERT_TRUE(s.ok());
  EXPECT_GT(s->blocks, 0u);
}

TEST(PosixBackendRootTest, UnusableRootsAreRefused) {
  EXPECT_EQ(NewPosixBackend("/nonexistent/cubetorchfs").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(NewPosixBackend("/etc/hostname").status().code(), Status::Code::kNotDirectory);
}

TEST_F(PosixBackendTest, WritesGoThroughToTheFile) {
  OpenWriteOptions o;
  o.create = true;
  o.exclusive = true;
  Result<std::unique_ptr<WritableFile>> f = backend_->OpenWrite("dir/new", o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ((*f)->Write(0, "hello", 5).value(), 5u);
  ASSERT_EQ((*f)->Write(10, "x", 1).value(), 1u);  // sparse
  std::ifstream in(root_ / "dir/new", std::ios::binary);
  std::string got((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(got, std::string("hello\0\0\0\0\0x", 11));  // in the file before any flush
  char buf[16];
  EXPECT_EQ((*f)->Read(8, 16, buf).value(), 3u);
  ASSERT_TRUE((*f)->Truncate(2).ok());
  EXPECT_EQ((*f)->Stat()->size, 2u);
  ASSERT_TRUE((*f)->Sync().ok());
  EXPECT_EQ(backend_->OpenWrite("dir/new", o).status().code(), Status::Code::kExists);
  EXPECT_EQ(backend_->OpenWrite("dir", {}).status().code(), Status::Code::kIsDirectory);
}

TEST_F(PosixBackendTest, NamespaceErrorsKeepTheirErrno) {
  EXPECT_EQ(backend_->Mkdir("dir", 0755, -1, -1).status().code(), Status::Code::kExists);
  EXPECT_EQ(backend_->Rmdir("dir").code(), Status::Code::kNotEmpty);
  EXPECT_EQ(backend_->Unlink("dir").code(), Status::Code::kIsDirectory);
  EXPECT_EQ(backend_->Rmdir("missing").code(), Status::Code::kNotFound);
  EXPECT_EQ(backend_->Rename("dir/file", "dir/sub", false).code(), Status::Code::kIsDirectory);
  EXPECT_EQ(backend_->Rename("dir/file", "empty", true).code(), Status::Code::kExists);
  ASSERT_TRUE(backend_->Rename("dir/file", "empty", false).ok());
  EXPECT_EQ(backend_->Stat("empty")->size, 11u);
  ASSERT_TRUE(backend_->Mkdir("d2", 0700, -1, -1).ok());
  EXPECT_EQ(backend_->Stat("d2")->mode & 0777, 0700u);
  AttrChange c;
  c.mode = 0600;
  EXPECT_EQ(backend_->SetAttr("empty", c)->mode & 0777, 0600u);
  ASSERT_TRUE(backend_->SyncDir("").ok());
  Status s = backend_->Link("missing", "l2").status();
  EXPECT_EQ(s.code(), Status::Code::kNotFound);
  // EPERM is not EACCES: link(2) of a directory.
  s = backend_->Link("dir", "l3").status();
  EXPECT_EQ(s.code(), Status::Code::kErrno);
  EXPECT_EQ(s.errno_value(), EPERM);
}

TEST_F(PosixBackendTest, FlushAndCloseReportSuccessOnALocalFile) {
  OpenWriteOptions o;
  o.create = true;
  Result<std::unique_ptr<WritableFile>> f = backend_->OpenWrite("dir/closed", o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE((*f)->Write(0, "abc", 3).ok());
  ASSERT_TRUE((*f)->Flush().ok());  // closes a duplicate: the handle goes on working
  ASSERT_TRUE((*f)->Write(3, "d", 1).ok());
  ASSERT_TRUE((*f)->Flush().ok());
  EXPECT_TRUE((*f)->Close().ok());
  EXPECT_TRUE((*f)->Close().ok());  // once closed, nothing more to report
  EXPECT_EQ(backend_->Stat("dir/closed")->size, 4u);
}

// A store with a symlink to a directory outside the root, and one inside it: no operation
// may act through either (the kernel follows the links users see, with their rights).
class PosixBeneathRootTest : public PosixBackendTest {
 protected:
  void SetUp() override {
    PosixBackendTest::SetUp();
    outside_ = root_.string() + "_outside";
    fs::remove_all(outside_);
    fs::create_directories(outside_ / "d");
    std::ofstream(outside_ / "secret") << "secret";
    std::ofstream(outside_ / "d" / "f") << "deep";
    fs::create_symlink(outside_, root_ / "esc");
    fs::create_symlink("dir", root_ / "inner");
  }
  void TearDown() override {
    fs::remove_all(outside_);
    PosixBackendTest::TearDown();
  }
  fs::path outside_;
};

TEST_F(PosixBeneathRootTest, NoReadOrOpenThroughASymlinkedDirectory) {
  char buf[64];
  for (const char* p : {"esc/secret", "esc/d/f", "inner/file"}) {
    SCOPED_TRACE(p);
    EXPECT_FALSE(backend_->Stat(p).ok());
    EXPECT_FALSE(backend_->StatRead(p, sizeof(buf), buf).ok());
    EXPECT_FALSE(backend_->Read(p, FileVersion{6, 0}, 0, sizeof(buf), buf).ok());
    EXPECT_FALSE(backend_->OpenReadFd(p, FileVersion{6, 0}).ok());
    EXPECT_FALSE(backend_->ReadLink(p).ok());
  }
  EXPECT_FALSE(backend_->List("esc").ok());
  EXPECT_FALSE(backend_->List("esc/d").ok());
  EXPECT_FALSE(backend_->List("inner").ok());
  // The links themselves are entries like any other.
  EXPECT_TRUE(backend_->Stat("esc")->IsSymlink());
  EXPECT_EQ(backend_->ReadLink("esc").value(), outside_.string());
}

TEST_F(PosixBeneathRootTest, NoChangeThroughASymlinkedDirectory) {
  OpenWriteOptions create;
  create.create = true;
  EXPECT_FALSE(backend_->OpenWrite("esc/new", create).ok());
  EXPECT_FALSE(backend_->OpenWrite("esc/secret", OpenWriteOptions{}).ok());
  EXPECT_FALSE(backend_->Mkdir("esc/newdir", 0755, -1, -1).ok());
  EXPECT_FALSE(backend_->Unlink("esc/secret").ok());
  EXPECT_FALSE(backend_->Rmdir("esc/d").ok());
  EXPECT_FALSE(backend_->Rename("esc/secret", "stolen", false).ok());
  EXPECT_FALSE(backend_->Rename("dir/file", "esc/planted", false).ok());
  EXPECT_FALSE(backend_->Link("esc/secret", "hard").ok());
  EXPECT_FALSE(backend_->Symlink("x", "esc/sym", -1, -1).ok());
  AttrChange chmod;
  chmod.mode = 0666;
  EXPECT_FALSE(backend_->SetAttr("esc/secret", chmod).ok());
  AttrChange times;
  times.mtime_ns = 0;
  EXPECT_FALSE(backend_->SetAttr("esc/secret", times).ok());
  EXPECT_FALSE(backend_->SyncDir("esc/d").ok());
  // Nothing outside changed.
  EXPECT_TRUE(fs::exists(outside_ / "secret"));
  EXPECT_TRUE(fs::exists(outside_ / "d" / "f"));
  EXPECT_FALSE(fs::exists(outside_ / "new"));
  EXPECT_FALSE(fs::exists(outside_ / "newdir"));
  EXPECT_FALSE(fs::exists(root_ / "stolen"));
  EXPECT_EQ(fs::status(outside_ / "secret").permissions() & fs::perms::others_write,
            fs::perms::none);
}

TEST_F(PosixBeneathRootTest, ChmodOfASymlinkNeverChangesItsTarget) {
  const auto before = fs::status(outside_ / "secret").permissions();
  fs::create_symlink(outside_ / "secret", root_ / "dir" / "fl");
  AttrChange chmod;
  chmod.mode = 0666;
  EXPECT_FALSE(backend_->SetAttr("dir/fl", chmod).ok());
  EXPECT_EQ(fs::status(outside_ / "secret").permissions(), before);
}

TEST_F(PosixBeneathRootTest, DotDotAndEmptyComponentsAreRefused) {
  for (const char* p : {"..", "../x", "dir/../../x", "dir//file", "./dir", "dir/.", "/dir"}) {
    SCOPED_TRACE(p);
    EXPECT_FALSE(backend_->Stat(p).ok());
  }
}

TEST_F(PosixBeneathRootTest, ADirectorySwappedForASymlinkIsNotFollowed) {
  ASSERT_TRUE(backend_->Stat("dir/sub").ok());
  fs::rename(root_ / "dir", root_ / "dir.old");
  fs::create_symlink(outside_, root_ / "dir");
  EXPECT_FALSE(backend_->Stat("dir/secret").ok());
  char buf[16];
  EXPECT_FALSE(backend_->StatRead("dir/secret", sizeof(buf), buf).ok());
}

TEST_F(PosixBackendTest, AFifoInTheStoreIsRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo((root_ / "fifo").c_str(), 0644), 0);
  char buf[8];
  // With a blocking open this would wait forever for a writer.
  EXPECT_EQ(backend_->StatRead("fifo", sizeof(buf), buf).status().code(),
            Status::Code::kIsDirectory);
  EXPECT_FALSE(backend_->OpenReadFd("fifo", FileVersion{}).ok());
}

TEST_F(PosixBackendTest, PathsLongerThanPathMaxWork) {
  // 40 levels of 200-byte names: about 8 KB, twice PATH_MAX.
  std::string rel;
  const std::string name(200, 'n');
  for (int i = 0; i < 40; ++i) {
    rel += (rel.empty() ? "" : "/") + name;
    ASSERT_TRUE(backend_->Mkdir(rel, 0755, -1, -1).ok()) << i;
  }
  ASSERT_GT(rel.size(), 4096u);
  OpenWriteOptions create;
  create.create = true;
  auto f = backend_->OpenWrite(rel + "/file", create);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE((*f)->Write(0, "deep", 4).ok());
  ASSERT_TRUE((*f)->Close().ok());
  auto a = backend_->Stat(rel + "/file");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->size, 4u);
  char buf[8];
  auto r = backend_->StatRead(rel + "/file", sizeof(buf), buf);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(std::string(buf, r->bytes), "deep");
  EXPECT_EQ(backend_->List(rel)->size(), 1u);
  EXPECT_TRUE(backend_->Unlink(rel + "/file").ok());
}

}  // namespace
}  // namespace cubetorchfs::cfs_client
