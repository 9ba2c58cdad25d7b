#include "fs/inode_table.h"

#include <gtest/gtest.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <set>
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

// An inode number names one store object: a name found holding another (swapped in behind the
// mount) gets a new inode, and the number the kernel holds keeps the object it checked, removed;
// names under a directory swapped so stay with the directory they were found in.
TEST(InodeTableTest, ANameHoldingAnotherObjectIsANewInode) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  auto dir = [](uint64_t store_ino) {
    cfs_client::FileAttr a;
    a.mode = S_IFDIR | 0755;
    a.store_dev = 3;
    a.store_ino = store_ino;
    return a;
  };
  cfs_client::FileAttr f = Attr(4);
  f.store_dev = 3;
  f.store_ino = 100;
  const uint64_t x = t.Acquire("x", dir(10), 1);
  const uint64_t xf = t.Acquire("x/f", f, 1);
  EXPECT_EQ(t.Acquire("x", dir(10), 2), x);  // the same object: the same inode
  EXPECT_EQ(t.AttrOf("x/f")->dir_id, dir(10).StoreId());
  const uint64_t swapped = t.Acquire("x", dir(20), 3);
  EXPECT_NE(swapped, x);
  ASSERT_TRUE(t.Get(x).has_value());
  EXPECT_TRUE(t.Get(x)->removed);
  EXPECT_EQ(t.Get(x)->attr.store_ino, 10u);
  EXPECT_EQ(t.Get(swapped)->attr.store_ino, 20u);
  EXPECT_FALSE(t.Find("x/f").has_value());  // not a name in the new directory
  EXPECT_EQ(t.Get(xf)->path, "x/f");        // still the old one's, for its own checks
  cfs_client::FileAttr g = f;
  g.store_ino = 200;
  const uint64_t pf = t.Acquire("x/f", g, 4);
  EXPECT_NE(pf, xf);
  EXPECT_EQ(t.AttrOf("x/f")->dir_id, dir(20).StoreId());
  // A store without identities keeps one inode per name, as before.
  const uint64_t plain = t.Acquire("y", Attr(1), 5);
  EXPECT_EQ(t.Acquire("y", Attr(2), 6), plain);
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
  t.SetAttr(a, Linked(40, 2), 15);  // what link(2) through the mount reports of the file
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
  EXPECT_EQ(t.SetOpenedVersion(a, {1, 5}), InodeTable::OpenedBefore::kNever);
  EXPECT_EQ(t.SetOpenedVersion(a, {1, 5}), InodeTable::OpenedBefore::kSameVersion);
  EXPECT_EQ(t.SetOpenedVersion(a, {2, 6}), InodeTable::OpenedBefore::kOtherVersion);
  EXPECT_EQ(t.SetOpenedVersion(a, {2, 6}), InodeTable::OpenedBefore::kSameVersion);
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
  // A directory moves as one entry: what is under it follows its name.
  const uint64_t f7 = *t.Find("n1005/f7");
  t.Rename("n1005", "m");
  EXPECT_LE(t.rename_visits() - visits, 1u);
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
  EXPECT_EQ(u.SetOpenedVersion(a, {3, 77}), InodeTable::OpenedBefore::kSameVersion);
  EXPECT_EQ(u.Find("y"), l1);
  EXPECT_EQ(u.OtherName(l1, "x"), "y");
  EXPECT_TRUE(u.Get(gone)->removed);
  EXPECT_FALSE(u.Find("gone").has_value());
  EXPECT_EQ(u.Get(kRootIno)->attr.mode, static_cast<mode_t>(S_IFDIR | 0755));
  // New numbers are none of the old ones; the kernel's references are honoured.
  const uint64_t fresh = u.Acquire("new", Attr(1), 7);
  for (uint64_t old : {dir, a, l1, gone, kRootIno}) EXPECT_NE(fresh, old);
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
  EXPECT_EQ(a, (uint64_t{3} << InodeTable::kGenerationShift) + 2);
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

