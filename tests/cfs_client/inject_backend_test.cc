#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <iterator>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cfs_client/backend.h"
#include "tests/test_util.h"

namespace cubetorchfs::cfs_client {
namespace {

using testing::FakeClock;
using testing::MemBackend;

std::unique_ptr<MemBackend> Store() {
  auto m = std::make_unique<MemBackend>();
  m->PutFile("f", "0123456789");
  return m;
}

TEST(InjectBackendTest, AddsLatencyToEveryRequest) {
  FakeClock clock;
  InjectCounters counters;
  auto b = NewInjectBackend(Store(), {true, 300, 0.0, 1}, &clock, &counters);
  uint64_t t0 = clock.NowNanos();
  ASSERT_TRUE(b->Stat("f").ok());
  char buf[10];
  ASSERT_TRUE(b->Read("f", {10, 1}, 0, 10, buf).ok());
  EXPECT_EQ(clock.NowNanos() - t0, 600'000u);
  EXPECT_EQ(counters.requests, 2u);
  EXPECT_EQ(counters.read_requests, 1u);
}

TEST(InjectBackendTest, ErrorRateOneFailsEverything) {
  FakeClock clock;
  auto b = NewInjectBackend(Store(), {true, 0, 1.0, 1}, &clock);
  EXPECT_EQ(b->Stat("f").status().code(), Status::Code::kIOError);
  EXPECT_EQ(b->List("").status().code(), Status::Code::kIOError);
  char buf[10];
  EXPECT_EQ(b->Read("f", {10, 1}, 0, 10, buf).status().code(), Status::Code::kIOError);
}

TEST(InjectBackendTest, ErrorRateIsSeededAndRoughlyRight) {
  FakeClock clock;
  auto run = [&](uint64_t seed) {
    InjectCounters counters;
    auto b = NewInjectBackend(Store(), {true, 0, 0.3, seed}, &clock, &counters);
    std::string pattern;
    for (int i = 0; i < 1000; ++i) pattern += b->Stat("f").ok() ? '.' : 'x';
    EXPECT_EQ(counters.injected_errors,
              static_cast<uint64_t>(std::count(pattern.begin(), pattern.end(), 'x')));
    return pattern;
  };
  std::string a = run(5), b = run(5), c = run(6);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  auto errors = std::count(a.begin(), a.end(), 'x');
  EXPECT_GT(errors, 200);
  EXPECT_LT(errors, 400);
}

TEST(InjectBackendTest, ZeroRatePassesThrough) {
  FakeClock clock;
  auto b = NewInjectBackend(Store(), {true, 0, 0.0, 1}, &clock);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(b->Stat("f").ok());
  EXPECT_TRUE(b->Stat("missing").status().IsNotFound());
}

TEST(InjectBackendTest, WritesAreForwardedDelayedAndFailed) {
  FakeClock clock;
  InjectCounters counters;
  auto store = Store();
  MemBackend* mem = store.get();
  auto b = NewInjectBackend(std::move(store), {true, 100, 0.0, 1}, &clock, &counters);
  OpenWriteOptions create;
  create.create = true;
  uint64_t t0 = clock.NowNanos();
  Result<std::unique_ptr<WritableFile>> f = b->OpenWrite("new", create);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Write(0, "abc", 3).ok());
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE(b->Rename("new", "moved", false).ok());
  EXPECT_EQ(clock.NowNanos() - t0, 400'000u);  // open, write, fsync, rename
  EXPECT_EQ(counters.write_requests, 4u);
  EXPECT_EQ(mem->Data("moved"), "abc");

  auto failing = NewInjectBackend(Store(), {true, 0, 1.0, 1}, &clock);
  EXPECT_EQ(failing->OpenWrite("x", create).status().code(), Status::Code::kIOError);
  EXPECT_EQ(failing->Unlink("f").code(), Status::Code::kIOError);
  EXPECT_EQ(failing->Mkdir("d", 0755, -1, -1).status().code(), Status::Code::kIOError);
}

// A clock whose sleepers wait until the test moves time to their wake-up: lets a test see how
// many requests are served at once and how long they take in all, with no real waiting.
class SteppedClock final : public Clock {
 public:
  uint64_t NowNanos() override {
    std::lock_guard<std::mutex> l(mu_);
    return now_;
  }
  void SleepMicros(uint64_t micros) override {
    std::unique_lock<std::mutex> l(mu_);
    const uint64_t wake = now_ + micros * 1000;
    sleepers_.insert(wake);
    peak_ = std::max(peak_, sleepers_.size());
    changed_.notify_all();
    changed_.wait(l, [&] { return now_ >= wake || released_; });
  }
  // Waits (at most 10 s, really) until `n` threads sleep, then moves time to the earliest
  // wake-up and wakes the threads due then. Returns how many woke (0: `n` never slept).
  size_t Step(size_t n) {
    std::unique_lock<std::mutex> l(mu_);
    if (!changed_.wait_for(l, std::chrono::seconds(10), [&] { return sleepers_.size() >= n; }))
      return 0;
    now_ = *sleepers_.begin();
    auto due_end = sleepers_.upper_bound(now_);
    const auto woken = static_cast<size_t>(std::distance(sleepers_.begin(), due_end));
    sleepers_.erase(sleepers_.begin(), due_end);
    changed_.notify_all();
    return woken;
  }
  // Lets every sleeper go (after a failed Step, so the test can join its threads).
  void ReleaseAll() {
    std::lock_guard<std::mutex> l(mu_);
    released_ = true;
    changed_.notify_all();
  }
  size_t peak_sleepers() {
    std::lock_guard<std::mutex> l(mu_);
    return peak_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  uint64_t now_ = 1'000'000'000;
  std::multiset<uint64_t> sleepers_;  // wake-up times
  size_t peak_ = 0;
  bool released_ = false;
};

// Runs `n` calls of `request` on as many threads, each sleeping once on `clock`; moves time
// each time min(at_once, calls not yet woken) of them sleep. False if they never did.
bool RunStepped(SteppedClock& clock, size_t n, size_t at_once,
                const std::function<void()>& request) {
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) threads.emplace_back(request);
  bool ok = true;
  for (size_t left = n; left > 0;) {
    size_t woken = clock.Step(std::min(at_once, left));
    if (woken == 0) {
      ok = false;
      clock.ReleaseAll();
      break;
    }
    left -= std::min(woken, left);
  }
  for (std::thread& t : threads) t.join();
  return ok;
}

conf::InjectOptions Limits(uint64_t latency_us, uint64_t max_concurrency, uint64_t bandwidth) {
  conf::InjectOptions o;
  o.enabled = true;
  o.latency_us = latency_us;
  o.max_concurrency = max_concurrency;
  o.bandwidth_bytes_s = bandwidth;
  return o;
}

TEST(InjectBackendTest, MaxConcurrencyServesThatManyAtOnceAndTheRestWait) {
  SteppedClock clock;
  InjectCounters counters;
  auto b = NewInjectBackend(Store(), Limits(50'000, 2, 0), &clock, &counters);
  const uint64_t t0 = clock.NowNanos();
  std::atomic<int> ok{0};
  // 7 requests, 2 at a time: 4 rounds of 50 ms, the waits for a slot counted in.
  ASSERT_TRUE(RunStepped(clock, 7, 2, [&] { ok += b->Stat("f").ok() ? 1 : 0; }))
      << "never 2 requests in flight at once";
  EXPECT_EQ(ok.load(), 7);
  EXPECT_EQ(clock.peak_sleepers(), 2u);
  EXPECT_EQ(counters.peak_in_flight, 2u);
  EXPECT_EQ(clock.NowNanos() - t0, 4 * 50'000'000u);
}

TEST(InjectBackendTest, MaxConcurrencyZeroServesAllAtOnce) {
  SteppedClock clock;
  InjectCounters counters;
  auto b = NewInjectBackend(Store(), Limits(50'000, 0, 0), &clock, &counters);
  const uint64_t t0 = clock.NowNanos();
  ASSERT_TRUE(RunStepped(clock, 7, 7, [&] { EXPECT_TRUE(b->Stat("f").ok()); }))
      << "the 7 requests were not all in flight at once";
  EXPECT_EQ(clock.peak_sleepers(), 7u);
  EXPECT_EQ(counters.peak_in_flight, 7u);
  EXPECT_EQ(clock.NowNanos() - t0, 50'000'000u);
}

TEST(InjectBackendTest, BandwidthAddsBytesOverBandwidthToTheLatency) {
  FakeClock clock;
  InjectCounters counters;
  auto store = Store();
  store->PutFile("big", std::string(1'000'000, 'x'));
  // 100 MB/s: 1 MB takes 10 ms on top of the 300 us latency.
  auto b = NewInjectBackend(std::move(store), Limits(300, 0, 100'000'000), &clock, &counters);
  std::vector<char> buf(2'000'000);
  uint64_t t0 = clock.NowNanos();
  Result<size_t> n = b->Read("big", {1'000'000, 1}, 0, 1'000'000, buf.data());
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1'000'000u);
  EXPECT_EQ(clock.NowNanos() - t0, 10'300'000u);

  t0 = clock.NowNanos();  // what was read counts, not what was asked for
  n = b->Read("big", {1'000'000, 1}, 500'000, 2'000'000, buf.data());
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 500'000u);
  EXPECT_EQ(clock.NowNanos() - t0, 5'300'000u);

  t0 = clock.NowNanos();
  Result<Backend::Fetched> f = b->StatRead("big", buf.size(), buf.data());
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->bytes, 1'000'000u);
  EXPECT_EQ(clock.NowNanos() - t0, 10'300'000u);

  t0 = clock.NowNanos();  // no data: the latency only
  ASSERT_TRUE(b->Stat("big").ok());
  EXPECT_EQ(clock.NowNanos() - t0, 300'000u);

  OpenWriteOptions create;
  create.create = true;
  Result<std::unique_ptr<WritableFile>> w = b->OpenWrite("new", create);
  ASSERT_TRUE(w.ok());
  t0 = clock.NowNanos();  // writes pay for their bytes too
  n = (*w)->Write(0, buf.data(), 250'000);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 250'000u);
  EXPECT_EQ(clock.NowNanos() - t0, 2'800'000u);
}

TEST(InjectBackendTest, BandwidthZeroIsUnlimited) {
  FakeClock clock;
  auto store = Store();
  store->PutFile("big", std::string(1'000'000, 'x'));
  auto b = NewInjectBackend(std::move(store), Limits(300, 0, 0), &clock);
  std::vector<char> buf(1'000'000);
  const uint64_t t0 = clock.NowNanos();
  Result<size_t> n = b->Read("big", {1'000'000, 1}, 0, buf.size(), buf.data());
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1'000'000u);
  EXPECT_EQ(clock.NowNanos() - t0, 300'000u);
}

TEST(InjectBackendTest, BandwidthIsSharedByRequestsInFlight) {
  SteppedClock clock;
  auto store = Store();
  store->PutFile("big", std::string(1'000'000, 'x'));
  auto b = NewInjectBackend(std::move(store), Limits(0, 0, 100'000'000), &clock);
  const uint64_t t0 = clock.NowNanos();
  // 4 reads of 1 MB at once over 100 MB/s: 40 ms in all, not 10.
  ASSERT_TRUE(RunStepped(clock, 4, 4, [&] {
    std::vector<char> buf(1'000'000);
    Result<size_t> n = b->Read("big", {1'000'000, 1}, 0, buf.size(), buf.data());
    EXPECT_TRUE(n.ok() && *n == 1'000'000u);
  }));
  EXPECT_EQ(clock.peak_sleepers(), 4u);
  EXPECT_EQ(clock.NowNanos() - t0, 40'000'000u);
}

}  // namespace
}  // namespace cubetorchfs::cfs_client
