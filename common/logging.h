// Process-wide log sink: a file under logDir, or stderr when running in the foreground.
//
// The one deliberate global besides the FUSE userdata: every component logs, and threading a
// logger through each constructor buys nothing here. Thread-safe: each line is written with a
// single write(2) call, so lines from different threads never interleave.
#pragma once

#include <sstream>
#include <string>
#include <string_view>

#include "common/status.h"

namespace cubetorchfs {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// Parses "debug", "info", "warn"/"warning", "error" (case-insensitive).
Result<LogLevel> ParseLogLevel(std::string_view s);

// Directs the log to `path` (appended, created 0644 with missing parent directories), or to
// stderr when `path` is empty. Returns an error naming the path if it cannot be opened.
Status InitLogging(const std::string& path, LogLevel level);
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
// True while the log goes to stderr (before InitLogging with a file, or in the foreground).
bool LogIsStderr();
void WriteLogLine(LogLevel level, const char* file, int line, const std::string& msg);

namespace internal {
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line)
      : level_(level), file_(file), line_(line) {}
  ~LogMessage() { WriteLogLine(level_, file_, line_, stream_.str()); }
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};
// Turns the stream expression into void so both branches of the ?: agree.
struct Voidify {
  void operator&(std::ostream&) {}
};
}  // namespace internal

}  // namespace cubetorchfs

// CTFS_LOG(kInfo) << "text" << value; — a statement, safe inside an unbraced if/else.
#define CTFS_LOG(level)                                                                   \
  !::cubetorchfs::LogEnabled(::cubetorchfs::LogLevel::level)                              \
      ? (void)0                                                                           \
      : ::cubetorchfs::internal::Voidify() &                                              \
            ::cubetorchfs::internal::LogMessage(::cubetorchfs::LogLevel::level, __FILE__, \
                                                __LINE__)                                 \
                .stream()