#include <malloc.h>

#include "common/snapshot_bytes.h"

namespace cubetorchfs::fs {
namespace {

// A name under directories the kernel never looked up gets bare records for them: they are
// not inodes the kernel knows, they carry its path, and they go with the last name under them.
TEST(InodeTableTest, NamesUnderUnknownDirectoriesKeepTheirPathAndLeaveNothingBehind) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t c = t.Acquire("a/b/c", Attr(1), 1);
  EXPECT_EQ(t.Get(c)->path, "a/b/c");
  EXPECT_FALSE(t.Find("a").has_value());
  EXPECT_FALSE(t.Find("a/b").has_value());
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(t.records(), 4u);
  const uint64_t a = t.Acquire("a", cfs_client::FileAttr{S_IFDIR | 0700}, 2);
  EXPECT_EQ(t.Find("a"), a);
  EXPECT_EQ(t.Get(a)->attr.mode, static_cast<mode_t>(S_IFDIR | 0700));
  t.Forget(a, 1);  // "a" is forgotten but "a/b/c" still known: its record stays, unnumbered
  EXPECT_FALSE(t.Get(a).has_value());
  EXPECT_EQ(t.Get(c)->path, "a/b/c");
  const uint64_t a2 = t.Acquire("a", cfs_client::FileAttr{S_IFDIR | 0700}, 3);
  EXPECT_NE(a2, a);  // a forgotten number is not given again
  t.Forget(a2, 1);
  t.Forget(c, 1);
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.records(), 1u);
  EXPECT_EQ(t.bad_forgets(), 0u);
}

// Renaming a directory moves one record; every file under it gets a newer write generation
// (handles opened by the old path look up the new one) and the new path.
TEST(InodeTableTest, ADirectoryRenameGivesEverythingUnderItANewPathAndGeneration) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  t.Acquire("d", cfs_client::FileAttr{S_IFDIR | 0755}, 1);
  const uint64_t f = t.Acquire("d/e/f", Attr(1), 1);
  const uint64_t other = t.Acquire("x/y", Attr(1), 1);
  const uint64_t gen = t.Get(f)->write_gen;
  const uint64_t other_gen = t.Get(other)->write_gen;
  t.Rename("d", "z/dd");
  EXPECT_EQ(t.Get(f)->path, "z/dd/e/f");
  EXPECT_GT(t.Get(f)->write_gen, gen);
  EXPECT_GT(t.PageStateOf("z/dd/e/f", f)->write_gen, gen);
  EXPECT_EQ(t.Get(other)->write_gen, other_gen);  // not under it: untouched
  EXPECT_FALSE(t.Find("d/e/f").has_value());
  EXPECT_EQ(t.Find("z/dd/e/f"), f);
  // A file moved out of a directory whose generation was high still gets a newer one.
  const uint64_t before = t.Get(f)->write_gen;
  t.Rename("z/dd/e/f", "top");
  EXPECT_GT(t.Get(f)->write_gen, before);
  EXPECT_EQ(t.Get(f)->path, "top");
}

// A slot is used again once its inode is forgotten, always under a number never given before.
TEST(InodeTableTest, ReusedSlotsNeverReuseANumber) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  std::set<uint64_t> seen;
  for (int k = 0; k < 1000; ++k) {
    std::string name = "f";
    name += std::to_string(k % 7);
    const uint64_t ino = t.Acquire(name, Attr(1), 1);
    EXPECT_TRUE(seen.insert(ino).second) << ino;
    t.Forget(ino, 1);
    EXPECT_FALSE(t.Get(ino).has_value());
  }
  EXPECT_EQ(t.records(), 1u);
  EXPECT_EQ(t.bad_forgets(), 0u);
}

