// backend.type "synthetic": a read-only store computed from its shape, for benchmarks and
// scale tests (bench/scale_bench.py, tests/integration/test_scale.py). It serves an
// ImageNet-shaped tree with no disk at all:
//
//   n00000000/ ... n<dirs-1>/                 class directories, 0555
//   n00000007/n00000007_<i>.JPEG, i < files    files, 0444
//
// A file's size lies in [min_bytes, max_bytes] and is derived from its path and the seed, its
// bytes from the path, the seed and the offset (SplitMix64 per 8-byte word), so any reader can
// check them (tests/integration/synthetic_store.py computes the same). Every file has one
// mtime (derived from the seed: another seed is another version of every file). Names not of
// this form do not exist; every change fails with EROFS. A namespace of 100 M files costs
// nothing until listed: a directory's listing is computed on demand.
#include <sys/stat.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>

#include "cfs_client/backend.h"

namespace cubetorchfs::cfs_client {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr int64_t kEpochNs = 1'700'000'000'000'000'000;  // 2023-11-14, the tree's mtime base

// Parses exactly `digits` decimal digits (`digits` 0: 1 to 10 digits without a leading zero).
bool ParseNumber(std::string_view s, size_t digits, uint64_t* out) {
  if (s.empty() || (digits != 0 && s.size() != digits)) return false;
  if (digits == 0 && (s.size() > 10 || (s.size() > 1 && s[0] == '0'))) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return std::from_chars(s.data(), s.data() + s.size(), *out).ec == std::errc();
}

class SyntheticBackend final : public Backend {
 public:
  explicit SyntheticBackend(const conf::SyntheticOptions& o)
      : o_(o), mtime_ns_(kEpochNs + static_cast<int64_t>(SplitMix64(o.seed) % 1'000'000'000)) {}

  Capabilities capabilities() const override {
    return CapabilitiesOfType(conf::BackendType::kSynthetic);
  }

  Result<FileAttr> Stat(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(Node n, Parse(path));
    return AttrOf(n);
  }

  Result<std::vector<DirEntry>> List(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(Node n, Parse(path));
    if (n.kind == Node::kFile) return Status::NotDirectory(path + ": not a directory");
    return Entries(n, 0, std::numeric_limits<uint64_t>::max());
  }

  Result<std::unique_ptr<DirLister>> ListPages(const std::string& path) override {
    CTFS_ASSIGN_OR_RETURN(Node n, Parse(path));
    if (n.kind == Node::kFile) return Status::NotDirectory(path + ": not a directory");
    return std::unique_ptr<DirLister>(new Lister(this, n));
  }

  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char* buf) override {
    CTFS_ASSIGN_OR_RETURN(Node n, Parse(path));
    if (n.kind != Node::kFile) return Status::IsDirectory(path + ": is a directory");
    const FileAttr a = AttrOf(n);
    if (a.Version() != expect) return Status::Stale(path + ": file changed in the store");
    return Fill(n, a.size, offset, len, buf);
  }

  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check) override {
    CTFS_ASSIGN_OR_RETURN(Node n, Parse(path));
    const FileAttr a = AttrOf(n);
    if (check) CTFS_RETURN_IF_ERROR(check(a));
    if (n.kind != Node::kFile) return Fetched{a, 0};
    return Fetched{a, Fill(n, a.size, 0, len, buf)};
  }

  Result<std::string> ReadLink(const std::string& path) override {
    CTFS_RETURN_IF_ERROR(Parse(path).status());
    return Status::Errno(EINVAL, "readlink " + path + ": not a symbolic link");
  }

  Result<FsStats> StatFs() override {
    FsStats s;
    const uint64_t files = o_.dirs * o_.files_per_dir;
    // Average file size in blocks times files, in floating point: 10^10 files of up to 1 TiB
    // overflow 64 bits.
    const long double blocks = static_cast<long double>(files) *
                               static_cast<long double>((o_.min_bytes + o_.max_bytes) / 2) /
                               static_cast<long double>(s.block_size);
    s.blocks = blocks >= 1.8e19L ? UINT64_MAX : static_cast<uint64_t>(blocks) + 1;
    s.files = files + o_.dirs + 1;
    return s;
  }

  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions&) override {
    return ReadOnly("open for writing", path);
  }
  Result<FileAttr> Mkdir(const std::string& path, mode_t, int64_t, int64_t) override {
    return ReadOnly("mkdir", path);
  }
  Status Unlink(const std::string& path) override { return ReadOnly("unlink", path); }
  Status Rmdir(const std::string& path) override { return ReadOnly("rmdir", path); }
  Status Rename(const std::string& from, const std::string&, bool) override {
    return ReadOnly("rename", from);
  }
  Result<FileAttr> Symlink(const std::string&, const std::string& path, int64_t, int64_t) override {
    return ReadOnly("symlink", path);
  }
  Result<FileAttr> Link(const std::string&, const std::string& to) override {
    return ReadOnly("link", to);
  }
  Result<FileAttr> SetAttr(const std::string& path, const AttrChange&) override {
    return ReadOnly("setattr", path);
  }
  Status SyncDir(const std::string&) override { return Status::OK(); }

 private:
  struct Node {
    enum Kind { kRoot, kDir, kFile } kind = kRoot;
    uint64_t dir = 0;
    uint64_t file = 0;
  };

