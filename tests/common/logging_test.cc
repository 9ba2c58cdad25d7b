#include "common/logging.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace cubetorchfs {
namespace {

// Sends the log to a fresh file for one test and reads it back; restores stderr after.
class LogCapture {
 public:
  LogCapture() {
    char dir[] = "/tmp/ctfs_logging_test.XXXXXX";
    dir_ = ::mkdtemp(dir);
    path_ = dir_ + "/test.log";
    EXPECT_TRUE(InitLogging(path_, LogLevel::kDebug).ok());
  }
  ~LogCapture() {
    (void)InitLogging("", LogLevel::kInfo);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string Text() const {
    std::ifstream in(path_, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  std::vector<std::string> Lines() const {
    std::vector<std::string> lines;
    std::istringstream in(Text());
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    return lines;
  }

 private:
  std::string dir_;
  std::string path_;
};

TEST(EscapeLogTextTest, EscapesControlBytesAndBackslash) {
  EXPECT_EQ(EscapeLogText("plain text"), "plain text");
  EXPECT_EQ(EscapeLogText("a\nb"), "a\\nb");
  EXPECT_EQ(EscapeLogText("t\tr\r"), "t\\tr\\r");
  EXPECT_EQ(EscapeLogText(std::string("nul\0x", 5)), "nul\\x00x");
  EXPECT_EQ(EscapeLogText("\x1b[31mred\x7f"), "\\x1b[31mred\\x7f");
  EXPECT_EQ(EscapeLogText("back\\slash"), "back\\\\slash");
  // Unambiguous: a literal backslash-n and a newline come out differently.
  EXPECT_NE(EscapeLogText("\\n"), EscapeLogText("\n"));
  EXPECT_EQ(EscapeLogText("caf\xc3\xa9 \xe4\xb8\xad"), "caf\xc3\xa9 \xe4\xb8\xad");  // UTF-8 kept
}

TEST(EscapeLogTextTest, CutsAtTheLimitNeverInsideAnEscapeOrUtf8) {
  EXPECT_EQ(EscapeLogText("abcdefgh", 4), "abcd... (4 bytes cut)");
  EXPECT_EQ(EscapeLogText("abc\ndef", 4), "abc... (4 bytes cut)");  // "\\n" would not fit
  // "é" is two bytes: never split.
  EXPECT_EQ(EscapeLogText("ab\xc3\xa9z", 3), "ab... (3 bytes cut)");
  EXPECT_EQ(EscapeLogText("abc", 3), "abc");
}

TEST(LoggingTest, NewlineInAMessageCannotForgeALine) {
  LogCapture capture;
  const std::string path = "/data/x\n[ERROR] forged";
  CTFS_LOG(kInfo) << "open " << path;
  CTFS_LOG(kError) << "read " << path << ": EIO";
  std::vector<std::string> lines = capture.Lines();
  ASSERT_EQ(lines.size(), 2u) << capture.Text();
  EXPECT_NE(lines[0].find("open /data/x\\n[ERROR] forged"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1].rfind("E ", 0), 0u) << lines[1];
  EXPECT_NE(lines[1].find("read /data/x\\n[ERROR] forged: EIO"), std::string::npos) << lines[1];
  for (const std::string& l : lines)
    for (char c : l) EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 || c == 0x7f) << l;
}

TEST(LoggingTest, AMegabyteMessageIsCut) {
  LogCapture capture;
  const std::string big(1 << 20, 'x');
  CTFS_LOG(kInfo) << big;
  std::vector<std::string> lines = capture.Lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_LT(lines[0].size(), 4096u);
  const std::string cut = "... (" + std::to_string((1 << 20) - kMaxLogMessageBytes) + " bytes cut)";
  EXPECT_NE(lines[0].find(cut), std::string::npos) << lines[0].substr(lines[0].size() - 64);
}

TEST(LoggingTest, AMessageOfEscapesIsCutToo) {
  LogCapture capture;
  CTFS_LOG(kInfo) << std::string(1 << 20, '\n');  // each byte becomes two
  std::vector<std::string> lines = capture.Lines();
  ASSERT_EQ(lines.size(), 1u);  // trailing newlines are dropped, so the line is just the head
  CTFS_LOG(kInfo) << std::string(1 << 20, '\x01') << "end";
  lines = capture.Lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_LT(lines[1].size(), 4096u);
  EXPECT_NE(lines[1].find("bytes cut)"), std::string::npos);
}

void WarnFromOneSite(int i) { CTFS_LOG(kWarn) << "request " << i << " failed"; }

TEST(LoggingTest, RepeatedWarningsFromOneSiteAreRateLimited) {
  LogCapture capture;
  const auto start = std::chrono::steady_clock::now();
  constexpr int kCalls = 10000;
  for (int i = 0; i < kCalls; ++i) WarnFromOneSite(i);
  const double elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const size_t written = capture.Lines().size();
  EXPECT_GE(written, static_cast<size_t>(kLogBurstLines));
  EXPECT_LE(written, kLogBurstLines + static_cast<size_t>(elapsed_s * kLogLinesPerSecond) + 1);

  // A second later one more passes and says how many were dropped.
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  WarnFromOneSite(kCalls);
  std::vector<std::string> lines = capture.Lines();
  ASSERT_EQ(lines.size(), written + 1);
  const std::string want = " (" + std::to_string(kCalls - written) + " similar lines suppressed)";
  EXPECT_NE(lines.back().find(want), std::string::npos) << lines.back();
  EXPECT_NE(lines.back().find("request 10000 failed"), std::string::npos) << lines.back();
}

TEST(LoggingTest, RateLimitIsPerCallSiteAndThreadSafe) {
  LogCapture capture;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([] {
      for (int i = 0; i < 2000; ++i) CTFS_LOG(kError) << "site A " << i;
    });
  for (auto& th : threads) th.join();
  for (int i = 0; i < 5; ++i) CTFS_LOG(kError) << "site B " << i;  // its own burst
  const double elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t a = 0, b = 0;
  for (const std::string& l : capture.Lines()) {
    a += l.find("site A") != std::string::npos;
    b += l.find("site B") != std::string::npos;
  }
  EXPECT_GE(a, static_cast<size_t>(kLogBurstLines));
  EXPECT_LE(a, kLogBurstLines + static_cast<size_t>(elapsed_s * kLogLinesPerSecond) + 1);
  EXPECT_EQ(b, 5u);
}

TEST(LoggingTest, InfoIsNotRateLimited) {
  LogCapture capture;
  for (int i = 0; i < 200; ++i) CTFS_LOG(kInfo) << "info " << i;
  EXPECT_EQ(capture.Lines().size(), 200u);
}

TEST(InitLoggingTest, NeverWritesThroughAPlantedFifoLinkOrHardLink) {
  char dir[] = "/tmp/ctfs_logging_plant.XXXXXX";
  const std::string d = ::mkdtemp(dir);
  const std::string victim = d + "/victim";
  std::ofstream(victim) << "keep";
  ASSERT_EQ(::mkfifo((d + "/fifo.log").c_str(), 0644), 0);
  ASSERT_EQ(::symlink(victim.c_str(), (d + "/sym.log").c_str()), 0);
  ASSERT_EQ(::link(victim.c_str(), (d + "/hard.log").c_str()), 0);
  // The FIFO must not block (no reader); none of them may become the log.
  for (const char* name : {"/fifo.log", "/sym.log", "/hard.log"})
    EXPECT_FALSE(InitLogging(d + name, LogLevel::kInfo).ok()) << name;
  CTFS_LOG(kError) << "must not reach the victim";
  (void)InitLogging("", LogLevel::kInfo);
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "keep");
  for (const char* name : {"/fifo.log", "/sym.log", "/hard.log", "/victim"})
    ::unlink((d + name).c_str());
  ::rmdir(d.c_str());
}

}  // namespace
}  // namespace cubetorchfs
