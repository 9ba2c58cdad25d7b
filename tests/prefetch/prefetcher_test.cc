#include "prefetch/prefetcher.h"

#include <gtest/gtest.h>

#include <prometheus/registry.h>
#include <functional>
#include <optional>

#include <malloc.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "cache/tiers.h"
#include "control/control_server.h"
#include "tests/test_util.h"

namespace cubetorchfs::prefetch {
namespace {

using testing::FakeClock;
using testing::MemBackend;

constexpr size_t kFileSize = 1000;

std::string Name(int i) { return "d/" + std::to_string(1000 + i); }

class PrefetcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_.AddDir("d");
    for (int i = 0; i < 64; ++i)
      store_.PutFile(Name(i), std::string(kFileSize, static_cast<char>('a' + i % 26)));
    ram_ = cache::RamCache::New({1 << 20, 64 << 10}, nullptr);
  }

  void Make(uint64_t window_files = 8, uint64_t budget = 1 << 20, uint64_t slack = 4,
            bool evict_after_read = true, bool keep_cache = false,
            std::function<std::optional<uint64_t>()> reclaim_counter = nullptr) {
    Prefetcher::Options o;
    o.keep_cache = keep_cache;
    o.reclaim_counter = std::move(reclaim_counter);
    o.start_workers = false;
    o.chunk_bytes = 64 << 10;
    o.prefetch.window_files = window_files;
    o.prefetch.evict_after_read = evict_after_read;
    o.window_budget_bytes = budget;
    o.skip_slack = slack;
    o.attr_timeout_s = 10;
    o.stream_idle_s = 60;
    pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  }

  // Residency checks see the attributes in known_ (as the inode table would hold them).
  class KnownAttrs final : public AttrSource {
   public:
    explicit KnownAttrs(PrefetcherTest* test) : test_(test) {}
    std::optional<cfs_client::FileAttr> FreshAttr(const std::string& path,
                                                  uint64_t* fetched_ns) const override {
      auto it = test_->known_.find(path);
      if (fetched_ns != nullptr) *fetched_ns = test_->clock_.NowNanos();
      return it == test_->known_.end() ? std::nullopt
                                       : std::optional<cfs_client::FileAttr>(it->second);
    }
    // Marks are kept as the inode table keeps them: for a file whose inode the kernel holds
    // (here: one in inodes_), and gone when the kernel forgets it (Forget).
    uint64_t MarkOf(const std::string& path,
                    std::optional<cfs_client::FileAttr>* fresh) const override {
      if (fresh != nullptr) *fresh = FreshAttr(path, nullptr);
      auto it = test_->marks_.find(path);
      return it == test_->marks_.end() ? 0 : it->second;
    }
    bool SetMark(const std::string& path, uint64_t mark) override {
      if (mark == 0) return test_->marks_.erase(path) > 0;
      if (test_->inodes_.count(path) == 0) return false;
      test_->marks_[path] = mark;
      return true;
    }
    uint64_t Marks() const override { return test_->marks_.size(); }

   private:
    PrefetcherTest* const test_;
  };
  void KnowAttrs() {
    for (int i = 0; i < 64; ++i) {
      known_[Name(i)] = store_.Stat(Name(i)).value();
      inodes_.insert(Name(i));
    }
    pf_->SetAttrSource(&known_attrs_);
  }
  // The kernel forgets the inode of file i: its mark goes with it (fs::InodeTable).
  void Forget(int i) {
    inodes_.erase(Name(i));
    marks_.erase(Name(i));
  }

  // The kernel's page cache, as the page probe reports it: it holds the files in held_.
  class HeldPages final : public PageCacheProbe {
   public:
    explicit HeldPages(PrefetcherTest* test) : test_(test) {}
    bool Resident(const std::string& path, uint64_t size) override {
      test_->probes_++;
      EXPECT_EQ(size, kFileSize);
      return test_->held_.count(path) > 0;
    }

   private:
    PrefetcherTest* const test_;
  };
  void ProbeKernel() { pf_->SetPageProbe(&held_pages_); }
  // A kernel that takes what is stored (FUSE_NOTIFY_STORE) while accept_stores_ is set.
  class StoringPages final : public PageCacheProbe {
   public:
    explicit StoringPages(PrefetcherTest* test) : test_(test) {}
    bool Resident(const std::string& path, uint64_t) override {
      test_->probes_++;
      return test_->held_.count(path) > 0;
    }
    bool Store(const std::string& path, const cfs_client::FileVersion& version,
               const cache::Buffer& data) override {
      if (!test_->accept_stores_) return false;
      test_->stored_[path] = std::string(data.data.get(), data.size);
      EXPECT_EQ(version, test_->store_.Stat(path).value().Version());
      test_->held_.insert(path);
      return true;
    }

   private:
    PrefetcherTest* const test_;
  };
  void Hold(std::initializer_list<int> files) {
    held_.clear();
    for (int i : files) held_.insert(Name(i));
  }

  std::string Publish(int from, int to) {
    std::string id = pf_->CreateStream("test", 1);
    std::vector<std::string> paths;
    for (int i = from; i < to; ++i) paths.push_back(Name(i));
    EXPECT_TRUE(pf_->Publish(id, paths));
    return id;
  }

  int RunAll() {
    int n = 0;
    while (pf_->RunOneJob()) ++n;
    return n;
  }

  // A whole-file read as FUSE would report it after serving it from the window.
  void ReadFile(int i, ReadOutcome outcome = ReadOutcome::kHit) {
    pf_->OnRead(Name(i), {kFileSize, 1}, 0, kFileSize, outcome);
  }

  // The kernel was served files 0-9 and then forgot the inodes of 0-6 (marks 7, 8 and 9 are
  // left).
  void ThreeMarksOfTenFiles() {
    Prefetcher::Options o;
    o.start_workers = false;
    o.keep_cache = true;
    pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
    KnowAttrs();
    ProbeKernel();
    for (int i = 0; i < 10; ++i) ReadFile(i, ReadOutcome::kMiss);
    for (int i = 0; i < 7; ++i) Forget(i);
  }

  MemBackend store_;
  FakeClock clock_;
  prometheus::Registry registry_;
  std::unique_ptr<cache::RamCache> ram_;
  std::map<std::string, cfs_client::FileAttr> known_;
  std::set<std::string> inodes_;           // files whose inodes the kernel holds
  std::map<std::string, uint64_t> marks_;  // their marks
  std::set<std::string> held_;
  int probes_ = 0;
  KnownAttrs known_attrs_{this};
  HeldPages held_pages_{this};
  bool accept_stores_ = true;
  std::map<std::string, std::string> stored_;
  StoringPages storing_pages_{this};
  std::unique_ptr<Prefetcher> pf_;  // last: it may call the two above until it is gone
};

TEST_F(PrefetcherTest, FilesTheKernelHoldsWholeAreNotFetchedAgain) {
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true);
  KnowAttrs();
  ProbeKernel();
  std::string first = Publish(0, 5);
  EXPECT_EQ(RunAll(), 5);
  EXPECT_EQ(probes_, 0);  // nothing marked yet: nothing to ask
  for (int i = 0; i < 5; ++i) ReadFile(i);
  EXPECT_EQ(pf_->GetStats().resident_marks, 5u);
  pf_->DeleteStream(first);
  const size_t reads = store_.read_log().size();
  const int stats = store_.stats();
  // The next epoch: the kernel still holds all five, so nothing is fetched.
  Hold({0, 1, 2, 3, 4});
  Publish(0, 5);
  RunAll();
  EXPECT_EQ(probes_, 5);
  EXPECT_EQ(store_.read_log().size(), reads);
  EXPECT_EQ(store_.stats(), stats);
  EXPECT_EQ(pf_->GetStats().page_resident, 5u);
  EXPECT_EQ(pf_->GetStats().window_files, 0u);
}

// A fetched file goes into the kernel's page cache at once: the readers then pass its position
// with no read reaching the daemon (the publisher says how far they are), and that counts as a
// hit; the window lets the file go. A file whose pages were dropped before its read reaches the
// daemon and counts as what that read was, not as a hit. The next epoch trusts the marks.
// A batch-mode stream (its workers read the files through /v1/files/batch, not the mount):
// nothing is put into the page cache for it, a file the kernel holds counts for nothing, and a
// file the RAM cache holds is left there, where the batch request finds it.
TEST_F(PrefetcherTest, ABatchModeStreamStoresNothingInThePageCacheAndPassesNothingOver) {
  Make(/*window_files=*/16, 1 << 20, /*slack=*/2, /*evict_after_read=*/false,
       /*keep_cache=*/true, [] { return std::optional<uint64_t>(7); });
  KnowAttrs();
  pf_->SetPageProbe(&storing_pages_);
  // A prefetch-mode stream first: files 0-3 stored and marked page-resident.
  std::string id = pf_->CreateStream("prefetch", 1);
  ASSERT_TRUE(pf_->Publish(id, {Name(0), Name(1), Name(2), Name(3)}));
  EXPECT_EQ(RunAll(), 4);
  EXPECT_EQ(stored_.size(), 4u);
  pf_->DeleteStream(id);

  id = pf_->CreateStream("batch", 1, 0, nullptr, "", /*page_cache=*/false);
  ASSERT_TRUE(pf_->Publish(id, {Name(0), Name(1), Name(4), Name(5)}));
  // 0 and 1, marked page-resident, are in the RAM cache too (the window gave them to it when
  // it stored them): left there for the batch request. 4 and 5 are fetched, and not stored.
  EXPECT_EQ(RunAll(), 2);
  EXPECT_EQ(stored_.size(), 4u);
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.stored, 4u);
  EXPECT_EQ(st.trusted, 0u);
  EXPECT_EQ(st.fetched, 6u);
  EXPECT_EQ(st.window_files, 2u);
  for (int i : {4, 5})
    EXPECT_NE(pf_->Get(Name(i), store_.Stat(Name(i)).value().Version(), 0), std::nullopt) << i;
  for (int i : {0, 1})
    EXPECT_NE(ram_->Get(cache::ChunkKey(Name(i), store_.Stat(Name(i)).value().Version(), 0)),
              nullptr)
        << i;
  for (int i : {0, 1, 4, 5}) ReadFile(i);  // served from the window, then kept in RAM
  pf_->DeleteStream(id);

  // The next batch-mode epoch: every file is in the RAM cache, where the batch request finds
  // it; none goes through the window again.
  id = pf_->CreateStream("batch", 1, 0, nullptr, "", /*page_cache=*/false);
  ASSERT_TRUE(pf_->Publish(id, {Name(0), Name(1), Name(4), Name(5)}));
  EXPECT_EQ(RunAll(), 0);
  EXPECT_EQ(pf_->GetStats().window_files, 0u);
  // The batch request reports each file's read as one of the control API (not to the kernel):
  // each consumes its position in the stream, as the read it was; another user's reads move
  // nothing.
  const std::vector<std::string> names = {Name(0), Name(1), Name(4), Name(5)};
  auto batch_reads = [&](int64_t uid) {
    for (const std::string& n : names) {
      const cfs_client::FileVersion v = store_.Stat(n).value().Version();
      pf_->OnRead(n, v, 0, v.size, n == Name(5) ? ReadOutcome::kLate : ReadOutcome::kHit,
                  /*to_kernel=*/false, uid);
    }
  };
  batch_reads(/*uid=*/2);
  st = pf_->GetStats();
  ASSERT_EQ(st.streams.size(), 1u);
  EXPECT_EQ(st.streams[0].queued, 4u);
  batch_reads(/*uid=*/0);  // the stream's user
  st = pf_->GetStats();
  EXPECT_EQ(st.streams[0].queued, 0u);
  EXPECT_EQ(st.streams[0].reads.hit, 3u);
  EXPECT_EQ(st.streams[0].reads.late, 1u);
}