  // A directory's entries [from, from + count), as many as it has.
  std::vector<DirEntry> Entries(const Node& n, uint64_t from, uint64_t count) const {
    const uint64_t total = n.kind == Node::kRoot ? o_.dirs : o_.files_per_dir;
    const uint64_t end = from + std::min(count, total - std::min(from, total));
    std::vector<DirEntry> out;
    out.reserve(end > from ? end - from : 0);
    for (uint64_t k = from; k < end; ++k) {
      if (n.kind == Node::kRoot) {
        out.push_back({DirName(k), AttrOf(Node{Node::kDir, k, 0})});
      } else {
        out.push_back({FileName(n.dir, k), AttrOf(Node{Node::kFile, n.dir, k})});
      }
    }
    return out;
  }

  class Lister final : public DirLister {
   public:
    Lister(const SyntheticBackend* store, Node dir) : store_(store), dir_(dir) {}
    Result<DirPage> Next(size_t max) override {
      DirPage page;
      page.entries = store_->Entries(dir_, next_, std::max<size_t>(max, 1));
      next_ += page.entries.size();
      const uint64_t total = dir_.kind == Node::kRoot ? store_->o_.dirs : store_->o_.files_per_dir;
      page.last = next_ >= total;
      return page;
    }

   private:
    const SyntheticBackend* const store_;
    const Node dir_;
    uint64_t next_ = 0;
  };

  static Status ReadOnly(const char* what, const std::string& path) {
    return Status::ReadOnly(std::string(what) + " " + path + ": the synthetic store is read-only");
  }

  static std::string DirName(uint64_t d) {
    char name[24];
    std::snprintf(name, sizeof(name), "n%08llu", static_cast<unsigned long long>(d));
    return name;
  }
  static std::string FileName(uint64_t d, uint64_t i) {
    return DirName(d) + "_" + std::to_string(i) + ".JPEG";
  }

  Result<Node> Parse(const std::string& path) const {
    if (path.empty()) return Node{};
    const std::string_view p(path);
    const size_t slash = p.find('/');
    const std::string_view first = p.substr(0, slash);
    uint64_t d = 0;
    if (first.size() != 9 || first[0] != 'n' || !ParseNumber(first.substr(1), 8, &d) ||
        d >= o_.dirs)
      return Status::NotFound(path + ": no such file or directory");
    if (slash == std::string_view::npos) return Node{Node::kDir, d, 0};
    const std::string_view rest = p.substr(slash + 1);
    const std::string_view suffix = ".JPEG";
    uint64_t i = 0;
    if (rest.find('/') != std::string_view::npos) {
      // Below a file: ENOTDIR; below a name that does not exist: ENOENT.
      const std::string_view name = rest.substr(0, rest.find('/'));
      if (Parse(std::string(first) + "/" + std::string(name)).ok())
        return Status::NotDirectory(path + ": not a directory");
      return Status::NotFound(path + ": no such file or directory");
    }
    if (rest.size() <= first.size() + 1 + suffix.size() || rest.substr(0, 9) != first ||
        rest[9] != '_' || rest.substr(rest.size() - suffix.size()) != suffix ||
        !ParseNumber(rest.substr(10, rest.size() - 10 - suffix.size()), 0, &i) ||
        i >= o_.files_per_dir)
      return Status::NotFound(path + ": no such file or directory");
    return Node{Node::kFile, d, i};
  }

  uint64_t FileKey(const Node& n) const {
    return SplitMix64(o_.seed ^ SplitMix64((n.dir << 32) ^ n.file));
  }

  FileAttr AttrOf(const Node& n) const {
    FileAttr a;
    a.mtime_ns = a.ctime_ns = a.atime_ns = mtime_ns_;
    if (n.kind != Node::kFile) {
      a.mode = S_IFDIR | 0555;
      a.nlink = 2;
      a.size = 4096;
      a.blocks = 8;
      return a;
    }
    a.mode = S_IFREG | 0444;
    a.size = o_.min_bytes + FileKey(n) % (o_.max_bytes - o_.min_bytes + 1);
    a.blocks = (a.size + 511) / 512;
    return a;
  }

  size_t Fill(const Node& n, uint64_t size, uint64_t offset, size_t len, char* buf) const {
    if (offset >= size) return 0;
    const size_t count = static_cast<size_t>(std::min<uint64_t>(len, size - offset));
    const uint64_t key = FileKey(n);
    for (size_t done = 0; done < count;) {
      const uint64_t pos = offset + done;
      const uint64_t word = SplitMix64(key + pos / 8);
      const size_t in_word = static_cast<size_t>(pos % 8);
      const size_t take = std::min<size_t>(8 - in_word, count - done);
      char bytes[8];
      std::memcpy(bytes, &word, 8);  // little-endian on every supported machine
      std::memcpy(buf + done, bytes + in_word, take);
      done += take;
    }
    return count;
  }

  const conf::SyntheticOptions o_;
  const int64_t mtime_ns_;
};

}  // namespace

std::unique_ptr<Backend> NewSyntheticBackend(const conf::SyntheticOptions& opts) {
  return std::make_unique<SyntheticBackend>(opts);
}

}  // namespace cubetorchfs::cfs_client
