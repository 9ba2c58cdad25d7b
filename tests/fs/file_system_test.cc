#include "fs/file_system.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <prometheus/registry.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>
#include <thread>

#include "tests/test_util.h"

namespace cubetorchfs::fs {
namespace {

using testing::FakeClock;
using testing::MemBackend;
using testing::Pattern;

std::string Bytes(const ReadResult& r) {
  std::string out;
  for (const auto& s : r.slices) out.append(s.buffer->data.get() + s.offset, s.length);
  return out;
}

double Metric(prometheus::Registry& reg, const std::string& name, const std::string& label_value) {
  for (const auto& f : reg.Collect())
    if (f.name == name)
      for (const auto& m : f.metric)
        for (const auto& l : m.label)
          if (l.value == label_value) return m.counter.value;
  return -1;
}

class FileSystemTest : public ::testing::Test {
 protected:
  int ServeThroughAnOutage(bool known);  // defined with the tests that use it
  void SetUp() override {
    store_.AddDir("d");
    store_.PutFile("d/small", Pattern(1000, 1));
    store_.PutFile("big", Pattern(300 << 10, 2));  // 300 KiB: 5 chunks of 64 KiB
    cache_ = cache::RamCache::New({4 << 20, 64 << 10}, nullptr);
    options_.chunk_bytes = 64 << 10;
    options_.attr_timeout_s = 10;
    options_.keep_cache = true;
    prefetch::Prefetcher::Options pf;
    pf.start_workers = false;
    pf.chunk_bytes = options_.chunk_bytes;
    pf.window_budget_bytes = 1 << 20;
    pf.keep_cache = options_.keep_cache;
    prefetcher_ =
        std::make_unique<prefetch::Prefetcher>(pf, &store_, cache_.get(), &clock_, &registry_);
    fs_ = FileSystem::New(options_, &store_, cache_.get(), prefetcher_.get(), &clock_, registry_)
              .value();
    prefetcher_->SetAttrSource(fs_.get());  // as the daemon does: marks live in its inodes
  }
  ~FileSystemTest() override {
    if (prefetcher_) prefetcher_->SetAttrSource(nullptr);
  }

  uint64_t LookupPath(const std::string& path) {
    uint64_t ino = kRootIno;
    size_t start = 0;
    while (start <= path.size()) {
      size_t slash = path.find('/', start);
      std::string name =
          path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
      Result<Entry> e = fs_->Lookup(ino, name);
      EXPECT_TRUE(e.ok()) << e.status().ToString();
      ino = e->ino;
      if (slash == std::string::npos) break;
      start = slash + 1;
    }
    return ino;
  }

  std::unique_ptr<FileHandle> OpenPath(const std::string& path) {
    Result<OpenResult> r = fs_->Open(LookupPath(path), O_RDONLY);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return std::move(r->handle);
  }

  // A file written under no_open whose flush fails, and fails again when the kernel forgets
  // it: an orphan write state. Returns its (forgotten) inode.
  uint64_t MakeOrphan(const std::string& name, const std::string& data) {
    Result<FileSystem::Created> c = fs_->Create(kRootIno, name, 0644, 0, {}, false);
    EXPECT_TRUE(c.ok());
    EXPECT_TRUE(fs_->Write(c->entry.ino, 0, data.data(), data.size()).ok());
    store_.FailWrites(2, Status::IOError("store down"));
    EXPECT_FALSE(fs_->Flush(c->entry.ino).ok());
    fs_->Forget(c->entry.ino, 1);  // the retry at forget fails too
    return c->entry.ino;
  }

