#include "cache/disk_cache.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <thread>

#include "cache/crc32c.h"

namespace cubetorchfs::cache {
namespace {

namespace fs = std::filesystem;

BufferRef Bytes(size_t n, char seed) {
  auto b = Buffer::Allocate(n);
  for (size_t i = 0; i < n; ++i) b->data.get()[i] = static_cast<char>(seed + i * 7);
  return b;
}

std::string Key(int i) { return ChunkKey("file" + std::to_string(i), {100, 1}, 0); }

size_t FilesIn(const fs::path& dir) {
  size_t n = 0;
  for (auto it = fs::directory_iterator(dir); it != fs::directory_iterator(); ++it) ++n;
  return n;
}

class DiskCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ctfs_disk_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override {
    cache_.reset();
    fs::remove_all(dir_);
  }
  void Open(uint64_t capacity = 1 << 20,
            DiskCache::Options::CrashPoint crash = DiskCache::Options::CrashPoint::kNone,
            uint64_t queue_bytes = 32ull << 20, std::function<void()> before_remove = nullptr) {
    cache_.reset();
    DiskCache::Options o;
    o.before_remove = std::move(before_remove);
    o.dir = dir_;
    o.capacity_bytes = capacity;
    o.min_free_ratio = 0;
    o.crash_point = crash;
    o.queue_bytes = queue_bytes;
    auto c = DiskCache::Open(o, &registry_);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    cache_ = std::move(c).value();
  }

  fs::path dir_;
  prometheus::Registry registry_;
  std::unique_ptr<DiskCache> cache_;
};

// A bit-at-a-time CRC32C (reflected polynomial 0x82F63B78), independent of the table and of
// the SSE4.2 instructions the product uses.
uint32_t ReferenceCrc32c(const unsigned char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32cTest, KnownValues) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);  // the standard check value
  EXPECT_EQ(Crc32c("", 0), 0u);
  EXPECT_EQ(Crc32c("", 0, 0x12345678u), 0x12345678u);  // no data: the running value unchanged
  // RFC 3720 (iSCSI) appendix B.4.
  unsigned char buf[32];
  std::memset(buf, 0x00, sizeof buf);
  EXPECT_EQ(Crc32c(buf, 32), 0x8A9136AAu) << "32 bytes of zeros";
  std::memset(buf, 0xFF, sizeof buf);
  EXPECT_EQ(Crc32c(buf, 32), 0x62A8AB43u) << "32 bytes of 0xFF";
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(Crc32c(buf, 32), 0x46DD794Eu) << "32 incrementing bytes";
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(Crc32c(buf, 32), 0x113FDB5Cu) << "32 decrementing bytes";
  // The reference agrees with the vectors, so it can judge the cases below.
  EXPECT_EQ(ReferenceCrc32c(reinterpret_cast<const unsigned char*>("123456789"), 9), 0xE3069283u);
  EXPECT_EQ(ReferenceCrc32c(buf, 32), 0x113FDB5Cu);
}

// The same bytes give the same CRC wherever they sit in memory (the 8-byte hardware loop and
// the byte tail), for every length up to a few words, and equal the bitwise reference.
TEST(Crc32cTest, SameValueAtEveryAlignmentAndLength) {
  unsigned char data[80];
  for (size_t i = 0; i < sizeof data; ++i) data[i] = static_cast<unsigned char>(i * 37 + 11);
  alignas(16) unsigned char buf[sizeof data + 16];
  for (size_t len = 0; len <= sizeof data; ++len) {
    const uint32_t want = ReferenceCrc32c(data, len);
    for (size_t off = 0; off < 8; ++off) {
      std::memset(buf, 0xA5, sizeof buf);
      std::memcpy(buf + off, data, len);
      ASSERT_EQ(Crc32c(buf + off, len), want) << "length " << len << " at offset " << off;
    }
  }
}

// Extending a CRC (the `crc` argument) over any split gives the CRC of the whole.
TEST(Crc32cTest, ExtendingAgreesAtEverySplit) {
  std::string s(1000, 'x');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 131 + (i >> 3));
  const uint32_t whole = Crc32c(s.data(), s.size());
  EXPECT_EQ(whole, ReferenceCrc32c(reinterpret_cast<const unsigned char*>(s.data()), s.size()));
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    ASSERT_EQ(Crc32c(s.data() + cut, s.size() - cut, Crc32c(s.data(), cut)), whole)
        << "split at " << cut;
  }
  // Three pieces, the middle one at an odd address.
  EXPECT_EQ(Crc32c(s.data() + 601, 399, Crc32c(s.data() + 3, 598, Crc32c(s.data(), 3))), whole);
}

