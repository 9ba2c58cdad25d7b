#include "fs/list_ahead.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace cubetorchfs::fs {
namespace {

using testing::FakeClock;
using testing::MemBackend;

std::string Class(int i) {
  std::string name = std::to_string(100 + i);
  name.insert(0, "train/c");
  return name;
}

// Polls `done` for up to 10 s.
bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 10000 && !done(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return done();
}

class ListAheadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_.AddDir("train");
    for (int c = 0; c < kClasses; ++c) {
      store_.AddDir(Class(c));
      for (int f = 0; f < 3; ++f)
        store_.PutFile(Class(c) + "/img" + std::to_string(f) + ".jpg", "x");
    }
    store_.PutFile("train/README", "a file beside the classes");
  }

  // One thread, so listings are made in the plan's order.
  void Make(uint64_t depth = 4, unsigned threads = 1, uint64_t max_entries = 1u << 18) {
    ListAhead::Options o;
    o.depth = depth;
    o.threads = threads;
    o.fresh_ns = 10'000'000'000;
    o.max_entries = max_entries;
    la_ = std::make_unique<ListAhead>(o, &store_, &clock_, &changes_);
  }

  // What OpenDir does: the listing from ahead if it has one, else from the store; then the
  // plan of its subdirectories.
  std::vector<cfs_client::DirEntry> OpenDir(const std::string& path, bool* from_ahead = nullptr) {
    std::optional<std::vector<cfs_client::DirEntry>> ahead = la_->Take(path);
    if (from_ahead != nullptr) *from_ahead = ahead.has_value();
    std::vector<cfs_client::DirEntry> entries = ahead ? *ahead : store_.List(path).value();
    la_->OnListed(path, entries);
    return entries;
  }

  static std::vector<std::string> Names(std::vector<cfs_client::DirEntry> entries) {
    std::vector<std::string> names;
    for (const auto& e : entries) names.push_back(e.name);
    std::sort(names.begin(), names.end());
    return names;
  }

  int Lists(const std::string& path) {
    const std::vector<std::string> log = store_.list_log();
    return static_cast<int>(std::count(log.begin(), log.end(), path));
  }

  static constexpr int kClasses = 40;
  MemBackend store_;
  FakeClock clock_;
  std::atomic<uint64_t> changes_{0};
  std::unique_ptr<ListAhead> la_;
};

TEST_F(ListAheadTest, AScanInNameOrderFindsEveryClassListedAheadAndListsEachOnce) {
  Make(/*depth=*/4);
  OpenDir("train");
  for (int c = 0; c < kClasses; ++c) {
    // With one thread the plan's listings are made in order: wait for this one's.
    ASSERT_TRUE(Eventually([&] { return la_->GetStats().listed >= static_cast<uint64_t>(c + 1); }))
        << c;
    bool ahead = false;
    const auto entries = OpenDir(Class(c), &ahead);
    EXPECT_TRUE(ahead) << c;
    EXPECT_EQ(Names(entries), (std::vector<std::string>{"img0.jpg", "img1.jpg", "img2.jpg"})) << c;
    EXPECT_EQ(Names(entries), Names(store_.List(Class(c)).value())) << c;
  }
  // Each class was listed by the store once (and once more by the check above).
  for (int c = 0; c < kClasses; ++c) EXPECT_EQ(Lists(Class(c)), 2) << c;
  const ListAhead::Stats st = la_->GetStats();
  EXPECT_EQ(st.listed, uint64_t{kClasses});
  EXPECT_EQ(st.taken, uint64_t{kClasses});
  EXPECT_EQ(st.stale + st.dropped, 0u);
}

