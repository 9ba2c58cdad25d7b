#include "common/mapped_buffer.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

namespace cubetorchfs {
namespace {

// Bytes appended in pieces across many growths come back whole; capacity is whole pages
// and grows only when asked; a moved buffer takes the bytes and leaves an empty one.
TEST(MappedBufferTest, GrowsInPlaceAndKeepsEveryByte) {
  MappedBuffer b;
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(b.capacity(), 0u);
  std::string expected;
  for (int i = 0; i < 20000; ++i) {
    std::string piece = std::to_string(i * 7919);
    piece += ';';
    ASSERT_TRUE(b.Reserve(b.size() + piece.size() + b.size() / 8));
    b.Append(piece.data(), piece.size());
    expected += piece;
  }
  ASSERT_EQ(b.size(), expected.size());
  EXPECT_EQ(std::string(b.data(), b.size()), expected);
  EXPECT_EQ(b.capacity() % MappedBuffer::Rounded(1), 0u);
  EXPECT_GE(b.capacity(), b.size());
  const size_t cap = b.capacity();
  EXPECT_TRUE(b.Reserve(cap - 1));
  EXPECT_EQ(b.capacity(), cap);

  MappedBuffer moved(std::move(b));
  EXPECT_EQ(std::string(moved.data(), moved.size()), expected);
  EXPECT_EQ(b.size(), 0u);  // NOLINT(bugprone-use-after-move): what a move leaves is defined
  EXPECT_EQ(b.capacity(), 0u);
  MappedBuffer other;
  ASSERT_TRUE(other.Reserve(10));
  other.Append("x", 1);
  other = std::move(moved);
  EXPECT_EQ(other.size(), expected.size());
}

TEST(MappedBufferTest, ASizeTheKernelCannotMapIsRefusedAndTheBufferKept) {
  MappedBuffer b;
  ASSERT_TRUE(b.Reserve(100));
  b.Append("abc", 3);
  EXPECT_FALSE(b.Reserve(SIZE_MAX - 10));    // rounds past the address space
  EXPECT_FALSE(b.Reserve(size_t{1} << 62));  // no such memory
  EXPECT_EQ(std::string(b.data(), b.size()), "abc");
}

}  // namespace
}  // namespace cubetorchfs
