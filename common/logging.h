// Process-wide log sink: a file under logDir, or stderr when running in the foreground.
//
// The one deliberate global besides the FUSE userdata: every component logs, and threading a
// logger through each constructor buys nothing here. Thread-safe: each line is written with a
// single write(2) call, so lines from different threads never interleave.
//
// Messages often carry request data (paths, bodies), so the logger itself makes every call
// exactly one bounded line, whatever the message holds:
//   - control bytes (< 0x20 and 0x7f) are escaped as \n, \t, \r or \xNN and a backslash as
//     \\, so a "\n" in a path cannot forge a line and the escaping is unambiguous (bytes
//     >= 0x80 pass unchanged: UTF-8 names stay readable);
//   - the message is cut at kMaxLogMessageBytes, ending "... (N bytes cut)";
//   - warnings and errors are rate-limited per call site (file:line): a burst of
//     kLogBurstLines, then about kLogLinesPerSecond; the next line that passes after some were
//     dropped ends "(N similar lines suppressed)". Debug and info lines are not limited.
#pragma once

#include <cstddef>
#include <sstream>
#include <string>
#include <string_view>

#include "common/status.h"

namespace cubetorchfs {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// Longest message text of one line, after escaping; a whole line stays under 4 KiB.
inline constexpr size_t kMaxLogMessageBytes = 3900;
// Rate limit of warnings and errors, per call site.
inline constexpr int kLogBurstLines = 10;
inline constexpr double kLogLinesPerSecond = 1.0;

// `text` with control bytes escaped (\n, \t, \r, \xNN) and '\\' doubled, cut after
// `max_bytes` bytes of output (never inside an escape or a UTF-8 sequence) and then ending
// "... (N bytes cut)", N counting bytes of `text`. Never contains a byte below 0x20 or 0x7f.
std::string EscapeLogText(std::string_view text, size_t max_bytes = kMaxLogMessageBytes);

// Parses "debug", "info", "warn"/"warning", "error" (case-insensitive).
Result<LogLevel> ParseLogLevel(std::string_view s);

// Directs the log to `path` (appended, created 0644 with missing parent directories), or to
// stderr when `path` is empty. Returns an error naming the path if it cannot be opened.
Status InitLogging(const std::string& path, LogLevel level);
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
// True while the log goes to stderr (before InitLogging with a file, or in the foreground).
bool LogIsStderr();
// Writes one line: escaped and cut as above, rate-limited per (file, line) for kWarn and
// kError. `file` is compared by address (pass __FILE__).
void WriteLogLine(LogLevel level, const char* file, int line, const std::string& msg);

// The last warning or error logged (for `cubetorchfs status`): its text, escaped and cut to
// 512 bytes, and when (Unix seconds); time 0 if none yet.
struct LoggedProblem {
  std::string text;
  double unix_s = 0;
};
LoggedProblem LastLoggedProblem();

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
