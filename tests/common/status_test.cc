#include "common/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace cubetorchfs {
namespace {

TEST(StatusTest, EachCodeHasOneErrnoAndAWireNameThatMapsBack) {
  const struct {
    Status s;
    int err;
    const char* wire;
  } cases[] = {
      {Status::NotFound("x"), ENOENT, "not_found"},
      {Status::PermissionDenied("x"), EACCES, "permission_denied"},
      {Status::NotDirectory("x"), ENOTDIR, "not_directory"},
      {Status::IsDirectory("x"), EISDIR, "is_directory"},
      {Status::InvalidArgument("x"), EINVAL, "invalid_argument"},
      {Status::IOError("x"), EIO, "io_error"},
      {Status::Stale("x"), ESTALE, "stale"},
      {Status::NotSupported("x"), ENOTSUP, "not_supported"},
      {Status::ReadOnly("x"), EROFS, "read_only"},
      {Status::NameTooLong("x"), ENAMETOOLONG, "name_too_long"},
      {Status::Corruption("x"), EBADMSG, "corruption"},
      {Status::Exists("x"), EEXIST, "exists"},
      {Status::NotEmpty("x"), ENOTEMPTY, "not_empty"},
      {Status::NoSpace("x"), ENOSPC, "no_space"},
      {Status::Errno(EXDEV, "x"), EXDEV, "errno"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.wire);
    EXPECT_EQ(ToErrno(c.s), c.err);
    EXPECT_EQ(CodeName(c.s.code()), c.wire);
    Status back = Status::FromWire(CodeName(c.s.code()), "y", ToErrno(c.s));
    EXPECT_EQ(back.code(), c.s.code());
    EXPECT_EQ(ToErrno(back), c.err);
    EXPECT_EQ(back.message(), "y");
  }
  EXPECT_EQ(ToErrno(Status::OK()), 0);
  EXPECT_EQ(CodeFromName("no_such_code"), std::nullopt);
  EXPECT_EQ(Status::FromWire("no_such_code", "y", 0).code(), Status::Code::kIOError);
  EXPECT_EQ(Status::FromWire("ok", "y", 0).code(), Status::Code::kIOError);
  EXPECT_EQ(Status::FromWire("errno", "y", 0).code(), Status::Code::kIOError);
  EXPECT_EQ(Status::FromWire("errno", "y", 1ll << 40).code(), Status::Code::kIOError);
  EXPECT_EQ(Status::FromWire("errno", "y", -5).code(), Status::Code::kIOError);
}

TEST(StatusTest, WrapKeepsTheCodeAndTheErrno) {
  Status s = Status::Errno(EXDEV, "rename a b").Wrap("checkpoint: ", " (retry)");
  EXPECT_EQ(s.code(), Status::Code::kErrno);
  EXPECT_EQ(s.errno_value(), EXDEV);
  EXPECT_EQ(ToErrno(s), EXDEV);
  EXPECT_EQ(s.message(), "checkpoint: rename a b (retry)");
  EXPECT_EQ(Status::NotFound("a").Wrap("b: ").code(), Status::Code::kNotFound);
}

TEST(StatusTest, FromErrnoNamesTheCallAndKeepsTheErrno) {
  Status s = Status::FromErrno(ENOENT, "open a/b");
  EXPECT_TRUE(s.IsNotFound());
  EXPECT_EQ(s.message(), "open a/b: " + std::string(std::strerror(ENOENT)));
  EXPECT_EQ(Status::FromErrno(ENOTEMPTY, "rmdir").code(), Status::Code::kNotEmpty);
  Status other = Status::FromErrno(EMLINK, "link");
  EXPECT_EQ(other.code(), Status::Code::kErrno);
  EXPECT_EQ(ToErrno(other), EMLINK);
}

Result<int> Half(int v) {
  if (v % 2 != 0) return Status::InvalidArgument("odd");
  return v / 2;
}

Result<int> Quarter(int v) {
  CTFS_ASSIGN_OR_RETURN(int half, Half(v));
  CTFS_ASSIGN_OR_RETURN(half, Half(half));
  return half;
}

TEST(StatusTest, AssignOrReturnAssignsOrReturnsTheError) {
  EXPECT_EQ(Quarter(8).value(), 2);
  EXPECT_EQ(Quarter(6).status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(Quarter(3).status().message(), "odd");
}

}  // namespace
}  // namespace cubetorchfs