// A batch-mode stream whose requests found a window's worth of files in a row in RAM, none
// through the window, rests: nothing is looked up ahead of it. Hits the window served do not
// count (the look-ahead made them). A read that is not such a hit (the request read the file
// from the store) wakes the look-ahead again, from where the readers are.
TEST_F(PrefetcherTest, ABatchModeStreamThatOnlyHitsRamRestsUntilAMiss) {
  Make(/*window_files=*/4, 1 << 20, /*slack=*/2, /*evict_after_read=*/false);
  KnowAttrs();
  std::vector<std::string> names;
  for (int i = 0; i < 12; ++i) names.push_back(Name(i));
  auto report = [&](int from, int to, ReadOutcome outcome) {
    for (int i = from; i < to; ++i) {
      const cfs_client::FileVersion v = store_.Stat(names[i]).value().Version();
      pf_->OnRead(names[i], v, 0, v.size, outcome, /*to_kernel=*/false, 0);
    }
  };
  std::string id = pf_->CreateStream("batch", 1, 0, nullptr, "", /*page_cache=*/false);
  ASSERT_TRUE(pf_->Publish(id, {Name(0), Name(1), Name(2), Name(3)}));
  EXPECT_EQ(RunAll(), 4);
  report(0, 4, ReadOutcome::kHit);  // served by the window: the look-ahead is at work
  ASSERT_TRUE(pf_->Publish(id, {Name(8), Name(9)}));
  EXPECT_EQ(RunAll(), 2);  // so it goes on
  pf_->DeleteStream(id);

  // The next epoch: 0-3 are in RAM (the window left them there), and found there.
  id = pf_->CreateStream("batch", 1, 0, nullptr, "", /*page_cache=*/false);
  ASSERT_TRUE(pf_->Publish(id, {Name(0), Name(1), Name(2), Name(3)}));
  EXPECT_EQ(RunAll(), 0);
  report(0, 4, ReadOutcome::kHit);  // four RAM hits in a row: a window's worth
  ASSERT_TRUE(pf_->Publish(id, {Name(4), Name(5), Name(6), Name(7)}));
  EXPECT_EQ(RunAll(), 0);            // resting: 4-7 are not looked at
  report(4, 5, ReadOutcome::kMiss);  // 4 was read from the store by the request
  EXPECT_EQ(RunAll(), 3);            // 5, 6 and 7 fetched ahead again
  EXPECT_EQ(pf_->GetStats().fetched, 9u);
}

TEST_F(PrefetcherTest, AFetchedFileIsStoredInThePageCacheAndPassingItIsAHit) {
  Make(/*window_files=*/16, 1 << 20, /*slack=*/2, true, /*keep_cache=*/true,
       [] { return std::optional<uint64_t>(7); });
  KnowAttrs();
  pf_->SetPageProbe(&storing_pages_);
  const std::string id = pf_->CreateStream("epoch", 1);
  auto publish = [&](int from, int to) {
    std::vector<std::string> paths;
    for (int i = from; i < to; ++i) paths.push_back(Name(i));
    // The readers have yet to read the last 8 positions published.
    ASSERT_EQ(pf_->PublishAs(0, id, paths, false, nullptr, nullptr, /*unread=*/8),
              Prefetcher::Op::kOk);
  };
  publish(0, 8);
  EXPECT_EQ(RunAll(), 8);
  ASSERT_EQ(stored_.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(stored_[Name(i)], store_.Data(Name(i)));
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.stored, 8u);
  EXPECT_EQ(st.resident_marks, 8u);
  EXPECT_EQ(st.reads.total(), 0u);
  EXPECT_EQ(st.window_bytes, 0u);  // the kernel holds the bytes; the window keeps no copy
  EXPECT_EQ(pf_->Get(Name(6), store_.Stat(Name(6)).value().Version(), 0), std::nullopt);

  // The kernel dropped file 6's pages: its read reaches the daemon, which fetches it again (a
  // miss), and is not counted again as a hit when the readers pass it.
  const cfs_client::FileVersion v6 = store_.Stat(Name(6)).value().Version();
  pf_->OnRead(Name(6), v6, 0, kFileSize, ReadOutcome::kMiss, /*to_kernel=*/true);
  EXPECT_EQ(pf_->GetStats().reads.miss, 1u);

  publish(8, 16);  // the readers are past positions 0-7 (the publisher knows: no slack)
  st = pf_->GetStats();
  EXPECT_EQ(st.reads.hit, 7u);
  EXPECT_EQ(st.reads.miss, 1u);
  ASSERT_EQ(st.streams.size(), 1u);
  EXPECT_EQ(st.streams[0].reads.hit, 7u);
  EXPECT_EQ(st.streams[0].page_cache, 7u);
  EXPECT_EQ(st.streams[0].skipped, 0u);
  EXPECT_EQ(st.streams[0].read, 1u);
  EXPECT_EQ(st.window_files, 0u);
  RunAll();
  publish(16, 24);  // past 8-15, all stored
  EXPECT_EQ(pf_->GetStats().reads.hit, 7u + 8u);
  pf_->DeleteStream(id);

  // The next epoch: every file is marked and nothing was reclaimed: passed over, no store read.
  const size_t reads = store_.read_log().size();
  Publish(0, 16);
  RunAll();
  EXPECT_EQ(store_.read_log().size(), reads);
  EXPECT_EQ(probes_, 0);
  EXPECT_EQ(pf_->GetStats().trusted, 16u);
}

// A trusted mark does not prove the pages are there: proactive reclaim (DAMON's pageout) drops
// page cache without the kernel counting a reclaim. The next epoch puts each marked file the
// daemon holds back into the page cache from RAM (no store read); one it does not hold is left
// to its mark.
TEST_F(PrefetcherTest, TrustedFilesTheDaemonHoldsArePutBackIntoThePageCache) {
  Make(16, 1 << 20, 2, /*evict_after_read=*/false, /*keep_cache=*/true,
       [] { return std::optional<uint64_t>(7); });
  KnowAttrs();
  pf_->SetPageProbe(&storing_pages_);
  const std::string first = Publish(0, 8);
  EXPECT_EQ(RunAll(), 8);
  ASSERT_EQ(pf_->GetStats().stored, 8u);
  pf_->DeleteStream(first);  // the epoch ends
  // The LRU keeps a copy of each (evict_after_read off), but not of file 3.
  for (int i = 0; i < 8; ++i)
    ram_->Insert(cache::ChunkKey(Name(i), store_.Stat(Name(i)).value().Version(), 0),
                 cache::Buffer::Allocate(kFileSize));
  ram_->EraseFile(Name(3));
  stored_.clear();
  held_.clear();  // the kernel dropped every page without counting a reclaim
  const size_t reads = store_.read_log().size();
  Publish(0, 8);
  RunAll();
  const Stats st = pf_->GetStats();
  EXPECT_EQ(st.trusted, 8u);
  EXPECT_EQ(st.restored, 7u);
  EXPECT_EQ(stored_.size(), 7u);
  EXPECT_EQ(stored_.count(Name(3)), 0u);
  EXPECT_EQ(store_.read_log().size(), reads);  // nothing read from the store
  EXPECT_EQ(probes_, 0);
}

// A kernel that refuses the bytes (it forgot the inode, the attributes it holds are of another
// version): nothing is marked, the file stays in the window for its read.
TEST_F(PrefetcherTest, AFileTheKernelDoesNotTakeWaitsInTheWindow) {
  Make(8, 1 << 20, 2, true, /*keep_cache=*/true, [] { return std::optional<uint64_t>(7); });
  KnowAttrs();
  pf_->SetPageProbe(&storing_pages_);
  accept_stores_ = false;
  Publish(0, 4);
  EXPECT_EQ(RunAll(), 4);
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.stored, 0u);
  EXPECT_EQ(st.resident_marks, 0u);
  EXPECT_EQ(st.window_files, 4u);
  ReadFile(0);
  EXPECT_EQ(pf_->GetStats().reads.hit, 1u);
}

// While the kernel reclaims no page-cache page, a marked file is passed over without a probe;
// once it has, the marks made before are probed, and those made after trusted again.
TEST_F(PrefetcherTest, MarksAreTrustedWhileNoPageIsReclaimed) {
  std::optional<uint64_t> reclaimed = 100;
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true, [&reclaimed] { return reclaimed; });
  KnowAttrs();
  ProbeKernel();
  for (int i = 0; i < 5; ++i) ReadFile(i, ReadOutcome::kMiss);  // all five marked
  const size_t reads = store_.read_log().size();
  Hold({0, 1, 2, 3, 4});
  std::string second = Publish(0, 5);
  RunAll();
  EXPECT_EQ(probes_, 0);
  EXPECT_EQ(pf_->GetStats().trusted, 5u);
  EXPECT_EQ(store_.read_log().size(), reads);
  pf_->DeleteStream(second);

  // Pages were reclaimed (the counter moved): the five are probed; 2 is gone and fetched.
  reclaimed = 150;
  clock_.AdvanceSeconds(1);  // past the counter's sampling interval
  Hold({0, 1, 3, 4});
  std::string third = Publish(0, 5);
  RunAll();
  EXPECT_EQ(probes_, 5);
  ASSERT_EQ(store_.read_log().size(), reads + 1);
  EXPECT_EQ(store_.read_log().back(), Name(2));
  ReadFile(2);  // marked again, after the reclaim: trusted
  pf_->DeleteStream(third);
  clock_.AdvanceSeconds(1);
  Publish(2, 3);
  RunAll();
  EXPECT_EQ(probes_, 5);
  EXPECT_EQ(pf_->GetStats().trusted, 6u);

  // A counter that cannot be read trusts nothing.
  reclaimed.reset();
  clock_.AdvanceSeconds(1);
  Publish(3, 4);
  RunAll();
  EXPECT_EQ(probes_, 6);
}

// Page pressure (files a stream passed over whose reads reach the daemon all the same, often)
// wins over trust: the files passed over are looked at again as the readers come near, and
// those the kernel dropped too are read into the LRU cache ahead of their readers.
TEST_F(PrefetcherTest, PagePressureWinsOverTrust) {
  Make(64, 1 << 20, 4, true, /*keep_cache=*/true, [] { return std::optional<uint64_t>(7); });
  KnowAttrs();
  ProbeKernel();
  for (int i = 0; i < 20; ++i) ReadFile(i, ReadOutcome::kMiss);  // marked, and trusted
  for (int i = 0; i < 20; ++i) held_.insert(Name(i));
  Publish(0, 20);
  RunAll();
  EXPECT_EQ(probes_, 0);
  EXPECT_EQ(pf_->GetStats().trusted, 20u);
  // Drops now and then are not pressure: 4 reads of files passed over, over more than 10 s.
  auto drop_and_read = [&](int i) {
    held_.erase(Name(i));
    ReadFile(i, ReadOutcome::kMiss);
  };
  for (int i = 0; i < 3; ++i) drop_and_read(i);
  clock_.AdvanceSeconds(11);
  drop_and_read(3);
  EXPECT_EQ(pf_->GetStats().page_drops, 4u);
  EXPECT_FALSE(pf_->GetStats().page_pressure);
  // Four within 10 s are.
  for (int i = 4; i < 8; ++i) drop_and_read(i);
  ASSERT_TRUE(pf_->GetStats().page_pressure);
  // Of the files passed over near the readers (8 to 19), the kernel dropped 9, 10 and 11 too,
  // and the RAM cache holds 11: 9 and 10 are read into the LRU cache, nothing else is read.
  for (int i : {9, 10, 11}) held_.erase(Name(i));
  ram_->Insert(cache::ChunkKey(Name(11), {kFileSize, 1}, 0), cache::Buffer::Allocate(kFileSize));
  const size_t reads = store_.read_log().size();
  RunAll();
  const std::vector<std::string> log = store_.read_log();
  EXPECT_EQ(std::vector<std::string>(log.begin() + static_cast<ptrdiff_t>(reads), log.end()),
            (std::vector<std::string>{Name(9), Name(10)}));
  const Stats st = pf_->GetStats();
  EXPECT_EQ(st.lru_filled, 2u);
  EXPECT_EQ(st.store_reads.lru_fill, 2u);
  EXPECT_EQ(st.store_reads.window, 0u);
  EXPECT_EQ(st.page_resident, 9u);  // 8 and 12 to 19: asked, found, not read
  EXPECT_EQ(probes_, 11);           // all but 11, which the RAM cache holds
  EXPECT_TRUE(ram_->Contains(cache::ChunkKey(Name(9), {kFileSize, 1}, 0)));
}

