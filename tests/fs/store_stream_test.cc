#include "fs/store_stream.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "fs/file_system.h"
#include "tests/test_util.h"

namespace cubetorchfs::fs {
namespace {

namespace stdfs = std::filesystem;
using testing::Pattern;

TEST(StreamAdmissionTest, ASecondReadOfTheSameBytesIsAdmitted) {
  StreamAdmission a(8);
  constexpr uint64_t kChunk = 4 << 20;                                   // granules of a page
  EXPECT_TRUE(a.FirstTouch("f@1:0", kChunk, 0, 16384));                  // a header
  EXPECT_TRUE(a.FirstTouch("f@1:0", kChunk, 16384, (1 << 20) + 16384));  // right after it
  EXPECT_TRUE(a.FirstTouch("f@1:0", kChunk, 3 << 20, 4 << 20));  // out of order: still first
  EXPECT_TRUE(a.FirstTouch("f@1:0", kChunk, (1 << 20) + 16384, 3 << 20));  // the gap
  EXPECT_FALSE(a.FirstTouch("f@1:0", kChunk, 8192, 12288));                // read again: cache it
  EXPECT_FALSE(a.FirstTouch("f@1:0", kChunk, (3 << 20) - 4096, (3 << 20) + 4096));
  EXPECT_TRUE(a.FirstTouch("f@1:1", kChunk, 0, 4096));  // another chunk
  EXPECT_TRUE(a.FirstTouch("f@2:0", kChunk, 0, 4096));  // another version of the file
  EXPECT_EQ(a.size(), 3u);
}

TEST(StreamAdmissionTest, LargeChunksCompareOnlyTheGranulesAReadCoversWhole) {
  StreamAdmission a(8);
  constexpr uint64_t kChunk = 64 << 20;  // granules of 64 KiB
  EXPECT_TRUE(a.FirstTouch("g", kChunk, 0, 16384));
  // Sequential reads sharing a granule at their boundary are not taken for re-reads.
  EXPECT_TRUE(a.FirstTouch("g", kChunk, 16384, 1 << 20));
  EXPECT_TRUE(a.FirstTouch("g", kChunk, 1 << 20, (2 << 20) + 4096));
  EXPECT_FALSE(a.FirstTouch("g", kChunk, 0, 1 << 20));  // a re-read
  EXPECT_TRUE(a.FirstTouch("g", kChunk, 0, 16384));     // too small to tell: streamed
}

TEST(StreamAdmissionTest, ForgetsTheLeastRecentlyStreamedChunkBeyondItsCapacity) {
  StreamAdmission a(2);
  EXPECT_TRUE(a.FirstTouch("a", 1 << 20, 0, 4096));
  EXPECT_TRUE(a.FirstTouch("b", 1 << 20, 0, 4096));
  EXPECT_FALSE(a.FirstTouch("a", 1 << 20, 0, 4096));  // a is now the most recent
  EXPECT_TRUE(a.FirstTouch("c", 1 << 20, 0, 4096));   // b forgotten
  EXPECT_EQ(a.size(), 2u);
  EXPECT_TRUE(a.FirstTouch("b", 1 << 20, 0, 4096));  // a first touch again
  EXPECT_FALSE(a.FirstTouch("c", 1 << 20, 0, 4096));
}

std::string Bytes(const ReadResult& r) {
  std::string out;
  if (r.store) {
    out.resize(r.store->length);
    const ssize_t n =
        ::pread(r.store->fd, out.data(), out.size(), static_cast<off_t>(r.store->offset));
    EXPECT_EQ(n, static_cast<ssize_t>(out.size()));
  }
  for (const auto& s : r.slices) out.append(s.buffer->data.get() + s.offset, s.length);
  return out;
}

class StoreStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = stdfs::temp_directory_path() / ("ctfs_stream_" + std::to_string(::getpid()));
    stdfs::remove_all(root_);
    stdfs::create_directories(root_);
    Write("big", Pattern(1 << 20, 1));  // 16 chunks of 64 KiB
    Write("small", Pattern(100 << 10, 2));
    Write("model.safetensors", Pattern(1 << 20, 3));
    backend_ = cfs_client::NewPosixBackend(root_).value();
    cache_ = cache::RamCache::New({8 << 20, 64 << 10}, nullptr);
    options_.chunk_bytes = 64 << 10;
    options_.stream_min_bytes = 512 << 10;
    prefetch::Prefetcher::Options pf;
    pf.start_workers = false;
    pf.chunk_bytes = options_.chunk_bytes;
    pf.window_budget_bytes = 1 << 20;
    prefetcher_ = std::make_unique<prefetch::Prefetcher>(pf, backend_.get(), cache_.get(), &clock_,
                                                         &registry_);
    fs_ = FileSystem::New(options_, backend_.get(), cache_.get(), prefetcher_.get(), &clock_,
                          registry_)
              .value();
  }
  void TearDown() override {
    fs_.reset();
    stdfs::remove_all(root_);
  }
  void Write(const std::string& rel, const std::string& data) {
    std::ofstream(root_ / rel, std::ios::binary | std::ios::trunc) << data;
  }
  std::unique_ptr<FileHandle> Open(const std::string& name) {
    Result<Entry> e = fs_->Lookup(kRootIno, name);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    Result<OpenResult> r = fs_->Open(e->ino, O_RDONLY);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return std::move(r->handle);
  }
  double Streamed() {
    for (const auto& f : registry_.Collect())
      if (f.name == "cubetorchfs_read_streamed_bytes_total") return f.metric[0].counter.value;
    return -1;
  }