  MemBackend store_;
  FakeClock clock_;
  prometheus::Registry registry_;
  FileSystem::Options options_;
  std::unique_ptr<cache::RamCache> cache_;
  std::unique_ptr<prefetch::Prefetcher> prefetcher_;
  std::unique_ptr<FileSystem> fs_;
};

TEST_F(FileSystemTest, OnlyReadsServedToTheKernelMarkFilesPageResident) {
  Result<cfs_client::FileAttr> attr = store_.Stat("d/small");
  ASSERT_TRUE(attr.ok());
  size_t streamed = 0;
  ASSERT_TRUE(fs_->StreamFile("d/small", *attr,
                              [&](const char*, size_t n) {
                                streamed += n;
                                return Status::OK();
                              })
                  .ok());
  EXPECT_EQ(streamed, 1000u);
  EXPECT_EQ(prefetcher_->GetStats().resident_marks, 0u);  // went to an HTTP client
  std::unique_ptr<FileHandle> h = OpenPath("d/small");
  ASSERT_TRUE(fs_->Read(*h, 0, 4096).ok());
  EXPECT_EQ(prefetcher_->GetStats().resident_marks, 1u);  // the kernel holds it now
}

// The one read policy, which the control API's batches and downloads use too (StreamFile): a
// chunk the RAM cache holds at the file's version is served from there, with no store request
// and without looking in the prefetch window first.
TEST_F(FileSystemTest, StreamFileServesTheRamCacheCopyWithNoStoreRequest) {
  Result<cfs_client::FileAttr> attr = store_.Stat("d/small");
  ASSERT_TRUE(attr.ok());
  std::shared_ptr<cache::Buffer> cached = cache::Buffer::Allocate(attr->size);
  std::memset(cached->data.get(), 'R', attr->size);  // stands out from the store's bytes
  cache_->Insert(cache::ChunkKey("d/small", attr->Version(), 0), std::move(cached));
  const int reads = store_.reads();
  std::string got;
  ASSERT_TRUE(fs_->StreamFile("d/small", *attr,
                              [&](const char* data, size_t n) {
                                got.append(data, n);
                                return Status::OK();
                              })
                  .ok());
  EXPECT_EQ(got, std::string(attr->size, 'R'));
  EXPECT_EQ(store_.reads(), reads);
  EXPECT_EQ(prefetcher_->GetStats().reads.hit, 1u);
  // Another version of the file (changed in the store) is not that copy: read from the store.
  store_.PutFile("d/small", "changed", 3);
  attr = store_.Stat("d/small");
  got.clear();
  ASSERT_TRUE(fs_->StreamFile("d/small", *attr,
                              [&](const char* data, size_t n) {
                                got.append(data, n);
                                return Status::OK();
                              })
                  .ok());
  EXPECT_EQ(got, "changed");
  EXPECT_EQ(store_.reads(), reads + 1);
}

TEST_F(FileSystemTest, LookupCountsAndForget) {
  uint64_t ino = LookupPath("d/small");
  EXPECT_EQ(fs_->inodes().lookups(ino), 1u);
  EXPECT_EQ(fs_->Lookup(kRootIno, "missing").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(fs_->Lookup(ino, "x").status().code(), Status::Code::kNotDirectory);
  fs_->Forget(ino, 1);
  EXPECT_EQ(fs_->GetAttr(ino).status().code(), Status::Code::kStale);
}

TEST_F(FileSystemTest, SmallFileIsFetchedOnceThenServedFromRam) {
  auto h = OpenPath("d/small");
  Result<ReadResult> r = fs_->Read(*h, 0, 4096);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(Bytes(r.value()), Pattern(1000, 1));
  EXPECT_EQ(store_.reads(), 1);
  r = fs_->Read(*h, 500, 100);
  EXPECT_EQ(Bytes(r.value()), Pattern(1000, 1).substr(500, 100));
  EXPECT_EQ(store_.reads(), 1);
  EXPECT_EQ(Metric(registry_, "cubetorchfs_reads_total", "miss"), 1);
  EXPECT_EQ(Metric(registry_, "cubetorchfs_reads_total", "hit"), 1);
  EXPECT_EQ(Metric(registry_, "cubetorchfs_read_bytes_total", "backend"), 1000);
  EXPECT_EQ(Metric(registry_, "cubetorchfs_read_bytes_total", "ram"), 100);
}

TEST_F(FileSystemTest, ReadsSpanningChunksAreExact) {
  const std::string want = Pattern(300 << 10, 2);
  auto h = OpenPath("big");
  for (uint64_t off : {0ul, 65535ul, 65536ul, 100000ul, (300ul << 10) - 10}) {
    Result<ReadResult> r = fs_->Read(*h, off, 131072);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(Bytes(r.value()), want.substr(off, 131072)) << off;
  }
  EXPECT_EQ(Bytes(fs_->Read(*h, 300 << 10, 10).value()), "");
  EXPECT_EQ(store_.reads(), 5);  // each chunk fetched exactly once
}

TEST_F(FileSystemTest, ChangedFileIsReadFreshAfterAttrTimeout) {
  const uint64_t ino = LookupPath("d/small");
  std::unique_ptr<FileHandle> h = std::move(fs_->Open(ino, O_RDONLY)->handle);
  ASSERT_TRUE(h);
  EXPECT_EQ(Bytes(fs_->Read(*h, 0, 4096).value()), Pattern(1000, 1));
  const int stats = store_.stats();
  const int reads = store_.reads();
  store_.PutFile("d/small", "new contents", 2);  // changed in the store, behind our back
  // Within attr_timeout_s (10 s): no round trip; the open serves the version it knows, and
  // the kernel keeps its cache.
  clock_.AdvanceSeconds(9.5);
  Result<OpenResult> within = fs_->Open(ino, O_RDONLY);
  ASSERT_TRUE(within.ok());
  EXPECT_EQ(store_.stats(), stats) << "attributes re-read before attr_timeout_s";
  EXPECT_TRUE(within->keep_cache);
  EXPECT_FALSE(within->invalidate_inode);
  EXPECT_EQ(Bytes(fs_->Read(*within->handle, 0, 4096).value()), Pattern(1000, 1));
  EXPECT_EQ(store_.reads(), reads) << "the known version is served from RAM";
  // Past attr_timeout_s since they were read: the store is asked again, sees the change,
  // the kernel's cache of the file is dropped and the new bytes are read.
  clock_.AdvanceSeconds(1);
  Result<OpenResult> after = fs_->Open(ino, O_RDONLY);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(store_.stats(), stats + 1) << "attributes not re-read after attr_timeout_s";
  EXPECT_FALSE(after->keep_cache);
  EXPECT_TRUE(after->invalidate_inode);
  EXPECT_EQ(Bytes(fs_->Read(*after->handle, 0, 4096).value()), "new contents");
  EXPECT_EQ(store_.reads(), reads + 1);
  // Fresh again: the next open within the timeout asks nothing.
  ASSERT_TRUE(fs_->Open(ino, O_RDONLY).ok());
  EXPECT_EQ(store_.stats(), stats + 1);
}

// Another file put at a cached file's path with the same size and mtime (utimes copies them)
// is a different file: its identity differs, so the cached bytes are not served for it.
TEST_F(FileSystemTest, AFileWithACopiedSizeAndMtimeIsNotServedAnotherFilesCachedBytes) {
  store_.GiveIdentities();
  store_.PutFile("d/secret", std::string(500, 'V'), 7);
  const uint64_t ino = LookupPath("d/secret");
  std::unique_ptr<FileHandle> h = std::move(fs_->Open(ino, O_RDONLY)->handle);
  EXPECT_EQ(Bytes(fs_->Read(*h, 0, 4096).value()), std::string(500, 'V'));  // cached now
  ASSERT_TRUE(store_.Unlink("d/secret").ok());  // in the store, behind the daemon's back
  store_.PutFile("d/secret", std::string(500, 'A'), 7);
  clock_.AdvanceSeconds(11);
  // The inode names the file the kernel checked: it opens nothing else (the kernel looks the
  // name up again), and the name found again is a new inode.
  Result<OpenResult> stale = fs_->Open(ino, O_RDONLY);
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.status().code(), Status::Code::kStale) << stale.status().ToString();
  const uint64_t now_ino = LookupPath("d/secret");
  EXPECT_NE(now_ino, ino);
  Result<OpenResult> again = fs_->Open(now_ino, O_RDONLY);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Bytes(fs_->Read(*again->handle, 0, 4096).value()), std::string(500, 'A'));
  // The first handle was opened on the other file: it reads that file's bytes (held) or
  // nothing, never the new file's.
  Result<ReadResult> old = fs_->Read(*h, 0, 4096);
  if (old.ok()) {
    EXPECT_EQ(Bytes(*old), std::string(500, 'V'));
  }
}

// A descriptor reads the file it opened: after renames through the mount put another file of
// the same size and mtime at the path it was opened by, it still reads its own file. Both a
// file renamed itself and one whose directory was renamed.
TEST_F(FileSystemTest, AnOpenHandleFollowsItsFileAcrossRenamesNotItsPath) {
  store_.GiveIdentities();
  for (const char* dir : {"t/x", "t/v"}) store_.AddDir(dir);
  store_.AddDir("t");
  store_.PutFile("t/mine", std::string(800, 'A'), 7);
  store_.PutFile("t/theirs", std::string(800, 'V'), 7);
  store_.PutFile("t/x/f", std::string(900, 'A'), 7);
  store_.PutFile("t/v/f", std::string(900, 'V'), 7);
  const uint64_t t = LookupPath("t");
  LookupPath("t/theirs");
  LookupPath("t/v/f");
  std::unique_ptr<FileHandle> file = OpenPath("t/mine");
  std::unique_ptr<FileHandle> in_dir = OpenPath("t/x/f");
  ASSERT_TRUE(fs_->Rename(t, "mine", t, "mine_old", 0).ok());
  ASSERT_TRUE(fs_->Rename(t, "theirs", t, "mine", 0).ok());
  ASSERT_TRUE(fs_->Rename(t, "x", t, "x_old", 0).ok());
  ASSERT_TRUE(fs_->Rename(t, "v", t, "x", 0).ok());
  Result<ReadResult> got = fs_->Read(*file, 0, 4096);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(Bytes(*got), std::string(800, 'A'));
  got = fs_->Read(*in_dir, 0, 4096);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(Bytes(*got), std::string(900, 'A'));
}

// Open directories' snapshots are bounded: one user holds at most half of dir_memory_bytes,
// all users together all of it, and what a closed directory held is given back.
TEST_F(FileSystemTest, OpenDirectoriesHoldAtMostTheirMemoryBound) {
  store_.AddDir("many");
  for (int i = 0; i < 2000; ++i)
    store_.PutFile("many/entry-with-a-long-name-" + std::to_string(i), "x");
  FileSystem::Options o = options_;
  o.dir_memory_bytes = 1u << 20;
  std::unique_ptr<FileSystem> fs =
      FileSystem::New(o, &store_, cache_.get(), prefetcher_.get(), &clock_, registry_).value();
  const uint64_t ino = fs->Lookup(kRootIno, "many")->ino;
  std::vector<std::unique_ptr<DirHandle>> held;
  Status refused;
  for (int i = 0; i < 100 && refused.ok(); ++i) {
    Result<std::unique_ptr<DirHandle>> d = fs->OpenDir(ino, /*uid=*/1000);
    if (d.ok())
      held.push_back(std::move(d).value());
    else
      refused = d.status();
  }
  ASSERT_FALSE(refused.ok()) << "100 snapshots of 2,000 entries fit in 1 MiB?";
  EXPECT_EQ(ToErrno(refused), ENOMEM);
  EXPECT_GE(held.size(), 1u);
  EXPECT_LE(fs->dir_memory_held(), (1u << 20) / 2);
  // Another user is not refused for the first one's snapshots.
  ASSERT_TRUE(fs->OpenDir(ino, /*uid=*/1001).ok());
  held.clear();
  EXPECT_EQ(fs->dir_memory_held(), 0u);
  EXPECT_TRUE(fs->OpenDir(ino, /*uid=*/1000).ok());
}

// One user's files open for writing are bounded (each holds a store descriptor or a staging
// file): past max_writes_per_uid its creates and opens for writing fail with EMFILE, another
// user's do not, and a release makes room again.
// A directory is listed a page at a time as its entries are asked for, holding a window of
// the listing: every entry comes once in order, an offset inside the window (a readdir resumed
// after the kernel dropped its buffer) is served from it, one before it lists again from the
// start, and the window never holds more than a page and what is kept behind it.
TEST_F(FileSystemTest, DirectoriesAreListedInPagesAndResumeAtAnyOffset) {
  store_.AddDir("flat");
  constexpr int kNames = 20000;
  for (int i = 0; i < kNames; ++i) store_.PutFile("flat/f" + std::to_string(i), "");
  FileSystem::Options o = options_;
  o.list_page_entries = 1000;
  std::unique_ptr<FileSystem> fs =
      FileSystem::New(o, &store_, cache_.get(), prefetcher_.get(), &clock_, registry_).value();
  const uint64_t ino = fs->Lookup(kRootIno, "flat")->ino;
  std::unique_ptr<DirHandle> dir = fs->OpenDir(ino, 1000).value();
  MutexLock l(dir->mu);
  EXPECT_EQ(dir->entries.size(), 1000u);  // the first page only
  auto name_at = [&](uint64_t k) REQUIRES(dir->mu) -> std::string {
    Result<bool> there = fs->DirEntryAt(*dir, k);
    EXPECT_TRUE(there.ok());
    if (!there.ok() || !*there) return "";
    EXPECT_LE(dir->entries.size(), kDirKeepBehind + 1000);
    return dir->entries[k - dir->first].name;
  };
  std::vector<std::string> first_pass;
  std::set<std::string> seen;
  for (uint64_t k = 0;; ++k) {
    const std::string n = name_at(k);
    if (n.empty()) break;
    first_pass.push_back(n);
    EXPECT_TRUE(seen.insert(n).second) << n << " twice";
    // Every 97 entries the kernel drops its buffer and resumes up to 150 entries back.
    if (k % 97 == 96 && k >= 150) {
      EXPECT_EQ(name_at(k - 150), first_pass[k - 150]);
    }
  }
  EXPECT_EQ(first_pass.size(), static_cast<size_t>(kNames));
  EXPECT_FALSE(*fs->DirEntryAt(*dir, kNames));
  // A rewind lists again from the start, in the same order while nothing changes.
  EXPECT_EQ(name_at(0), first_pass[0]);
  EXPECT_EQ(name_at(12345), first_pass[12345]);
  EXPECT_GT(fs->dir_memory_held(), 0u);
}

TEST_F(FileSystemTest, FilesOpenForWritingAreBoundedPerUser) {
  FileSystem::Options o = options_;
  o.max_writes_per_uid = 3;
  std::unique_ptr<FileSystem> fs =
      FileSystem::New(o, &store_, cache_.get(), prefetcher_.get(), &clock_, registry_).value();
  const Owner attacker{1000, 1000};
  std::vector<FileSystem::Created> held;
  for (const char* name : {"w0", "w1", "w2"}) {
    Result<FileSystem::Created> c = fs->Create(kRootIno, name, 0644, O_WRONLY, attacker, true);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    held.push_back(std::move(c).value());
  }
  Result<FileSystem::Created> over = fs->Create(kRootIno, "w3", 0644, O_WRONLY, attacker, true);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(ToErrno(over.status()), EMFILE);
  const uint64_t d = fs->Lookup(kRootIno, "d")->ino;
  const uint64_t small = fs->Lookup(d, "small")->ino;
  Result<OpenResult> w = fs->Open(small, O_WRONLY, true, /*uid=*/1000);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(ToErrno(w.status()), EMFILE);
  ASSERT_TRUE(fs->Create(kRootIno, "v0", 0644, O_WRONLY, Owner{1001, 1001}, true).ok());
  ASSERT_TRUE(fs->Release(held[0].entry.ino, held[0].handle.get()).ok());
  EXPECT_TRUE(fs->Create(kRootIno, "w3", 0644, O_WRONLY, attacker, true).ok());
}

TEST_F(FileSystemTest, OpenUsesCachedAttributesUntilTheyExpire) {
  uint64_t ino = LookupPath("d/small");
  int stats = store_.stats();
  ASSERT_TRUE(fs_->Open(ino, O_RDONLY).ok());
  Result<OpenResult> second = fs_->Open(ino, O_RDONLY);
  EXPECT_TRUE(second->keep_cache);   // unchanged version, keep_cache configured
  EXPECT_EQ(store_.stats(), stats);  // no backend round trip while fresh
  store_.PutFile("d/small", "changed", 3);
  clock_.AdvanceSeconds(11);
  Result<OpenResult> third = fs_->Open(ino, O_RDONLY);
  EXPECT_EQ(store_.stats(), stats + 1);
  EXPECT_FALSE(third->keep_cache);
  EXPECT_EQ(Bytes(fs_->Read(*third->handle, 0, 100).value()), "changed");
}

TEST_F(FileSystemTest, GetAttrIsAnsweredFromHeldAttributesUntilTheyExpire) {
  uint64_t ino = LookupPath("d/small");
  const int stats = store_.stats();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(fs_->GetAttr(ino)->size, 1000u);
  EXPECT_EQ(store_.stats(), stats);  // no store request while the lookup's attributes hold
  store_.PutFile("d/small", "changed", 3);
  clock_.AdvanceSeconds(9);
  EXPECT_EQ(fs_->GetAttr(ino)->size, 1000u);
  EXPECT_EQ(store_.stats(), stats);
  clock_.AdvanceSeconds(2);  // past attr_timeout_s: the store is asked, once
  EXPECT_EQ(fs_->GetAttr(ino)->size, 7u);
  EXPECT_EQ(fs_->GetAttr(ino)->size, 7u);
  EXPECT_EQ(store_.stats(), stats + 1);
}

// A store that does not answer, with `known` (InOutage) or not: d/small, cached and with
// expired attributes, is served by getattr, lookup, open and read; "never-looked-up" fails
// with IOError; then the store answers again and is asked. Returns the store requests made
// while it was down.
int FileSystemTest::ServeThroughAnOutage(bool known) {
  uint64_t ino = LookupPath("d/small");
  std::unique_ptr<FileHandle> h = OpenPath("d/small");
  EXPECT_EQ(Bytes(fs_->Read(*h, 0, 2000).value()), Pattern(1000, 1));  // now in the cache
  const uint64_t dir = LookupPath("d");
  clock_.AdvanceSeconds(11);  // attributes expired
  store_.SetDown(true);
  store_.SetOutage(known);
  const int stats = store_.stats();
  EXPECT_EQ(fs_->GetAttr(ino)->size, 1000u);
  Result<Entry> again = fs_->Lookup(dir, "small");
  EXPECT_TRUE(again.ok()) << again.status().ToString();
  if (again.ok()) {
    EXPECT_EQ(again->ino, ino);
  }
  Result<OpenResult> o = fs_->Open(ino, O_RDONLY);
  EXPECT_TRUE(o.ok()) << o.status().ToString();
  if (o.ok()) {
    EXPECT_EQ(Bytes(fs_->Read(*o->handle, 0, 2000).value()), Pattern(1000, 1));
  }
  const int held_requests = store_.stats() - stats;
  EXPECT_EQ(fs_->Lookup(dir, "never-looked-up").status().code(), Status::Code::kIOError);
  EXPECT_EQ(store_.stats(), stats + held_requests + 1);  // a name not held is asked
  store_.SetDown(false);
  store_.SetOutage(false);
  store_.PutFile("d/small", "changed", 3);
  EXPECT_EQ(fs_->GetAttr(ino)->size, 7u);  // held unrenewed: the store is asked again
  return held_requests;
}

// Not known yet: each request asks the store first and, when it does not answer, gets what
// the daemon holds.
TEST_F(FileSystemTest, WhatIsHeldIsServedWhileTheStoreDoesNotAnswer) {
  EXPECT_GT(ServeThroughAnOutage(false), 0);
}

// Known (a request failed to reach the store): what the daemon holds answers at once, with no
// request that would wait out the store's timeout.
TEST_F(FileSystemTest, WhatIsHeldAnswersAtOnceWhileTheStoreIsKnownDown) {
  EXPECT_EQ(ServeThroughAnOutage(true), 0);
}

TEST_F(FileSystemTest, GetAttrOfAFileBeingWrittenShowsTheBytesWritten) {
  uint64_t ino = LookupPath("d/small");
  Result<OpenResult> w = fs_->Open(ino, O_WRONLY);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const std::string more(3000, 'x');
  ASSERT_TRUE(fs_->Write(ino, 1000, more.data(), more.size()).ok());
  EXPECT_EQ(fs_->GetAttr(ino)->size, 4000u);  // not the held 1000, though it is fresh
}

TEST_F(FileSystemTest, ReadOnlyMountRefusesEveryChange) {
  options_.read_only = true;
  prefetcher_->SetAttrSource(nullptr);
  fs_ = FileSystem::New(options_, &store_, cache_.get(), prefetcher_.get(), &clock_, registry_)
            .value();
  prefetcher_->SetAttrSource(fs_.get());
  uint64_t ino = LookupPath("d/small");
  const auto kRo = Status::Code::kReadOnly;
  EXPECT_EQ(fs_->Open(ino, O_WRONLY).status().code(), kRo);
  EXPECT_EQ(fs_->Open(ino, O_RDWR).status().code(), kRo);
  EXPECT_EQ(fs_->Access(ino, W_OK).code(), kRo);
  EXPECT_TRUE(fs_->Access(ino, R_OK).ok());
  EXPECT_EQ(fs_->Create(kRootIno, "n", 0644, 0, {}, true).status().code(), kRo);
  EXPECT_EQ(fs_->Write(ino, 0, "x", 1).status().code(), kRo);
  EXPECT_EQ(fs_->Mkdir(kRootIno, "m", 0755, {}).status().code(), kRo);
  EXPECT_EQ(fs_->Unlink(LookupPath("d"), "small").code(), kRo);
  EXPECT_EQ(fs_->Rename(kRootIno, "big", kRootIno, "b2", 0).code(), kRo);
  FileSystem::AttrChange trunc;
  trunc.size = 0;
  EXPECT_EQ(fs_->SetAttr(ino, trunc).status().code(), kRo);
  EXPECT_EQ(store_.Data("d/small"), Pattern(1000, 1));
  EXPECT_FALSE(store_.Exists("n"));
}

TEST_F(FileSystemTest, CreateWriteFlushReachesTheStore) {
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "ckpt", 0644, O_EXCL, {}, true);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE(fs_->Write(c->entry.ino, 0, "abc", 3).ok());
  ASSERT_TRUE(fs_->Write(c->entry.ino, 3, "def", 3).ok());
  EXPECT_EQ(fs_->GetAttr(c->entry.ino)->size, 6u);
  // Read back through the mount while still open: the written bytes.
  EXPECT_EQ(Bytes(fs_->Read(*c->handle, 0, 100).value()), "abcdef");
  ASSERT_TRUE(fs_->Flush(c->entry.ino).ok());
  ASSERT_TRUE(fs_->Fsync(c->entry.ino).ok());
  EXPECT_GE(store_.syncs(), 1);
  ASSERT_TRUE(fs_->Release(c->entry.ino, c->handle.get()).ok());
  EXPECT_EQ(store_.Data("ckpt"), "abcdef");
  EXPECT_EQ(fs_->Create(kRootIno, "ckpt", 0644, O_EXCL, {}, true).status().code(),
            Status::Code::kExists);
}

