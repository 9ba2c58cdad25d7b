#include "daemon/command_line.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

namespace cubetorchfs::daemon {
namespace {

TEST(CommandLineTest, ConfigFlagForm) {
  auto cl = ParseCommandLine({"-c", "c.json", "/mnt", "-f", "-d", "-o", "allow_other,ro"});
  ASSERT_TRUE(cl.ok()) << cl.status().ToString();
  EXPECT_EQ(cl->config_path, "c.json");
  EXPECT_EQ(cl->mount_point, "/mnt");
  EXPECT_TRUE(cl->foreground);
  EXPECT_TRUE(cl->debug);
  EXPECT_EQ(cl->mount_options, (std::vector<std::string>{"allow_other", "ro"}));
}

TEST(CommandLineTest, MountHelperForm) {
  auto cl = ParseCommandLine({"/etc/c.json", "/mnt", "-o", "rw,dev", "-orw"});
  ASSERT_TRUE(cl.ok());
  EXPECT_EQ(cl->config_path, "/etc/c.json");
  EXPECT_EQ(cl->mount_point, "/mnt");
  EXPECT_FALSE(cl->foreground);
  EXPECT_EQ(cl->mount_options.size(), 3u);
}

TEST(CommandLineTest, MountPointIsOptional) {
  auto cl = ParseCommandLine({"-c", "c.json"});
  ASSERT_TRUE(cl.ok());
  EXPECT_EQ(cl->mount_point, "");
}

TEST(CommandLineTest, Errors) {
  EXPECT_FALSE(ParseCommandLine({}).ok());
  EXPECT_FALSE(ParseCommandLine({"-c"}).ok());
  EXPECT_FALSE(ParseCommandLine({"-c", "x", "a", "b"}).ok());
  EXPECT_FALSE(ParseCommandLine({"-c", "x", "--bogus"}).ok());
  EXPECT_TRUE(ParseCommandLine({"--help"})->help);
  EXPECT_TRUE(ParseCommandLine({"--version"})->version);
}

}  // namespace
}  // namespace cubetorchfs::daemon

#include <fcntl.h>
#include <sys/socket.h>

#include <unistd.h>
#include <cstring>

#include "daemon/supervisor.h"
#include "fuse/handle_table.h"

namespace cubetorchfs::daemon {
namespace {

TEST(TakeoverTest, ParsesDescriptorsAndRefusesWhatIsNotOpenOrMalformed) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  const std::string r = std::to_string(p[0]);
  auto t = ParseTakeover("fuse=" + r + ",generation=4,state=" + r);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->fuse_fd, p[0]);
  EXPECT_EQ(t->generation, 4u);
  EXPECT_EQ(t->state_fd, p[0]);
  EXPECT_EQ(t->init_fd, -1);
  EXPECT_EQ(t->channel_fd, -1);
  EXPECT_EQ(t->cache_fd, -1);
  auto c = ParseTakeover("fuse=" + r + ",generation=5,table=" + r + ",cache=" + r);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->table_fd, p[0]);
  EXPECT_EQ(c->cache_fd, p[0]);
  EXPECT_EQ(c->passthrough_fd, -1);
  auto pt = ParseTakeover("fuse=" + r + ",generation=6,passthrough=" + r);
  ASSERT_TRUE(pt.ok()) << pt.status().ToString();
  EXPECT_EQ(pt->passthrough_fd, p[0]);
  EXPECT_FALSE(ParseTakeover("fuse=" + r + ",passthrough=999999").ok());  // not open
  EXPECT_FALSE(ParseTakeover("fuse=" + r + ",cache=999999").ok());        // not open
  for (const std::string& bad : std::vector<std::string>{
           "", "generation=1", "fuse=" + r + ",bogus=1", "fuse=" + r + ",init=x",
           "fuse=" + r + ",init=-1", "fuse=" + r + ",generation=8388608", "fuse=999999",
           "fuse=" + r + ",channel"})
    EXPECT_FALSE(ParseTakeover(bad).ok()) << bad;
  ::close(p[0]);
  ::close(p[1]);
}

TEST(TakeoverTest, CommandLineTakesTheInternalFlagsAndBaseArgvDropsThem) {
  auto cl = ParseCommandLine({"-c", "/c.json", "/mnt", "--takeover", "fuse=3"});
  ASSERT_TRUE(cl.ok());
  EXPECT_EQ(cl->takeover, "fuse=3");
  EXPECT_EQ(BaseArgv({"x", "-c", "/c", "--resume", "fuse=3", "/m", "--takeover", "fuse=4"}),
            (std::vector<std::string>{"x", "-c", "/c", "/m"}));
}

TEST(TakeoverTest, MessagesCarryPayloadAndDescriptor) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  Result<int> memfd = MemfdWith("t", std::string(100000, 'z'));
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(SendMessage(sv[0], kMsgState, "abc", *memfd));
  char buf[16];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  iovec iov{buf, sizeof buf};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  ASSERT_EQ(::recvmsg(sv[1], &mh, 0), 4);
  EXPECT_EQ(std::string(buf, 4), "Sabc");
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&mh)), sizeof fd);
  Result<std::string> all = ReadAllFd(fd);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, std::string(100000, 'z'));
  for (int f : {fd, *memfd, sv[0], sv[1]}) ::close(f);
}

