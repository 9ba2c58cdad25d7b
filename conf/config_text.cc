#include "conf/config_text.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/mark.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "common/unique_fd.h"
#include "conf/config.h"

namespace cubetorchfs::conf {

bool HasControlChar(const std::string& s) {
  return std::any_of(s.begin(), s.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c < 0x20 || c == 0x7f;
  });
}

namespace {

// Walks the parser's events (not the node tree, where aliases can make a small file expand
// into exponentially many nodes) and refuses what yaml-cpp accepts silently: a key given twice
// in one map (the later value would win unnoticed), a key that is not a string or holds a
// control character, and a second YAML document (YAML::Load reads only the first). JSON and
// YAML in block or flow style all produce the same events.
class KeyScanner : public YAML::EventHandler {
 public:
  struct Error {
    std::string message;
  };

  // Called after the first document: later ones may only be empty ("a: 1\n---\n").
  void StartExtraDocuments() { extra_documents_ = true; }

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& mark, YAML::anchor_t) override {
    if (InKeyPosition()) throw Error{Where() + "a key must be a string" + Line(mark)};
    ValueDone();
  }
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override {
    CheckExtra(mark);
    if (InKeyPosition()) throw Error{Where() + "a key must be a string, not an alias" + Line(mark)};
    ValueDone();
  }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                const std::string& value) override {
    CheckExtra(mark);
    if (InKeyPosition()) return Key(mark, value);
    ValueDone();
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    Open(mark, /*map=*/false);
  }
  void OnSequenceEnd() override { Close(); }
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    Open(mark, /*map=*/true);
  }
  void OnMapEnd() override { Close(); }

 private:
  struct Frame {
    bool map = false;
    bool want_key = true;              // map: the next scalar is a key
    std::string key;                   // map: the key whose value is being read
    std::map<std::string, int> lines;  // map: the keys seen, each with its line
    size_t index = 0;                  // sequence: the element being read
  };

  static std::string Line(const YAML::Mark& mark) {
    return " (line " + std::to_string(mark.line + 1) + ")";
  }

  void CheckExtra(const YAML::Mark& mark) const {
    if (extra_documents_)
      throw Error{"config: holds a second YAML document" + Line(mark) +
                  "; only the first would be read, so put every key in one"};
  }

  bool InKeyPosition() const {
    return !stack_.empty() && stack_.back().map && stack_.back().want_key;
  }

  // The key path being read: "cache.memory_bytes", "mountOptions[2]".
  std::string Path() const {
    std::string p;
    for (const Frame& f : stack_) {
      if (!f.map)
        p += "[" + std::to_string(f.index) + "]";
      else if (!f.want_key)
        p += (p.empty() ? "" : ".") + f.key;
    }
    return p;
  }
  std::string Where() const {
    std::string p = Path();
    return (p.empty() ? "config" : p) + ": ";
  }

  void Open(const YAML::Mark& mark, bool map) {
    CheckExtra(mark);
    if (InKeyPosition())
      throw Error{Where() + "a key must be a string, not a list or an object" + Line(mark)};
    stack_.emplace_back();
    stack_.back().map = map;
  }
  void Close() {
    if (!stack_.empty()) stack_.pop_back();
    ValueDone();
  }
  void ValueDone() {
    if (stack_.empty()) return;
    Frame& f = stack_.back();
    if (f.map)
      f.want_key = true;
    else
      ++f.index;
  }
  void Key(const YAML::Mark& mark, const std::string& key) {
    Frame& f = stack_.back();
    f.key = key;
    f.want_key = false;
    if (HasControlChar(key))
      throw Error{Where() + "a key must not contain control characters" + Line(mark)};
    auto [it, inserted] = f.lines.emplace(key, mark.line + 1);
    if (!inserted)
      throw Error{Where() + "duplicate key (lines " + std::to_string(it->second) + " and " +
                  std::to_string(mark.line + 1) +
                  "); the second value would silently replace the first"};
  }

  std::vector<Frame> stack_;
  bool extra_documents_ = false;
};

}  // namespace

Status CheckKeys(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  KeyScanner scanner;
  try {
    if (!parser.HandleNextDocument(scanner)) return Status::OK();
    scanner.StartExtraDocuments();
    while (parser.HandleNextDocument(scanner)) {
    }
  } catch (const KeyScanner::Error& e) {
    return Status::InvalidArgument(e.message);
  }
  return Status::OK();
}

