#include "fuse/page_probe.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cubetorchfs::fuse {
namespace {

// A kernel whose page cache holds, of each inode, the first `held` bytes: a retrieve is
// answered with the bytes of its range that lie in them (as the kernel answers up to the first
// page it lacks), inside the notify or, `async`, from another thread as the session loop would.
class FakeKernel final : public PageProbe::Kernel {
 public:
  explicit FakeKernel(PageProbe* probe) : probe_(probe) {}
  ~FakeKernel() override {
    for (std::thread& t : answers_) t.join();
  }

  std::atomic<uint64_t> held{0};
  std::atomic<int> fail{0};         // a negative errno for every notify (the inode forgotten)
  std::atomic<bool> silent{false};  // no answer ever comes
  std::atomic<bool> async{false};
  std::function<void()> on_retrieve;  // runs inside the notify, no lock held

  int Retrieve(uint64_t ino, uint64_t offset, uint64_t len, void* cookie) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      retrieves_.push_back({ino, offset, len});
    }
    if (on_retrieve) on_retrieve();
    if (fail != 0) return fail;
    if (!silent) {
      const uint64_t h = held;
      const uint64_t bytes = offset >= h ? 0 : std::min(len, h - offset);
      if (!async) {
        probe_->OnReply(cookie, bytes);
      } else {
        std::lock_guard<std::mutex> l(mu_);
        answers_.emplace_back([this, cookie, bytes] { probe_->OnReply(cookie, bytes); });
      }
    }
    return 0;
  }
  int Store(uint64_t ino, const char* data, size_t size) override {
    std::lock_guard<std::mutex> l(mu_);
    stored_.push_back({ino, 0, size});
    stored_bytes_.assign(data, size);
    return fail;
  }

  struct Call {
    uint64_t ino, offset, len;
  };
  std::vector<Call> retrieves() {
    std::lock_guard<std::mutex> l(mu_);
    return retrieves_;
  }
  std::vector<Call> stored() {
    std::lock_guard<std::mutex> l(mu_);
    return stored_;
  }
  std::string stored_bytes() {
    std::lock_guard<std::mutex> l(mu_);
    return stored_bytes_;
  }

 private:
  PageProbe* const probe_;
  std::mutex mu_;
  std::vector<Call> retrieves_, stored_;
  std::string stored_bytes_;
  std::vector<std::thread> answers_;
};

const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));

// A probe attached to a fake kernel, closed before the kernel goes.
struct Attached {
  explicit Attached(std::chrono::milliseconds timeout = std::chrono::milliseconds(1000))
      : probe(timeout), kernel(&probe) {
    probe.Attach(&kernel);
  }
  ~Attached() { probe.Close(); }
  PageProbe probe;
  FakeKernel kernel;
};

// The probe asks for the file's first page and its last, not the pages between: two pages
// through /dev/fuse whatever the file's size.
TEST(PageProbeTest, AsksForTheFirstAndTheLastPageOnly) {
  Attached a;
  PageProbe& probe = a.probe;
  FakeKernel& kernel = a.kernel;
  const uint64_t size = 10 * kPage + 100;
  kernel.held = size;
  kernel.async = true;
  EXPECT_TRUE(probe.Resident(7, size));
  std::vector<FakeKernel::Call> calls = kernel.retrieves();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].ino, 7u);
  EXPECT_EQ(calls[0].offset, 0u);
  EXPECT_EQ(calls[0].len, kPage);
  EXPECT_EQ(calls[1].offset, 10 * kPage);
  EXPECT_EQ(calls[1].len, 100u);
  // A file of one page: one retrieve; an empty file: none (nothing to hold).
  EXPECT_TRUE(probe.Resident(8, kPage / 2));
  EXPECT_EQ(kernel.retrieves().size(), 3u);
  EXPECT_TRUE(probe.Resident(9, 0));
  EXPECT_EQ(kernel.retrieves().size(), 3u);
}

TEST(PageProbeTest, APageTheKernelLacksMeansNotResident) {
  Attached a;
  PageProbe& probe = a.probe;
  FakeKernel& kernel = a.kernel;
  kernel.held = 3 * kPage;  // the last page was dropped
  EXPECT_FALSE(probe.Resident(1, 4 * kPage));
  EXPECT_EQ(kernel.retrieves().size(), 2u);
  kernel.held = kPage / 2;  // the first page is short: the last is not asked
  EXPECT_FALSE(probe.Resident(1, 4 * kPage));
  EXPECT_EQ(kernel.retrieves().size(), 3u);
  kernel.held = 0;
  EXPECT_FALSE(probe.Resident(1, 100));
  EXPECT_EQ(kernel.retrieves().size(), 4u);
}

