#include "cache/cache_arena.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "cache/ram_cache.h"

namespace cubetorchfs::cache {
namespace {

constexpr uint64_t kReserve = uint64_t{1} << 30;

// Bytes the memfd holds (its pages written and not given back).
uint64_t Held(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

char Fill(const std::string& key, size_t i) {
  return static_cast<char>(std::hash<std::string>{}(key) + i * 131);
}

void FillBlock(char* p, const std::string& key, size_t size) {
  for (size_t i = 0; i < size; i += 512) p[i] = Fill(key, i);
  if (size > 0) p[size - 1] = Fill(key, size - 1);
}

bool BlockIs(const char* p, const std::string& key, size_t size) {
  for (size_t i = 0; i < size; i += 512)
    if (p[i] != Fill(key, i)) return false;
  return size == 0 || p[size - 1] == Fill(key, size - 1);
}

// What a dead process left: `published` blocks with records, others allocated and not, some
// published then retired. Returns a second descriptor of its memfd, as the supervisor holds
// it. The arena itself is kept, untouched, to the end of the tests: as a killed process's
// memory, nothing writes to it any more (a kill -9 through a real mount is
// tests/integration/test_crash.py's).
int ArenaOfDeadProcess(const std::map<std::string, size_t>& published,
                       const std::function<uint64_t(CacheArena&)>& more = {},
                       uint64_t* more_got = nullptr) {
  static std::vector<std::unique_ptr<CacheArena>> dead;
  auto arena = CacheArena::Create(kReserve);
  EXPECT_TRUE(arena.ok());
  if (!arena.ok()) return -1;
  CacheArena& a = **arena;
  int i = 0;
  for (const auto& [key, size] : published) {
    char* p = a.Allocate(size);
    EXPECT_NE(p, nullptr);
    FillBlock(p, key, size);
    EXPECT_NE(a.Publish(key, p, size), 0u);
    // Between them: blocks never published, and blocks published then retired and freed.
    char* q = a.Allocate(size);
    std::memset(q, 'u', size);
    if (i++ % 2 == 0) {
      a.Retire(a.Publish(std::string("gone/").append(key), q, size));
      a.Free(q);
    }
  }
  const uint64_t extra = more ? more(a) : 0;
  if (more_got != nullptr) *more_got = extra;
  const int fd = ::fcntl(a.fd(), F_DUPFD_CLOEXEC, 0);
  EXPECT_GE(fd, 0);
  dead.push_back(std::move(arena).value());
  return fd;
}

std::map<std::string, size_t> SomeFiles() {
  std::map<std::string, size_t> files;
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    const size_t size = i % 50 == 0  ? (size_t{1} << 20) + rng() % (3 << 20)  // large
                        : i % 5 == 0 ? 4096 + rng() % (200 << 10)             // page classes
                                     : 1 + rng() % 3000;                      // small
    files[std::string("train/n01/f").append(std::to_string(i)).append(".JPEG")] = size;
  }
  files["empty"] = 0;
  files[std::string(CacheArena::kMaxKey, 'k')] = 10;  // the longest key a record takes
  return files;
}

TEST(CacheArenaTest, AdoptsExactlyWhatTheDeadProcessPublished) {
  const std::map<std::string, size_t> files = SomeFiles();
  const int fd = ArenaOfDeadProcess(files);
  CacheArena::Adoption got;
  auto arena = CacheArena::Adopt(fd, &got);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(got.dropped, 0u);
  ASSERT_EQ(got.entries.size(), files.size());
  uint64_t bytes = 0;
  for (const CacheArena::Entry& e : got.entries) {
    ASSERT_EQ(files.count(e.key), 1u) << e.key.substr(0, 40);
    EXPECT_EQ(e.size, files.at(e.key));
    EXPECT_TRUE(BlockIs(e.data, e.key, e.size)) << e.key.substr(0, 40);
    bytes += e.size;
  }
  EXPECT_EQ(got.bytes, bytes);
  for (size_t i = 1; i < got.entries.size(); ++i)  // the latest published first
    ASSERT_GT(got.entries[i - 1].seq, got.entries[i].seq) << i;
  // What no record kept gave its pages back: the memfd holds about the published bytes.
  uint64_t blocks = 0;
  for (const auto& [key, size] : files)
    blocks += CacheArena::BlockBytes(size) + CacheArena::RecordBytes(key.size());
  EXPECT_LE(Held(fd), blocks * 3 / 2 + (uint64_t{4} << 20)) << blocks;

  // New blocks never land on adopted ones; freeing everything gives every span back.
  std::vector<std::pair<char*, std::string>> fresh;
  for (int i = 0; i < 3000; ++i) {
    const std::string key = std::string("new").append(std::to_string(i));
    const size_t size = i % 300 == 0 ? (size_t{2} << 20) : 1 + (i * 977) % 150000;
    char* p = (*arena)->Allocate(size);
    ASSERT_NE(p, nullptr);
    FillBlock(p, key, size);
    fresh.emplace_back(p, key);
  }
  for (const CacheArena::Entry& e : got.entries)
    EXPECT_TRUE(BlockIs(e.data, e.key, e.size)) << "overwritten: " << e.key.substr(0, 40);
  for (auto& [p, key] : fresh) (*arena)->Free(p);
  for (const CacheArena::Entry& e : got.entries) {
    (*arena)->Retire(e.record);
    (*arena)->Free(e.data);
  }
  EXPECT_EQ((*arena)->spans_used(), 0u);
  EXPECT_LE(Held(fd), uint64_t{4} << 20);  // the header and span table
}

TEST(CacheArenaTest, UnsoundRecordsAreDroppedAndClearedForGood) {
  uint64_t torn = 0;
  const int fd = ArenaOfDeadProcess(
      {{"a", 100}, {"b", 5000}, {"c", 70}},
      [](CacheArena& a) {
        char* p = a.Allocate(100);
        std::memset(p, 'x', 100);
        const uint64_t r = a.Publish("torn", p, 100);  // its key is written over below
        a.Publish("twice", p, 100);  // the same block: kept, as the torn one is not
        char* q = a.Allocate(50);
        a.Publish("one", q, 50);
        a.Publish("two", q, 50);  // claims a block claimed already
        return r;
      },
      &torn);
  ASSERT_NE(torn, 0u);
  const char x = 'X';  // a record's key begins kRecordHeader bytes into its block
  ASSERT_EQ(::pwrite(fd, &x, 1, static_cast<off_t>(torn + CacheArena::kRecordHeader)), 1);
  auto keys = [](const CacheArena::Adoption& got) {
    std::vector<std::string> k;
    for (const auto& e : got.entries) k.push_back(e.key);
    std::sort(k.begin(), k.end());
    return k;
  };
  const std::vector<std::string> kept = {"a", "b", "c", "one", "twice"};
  {
    CacheArena::Adoption got;
    auto arena = CacheArena::Adopt(::dup(fd), &got);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    EXPECT_EQ(keys(got), kept);
    EXPECT_EQ(got.dropped, 2u);
  }  // a crash of the adopter before it changed anything
  CacheArena::Adoption got;
  auto arena = CacheArena::Adopt(fd, &got);
  ASSERT_TRUE(arena.ok());
  EXPECT_EQ(keys(got), kept);
  EXPECT_EQ(got.dropped, 0u);  // cleared by the first adoption: not found again
}

TEST(CacheArenaTest, AnArenaOfAnotherFormIsRefused) {
  const int fd = ArenaOfDeadProcess({{"a", 10}});
  uint32_t bad = 0xdead;  // the layout word
  ASSERT_EQ(::pwrite(fd, &bad, sizeof bad, 8), static_cast<ssize_t>(sizeof bad));
  CacheArena::Adoption got;
  auto arena = CacheArena::Adopt(fd, &got);
  ASSERT_FALSE(arena.ok());
  EXPECT_NE(arena.status().message().find("another form"), std::string::npos);
  EXPECT_TRUE(got.entries.empty());
}

TEST(CacheArenaTest, ShrinkMovesToTheSmallerClassAndKeepsTheBytes) {
  auto arena = CacheArena::Create(kReserve);
  ASSERT_TRUE(arena.ok());
  CacheArena& a = **arena;
  for (size_t guess : {size_t{5000}, size_t{128} << 10, size_t{4} << 20}) {
    char* p = a.Allocate(guess);
    FillBlock(p, "k", guess);
    for (size_t n : {guess - 1, guess / 3, size_t{1000}}) {
      char* q = a.Shrink(p, guess, n);
      for (size_t i = 0; i < n; i += 512) ASSERT_EQ(q[i], Fill("k", i)) << guess << " " << n;
      p = q;
      guess = n;
      FillBlock(p, "k", n);
    }
    a.Free(p);
  }
  EXPECT_EQ(a.spans_used(), 0u);
  EXPECT_LE(Held(a.fd()), uint64_t{4} << 20);
}

TEST(CacheArenaTest, RefusesWhenTheReservationIsUsedUpAndRecovers) {
  auto arena = CacheArena::Create(16 * CacheArena::kSpan);
  ASSERT_TRUE(arena.ok());
  CacheArena& a = **arena;
  std::vector<char*> got;
  while (char* p = a.Allocate(2 << 20)) got.push_back(p);  // a span each
  EXPECT_FALSE(got.empty());
  EXPECT_EQ(a.Allocate(100), nullptr);
  EXPECT_GE(a.refused(), 2u);
  for (char* p : got) a.Free(p);
  EXPECT_NE(a.Allocate(100), nullptr);
}

// Many threads allocating, publishing, retiring and freeing at once (TSan's run).
TEST(CacheArenaTest, ConcurrentUse) {
  auto arena = CacheArena::Create(kReserve);
  ASSERT_TRUE(arena.ok());
  CacheArena& a = **arena;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&a, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<char*, uint64_t>> held;
      for (int i = 0; i < 4000; ++i) {
        const size_t size = rng() % 8 == 0 ? 1 + rng() % (256 << 10) : 1 + rng() % 4000;
        char* p = a.Allocate(size);
        ASSERT_NE(p, nullptr);
        p[0] = static_cast<char>(t);
        held.emplace_back(
            p, a.Publish(
                   std::string("t").append(std::to_string(t)).append("/").append(std::to_string(i)),
                   p, size));
        if (held.size() > 100) {
          const size_t k = rng() % held.size();
          ASSERT_EQ(held[k].first[0], static_cast<char>(t));
          a.Retire(held[k].second);
          a.Free(held[k].first);
          held.erase(held.begin() + static_cast<long>(k));
        }
      }
      for (auto& [p, r] : held) {
        a.Retire(r);
        a.Free(p);
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(a.spans_used(), 0u);
}

}  // namespace
}  // namespace cubetorchfs::cache