namespace {

const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

Result<std::string> ReadConfigFile(const std::string& path) {
  auto fail = [&path](const std::string& why) {
    return Status::InvalidArgument(path + ": cannot read config: " + why);
  };
  auto not_regular = [&fail](mode_t mode) {
    return fail(std::string("not a regular file (") + FileKind(mode) + ")");
  };
  // stat before open: opening a device can act on it, and a FIFO must not block the open.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return fail(std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  // O_NONBLOCK: should the path have become a FIFO since the stat, open(2) still returns at
  // once; fstat then checks what was opened.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (fd.get() < 0) return fail(std::strerror(errno));
  if (::fstat(fd.get(), &st) != 0) return fail(std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  const std::string too_big = "larger than " + std::to_string(kMaxConfigBytes >> 20) + " MiB";
  if (st.st_size > static_cast<off_t>(kMaxConfigBytes)) return fail(too_big);
  // At most one byte past the limit is read: a file that grows meanwhile, or one that reports
  // size 0 (/proc), is still bounded.
  std::string text(kMaxConfigBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > kMaxConfigBytes) return fail(too_big);
  text.resize(got);
  return text;
}

Result<uint64_t> ParseSize(std::string_view text) {
  std::string s(text);
  size_t b = s.find_first_not_of(" \t");
  size_t e = s.find_last_not_of(" \t");
  if (b == std::string::npos) return Status::InvalidArgument("empty size");
  s = s.substr(b, e - b + 1);
  if (s[0] == '-') return Status::InvalidArgument("size must not be negative, got \"" + s + "\"");
  size_t num_end = 0;
  while (num_end < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[num_end])) || s[num_end] == '.'))
    ++num_end;
  std::string num = s.substr(0, num_end);
  std::string unit = s.substr(num_end);
  size_t ub = unit.find_first_not_of(" \t");
  unit = ub == std::string::npos ? "" : unit.substr(ub);
  if (num.empty() || std::count(num.begin(), num.end(), '.') > 1)
    return Status::InvalidArgument("not a size: \"" + s + "\" (use bytes or e.g. \"4GiB\")");
  std::string u;
  for (char c : unit) u += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  uint64_t mult = 0;
  if (u.empty() || u == "b")
    mult = 1;
  else if (u == "k" || u == "kb" || u == "kib")
    mult = 1ull << 10;
  else if (u == "m" || u == "mb" || u == "mib")
    mult = 1ull << 20;
  else if (u == "g" || u == "gb" || u == "gib")
    mult = 1ull << 30;
  else if (u == "t" || u == "tb" || u == "tib")
    mult = 1ull << 40;
  else
    return Status::InvalidArgument("unknown unit \"" + unit + "\" in \"" + s +
                                   "\" (use B, KiB, MiB, GiB or TiB)");
  long double v = std::strtold(num.c_str(), nullptr) * static_cast<long double>(mult);
  if (v > static_cast<long double>(std::numeric_limits<uint64_t>::max()))
    return Status::InvalidArgument("size too large: \"" + s + "\"");
  if (v != std::floor(v))
    return Status::InvalidArgument("not a whole number of bytes: \"" + s + "\"");
  return static_cast<uint64_t>(v);
}

namespace {

// Keys of the CubeFS client's config.json that we accept without a warning. Most have no
// meaning here; rdonly, lookupValid and attrValid map onto fuse.* when that is not set.
const std::set<std::string>& CubeFsClientKeys() {
  static const std::set<std::string> keys = {
      "masterAddr",
      "owner",
      "consulAddr",
      "token",
      "rdonly",
      "lookupValid",
      "attrValid",
      "icacheTimeout",
      "enSyncWrite",
      "autoInvalData",
      "writecache",
      "keepcache",
      "readRate",
      "writeRate",
      "followerRead",
      "nearRead",
      "accessKey",
      "secretKey",
      "subdir",
      "fsyncOnClose",
      "maxcpus",
      "enableXattr",
      "enablePosixACL",
      "enableSummary",
      "enableUnixPermission",
      "disableDcache",
      "bcacheDir",
      "maxStreamerLimit",
      "clientKey",
      "authenticate",
      "ticketHost",
      "enableHTTPS",
      "certFile",
      "warnLogDir",
      "logDirSize",
      "readThreads",
      "writeThreads",
      "enableBcache",
      "buffersTotalLimit",
      "metaSendTimeout",
      "minWriteAbleDataPartitionCnt",
      "bcacheFilterFiles",
      "bcacheBatchCnt",
      "bcacheCheckInterval",
      "prefetchThread",
      "prefetchBuffer",
      "mountOptions",
      "enableAudit",
      "localIP",
  };
  return keys;
}

}  // namespace

bool IsCubeFsClientKey(const std::string& key) { return CubeFsClientKeys().count(key) > 0; }

}  // namespace cubetorchfs::conf