TEST_F(FileSystemTest, OverwriteIsNeverServedFromAStaleCache) {
  auto h = OpenPath("d/small");
  ASSERT_EQ(Bytes(fs_->Read(*h, 0, 4096).value()), Pattern(1000, 1));  // now cached
  const uint64_t ino = h->ino;
  // Written without a handle (FUSE no_open: fh 0), same size: only explicit invalidation
  // can tell the cached chunk is old.
  const std::string fresh = Pattern(1000, 7);
  ASSERT_TRUE(fs_->Write(ino, 0, fresh.data(), fresh.size()).ok());
  ASSERT_TRUE(fs_->Flush(ino).ok());  // no writer handle: closes the write state
  EXPECT_EQ(store_.Data("d/small"), fresh);
  EXPECT_EQ(Bytes(fs_->Read(*h, 0, 4096).value()), fresh);  // the handle opened before
  Result<FileHandle> now = fs_->HandleFor(ino);
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(Bytes(fs_->Read(*now, 0, 4096).value()), fresh);
}

TEST_F(FileSystemTest, TruncateAndUnlinkOfAnOpenFile) {
  uint64_t ino = LookupPath("d/small");
  FileSystem::AttrChange trunc;
  trunc.size = 10;
  Result<cfs_client::FileAttr> a = fs_->SetAttr(ino, trunc);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->size, 10u);
  EXPECT_EQ(store_.Data("d/small"), Pattern(1000, 1).substr(0, 10));
  Result<OpenResult> w = fs_->Open(ino, O_RDWR);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(fs_->Unlink(LookupPath("d"), "small").ok());
  EXPECT_FALSE(store_.Exists("d/small"));
  EXPECT_EQ(fs_->Lookup(LookupPath("d"), "small").status().code(), Status::Code::kNotFound);
  EXPECT_TRUE(fs_->Release(ino, w->handle.get()).ok());
}

