// Status and Result<T>: errors as values.
//
// A Status is either OK or an error code with a message. The codes are the small set of
// outcomes the file system must tell apart. Each code has one errno (ToErrno: what FUSE
// replies and the loader's C API returns) and one wire name (CodeName: the "code" of the
// control API's error replies, mapped back by CodeFromName). Result<T> holds a T or a
// non-OK Status. Both are cheap to move and safe to copy;
// neither is thread-safe to mutate concurrently (like any value).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace cubetorchfs {

class [[nodiscard]] Status {
 public:
  enum class Code {
    kOk = 0,
    kNotFound,          // no such file or directory
    kPermissionDenied,  // access refused by the store
    kNotDirectory,      // a path component is not a directory
    kIsDirectory,       // a file operation on a directory
    kInvalidArgument,   // bad input from the caller (config, request, path)
    kIOError,           // the store failed; may succeed if retried
    kStale,             // the file changed while it was being read
    kNotSupported,      // the operation is not implemented by this component
    kReadOnly,          // the file system does not accept writes
    kNameTooLong,       // a name or path longer than the store allows
    kCorruption,        // data failed a consistency check
    kExists,            // the name already exists
    kNotEmpty,          // a directory that must be empty is not
    kNoSpace,           // the store is full
    kErrno,             // any other error of a POSIX store, carried as its errno
  };

  Status() = default;
  static Status OK() { return Status(); }
  static Status NotFound(std::string_view msg) { return {Code::kNotFound, msg}; }
  static Status PermissionDenied(std::string_view msg) { return {Code::kPermissionDenied, msg}; }
  static Status NotDirectory(std::string_view msg) { return {Code::kNotDirectory, msg}; }
  static Status IsDirectory(std::string_view msg) { return {Code::kIsDirectory, msg}; }
  static Status InvalidArgument(std::string_view msg) { return {Code::kInvalidArgument, msg}; }
  static Status IOError(std::string_view msg) { return {Code::kIOError, msg}; }
  static Status Stale(std::string_view msg) { return {Code::kStale, msg}; }
  static Status NotSupported(std::string_view msg) { return {Code::kNotSupported, msg}; }
  static Status ReadOnly(std::string_view msg) { return {Code::kReadOnly, msg}; }
  static Status NameTooLong(std::string_view msg) { return {Code::kNameTooLong, msg}; }
  static Status Corruption(std::string_view msg) { return {Code::kCorruption, msg}; }
  static Status Exists(std::string_view msg) { return {Code::kExists, msg}; }
  static Status NotEmpty(std::string_view msg) { return {Code::kNotEmpty, msg}; }
  static Status NoSpace(std::string_view msg) { return {Code::kNoSpace, msg}; }
  // An error of a POSIX store that has no code of its own (EXDEV, EMLINK, EDQUOT, ...): the
  // errno reaches the caller unchanged. REQUIRES: err > 0.
  static Status Errno(int err, std::string_view msg) {
    Status s(Code::kErrno, msg);
    s.errno_ = err;
    return s;
  }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  int errno_value() const { return errno_; }  // the errno of a kErrno status, else 0
  bool IsNotFound() const { return code_ == Code::kNotFound; }
  bool IsStale() const { return code_ == Code::kStale; }

  // The same code (and errno) with `prefix` and `suffix` around the message (to add context).
  Status Wrap(std::string_view prefix, std::string_view suffix = "") const {
    Status s(code_, std::string(prefix) + msg_ + std::string(suffix));
    s.errno_ = errno_;
    return s;
  }

  // The status of a failed system call: `what` and strerror(err). The errno's own code where
  // it has one (ENOENT is NotFound, ...), else an errno-carrying status. REQUIRES: err > 0.
  static Status FromErrno(int err, std::string_view what);
  // A status from its wire form: the code's name (CodeName), the message, and the errno of
  // an "errno" status. An unknown name, or an "errno" status whose errno is not in 1..4095,
  // gives an IOError.
  static Status FromWire(std::string_view code, std::string_view msg, int64_t err);

  // "IOError: open a/b: No such file..." — for logs and user-facing errors.
  std::string ToString() const;

 private:
  Status(Code code, std::string_view msg) : code_(code), msg_(msg) {}

  Code code_ = Code::kOk;
  int errno_ = 0;
  std::string msg_;
};

// The errno a status stands for: 0 for OK, the code's own errno (NotFound: ENOENT,
// Corruption: EBADMSG, ...), the carried errno of an errno status.
int ToErrno(const Status& s);

// The wire name of a code ("not_found", ...), and back; nothing for an unknown name.
std::string_view CodeName(Status::Code code);
std::optional<Status::Code> CodeFromName(std::string_view name);

// Holds a value or an error. Accessing value() of an error aborts (a broken invariant).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) std::abort();   // an OK Status carries no value
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

// Returns the error from the enclosing function if `expr` (a Status) is not OK.
#define CTFS_RETURN_IF_ERROR(expr)      \
  do {                                  \
    ::cubetorchfs::Status _st = (expr); \
    if (!_st.ok()) return _st;          \
  } while (0)

#define CTFS_STATUS_CONCAT_INNER(a, b) a##b
#define CTFS_STATUS_CONCAT(a, b) CTFS_STATUS_CONCAT_INNER(a, b)

// `lhs = value of expr` (a Result<T>), or returns its error from the enclosing function.
// `lhs` may declare: CTFS_ASSIGN_OR_RETURN(auto fd, OpenFile(path));
#define CTFS_ASSIGN_OR_RETURN(lhs, expr) \
  CTFS_ASSIGN_OR_RETURN_IMPL(CTFS_STATUS_CONCAT(_ctfs_result_, __LINE__), lhs, expr)
#define CTFS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

}  // namespace cubetorchfs
