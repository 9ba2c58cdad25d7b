// Fakes shared by the unit tests.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "cfs_client/backend.h"
#include "common/clock.h"

namespace cubetorchfs::testing {

// Lists `path` of `b` in pages of at most `page` entries and checks what a paged listing
// promises: no page larger, each name once, the same names as a whole List, the last page
// marked (and nothing asked after it). Returns the names in the order listed.
inline std::vector<std::string> ListInPages(cfs_client::Backend& b, const std::string& path,
                                            size_t page) {
  std::vector<std::string> names;
  Result<std::unique_ptr<cfs_client::DirLister>> lister = b.ListPages(path);
  EXPECT_TRUE(lister.ok()) << lister.status().ToString();
  if (!lister.ok()) return names;
  size_t pages = 0;
  for (bool last = false; !last;) {
    Result<cfs_client::DirPage> p = (*lister)->Next(page);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok() || ++pages > 1'000'000) break;
    EXPECT_LE(p->entries.size(), page);
    for (const cfs_client::DirEntry& e : p->entries) names.push_back(e.name);
    last = p->last;
  }
  std::set<std::string> once(names.begin(), names.end());
  EXPECT_EQ(once.size(), names.size()) << "a name listed twice";
  Result<std::vector<cfs_client::DirEntry>> whole = b.List(path);
  EXPECT_TRUE(whole.ok());
  if (whole.ok()) {
    std::set<std::string> all;
    for (const cfs_client::DirEntry& e : *whole) all.insert(e.name);
    EXPECT_EQ(all, once);
  }
  return names;
}

// `n` bytes that differ with `seed` and repeat only every 251 bytes: file contents for tests.
inline std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed) % 251);
  return s;
}

// A clock that moves only when told to (or when something sleeps on it).
class FakeClock final : public Clock {
 public:
  uint64_t NowNanos() override { return now_.load(); }
  void SleepMicros(uint64_t micros) override { now_ += micros * 1000; }
  void AdvanceSeconds(double s) { now_ += static_cast<uint64_t>(s * 1e9); }

 private:
  std::atomic<uint64_t> now_{1'000'000'000};
};

// An in-memory store: files and directories by path, with counters of requests.
//
// Writes: by default a WritableFile edits its file's bytes in place, following the file (not
// the name) across renames and unlinks, like a posix descriptor. In object-store mode
// (SetObjectStore) it edits a private copy, published at the path on Flush/Sync (like the s3
// backend's staging file): a new file is not in the store until then.
class MemBackend final : public cfs_client::Backend {
 public:
  MemBackend() { AddDir(""); }

  void AddDir(const std::string& path) {
    std::lock_guard<std::mutex> l(mu_);
    cfs_client::FileAttr a;
    a.mode = S_IFDIR | 0755;
    a.nlink = 2;
    a.store_ino = identities_ ? ++next_store_ino_ : 0;
    nodes_[path] = std::make_shared<Node>(Node{a, ""});
  }
  void PutFile(const std::string& path, const std::string& data, int64_t mtime_ns = 1) {
    std::lock_guard<std::mutex> l(mu_);
    cfs_client::FileAttr a;
    a.mode = S_IFREG | 0644;
    a.size = data.size();
    a.mtime_ns = mtime_ns;
    auto it = nodes_.find(path);
    if (it != nodes_.end() && it->second->attr.IsRegular()) {
      a.store_ino = it->second->attr.store_ino;
      *it->second = Node{a, data};  // rewritten in place: open files see it
    } else {
      // A new file: an identity of its own, as on posix (once GiveIdentities was called).
      a.store_ino = identities_ ? ++next_store_ino_ : 0;
      nodes_[path] = std::make_shared<Node>(Node{a, data});
    }
  }
  void SetObjectStore(bool on) { object_store_ = on; }
  // Files put from now on get a store identity (FileAttr::store_ino) each, as on posix; a
  // rewrite in place keeps it. Off by default: versions written by hand in tests then match.
  void GiveIdentities() {
    std::lock_guard<std::mutex> l(mu_);
    identities_ = true;
  }
  int reads() const { return reads_.load(); }
  // Paths of Read calls, in order.
  std::vector<std::string> read_log() {
    std::lock_guard<std::mutex> l(mu_);
    return read_log_;
  }
  // Paths of List calls, in order.
  std::vector<std::string> list_log() {
    std::lock_guard<std::mutex> l(mu_);
    return list_log_;
  }
  // While closed, Read calls block (after recording themselves) until Open().
  void CloseGate() {
    std::lock_guard<std::mutex> l(gate_mu_);
    gate_open_ = false;
  }
  void OpenGate() {
    {
      std::lock_guard<std::mutex> l(gate_mu_);
      gate_open_ = true;
    }
    gate_cv_.notify_all();
  }
  int blocked_reads() const { return blocked_.load(); }
  int stats() const { return stats_.load(); }