TEST_F(FileSystemTest, FailedFlushIsReportedAndRetried) {
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "f", 0644, 0, {}, true);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(fs_->Write(c->entry.ino, 0, "data", 4).ok());
  store_.FailWrites(1, Status::NoSpace("full"));
  EXPECT_EQ(fs_->Flush(c->entry.ino).code(), Status::Code::kNoSpace);
  store_.FailWrites(1, Status::IOError("down"));
  EXPECT_EQ(fs_->Fsync(c->entry.ino).code(), Status::Code::kIOError);
  EXPECT_EQ(fs_->Write(c->entry.ino, 4, "x", 1).status().code(), Status::Code::kOk);
  EXPECT_TRUE(fs_->Fsync(c->entry.ino).ok());  // the store is back: now it succeeds
  EXPECT_TRUE(fs_->Release(c->entry.ino, c->handle.get()).ok());
  EXPECT_EQ(store_.Data("f"), "datax");
}

TEST_F(FileSystemTest, RenameMovesTheInodeAndReplacesTheTarget) {
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "tmp", 0644, 0, {}, false);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(fs_->Write(c->entry.ino, 0, "meta", 4).ok());
  ASSERT_TRUE(fs_->Fsync(c->entry.ino).ok());
  ASSERT_EQ(fs_->Rename(kRootIno, "tmp", kRootIno, "big", RENAME_NOREPLACE).code(),
            Status::Code::kExists);
  ASSERT_TRUE(fs_->Rename(kRootIno, "tmp", kRootIno, "big", 0).ok());
  EXPECT_EQ(store_.Data("big"), "meta");
  EXPECT_FALSE(store_.Exists("tmp"));
  Result<Entry> e = fs_->Lookup(kRootIno, "big");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->ino, c->entry.ino);
  EXPECT_EQ(e->attr.size, 4u);
  EXPECT_EQ(fs_->Rename(kRootIno, "big", kRootIno, "x", RENAME_EXCHANGE).code(),
            Status::Code::kNotSupported);
}

