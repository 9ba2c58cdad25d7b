#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "fuse/uring_loop.h"

namespace cubetorchfs::fuse {
namespace {

TEST(UringSlotsTest, ANewMemfdHoldsDisjointSlotsOfThePayloadSize) {
  Result<std::shared_ptr<UringSlots>> s = UringSlots::Open(-1, 4, 8192);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE((*s)->adopted());
  EXPECT_EQ((*s)->count(), 4);
  EXPECT_EQ((*s)->payload_size(), 8192u);
  EXPECT_GE((*s)->fd(), 0);
  for (int i = 1; i < 4; ++i)
    EXPECT_EQ((*s)->slot(i) - (*s)->slot(i - 1), static_cast<ptrdiff_t>(4096 + 8192));
  // The slots are the memfd's: what one process writes, the next one reads.
  std::memcpy((*s)->slot(3) + 4096, "payload", 7);
  char back[7];
  const off_t at =
      static_cast<off_t>((*s)->slot(3) + 4096 - reinterpret_cast<char*>((*s)->table()));
  ASSERT_EQ(::pread((*s)->fd(), back, sizeof back, at), 7);
  EXPECT_EQ(std::string(back, 7), "payload");
}

TEST(UringSlotsTest, AnotherProcessesMemfdIsCheckedBeforeUse) {
  const int junk = ::memfd_create("junk", MFD_CLOEXEC);
  ASSERT_GE(junk, 0);
  ASSERT_EQ(::ftruncate(junk, 1 << 20), 0);
  Result<std::shared_ptr<UringSlots>> bad = UringSlots::Open(junk, 4, 8192);  // takes junk
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("not in a format"), std::string::npos)
      << bad.status().ToString();

  Result<std::shared_ptr<UringSlots>> mine = UringSlots::Open(-1, 2, 8192);
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  // Its address is taken in this process (by `mine`): adoption needs the very address.
  Result<std::shared_ptr<UringSlots>> twice = UringSlots::Open(::dup((*mine)->fd()), 2, 8192);
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("at their address"), std::string::npos)
      << twice.status().ToString();

  const int cut = ::memfd_create("cut", MFD_CLOEXEC);
  ASSERT_GE(cut, 0);
  char head[64];
  ASSERT_EQ(::pread((*mine)->fd(), head, sizeof head, 0), 64);
  ASSERT_EQ(::pwrite(cut, head, sizeof head, 0), 64);  // the table only: truncated
  Result<std::shared_ptr<UringSlots>> short_one = UringSlots::Open(cut, 2, 8192);
  ASSERT_FALSE(short_one.ok());
  EXPECT_NE(short_one.status().message().find("truncated"), std::string::npos)
      << short_one.status().ToString();
}

TEST(UringSlotsTest, OneQueuePerPossibleCpu) {
  std::ifstream in("/sys/devices/system/cpu/possible");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const size_t dash = line.rfind('-'), comma = line.rfind(',');
  const size_t from = std::max(dash == std::string::npos ? 0 : dash + 1,
                               comma == std::string::npos ? 0 : comma + 1);
  EXPECT_EQ(UringQueueCount(), std::stoi(line.substr(from)) + 1);
}

}  // namespace
}  // namespace cubetorchfs::fuse
