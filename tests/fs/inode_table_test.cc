#include "fs/inode_table.h"

#include <gtest/gtest.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <sys/stat.h>

#include <string>
#include <thread>
#include <vector>

namespace cubetorchfs::fs {
namespace {

cfs_client::FileAttr Attr(uint64_t size) {
  cfs_client::FileAttr a;
  a.mode = S_IFREG | 0644;
  a.size = size;
  return a;
}

TEST(InodeTableTest, SamePathSameInodeUntilForgotten) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  uint64_t a = t.Acquire("a", Attr(1), 10);
  EXPECT_EQ(t.Acquire("a", Attr(2), 20), a);
  EXPECT_EQ(t.lookups(a), 2u);
  EXPECT_EQ(t.Get(a)->attr.size, 2u);
  EXPECT_EQ(t.Get(a)->attr_time_ns, 20u);
  t.Forget(a, 1);
  EXPECT_TRUE(t.Get(a).has_value());
  t.Forget(a, 1);
  EXPECT_FALSE(t.Get(a).has_value());
  // A new lookup of the same path gets a new number: old numbers are never reused.
  uint64_t again = t.Acquire("a", Attr(1), 30);
  EXPECT_NE(again, a);
}

// What a store into the page cache checks: the inode the path names now, its version and
// write generation; nothing once the path names another inode, is removed or renamed.
TEST(InodeTableTest, PageStateFollowsThePath) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t a = t.Acquire("d/a", Attr(3), 10);
  std::optional<InodeTable::PageState> s = t.PageStateOf("d/a");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->ino, a);
  EXPECT_EQ(s->version, Attr(3).Version());
  EXPECT_TRUE(s->regular);
  EXPECT_EQ(t.PageStateOf("d/a", a)->write_gen, s->write_gen);
  t.BumpWriteGen(a);
  EXPECT_NE(t.PageStateOf("d/a", a)->write_gen, s->write_gen);
  EXPECT_FALSE(t.PageStateOf("d/b").has_value());
  EXPECT_FALSE(t.PageStateOf("d/b", a).has_value());  // `a` does not answer to d/b
  t.Rename("d/a", "d/c");
  EXPECT_FALSE(t.PageStateOf("d/a", a).has_value());
  EXPECT_EQ(t.PageStateOf("d/c")->ino, a);
  t.Remove("d/c");
  EXPECT_FALSE(t.PageStateOf("d/c", a).has_value());
  EXPECT_FALSE(t.PageStateOf("d/c").has_value());
}

cfs_client::FileAttr Linked(uint64_t store_ino, uint32_t nlink) {
  cfs_client::FileAttr a = Attr(5);
  a.store_dev = 7;
  a.store_ino = store_ino;
  a.nlink = nlink;
  return a;
}

TEST(InodeTableTest, HardLinksShareOneInode) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t a = t.Acquire("a", Linked(40, 1), 10);
  const uint64_t b = t.Acquire("d/b", Linked(40, 2), 20);
  EXPECT_EQ(b, a);
  EXPECT_EQ(t.lookups(a), 2u);
  EXPECT_EQ(t.Get(a)->attr.nlink, 2u);
  EXPECT_EQ(*t.Find("d/b"), a);
  EXPECT_EQ(t.OtherName(a, "a"), "d/b");
  EXPECT_EQ(t.OtherName(a, "d/b"), "a");
  // Another file, and a file of one link with a reused identity, are inodes of their own.
  EXPECT_NE(t.Acquire("c", Linked(41, 2), 30), a);
  EXPECT_NE(t.Acquire("e", Linked(40, 1), 30), a);

  // A directory rename carries the link under it; the first name's removal leaves the other.
  t.Rename("d", "dd");
  EXPECT_EQ(*t.Find("dd/b"), a);
  EXPECT_FALSE(t.Find("d/b").has_value());
  EXPECT_EQ(t.Remove("a"), "dd/b");
  EXPECT_EQ(t.Get(a)->path, "dd/b");
  EXPECT_FALSE(t.Get(a)->removed);
  EXPECT_EQ(t.Get(a)->attr.nlink, 1u);
  EXPECT_EQ(t.Get(a)->attr_time_ns, 0u);  // its ctime moved: asked of the store again
  EXPECT_FALSE(t.OtherName(a, "dd/b").has_value());
  // The last name's removal leaves the inode to the kernel's references only.
  EXPECT_FALSE(t.Remove("dd/b").has_value());
  EXPECT_TRUE(t.Get(a)->removed);
  EXPECT_FALSE(t.Find("dd/b").has_value());
}

TEST(InodeTableTest, ForgettingALinkedInodeDropsAllItsNames) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t a = t.Acquire("a", Linked(40, 2), 10);
  ASSERT_EQ(t.Acquire("b", Linked(40, 2), 10), a);
  t.Forget(a, 2);
  EXPECT_FALSE(t.Find("a").has_value());
  EXPECT_FALSE(t.Find("b").has_value());
  const uint64_t again = t.Acquire("b", Linked(40, 2), 20);
  EXPECT_NE(again, a);
  EXPECT_EQ(t.Acquire("a", Linked(40, 2), 20), again);
  EXPECT_EQ(t.size(), 2u);  // the root and the one file
}