// The replaced file of a rename stays what its descriptors see (as after unlink): its inode
// never resolves its old path again, which now names the renamed file.
TEST_F(FileSystemTest, RenameOverKeepsTheReplacedFileForItsDescriptors) {
  const uint64_t old_ino = LookupPath("d/small");  // known to the kernel (no_open: no handle)
  Result<FileSystem::Created> c = fs_->Create(LookupPath("d"), "tmp", 0644, 0, {}, false);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(fs_->Write(c->entry.ino, 0, "NEW", 3).ok());
  ASSERT_TRUE(fs_->Flush(c->entry.ino).ok());
  ASSERT_TRUE(fs_->Rename(LookupPath("d"), "tmp", LookupPath("d"), "small", 0).ok());
  EXPECT_EQ(store_.Data("d/small"), "NEW");
  // Reads of the old inode: the old bytes.
  Result<FileHandle> h = fs_->HandleFor(old_ino);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  Result<ReadResult> r = fs_->Read(*h, 0, 4096);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Bytes(*r), Pattern(1000, 1));
  // Writes of the old inode go to the old file, never into the one that has the name now.
  ASSERT_TRUE(fs_->Write(old_ino, 0, "X", 1).ok());
  ASSERT_TRUE(fs_->Flush(old_ino).ok());
  FileSystem::AttrChange trunc;
  trunc.size = 1;
  ASSERT_TRUE(fs_->SetAttr(old_ino, trunc).ok());
  EXPECT_EQ(store_.Data("d/small"), "NEW");
  EXPECT_EQ(Bytes(fs_->Read(*h, 0, 4096).value()), "X");
  // Forgotten by the kernel: the old file is let go.
  fs_->Forget(old_ino, 1);
  EXPECT_EQ(store_.open_files(), 0);
  EXPECT_EQ(store_.Data("d/small"), "NEW");
}