  Result<cfs_client::FileAttr> Stat(const std::string& path) override {
    stats_++;
    if (down_.load()) return Status::IOError("store does not answer");
    std::lock_guard<std::mutex> l(mu_);
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return Status::NotFound(path);
    return it->second->attr;
  }
  Result<std::vector<cfs_client::DirEntry>> List(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    list_log_.push_back(path);
    std::vector<cfs_client::DirEntry> out;
    const std::string prefix = path.empty() ? "" : path + "/";
    for (const auto& [p, n] : nodes_) {
      if (p.empty() || p.rfind(prefix, 0) != 0) continue;
      std::string rest = p.substr(prefix.size());
      if (rest.find('/') == std::string::npos) out.push_back({rest, n->attr});
    }
    return out;
  }
  Result<size_t> Read(const std::string& path, const cfs_client::FileVersion& expect,
                      uint64_t offset, size_t len, char* buf) override {
    reads_++;
    {
      std::unique_lock<std::mutex> g(gate_mu_);
      if (!gate_open_) {
        blocked_++;
        gate_cv_.wait(g, [&] { return gate_open_; });
        blocked_--;
      }
    }
    std::lock_guard<std::mutex> l(mu_);
    read_log_.push_back(path);
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return Status::NotFound(path);
    if (it->second->attr.Version() != expect) return Status::Stale(path);
    const std::string& d = it->second->data;
    if (offset >= d.size()) return size_t{0};
    size_t n = std::min(len, d.size() - offset);
    d.copy(buf, n, offset);
    return n;
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf,
                           const AttrCheck& check = nullptr) override {
    Result<cfs_client::FileAttr> attr = Stat(path);
    stats_--;  // one request, counted as a read
    if (!attr.ok()) return attr.status();
    if (!attr->IsRegular()) return Status::IsDirectory(path);
    if (check) CTFS_RETURN_IF_ERROR(check(attr.value()));
    Result<size_t> n = Read(path, attr->Version(), 0, len, buf);
    if (!n.ok()) return n.status();
    return Fetched{attr.value(), n.value()};
  }
  // As an object store's GET: a regular file's attributes and first bytes, one request.
  Result<Fetched> LookupRead(const std::string& path, size_t len, char* buf) override {
    Result<cfs_client::FileAttr> attr = Stat(path);
    if (!attr.ok() || !attr->IsRegular()) {
      if (!attr.ok()) return attr.status();
      return Fetched{attr.value(), 0};
    }
    stats_--;  // one request, counted as a read
    Result<size_t> n = Read(path, attr->Version(), 0, len, buf);
    if (!n.ok()) return n.status();
    return Fetched{attr.value(), n.value()};
  }
  Result<std::string> ReadLink(const std::string& path) override {
    return Status::InvalidArgument(path + ": not a symlink");
  }
  Result<cfs_client::FsStats> StatFs() override { return cfs_client::FsStats{}; }

  // --- writes ---
  std::string Data(const std::string& path) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = nodes_.find(path);
    return it == nodes_.end() ? std::string("<missing>") : it->second->data;
  }
  bool Exists(const std::string& path) {
    std::lock_guard<std::mutex> l(mu_);
    return nodes_.count(path) > 0;
  }
  // The next `n` write-side calls (writes, flushes, syncs, namespace changes) fail with `s`.
  void FailWrites(int n, Status s) {
    std::lock_guard<std::mutex> l(mu_);
    fail_writes_ = n;
    fail_status_ = std::move(s);
  }
  // Called by every WritableFile::Flush before it publishes (e.g. to block it, as a slow
  // upload would). Set before the files are used.
  void SetFlushGate(std::function<void()> gate) { flush_gate_ = std::move(gate); }
  // The next `n` WritableFile closes fail with `s` (the file is closed all the same).
  void FailCloses(int n, Status s) {
    std::lock_guard<std::mutex> l(mu_);
    fail_closes_ = n;
    close_status_ = std::move(s);
  }
  // While down, every Stat (and so every StatRead) fails with IOError: the store does not
  // answer.
  void SetDown(bool down) { down_.store(down); }
  // Reports an outage (InOutage) as a metered wrapper would once a request failed to reach the
  // store; independent of SetDown, which makes requests fail.
  void SetOutage(bool outage) { outage_.store(outage); }
  bool InOutage() const override { return outage_.load(); }
  int syncs() const { return syncs_.load(); }
  int flushes() const { return flushes_.load(); }
  int closes() const { return closes_.load(); }
  int discards() const { return discards_.load(); }
  // WritableFiles open now.
  int open_files() const { return open_files_.load(); }

