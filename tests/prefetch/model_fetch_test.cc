#include "prefetch/model_fetch.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/test_util.h"

namespace cubetorchfs::prefetch {
namespace {

using testing::MemBackend;

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  uint32_t x = 12345;
  for (auto& c : s) {
    x = x * 1103515245 + 12345;
    c = static_cast<char>(x >> 16);
  }
  return s;
}

// 1 MiB chunks, `threads` parallel reads.
ModelFetcher::Options Opts(int threads = 8) {
  ModelFetcher::Options o;
  o.chunk_bytes = 1 << 20;
  o.threads = threads;
  return o;
}

std::unique_ptr<cache::RamCache> Ram() {
  cache::RamCache::Options o;
  o.capacity_bytes = 64 << 20;
  o.max_entry_bytes = 1 << 20;
  return cache::RamCache::New(o, nullptr);
}

TEST(ModelFetchTest, MakeResidentGivesASealedReadOnlyCopy) {
  MemBackend backend;
  const std::string data = Pattern((5 << 20) + 123);
  backend.AddDir("models");
  backend.PutFile("models/m.safetensors", data, 7);
  auto ram = Ram();
  ModelFetcher::Options o = Opts(4);
  ModelFetcher f(o, &backend, ram.get(), nullptr);
  // One chunk already in RAM: it is used, not fetched again.
  auto chunk2 = cache::Buffer::Allocate(1 << 20);
  std::memcpy(chunk2->data.get(), data.data() + (2 << 20), 1 << 20);
  ram->Insert(cache::ChunkKey("models/m.safetensors", {data.size(), 7}, 2), chunk2);

  Result<ResidentFile> r = f.MakeResident("models/m.safetensors");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->size, data.size());
  EXPECT_EQ(r->ram_bytes, 1u << 20);
  EXPECT_EQ(r->backend_bytes, data.size() - (1 << 20));
  std::string got(data.size(), '\0');
  ASSERT_EQ(::pread(r->fd, got.data(), got.size(), 0), static_cast<ssize_t>(got.size()));
  EXPECT_EQ(got, data);
  EXPECT_EQ(::pwrite(r->fd, "x", 1, 0), -1);  // read-only descriptor
  EXPECT_EQ(::fcntl(r->fd, F_GET_SEALS) & F_SEAL_WRITE, F_SEAL_WRITE);
  ::close(r->fd);

  EXPECT_NE(f.MakeResident("models/none.safetensors").status().message().find("no such file"),
            std::string::npos);
  EXPECT_EQ(f.MakeResident("models").status().code(), Status::Code::kInvalidArgument);
}

TEST(ModelFetchTest, PosixStoreHandsOverItsOwnFileUnlessInjecting) {
  const std::string root = ::testing::TempDir() + "ctfs_model_fetch_" + std::to_string(::getpid());
  std::filesystem::create_directories(root);
  const std::string data = Pattern((2 << 20) + 17);
  {
    std::ofstream out(root + "/m.safetensors", std::ios::binary);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
  }
  auto posix = cfs_client::NewPosixBackend(root);
  ASSERT_TRUE(posix.ok()) << posix.status().ToString();
  auto ram = Ram();
  ModelFetcher::Options o = Opts();
  ModelFetcher direct(o, posix->get(), ram.get(), nullptr);
  Result<ResidentFile> r = direct.MakeResident("m.safetensors");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->store_file);
  struct stat a, b;
  ASSERT_EQ(::fstat(r->fd, &a), 0);
  ASSERT_EQ(::stat((root + "/m.safetensors").c_str(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino);              // the store's file itself: no copy was made
  EXPECT_EQ(::pwrite(r->fd, "x", 1, 0), -1);  // read-only
  ::close(r->fd);
  // The caller's check runs on the file actually opened: refused, no descriptor, no copy.
  int asked = 0;
  Result<ResidentFile> refused =
      direct.MakeResident("m.safetensors", [&](const cfs_client::FileAttr& attr) -> Status {
        if (++asked == 2 && attr.IsRegular())  // the second ask: the opened descriptor's fstat
          return Status::PermissionDenied("not this file");
        return Status::OK();
      });
  EXPECT_EQ(refused.status().code(), Status::Code::kPermissionDenied);
  EXPECT_EQ(asked, 2);

  // With fault injection every byte must pass through the daemon: a memory copy.
  conf::InjectOptions inject;
  inject.latency_us = 1;
  auto injected = cfs_client::NewInjectBackend(std::move(posix).value(), inject, SystemClock());
  ModelFetcher copying(o, injected.get(), ram.get(), nullptr);
  r = copying.MakeResident("m.safetensors");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->store_file);
  EXPECT_EQ(::fcntl(r->fd, F_GET_SEALS) & F_SEAL_WRITE, F_SEAL_WRITE);
  std::string got(data.size(), '\0');
  ASSERT_EQ(::pread(r->fd, got.data(), got.size(), 0), static_cast<ssize_t>(got.size()));
  EXPECT_EQ(got, data);
  ::close(r->fd);
  std::filesystem::remove_all(root);
}

