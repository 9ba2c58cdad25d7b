#include "common/private_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace cubetorchfs {
namespace {

class PrivateDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ctfs-private-dir-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    base_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(base_); }
  std::string base_;
};

TEST_F(PrivateDirTest, SymlinkInPathFindsALinkAnywhere) {
  std::filesystem::create_directories(base_ + "/real/sub");
  std::filesystem::create_directory_symlink(base_ + "/real", base_ + "/link");
  EXPECT_EQ(SymlinkInPath(base_ + "/real/sub"), "");
  EXPECT_EQ(SymlinkInPath(base_ + "/link"), base_ + "/link");
  EXPECT_EQ(SymlinkInPath(base_ + "/link/sub/missing"), base_ + "/link");
  EXPECT_EQ(SymlinkInPath(base_ + "/real/../link/sub"), base_ + "/link");
  EXPECT_EQ(SymlinkInPath(base_ + "/missing/link"), "");  // the walk ends at a missing name
}

TEST_F(PrivateDirTest, DaemonDirIsMadeAndKeepsAnExistingMode) {
  const std::string made = base_ + "/a/b/logs";
  ASSERT_TRUE(EnsureDaemonDir(made, "logDir", "logs", CreateDir::kWithParents, 0700).ok());
  struct stat st;
  ASSERT_EQ(::stat(made.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  const std::string shared = base_ + "/shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 0755), 0);
  ASSERT_TRUE(EnsureDaemonDir(shared, "logDir", "logs", CreateDir::kNo, 0700).ok());
  ASSERT_EQ(::stat(shared.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u);  // not narrowed: it may be /var/log
  EXPECT_TRUE(EnsureDaemonDir(base_ + "/none", "logDir", "logs", CreateDir::kNo, 0700).ok());
}

TEST_F(PrivateDirTest, LinksAndOpenDirectoriesAreRefusedNamingTheKey) {
  std::filesystem::create_directories(base_ + "/real");
  std::filesystem::create_directory_symlink(base_ + "/real", base_ + "/link");
  for (const std::string& dir : {base_ + "/link", base_ + "/link/logs"}) {
    Status s = EnsureDaemonDir(dir, "logDir", "logs", CreateDir::kWithParents, 0700);
    EXPECT_FALSE(s.ok()) << dir;
    EXPECT_EQ(s.message().rfind("logDir: " + dir + ": " + base_ + "/link is a symlink", 0), 0u)
        << s.message();
    s = EnsurePrivateDir(dir, "cache.disk_dir", "data", CreateDir::kWithParents);
    EXPECT_FALSE(s.ok()) << dir;
    EXPECT_NE(s.message().find("symlink"), std::string::npos) << s.message();
  }
  EXPECT_FALSE(std::filesystem::exists(base_ + "/real/logs"));  // nothing made through it
  const std::string open = base_ + "/open";
  ASSERT_EQ(::mkdir(open.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  Status s = EnsureDaemonDir(open, "logDir", "logs", CreateDir::kNo, 0700);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("other users"), std::string::npos) << s.message();
  ASSERT_EQ(::chmod(open.c_str(), 01777), 0);  // sticky, as /tmp: fine
  EXPECT_TRUE(EnsureDaemonDir(open, "logDir", "logs", CreateDir::kNo, 0700).ok());
}

}  // namespace
}  // namespace cubetorchfs