// A warm epoch whose files the kernel holds reads nothing from the store (issue 60: a
// shuffled DataLoader over 1.28 M files, no read reaching the daemon in epochs 2 and 3, yet
// tens of thousands of files a warm epoch read into the LRU cache). Reads of marked files a
// stream did not pass over (here: epoch 1's reads of files the window held as they were put
// into the page cache) say nothing of what the streams pass over: no page pressure.
TEST_F(PrefetcherTest, WarmEpochsWhoseFilesTheKernelHoldsReadNothingFromTheStore) {
  Make(64, 1 << 20, 4, /*evict_after_read=*/true, /*keep_cache=*/true,
       [] { return std::optional<uint64_t>(7); });
  KnowAttrs();
  pf_->SetPageProbe(&storing_pages_);
  auto pass_all = [&](const std::string& id) {  // the publisher: the readers are past all
    ASSERT_EQ(pf_->PublishAs(0, id, {}, false, nullptr, nullptr, 0), Prefetcher::Op::kOk);
  };
  // Epoch 1: every file is fetched and put into the page cache; eight readers' reads reach
  // the daemon all the same (they raced the store), within a second: reads of marked files.
  std::string id = Publish(0, 20);
  EXPECT_EQ(RunAll(), 20);
  EXPECT_EQ(pf_->GetStats().stored, 20u);
  for (int i = 0; i < 8; ++i) ReadFile(i);
  EXPECT_EQ(pf_->GetStats().page_drops, 8u);
  EXPECT_FALSE(pf_->GetStats().page_pressure);
  pass_all(id);
  pf_->DeleteStream(id);
  const size_t reads = store_.read_log().size();
  EXPECT_EQ(reads, 20u);
  // Epochs 2 to 4, shuffled: the kernel holds every file, no read reaches the daemon.
  for (int epoch = 2; epoch <= 4; ++epoch) {
    clock_.AdvanceSeconds(5);
    std::string e = pf_->CreateStream("test", 1);
    std::vector<std::string> paths;
    for (int i = 0; i < 20; ++i) paths.push_back(Name((i * 7 + epoch) % 20));
    ASSERT_TRUE(pf_->Publish(e, paths));
    RunAll();
    pass_all(e);
    const Stats st = pf_->GetStats();
    ASSERT_EQ(st.streams.size(), 1u);
    EXPECT_EQ(st.streams[0].page_cache, 20u) << "epoch " << epoch;
    pf_->DeleteStream(e);
  }
  EXPECT_EQ(store_.read_log().size(), reads);
  const Stats st = pf_->GetStats();
  EXPECT_EQ(st.lru_filled, 0u);
  EXPECT_EQ(st.store_reads.lru_fill, 0u);
  EXPECT_EQ(st.store_reads.window, 20u);  // epoch 1's, each file once
}

// Under page pressure, a file passed over near the readers that the kernel still holds, or
// that the RAM cache or the NVMe tier holds, costs no store read.
TEST_F(PrefetcherTest, UnderPagePressureNoFileTheKernelOrTheCacheHoldsIsReadFromTheStore) {
  const std::string dir = ::testing::TempDir() + "ctfs_prefetch_nvme_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  cache::DiskCache::Options d;
  d.dir = dir;
  d.capacity_bytes = 1 << 20;
  d.min_free_ratio = 0;
  auto disk = cache::DiskCache::Open(d, nullptr);
  ASSERT_TRUE(disk.ok()) << disk.status().ToString();
  Prefetcher::Options o;
  o.start_workers = false;
  o.keep_cache = true;
  o.reclaim_counter = [] { return std::optional<uint64_t>(7); };  // every mark trusted
  o.chunk_bytes = 64 << 10;
  o.prefetch.window_files = 64;
  o.prefetch.max_inflight = 2;  // near: 4 positions ahead of the furthest read
  o.skip_slack = 64;
  o.attr_timeout_s = 1000;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_, disk->get());
  KnowAttrs();
  ProbeKernel();
  for (int i = 0; i < 20; ++i) ReadFile(i, ReadOutcome::kMiss);
  for (int i = 0; i < 20; ++i) held_.insert(Name(i));
  Publish(0, 20);
  RunAll();
  EXPECT_EQ(probes_, 0);
  EXPECT_TRUE(store_.read_log().empty());
  // The kernel drops four files the stream passed over before their reads, within 10 s.
  for (int i = 0; i < 4; ++i) {
    held_.erase(Name(i));
    ReadFile(i, ReadOutcome::kMiss);
  }
  ASSERT_TRUE(pf_->GetStats().page_pressure);
  // Near the readers now: 4 and 5, which the kernel still holds; 6, dropped but in RAM; 7,
  // dropped but on NVMe.
  held_.erase(Name(6));
  held_.erase(Name(7));
  ram_->Insert(cache::ChunkKey(Name(6), {kFileSize, 1}, 0), cache::Buffer::Allocate(kFileSize));
  ASSERT_TRUE(
      (*disk)
          ->Put(cache::ChunkKey(Name(7), {kFileSize, 1}, 0), *cache::Buffer::Allocate(kFileSize))
          .ok());
  RunAll();
  EXPECT_TRUE(store_.read_log().empty());
  const Stats st = pf_->GetStats();
  EXPECT_EQ(st.lru_filled, 0u);
  EXPECT_EQ(st.store_reads.lru_fill, 0u);
  EXPECT_EQ(st.page_resident, 2u);
  EXPECT_EQ(probes_, 2);  // the cached ones need no probe
  pf_.reset();            // before the NVMe tier it uses
  disk->reset();
  std::filesystem::remove_all(dir);
}

TEST_F(PrefetcherTest, MarkedFilesWhosePagesTheKernelDroppedAreFetched) {
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true);
  KnowAttrs();
  ProbeKernel();
  pf_->DeleteStream(Publish(0, 5));  // nothing fetched: the reads below are demand reads
  for (int i = 0; i < 5; ++i) ReadFile(i, ReadOutcome::kMiss);  // all five marked
  // Memory pressure took the pages of 2 and 4, and not in the order they were served.
  Hold({0, 1, 3});
  Publish(0, 5);
  const size_t before = store_.read_log().size();
  RunAll();
  std::vector<std::string> log = store_.read_log();
  EXPECT_EQ(std::vector<std::string>(log.begin() + before, log.end()),
            (std::vector<std::string>{Name(2), Name(4)}));
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.page_resident, 3u);
  EXPECT_EQ(st.probed_absent, 2u);
  EXPECT_EQ(st.resident_marks, 3u);
  // The fetched files are served from the window, and leave it once read.
  EXPECT_TRUE(pf_->Get(Name(2), {kFileSize, 1}, 0).has_value());
  ReadFile(2);
  ReadFile(4);
  EXPECT_EQ(pf_->GetStats().window_files, 0u);
}

TEST_F(PrefetcherTest, FilesPassedOverAreProbedAgainAsTheReadersComeNear) {
  Prefetcher::Options o;
  o.start_workers = false;
  o.keep_cache = true;
  o.prefetch.window_files = 64;
  o.prefetch.max_inflight = 2;  // rechecks 4 positions ahead of the furthest read
  o.skip_slack = 4;
  o.attr_timeout_s = 10;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  KnowAttrs();
  ProbeKernel();
  for (int i = 0; i < 20; ++i) ReadFile(i, ReadOutcome::kMiss);
  Hold({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19});
  Publish(0, 20);
  RunAll();
  EXPECT_EQ(probes_, 20);
  EXPECT_TRUE(store_.read_log().empty());
  // Long after that first probe, the kernel drops file 10's pages. The readers reach file 7
  // (its pages had gone too): files 8 to 11 are now near, and asked about again.
  held_.erase(Name(10));
  held_.erase(Name(7));
  ReadFile(7, ReadOutcome::kMiss);
  RunAll();
  EXPECT_EQ(store_.read_log(), std::vector<std::string>{Name(10)});
  EXPECT_EQ(pf_->GetStats().probed_absent, 1u);
  // Files further ahead are not asked about again yet.
  held_.erase(Name(15));
  RunAll();
  EXPECT_EQ(store_.read_log(), std::vector<std::string>{Name(10)});
}

TEST_F(PrefetcherTest, UnderSustainedPageDropsFilesNearTheReadersTheKernelDroppedAreWarmed) {
  Prefetcher::Options o;
  o.start_workers = false;
  o.keep_cache = true;
  o.prefetch.window_files = 64;
  o.prefetch.max_inflight = 2;  // near: 4 positions ahead of the furthest read
  o.skip_slack = 64;
  o.attr_timeout_s = 1000;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  KnowAttrs();
  ProbeKernel();
  for (int i = 0; i < 40; ++i) ReadFile(i, ReadOutcome::kMiss);  // all marked
  for (int i = 0; i < 40; ++i) held_.insert(Name(i));
  // Drops outside the streams are not pressure, however often: 4 reads of marked files within
  // a second, in no stream.
  for (int i = 0; i < 4; ++i) ReadFile(i, ReadOutcome::kMiss);
  EXPECT_EQ(pf_->GetStats().page_drops, 4u);
  EXPECT_FALSE(pf_->GetStats().page_pressure);  // and each read marked its file again

  auto reader = std::make_shared<Caller>();
  reader->uid = 1000;
  reader->gid = 1000;
  std::string id = pf_->CreateStream("user", 1, 1000, reader);
  std::vector<std::string> paths;
  for (int i = 0; i < 30; ++i) paths.push_back(Name(i));
  ASSERT_TRUE(pf_->Publish(id, paths));
  RunAll();
  EXPECT_EQ(probes_, 30);
  EXPECT_TRUE(store_.read_log().empty());
  // The kernel drops four files between their probe and their read, within 10 s: a probe
  // cannot keep up. The files passed over that the readers are near (4 to 7) are not probed
  // again as before but go to the LRU cache, the window staying empty: those the kernel
  // dropped too (5 and 6) and the RAM cache does not hold (7). 4, still in the kernel, is
  // found there and not read.
  for (int i = 0; i < 4; ++i) {
    held_.erase(Name(i));
    ReadFile(i, ReadOutcome::kMiss);
    clock_.AdvanceSeconds(1);
  }
  EXPECT_TRUE(pf_->GetStats().page_pressure);
  for (int i : {5, 6, 7}) held_.erase(Name(i));
  ram_->Insert(cache::ChunkKey(Name(7), {kFileSize, 1}, 0), cache::Buffer::Allocate(kFileSize));
  const Stats before = pf_->GetStats();
  RunAll();
  std::vector<std::string> want = {Name(5), Name(6)};
  EXPECT_EQ(store_.read_log(), want);
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.lru_filled, 2u);
  EXPECT_EQ(st.store_reads.lru_fill, 2u);
  EXPECT_EQ(st.page_resident, before.page_resident + 1);
  EXPECT_EQ(st.window_files, 0u);
  EXPECT_TRUE(ram_->Get(cache::ChunkKey(Name(5), {kFileSize, 1}, 0)));
  // As the readers go on, the next ones are warmed if the kernel dropped them; a file the
  // reader's owner may not read is not.
  known_[Name(9)].mode = S_IFREG | 0600;
  known_[Name(9)].uid = 4242;
  held_.erase(Name(8));
  held_.erase(Name(9));
  ReadFile(4);
  ReadFile(5);
  RunAll();
  want.push_back(Name(8));
  EXPECT_EQ(store_.read_log(), want);
  EXPECT_EQ(pf_->GetStats().denied, 1u);
  EXPECT_EQ(pf_->GetStats().store_reads.lru_fill, 3u);
  // 60 s with no new drop end it: the files passed over are probed again as readers come.
  clock_.AdvanceSeconds(61);
  EXPECT_FALSE(pf_->GetStats().page_pressure);
  const int probes = probes_;
  ReadFile(6);
  ReadFile(7);
  RunAll();
  EXPECT_EQ(store_.read_log(), want);
  EXPECT_GT(probes_, probes);
}