  struct Node {
    cfs_client::FileAttr attr;
    std::string data;
  };

  class MemFile final : public cfs_client::WritableFile {
   public:
    MemFile(MemBackend* b, std::string path, std::shared_ptr<Node> node)
        : b_(b), path_(std::move(path)), node_(std::move(node)) {
      b_->open_files_++;
    }
    ~MemFile() override { b_->open_files_--; }
    Result<size_t> Write(uint64_t offset, const char* data, size_t len) override {
      std::lock_guard<std::mutex> l(b_->mu_);
      CTFS_RETURN_IF_ERROR(b_->MaybeFailLocked());
      Node& n = *node_;
      if (n.data.size() < offset + len) n.data.resize(offset + len, '\0');
      n.data.replace(offset, len, data, len);
      b_->TouchLocked(n);
      return len;
    }
    Result<size_t> Read(uint64_t offset, size_t len, char* buf) override {
      std::lock_guard<std::mutex> l(b_->mu_);
      const Node& n = *node_;
      if (offset >= n.data.size()) return size_t{0};
      size_t k = std::min(len, n.data.size() - offset);
      n.data.copy(buf, k, offset);
      return k;
    }
    Status Truncate(uint64_t size) override {
      std::lock_guard<std::mutex> l(b_->mu_);
      CTFS_RETURN_IF_ERROR(b_->MaybeFailLocked());
      node_->data.resize(size, '\0');
      b_->TouchLocked(*node_);
      return Status::OK();
    }
    Status Allocate(int, uint64_t, uint64_t) override { return Status::NotSupported("fallocate"); }
    Status Flush() override {
      b_->flushes_++;
      if (b_->flush_gate_) b_->flush_gate_();  // a slow upload, outside the store's lock
      std::lock_guard<std::mutex> l(b_->mu_);
      CTFS_RETURN_IF_ERROR(b_->MaybeFailLocked());
      return PublishLocked();
    }
    Status Sync() override {
      b_->syncs_++;
      std::lock_guard<std::mutex> l(b_->mu_);
      CTFS_RETURN_IF_ERROR(b_->MaybeFailLocked());
      return PublishLocked();
    }
    Result<cfs_client::FileAttr> Stat() override {
      std::lock_guard<std::mutex> l(b_->mu_);
      return node_->attr;
    }
    void Moved(const std::string& path) override {
      std::lock_guard<std::mutex> l(b_->mu_);
      path_ = path;
    }
    Status Close() override {
      b_->closes_++;
      std::lock_guard<std::mutex> l(b_->mu_);
      if (b_->fail_closes_ <= 0) return Status::OK();
      b_->fail_closes_--;
      return b_->close_status_;
    }
    void Discard() override {
      b_->discards_++;
      std::lock_guard<std::mutex> l(b_->mu_);
      discarded_ = true;
    }

   private:
    // Object-store mode: the private copy becomes the object at path_. REQUIRES: b_->mu_.
    Status PublishLocked() {
      if (!b_->object_store_ || discarded_) return Status::OK();
      b_->nodes_[path_] = std::make_shared<Node>(*node_);
      return Status::OK();
    }

    MemBackend* const b_;
    std::string path_;
    const std::shared_ptr<Node> node_;
    bool discarded_ = false;
  };

