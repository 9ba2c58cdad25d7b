#include "daemon/handover.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <string>

#include "fuse/page_probe.h"

namespace cubetorchfs::daemon {
namespace {

int Errno(const Status& s) { return ToErrno(s); }

// An upgrade is asked of the worker only when the next binary can take the mount over whole.
TEST(HandoverTest, RefusesWhatCannotBeHandedOnAndStopsTheLoopOtherwise) {
  std::atomic<uint64_t> writing{0};
  Handover h([&] { return writing.load(); });
  EXPECT_EQ(Errno(h.Request()), EAGAIN);  // the loop does not serve yet
  EXPECT_FALSE(h.asked()->load());
  h.Serving();
  writing = 2;  // write states cannot cross to another process
  Status busy = h.Request();
  EXPECT_EQ(Errno(busy), EBUSY);
  EXPECT_NE(busy.message().find("2 file(s) open for writing"), std::string::npos) << busy.message();
  EXPECT_FALSE(h.asked()->load());
  writing = 0;
  ASSERT_TRUE(h.Request().ok());
  EXPECT_TRUE(h.asked()->load());  // what FuseSession::Serve stops on
  EXPECT_TRUE(h.Request().ok());   // asked twice: one handover
  h.Abandon();                     // a file was opened for writing meanwhile: serve on
  EXPECT_FALSE(h.asked()->load());
  h.SupervisorGone();
  EXPECT_EQ(Errno(h.Request()), ESRCH);  // nobody to hand over to
  EXPECT_FALSE(h.asked()->load());
}

// What the probe sends the kernel: counted, each retrieve answered at once with `len` bytes.
class CountingKernel final : public fuse::PageProbe::Kernel {
 public:
  explicit CountingKernel(fuse::PageProbe* probe) : probe_(probe) {}
  int Retrieve(uint64_t, uint64_t, uint64_t len, void* cookie) override {
    ++retrieves;
    probe_->OnReply(cookie, len);
    return 0;
  }
  int Store(uint64_t, const char*, size_t) override { return 0; }
  std::atomic<int> retrieves{0};

 private:
  fuse::PageProbe* const probe_;
};

// A request pauses the page probe (its stores wait on reads only the loop answers): nothing is
// asked of the kernel until the handover is abandoned, which resumes it.
TEST(HandoverTest, PausesTheProbeUntilTheHandoverIsAbandoned) {
  fuse::PageProbe probe;
  CountingKernel kernel(&probe);
  probe.Attach(&kernel);
  Handover h([] { return uint64_t{0}; });
  h.SetProbe(&probe);
  h.Serving();
  EXPECT_TRUE(probe.Resident(1, 100));
  EXPECT_EQ(kernel.retrieves.load(), 1);
  ASSERT_TRUE(h.Request().ok());
  EXPECT_FALSE(probe.Resident(1, 100));  // paused: not asked
  EXPECT_EQ(kernel.retrieves.load(), 1);
  h.Abandon();
  EXPECT_TRUE(probe.Resident(1, 100));
  EXPECT_EQ(kernel.retrieves.load(), 2);
  probe.Close();
}

TEST(HandoverTest, StateFramesRoundTripAndAnUnframedStateIsTheInodeTableAlone) {
  std::string passthrough;
  // No passthrough opens: the bytes are the inode table's, the form an earlier version reads.
  EXPECT_EQ(FrameState("inodes", ""), "inodes");
  Result<std::string> plain = UnframeState("inodes", &passthrough);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(*plain, "inodes");
  EXPECT_TRUE(passthrough.empty());
  const std::string framed = FrameState(std::string("in\0odes", 7), "pass");
  Result<std::string> both = UnframeState(framed, &passthrough);
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(*both, std::string("in\0odes", 7));
  EXPECT_EQ(passthrough, "pass");
  // Cut anywhere past the magic: refused, never half read.
  for (size_t n = 8; n < framed.size(); ++n) {
    Result<std::string> cut = UnframeState(framed.substr(0, n), &passthrough);
    EXPECT_EQ(cut.status().code(), Status::Code::kInvalidArgument) << n;
  }
}

}  // namespace
}  // namespace cubetorchfs::daemon
