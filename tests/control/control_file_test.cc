// The control file in a directory other users may write to: planted symlinks are never
// followed, the file is a regular 0644 file whatever the umask, removal unlinks only our own
// file, unsafe directories are refused; and the readers' side (ReadTrustedControlFile, the
// loader's ControlSocketOf) trusts only what a root daemon or the user's own would leave.
#include "control/control_file.h"
#include "common/trusted_file.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/unique_fd.h"
#include "loader/daemon_fd.h"

namespace cubetorchfs::control {
namespace {

namespace fs = std::filesystem;

constexpr uid_t kNobody = 65534;

std::string Slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Spit(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::trunc);
  out << text;
}

class ControlFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ctfs_ctl_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::permissions(dir_, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                              fs::perms::others_read | fs::perms::others_exec);
    victim_ = dir_ / "victim";
    Spit(victim_, "precious\n");
    info_.vol_name = "vol";
    info_.mount_point = "/cfs/mnt";
    info_.control_socket = "/run/cubetorchfs/vol.sock";
    info_.pid = static_cast<int>(::getpid());
    info_.version = "test";
  }
  void TearDown() override {
    ::umask(old_umask_);
    ::unsetenv("CUBE_TORCH_CONFIG_DIR");
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path dir_;
  fs::path victim_;
  ControlInfo info_;
  mode_t old_umask_ = ::umask(022);
};

TEST_F(ControlFileTest, PlantedSymlinksAreNeverFollowed) {
  const fs::path path = dir_ / "cube_torch.config.vol";
  // The old predictable temp name, and the final name itself, point at the victim.
  fs::create_symlink(victim_, path.string() + ".tmp." + std::to_string(::getpid()));
  fs::create_symlink(victim_, path);
  ::umask(0);
  ASSERT_TRUE(WriteControlFile(path.string(), info_).ok());
  EXPECT_EQ(Slurp(victim_), "precious\n");
  struct stat st;
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0644u);  // readable by the users whose hook reads it; umask 0
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(Slurp(path), ControlFileJson(info_));
  // No temp file left, and none named like a control file.
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 3u);  // victim, the planted .tmp.<pid> link, the control file
}

TEST_F(ControlFileTest, OddNamesRoundTripThroughAJsonParser) {
  info_.mount_point = "/cfs/m\"nt\\x\n\x01";
  info_.vol_name = "v\"ol";
  const nlohmann::json j = nlohmann::json::parse(ControlFileJson(info_));
  EXPECT_EQ(j["mount_point"], info_.mount_point);
  EXPECT_EQ(j["vol_name"], info_.vol_name);
  EXPECT_EQ(j["pid"], info_.pid);
  EXPECT_EQ(j["local_ip"], "127.0.0.1");
}

TEST_F(ControlFileTest, RemovalUnlinksOnlyOurOwnFile) {
  const fs::path path = dir_ / "cube_torch.config.vol";
  ASSERT_TRUE(WriteControlFile(path.string(), info_).ok());
  // Another file (same contents, same pid) replaced ours: it stays.
  const fs::path other = dir_ / "other";
  Spit(other, ControlFileJson(info_));
  fs::rename(other, path);
  RemoveControlFile(path.string(), info_.pid);
  EXPECT_TRUE(fs::exists(path));
  // Ours again, then replaced by a symlink: the link (and its target) stay.
  ASSERT_TRUE(WriteControlFile(path.string(), info_).ok());
  const fs::path link = dir_ / "link";
  fs::create_symlink(victim_, link);
  fs::rename(link, path);
  RemoveControlFile(path.string(), info_.pid);
  EXPECT_TRUE(fs::is_symlink(path));
  EXPECT_EQ(Slurp(victim_), "precious\n");
  // Ours, untouched: removed.
  ASSERT_TRUE(WriteControlFile(path.string(), info_).ok());
  RemoveControlFile(path.string(), info_.pid + 1);  // names another daemon: kept
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(path)));
  RemoveControlFile(path.string(), info_.pid);
  EXPECT_FALSE(fs::exists(fs::symlink_status(path)));
  // Never written by us: never removed.
  Spit(path, ControlFileJson(info_));
  RemoveControlFile(path.string(), info_.pid);
  EXPECT_TRUE(fs::exists(path));
}

TEST_F(ControlFileTest, UnsafeDirectoriesAreRefused) {
  const fs::path open_dir = dir_ / "open";
  fs::create_directory(open_dir);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);  // world-writable, not sticky
  Status s = WriteControlFile((open_dir / "cube_torch.config.vol").string(), info_);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(open_dir.string()), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("sticky"), std::string::npos) << s.ToString();
  EXPECT_FALSE(fs::exists(open_dir / "cube_torch.config.vol"));
  ASSERT_EQ(::chmod(open_dir.c_str(), 0775), 0);  // group-writable, not sticky
  EXPECT_FALSE(CheckControlDir(open_dir.string()).ok());
  ASSERT_EQ(::chmod(open_dir.c_str(), 01777), 0);  // like /tmp
  EXPECT_TRUE(WriteControlFile((open_dir / "cube_torch.config.vol").string(), info_).ok());
  EXPECT_TRUE(CheckControlDir("/tmp").ok());
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a directory of another user";
  const fs::path theirs = dir_ / "theirs";
  fs::create_directory(theirs);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  s = WriteControlFile((theirs / "cube_torch.config.vol").string(), info_);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("uid 65534"), std::string::npos) << s.ToString();
}

