#include "common/status.h"

#include <array>
#include <cerrno>
#include <cstring>

namespace cubetorchfs {

namespace {

struct CodeInfo {
  Status::Code code;
  const char* name;  // ToString's
  const char* wire;  // CodeName's
  int err;           // ToErrno's
  bool from_errno;   // FromErrno maps err to this code
};

using Code = Status::Code;
constexpr std::array<CodeInfo, 16> kCodes = {{
    {Code::kOk, "OK", "ok", 0, false},
    {Code::kNotFound, "NotFound", "not_found", ENOENT, true},
    {Code::kPermissionDenied, "PermissionDenied", "permission_denied", EACCES, true},
    {Code::kNotDirectory, "NotDirectory", "not_directory", ENOTDIR, true},
    {Code::kIsDirectory, "IsDirectory", "is_directory", EISDIR, true},
    {Code::kInvalidArgument, "InvalidArgument", "invalid_argument", EINVAL, true},
    {Code::kIOError, "IOError", "io_error", EIO, true},
    {Code::kStale, "Stale", "stale", ESTALE, false},
    {Code::kNotSupported, "NotSupported", "not_supported", ENOTSUP, false},
    {Code::kReadOnly, "ReadOnly", "read_only", EROFS, false},
    {Code::kNameTooLong, "NameTooLong", "name_too_long", ENAMETOOLONG, true},
    {Code::kCorruption, "Corruption", "corruption", EBADMSG, false},
    {Code::kExists, "Exists", "exists", EEXIST, true},
    {Code::kNotEmpty, "NotEmpty", "not_empty", ENOTEMPTY, true},
    {Code::kNoSpace, "NoSpace", "no_space", ENOSPC, true},
    {Code::kErrno, "Error", "errno", 0, false},
}};

const CodeInfo& Info(Code code) {
  for (const CodeInfo& c : kCodes)
    if (c.code == code) return c;
  return kCodes[static_cast<size_t>(Code::kIOError)];
}

}  // namespace

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(Info(code_).name) + ": " + msg_;
}

Status Status::FromErrno(int err, std::string_view what) {
  std::string msg = std::string(what) + ": " + std::strerror(err);
  for (const CodeInfo& c : kCodes)
    if (c.from_errno && c.err == err) return Status(c.code, msg);
  // EPERM, EXDEV, EMLINK, EDQUOT, EFBIG, ELOOP, EROFS, ...: as the system said.
  return Errno(err > 0 ? err : EIO, msg);
}

int ToErrno(const Status& s) {
  if (s.code() == Status::Code::kErrno) return s.errno_value() > 0 ? s.errno_value() : EIO;
  return Info(s.code()).err;
}

std::string_view CodeName(Status::Code code) { return Info(code).wire; }

std::optional<Status::Code> CodeFromName(std::string_view name) {
  for (const CodeInfo& c : kCodes)
    if (name == c.wire) return c.code;
  return std::nullopt;
}

Status Status::FromWire(std::string_view code, std::string_view msg, int64_t err) {
  std::optional<Code> c = CodeFromName(code);
  if (!c || *c == Code::kOk) return IOError(msg);
  if (*c == Code::kErrno)
    return err > 0 && err < 4096 ? Errno(static_cast<int>(err), msg) : IOError(msg);
  return Status(*c, msg);
}

}  // namespace cubetorchfs