TEST(ModelFetchTest, ConcurrentRequestsShareOneBuild) {
  MemBackend backend;
  const std::string data = Pattern((3 << 20) + 5);
  backend.PutFile("m.safetensors", data, 3);
  auto ram = Ram();
  ModelFetcher::Options o = Opts(2);
  ModelFetcher f(o, &backend, ram.get(), nullptr);
  backend.CloseGate();  // the first build waits in the store
  Result<ResidentFile> a = Status::IOError("unset"), b = Status::IOError("unset");
  std::thread ta([&] { a = f.MakeResident("m.safetensors"); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (backend.reads() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::thread tb([&] { b = f.MakeResident("m.safetensors"); });
  // The gate opens only once b has joined a's build (a sleep would let b come after it).
  while (f.joined_builds() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(f.joined_builds(), 1u);
  backend.OpenGate();
  ta.join();
  tb.join();
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(backend.reads(), 4);  // 4 chunks read once, not twice
  EXPECT_NE(a->fd, b->fd);        // each its own descriptor of the same memory
  for (int fd : {a->fd, b->fd}) {
    std::string got(data.size(), '\0');
    ASSERT_EQ(::pread(fd, got.data(), got.size(), 0), static_cast<ssize_t>(got.size()));
    EXPECT_EQ(got, data);
    ::close(fd);
  }
  // Once built, a new request builds anew (nothing is retained by the daemon).
  Result<ResidentFile> c = f.MakeResident("m.safetensors");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(backend.reads(), 8);
  ::close(c->fd);
}

TEST(ModelFetchTest, FirstReadOfAModelFileFetchesItsChunksInParallel) {
  MemBackend backend;
  const std::string data = Pattern(6 << 20);
  backend.PutFile("m.safetensors", data, 1);
  backend.PutFile("other.bin", data, 1);
  auto ram = Ram();
  ModelFetcher::Options o = Opts(3);
  o.background_max_bytes = 4 << 20;  // at most 4 chunks from the read offset
  ModelFetcher f(o, &backend, ram.get(), nullptr);
  const cfs_client::FileVersion v{data.size(), 1};
  f.OnRead("other.bin", v, 0);  // not a model file
  EXPECT_EQ(f.background_chunks(), 0u);
  f.OnRead("m.safetensors", v, 1 << 20);
  f.OnRead("m.safetensors", v, 2 << 20);  // once per file version
  EXPECT_EQ(f.background_chunks(), 4u);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto cached = [&] {
    int n = 0;
    for (uint64_t c = 0; c < 6; ++c)
      n += ram->Get(cache::ChunkKey("m.safetensors", v, c)) != nullptr;
    return n;
  };
  while (cached() < 4 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(cached(), 4);
  EXPECT_EQ(ram->Get(cache::ChunkKey("m.safetensors", v, 0)), nullptr);  // before the offset
  EXPECT_NE(ram->Get(cache::ChunkKey("m.safetensors", v, 4)), nullptr);
}

}  // namespace
}  // namespace cubetorchfs::prefetch