TEST_F(ControlFileTest, ControlFilePathFollowsTheEnvironment) {
  ::setenv("CUBE_TORCH_CONFIG_DIR", dir_.c_str(), 1);
  EXPECT_EQ(ControlFilePath("v"), (dir_ / "cube_torch.config.v").string());
  ::unsetenv("CUBE_TORCH_CONFIG_DIR");
  EXPECT_EQ(ControlFilePath("v"), "/tmp/cube_torch.config.v");
}

TEST_F(ControlFileTest, ReadersTrustOnlyRootOrTheirOwnPlainFiles) {
  const fs::path path = dir_ / "cube_torch.config.vol";
  EXPECT_TRUE(ReadTrustedControlFile(path.string()).status().IsNotFound());
  ASSERT_TRUE(WriteControlFile(path.string(), info_).ok());
  Result<std::string> text = ReadTrustedControlFile(path.string());
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, ControlFileJson(info_));
  ASSERT_EQ(::chmod(path.c_str(), 0664), 0);
  EXPECT_FALSE(ReadTrustedControlFile(path.string()).ok());
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  fs::remove(path);
  fs::create_symlink(victim_, path);
  EXPECT_FALSE(ReadTrustedControlFile(path.string()).ok());
  fs::remove(path);
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a file of another user";
  ASSERT_TRUE(WriteControlFile(path.string(), info_).ok());
  ASSERT_EQ(::chown(path.c_str(), kNobody, kNobody), 0);
  Result<std::string> theirs = ReadTrustedControlFile(path.string());
  ASSERT_FALSE(theirs.ok());
  EXPECT_NE(theirs.status().message().find("uid 65534"), std::string::npos);
}

// A listening unix socket at `path` (closed with the returned descriptor).
UniqueFd Listen(const fs::path& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(fd.get(), 1), 0);
  return fd;
}

TEST_F(ControlFileTest, LoaderTrustsOnlyRootOrItsOwnControlFileAndSocket) {
  ::setenv("CUBE_TORCH_CONFIG_DIR", dir_.c_str(), 1);
  const fs::path sock_dir = dir_ / "run";
  fs::create_directory(sock_dir);
  ::chmod(sock_dir.c_str(), 0755);
  const fs::path sock = sock_dir / "vol.sock";
  UniqueFd listener = Listen(sock);
  info_.control_socket = sock.string();
  const fs::path path = dir_ / "cube_torch.config.vol";
  ASSERT_TRUE(WriteControlFile(path.string(), info_).ok());
  Result<std::string> got = loader::ControlSocketOf("vol");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, sock.string());

  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);  // writable by anyone
  EXPECT_FALSE(loader::ControlSocketOf("vol").ok());
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);

  ASSERT_EQ(::chmod(sock_dir.c_str(), 0777), 0);  // anyone may swap the socket
  EXPECT_FALSE(loader::ControlSocketOf("vol").ok());
  ASSERT_EQ(::chmod(sock_dir.c_str(), 0755), 0);

  const fs::path elsewhere = dir_ / "elsewhere";
  fs::rename(path, elsewhere);
  fs::create_symlink(elsewhere, path);  // a symlink to a trusted file is still a symlink
  Result<std::string> linked = loader::ControlSocketOf("vol");
  ASSERT_FALSE(linked.ok());
  EXPECT_NE(linked.status().message().find("symlink"), std::string::npos);
  fs::remove(path);
  fs::rename(elsewhere, path);
  ASSERT_TRUE(loader::ControlSocketOf("vol").ok());

  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make files of another user";
  ASSERT_EQ(::chown(sock.c_str(), kNobody, kNobody), 0);
  Result<std::string> their_sock = loader::ControlSocketOf("vol");
  ASSERT_FALSE(their_sock.ok());
  EXPECT_NE(their_sock.status().message().find("uid 65534"), std::string::npos);
  ASSERT_EQ(::chown(sock.c_str(), 0, 0), 0);
  ASSERT_EQ(::chown(path.c_str(), kNobody, kNobody), 0);
  Result<std::string> their_file = loader::ControlSocketOf("vol");
  ASSERT_FALSE(their_file.ok());
  EXPECT_NE(their_file.status().message().find("uid 65534"), std::string::npos);
  EXPECT_NE(their_file.status().message().find(path.string()), std::string::npos);
}

}  // namespace
}  // namespace cubetorchfs::control