TEST_F(PrefetcherTest, AFilePublishedTwiceWhosePagesAreGoneIsProbedAndFetchedOnce) {
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true);
  KnowAttrs();
  ProbeKernel();
  ReadFile(0, ReadOutcome::kMiss);
  std::string id = pf_->CreateStream("test", 1);
  ASSERT_TRUE(pf_->Publish(id, {Name(0), Name(1), Name(0)}));
  // The probe finds file 0 gone: it is fetched once, for both of its positions.
  RunAll();
  EXPECT_EQ(probes_, 1);
  EXPECT_EQ(store_.read_log(), (std::vector<std::string>{Name(0), Name(1)}));
  EXPECT_EQ(pf_->GetStats().window_files, 2u);
}

TEST_F(PrefetcherTest, AReadOfAMarkedFileDropsOnlyItsMark) {
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true);
  KnowAttrs();
  ProbeKernel();
  for (int i = 0; i < 3; ++i) ReadFile(i, ReadOutcome::kMiss);
  // The kernel asks for file 1 again (and only reads part of it): its pages are gone.
  pf_->OnRead(Name(1), {kFileSize, 1}, 0, kFileSize / 2, ReadOutcome::kMiss);
  EXPECT_EQ(pf_->GetStats().resident_marks, 2u);
  Hold({0, 1, 2});
  Publish(0, 3);
  RunAll();
  EXPECT_EQ(probes_, 2);
  EXPECT_EQ(store_.read_log(), std::vector<std::string>{Name(1)});
}

TEST_F(PrefetcherTest, WithoutAPageProbeMarkedFilesAreFetched) {
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true);
  KnowAttrs();
  for (int i = 0; i < 3; ++i) ReadFile(i, ReadOutcome::kMiss);
  EXPECT_EQ(pf_->GetStats().resident_marks, 3u);
  Publish(0, 3);
  EXPECT_EQ(RunAll(), 3);
  EXPECT_EQ(store_.read_log().size(), 3u);
}

TEST_F(PrefetcherTest, MarksHoldOnlyAtTheVersionOfFreshAttributes) {
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true);
  KnowAttrs();
  ProbeKernel();
  Hold({0, 1, 2});
  pf_->DeleteStream(Publish(0, 3));
  for (int i = 0; i < 3; ++i) ReadFile(i);
  known_[Name(0)].mtime_ns = 2;  // changed in the store
  known_.erase(Name(1));         // attributes expired
  pf_->Invalidate(Name(2));      // written through the mount
  Publish(0, 3);
  EXPECT_EQ(RunAll(), 3);
  EXPECT_EQ(probes_, 0);
  EXPECT_EQ(pf_->GetStats().page_resident, 0u);
}

TEST_F(PrefetcherTest, WithoutKeepCacheNothingIsMarked) {
  Make();
  KnowAttrs();
  ProbeKernel();
  pf_->DeleteStream(Publish(0, 3));
  for (int i = 0; i < 3; ++i) ReadFile(i, ReadOutcome::kMiss);
  EXPECT_EQ(pf_->GetStats().resident_marks, 0u);
  Publish(0, 3);
  EXPECT_EQ(RunAll(), 3);
}

TEST_F(PrefetcherTest, ReadsForTheControlApiMarkNothing) {
  Make(8, 1 << 20, 4, true, /*keep_cache=*/true);
  KnowAttrs();
  ProbeKernel();
  // /batchdownload streamed file 0 to an HTTP client: the kernel holds none of it.
  pf_->OnRead(Name(0), {kFileSize, 1}, 0, kFileSize, ReadOutcome::kMiss, /*to_kernel=*/false);
  EXPECT_EQ(pf_->GetStats().resident_marks, 0u);
  Publish(0, 1);
  EXPECT_EQ(RunAll(), 1);
  EXPECT_EQ(probes_, 0);
}