TEST(InodeTableTest, RootIsPermanent) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  t.Forget(kRootIno, 1000);
  ASSERT_TRUE(t.Get(kRootIno).has_value());
  EXPECT_EQ(t.Get(kRootIno)->path, "");
}

TEST(InodeTableTest, OverForgetAndUnknownInodesAreCountedAndSurvived) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  uint64_t a = t.Acquire("a", Attr(1), 0);
  uint64_t b = t.Acquire("b", Attr(1), 0);
  t.Acquire("b", Attr(1), 0);
  t.Forget(b, 2);  // exactly what it has: fine
  EXPECT_EQ(t.bad_forgets(), 0u);
  t.Forget(a, 5);
  EXPECT_FALSE(t.Get(a).has_value());
  EXPECT_EQ(t.bad_forgets(), 1u);
  t.Forget(12345, 1);
  EXPECT_EQ(t.bad_forgets(), 2u);
  EXPECT_EQ(t.size(), 1u);
}

TEST(InodeTableTest, OpenedVersionIsRemembered) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  uint64_t a = t.Acquire("a", Attr(1), 0);
  EXPECT_FALSE(t.SetOpenedVersion(a, {1, 5}).has_value());
  EXPECT_EQ(t.SetOpenedVersion(a, {2, 6}).value(), (cfs_client::FileVersion{1, 5}));
}

// A rename visits what it moves and nothing else, however many paths the table knows: a
// checkpoint's "x.tmp" -> "x" among 1.28 M known files costs one entry, not a walk.
TEST(InodeTableTest, RenameVisitsOnlyWhatItMoves) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  cfs_client::FileAttr dir{S_IFDIR | 0755};
  for (int d = 0; d < 20; ++d) {
    std::string name = "n";
    name += std::to_string(1000 + d);
    t.Acquire(name, dir, 1);
    for (int f = 0; f < 500; ++f) {
      std::string file = name;
      file += "/f";
      file += std::to_string(f);
      t.Acquire(file, Attr(1), 1);
    }
  }
  // Neighbours in the order of paths: "n1005.tmp" and "n1005x" sort around "n1005/".
  const uint64_t tmp = t.Acquire("n1005.tmp", Attr(3), 1);
  const uint64_t next = t.Acquire("n1005x", Attr(4), 1);
  ASSERT_EQ(t.size(), 1u + 20 * 501 + 2);
  t.Rename("n1005.tmp", "ckpt");
  uint64_t visits = t.rename_visits();
  EXPECT_LE(visits, 2u);  // the file, and the first path after "n1005.tmp/"
  EXPECT_EQ(*t.Find("ckpt"), tmp);
  // A directory moves with its 500 known entries, and only them.
  const uint64_t f7 = *t.Find("n1005/f7");
  t.Rename("n1005", "m");
  EXPECT_LE(t.rename_visits() - visits, 1u + 500 + 1);  // the directory, its files, the next
  visits = t.rename_visits();
  EXPECT_EQ(*t.Find("m/f7"), f7);
  EXPECT_EQ(t.Get(f7)->path, "m/f7");
  EXPECT_FALSE(t.Find("n1005/f7").has_value());
  EXPECT_EQ(*t.Find("n1005x"), next);  // a sibling whose name starts the same stays
  // Renaming a file over another removes the replaced one's entry, still without a walk.
  t.Rename("ckpt", "n1006/f7");
  EXPECT_LE(t.rename_visits() - visits, 2u);
  EXPECT_EQ(*t.Find("n1006/f7"), tmp);
}

// The cubetorchfs_inodes gauge follows the table: it grows with lookups and shrinks when the
// kernel forgets.
TEST(InodeTableTest, SizeGaugeFollowsLookupsAndForgets) {
  prometheus::Registry registry;
  prometheus::Gauge& g = prometheus::BuildGauge().Name("g").Register(registry).Add({});
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  t.SetSizeGauge(&g);
  EXPECT_EQ(g.Value(), 1);  // the root
  const uint64_t a = t.Acquire("a", Attr(1), 1);
  t.Acquire("a", Attr(1), 1);
  const uint64_t b = t.Acquire("b", Attr(1), 1);
  EXPECT_EQ(g.Value(), 3);
  t.Forget(a, 1);
  EXPECT_EQ(g.Value(), 3);  // one lookup of a is left
  t.Forget(a, 1);
  t.Forget(b, 1);
  EXPECT_EQ(g.Value(), 1);
}

}  // namespace
}  // namespace cubetorchfs::fs