// An upgrade from a version that kept the table by path: its snapshot is read, and every
// number, count, name, link and removal in it holds.
TEST(InodeTableTest, RestoresThePathKeyedTableOfTheVersionsBefore) {
  auto node = [](std::string* out, uint64_t ino, uint64_t nlookup, bool removed,
                 const cfs_client::FileAttr& a, const std::string& path,
                 const std::vector<std::string>& others) {
    for (uint64_t v :
         {ino,         nlookup,      uint64_t{removed}, uint64_t{0}, uint64_t{9},       uint64_t{1},
          a.size,      uint64_t{44}, uint64_t{a.mode},  a.size,      uint64_t{a.nlink}, uint64_t{0},
          uint64_t{0}, uint64_t{0},  uint64_t{44},      uint64_t{0}, uint64_t{0},       uint64_t{0},
          a.store_dev, a.store_ino})
      PutU64(out, v);
    PutString(out, path);
    PutU64(out, others.size());
    for (const std::string& o : others) PutString(out, o);
  };
  std::string bytes;
  PutU64(&bytes, 0x31544E49'53465443ull);
  PutU64(&bytes, (uint64_t{2} << 40) + 100);
  PutU64(&bytes, 5);
  const uint64_t base = uint64_t{2} << 40;
  cfs_client::FileAttr file = Attr(3);
  file.mtime_ns = 44;
  node(&bytes, base + 7, 2, false, file, "train/n1/img_1.JPEG", {});
  node(&bytes, 1, 1, false, cfs_client::FileAttr{S_IFDIR | 0755}, "", {});
  node(&bytes, base + 3, 1, false, cfs_client::FileAttr{S_IFDIR | 0755}, "train", {});
  node(&bytes, base + 9, 1, false, Linked(5, 2), "l1", {"train/l2"});
  node(&bytes, base + 11, 1, true, Attr(1), "gone", {});
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  t.SetGeneration(3);
  ASSERT_TRUE(t.Restore(bytes).ok());
  EXPECT_EQ(t.size(), 5u);
  EXPECT_EQ(t.Find("train/n1/img_1.JPEG"), base + 7);
  EXPECT_FALSE(t.Find("train/n1").has_value());  // never looked up: a bare record
  EXPECT_EQ(t.Find("train"), base + 3);
  EXPECT_EQ(t.lookups(base + 7), 2u);
  EXPECT_EQ(t.Get(base + 7)->path, "train/n1/img_1.JPEG");
  EXPECT_EQ(t.SetOpenedVersion(base + 7, file.Version()), InodeTable::OpenedBefore::kSameVersion);
  EXPECT_EQ(t.Find("train/l2"), base + 9);
  EXPECT_EQ(t.OtherName(base + 9, "l1"), "train/l2");
  EXPECT_TRUE(t.Get(base + 11)->removed);
  EXPECT_EQ(t.Get(base + 11)->path, "gone");
  // The restored table is handed on again in this version's form, numbers and all.
  InodeTable u(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  u.SetGeneration(4);
  ASSERT_TRUE(u.Restore(t.Serialize()).ok());
  EXPECT_EQ(u.Find("train/n1/img_1.JPEG"), base + 7);
  EXPECT_EQ(u.Get(base + 9)->path, "l1");
  for (uint64_t ino : {base + 7, base + 3, base + 9, base + 11})
    u.Forget(ino, ino == base + 7 ? 2 : 1);
  EXPECT_EQ(u.bad_forgets(), 0u);
  EXPECT_EQ(u.size(), 1u);
  EXPECT_EQ(u.records(), 1u);
}

// The prefetcher's page-resident mark lives in the inode's record: set only on a live inode,
// counted, and gone when the kernel forgets the inode (as its pages are).
TEST(InodeTableTest, AMarkGoesWithItsInode) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  EXPECT_FALSE(t.SetMark("d/a", 5));  // the kernel knows no such inode
  const uint64_t a = t.Acquire("d/a", Attr(3), 1);
  const uint64_t b = t.Acquire("d/b", Attr(3), 1);
  EXPECT_TRUE(t.SetMark("d/a", 5));
  EXPECT_TRUE(t.SetMark("d/b", 6));
  EXPECT_TRUE(t.SetMark("d/b", 7));
  EXPECT_EQ(t.marks(), 2u);
  EXPECT_EQ(t.AttrOf("d/a")->mark, 5u);
  EXPECT_EQ(t.AttrOf("d/b")->mark, 7u);
  EXPECT_TRUE(t.SetMark("d/b", 0));
  EXPECT_EQ(t.marks(), 1u);
  t.Forget(a, 1);
  EXPECT_EQ(t.marks(), 0u);
  // Looked up again: a new inode, unmarked (the kernel holds none of its pages).
  t.Acquire("d/a", Attr(3), 2);
  EXPECT_EQ(t.AttrOf("d/a")->mark, 0u);
  t.Forget(b, 1);
  EXPECT_FALSE(t.SetMark("d/b", 9));
}

// Block counts are kept as which formula gives them (512- or 4096-byte blocks of the size,
// or none), others beside the record; every kind comes back, through a handover too.
TEST(InodeTableTest, BlockCountsOfEveryKindComeBack) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  struct Case {
    uint64_t size, blocks;
  };
  const std::vector<Case> cases = {{0, 0},          {1, 1},      {1, 8},    {5000, 0},
                                   {5000, 10},      {5000, 16},  {5000, 7}, {4096, 4096},
                                   {UINT64_MAX, 1}, {1 << 30, 2}};
  std::vector<uint64_t> inos;
  for (size_t k = 0; k < cases.size(); ++k) {
    cfs_client::FileAttr a = Attr(cases[k].size);
    a.blocks = cases[k].blocks;
    std::string name = "f";
    name += std::to_string(k);
    inos.push_back(t.Acquire(name, a, 1));
  }
  InodeTable u(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  ASSERT_TRUE(u.Restore(t.Serialize()).ok());
  for (size_t k = 0; k < cases.size(); ++k) {
    for (const InodeTable* table : {&t, &u}) {
      std::optional<InodeInfo> got = table->Get(inos[k]);
      ASSERT_TRUE(got);
      EXPECT_EQ(got->attr.blocks, cases[k].blocks) << k;
      EXPECT_EQ(got->attr.size, cases[k].size) << k;
      EXPECT_EQ(got->attr.mode, static_cast<mode_t>(S_IFREG | 0644)) << k;
    }
  }
  // A count that changes kind, both ways.
  cfs_client::FileAttr a = Attr(5000);
  a.blocks = 7;
  t.SetAttr(inos[4], a, 2);
  EXPECT_EQ(t.Get(inos[4])->attr.blocks, 7u);
  a.blocks = 16;
  t.SetAttr(inos[6], a, 2);
  EXPECT_EQ(t.Get(inos[6])->attr.blocks, 16u);
  t.Forget(inos[4], 1);
  EXPECT_FALSE(t.Get(inos[4]));
}

// A process that dies leaves its records in the table's memfd; the next adopts them: every
// inode number the kernel holds names the same file, with its counts, attributes and mark.
TEST(InodeTableTest, TheNextProcessAdoptsTheRecordsADeadOneLeft) {
  InodeTable old(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  ASSERT_GE(old.durable_fd(), 0);
  const std::string long_name(200, 'x');
  const uint64_t a = old.Acquire("train/c1/a.jpg", Attr(100), 5);
  old.Acquire("train/c1/a.jpg", Attr(100), 6);
  const uint64_t b = old.Acquire("train/c2/" + long_name, Attr(200), 7);
  const uint64_t c = old.Acquire("train/c2/old", Attr(300), 8);
  old.Rename("train/c2/old", "train/c1/renamed-to-a-name-longer-than-23");
  const uint64_t gone = old.Acquire("train/gone", Attr(1), 9);
  old.Remove("train/gone");  // open still: the kernel holds it
  const uint64_t forgotten = old.Acquire("train/forgotten", Attr(1), 9);
  old.Forget(forgotten, 1);
  // A forget to zero whose record had not gone yet when the process died.
  const uint64_t half_forgotten =
      old.Acquire("train/deep/half-forgotten-with-a-long-name", Attr(1), 9);
  old.MarkForgottenForTest(half_forgotten);
  ASSERT_TRUE(old.SetMark("train/c1/a.jpg", 42));

  InodeTable next(cfs_client::FileAttr{S_IFDIR | 0700}, 0);
  next.SetGeneration(1);
  Result<InodeTable::Adopted> r = next.AdoptDurable(::dup(old.durable_fd()));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dropped, 0u);
  EXPECT_EQ(next.Get(a)->path, "train/c1/a.jpg");
  EXPECT_EQ(next.lookups(a), 2u);
  EXPECT_EQ(next.Get(a)->attr.size, 100u);
  EXPECT_EQ(next.Get(a)->attr_time_ns, 6u);
  EXPECT_EQ(next.AttrOf("train/c1/a.jpg")->mark, 42u);
  EXPECT_EQ(next.Get(b)->path, "train/c2/" + long_name);
  EXPECT_EQ(next.Get(c)->path, "train/c1/renamed-to-a-name-longer-than-23");
  EXPECT_TRUE(next.Get(gone)->removed);
  EXPECT_FALSE(next.Get(forgotten));
  EXPECT_FALSE(next.Get(half_forgotten));
  EXPECT_FALSE(next.Find("train/deep/half-forgotten-with-a-long-name"));
  EXPECT_EQ(next.records(), old.records() - 2);  // it and its directory, which nothing holds
  EXPECT_EQ(next.Find("train/c1/a.jpg"), a);
  EXPECT_EQ(next.size(), old.size() - 1);  // the old table still counts half_forgotten
  EXPECT_EQ(next.marks(), 1u);
  // New names get numbers of the new generation, and their names blocks of their own.
  std::vector<uint64_t> fresh;
  for (int k = 0; k < 100; ++k)
    fresh.push_back(next.Acquire("train/c3/" + std::string(40 + k, 'y'), Attr(k), 10));
  for (int k = 0; k < 100; ++k) {
    EXPECT_GE(fresh[k], uint64_t{1} << InodeTable::kGenerationShift);
    EXPECT_EQ(next.Get(fresh[k])->path, "train/c3/" + std::string(40 + k, 'y'));
  }
  EXPECT_EQ(next.Get(b)->path, "train/c2/" + long_name);
  EXPECT_EQ(next.Get(c)->path, "train/c1/renamed-to-a-name-longer-than-23");
  next.Forget(a, 2);
  EXPECT_FALSE(next.Get(a));
  EXPECT_EQ(next.bad_forgets(), 0u);
}

// What a death in the middle of a change leaves: a record being renamed is dropped with what
// lies under it, and so is a file open for writing (its unflushed bytes died); one whose
// attributes were being written is kept, to be asked again.
TEST(InodeTableTest, RecordsBeingChangedWhenTheProcessDiedAreDroppedOrExpired) {
  InodeTable old(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t dir = old.Acquire("d", cfs_client::FileAttr{S_IFDIR | 0755}, 5);
  const uint64_t under = old.Acquire("d/e/f", Attr(1), 5);
  const uint64_t torn = old.Acquire("x", Attr(2), 5);
  const uint64_t kept = old.Acquire("y", Attr(3), 5);
  const uint64_t written = old.Acquire("w", Attr(4), 5);
  const uint64_t closed = old.Acquire("v", Attr(4), 5);
  old.SetWriting(written, true);
  old.SetWriting(closed, true);
  old.SetWriting(closed, false);
  old.MarkBusyForTest(dir, /*name=*/true);
  old.MarkBusyForTest(torn, /*name=*/false);

  InodeTable next(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  next.SetGeneration(1);
  Result<InodeTable::Adopted> r = next.AdoptDurable(::dup(old.durable_fd()));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dropped, 4u);  // d, d/e, d/e/f, and w: open for writing
  EXPECT_FALSE(next.Get(written));
  EXPECT_TRUE(next.Get(closed));
  EXPECT_EQ(r->expired, 1u);
  EXPECT_FALSE(next.Get(dir));
  EXPECT_FALSE(next.Get(under));
  EXPECT_FALSE(next.Find("d/e/f"));
  EXPECT_EQ(next.Get(torn)->attr_time_ns, 0u);
  EXPECT_EQ(next.Get(kept)->attr_time_ns, 5u);
  // The kernel's forgets of what was dropped are an earlier process's numbers: no error.
  next.Forget(under, 1);
  EXPECT_EQ(next.bad_forgets(), 0u);
  // The names come back as new inodes.
  const uint64_t again = next.Acquire("d/e/f", Attr(1), 6);
  EXPECT_NE(again, under);
  EXPECT_EQ(next.Get(again)->path, "d/e/f");
}

// A memfd that is not a table of this form is refused, and the table stays as it was.
TEST(InodeTableTest, AMemfdOfAnotherFormIsRefused) {
  InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  const uint64_t a = t.Acquire("a", Attr(1), 5);
  const int small = ::memfd_create("x", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(small, 4096), 0);
  EXPECT_FALSE(t.AdoptDurable(small).ok());
  InodeTable other(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
  // The right size, the wrong header.
  char* p = static_cast<char*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, other.durable_fd(), 0));
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 0x5a, 64);
  ::munmap(p, 4096);
  Result<InodeTable::Adopted> r = t.AdoptDurable(::dup(other.durable_fd()));
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(t.Get(a)->path, "a");
}

