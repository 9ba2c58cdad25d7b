#include "common/status.h"

namespace cubetorchfs {

std::string Status::ToString() const {
  const char* name = "OK";
  switch (code_) {
    case Code::kOk:
      return "OK";
    case Code::kNotFound:
      name = "NotFound";
      break;
    case Code::kPermissionDenied:
      name = "PermissionDenied";
      break;
    case Code::kNotDirectory:
      name = "NotDirectory";
      break;
    case Code::kIsDirectory:
      name = "IsDirectory";
      break;
    case Code::kInvalidArgument:
      name = "InvalidArgument";
      break;
    case Code::kIOError:
      name = "IOError";
      break;
    case Code::kStale:
      name = "Stale";
      break;
    case Code::kNotSupported:
      name = "NotSupported";
      break;
    case Code::kReadOnly:
      name = "ReadOnly";
      break;
    case Code::kNameTooLong:
      name = "NameTooLong";
      break;
    case Code::kCorruption:
      name = "Corruption";
      break;
    case Code::kExists:
      name = "Exists";
      break;
    case Code::kNotEmpty:
      name = "NotEmpty";
      break;
    case Code::kNoSpace:
      name = "NoSpace";
      break;
    case Code::kErrno:
      name = "Error";
      break;
  }
  return std::string(name) + ": " + msg_;
}

}  // namespace cubetorchfs