// A handle an earlier process of the mount opened (a crash or an upgrade since: its number is
// unknown here) reads the inode's version only while that is the version it was opened at.
TEST_F(FileSystemTest, AHandleOfAnEarlierProcessNeverReadsAnotherVersion) {
  auto h = OpenPath("d/small");
  ASSERT_NE(h, nullptr);
  const uint64_t ino = h->ino;
  Result<FileHandle> same = fs_->HandleFor(ino, /*opened_before=*/true);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(Bytes(fs_->Read(*same, 0, 4096).value()), Pattern(1000, 1));
  store_.PutFile("d/small", "changed by another client", 9);
  clock_.AdvanceSeconds(11);  // its attributes expired: the next read asks the store
  EXPECT_EQ(fs_->HandleFor(ino, /*opened_before=*/true).status().code(), Status::Code::kStale);
  // A read without an open (no_open) reads the version there is.
  Result<FileHandle> now = fs_->HandleFor(ino);
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(Bytes(fs_->Read(*now, 0, 4096).value()), "changed by another client");
}

// Unlinked with no file kept open (the keep-alive open failed): the inode answers ESTALE and
// never touches the file created at its old path since.
TEST_F(FileSystemTest, RemovedInodeWithoutStateNeverResolvesItsPath) {
  const uint64_t old_ino = LookupPath("d/small");
  store_.FailWrites(1, Status::IOError("keep-alive open fails"));
  ASSERT_TRUE(fs_->Unlink(LookupPath("d"), "small").ok());
  EXPECT_FALSE(store_.Exists("d/small"));
  store_.PutFile("d/small", "another file", 5);  // made by another client of the store
  clock_.AdvanceSeconds(11);                     // the inode's attributes expired
  const auto kStale = Status::Code::kStale;
  EXPECT_EQ(fs_->Write(old_ino, 0, "X", 1).status().code(), kStale);
  EXPECT_EQ(fs_->HandleFor(old_ino).status().code(), kStale);
  EXPECT_EQ(fs_->Open(old_ino, O_RDONLY).status().code(), kStale);
  EXPECT_EQ(fs_->Open(old_ino, O_RDWR).status().code(), kStale);
  FileSystem::AttrChange chmod;
  chmod.meta.mode = 0600;
  EXPECT_EQ(fs_->SetAttr(old_ino, chmod).status().code(), kStale);
  FileSystem::AttrChange trunc;
  trunc.size = 0;
  EXPECT_EQ(fs_->SetAttr(old_ino, trunc).status().code(), kStale);
  EXPECT_TRUE(fs_->Fsync(old_ino).ok());
  EXPECT_EQ(fs_->GetAttr(old_ino)->size, 1000u);  // what it last was
  EXPECT_EQ(store_.Data("d/small"), "another file");
  EXPECT_EQ(store_.open_files(), 0);
}

// close(2) errors of the store (NFS reports write-back failures there) reach close.
TEST_F(FileSystemTest, AFailedCloseOfTheStoreFileFailsTheFlush) {
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "nfs", 0644, 0, {}, false);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(fs_->Write(c->entry.ino, 0, "data", 4).ok());
  store_.FailCloses(1, Status::Errno(EDQUOT, "quota exceeded at close"));
  Status s = fs_->Flush(c->entry.ino);
  EXPECT_EQ(s.code(), Status::Code::kErrno);
  EXPECT_EQ(s.errno_value(), EDQUOT);
  EXPECT_EQ(store_.closes(), 1);
  EXPECT_EQ(store_.open_files(), 0);
}