  stdfs::path root_;
  testing::FakeClock clock_;
  prometheus::Registry registry_;
  FileSystem::Options options_;
  std::unique_ptr<cfs_client::Backend> backend_;
  std::unique_ptr<cache::RamCache> cache_;
  std::unique_ptr<prefetch::Prefetcher> prefetcher_;
  std::unique_ptr<FileSystem> fs_;
};

TEST_F(StoreStreamTest, AColdReadIsStreamedAndASecondReadIsCached) {
  const std::string want = Pattern(1 << 20, 1);
  std::unique_ptr<FileHandle> h = Open("big");
  ASSERT_NE(h->stream, nullptr);
  // In order, 128 KiB at a time, and one read across a chunk boundary: all streamed.
  for (uint64_t off : {0ul, 131072ul, 262144ul, 400000ul}) {
    Result<ReadResult> r = fs_->Read(*h, off, 131072);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(r->store.has_value()) << off;
    EXPECT_TRUE(r->slices.empty());
    EXPECT_EQ(Bytes(*r), want.substr(off, 131072)) << off;
  }
  EXPECT_EQ(Streamed(), 4 * 131072);
  EXPECT_EQ(cache_->bytes(), 0u) << "streamed bytes are not cached";
  // The same bytes again: a second touch reads them into the cache.
  Result<ReadResult> again = fs_->Read(*h, 0, 131072);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->store.has_value());
  EXPECT_EQ(Bytes(*again), want.substr(0, 131072));
  EXPECT_EQ(cache_->bytes(), 2u * (64 << 10));
  // A read touching a cached chunk is served from the cache, not streamed.
  Result<ReadResult> mixed = fs_->Read(*h, 100000, 131072);
  ASSERT_TRUE(mixed.ok());
  EXPECT_FALSE(mixed->store.has_value());
  EXPECT_EQ(Bytes(*mixed), want.substr(100000, 131072));
  // The end of the file: a short read, streamed.
  Result<ReadResult> tail = fs_->Read(*h, (1 << 20) - 1000, 131072);
  ASSERT_TRUE(tail.ok());
  ASSERT_TRUE(tail->store.has_value());
  EXPECT_EQ(Bytes(*tail), want.substr((1 << 20) - 1000));
}