TEST_F(DiskCacheTest, RoundTripSurvivesRestart) {
  Open();
  ASSERT_TRUE(cache_->Put(Key(1), *Bytes(5000, 'a')).ok());
  ASSERT_TRUE(cache_->Put(Key(2), *Bytes(10, 'b')).ok());
  Open();  // a restarted daemon
  EXPECT_EQ(cache_->entries(), 2u);
  EXPECT_EQ(cache_->bytes(), 5010u);
  Result<BufferRef> got = cache_->Get(Key(1));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::memcmp((*got)->data.get(), Bytes(5000, 'a')->data.get(), 5000), 0);
  EXPECT_TRUE(cache_->Get(Key(3)).status().IsNotFound());
}

TEST_F(DiskCacheTest, CrashAfterTempWriteLeavesNoEntryAndNoFiles) {
  Open(1 << 20, DiskCache::Options::CrashPoint::kAfterTempWrite);
  EXPECT_FALSE(cache_->Put(Key(1), *Bytes(100, 'a')).ok());
  Open();
  EXPECT_EQ(cache_->entries(), 0u);
  EXPECT_EQ(cache_->bytes(), 0u);
  EXPECT_EQ(FilesIn(dir_ / "tmp"), 0u);
  EXPECT_EQ(FilesIn(dir_ / "data"), 0u);
}

TEST_F(DiskCacheTest, CrashAfterRenameRemovesTheOrphan) {
  Open(1 << 20, DiskCache::Options::CrashPoint::kAfterRename);
  EXPECT_FALSE(cache_->Put(Key(1), *Bytes(100, 'a')).ok());
  EXPECT_EQ(FilesIn(dir_ / "data"), 1u);  // data written, never indexed
  Open();
  EXPECT_EQ(cache_->entries(), 0u);
  EXPECT_EQ(FilesIn(dir_ / "data"), 0u);
}

TEST_F(DiskCacheTest, IndexEntryWithoutDataIsDropped) {
  Open();
  ASSERT_TRUE(cache_->Put(Key(1), *Bytes(100, 'a')).ok());
  ASSERT_TRUE(cache_->Put(Key(2), *Bytes(100, 'b')).ok());
  const std::string file = cache_->DataFileOf(Key(1));
  cache_.reset();
  fs::remove(file);
  Open();
  EXPECT_EQ(cache_->entries(), 1u);
  EXPECT_FALSE(cache_->Contains(Key(1)));
  EXPECT_TRUE(cache_->Get(Key(2)).ok());
}

TEST_F(DiskCacheTest, CorruptionIsDetectedAndDropped) {
  Open();
  ASSERT_TRUE(cache_->Put(Key(1), *Bytes(4096, 'a')).ok());
  {
    std::fstream f(cache_->DataFileOf(Key(1)), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1234);
    f.put('\xff');
  }
  EXPECT_TRUE(cache_->Get(Key(1)).status().IsNotFound());
  EXPECT_EQ(cache_->corruptions(), 1u);
  EXPECT_FALSE(cache_->Contains(Key(1)));
  ASSERT_TRUE(cache_->Put(Key(1), *Bytes(4096, 'a')).ok());  // refetched data can go back
  EXPECT_TRUE(cache_->Get(Key(1)).ok());
}

TEST_F(DiskCacheTest, BudgetAndLruOrder) {
  Open(/*capacity=*/4000);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(cache_->Put(Key(i), *Bytes(1000, 'a')).ok());
  ASSERT_TRUE(cache_->Get(Key(0)).ok());  // 1 is now the least recently used
  ASSERT_TRUE(cache_->Put(Key(4), *Bytes(1000, 'e')).ok());
  EXPECT_LE(cache_->bytes(), 4000u);
  EXPECT_FALSE(cache_->Contains(Key(1)));
  EXPECT_TRUE(cache_->Contains(Key(0)));
  EXPECT_TRUE(cache_->Contains(Key(4)));
  EXPECT_FALSE(cache_->Put(Key(9), *Bytes(5000, 'z')).ok());  // larger than the tier
}

TEST_F(DiskCacheTest, AsyncPutsAreWrittenByTheWriter) {
  Open();
  for (int i = 0; i < 20; ++i) cache_->PutAsync(Key(i), Bytes(2000, static_cast<char>(i)));
  cache_->Flush();
  EXPECT_EQ(cache_->entries(), 20u);
  Result<BufferRef> got = cache_->Get(Key(7));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)->data.get()[0], 7);
}

TEST_F(DiskCacheTest, AChunkBiggerThanTheQueueIsStillWritten) {
  cache_.reset();
  DiskCache::Options o;
  o.dir = dir_;
  o.capacity_bytes = 1 << 20;
  o.min_free_ratio = 0;
  o.queue_bytes = 1000;
  cache_ = DiskCache::Open(o, nullptr).value();
  cache_->PutAsync(Key(1), Bytes(5000, 'a'));  // an empty queue takes any one chunk
  cache_->PutAsync(Key(1), Bytes(5000, 'a'));  // already queued or written: ignored
  cache_->Flush();
  EXPECT_EQ(cache_->entries(), 1u);
  EXPECT_EQ(cache_->bytes(), 5000u);
}