// Under no_open any close flushes (and may close) the inode's one write state while other
// descriptors write: their writes, truncates and fsyncs open it again, never a spurious EIO
// nor an fsync that syncs nothing.
TEST_F(FileSystemTest, WritesRacingAFlushThatClosesTheStateSucceed) {
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "race", 0644, 0, {}, false);
  ASSERT_TRUE(c.ok());
  const uint64_t ino = c->entry.ino;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread closer([&] {
    while (!stop.load())
      if (!fs_->Flush(ino).ok()) failures++;
  });
  const int syncs_before = store_.syncs();
  int fsyncs = 0;
  for (int i = 0; i < 3000; ++i) {
    if (!fs_->Write(ino, static_cast<uint64_t>(i % 100), "x", 1).ok()) failures++;
    if (i % 10 == 0) {
      FileSystem::AttrChange trunc;
      trunc.size = 50;
      if (!fs_->SetAttr(ino, trunc).ok()) failures++;
    }
    if (i % 7 == 0) {
      if (!fs_->Fsync(ino).ok()) failures++;
      fsyncs++;
    }
  }
  stop = true;
  closer.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store_.syncs() - syncs_before, fsyncs);  // every fsync synced a file
}

// An orphan (forgotten before its bytes could reach an object store) is not uploaded at
// unmount over what was written at its path since.
TEST_F(FileSystemTest, AnOrphanDoesNotOverwriteNewerBytesAtUnmount) {
  store_.SetObjectStore(true);
  const uint64_t orphan = MakeOrphan("ckpt", "old");
  EXPECT_FALSE(store_.Exists("ckpt"));
  Result<FileSystem::Created> again = fs_->Create(kRootIno, "ckpt", 0644, 0, {}, false);
  ASSERT_TRUE(again.ok());
  ASSERT_NE(again->entry.ino, orphan);
  ASSERT_TRUE(fs_->Write(again->entry.ino, 0, "new", 3).ok());
  ASSERT_TRUE(fs_->Flush(again->entry.ino).ok());
  EXPECT_EQ(store_.Data("ckpt"), "new");
  EXPECT_TRUE(fs_->FlushAll().ok());
  EXPECT_EQ(store_.Data("ckpt"), "new");
  EXPECT_EQ(store_.open_files(), 0);  // every file let go at unmount
}

// Nor over a file renamed onto its path, nor back over a file since unlinked, nor into a
// directory removed since; while a file moved by a directory rename is still flushed.
TEST_F(FileSystemTest, AnOrphanDoesNotComeBackOverARenameOrAnUnlink) {
  store_.SetObjectStore(true);
  MakeOrphan("ckpt", "failed");
  Result<FileSystem::Created> tmp = fs_->Create(kRootIno, "ckpt.tmp", 0644, 0, {}, false);
  ASSERT_TRUE(tmp.ok());
  ASSERT_TRUE(fs_->Write(tmp->entry.ino, 0, "newest", 6).ok());
  ASSERT_TRUE(fs_->Flush(tmp->entry.ino).ok());
  ASSERT_TRUE(fs_->Rename(kRootIno, "ckpt.tmp", kRootIno, "ckpt", 0).ok());
  EXPECT_EQ(store_.Data("ckpt"), "newest");

  // "gone" is in the store; a later rewrite of it fails and is forgotten; then it is deleted.
  Result<FileSystem::Created> g = fs_->Create(kRootIno, "gone", 0644, 0, {}, false);
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(fs_->Write(g->entry.ino, 0, "v1", 2).ok());
  ASSERT_TRUE(fs_->Flush(g->entry.ino).ok());
  ASSERT_TRUE(fs_->Write(g->entry.ino, 0, "v2", 2).ok());
  store_.FailWrites(2, Status::IOError("store down"));
  EXPECT_FALSE(fs_->Flush(g->entry.ino).ok());
  fs_->Forget(g->entry.ino, 1);
  ASSERT_TRUE(store_.Exists("gone"));
  ASSERT_TRUE(fs_->Unlink(kRootIno, "gone").ok());

  EXPECT_TRUE(fs_->FlushAll().ok());
  EXPECT_EQ(store_.Data("ckpt"), "newest");
  EXPECT_FALSE(store_.Exists("gone"));
}

// An orphan with nothing newer at its path is still flushed at unmount.
TEST_F(FileSystemTest, AnOrphanIsFlushedAtUnmount) {
  store_.SetObjectStore(true);
  MakeOrphan("ckpt", "only");
  EXPECT_TRUE(fs_->FlushAll().ok());
  EXPECT_EQ(store_.Data("ckpt"), "only");
}

// touch of a new file on an object store: the times are set before the first upload, and the
// file opens and reads after its attributes expire, from what was written so far.
TEST_F(FileSystemTest, AnUnflushedFileOfAnObjectStoreCanBeTouchedAndOpened) {
  store_.SetObjectStore(true);
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "touched", 0644, 0, {}, false);
  ASSERT_TRUE(c.ok());
  const uint64_t ino = c->entry.ino;
  FileSystem::AttrChange times;
  times.meta.atime_ns = times.meta.mtime_ns = cfs_client::AttrChange::kTimeNow;
  Result<cfs_client::FileAttr> a = fs_->SetAttr(ino, times);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(fs_->Write(ino, 0, "abc", 3).ok());
  clock_.AdvanceSeconds(11);
  Result<FileHandle> h = fs_->HandleFor(ino);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->version.size, 3u);
  clock_.AdvanceSeconds(11);
  Result<OpenResult> o = fs_->Open(ino, O_RDONLY, false);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(Bytes(fs_->Read(*o->handle, 0, 100).value()), "abc");
  EXPECT_FALSE(store_.Exists("touched"));
  ASSERT_TRUE(fs_->Flush(ino).ok());
  EXPECT_EQ(store_.Data("touched"), "abc");
}