// A mark goes with the inode: files whose inodes the kernel forgot are fetched, with no probe.
TEST_F(PrefetcherTest, MarksGoWithTheInodesTheKernelForgets) {
  ThreeMarksOfTenFiles();
  EXPECT_EQ(pf_->GetStats().resident_marks, 3u);
  Hold({0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  Publish(0, 10);
  RunAll();
  EXPECT_EQ(probes_, 3);  // only 7, 8 and 9 are asked about and passed over
  EXPECT_EQ(store_.read_log().size(), 7u);
  EXPECT_EQ(pf_->GetStats().page_resident, 3u);
}

// A file read many times keeps one mark; a read of a file whose inode the kernel does not
// hold (an HTTP client's, or one forgotten) marks nothing.
TEST_F(PrefetcherTest, AFileReadAgainAndAgainKeepsOneMark) {
  ThreeMarksOfTenFiles();  // marks 7, 8, 9
  // Page drops this far apart are no memory pressure.
  for (int k = 0; k < 3000; ++k) {
    clock_.AdvanceSeconds(11);
    ReadFile(9, ReadOutcome::kMiss);
  }
  EXPECT_EQ(pf_->GetStats().resident_marks, 3u);
  ReadFile(3, ReadOutcome::kMiss);  // its inode was forgotten
  EXPECT_EQ(pf_->GetStats().resident_marks, 3u);
  Hold({7, 8, 9});
  Publish(7, 10);
  RunAll();
  EXPECT_EQ(probes_, 3);
  EXPECT_EQ(pf_->GetStats().page_resident, 3u);
}

// Marks made after 2^31 others still order as made (sequence numbers compare modulo 2^31).
TEST(ResidentMarksTest, SequenceNumbersWrap) {
  ResidentMarks marks({true, [] { return std::optional<uint64_t>(5); }});
  ResidentMarks::Mark first = marks.Make({1, 2, 3, 4}, 0);
  EXPECT_EQ(first.seq, 1u);
  EXPECT_TRUE(marks.Trusted(first, 0));
  ResidentMarks::Mark a{7, 0x7FFFFFFEu, false}, b{7, 0x7FFFFFFFu, false}, c{7, 1, false};
  EXPECT_TRUE(ResidentMarks::Newer(b, a));
  EXPECT_TRUE(ResidentMarks::Newer(c, b));  // after the wrap (0 is never a sequence number)
  EXPECT_FALSE(ResidentMarks::Newer(a, c));
  EXPECT_FALSE(ResidentMarks::Newer(a, a));
  for (const ResidentMarks::Mark& m : {a, b, c, ResidentMarks::Mark{0xFFFFFFFFu, 5, true}}) {
    std::optional<ResidentMarks::Mark> back = ResidentMarks::Mark::Unpack(m.Pack());
    ASSERT_TRUE(back);
    EXPECT_NE(m.Pack(), 0u);
    EXPECT_EQ(back->version, m.version);
    EXPECT_EQ(back->seq, m.seq);
    EXPECT_EQ(back->probing, m.probing);
  }
  EXPECT_FALSE(ResidentMarks::Mark::Unpack(0));
}

// A mark a dead process made (kept in its inode records) is no probe running any more, and is
// probed before it is believed, whatever this process has marked since it started.
TEST(ResidentMarksTest, AMarkOfAnEarlierProcessIsProbedBeforeItIsBelieved) {
  const ResidentMarks::Mark old{9, 123456, true};
  std::optional<ResidentMarks::Mark> m =
      ResidentMarks::Mark::Unpack(ResidentMarks::Mark::OfEarlierProcess(old.Pack()));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->version, 9u);
  EXPECT_FALSE(m->probing);
  ResidentMarks marks({true, [] { return std::optional<uint64_t>(5); }});
  for (int k = 0; k < 1000; ++k) {
    const ResidentMarks::Mark mine = marks.Make({1, 2, 3, 4}, 0);
    EXPECT_TRUE(marks.Trusted(mine, 0));
    EXPECT_FALSE(marks.Trusted(*m, 0));
    EXPECT_TRUE(ResidentMarks::Newer(mine, *m));
  }
  EXPECT_EQ(ResidentMarks::Mark::OfEarlierProcess(0), 0u);
}

TEST_F(PrefetcherTest, FilesTheRamCacheHoldsAtFreshAttributesCostNoStoreRequest) {
  Make(8, 1 << 20, 4, /*evict_after_read=*/false);
  KnowAttrs();
  std::string first = Publish(0, 4);
  RunAll();
  for (int i = 0; i < 4; ++i) ReadFile(i);  // into the RAM cache's LRU
  pf_->DeleteStream(first);
  const size_t reads = store_.read_log().size();
  const int stats = store_.stats();
  Publish(0, 4);
  EXPECT_EQ(RunAll(), 4);
  EXPECT_EQ(store_.read_log().size(), reads);
  EXPECT_EQ(store_.stats(), stats);
  EXPECT_EQ(pf_->GetStats().cached, 4u);
  std::optional<Prefetcher::WindowHit> hit = pf_->Get(Name(3), {kFileSize, 1}, 0);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(std::string(hit->buffer->data.get(), hit->buffer->size), std::string(kFileSize, 'd'));
}

TEST_F(PrefetcherTest, KnownAttributesStillCheckTheReadersPermission) {
  Make(8, 1 << 20, 4, /*evict_after_read=*/false);
  KnowAttrs();
  known_[Name(0)].mode = S_IFREG | 0600;
  known_[Name(0)].uid = 0;
  auto reader = std::make_shared<Caller>();
  reader->uid = 1000;
  reader->gid = 1000;
  std::string id = pf_->CreateStream("user", 1, 1000, reader);
  ASSERT_TRUE(pf_->Publish(id, {Name(0)}));
  const size_t reads = store_.read_log().size();
  RunAll();
  EXPECT_EQ(store_.read_log().size(), reads);
  EXPECT_EQ(pf_->GetStats().denied, 1u);
}

TEST_F(PrefetcherTest, FetchesInPublishedOrder) {
  Make();
  Publish(0, 5);
  EXPECT_EQ(RunAll(), 5);
  EXPECT_EQ(store_.read_log(),
            (std::vector<std::string>{Name(0), Name(1), Name(2), Name(3), Name(4)}));
  auto hit = pf_->Get(Name(2), {kFileSize, 1}, 0);
  ASSERT_TRUE(hit.has_value());
  EXPECT_FALSE(hit->waited);
  EXPECT_EQ(hit->buffer->size, kFileSize);
  EXPECT_EQ(hit->buffer->data.get()[0], 'c');
  EXPECT_EQ(pf_->GetStats().fetched, 5u);
}

TEST_F(PrefetcherTest, WindowIsBoundedByFilesAndAdvancesWithReads) {
  Make(/*window_files=*/3);
  Publish(0, 10);
  EXPECT_EQ(RunAll(), 3);
  EXPECT_EQ(pf_->GetStats().window_files, 3u);
  ReadFile(0);  // read in full: leaves the window, which moves on by one
  EXPECT_EQ(pf_->GetStats().window_files, 2u);
  EXPECT_EQ(RunAll(), 1);
  EXPECT_EQ(store_.read_log().back(), Name(3));
}

TEST_F(PrefetcherTest, WindowIsBoundedByBytesAndNeverEvictsUnreadFiles) {
  Make(/*window_files=*/32, /*budget=*/2 * kFileSize);
  Publish(0, 10);
  EXPECT_EQ(RunAll(), 2);  // full: waits instead of pushing anything out
  EXPECT_EQ(pf_->GetStats().window_bytes, 2 * kFileSize);
  EXPECT_TRUE(pf_->Get(Name(0), {kFileSize, 1}, 0).has_value());
  EXPECT_TRUE(pf_->Get(Name(1), {kFileSize, 1}, 0).has_value());
  ReadFile(0);
  EXPECT_EQ(RunAll(), 1);
  EXPECT_EQ(pf_->GetStats().window_bytes, 2 * kFileSize);
}

TEST_F(PrefetcherTest, FilesReadBeforeTheirTurnAreNotFetched) {
  Make();
  Publish(0, 4);
  ReadFile(1, ReadOutcome::kMiss);  // the reader got there first (demand miss)
  EXPECT_EQ(RunAll(), 3);
  EXPECT_EQ(store_.read_log(), (std::vector<std::string>{Name(0), Name(2), Name(3)}));
}

TEST_F(PrefetcherTest, PositionsFarBehindTheReadersAreSkipped) {
  Make(/*window_files=*/4, 1 << 20, /*slack=*/2);
  std::string id = Publish(0, 20);
  ReadFile(10, ReadOutcome::kMiss);  // the readers jumped ahead
  RunAll();
  // high = 11, slack 2: positions 0..8 are skipped.
  for (const auto& p : store_.read_log()) EXPECT_GE(p, Name(9)) << p;
  Stats s = pf_->GetStats();
  ASSERT_EQ(s.streams.size(), 1u);
  EXPECT_EQ(s.streams[0].skipped, 9u);
  EXPECT_EQ(s.streams[0].read, 1u);
}

TEST_F(PrefetcherTest, EvictAfterReadFreesTheWindow) {
  Make();
  Publish(0, 2);
  RunAll();
  pf_->OnRead(Name(0), {kFileSize, 1}, 0, 600, ReadOutcome::kHit);
  EXPECT_EQ(pf_->GetStats().window_files, 2u);  // half read: still needed
  pf_->OnRead(Name(0), {kFileSize, 1}, 600, 400, ReadOutcome::kHit);
  EXPECT_EQ(pf_->GetStats().window_files, 1u);
  EXPECT_FALSE(pf_->Get(Name(0), {kFileSize, 1}, 0).has_value());
  EXPECT_EQ(ram_->Get(cache::ChunkKey(Name(0), {kFileSize, 1}, 0)), nullptr);
}

TEST_F(PrefetcherTest, WithoutEvictAfterReadReadFilesMoveToTheRamCache) {
  Make(8, 1 << 20, 4, /*evict_after_read=*/false);
  Publish(0, 2);
  RunAll();
  ReadFile(0);
  EXPECT_EQ(pf_->GetStats().window_files, 1u);
  EXPECT_NE(ram_->Get(cache::ChunkKey(Name(0), {kFileSize, 1}, 0)), nullptr);
}

TEST_F(PrefetcherTest, HitLateMissAccountingPerStreamAndGlobal) {
  Make();
  Publish(0, 3);
  ReadFile(0, ReadOutcome::kHit);
  ReadFile(1, ReadOutcome::kLate);
  ReadFile(2, ReadOutcome::kMiss);
  pf_->OnRead("not/published", {1, 1}, 0, 1, ReadOutcome::kMiss);
  Stats s = pf_->GetStats();
  EXPECT_EQ(s.reads.hit, 1u);
  EXPECT_EQ(s.reads.late, 1u);
  EXPECT_EQ(s.reads.miss, 2u);
  EXPECT_EQ(s.streams[0].reads.hit, 1u);
  EXPECT_EQ(s.streams[0].reads.late, 1u);
  EXPECT_EQ(s.streams[0].reads.miss, 1u);
}

// The scheduler state of thread `tid` of this process ('R', 'S', 'D'...), or 0 if unknown.
char ThreadState(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return 0;
  const size_t paren = line.rfind(')');  // "tid (comm) S ...": comm may hold anything
  return paren == std::string::npos || paren + 2 >= line.size() ? 0 : line[paren + 2];
}

double ReadsCounter(prometheus::Registry& reg, const std::string& result) {
  for (const auto& f : reg.Collect())
    if (f.name == "cubetorchfs_reads_total")
      for (const auto& m : f.metric)
        for (const auto& l : m.label)
          if (l.name == "result" && l.value == result) return m.counter.value;
  return -1;
}

TEST_F(PrefetcherTest, ReaderWaitsOnAFetchInFlightAndIsLate) {
  Make();
  Publish(0, 1);
  store_.CloseGate();
  std::thread worker([&] { pf_->RunOneJob(); });
  while (store_.blocked_reads() == 0) std::this_thread::yield();  // the fetch is running
  std::optional<Prefetcher::WindowHit> got;
  std::atomic<pid_t> reader_tid{0};
  std::atomic<bool> reader_done{false};
  std::thread reader([&] {
    reader_tid = static_cast<pid_t>(::syscall(SYS_gettid));
    got = pf_->Get(Name(0), {kFileSize, 1}, 0);
    reader_done = true;
  });
  // Open the gate only once the reader sleeps inside Get (nothing else in Get blocks: the
  // worker holds no lock while the store read is stuck), so its Get began while the fetch was
  // in flight. A Get that does not wait returns and ends this loop too.
  while (reader_tid == 0) std::this_thread::yield();
  while (!reader_done) {
    const char state = ThreadState(reader_tid);
    if (state == 'S') {  // asleep; still asleep a moment later: not a passing lock wait
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      if (!reader_done && ThreadState(reader_tid) == 'S') break;
      continue;
    }
    if (state == 0) {  // no /proc: give the reader time to get there
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      break;
    }
    std::this_thread::yield();
  }
  EXPECT_EQ(store_.blocked_reads(), 1) << "the fetch finished before the reader came";
  store_.OpenGate();
  worker.join();
  reader.join();
  ASSERT_TRUE(got.has_value()) << "the reader was not given the fetch it waited for";
  EXPECT_TRUE(got->waited) << "the read came while the fetch was in flight: it waited, a late "
                              "read, not a plain hit";
  ASSERT_EQ(got->buffer->size, kFileSize);
  EXPECT_EQ(std::string(got->buffer->data.get(), kFileSize), std::string(kFileSize, 'a'));
  EXPECT_EQ(store_.reads(), 1) << "the file was fetched a second time";
  // FUSE reports the read as late because it waited (fs/file_system.cc); it is counted so.
  const double late_before = ReadsCounter(registry_, "late");
  pf_->OnRead(Name(0), {kFileSize, 1}, 0, kFileSize,
              got->waited ? ReadOutcome::kLate : ReadOutcome::kHit);
  Stats s = pf_->GetStats();
  EXPECT_EQ(s.reads.late, 1u);
  EXPECT_EQ(s.reads.hit, 0u);
  ASSERT_EQ(s.streams.size(), 1u);
  EXPECT_EQ(s.streams[0].reads.late, 1u);
  EXPECT_EQ(ReadsCounter(registry_, "late"), late_before + 1);
  EXPECT_EQ(ReadsCounter(registry_, "hit"), 0);
}

TEST_F(PrefetcherTest, ReadersDoNotWaitOnAFetchThatWaitsForRoom) {
  store_.PutFile(Name(2), std::string(2500, 'z'));
  Make(/*window_files=*/8, /*budget=*/3 * kFileSize);
  std::string id = Publish(0, 3);
  EXPECT_TRUE(pf_->RunOneJob());  // files 0 and 1 fill two thirds of the window
  EXPECT_TRUE(pf_->RunOneJob());
  std::thread worker([&] { pf_->RunOneJob(); });  // file 2 does not fit: waits for room
  // Whenever this reader comes, it must not block behind that wait: it reads on demand.
  while (pf_->GetStats().inflight == 0) std::this_thread::yield();
  std::optional<Prefetcher::WindowHit> got = pf_->Get(Name(2), {2500, 1}, 0);
  EXPECT_FALSE(got.has_value());
  EXPECT_TRUE(pf_->DeleteStream(id));  // nobody wants it any more: the waiting fetch gives up
  worker.join();
  EXPECT_EQ(pf_->GetStats().window_files, 0u);
}

TEST_F(PrefetcherTest, LargeFilesAreFetchedInParallelChunks) {
  std::string big(300 << 10, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31 % 251);
  store_.PutFile("big", big);
  Make(/*window_files=*/8, /*budget=*/1 << 20);
  std::string id = pf_->CreateStream("t", 1);
  ASSERT_TRUE(pf_->Publish(id, {"big"}));
  EXPECT_EQ(RunAll(), 1);
  // The first request brought the first 64 KiB guess; then 5 chunks of 64 KiB.
  EXPECT_EQ(store_.reads(), 1 + 5);
  EXPECT_EQ(pf_->GetStats().store_reads.window, 1u + 5u);  // each request counted
  for (uint64_t c = 0; c < 5; ++c) {
    auto hit = pf_->Get("big", {big.size(), 1}, c);
    ASSERT_TRUE(hit.has_value()) << c;
    const size_t len = std::min<size_t>(64 << 10, big.size() - c * (64 << 10));
    ASSERT_EQ(hit->buffer->size, len);
    EXPECT_EQ(std::string(hit->buffer->data.get(), len), big.substr(c * (64 << 10), len)) << c;
  }
}

TEST_F(PrefetcherTest, FailedFetchesAreCountedAndLeftToDemandReads) {
  Make();
  std::string id = pf_->CreateStream("t", 1);
  ASSERT_TRUE(pf_->Publish(id, {"missing", Name(0)}));
  EXPECT_EQ(RunAll(), 2);
  Stats s = pf_->GetStats();
  EXPECT_EQ(s.failed, 1u);
  EXPECT_EQ(s.fetched, 1u);
  EXPECT_FALSE(pf_->Get("missing", {0, 0}, 0).has_value());
}

TEST_F(PrefetcherTest, DeletedStreamReleasesUnreadFilesAsEvictedUnread) {
  Make();
  std::string id = Publish(0, 4);
  RunAll();
  ReadFile(0);
  EXPECT_TRUE(pf_->DeleteStream(id));
  Stats s = pf_->GetStats();
  EXPECT_EQ(s.window_files, 0u);
  EXPECT_EQ(s.window_bytes, 0u);
  EXPECT_EQ(s.evicted_unread, 3u);
  EXPECT_FALSE(pf_->DeleteStream(id));
  EXPECT_FALSE(pf_->Publish(id, {Name(1)}));
}

TEST_F(PrefetcherTest, IdleStreamsExpire) {
  Make();
  Publish(0, 2);
  RunAll();
  clock_.AdvanceSeconds(30);
  pf_->Sweep();
  EXPECT_EQ(pf_->GetStats().streams.size(), 1u);
  clock_.AdvanceSeconds(31);
  pf_->Sweep();
  EXPECT_EQ(pf_->GetStats().streams.size(), 0u);
  EXPECT_EQ(pf_->GetStats().window_files, 0u);
}

TEST_F(PrefetcherTest, StreamsShareTheWindowRoundRobin) {
  Make(/*window_files=*/4);
  std::string a = Publish(0, 10);
  std::string b = Publish(20, 30);
  EXPECT_EQ(RunAll(), 4);
  EXPECT_EQ(store_.read_log(), (std::vector<std::string>{Name(0), Name(20), Name(1), Name(21)}));
}

TEST_F(PrefetcherTest, RepeatedPathSharesOneEntry) {
  Make();
  std::string id = pf_->CreateStream("epochs", 1);
  ASSERT_TRUE(pf_->Publish(id, {Name(0), Name(1), Name(0)}));
  EXPECT_EQ(RunAll(), 2);
  ReadFile(0);
  EXPECT_TRUE(pf_->Get(Name(0), {kFileSize, 1}, 0).has_value());  // still wanted once more
  ReadFile(1);
  ReadFile(0);
  EXPECT_EQ(pf_->GetStats().window_files, 0u);
}

TEST_F(PrefetcherTest, WarmAttributesAnswerLookupsWhileFresh) {
  Make();
  Publish(0, 1);
  EXPECT_FALSE(pf_->WindowAttr(Name(0), 0).has_value());
  RunAll();
  ASSERT_TRUE(pf_->WindowAttr(Name(0), 0).has_value());
  EXPECT_EQ(pf_->WindowAttr(Name(0), 0)->size, kFileSize);
  clock_.AdvanceSeconds(11);
  EXPECT_FALSE(pf_->WindowAttr(Name(0), 0).has_value());
}

TEST_F(PrefetcherTest, ExportsPrometheusCounters) {
  Make();
  Publish(0, 2);
  RunAll();
  ReadFile(0, ReadOutcome::kHit);
  double fetched = -1, hits = -1, window_reads = -1, lru_fill_reads = -1;
  for (const auto& f : registry_.Collect()) {
    for (const auto& m : f.metric) {
      for (const auto& l : m.label) {
        if (f.name == "cubetorchfs_prefetch_files_total" && l.value == "fetched")
          fetched = m.counter.value;
        if (f.name == "cubetorchfs_reads_total" && l.value == "hit") hits = m.counter.value;
        if (f.name == "cubetorchfs_prefetch_store_reads_total" && l.name == "reason")
          (l.value == "window" ? window_reads : lru_fill_reads) = m.counter.value;
      }
    }
  }
  EXPECT_EQ(fetched, 2);
  EXPECT_EQ(hits, 1);
  EXPECT_EQ(window_reads, 2);  // why the store was read: two files fetched ahead
  EXPECT_EQ(lru_fill_reads, 0);
  EXPECT_EQ(pf_->GetStats().store_reads.window, 2u);
}

TEST(ToStorePathTest, MapsMountPathsAndRejectsOthers) {
  EXPECT_EQ(control::ToStorePath("/mnt/x", "/mnt/x/a/b.jpg").value(), "a/b.jpg");
  EXPECT_EQ(control::ToStorePath("/mnt/x", "a//./b.jpg").value(), "a/b.jpg");
  EXPECT_EQ(control::ToStorePath("/", "/a").value(), "a");
  EXPECT_FALSE(control::ToStorePath("/mnt/x", "/mnt/xy/a").ok());
  EXPECT_FALSE(control::ToStorePath("/mnt/x", "/etc/passwd").ok());
  EXPECT_FALSE(control::ToStorePath("/mnt/x", "/mnt/x/../etc/passwd").ok());
  EXPECT_FALSE(control::ToStorePath("/mnt/x", "/mnt/x").ok());
  EXPECT_FALSE(control::ToStorePath("/mnt/x", "").ok());
}

TEST(ToStorePathTest, RefusesPathsOverPathMaxAndNamesOverNameMax) {
  // A name of 255 bytes and a path of 4096 are what the kernel allows.
  const std::string name255(255, 'n'), name256(256, 'n');
  EXPECT_EQ(control::ToStorePath("/mnt/x", "/mnt/x/a/" + name255).value(), "a/" + name255);
  Result<std::string> r = control::ToStorePath("/mnt/x", "/mnt/x/a/" + name256);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kNameTooLong);
  EXPECT_NE(r.status().message().find("NAME_MAX"), std::string::npos) << r.status().message();
  EXPECT_LT(r.status().message().size(), 200u);  // the path is not echoed whole
  EXPECT_FALSE(control::ToStorePath("/mnt/x", name256 + "/f").ok());  // a directory, too
  std::string deep;  // 16 names of 255 bytes: 4095 bytes
  while (deep.size() + 256 <= 4096) deep += (deep.empty() ? "" : "/") + name255;
  EXPECT_TRUE(control::ToStorePath("/", deep).ok());
  r = control::ToStorePath("/", deep + "/xy");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kNameTooLong);
  EXPECT_NE(r.status().message().find("PATH_MAX"), std::string::npos) << r.status().message();
  // Counted on the path as sent: "./" padding does not make a long path acceptable.
  std::string padded = "a";
  while (padded.size() <= 4096) padded = "./" + padded;
  EXPECT_FALSE(control::ToStorePath("/", padded).ok());
}

