#include "common/logging.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <unordered_map>
#include <utility>

#include "common/thread_annotations.h"

namespace cubetorchfs {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_fd{STDERR_FILENO};
Mutex g_problem_mu;
LoggedProblem g_problem GUARDED_BY(g_problem_mu);

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

// Bytes `c` takes once escaped.
size_t EscapedSize(unsigned char c) {
  if (c == '\\' || c == '\n' || c == '\t' || c == '\r') return 2;
  if (c < 0x20 || c == 0x7f) return 4;
  return 1;
}

void AppendEscaped(std::string* out, unsigned char c) {
  switch (c) {
    case '\\':
      *out += "\\\\";
      return;
    case '\n':
      *out += "\\n";
      return;
    case '\t':
      *out += "\\t";
      return;
    case '\r':
      *out += "\\r";
      return;
    default:
      if (c < 0x20 || c == 0x7f) {
        static constexpr char kHex[] = "0123456789abcdef";
        *out += "\\x";
        *out += kHex[c >> 4];
        *out += kHex[c & 0xf];
      } else {
        *out += static_cast<char>(c);
      }
  }
}

// Per-call-site token buckets for warnings and errors. Call sites are source lines, so the
// table stays small; it is cleared if something passes ever-new `file` pointers.
class RateLimiter {
 public:
  // True if a line from (file, line) may be written now; then *suppressed is the number of
  // lines from there dropped since the last one written.
  bool Admit(const char* file, int line, uint64_t* suppressed) EXCLUDES(mu_) {
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    MutexLock lock(mu_);
    if (sites_.size() >= kMaxSites) sites_.clear();
    auto [it, inserted] = sites_.try_emplace(Site{file, line});
    Bucket& b = it->second;
    if (inserted) {
      b.tokens = kLogBurstLines;
    } else {
      const double elapsed_s = static_cast<double>(now - b.last_ns) / 1e9;
      b.tokens = std::min<double>(kLogBurstLines, b.tokens + elapsed_s * kLogLinesPerSecond);
    }
    b.last_ns = now;
    if (b.tokens < 1.0) {
      ++b.suppressed;
      return false;
    }
    b.tokens -= 1.0;
    *suppressed = std::exchange(b.suppressed, 0);
    return true;
  }

 private:
  static constexpr size_t kMaxSites = 4096;
  struct Site {
    const char* file;
    int line;
    bool operator==(const Site& o) const { return file == o.file && line == o.line; }
  };
  struct SiteHash {
    size_t operator()(const Site& s) const {
      return std::hash<const void*>()(s.file) * 31 + static_cast<size_t>(s.line);
    }
  };
  struct Bucket {
    double tokens = 0;
    int64_t last_ns = 0;
    uint64_t suppressed = 0;
  };
  Mutex mu_;
  std::unordered_map<Site, Bucket, SiteHash> sites_ GUARDED_BY(mu_);
};

RateLimiter& Limiter() {
  static RateLimiter* limiter = new RateLimiter;  // never destroyed: threads log until _exit
  return *limiter;
}

}  // namespace

std::string EscapeLogText(std::string_view text, size_t max_bytes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes) + 16);
  size_t i = 0;
  for (; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (out.size() + EscapedSize(c) > max_bytes) break;
    AppendEscaped(&out, c);
  }
  if (i == text.size()) return out;
  // Cut before a whole UTF-8 sequence (bytes >= 0x80 were copied one for one).
  for (int k = 0; k < 3 && i > 0 && (static_cast<unsigned char>(text[i]) & 0xc0) == 0x80 &&
                  static_cast<unsigned char>(text[i - 1]) >= 0x80;
       ++k) {
    --i;
    out.pop_back();
  }
  out += "... (" + std::to_string(text.size() - i) + " bytes cut)";
  return out;
}

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
  // The daemon runs as root: never write through a link planted at the log's name. The log
  // names files of every user, so it is readable by the daemon's user only.
  // O_NONBLOCK: a FIFO planted there must not block the start; it is refused below, as is a
  // hard link to another file (more than one link) and a file of another owner.
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC,
                  0600);
  if (fd < 0) return Status::IOError(path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1 ||
      st.st_uid != ::geteuid()) {
    ::close(fd);
    return Status::PermissionDenied(path +
                                    ": not a regular file of ours with one link; "
                                    "refusing to log into it");
  }
  if ((st.st_mode & 077) != 0) ::fchmod(fd, st.st_mode & 0700);  // an older log, made private
  int old = g_fd.exchange(fd);
  if (old != STDERR_FILENO) ::close(old);
  return Status::OK();
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool LogIsStderr() { return g_fd.load() == STDERR_FILENO; }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

LoggedProblem LastLoggedProblem() {
  MutexLock l(g_problem_mu);
  return g_problem;
}

void WriteLogLine(LogLevel level, const char* file, int line, const std::string& msg) {
  uint64_t suppressed = 0;
  if (level >= LogLevel::kWarn && !Limiter().Admit(file, line, &suppressed)) return;
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
  std::string_view text = msg;
  while (!text.empty() && text.back() == '\n') text.remove_suffix(1);  // a habit, not a forgery
  std::string out = head;
  out += EscapeLogText(text);
  if (level >= LogLevel::kWarn) {
    MutexLock l(g_problem_mu);
    g_problem.text = out.substr(0, 512);
    g_problem.unix_s = duration<double>(now.time_since_epoch()).count();
  }
  if (suppressed > 0) out += " (" + std::to_string(suppressed) + " similar lines suppressed)";
  out.push_back('\n');
  ssize_t ignored = ::write(g_fd.load(), out.data(), out.size());
  (void)ignored;  // nowhere left to report a failed log write
}

}  // namespace cubetorchfs