// Unlink and rename-over of a file not yet in an object store drop its local copy.
TEST_F(FileSystemTest, RemovingAnUnflushedFileDiscardsItsBytes) {
  store_.SetObjectStore(true);
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "gone", 0644, 0, {}, true);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(fs_->Write(c->entry.ino, 0, "abc", 3).ok());
  ASSERT_TRUE(fs_->Unlink(kRootIno, "gone").ok());
  EXPECT_EQ(store_.discards(), 1);
  ASSERT_TRUE(fs_->Release(c->entry.ino, c->handle.get()).ok());
  fs_->Forget(c->entry.ino, 1);
  EXPECT_FALSE(store_.Exists("gone"));
  EXPECT_EQ(store_.open_files(), 0);

  Result<FileSystem::Created> dst = fs_->Create(kRootIno, "dst", 0644, 0, {}, false);
  ASSERT_TRUE(dst.ok());
  ASSERT_TRUE(fs_->Write(dst->entry.ino, 0, "unflushed", 9).ok());
  store_.PutFile("src", "src bytes");
  ASSERT_TRUE(fs_->Rename(kRootIno, "src", kRootIno, "dst", 0).ok());
  EXPECT_EQ(store_.discards(), 2);
  EXPECT_TRUE(fs_->FlushAll().ok());
  EXPECT_EQ(store_.Data("dst"), "src bytes");
}

TEST_F(FileSystemTest, UnknownRenameFlagsAreInvalid) {
  EXPECT_EQ(fs_->Rename(kRootIno, "big", kRootIno, "x", 1u << 10).code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(fs_->Rename(kRootIno, "big", kRootIno, "x", RENAME_EXCHANGE).code(),
            Status::Code::kNotSupported);
  EXPECT_TRUE(store_.Exists("big"));
}

TEST_F(FileSystemTest, OpenDirSnapshotsEntries) {
  Result<std::unique_ptr<DirHandle>> dir = fs_->OpenDir(kRootIno);
  ASSERT_TRUE(dir.ok());
  MutexLock l((*dir)->mu);
  std::vector<std::string> names;
  for (const auto& e : (*dir)->entries) names.push_back(e.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"big", "d"}));
  uint64_t ino = fs_->AcquireDirEntry(**dir, (*dir)->entries[0]);
  EXPECT_EQ(fs_->inodes().lookups(ino), 1u);
}

TEST_F(FileSystemTest, ConcurrentReadersGetExactBytesWithOneFetchPerChunk) {
  const std::string want = Pattern(300 << 10, 2);
  auto h = OpenPath("big");
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t off = (t * 4096) % 65536; off < want.size(); off += 50000) {
        Result<ReadResult> r = fs_->Read(*h, off, 70000);
        if (!r.ok() || Bytes(r.value()) != want.substr(off, 70000)) bad++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(store_.reads(), 5);
}

// A stat of a file being written answers while its upload is in flight: an upload holds the
// file's write lock for its whole length, and a stat does not take it.
TEST_F(FileSystemTest, StatDoesNotWaitForAnUploadInFlight) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> first{true};
  store_.SetFlushGate([&] {
    if (!first.exchange(false)) return;
    entered.set_value();
    released.wait();
  });
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "up", 0644, 0, {}, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const uint64_t ino = c->entry.ino;
  const std::string data = Pattern(5000, 3);
  ASSERT_TRUE(fs_->Write(ino, 0, data.data(), data.size()).ok());
  auto upload = std::async(std::launch::async, [&] { return fs_->Flush(ino); });
  ASSERT_EQ(entered.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto stat = std::async(std::launch::async, [&] {
    Result<cfs_client::FileAttr> a = fs_->GetAttr(ino);
    Result<Entry> e = fs_->Lookup(kRootIno, "up");
    return a.ok() && a->size == data.size() && e.ok() && e->attr.size == data.size();
  });
  const bool in_time = stat.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
  release.set_value();
  EXPECT_TRUE(in_time) << "stat waited for the upload";
  EXPECT_TRUE(stat.get());
  EXPECT_TRUE(upload.get().ok());
  EXPECT_EQ(store_.Data("up"), data);
}

// A forget of a file whose bytes are not in the store yet returns at once: the upload runs
// on the background thread, not on the FUSE thread the forget came on.
TEST_F(FileSystemTest, ForgetDoesNotWaitForTheUpload) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> first{true};
  store_.SetFlushGate([&] {
    if (!first.exchange(false)) return;
    entered.set_value();
    released.wait();
  });
  fs_->StartWriteBack();
  Result<FileSystem::Created> c = fs_->Create(kRootIno, "forgotten", 0644, 0, {}, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const std::string data = Pattern(3000, 5);
  ASSERT_TRUE(fs_->Write(c->entry.ino, 0, data.data(), data.size()).ok());
  auto forget = std::async(std::launch::async, [&] { fs_->Forget(c->entry.ino, 1); });
  const bool in_time = forget.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
  // The upload did start, elsewhere.
  const bool started =
      entered.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  release.set_value();
  forget.get();
  EXPECT_TRUE(in_time) << "forget waited for the upload";
  EXPECT_TRUE(started);
  for (int i = 0; i < 1000 && store_.Data("forgotten") != data; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(store_.Data("forgotten"), data);
  fs_->StopWriteBack();
  EXPECT_TRUE(fs_->FlushAll().ok());
  EXPECT_EQ(store_.open_files(), 0);
}

// With lookup_read_bytes, a lookup of a small file is the one request of its cold read: the
// bytes come with the attributes and the read is served from the RAM cache.
TEST_F(FileSystemTest, ALookupThatReadsMakesTheColdReadOneRequest) {
  FileSystem::Options o = options_;
  o.lookup_read_bytes = 16 << 10;
  std::unique_ptr<FileSystem> fs =
      FileSystem::New(o, &store_, cache_.get(), prefetcher_.get(), &clock_, registry_).value();
  Result<Entry> d = fs->Lookup(kRootIno, "d");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const int reads = store_.reads(), stats = store_.stats();
  Result<Entry> e = fs->Lookup(d->ino, "small");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(store_.reads(), reads + 1);  // one request: the GET
  EXPECT_EQ(store_.stats(), stats);
  Result<OpenResult> o2 = fs->Open(e->ino, O_RDONLY);
  ASSERT_TRUE(o2.ok()) << o2.status().ToString();
  EXPECT_EQ(Bytes(fs->Read(*o2->handle, 0, 4096).value()), Pattern(1000, 1));
  EXPECT_EQ(store_.reads(), reads + 1);  // served from the RAM cache
  // A file larger than the bytes asked for: its attributes only; its read fetches it.
  Result<Entry> big = fs->Lookup(kRootIno, "big");
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->attr.size, 300u << 10);
}

}  // namespace
}  // namespace cubetorchfs::fs