TEST_F(PrefetcherTest, StreamsBelongToTheirCreator) {
  Make();
  const std::string mine = pf_->CreateStream("alice", 1, 1000);
  ASSERT_FALSE(mine.empty());
  EXPECT_EQ(pf_->PublishAs(1001, mine, {Name(0)}), Prefetcher::Op::kForbidden);
  EXPECT_EQ(pf_->DeleteStreamAs(1001, mine), Prefetcher::Op::kForbidden);
  EXPECT_EQ(pf_->PublishAs(1000, mine, {Name(0)}), Prefetcher::Op::kOk);
  EXPECT_EQ(pf_->PublishAs(1000, "s999", {Name(0)}), Prefetcher::Op::kNotFound);
  EXPECT_EQ(pf_->GetStats(1001).streams.size(), 0u);
  ASSERT_EQ(pf_->GetStats(1000).streams.size(), 1u);
  EXPECT_EQ(pf_->GetStats(1000).streams[0].uid, 1000u);
  EXPECT_EQ(pf_->DeleteStreamAs(0, mine), Prefetcher::Op::kOk);  // root may
}

TEST_F(PrefetcherTest, StreamsAndQueuedPathsAreLimitedPerUser) {
  Prefetcher::Options o;
  o.start_workers = false;
  o.max_streams_per_uid = 2;
  o.max_queued_paths_per_uid = 5;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  const std::string a = pf_->CreateStream("a", 1, 1000);
  const std::string b = pf_->CreateStream("b", 1, 1000);
  EXPECT_FALSE(a.empty());
  EXPECT_FALSE(b.empty());
  EXPECT_TRUE(pf_->CreateStream("c", 1, 1000).empty());
  EXPECT_FALSE(pf_->CreateStream("other", 1, 1001).empty());
  EXPECT_EQ(pf_->PublishAs(1000, a, {Name(0), Name(1), Name(2)}), Prefetcher::Op::kOk);
  EXPECT_EQ(pf_->PublishAs(1000, b, {Name(3), Name(4), Name(5)}), Prefetcher::Op::kFull);
  EXPECT_EQ(pf_->PublishAs(1000, b, {Name(3), Name(4)}), Prefetcher::Op::kOk);
}

// Distinct paths of `len` bytes, numbered from `from`.
std::vector<std::string> LongPaths(size_t n, size_t len, size_t from = 0) {
  std::vector<std::string> out;
  for (size_t i = from; i < from + n; ++i) {
    std::string p = "d/" + std::to_string(i) + "_";
    p.resize(std::max(len, p.size()), 'x');
    out.push_back(std::move(p));
  }
  return out;
}

TEST_F(PrefetcherTest, QueuedPathsAreLimitedInBytesPerUserAndForAll) {
  Prefetcher::Options o;
  o.start_workers = false;
  o.max_queued_path_bytes_per_uid = 100 * Prefetcher::QueuedPathCost(1000);
  o.max_queued_path_bytes = 1000 * Prefetcher::QueuedPathCost(1000);
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  const std::string a = pf_->CreateStream("a", 1, 1000);
  // Counted by what they cost, not by their number: 100 paths of 1,000 bytes fill the user's
  // part, whatever the count limits say.
  Prefetcher::Refusal why;
  EXPECT_EQ(pf_->PublishAs(1000, a, LongPaths(101, 1000), false, nullptr, &why),
            Prefetcher::Op::kFull);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kUserBytes);
  EXPECT_EQ(why.value, o.max_queued_path_bytes_per_uid);
  EXPECT_EQ(why.held, 0u);
  EXPECT_EQ(why.asked, 101 * Prefetcher::QueuedPathCost(1000));
  EXPECT_EQ(pf_->GetStats().queued_bytes, 0u);  // refused whole
  EXPECT_EQ(pf_->PublishAs(1000, a, LongPaths(100, 1000)), Prefetcher::Op::kOk);
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.queued_paths, 100u);
  EXPECT_EQ(st.queued_bytes, 100 * Prefetcher::QueuedPathCost(1000));
  EXPECT_EQ(st.queued_users, 1u);
  ASSERT_EQ(st.streams.size(), 1u);
  EXPECT_EQ(st.streams[0].queued_bytes, st.queued_bytes);
  // Short paths still fit by count once the bytes are there: the user is full by bytes.
  EXPECT_EQ(pf_->PublishAs(1000, a, {Name(0)}, false, nullptr, &why), Prefetcher::Op::kFull);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kUserBytes);
  // The legacy way keeps what fits, in order, and says which limit cut it.
  const std::string b = pf_->CreateStream("b", 1, 1001);
  size_t taken = 0;
  EXPECT_EQ(pf_->PublishAs(1001, b, LongPaths(150, 1000, 1000), true, &taken, &why),
            Prefetcher::Op::kOk);
  EXPECT_EQ(taken, 100u);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kUserBytes);
  // Costs follow the heap block of the stream's one copy of the path, plus a fixed part.
  EXPECT_EQ(Prefetcher::QueuedPathCost(10), Prefetcher::QueuedPathCost(0));
  EXPECT_EQ(Prefetcher::QueuedPathCost(4000) - Prefetcher::QueuedPathCost(0), 4016u);
  EXPECT_GE(Prefetcher::QueuedPathCost(40), 200u);  // about 220 for dataset paths
}

TEST_F(PrefetcherTest, RefusalsNameTheLimitHit) {
  Prefetcher::Options o;
  o.start_workers = false;
  o.max_queued_paths_per_uid = 5;
  o.max_queued_paths = 100;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  const std::string a = pf_->CreateStream("a", 1, 1000);
  Prefetcher::Refusal why;
  EXPECT_EQ(pf_->PublishAs(1000, a, {Name(0), Name(1), Name(2)}), Prefetcher::Op::kOk);
  EXPECT_EQ(pf_->PublishAs(1000, a, {Name(3), Name(4), Name(5)}, false, nullptr, &why),
            Prefetcher::Op::kFull);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kUserPaths);
  EXPECT_EQ(why.value, 5u);
  EXPECT_EQ(why.held, 3u);
  EXPECT_EQ(why.asked, 3u);
  // A refusal is left only when one was refused.
  EXPECT_EQ(pf_->PublishAs(1000, a, {Name(3), Name(4)}, false, nullptr, &why), Prefetcher::Op::kOk);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kNone);
  // A full user may still publish nothing (a request whose paths were all rejected).
  EXPECT_EQ(pf_->PublishAs(1000, a, {}, false, nullptr, &why), Prefetcher::Op::kOk);
  size_t taken = 1;
  EXPECT_EQ(pf_->PublishAs(1000, a, {}, true, &taken, &why), Prefetcher::Op::kOk);
  EXPECT_EQ(taken, 0u);
  EXPECT_EQ(pf_->PublishAs(1000, a, {Name(6)}, true, &taken, &why), Prefetcher::Op::kFull);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kUserPaths);
}

