#include "fuse/passthrough.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <set>

namespace cubetorchfs::fuse {
namespace {

using Mode = Passthrough::Mode;

// The kernel's side, counted: registrations live, given back, and a refusal to inject.
struct FakeDevice {
  std::set<int32_t> live;
  int32_t next = 1;
  int refuse = 0;  // errno of the next registrations, 0: accepted
  int opened_fds = 0;
  Passthrough::Device device() {
    return {[this](int) -> Result<int32_t> {
              if (refuse != 0) return Status::FromErrno(refuse, "register");
              live.insert(next);
              return next++;
            },
            [this](int32_t id) { EXPECT_EQ(live.erase(id), 1u) << "given back twice: " << id; }};
  }
  // A descriptor for the table to register (and close).
  std::function<int()> backing() {
    return [this] {
      ++opened_fds;
      return ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    };
  }
};

const std::function<int()> kNotEligible = [] { return -1; };

TEST(PassthroughTest, OpensOfOneInodeShareOneRegistrationUntilTheLastCloses) {
  FakeDevice dev;
  Passthrough pt(dev.device());
  Result<Passthrough::Answer> a = pt.Open(7, false, 100, dev.backing());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->mode, Mode::kPassthrough);
  // A second reader, even one not eligible itself (the file shrank, say): same registration,
  // and no second store open.
  Result<Passthrough::Answer> b = pt.Open(7, false, 100, kNotEligible);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->mode, Mode::kPassthrough);
  EXPECT_EQ(b->backing_id, a->backing_id);
  EXPECT_EQ(dev.opened_fds, 1);
  EXPECT_EQ(pt.backings(), 1u);
  pt.Release(7, Mode::kPassthrough);
  EXPECT_EQ(dev.live.size(), 1u);
  pt.Release(7, Mode::kPassthrough);
  EXPECT_TRUE(dev.live.empty());
  EXPECT_TRUE(pt.empty());
  EXPECT_EQ(pt.opens(), 2u);
}

// No reader locks the owner out: a writer of an inode with passthrough opens joins their
// registration with direct I/O (its writes come to the daemon); a file replaced in the store
// is ESTALE, which makes the kernel look the name up again.
TEST(PassthroughTest, WritersJoinPassthroughOpensWithDirectIoAndReplacedFilesAreStale) {
  FakeDevice dev;
  Passthrough pt(dev.device());
  Result<Passthrough::Answer> a = pt.Open(7, false, 100, dev.backing());
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->direct_io);
  Result<Passthrough::Answer> w = pt.Open(7, true, 100, kNotEligible);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->mode, Mode::kPassthrough);
  EXPECT_EQ(w->backing_id, a->backing_id);
  EXPECT_TRUE(w->direct_io);
  Result<Passthrough::Answer> r = pt.Open(7, false, 101, dev.backing());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ToErrno(r.status()), ESTALE);
  EXPECT_EQ(dev.opened_fds, 1);
  pt.Release(7, Mode::kPassthrough);
  EXPECT_EQ(dev.live.size(), 1u);  // the writer still holds it
  pt.Release(7, Mode::kPassthrough);
  EXPECT_TRUE(dev.live.empty());
  // No opens: a writer opens cached, and a reader then reads cached too.
  Result<Passthrough::Answer> w2 = pt.Open(7, true, 101, kNotEligible);
  ASSERT_TRUE(w2.ok());
  EXPECT_EQ(w2->mode, Mode::kCached);
  EXPECT_FALSE(w2->direct_io);
  Result<Passthrough::Answer> r2 = pt.Open(7, false, 101, dev.backing());
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->mode, Mode::kCached);
  EXPECT_EQ(dev.opened_fds, 1);  // no registration while a cached open exists
  pt.Release(7, Mode::kCached);
  pt.Release(7, Mode::kCached);
  EXPECT_TRUE(pt.empty());
}

TEST(PassthroughTest, ARefusalDisablesItOnceAndOpensGoOnCached) {
  FakeDevice dev;
  dev.refuse = EPERM;
  Passthrough pt(dev.device());
  Result<Passthrough::Answer> a = pt.Open(7, false, 100, dev.backing());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->mode, Mode::kCached);
  EXPECT_FALSE(pt.enabled());
  ASSERT_TRUE(pt.Open(8, false, 100, dev.backing()).ok());
  EXPECT_EQ(dev.opened_fds, 1);  // disabled: no more store opens for it
}

