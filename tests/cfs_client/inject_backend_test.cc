#include <gtest/gtest.h>

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

}  // namespace
}  // namespace cubetorchfs::cfs_client