TEST(HandleTableTest, NumbersAreAboveEarlierGenerationsAndUnknownOnesAreNotFound) {
  fuse::HandleTable<int> t;
  t.SetGeneration(2);
  const uint64_t a = t.Insert(std::make_unique<int>(7));
  EXPECT_EQ(a, (uint64_t{2} << 40) + 1);
  EXPECT_EQ(*t.Get(a), 7);
  EXPECT_EQ(t.Get(5), nullptr);  // a number an earlier process gave out
  EXPECT_EQ(*t.Adopt(5, std::make_unique<int>(8)), 8);
  EXPECT_EQ(*t.Adopt(5, std::make_unique<int>(9)), 8);  // the first adoption stays
  EXPECT_EQ(*t.Take(a), 7);
  EXPECT_EQ(t.Take(a), nullptr);
  EXPECT_EQ(t.size(), 1u);
}

TEST(CommandLineTest, TheHelpListsEveryCommand) {
  const std::string help = UsageText();
  ASSERT_FALSE(Commands().empty());
  for (const Command& c : Commands()) {
    EXPECT_NE(help.find("cubetorchfs " + std::string(c.name) + " " + std::string(c.synopsis)),
              std::string::npos)
        << c.name;
    EXPECT_NE(help.find("  " + std::string(c.name) + " "), std::string::npos) << c.name;
  }
}

TEST(CommandLineTest, ADetachedDaemonWithNoLogDirLogsToAFileOfItsUser) {
  EXPECT_EQ(DefaultLogDir(0, "/x/state", "/root"), "/var/log/cubetorchfs");
  EXPECT_EQ(DefaultLogDir(1000, "/home/u/st", "/home/u"), "/home/u/st/cubetorchfs");
  EXPECT_EQ(DefaultLogDir(1000, nullptr, "/home/u"), "/home/u/.local/state/cubetorchfs");
  EXPECT_EQ(DefaultLogDir(1000, "relative", "/home/u"), "/home/u/.local/state/cubetorchfs");
  EXPECT_EQ(DefaultLogDir(1000, "", ""), "");  // none: the command asks for logDir
  EXPECT_EQ(DefaultLogDir(1000, nullptr, nullptr), "");
}

// Debian's and Ubuntu's /var/log is root:syslog 0775: the default log directory beneath a
// group-writable directory is used, and the log is opened beneath its descriptor; a link in
// its path, or a directory others may write, is still refused with what to set.
TEST(CommandLineTest, TheDefaultLogDirMayLieBelowAGroupWritableDirectory) {
  char tmpl[] = "/tmp/ctfs-logdir-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string base = tmpl;
  const std::string var_log = base + "/var/log";
  std::filesystem::create_directories(var_log);
  ASSERT_EQ(::chmod(var_log.c_str(), 0775), 0);
  ASSERT_EQ(::chmod(base.c_str(), 0775), 0);

  Result<UniqueFd> held = OpenDefaultLogDir(var_log + "/cubetorchfs");
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  struct stat st;
  ASSERT_EQ(::stat((var_log + "/cubetorchfs").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  // The log opens beneath the descriptor, even once the directory was renamed away.
  ASSERT_EQ(::rename((var_log + "/cubetorchfs").c_str(), (var_log + "/moved").c_str()), 0);
  const int fd = ::open(LogPathIn(held->get(), "v.log").c_str(),
                        O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  EXPECT_TRUE(std::filesystem::exists(var_log + "/moved/v.log"));

  // A link anywhere in the path: refused, naming the link and what to set.
  std::filesystem::create_directory_symlink(var_log + "/moved", var_log + "/cubetorchfs");
  for (const std::string& dir : {var_log + "/cubetorchfs", var_log + "/cubetorchfs/sub"}) {
    Result<UniqueFd> r = OpenDefaultLogDir(dir);
    ASSERT_FALSE(r.ok()) << dir;
    EXPECT_TRUE(r.status().message().starts_with("logDir: ")) << r.status().message();
    EXPECT_NE(r.status().message().find(var_log + "/cubetorchfs is a symlink"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("set logDir"), std::string::npos);
  }
  EXPECT_FALSE(std::filesystem::exists(var_log + "/moved/sub"));
  // The directory itself open to others' writes: refused.
  ASSERT_EQ(::chmod((var_log + "/moved").c_str(), 0775), 0);
  Result<UniqueFd> open = OpenDefaultLogDir(var_log + "/moved");
  ASSERT_FALSE(open.ok());
  EXPECT_NE(open.status().message().find("mode 0775"), std::string::npos);
  std::filesystem::remove_all(base);
}

}  // namespace
}  // namespace cubetorchfs::daemon
