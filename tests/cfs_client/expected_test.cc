// Expected (cfs_client/backend.h): a posix store acts on the objects a thread binds, checked on
// the descriptor it acts through, and on nothing swapped in at their paths since.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "cfs_client/backend.h"

namespace cubetorchfs::cfs_client {
namespace {

namespace stdfs = std::filesystem;

class ExpectedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = stdfs::temp_directory_path() / ("ctfs_expected_" + std::to_string(::getpid()));
    stdfs::remove_all(root_);
    stdfs::create_directories(root_ / "team/x");
    stdfs::create_directories(root_ / "team/p");
    Put("team/x/f", "mine");
    Put("team/p/f", "theirs");
    store_ = NewPosixBackend(root_.string()).value();
    x_ = store_->Stat("team/x").value().StoreId();
    f_ = store_->Stat("team/x/f").value().StoreId();
    // The store-side swap: the checked directory aside, another one at its name.
    stdfs::rename(root_ / "team/x", root_ / "team/aside");
    stdfs::rename(root_ / "team/p", root_ / "team/x");
  }
  void TearDown() override { stdfs::remove_all(root_); }
  void Put(const std::string& rel, const std::string& bytes) {
    std::ofstream(root_ / rel, std::ios::binary) << bytes;
  }
  std::string Get(const std::string& rel) {
    std::ifstream in(root_ / rel, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  static void ExpectStale(const Status& s) {
    EXPECT_EQ(s.code(), Status::Code::kStale) << s.ToString();
  }

  stdfs::path root_;
  std::unique_ptr<Backend> store_;
  uint64_t x_ = 0, f_ = 0;
};

TEST_F(ExpectedTest, ALookupInASwappedDirectoryIsStale) {
  ASSERT_NE(x_, 0u);
  {
    const Expected::Scope in_dir({{"team/x", x_}});
    ExpectStale(store_->Stat("team/x/f").status());
    char buf[16];
    ExpectStale(store_->StatRead("team/x/f", sizeof(buf), buf).status());
    ExpectStale(store_->ReadLink("team/x/f").status());
  }
  // Unbound, the path is resolved as it stands (what a caller that checked nothing gets).
  EXPECT_TRUE(store_->Stat("team/x/f").ok());
  // Bound to the directory that is there now: found.
  const Expected::Scope now({{"team/x", store_->Stat("team/x").value().StoreId()}});
  EXPECT_TRUE(store_->Stat("team/x/f").ok());
}

TEST_F(ExpectedTest, AListingOfASwappedDirectoryIsStale) {
  const Expected::Scope self({{"team/x", x_}});
  ExpectStale(store_->ListPages("team/x").status());
  ExpectStale(store_->List("team/x").status());
}

TEST_F(ExpectedTest, ChangesInASwappedDirectoryDoNothing) {
  const Expected::Scope in_dir({{"team/x", x_}});
  ExpectStale(store_->Unlink("team/x/f"));
  ExpectStale(store_->OpenWrite("team/x/new", {.create = true}).status());
  ExpectStale(store_->Mkdir("team/x/d", 0755, -1, -1).status());
  ExpectStale(store_->Symlink("f", "team/x/l", -1, -1).status());
  ExpectStale(store_->Rename("team/x/f", "team/x/g", false));
  EXPECT_EQ(Get("team/x/f"), "theirs");
  EXPECT_FALSE(stdfs::exists(root_ / "team/x/new"));
  EXPECT_FALSE(stdfs::exists(root_ / "team/x/d"));
  EXPECT_FALSE(stdfs::is_symlink(root_ / "team/x/l"));
  EXPECT_FALSE(stdfs::exists(root_ / "team/x/g"));
}

TEST_F(ExpectedTest, AFileSwappedInIsNotChangedTruncatedOrLinked) {
  // The checked directory is back; the file at the name is another one.
  stdfs::rename(root_ / "team/x", root_ / "team/p");
  stdfs::rename(root_ / "team/aside", root_ / "team/x");
  stdfs::rename(root_ / "team/x/f", root_ / "team/x/mine");
  stdfs::rename(root_ / "team/p/f", root_ / "team/x/f");
  ::chmod((root_ / "team/x/f").c_str(), 0600);
  const Expected::Scope objects({{"team/x", x_}, {"team/x/f", f_}});
  AttrChange chmod;
  chmod.mode = 0666;
  ExpectStale(store_->SetAttr("team/x/f", chmod).status());
  struct stat st;
  ASSERT_EQ(::stat((root_ / "team/x/f").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  ExpectStale(store_->OpenWrite("team/x/f", {.truncate = true}).status());
  EXPECT_EQ(Get("team/x/f"), "theirs");
  ExpectStale(store_->Link("team/x/f", "team/x/hard").status());
  EXPECT_FALSE(stdfs::exists(root_ / "team/x/hard"));
  // The file the binding names, where it is now, is changed through its descriptor.
  const Expected::Scope mine({{"team/x/mine", f_}});
  ASSERT_TRUE(store_->SetAttr("team/x/mine", chmod).ok());
  ASSERT_EQ(::stat((root_ / "team/x/mine").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0666u);
  ASSERT_TRUE(store_->Link("team/x/mine", "team/x/hard").ok());
  EXPECT_EQ(Get("team/x/hard"), "mine");
}

TEST_F(ExpectedTest, ScopesNestAndEnd) {
  const uint64_t now = store_->Stat("team/x").value().StoreId();
  {
    const Expected::Scope outer({{"team/x", x_}});
    {
      const Expected::Scope inner({{"team/x", now}});
      EXPECT_TRUE(store_->Stat("team/x/f").ok());  // the innermost binding wins
    }
    ExpectStale(store_->Stat("team/x/f").status());
  }
  EXPECT_FALSE(Expected::Any());
  EXPECT_TRUE(store_->Stat("team/x/f").ok());
}

}  // namespace
}  // namespace cubetorchfs::cfs_client