  Result<std::unique_ptr<cfs_client::WritableFile>> OpenWrite(
      const std::string& path, const cfs_client::OpenWriteOptions& o) override {
    std::lock_guard<std::mutex> l(mu_);
    CTFS_RETURN_IF_ERROR(MaybeFailLocked());
    auto it = nodes_.find(path);
    std::shared_ptr<Node> node;
    if (it == nodes_.end()) {
      if (!o.create) return Status::NotFound(path);
      cfs_client::FileAttr a;
      a.mode = S_IFREG | o.mode;
      a.mtime_ns = ++mtime_;
      node = std::make_shared<Node>(Node{a, ""});
      if (!object_store_) nodes_[path] = node;
    } else if (o.create && o.exclusive) {
      return Status::Exists(path);
    } else if (it->second->attr.IsDir()) {
      return Status::IsDirectory(path);
    } else {
      node = object_store_ ? std::make_shared<Node>(*it->second) : it->second;
      if (o.truncate) {
        node->data.clear();
        TouchLocked(*node);
      }
    }
    return std::unique_ptr<cfs_client::WritableFile>(new MemFile(this, path, std::move(node)));
  }
  Result<cfs_client::FileAttr> Mkdir(const std::string& path, mode_t, int64_t, int64_t) override {
    std::lock_guard<std::mutex> l(mu_);
    CTFS_RETURN_IF_ERROR(MaybeFailLocked());
    if (nodes_.count(path)) return Status::Exists(path);
    cfs_client::FileAttr a;
    a.mode = S_IFDIR | 0755;
    a.nlink = 2;
    nodes_[path] = std::make_shared<Node>(Node{a, ""});
    return a;
  }
  Status Unlink(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    CTFS_RETURN_IF_ERROR(MaybeFailLocked());
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return Status::NotFound(path);
    if (it->second->attr.IsDir()) return Status::IsDirectory(path);
    nodes_.erase(it);
    return Status::OK();
  }
  Status Rmdir(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    CTFS_RETURN_IF_ERROR(MaybeFailLocked());
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return Status::NotFound(path);
    if (!it->second->attr.IsDir()) return Status::NotDirectory(path);
    for (const auto& [p, n] : nodes_)
      if (p.rfind(path + "/", 0) == 0) return Status::NotEmpty(path);
    nodes_.erase(it);
    return Status::OK();
  }
  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    std::lock_guard<std::mutex> l(mu_);
    CTFS_RETURN_IF_ERROR(MaybeFailLocked());
    auto it = nodes_.find(from);
    if (it == nodes_.end()) return Status::NotFound(from);
    if (noreplace && nodes_.count(to)) return Status::Exists(to);
    std::shared_ptr<Node> n = it->second;
    nodes_.erase(it);
    nodes_[to] = std::move(n);
    // A directory's entries move with it.
    const std::string prefix = from + "/";
    std::vector<std::pair<std::string, std::shared_ptr<Node>>> under;
    for (auto c = nodes_.lower_bound(prefix);
         c != nodes_.end() && c->first.compare(0, prefix.size(), prefix) == 0;)
      under.emplace_back(c->first, c->second), c = nodes_.erase(c);
    for (auto& [p, node] : under) nodes_[to + p.substr(from.size())] = std::move(node);
    return Status::OK();
  }
  Result<cfs_client::FileAttr> Symlink(const std::string&, const std::string& path, int64_t,
                                       int64_t) override {
    return Status::NotSupported(path);
  }
  Result<cfs_client::FileAttr> Link(const std::string& from, const std::string&) override {
    return Status::NotSupported(from);
  }
  Result<cfs_client::FileAttr> SetAttr(const std::string& path,
                                       const cfs_client::AttrChange& c) override {
    std::lock_guard<std::mutex> l(mu_);
    CTFS_RETURN_IF_ERROR(MaybeFailLocked());
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return Status::NotFound(path);
    if (c.mode) it->second->attr.mode = (it->second->attr.mode & S_IFMT) | *c.mode;
    return it->second->attr;
  }
  Status SyncDir(const std::string&) override { return Status::OK(); }

 private:
  // REQUIRES: mu_ held.
  Status MaybeFailLocked() {
    if (fail_writes_ <= 0) return Status::OK();
    fail_writes_--;
    return fail_status_;
  }
  void TouchLocked(Node& n) {
    n.attr.size = n.data.size();
    n.attr.mtime_ns = ++mtime_;
  }

  std::mutex mu_;
  uint64_t next_store_ino_ = 1000;  // guarded by mu_
  bool identities_ = false;         // guarded by mu_
  std::map<std::string, std::shared_ptr<Node>> nodes_;
  std::atomic<bool> object_store_{false};
  int fail_writes_ = 0;
  Status fail_status_;
  int fail_closes_ = 0;
  Status close_status_;
  int64_t mtime_ = 1000;
  std::atomic<int> syncs_{0};
  std::atomic<int> flushes_{0};
  std::function<void()> flush_gate_;
  std::atomic<int> closes_{0};
  std::atomic<int> discards_{0};
  std::atomic<int> open_files_{0};
  std::atomic<int> reads_{0};
  std::vector<std::string> read_log_;
  std::vector<std::string> list_log_;
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  bool gate_open_ = true;
  std::atomic<int> blocked_{0};
  std::atomic<int> stats_{0};
  std::atomic<bool> down_{false};
  std::atomic<bool> outage_{false};
};

}  // namespace cubetorchfs::testing