namespace cubetorchfs::fs {
namespace {

TEST(InodeTableTest, SerializedTableRestoresEveryNumberPathCountAndLink) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t dir = t.Acquire("d", cfs_client::FileAttr{S_IFDIR | 0755}, 1);
  const uint64_t a = t.Acquire("d/a", Attr(3), 2);
  t.Acquire("d/a", Attr(3), 3);
  const uint64_t l1 = t.Acquire("x", Linked(9, 2), 4);
  EXPECT_EQ(t.Acquire("y", Linked(9, 2), 5), l1);
  const uint64_t gone = t.Acquire("gone", Attr(1), 6);
  t.Remove("gone");
  t.SetOpenedVersion(a, {3, 77});

  InodeTable u(cfs_client::FileAttr{S_IFDIR | 0700}, 0);
  ASSERT_TRUE(u.Restore(t.Serialize()).ok());
  EXPECT_EQ(u.size(), t.size());
  EXPECT_EQ(u.Find("d"), dir);
  EXPECT_EQ(u.Find("d/a"), a);
  EXPECT_EQ(u.lookups(a), 2u);
  EXPECT_EQ(u.Get(a)->attr.size, 3u);
  EXPECT_EQ(u.Get(a)->attr_time_ns, 3u);
  EXPECT_EQ(u.Get(a)->opened_version->mtime_ns, 77);
  EXPECT_EQ(u.Find("y"), l1);
  EXPECT_EQ(u.OtherName(l1, "x"), "y");
  EXPECT_TRUE(u.Get(gone)->removed);
  EXPECT_FALSE(u.Find("gone").has_value());
  EXPECT_EQ(u.Get(kRootIno)->attr.mode, static_cast<mode_t>(S_IFDIR | 0755));
  // New numbers continue above the old ones; the kernel's references are honoured.
  EXPECT_GT(u.Acquire("new", Attr(1), 7), gone);
  u.Forget(a, 2);
  EXPECT_FALSE(u.Get(a).has_value());
  EXPECT_EQ(u.bad_forgets(), 0u);
}

TEST(InodeTableTest, RestoreRefusesBytesItCannotReadAndKeepsTheTable) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  t.Acquire("a", Attr(1), 1);
  const std::string good = t.Serialize();
  InodeTable u(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t mine = u.Acquire("mine", Attr(1), 1);
  for (size_t cut : {size_t{0}, size_t{7}, size_t{30}, good.size() - 1})
    EXPECT_FALSE(u.Restore(good.substr(0, cut)).ok()) << cut;
  std::string bad_magic = good;
  bad_magic[0] ^= 1;
  EXPECT_FALSE(u.Restore(bad_magic).ok());
  EXPECT_FALSE(u.Restore(good + "x").ok());
  EXPECT_EQ(u.Find("mine"), mine);
}

TEST(InodeTableTest, LaterGenerationNumbersAreAboveEarlierOnesAndTheirForgetsAreQuiet) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  t.SetGeneration(3);
  const uint64_t a = t.Acquire("a", Attr(1), 1);
  EXPECT_EQ(a, (uint64_t{3} << 40) + 2);
  t.Forget(5, 1);  // an inode of a process before a crash: not handed over, not an error
  EXPECT_EQ(t.bad_forgets(), 0u);
  t.Forget(a + 100, 1);  // a number this process never gave out: a broken contract
  EXPECT_EQ(t.bad_forgets(), 1u);
}

// Lookups, forgets, attribute reads and renames from many threads at once (the shards and the
// names' reader-writer lock; TSan runs this too): every count and name comes out exact.
TEST(InodeTableTest, ConcurrentLookupsForgetsAndRenamesKeepCountsAndNames) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  constexpr int kThreads = 4, kFiles = 200, kRounds = 50;
  std::vector<uint64_t> inos(kFiles);
  for (int f = 0; f < kFiles; ++f) inos[f] = t.Acquire("d/f" + std::to_string(f), Attr(1), 1);
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k)
    threads.emplace_back([&t, &inos, k] {
      for (int r = 0; r < kRounds; ++r)
        for (int f = k; f < kFiles; f += 1) {
          const std::string path = "d/f" + std::to_string(f);
          const uint64_t ino = t.Acquire(path, Attr(1), 2);
          EXPECT_EQ(ino, inos[f]);
          EXPECT_TRUE(t.Get(ino).has_value());
          EXPECT_TRUE(t.AttrOf(path).has_value());
          t.SetAttr(ino, Attr(1), 3);
          t.Forget(ino, 1);
          // A name that comes and goes beside them.
          const std::string own = "own" + std::to_string(k) + "/x";
          const uint64_t mine = t.Acquire(own, Attr(1), 2);
          t.Rename(own, "own" + std::to_string(k) + "/y");
          EXPECT_EQ(t.Find("own" + std::to_string(k) + "/y"), mine);
          t.Forget(mine, 1);
        }
    });
  for (std::thread& th : threads) th.join();
  for (int f = 0; f < kFiles; ++f) EXPECT_EQ(t.lookups(inos[f]), 1u) << f;
  EXPECT_EQ(t.size(), static_cast<size_t>(kFiles) + 1);  // the root, the files, no leftovers
  EXPECT_EQ(t.bad_forgets(), 0u);
}

}  // namespace
}  // namespace cubetorchfs::fs