// A read streamed across a chunk boundary marks the bytes it took of the next chunk too: the
// kernel's next read, starting in that chunk over those bytes, is a second touch (cached), so
// no byte is streamed twice however the kernel splits its reads.
TEST_F(StoreStreamTest, BytesStreamedPastAChunkBoundaryAreNotStreamedAgain) {
  const std::string want = Pattern(1 << 20, 1);
  std::unique_ptr<FileHandle> h = Open("big");
  ASSERT_NE(h->stream, nullptr);
  Result<ReadResult> across = fs_->Read(*h, 60 << 10, 8 << 10);  // 4 KiB of chunks 0 and 1
  ASSERT_TRUE(across.ok());
  ASSERT_TRUE(across->store.has_value());
  EXPECT_EQ(Streamed(), 8 << 10);
  // Bytes of chunk 1 that no read took yet are a first touch: streamed.
  Result<ReadResult> later = fs_->Read(*h, 96 << 10, 4 << 10);
  ASSERT_TRUE(later.ok());
  EXPECT_TRUE(later->store.has_value());
  EXPECT_EQ(Streamed(), 12 << 10);
  Result<ReadResult> again = fs_->Read(*h, 64 << 10, 4 << 10);  // chunk 1's first page again
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->store.has_value());
  EXPECT_EQ(Bytes(*again), want.substr(64 << 10, 4 << 10));
  EXPECT_EQ(Streamed(), 12 << 10);
}

TEST_F(StoreStreamTest, SmallFilesModelFilesAndAZeroThresholdAreNeverStreamed) {
  EXPECT_EQ(Open("small")->stream, nullptr);              // under stream_min_bytes
  EXPECT_EQ(Open("model.safetensors")->stream, nullptr);  // the model fetcher's
  options_.stream_min_bytes = 0;
  fs_ =
      FileSystem::New(options_, backend_.get(), cache_.get(), prefetcher_.get(), &clock_, registry_)
          .value();
  std::unique_ptr<FileHandle> h = Open("big");
  EXPECT_EQ(h->stream, nullptr);
  Result<ReadResult> r = fs_->Read(*h, 0, 131072);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->store.has_value());
}

TEST_F(StoreStreamTest, OnlyABackendThatHandsOutDescriptorsStreams) {
  EXPECT_TRUE(backend_->capabilities().hands_out_fds);
  conf::InjectOptions slow;
  slow.latency_us = 1;  // every byte must then pass through the daemon
  testing::FakeClock clock;
  std::unique_ptr<cfs_client::Backend> injected =
      cfs_client::NewInjectBackend(cfs_client::NewPosixBackend(root_).value(), slow, &clock);
  EXPECT_FALSE(injected->capabilities().hands_out_fds);
  EXPECT_TRUE(cfs_client::NewInjectBackend(cfs_client::NewPosixBackend(root_).value(), {}, &clock)
                  ->capabilities()
                  .hands_out_fds);
  testing::MemBackend mem;
  EXPECT_FALSE(mem.capabilities().hands_out_fds);
  fs_ =
      FileSystem::New(options_, injected.get(), cache_.get(), prefetcher_.get(), &clock_, registry_)
          .value();
  EXPECT_EQ(Open("big")->stream, nullptr);
  fs_.reset();
}

TEST_F(StoreStreamTest, AFileChangedInTheStoreIsNotStreamedUnderItsOldVersion) {
  std::unique_ptr<FileHandle> h = Open("big");
  ASSERT_NE(h->stream, nullptr);
  Write("big", Pattern(900 << 10, 9));  // rewritten behind the mount's back
  Result<ReadResult> r = fs_->Read(*h, 0, 131072);
  // The usual path then reports the change (or, on a coarse clock, serves what it reads);
  // never the new bytes as if they were the opened version's, by the streamed path.
  if (r.ok()) {
    EXPECT_FALSE(r->store.has_value());
  }
  EXPECT_EQ(Streamed(), 0);
}

}  // namespace
}  // namespace cubetorchfs::fs
