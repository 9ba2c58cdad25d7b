// Fakes shared by the unit tests.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <vector>
#include <map>
#include <mutex>
#include <string>

#include "cfs_client/backend.h"
#include "common/clock.h"

namespace cubetorchfs::testing {

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
class MemBackend final : public cfs_client::Backend {
 public:
  MemBackend() { AddDir(""); }

  void AddDir(const std::string& path) {
    std::lock_guard<std::mutex> l(mu_);
    cfs_client::FileAttr a;
    a.mode = S_IFDIR | 0755;
    a.nlink = 2;
    nodes_[path] = {a, ""};
  }
  void PutFile(const std::string& path, const std::string& data, int64_t mtime_ns = 1) {
    std::lock_guard<std::mutex> l(mu_);
    cfs_client::FileAttr a;
    a.mode = S_IFREG | 0644;
    a.size = data.size();
    a.mtime_ns = mtime_ns;
    nodes_[path] = {a, data};
  }
  int reads() const { return reads_.load(); }
  // Paths of Read calls, in order.
  std::vector<std::string> read_log() {
    std::lock_guard<std::mutex> l(mu_);
    return read_log_;
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
    std::lock_guard<std::mutex> l(mu_);
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return Status::NotFound(path);
    return it->second.attr;
  }
  Result<std::vector<cfs_client::DirEntry>> List(const std::string& path) override {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<cfs_client::DirEntry> out;
    const std::string prefix = path.empty() ? "" : path + "/";
    for (const auto& [p, n] : nodes_) {
      if (p.empty() || p.rfind(prefix, 0) != 0) continue;
      std::string rest = p.substr(prefix.size());
      if (rest.find('/') == std::string::npos) out.push_back({rest, n.attr});
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
    if (it->second.attr.Version() != expect) return Status::Stale(path);
    const std::string& d = it->second.data;
    if (offset >= d.size()) return size_t{0};
    size_t n = std::min(len, d.size() - offset);
    d.copy(buf, n, offset);
    return n;
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char* buf) override {
    Result<cfs_client::FileAttr> attr = Stat(path);
    stats_--;  // one request, counted as a read
    if (!attr.ok()) return attr.status();
    if (!attr->IsRegular()) return Status::IsDirectory(path);
    Result<size_t> n = Read(path, attr->Version(), 0, len, buf);
    if (!n.ok()) return n.status();
    return Fetched{attr.value(), n.value()};
  }
  Result<std::string> ReadLink(const std::string& path) override {
    return Status::InvalidArgument(path + ": not a symlink");
  }
  Result<cfs_client::FsStats> StatFs() override { return cfs_client::FsStats{}; }

 private:
  struct Node {
    cfs_client::FileAttr attr;
    std::string data;
  };
  std::mutex mu_;
  std::map<std::string, Node> nodes_;
  std::atomic<int> reads_{0};
  std::vector<std::string> read_log_;
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  bool gate_open_ = true;
  std::atomic<int> blocked_{0};
  std::atomic<int> stats_{0};
};

}  // namespace cubetorchfs::testing