TEST_F(PrefetcherTest, TwoUsersCannotStarveAThird) {
  // The per-user limits are as large as the global ones: only the fair share keeps room.
  Prefetcher::Options o;
  o.start_workers = false;
  o.max_queued_paths_per_uid = o.max_queued_paths = 1200;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  std::vector<std::string> one(1, Name(0));
  // Each user publishes one path at a time until refused: the most it can get.
  auto fill = [&](uid_t uid, const std::string& id, Prefetcher::Refusal* why) {
    uint64_t n = 0;
    while (n < 2000 && pf_->PublishAs(uid, id, one, false, nullptr, why) == Prefetcher::Op::kOk)
      ++n;
    return n;
  };
  const std::string a = pf_->CreateStream("a", 1, 1000);
  const std::string b = pf_->CreateStream("b", 1, 1001);
  const std::string c = pf_->CreateStream("c", 1, 1002);
  Prefetcher::Refusal why;
  EXPECT_EQ(fill(1000, a, &why), 600u);  // alone: half, the other half kept for others
  EXPECT_EQ(why.limit, Prefetcher::Limit::kSharePaths);
  EXPECT_EQ(why.users, 1u);
  EXPECT_EQ(fill(1001, b, &why), 400u);  // two users: a third each
  EXPECT_EQ(why.limit, Prefetcher::Limit::kSharePaths);
  EXPECT_EQ(why.users, 2u);
  // What is left (at least a sixth) is the third user's.
  EXPECT_EQ(pf_->PublishAs(1002, c, LongPaths(200, 10)), Prefetcher::Op::kOk);
  EXPECT_EQ(pf_->PublishAs(1002, c, one, false, nullptr, &why), Prefetcher::Op::kFull);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kPoolPaths);
  EXPECT_EQ(why.held, 1200u);
  // The first one, over its share (a third, with two users queuing), gets no more.
  pf_->DeleteStreamAs(1002, c);
  EXPECT_EQ(pf_->PublishAs(1000, a, one, false, nullptr, &why), Prefetcher::Op::kFull);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kSharePaths);
  EXPECT_EQ(why.value, 400u);  // two users queuing: a third each
  EXPECT_EQ(pf_->GetStats().queued_users, 2u);
}

TEST_F(PrefetcherTest, TwoUsersCannotStarveAThirdOfMemory) {
  Prefetcher::Options o;
  o.start_workers = false;
  const uint64_t cost = Prefetcher::QueuedPathCost(4000);
  o.max_queued_path_bytes_per_uid = o.max_queued_path_bytes = 600 * cost;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  const std::string a = pf_->CreateStream("a", 1, 1000);
  const std::string b = pf_->CreateStream("b", 1, 1001);
  const std::string c = pf_->CreateStream("c", 1, 1002);
  Prefetcher::Refusal why;
  size_t taken = 0;
  // Long paths, as many as fit (the legacy way).
  EXPECT_EQ(pf_->PublishAs(1000, a, LongPaths(1000, 4000), true, &taken, &why),
            Prefetcher::Op::kOk);
  EXPECT_EQ(taken, 300u);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kShareBytes);
  EXPECT_EQ(pf_->PublishAs(1001, b, LongPaths(1000, 4000, 1000), true, &taken, &why),
            Prefetcher::Op::kOk);
  EXPECT_EQ(taken, 200u);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kShareBytes);
  // Room is left for the third: 100 long paths, or many more short ones.
  EXPECT_EQ(pf_->PublishAs(1002, c, LongPaths(1500, 20)), Prefetcher::Op::kOk);
  EXPECT_EQ(pf_->PublishAs(1002, c, LongPaths(80, 4000, 5000), false, nullptr, &why),
            Prefetcher::Op::kFull);
  EXPECT_EQ(why.limit, Prefetcher::Limit::kPoolBytes);
  EXPECT_LE(pf_->GetStats().queued_bytes, o.max_queued_path_bytes);
}

TEST_F(PrefetcherTest, QueuedPathAccountingFollowsReadsAndDeletes) {
  Make(/*window_files=*/8, /*budget=*/1 << 20, /*slack=*/4);
  const std::string a = pf_->CreateStream("a", 1, 1000);
  const std::string b = pf_->CreateStream("b", 1, 1000);
  std::vector<std::string> paths;
  for (int i = 0; i < 20; ++i) paths.push_back(Name(i));
  ASSERT_EQ(pf_->PublishAs(1000, a, paths), Prefetcher::Op::kOk);
  ASSERT_EQ(pf_->PublishAs(1000, b, LongPaths(10, 300)), Prefetcher::Op::kOk);
  const uint64_t each = Prefetcher::QueuedPathCost(Name(0).size());
  const uint64_t bs = 10 * Prefetcher::QueuedPathCost(300);
  EXPECT_EQ(pf_->GetStats().queued_bytes, 20 * each + bs);
  // Reads consume positions; those far behind the furthest read are skipped.
  ReadFile(0);
  ReadFile(1);
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.queued_paths, 18u + 10);
  EXPECT_EQ(st.queued_bytes, 18 * each + bs);
  ReadFile(15);  // 2..11 skipped (slack 4): the queue is 12..19 (15 read)
  st = pf_->GetStats();
  EXPECT_EQ(st.queued_paths, 8u + 10);
  EXPECT_EQ(st.queued_bytes, 8 * each + bs);
  for (const auto& s : st.streams) EXPECT_EQ(s.queued_bytes, s.id == a ? 8 * each : bs) << s.id;
  EXPECT_TRUE(pf_->DeleteStream(a));
  st = pf_->GetStats();
  EXPECT_EQ(st.queued_bytes, bs);
  EXPECT_EQ(st.queued_users, 1u);
  EXPECT_TRUE(pf_->DeleteStream(b));
  st = pf_->GetStats();
  EXPECT_EQ(st.queued_paths, 0u);
  EXPECT_EQ(st.queued_bytes, 0u);
  EXPECT_EQ(st.queued_users, 0u);
}

// A warm epoch: the kernel serves every file from its page cache, so no read reaches the
// daemon and only the publisher can say where the readers are. With `unread`, the queue stays
// O(lookahead): it never reaches the per-user limit, however long the epoch.
TEST_F(PrefetcherTest, PublishersSayingWhatIsUnreadKeepTheQueueToTheirLookahead) {
  Prefetcher::Options o;
  o.start_workers = false;
  o.chunk_bytes = 64 << 10;
  o.prefetch.window_files = 8;
  o.skip_slack = 4;
  o.attr_timeout_s = 10;
  o.max_queued_paths_per_uid = 16;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  const std::string id = pf_->CreateStream("warm", 1, 1000);
  // 64 files in batches of 4, each publish saying the latest 8 positions are unread.
  for (int b = 0; b < 16; ++b) {
    std::vector<std::string> paths;
    for (int i = 4 * b; i < 4 * b + 4; ++i) paths.push_back(Name(i));
    ASSERT_EQ(pf_->PublishAs(1000, id, paths, false, nullptr, nullptr, 8), Prefetcher::Op::kOk)
        << "batch " << b;
    RunAll();
    const Stats st = pf_->GetStats();
    // Queued: the 8 unread at most (the publisher knows the readers passed the rest: no
    // slack is kept behind them).
    EXPECT_LE(st.queued_paths, 8u) << "batch " << b;
    EXPECT_EQ(st.streams[0].skipped + st.queued_paths, 4u * (b + 1)) << "batch " << b;
  }
  Stats st = pf_->GetStats();
  EXPECT_EQ(st.streams[0].published, 64u);
  EXPECT_EQ(st.queued_paths, 8u);
  // Files fetched for positions the readers passed without a read are given up.
  EXPECT_EQ(st.window_files, st.streams[0].fetched - st.evicted_unread);
  EXPECT_LE(st.window_files, 8u);
  EXPECT_GT(st.evicted_unread, 0u);
  // Without `unread`, the same publishes pass the limit at 16 positions.
  const std::string old = pf_->CreateStream("old", 1, 1001);
  Prefetcher::Op op = Prefetcher::Op::kOk;
  for (int b = 0; b < 16 && op == Prefetcher::Op::kOk; ++b)
    op =
        pf_->PublishAs(1001, old, {Name(4 * b), Name(4 * b + 1), Name(4 * b + 2), Name(4 * b + 3)});
  EXPECT_EQ(op, Prefetcher::Op::kFull);
  // A publish past the limit still moves the cursor: what it says of earlier positions holds
  // whether or not its own paths fit.
  Prefetcher::Refusal refusal;
  EXPECT_EQ(pf_->PublishAs(1001, old, std::vector<std::string>(20, Name(0)), false, nullptr,
                           &refusal, 20),
            Prefetcher::Op::kFull);
  EXPECT_EQ(refusal.limit, Prefetcher::Limit::kUserPaths);
  st = pf_->GetStats(1001);
  EXPECT_LE(st.streams[0].queued, 4u);  // 16 queued, the readers past all but the slack
}

TEST_F(PrefetcherTest, MemoryIsGivenBackWhenStreamsEndOrExpire) {
  Prefetcher::Options o;
  o.start_workers = false;
  o.stream_idle_s = 60;
  int trims = 0;
  o.trim_heap = [&trims] {
    ++trims;
    return true;
  };
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  // A small stream's end is not worth a trim.
  std::string id = pf_->CreateStream("small", 1, 1000);
  ASSERT_EQ(pf_->PublishAs(1000, id, LongPaths(10, 100)), Prefetcher::Op::kOk);
  EXPECT_EQ(pf_->DeleteStreamAs(1000, id), Prefetcher::Op::kOk);
  EXPECT_EQ(trims, 0);
  // A deleted one of 1 MiB or more is.
  id = pf_->CreateStream("big", 1, 1000);
  ASSERT_EQ(pf_->PublishAs(1000, id, LongPaths(300, 4000)), Prefetcher::Op::kOk);
  EXPECT_GE(pf_->GetStats().queued_bytes, Prefetcher::kTrimAfterBytes);
  EXPECT_EQ(pf_->DeleteStreamAs(1000, id), Prefetcher::Op::kOk);
  EXPECT_EQ(trims, 1);
  // So is one that expires.
  id = pf_->CreateStream("idle", 1, 1000);
  ASSERT_EQ(pf_->PublishAs(1000, id, LongPaths(300, 4000)), Prefetcher::Op::kOk);
  clock_.AdvanceSeconds(30);
  pf_->Sweep();
  EXPECT_EQ(trims, 1);
  EXPECT_EQ(pf_->GetStats().streams.size(), 1u);
  clock_.AdvanceSeconds(31);
  pf_->Sweep();
  EXPECT_EQ(pf_->GetStats().streams.size(), 0u);
  EXPECT_EQ(pf_->GetStats().queued_bytes, 0u);
  EXPECT_EQ(trims, 2);
  // A trim skipped (another ran just before) is tried again at the next sweep.
  bool skip = true;
  pf_.reset();
  o.trim_heap = [&] {
    ++trims;
    return !std::exchange(skip, false);
  };
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  id = pf_->CreateStream("big", 1, 1000);
  ASSERT_EQ(pf_->PublishAs(1000, id, LongPaths(300, 4000)), Prefetcher::Op::kOk);
  EXPECT_EQ(pf_->DeleteStreamAs(1000, id), Prefetcher::Op::kOk);
  EXPECT_EQ(trims, 3);
  pf_->Sweep();
  EXPECT_EQ(trims, 4);
  pf_->Sweep();
  EXPECT_EQ(trims, 4);  // done: nothing more to give back
}

// Heap bytes in use (all arenas, mmapped blocks included), as malloc counts them.
[[maybe_unused]] uint64_t HeapInUse() {
  const struct mallinfo2 m = ::mallinfo2();
  return m.uordblks + m.hblkhd;
}

