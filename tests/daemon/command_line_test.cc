#include "daemon/command_line.h"

#include <gtest/gtest.h>

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
