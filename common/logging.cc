#include "common/logging.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

namespace cubetorchfs {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_fd{STDERR_FILENO};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kError:
      return "E";
  }
  return "?";
}

}  // namespace

Result<LogLevel> ParseLogLevel(std::string_view s) {
  std::string l(s);
  for (char& c : l) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (l == "debug") return LogLevel::kDebug;
  if (l == "info") return LogLevel::kInfo;
  if (l == "warn" || l == "warning") return LogLevel::kWarn;
  if (l == "error") return LogLevel::kError;
  return Status::InvalidArgument("must be one of debug, info, warn, error; got \"" + l + "\"");
}

Status InitLogging(const std::string& path, LogLevel level) {
  SetLogLevel(level);
  if (path.empty()) {
    g_fd = STDERR_FILENO;
    return Status::OK();
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path + ": " + std::strerror(errno));
  int old = g_fd.exchange(fd);
  if (old != STDERR_FILENO) ::close(old);
  return Status::OK();
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool LogIsStderr() { return g_fd.load() == STDERR_FILENO; }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void WriteLogLine(LogLevel level, const char* file, int line, const std::string& msg) {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t secs = system_clock::to_time_t(now);
  auto usec = duration_cast<microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm tm{};
  localtime_r(&secs, &tm);
  const char* base = std::strrchr(file, '/');
  char head[96];
  std::snprintf(head, sizeof head, "%s %04d-%02d-%02d %02d:%02d:%02d.%06ld %d %s:%d] ",
                LevelName(level), tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                tm.tm_min, tm.tm_sec, static_cast<long>(usec), static_cast<int>(::gettid()),
                base ? base + 1 : file, line);
  std::string out = head + msg;
  if (out.empty() || out.back() != '\n') out.push_back('\n');
  ssize_t ignored = ::write(g_fd.load(), out.data(), out.size());
  (void)ignored;  // nowhere left to report a failed log write
}

}  // namespace cubetorchfs