TEST_F(PrefetcherTest, QueuedPathCostCoversWhatPublishAllocates) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers keep their own heap: malloc's counts say nothing";
#else
  Prefetcher::Options o;
  o.start_workers = false;
  o.skip_slack = 4;
  o.max_queued_path_bytes_per_uid = o.max_queued_path_bytes = 1ull << 30;
  pf_ = std::make_unique<Prefetcher>(o, &store_, ram_.get(), &clock_, &registry_);
  constexpr size_t kPaths = 20000;
  for (size_t len : {8u, 40u, 120u, 1000u, 4000u}) {
    for (bool repeated : {false, true}) {
      std::vector<std::string> paths = LongPaths(repeated ? 1 : kPaths, len, 1000000);
      if (repeated) paths.resize(kPaths, paths[0]);  // one path published over and over
      const std::string id = pf_->CreateStream("m", 1, 1000);
      const uint64_t before = HeapInUse();
      ASSERT_EQ(pf_->PublishAs(1000, id, paths), Prefetcher::Op::kOk);
      const uint64_t used = HeapInUse() - before;
      const uint64_t charged = pf_->GetStats().queued_bytes;
      EXPECT_EQ(charged, kPaths * Prefetcher::QueuedPathCost(paths[0].size()));
      // What it charges covers what it holds; distinct paths are charged about what they cost.
      EXPECT_LE(used, charged) << len << (repeated ? " repeated" : " distinct");
      if (!repeated) {
        EXPECT_LE(charged, used + used / 2) << len;
      }
      std::printf("  %zu-byte paths, %s: %.0f bytes each held, %.0f charged\n", paths[0].size(),
                  repeated ? "repeated" : "distinct", static_cast<double>(used) / kPaths,
                  static_cast<double>(charged) / kPaths);
      if (!repeated) {
        // The readers pass them (a read of the last skips the rest): what the stream holds
        // follows what is left (its index is rehashed small).
        pf_->OnRead(paths.back(), {kFileSize, 1}, 0, kFileSize, ReadOutcome::kMiss);
        const uint64_t left = pf_->GetStats().queued_bytes;
        EXPECT_LE(left, 8 * Prefetcher::QueuedPathCost(paths[0].size()));
        const uint64_t now = HeapInUse();
        EXPECT_LE(now - std::min(now, before), left + (64u << 10)) << len;
      }
      ASSERT_TRUE(pf_->DeleteStream(id));
      const uint64_t now = HeapInUse();
      EXPECT_LE(now - std::min(now, before), 16u << 10) << len;
    }
  }
#endif
}

TEST_F(PrefetcherTest, OneUserFloodingTheWindowDoesNotStarveAnother) {
  Make(/*window_files=*/8, /*budget=*/1 << 20, /*slack=*/4);
  const std::string flood = pf_->CreateStream("flood", 1, 1000);
  std::vector<std::string> many;
  for (int i = 0; i < 40; ++i) many.push_back(Name(i));
  ASSERT_EQ(pf_->PublishAs(1000, flood, many), Prefetcher::Op::kOk);
  EXPECT_EQ(RunAll(), 8);  // alone, it may fill the window; it never reads
  const std::string fair = pf_->CreateStream("fair", 1, 1001);
  ASSERT_EQ(pf_->PublishAs(1001, fair, {Name(50), Name(51), Name(52), Name(53)}),
            Prefetcher::Op::kOk);
  RunAll();
  for (int i = 50; i < 54; ++i) EXPECT_TRUE(pf_->Get(Name(i), {kFileSize, 1}, 0).has_value()) << i;
  const Stats st = pf_->GetStats();
  EXPECT_LE(st.window_files, 8u);
  EXPECT_GE(st.preempted, 4u);
}

// A stream that claims no share (/batchdownload/path's) takes only free room: it never makes
// another user give up a prefetched file, and gets room again once some is free.
TEST_F(PrefetcherTest, AStreamClaimingNoShareTakesOnlyFreeRoom) {
  Make(/*window_files=*/8, /*budget=*/1 << 20, /*slack=*/4);
  const std::string full = pf_->CreateStream("full", 1, 1000);
  std::vector<std::string> many;
  for (int i = 0; i < 8; ++i) many.push_back(Name(i));
  ASSERT_EQ(pf_->PublishAs(1000, full, many), Prefetcher::Op::kOk);
  EXPECT_EQ(RunAll(), 8);
  const std::string asker = pf_->CreateStream("legacy batch", 0, 1001, nullptr, "",
                                              /*page_cache=*/false, /*claims_share=*/false);
  ASSERT_EQ(pf_->PublishAs(1001, asker, {Name(50), Name(51)}), Prefetcher::Op::kOk);
  EXPECT_EQ(RunAll(), 0);
  EXPECT_EQ(pf_->GetStats().preempted, 0u);
  pf_->DeleteStream(full);  // room again
  EXPECT_EQ(RunAll(), 2);
}

// Another user's read of a file far ahead in a stream (a shared file both may read) neither
// moves that stream's cursor past its positions nor drops what was prefetched for it.
TEST_F(PrefetcherTest, AnotherUsersReadMovesNeitherTheStreamNorItsWindow) {
  Make(/*window_files=*/8, /*budget=*/1 << 20, /*slack=*/2);
  const std::string mine = pf_->CreateStream("victim", 1, 1001);
  std::vector<std::string> paths;
  for (int i = 0; i < 40; ++i) paths.push_back(Name(i));
  ASSERT_EQ(pf_->PublishAs(1001, mine, paths), Prefetcher::Op::kOk);
  EXPECT_EQ(RunAll(), 8);
  // The attacker reads position 30 and a file already prefetched for the victim.
  pf_->OnRead(Name(30), {kFileSize, 1}, 0, kFileSize, ReadOutcome::kMiss, true, /*uid=*/1000);
  pf_->OnRead(Name(3), {kFileSize, 1}, 0, kFileSize, ReadOutcome::kHit, true, /*uid=*/1000);
  Stats st = pf_->GetStats();
  ASSERT_EQ(st.streams.size(), 1u);
  EXPECT_EQ(st.streams[0].skipped, 0u) << "another user's read skipped the victim's positions";
  EXPECT_EQ(st.window_files, 8u) << "another user's read dropped a file prefetched for the victim";
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(pf_->Get(Name(i), {kFileSize, 1}, 0).has_value()) << i;
  // The victim's own read of position 30 moves its stream.
  pf_->OnRead(Name(30), {kFileSize, 1}, 0, kFileSize, ReadOutcome::kMiss, true, /*uid=*/1001);
  EXPECT_GT(pf_->GetStats().streams[0].skipped, 0u);
}

// The read path does not wait on the prefetcher's lock: readers on several threads find ready
// files in the window's view, and their reads are counted and consume their positions whether
// they took the lock or left the read for its holder. A thread asking for the counters all the
// while holds the lock often, so that reads are left queued.
// (64 positions and a slack of 64: however the threads are scheduled, none is skipped.)
TEST_F(PrefetcherTest, ReadsFromManyThreadsAreAllCountedAndConsumeTheirPositions) {
  constexpr int kFiles = 64;
  Make(/*window_files=*/kFiles, 1 << 20, /*slack=*/64);
  const std::string id = Publish(0, kFiles);
  EXPECT_EQ(RunAll(), kFiles);
  EXPECT_EQ(pf_->GetStats().window_files, uint64_t{kFiles});
  std::atomic<int> next{0};
  std::atomic<bool> done{false};
  std::atomic<int> served{0};
  std::thread stats([&] {
    while (!done) pf_->GetStats();
  });
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t)
    readers.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < kFiles;) {
        const cfs_client::FileVersion v = store_.Stat(Name(i)).value().Version();
        std::optional<Prefetcher::WindowHit> hit = pf_->Get(Name(i), v, 0);
        if (hit && !hit->waited && hit->buffer->size == kFileSize &&
            hit->buffer->data.get()[0] == static_cast<char>('a' + i % 26))
          served++;
        pf_->OnRead(Name(i), v, 0, kFileSize, ReadOutcome::kHit);
      }
    });
  for (std::thread& r : readers) r.join();
  done = true;
  stats.join();
  EXPECT_EQ(served.load(), kFiles);
  const Stats after = pf_->GetStats();
  EXPECT_EQ(after.reads.hit, uint64_t{kFiles});
  EXPECT_EQ(after.window_files, 0u);  // each read whole, wanted by no position: let go
  EXPECT_EQ(after.evicted_unread, 0u);
  ASSERT_EQ(after.streams.size(), 1u);
  EXPECT_EQ(after.streams[0].reads.hit, uint64_t{kFiles});
  EXPECT_EQ(after.streams[0].skipped, 0u);
  EXPECT_EQ(after.queued_paths, 0u);
  pf_->DeleteStream(id);
}

// What the read path finds with no lock follows the window: attributes while fresh, nothing once
// a file is written through the mount, and nothing once the window lets the file go.
TEST_F(PrefetcherTest, TheWindowsViewFollowsInvalidationAndRelease) {
  Make(/*window_files=*/8);
  Publish(0, 2);
  EXPECT_EQ(RunAll(), 2);
  const cfs_client::FileVersion v0 = store_.Stat(Name(0)).value().Version();
  const cfs_client::FileVersion v1 = store_.Stat(Name(1)).value().Version();
  ASSERT_TRUE(pf_->WindowAttr(Name(0), 0).has_value());
  EXPECT_EQ(pf_->WindowAttr(Name(0), 0)->size, kFileSize);
  EXPECT_TRUE(pf_->Get(Name(0), v0, 0).has_value());
  cfs_client::FileVersion other = v0;
  other.mtime_ns++;
  EXPECT_FALSE(pf_->Get(Name(0), other, 0).has_value());  // another version: not served
  EXPECT_FALSE(pf_->Get(Name(0), v0, 1).has_value());     // past its chunks
  EXPECT_FALSE(pf_->Get(Name(5), v0, 0).has_value());     // not in the window
  pf_->Invalidate(Name(0));
  EXPECT_FALSE(pf_->Get(Name(0), v0, 0).has_value());
  EXPECT_FALSE(pf_->WindowAttr(Name(0), 0).has_value());
  pf_->OnRead(Name(1), v1, 0, kFileSize, ReadOutcome::kHit);
  EXPECT_FALSE(pf_->Get(Name(1), v1, 0).has_value());  // read whole: released
  EXPECT_FALSE(pf_->WindowAttr(Name(1), 0).has_value());
  clock_.AdvanceSeconds(20);  // past attr_timeout_s
  Publish(2, 3);
  EXPECT_EQ(RunAll(), 1);
  EXPECT_TRUE(pf_->WindowAttr(Name(2), 0).has_value());
  clock_.AdvanceSeconds(20);
  EXPECT_FALSE(pf_->WindowAttr(Name(2), 0).has_value());  // stale attributes answer no lookup
}

// Reads queued while the lock is held are applied in the order they were reported, across the
// threads' queues. Positions further than the slack behind the furthest read are skipped, so
// one thread's queue applied before another's would skip positions read in fact and count
// their files evicted unread.
TEST_F(PrefetcherTest, QueuedReadsAreAppliedInTheOrderTheyWereReported) {
  constexpr int kFiles = 400;
  for (int i = 64; i < kFiles; ++i)
    store_.PutFile(Name(i), std::string(kFileSize, static_cast<char>('a' + i % 26)));
  Make(/*window_files=*/kFiles, 4 << 20, /*slack=*/64);
  const std::string id = Publish(0, kFiles);
  EXPECT_EQ(RunAll(), kFiles);
  auto read = [&](int from, int to) {
    for (int i = from; i < to; ++i)
      pf_->OnRead(Name(i), store_.Stat(Name(i)).value().Version(), 0, kFileSize, ReadOutcome::kHit);
  };
  pf_->HoldLockForTest([&] {
    // Thread a reports position 0, thread b positions 1-199, thread a again 200-399; each
    // thread's reads go to its own queue, and none takes the lock.
    std::promise<void> a_first, b_done;
    std::thread a([&] {
      read(0, 1);
      a_first.set_value();
      b_done.get_future().wait();
      read(200, kFiles);
    });
    a_first.get_future().wait();
    std::thread b([&] { read(1, 200); });
    b.join();
    b_done.set_value();
    a.join();
  });
  const Stats after = pf_->GetStats();
  EXPECT_EQ(after.reads.hit, uint64_t{kFiles});
  ASSERT_EQ(after.streams.size(), 1u);
  EXPECT_EQ(after.streams[0].skipped, 0u);
  EXPECT_EQ(after.streams[0].reads.hit, uint64_t{kFiles});
  EXPECT_EQ(after.evicted_unread, 0u);
  pf_->DeleteStream(id);
}

}  // namespace
}  // namespace cubetorchfs::prefetch