// EraseFile waits for a chunk of its file being written, not for the writer to go idle: with
// other files keeping the queue full it used to wait as long as they did (the writer takes
// the next chunk without letting go of the lock).
TEST_F(DiskCacheTest, EraseFileIsNotStarvedByAFullQueue) {
  Open(64 << 20, DiskCache::Options::CrashPoint::kNone, 256 << 10);
  cache_->PutAsync(ChunkKey("victim", {100, 1}, 0), Bytes(2000, 'v'));
  cache_->Flush();
  std::atomic<bool> stop{false};
  std::thread producer([&] {
    for (int i = 0; !stop.load(); ++i)
      cache_->PutAsync(ChunkKey("other", {100, 1}, static_cast<uint64_t>(i)), Bytes(4096, 'o'));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the writer is busy now
  std::promise<void> erased;
  std::future<void> done = erased.get_future();
  std::thread eraser([&] {
    cache_->EraseFile("victim");
    erased.set_value();
  });
  const bool in_time = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  stop = true;  // lets a starved EraseFile finish, so the test ends either way
  producer.join();
  eraser.join();
  EXPECT_TRUE(in_time) << "EraseFile waited for the whole queue";
  EXPECT_FALSE(cache_->Contains(ChunkKey("victim", {100, 1}, 0)));
}

TEST_F(DiskCacheTest, SecondOpenOfTheSameDirectoryFailsClearly) {
  Open();
  DiskCache::Options o;
  o.dir = dir_;
  o.capacity_bytes = 1 << 20;
  auto second = DiskCache::Open(o, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cache.disk_dir"), std::string::npos);
}

// Every directory of the tier 0700 and every file 0600, RocksDB's own included, whatever the
// umask: the tier holds copies of files other users may not read.
void ExpectPrivate(const fs::path& dir) {
  struct stat st;
  ASSERT_EQ(::lstat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u) << dir;
  size_t files = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    ASSERT_EQ(::lstat(e.path().c_str(), &st), 0);
    if (S_ISDIR(st.st_mode)) {
      EXPECT_EQ(st.st_mode & 07777, 0700u) << e.path();
    } else {
      EXPECT_TRUE(S_ISREG(st.st_mode)) << e.path();
      EXPECT_EQ(st.st_mode & 07777, 0600u) << e.path();
      ++files;
    }
  }
  EXPECT_GT(files, 3u);  // chunks and the index's files were looked at
}

class UmaskZero {
 public:
  UmaskZero() : old_(::umask(0)) {}
  ~UmaskZero() { ::umask(old_); }

 private:
  mode_t old_;
};

TEST_F(DiskCacheTest, FilesAre0600AndDirectories0700EvenUnderUmaskZero) {
  UmaskZero umask0;
  Open();
  ASSERT_TRUE(cache_->Put(Key(1), *Bytes(5000, 'a')).ok());
  cache_->PutAsync(Key(2), Bytes(7000, 'b'));
  cache_->Flush();
  ASSERT_NE(cache_->DataFileOf(Key(1)), "");
  ExpectPrivate(dir_);
  Open();  // a restart writes new index files
  ASSERT_TRUE(cache_->Put(Key(3), *Bytes(100, 'c')).ok());
  ExpectPrivate(dir_);
}

TEST_F(DiskCacheTest, AnExistingWideTierIsNarrowedAtOpen) {
  Open();
  ASSERT_TRUE(cache_->Put(Key(1), *Bytes(5000, 'a')).ok());
  const std::string chunk = cache_->DataFileOf(Key(1));
  cache_.reset();
  // As an older version left it: 0755 directories, 0644 chunks.
  for (const char* d : {"", "/data", "/tmp", "/index"})
    ASSERT_EQ(::chmod((dir_.string() + d).c_str(), 0755), 0);
  ASSERT_EQ(::chmod(chunk.c_str(), 0644), 0);
  Open();
  EXPECT_EQ(cache_->entries(), 1u);
  ExpectPrivate(dir_);
}

TEST_F(DiskCacheTest, ASymlinkedTierIsRefused) {
  const fs::path real = dir_.string() + ".real";
  fs::create_directories(real);
  fs::create_symlink(real, dir_);
  DiskCache::Options o;
  o.dir = dir_;
  o.capacity_bytes = 1 << 20;
  auto c = DiskCache::Open(o, nullptr);
  fs::remove_all(real);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("symlink"), std::string::npos) << c.status().ToString();
  EXPECT_NE(c.status().message().find(dir_.string()), std::string::npos);
}

TEST_F(DiskCacheTest, ATierInADirectoryOthersCanChangeIsRefused) {
  // Anyone could rename the tier away and put a link in its place: refused.
  const fs::path open_parent = dir_.string() + ".open";
  fs::create_directories(open_parent);
  ::chmod(open_parent.c_str(), 0777);
  DiskCache::Options o;
  o.dir = open_parent / "tier";
  o.capacity_bytes = 1 << 20;
  auto c = DiskCache::Open(o, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("lets another user replace it"), std::string::npos)
      << c.status().ToString();
  // With the sticky bit (as /tmp has) others cannot rename it: accepted.
  ::chmod(open_parent.c_str(), 01777);
  EXPECT_TRUE(DiskCache::Open(o, nullptr).ok());
  fs::remove_all(open_parent);
}

TEST_F(DiskCacheTest, ATierOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a directory of another user";
  fs::create_directories(dir_);
  ASSERT_EQ(::chown(dir_.c_str(), 65534, 65534), 0);
  DiskCache::Options o;
  o.dir = dir_;
  o.capacity_bytes = 1 << 20;
  auto c = DiskCache::Open(o, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("uid 65534"), std::string::npos) << c.status().ToString();
  EXPECT_TRUE(fs::is_empty(dir_));  // nothing was written into it
}

// A slow disk: an eviction's unlinks and index deletes block. Readers of other chunks do
// not wait for them: the index lock is not held across that I/O.
TEST_F(DiskCacheTest, ReadersDoNotWaitForAnEvictionOnASlowDisk) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> first{true};
  Open(2 * 100, DiskCache::Options::CrashPoint::kNone, 32ull << 20, [&] {
    if (!first.exchange(false)) return;
    entered.set_value();
    released.wait();
  });
  ASSERT_TRUE(cache_->Put(Key(1), *Bytes(100, 'a')).ok());
  ASSERT_TRUE(cache_->Put(Key(2), *Bytes(100, 'b')).ok());
  // Key(1) is the least recently used: putting Key(3) evicts it, and blocks removing it.
  auto writer =
      std::async(std::launch::async, [&] { return cache_->Put(Key(3), *Bytes(100, 'c')); });
  ASSERT_EQ(entered.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto reader = std::async(std::launch::async, [&] {
    bool has = cache_->Contains(Key(2));
    Result<BufferRef> got = cache_->Get(Key(2));
    return has && got.ok() &&
           std::memcmp((*got)->data.get(), Bytes(100, 'b')->data.get(), 100) == 0;
  });
  const bool in_time = reader.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
  EXPECT_FALSE(cache_->Contains(Key(1)));  // out of the index before its file goes
  release.set_value();
  EXPECT_TRUE(in_time) << "a reader waited for the eviction's disk I/O";
  EXPECT_TRUE(reader.get());
  EXPECT_TRUE(writer.get().ok());
  EXPECT_TRUE(cache_->Contains(Key(3)));
  EXPECT_EQ(cache_->bytes(), 200u);
  // The evicted chunk's file and row are gone: after a restart it is not found.
  Open(2 * 100);
  EXPECT_FALSE(cache_->Contains(Key(1)));
  EXPECT_TRUE(cache_->Contains(Key(2)));
  EXPECT_TRUE(cache_->Contains(Key(3)));
}

// EraseFile looks at the file's own chunks (every version) and one more index entry, not at
// every chunk of the tier, and leaves a file whose path starts the same.
TEST_F(DiskCacheTest, EraseFileVisitsOnlyTheFilesChunks) {
  Open(8 << 20);
  for (int i = 0; i < 300; ++i) ASSERT_TRUE(cache_->Put(Key(i), *Bytes(100, 'a')).ok());
  for (uint64_t c = 0; c < 3; ++c)
    ASSERT_TRUE(cache_->Put(ChunkKey("victim", {500, 3}, c), *Bytes(100, 'v')).ok());
  ASSERT_TRUE(cache_->Put(ChunkKey("victim", {100, 1}, 0), *Bytes(100, 'o')).ok());
  ASSERT_TRUE(cache_->Put(ChunkKey("victim2", {100, 1}, 0), *Bytes(100, 'w')).ok());
  cache_->Flush();
  const uint64_t before = cache_->erase_visits();
  cache_->EraseFile("victim");
  EXPECT_LE(cache_->erase_visits() - before, 4u + 1u);
  EXPECT_TRUE(cache_->Get(ChunkKey("victim", {500, 3}, 2)).status().IsNotFound());
  EXPECT_TRUE(cache_->Get(ChunkKey("victim", {100, 1}, 0)).status().IsNotFound());
  EXPECT_TRUE(cache_->Get(ChunkKey("victim2", {100, 1}, 0)).ok());
  EXPECT_TRUE(cache_->Get(Key(299)).ok());
  EXPECT_EQ(cache_->entries(), 301u);
}

}  // namespace
}  // namespace cubetorchfs::cache