// A failed notify (-ENOENT: the kernel forgot the inode, and its pages with it) or no answer in
// time: not resident, and the caller fetches the file, which is always safe.
TEST(PageProbeTest, AFailedNotifyOrNoAnswerInTimeMeansNotResident) {
  Attached a(std::chrono::milliseconds(50));
  PageProbe& probe = a.probe;
  FakeKernel& kernel = a.kernel;
  kernel.held = kPage;
  kernel.fail = -ENOENT;
  EXPECT_FALSE(probe.Resident(1, kPage));
  kernel.fail = 0;
  kernel.silent = true;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(probe.Resident(1, kPage));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  // The late answer finds nobody waiting and changes nothing.
  probe.OnReply(reinterpret_cast<void*>(uint64_t{2}), kPage);
}

TEST(PageProbeTest, NothingIsAskedBeforeAttachOrAfterClose) {
  PageProbe probe;
  FakeKernel kernel(&probe);
  kernel.held = kPage;
  EXPECT_FALSE(probe.Resident(1, kPage));
  EXPECT_FALSE(probe.Store(1, "x", 1));
  probe.Attach(&kernel);
  EXPECT_TRUE(probe.Resident(1, kPage));
  probe.Close();
  EXPECT_FALSE(probe.Resident(1, kPage));
  EXPECT_FALSE(probe.Store(1, "x", 1));
  EXPECT_EQ(kernel.retrieves().size(), 1u);
  EXPECT_TRUE(kernel.stored().empty());
}

// Before a handover the probe pauses: no notify starts, a waiter is let go at once, and Pause
// returns only once the notifies being written are done; Resume takes up the same kernel.
TEST(PageProbeTest, PauseWaitsForNotifiesUnderWayAndResumeTakesUpTheKernel) {
  Attached a(std::chrono::seconds(30));
  PageProbe& probe = a.probe;
  FakeKernel& kernel = a.kernel;
  kernel.held = kPage;
  kernel.silent = true;  // the retrieve below waits for an answer that never comes
  std::atomic<bool> inside{false}, answered{false};
  kernel.on_retrieve = [&] { inside = true; };
  std::thread reader([&] {
    EXPECT_FALSE(probe.Resident(1, kPage));
    answered = true;
  });
  while (!inside) std::this_thread::yield();
  const auto start = std::chrono::steady_clock::now();
  probe.Pause();  // wakes the waiter: it gives up rather than wait 30 s
  reader.join();
  EXPECT_TRUE(answered);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  kernel.on_retrieve = nullptr;
  kernel.silent = false;
  EXPECT_FALSE(probe.Resident(1, kPage));  // paused: nothing asked
  EXPECT_EQ(kernel.retrieves().size(), 1u);
  probe.Resume();
  EXPECT_TRUE(probe.Resident(1, kPage));
  EXPECT_EQ(kernel.retrieves().size(), 2u);
}

TEST(PageProbeTest, StorePassesTheBytesAndTheKernelsAnswer) {
  Attached a;
  PageProbe& probe = a.probe;
  FakeKernel& kernel = a.kernel;
  EXPECT_TRUE(probe.Store(5, "hello", 5));
  ASSERT_EQ(kernel.stored().size(), 1u);
  EXPECT_EQ(kernel.stored()[0].ino, 5u);
  EXPECT_EQ(kernel.stored_bytes(), "hello");
  kernel.fail = -ENOENT;  // the kernel does not know the inode
  EXPECT_FALSE(probe.Store(5, "hello", 5));
}

// Many readers at once: each gets the answer to its own retrieve (by cookie).
TEST(PageProbeTest, ConcurrentProbesEachGetTheirOwnAnswer) {
  Attached a;
  PageProbe& probe = a.probe;
  FakeKernel& kernel = a.kernel;
  kernel.held = 2 * kPage;
  std::atomic<int> resident{0}, absent{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < 8; ++i)
    readers.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k)
        (probe.Resident(i, (i % 2 ? 2 : 3) * kPage) ? resident : absent)++;
    });
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(resident.load(), 4 * 50);  // the files of 2 pages
  EXPECT_EQ(absent.load(), 4 * 50);    // those of 3: their last page is not held
}

}  // namespace
}  // namespace cubetorchfs::fuse