TEST(PassthroughTest, TheTableSurvivesAHandoverAndInfersTheModeOfOldHandles) {
  FakeDevice dev;
  Passthrough before(dev.device());
  ASSERT_TRUE(before.Open(7, false, 100, dev.backing()).ok());
  ASSERT_TRUE(before.Open(7, false, 100, kNotEligible).ok());
  ASSERT_TRUE(before.Open(9, true, 200, kNotEligible).ok());
  const std::string bytes = before.Serialize();

  Passthrough after(dev.device());
  ASSERT_TRUE(after.Restore(bytes).ok());
  EXPECT_EQ(after.backings(), 1u);
  // The writer of inode 9 is known: a reader of 9 is not passed through.
  Result<Passthrough::Answer> r9 = after.Open(9, false, 200, dev.backing());
  ASSERT_TRUE(r9.ok());
  EXPECT_EQ(r9->mode, Mode::kCached);
  // Handles the earlier process opened (mode unknown) release inode 7's registration.
  after.Release(7, std::nullopt);
  after.Release(7, std::nullopt);
  EXPECT_TRUE(dev.live.empty());
  after.Release(9, std::nullopt);
  after.Release(9, Mode::kCached);
  EXPECT_TRUE(after.empty());

  // Bytes of another kind are refused, whole.
  Passthrough other(dev.device());
  EXPECT_FALSE(other.Restore("not a table").ok());
  EXPECT_FALSE(other.Restore(bytes.substr(0, bytes.size() - 3)).ok());
  EXPECT_TRUE(other.empty());
}

// After a kill -9 the kernel's opens and registrations live on (the connection is the
// supervisor's): the next process adopts the table from the memfd the dead one kept it in, so
// an open of an inode the kernel has in passthrough mode names the registration it holds.
TEST(PassthroughTest, TheTableOutlivesACrashInItsMemfd) {
  FakeDevice dev;
  auto before = std::make_unique<Passthrough>(dev.device());
  ASSERT_GE(before->durable_fd(), 0);
  Result<Passthrough::Answer> a = before->Open(7, false, 100, dev.backing());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(before->Open(7, false, 100, kNotEligible).ok());
  ASSERT_TRUE(before->Open(9, true, 200, kNotEligible).ok());
  ASSERT_TRUE(before->Open(11, false, 300, dev.backing()).ok());
  before->Release(11, Mode::kPassthrough);       // closed before the crash: nothing of it is kept
  const int kept = ::dup(before->durable_fd());  // what the supervisor holds
  before.reset();                                // the crash: the kernel's state stays

  Passthrough after(dev.device());
  Result<size_t> adopted = after.AdoptDurable(kept);
  ASSERT_TRUE(adopted.ok()) << adopted.status().ToString();
  EXPECT_EQ(*adopted, 2u);
  EXPECT_EQ(after.backings(), 1u);
  // A new reader of 7 joins the registration the kernel holds: no second one.
  Result<Passthrough::Answer> r7 = after.Open(7, false, 100, dev.backing());
  ASSERT_TRUE(r7.ok());
  EXPECT_EQ(r7->mode, Mode::kPassthrough);
  EXPECT_EQ(r7->backing_id, a->backing_id);
  EXPECT_EQ(dev.opened_fds, 2);  // 7's and 11's, before the crash
  // The writer of 9 is known: a reader of 9 is not passed through.
  Result<Passthrough::Answer> r9 = after.Open(9, false, 200, dev.backing());
  ASSERT_TRUE(r9.ok());
  EXPECT_EQ(r9->mode, Mode::kCached);
  // The old handles' releases (mode unknown) and the new one give the registration back.
  after.Release(7, std::nullopt);
  after.Release(7, std::nullopt);
  EXPECT_EQ(dev.live.size(), 1u);
  after.Release(7, Mode::kPassthrough);
  EXPECT_TRUE(dev.live.empty());
  after.Release(9, std::nullopt);
  after.Release(9, Mode::kCached);
  EXPECT_TRUE(after.empty());

  // A second crash: the process after adopts what this one left in the same memfd.
  ASSERT_TRUE(after.Open(12, false, 400, dev.backing()).ok());
  Passthrough third(dev.device());
  Result<size_t> again = third.AdoptDurable(::dup(after.durable_fd()));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 1u);
  EXPECT_EQ(third.backings(), 1u);

  // A memfd of another layout is refused, and the table goes on empty.
  const int other = ::memfd_create("not-a-table", MFD_CLOEXEC);
  ASSERT_GE(other, 0);
  ASSERT_EQ(::ftruncate(other, 4096), 0);
  Passthrough fresh(dev.device());
  EXPECT_FALSE(fresh.AdoptDurable(other).ok());
  EXPECT_TRUE(fresh.empty());
}

}  // namespace
}  // namespace cubetorchfs::fuse
