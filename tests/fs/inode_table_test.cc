#include "fs/inode_table.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

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

}  // namespace
}  // namespace cubetorchfs::fs