// The pages of shared memory this process has touched: the table's region (its records).
size_t RssShmemBytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  size_t kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "RssShmem: %zu kB", &kib) == 1) break;
  std::fclose(f);
  return kib << 10;
}

// What a known file costs, counted by malloc and by the shared pages of the table's region:
// ImageNet-like names (20-byte file names in directories of 1,300), all of the table's
// structures included, the page-resident mark too.
TEST(InodeTableTest, AKnownMarkedFileCostsAtMost150Bytes) {
  constexpr int kFiles = 200000;
  const size_t before = mallinfo2().uordblks + mallinfo2().hblkhd + RssShmemBytes();
  {
    InodeTable t(cfs_client::FileAttr{S_IFDIR | 0755}, 0);
    cfs_client::FileAttr a = Attr(110 << 10);
    a.blocks = 224;  // as ext4 counts it
    a.store_dev = 64769;
    char path[96];
    for (int k = 0; k < kFiles; ++k) {
      a.store_ino = 1000 + k;
      std::snprintf(path, sizeof path, "train/n%08d/n%08d_%d.JPEG", k / 1300, k / 1300, k);
      t.Acquire(path, a, 1);
      ASSERT_TRUE(t.SetMark(path, 1 + k));
    }
    const size_t held = mallinfo2().uordblks + mallinfo2().hblkhd + RssShmemBytes() - before;
    const double per_file = static_cast<double>(held) / kFiles;
    ASSERT_GT(held, static_cast<size_t>(kFiles) * 136);  // the records are counted
    std::printf(
        "%d known files: %.1f bytes each by malloc and shared pages, %.1f by the "
        "table's own count\n",
        kFiles, per_file, static_cast<double>(t.bytes()) / kFiles);
    EXPECT_LE(per_file, 150.0);
    EXPECT_EQ(t.size(), static_cast<size_t>(kFiles) + 1);
    EXPECT_EQ(t.marks(), static_cast<size_t>(kFiles));
  }
}

}  // namespace
}  // namespace cubetorchfs::fs