TEST_F(ListAheadTest, OnlyDepthDirectoriesAreListedAheadOfTheLatestOpened) {
  Make(/*depth=*/4);
  OpenDir("train");
  ASSERT_TRUE(Eventually([&] { return la_->GetStats().listed >= 4; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(la_->GetStats().listed, 4u);  // not the other 36
  EXPECT_EQ(Lists(Class(4)), 0);
  OpenDir(Class(0));
  ASSERT_TRUE(Eventually([&] { return la_->GetStats().listed >= 5; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(la_->GetStats().listed, 5u);
  EXPECT_EQ(Lists(Class(4)), 1);
  EXPECT_EQ(Lists(Class(5)), 0);
}

TEST_F(ListAheadTest, AChangeThroughTheMountOrAgeMakesAListingMadeAheadUnusable) {
  Make(/*depth=*/2);
  OpenDir("train");
  ASSERT_TRUE(Eventually([&] { return la_->GetStats().listed >= 2; }));
  // A file created in class 0 after it was listed ahead: the listing is not handed out.
  store_.PutFile(Class(0) + "/new.jpg", "y");
  changes_ += 2;  // the change's begin and end (FileSystem::ChangeScope)
  bool ahead = true;
  EXPECT_EQ(Names(OpenDir(Class(0), &ahead)).size(), 4u);
  EXPECT_FALSE(ahead);
  EXPECT_EQ(la_->GetStats().stale, 1u);
  // Class 1, listed ahead before the change too.
  EXPECT_EQ(Names(OpenDir(Class(1), &ahead)).size(), 3u);
  EXPECT_FALSE(ahead);
  // Class 2 was listed after the change: good until it is older than fresh_ns.
  ASSERT_TRUE(Eventually([&] { return la_->GetStats().listed >= 4; }));
  OpenDir(Class(2), &ahead);
  EXPECT_TRUE(ahead);
  clock_.AdvanceSeconds(11);
  OpenDir(Class(3), &ahead);
  EXPECT_FALSE(ahead);
  EXPECT_EQ(la_->GetStats().stale, 3u);
}

// A private directory listed ahead, then swapped in the store for another user's directory at
// the same name: the other directory (another store identity) never gets the listing made of
// the first.
TEST_F(ListAheadTest, AListingIsHandedOutOnlyForTheDirectoryPlanned) {
  store_.GiveIdentities();
  for (const char* d : {"team", "team/a", "team/private"}) store_.AddDir(d);
  store_.PutFile("team/private/secret-name", "x");
  Make(/*depth=*/2);
  OpenDir("team");
  ASSERT_TRUE(Eventually([&] { return la_->GetStats().listed >= 2; }));
  const uint64_t planned = store_.Stat("team/private")->StoreId();
  ASSERT_NE(planned, 0u);
  ASSERT_TRUE(store_.Rename("team/private", "team/private.old", false).ok());
  store_.AddDir("team/private");  // the attacker's own, empty
  const uint64_t swapped = store_.Stat("team/private")->StoreId();
  ASSERT_NE(swapped, planned);
  const uint64_t stale = la_->GetStats().stale;
  EXPECT_FALSE(la_->Take("team/private", swapped).has_value());
  EXPECT_GT(la_->GetStats().stale, stale);
  // The directory planned gets its listing.
  OpenDir("team");
  ASSERT_TRUE(Eventually([&] { return la_->GetStats().listed >= 4; }));
  std::optional<std::vector<cfs_client::DirEntry>> a =
      la_->Take("team/a", store_.Stat("team/a")->StoreId());
  EXPECT_TRUE(a.has_value());
}

TEST_F(ListAheadTest, ListingsTheScanWentPastAreDroppedAndEntriesAreBounded) {
  Make(/*depth=*/4, /*threads=*/1, /*max_entries=*/7);  // room for two classes of 3
  OpenDir("train");
  ASSERT_TRUE(Eventually([&] {
    const ListAhead::Stats st = la_->GetStats();
    return st.listed + st.dropped >= 4;
  }));
  ListAhead::Stats st = la_->GetStats();
  EXPECT_EQ(st.listed, 2u);
  EXPECT_EQ(st.dropped, 2u);  // over max_entries: not kept
  // The scan opens class 3 first: classes 0 and 1, ready and skipped, are dropped.
  bool ahead = true;
  OpenDir(Class(3), &ahead);
  EXPECT_FALSE(ahead);  // dropped when made: listed again
  st = la_->GetStats();
  EXPECT_EQ(st.stale, 2u);
  // Their room is free again: classes 4 to 7 are listed ahead, and two of them kept.
  ASSERT_TRUE(Eventually([&] {
    const ListAhead::Stats s = la_->GetStats();
    return s.listed + s.dropped >= 8;
  }));
  EXPECT_EQ(la_->GetStats().listed, 4u);
}

TEST_F(ListAheadTest, ADirectoryWithOneSubdirectoryOrNoneMakesNoPlan) {
  Make();
  store_.AddDir("solo");
  store_.AddDir("solo/only");
  OpenDir("solo");
  OpenDir(Class(0));  // files only
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(la_->GetStats().listed, 0u);
}

TEST_F(ListAheadTest, ADirectoryOfMoreSubdirectoriesThanAPlanHoldsMakesNone) {
  ListAhead::Options o;
  o.max_plan_dirs = kClasses - 1;
  la_ = std::make_unique<ListAhead>(o, &store_, &clock_, &changes_);
  OpenDir("train");  // 40 classes: one more than a plan holds
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(la_->GetStats().listed, 0u);
  bool ahead = true;
  OpenDir(Class(0), &ahead);
  EXPECT_FALSE(ahead);
}

TEST_F(ListAheadTest, ManyThreadsAndAConcurrentScanAgreeWithTheStore) {
  Make(/*depth=*/8, /*threads=*/4);
  OpenDir("train");
  for (int c = 0; c < kClasses; ++c)
    EXPECT_EQ(Names(OpenDir(Class(c))), Names(store_.List(Class(c)).value())) << c;
  // How many listings the threads made before the scan reached them depends on scheduling
  // (a loaded machine may let the scan list every class itself): only the accounting is fixed.
  const ListAhead::Stats st = la_->GetStats();
  EXPECT_LE(st.taken + st.stale, st.listed);
  la_.reset();  // joins with listings possibly in flight
}

}  // namespace
}  // namespace cubetorchfs::fs
