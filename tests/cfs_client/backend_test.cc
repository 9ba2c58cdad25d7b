// What every backend reports it can do, and the wrapper base the injection and metrics
// wrappers derive from.
#include "cfs_client/backend.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "conf/config.h"
#include "tests/test_util.h"

namespace cubetorchfs::cfs_client {
namespace {

namespace stdfs = std::filesystem;

class CapabilitiesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = stdfs::temp_directory_path() / ("ctfs_caps_" + std::to_string(::getpid()));
    stdfs::remove_all(root_);
    stdfs::create_directories(root_);
  }
  void TearDown() override { stdfs::remove_all(root_); }

  conf::BackendOptions Options(conf::BackendType type) const {
    conf::BackendOptions o;
    o.type = type;
    o.root = root_.string();
    o.s3.endpoint = "http://127.0.0.1:9";  // never asked: construction makes no request
    o.s3.bucket = "bkt";
    o.cubefs.lib = FAKE_LIBCFS;
    o.cubefs.master_addr = "127.0.0.1:17010";
    o.cubefs.volume = root_.string();
    o.cubefs.access_key = "ak";
    o.cubefs.secret_key = "sk";
    return o;
  }

  stdfs::path root_;
  prometheus::Registry registry_;
  testing::FakeClock clock_;
};

TEST_F(CapabilitiesTest, EachBackendReportsWhatItCanDo) {
  Capabilities posix = NewPosixBackend(root_.string()).value()->capabilities();
  EXPECT_TRUE(posix.has_owners);
  EXPECT_TRUE(posix.hands_out_fds);
  EXPECT_FALSE(posix.lookup_returns_data);
  EXPECT_FALSE(posix.writes_own_logs);

  Capabilities s3 = NewS3Backend(Options(conf::BackendType::kS3).s3).value()->capabilities();
  EXPECT_FALSE(s3.has_owners);  // one owner and mode for all, no symlinks
  EXPECT_FALSE(s3.hands_out_fds);
  EXPECT_TRUE(s3.lookup_returns_data);
  EXPECT_FALSE(s3.writes_own_logs);

  Capabilities cubefs =
      NewCubefsBackend(Options(conf::BackendType::kCubefs).cubefs).value()->capabilities();
  EXPECT_TRUE(cubefs.has_owners);
  EXPECT_FALSE(cubefs.hands_out_fds);
  EXPECT_FALSE(cubefs.lookup_returns_data);
  EXPECT_TRUE(cubefs.writes_own_logs);

  Capabilities synthetic = NewSyntheticBackend({})->capabilities();
  EXPECT_TRUE(synthetic.has_owners);
  EXPECT_FALSE(synthetic.hands_out_fds);
  EXPECT_FALSE(synthetic.lookup_returns_data);
  EXPECT_FALSE(synthetic.writes_own_logs);

  // A store that does not say: its owners are checked, and nothing else is assumed.
  EXPECT_EQ(testing::MemBackend().capabilities(), Capabilities{});
  EXPECT_TRUE(Capabilities{}.has_owners);
}

// What the daemon decides before the store is built is what the built store then reports,
// through the injection and metrics wrappers.
TEST_F(CapabilitiesTest, KnownBeforeTheBackendIsBuilt) {
  for (conf::BackendType type : {conf::BackendType::kPosix, conf::BackendType::kS3,
                                 conf::BackendType::kCubefs, conf::BackendType::kSynthetic}) {
    SCOPED_TRACE(conf::BackendTypeName(type));
    for (bool inject : {false, true}) {
      conf::BackendOptions o = Options(type);
      o.inject.enabled = inject;
      o.inject.latency_us = inject ? 1 : 0;
      Result<std::unique_ptr<Backend>> b = NewBackend(o, registry_, &clock_);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      EXPECT_EQ((*b)->capabilities(), CapabilitiesOf(o));
      Capabilities expected = CapabilitiesOfType(type);
      if (inject) expected.hands_out_fds = false;  // every byte passes the injection
      EXPECT_EQ(CapabilitiesOf(o), expected);
    }
  }
  // An injection section that injects nothing leaves the descriptors.
  conf::BackendOptions o = Options(conf::BackendType::kPosix);
  o.inject.enabled = true;
  EXPECT_TRUE(CapabilitiesOf(o).hands_out_fds);
  EXPECT_TRUE(NewBackend(o, registry_, &clock_).value()->capabilities().hands_out_fds);
}

TEST_F(CapabilitiesTest, ThePosixFactoryAndCheckNameTheRoot) {
  conf::BackendOptions o = Options(conf::BackendType::kPosix);
  o.root = (root_ / "missing").string();
  Result<std::unique_ptr<Backend>> b = NewBackend(o, registry_, &clock_);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message().rfind("backend.root: ", 0), 0u) << b.status().message();
  Status check = CheckBackend(&o);
  ASSERT_FALSE(check.ok());
  EXPECT_EQ(check.message().rfind("backend.root: ", 0), 0u) << check.message();
  o.root = root_.string() + "/./";
  ASSERT_TRUE(CheckBackend(&o).ok());
  EXPECT_EQ(o.root, stdfs::canonical(root_).string());  // the real path
  o = Options(conf::BackendType::kCubefs);
  o.cubefs.lib = "/nonexistent/libcfs.so";
  check = CheckBackend(&o);
  ASSERT_FALSE(check.ok());
  EXPECT_EQ(check.message().rfind("backend.cubefs.lib: ", 0), 0u) << check.message();
}

TEST_F(CapabilitiesTest, StoreNames) {
  EXPECT_EQ(StoreName(Options(conf::BackendType::kPosix)), root_.string());
  EXPECT_EQ(StoreName(Options(conf::BackendType::kS3)), "http://127.0.0.1:9/bkt");
  EXPECT_EQ(StoreName(Options(conf::BackendType::kCubefs)),
            "cubefs://127.0.0.1:17010/" + root_.string());
  EXPECT_EQ(StoreName(Options(conf::BackendType::kSynthetic)), "synthetic");
}

// A store that records every call made to it, and answers each with a value of its own.
class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(std::vector<std::string>* calls) : calls_(calls) {}

  Capabilities capabilities() const override {
    calls_->push_back("capabilities");
    Capabilities c;
    c.has_owners = false;
    c.lookup_returns_data = true;
    c.hands_out_fds = true;
    c.writes_own_logs = true;
    return c;
  }
  Result<FileAttr> Stat(const std::string& path) override { return Attr("Stat " + path); }
  Result<std::vector<DirEntry>> List(const std::string& path) override {
    Record("List " + path);
    return std::vector<DirEntry>{DirEntry{"e", {}}};
  }
  Result<size_t> Read(const std::string& path, const FileVersion& expect, uint64_t offset,
                      size_t len, char*) override {
    Record("Read " + path + " " + std::to_string(expect.size) + " " + std::to_string(offset) + " " +
           std::to_string(len));
    return size_t{7};
  }
  Result<Fetched> StatRead(const std::string& path, size_t len, char*,
                           const AttrCheck& check) override {
    Record("StatRead " + path + " " + std::to_string(len) + (check ? " check" : ""));
    return Fetched{{}, 8};
  }
  Result<Fetched> LookupRead(const std::string& path, size_t len, char*) override {
    Record("LookupRead " + path + " " + std::to_string(len));
    return Fetched{{}, 9};
  }
  Result<std::string> ReadLink(const std::string& path) override {
    Record("ReadLink " + path);
    return std::string("target");
  }
  Result<FsStats> StatFs() override {
    Record("StatFs");
    FsStats s;
    s.files = 11;
    return s;
  }
  Result<int> OpenReadFd(const std::string& path, const FileVersion&,
                         const AttrCheck& check) override {
    Record("OpenReadFd " + path + (check ? " check" : ""));
    return 12;
  }
  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& options) override {
    Record("OpenWrite " + path + (options.create ? " create" : ""));
    return Status::NoSpace("recorded");
  }
  Result<FileAttr> Mkdir(const std::string& path, mode_t mode, int64_t uid, int64_t gid) override {
    return Attr("Mkdir " + path + " " + std::to_string(mode) + " " + std::to_string(uid) + " " +
                std::to_string(gid));
  }
  Status Unlink(const std::string& path) override { return Done("Unlink " + path); }
  Status Rmdir(const std::string& path) override { return Done("Rmdir " + path); }
  Status Rename(const std::string& from, const std::string& to, bool noreplace) override {
    return Done("Rename " + from + " " + to + (noreplace ? " noreplace" : ""));
  }
  Result<FileAttr> Symlink(const std::string& target, const std::string& path, int64_t,
                           int64_t) override {
    return Attr("Symlink " + target + " " + path);
  }
  Result<FileAttr> Link(const std::string& from, const std::string& to) override {
    return Attr("Link " + from + " " + to);
  }
  Result<FileAttr> Mknod(const std::string& path, mode_t, uint64_t rdev, int64_t,
                         int64_t) override {
    return Attr("Mknod " + path + " " + std::to_string(rdev));
  }
  Result<FileAttr> SetAttr(const std::string& path, const AttrChange& change) override {
    return Attr("SetAttr " + path + (change.mode ? " mode" : ""));
  }
  Status SyncDir(const std::string& path) override { return Done("SyncDir " + path); }

 private:
  void Record(const std::string& call) const { calls_->push_back(call); }
  Result<FileAttr> Attr(const std::string& call) const {
    Record(call);
    FileAttr a;
    a.size = calls_->size();
    return a;
  }
  Status Done(const std::string& call) const {
    Record(call);
    return Status::Exists(call);
  }

  std::vector<std::string>* const calls_;
};

// A file being written that records every call made to it.
class RecordingFile final : public WritableFile {
 public:
  explicit RecordingFile(std::vector<std::string>* calls) : calls_(calls) {}
  Result<size_t> Write(uint64_t offset, const char*, size_t len) override {
    calls_->push_back("Write " + std::to_string(offset) + " " + std::to_string(len));
    return len;
  }
  Result<size_t> Read(uint64_t offset, size_t len, char*) override {
    calls_->push_back("Read " + std::to_string(offset) + " " + std::to_string(len));
    return size_t{3};
  }
  Status Truncate(uint64_t size) override {
    calls_->push_back("Truncate " + std::to_string(size));
    return Status::OK();
  }
  Status Allocate(int mode, uint64_t offset, uint64_t len) override {
    calls_->push_back("Allocate " + std::to_string(mode) + " " + std::to_string(offset) + " " +
                      std::to_string(len));
    return Status::NotSupported("recorded");
  }
  Status Flush() override {
    calls_->push_back("Flush");
    return Status::OK();
  }
  Status Sync() override {
    calls_->push_back("Sync");
    return Status::OK();
  }
  Result<FileAttr> Stat() override {
    calls_->push_back("Stat");
    FileAttr a;
    a.size = 42;
    return a;
  }
  void Moved(const std::string& path) override { calls_->push_back("Moved " + path); }
  Status Close() override {
    calls_->push_back("Close");
    return Status::IOError("recorded");
  }
  void Discard() override { calls_->push_back("Discard"); }

 private:
  std::vector<std::string>* const calls_;
};

// A wrapper that changes nothing: every call must reach the wrapped store as it was made,
// and its answer come back unchanged.
class PlainWrapper final : public BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
};
class PlainFileWrapper final : public WritableFileWrapper {
 public:
  using WritableFileWrapper::WritableFileWrapper;
};

TEST(BackendWrapperTest, ForwardsEveryCall) {
  std::vector<std::string> calls;
  PlainWrapper w(std::make_unique<RecordingBackend>(&calls));
  Backend& b = w;  // through the interface, as callers use it
  char buf[16];
  const Backend::AttrCheck check = [](const FileAttr&) { return Status::OK(); };

  Capabilities c = b.capabilities();
  EXPECT_FALSE(c.has_owners);
  EXPECT_TRUE(c.lookup_returns_data && c.hands_out_fds && c.writes_own_logs);
  EXPECT_EQ(b.Stat("s")->size, 2u);
  EXPECT_EQ(b.List("l")->at(0).name, "e");
  EXPECT_EQ(*b.Read("r", {5, 1}, 6, 7, buf), 7u);
  EXPECT_EQ(b.StatRead("sr", 16, buf, check)->bytes, 8u);
  EXPECT_EQ(b.LookupRead("lr", 16, buf)->bytes, 9u);
  EXPECT_EQ(*b.ReadLink("rl"), "target");
  EXPECT_EQ(b.StatFs()->files, 11u);
  EXPECT_EQ(*b.OpenReadFd("fd", {1, 1}, check), 12);
  OpenWriteOptions ow;
  ow.create = true;
  EXPECT_EQ(b.OpenWrite("w", ow).status().code(), Status::Code::kNoSpace);
  EXPECT_TRUE(b.Mkdir("d", 0755, 1, 2).ok());
  EXPECT_EQ(b.Unlink("u").code(), Status::Code::kExists);
  EXPECT_EQ(b.Rmdir("rd").code(), Status::Code::kExists);
  EXPECT_EQ(b.Rename("a", "b", true).message(), "Rename a b noreplace");
  EXPECT_TRUE(b.Symlink("t", "sl", 0, 0).ok());
  EXPECT_TRUE(b.Link("x", "y").ok());
  EXPECT_TRUE(b.Mknod("n", S_IFIFO | 0644, 3, 0, 0).ok());
  AttrChange change;
  change.mode = 0600;
  EXPECT_TRUE(b.SetAttr("sa", change).ok());
  EXPECT_EQ(b.SyncDir("sd").code(), Status::Code::kExists);

  const std::vector<std::string> expected = {"capabilities",
                                             "Stat s",
                                             "List l",
                                             "Read r 5 6 7",
                                             "StatRead sr 16 check",
                                             "LookupRead lr 16",
                                             "ReadLink rl",
                                             "StatFs",
                                             "OpenReadFd fd check",
                                             "OpenWrite w create",
                                             "Mkdir d 493 1 2",
                                             "Unlink u",
                                             "Rmdir rd",
                                             "Rename a b noreplace",
                                             "Symlink t sl",
                                             "Link x y",
                                             "Mknod n 3",
                                             "SetAttr sa mode",
                                             "SyncDir sd"};
  EXPECT_EQ(calls, expected);
}

TEST(BackendWrapperTest, FileWrapperForwardsEveryCall) {
  std::vector<std::string> calls;
  PlainFileWrapper w(std::make_unique<RecordingFile>(&calls));
  WritableFile& f = w;
  char buf[8] = {};
  EXPECT_EQ(*f.Write(1, buf, 2), 2u);
  EXPECT_EQ(*f.Read(3, 4, buf), 3u);
  EXPECT_TRUE(f.Truncate(5).ok());
  EXPECT_EQ(f.Allocate(1, 6, 7).code(), Status::Code::kNotSupported);
  EXPECT_TRUE(f.Flush().ok());
  EXPECT_TRUE(f.Sync().ok());
  EXPECT_EQ(f.Stat()->size, 42u);
  f.Moved("new");
  f.Discard();
  EXPECT_EQ(f.Close().code(), Status::Code::kIOError);
  const std::vector<std::string> expected = {
      "Write 1 2", "Read 3 4", "Truncate 5", "Allocate 1 6 7", "Flush",
      "Sync",      "Stat",     "Moved new",  "Discard",        "Close"};
  EXPECT_EQ(calls, expected);
}

// The metrics wrapper counts fallocate under its own op, not as a truncate.
TEST(BackendWrapperTest, MeteredFallocateHasItsOwnOp) {
  prometheus::Registry registry;
  testing::FakeClock clock;
  auto store = std::make_unique<testing::MemBackend>();
  std::unique_ptr<Backend> b = NewMeteredBackend(std::move(store), registry, &clock);
  OpenWriteOptions ow;
  ow.create = true;
  std::unique_ptr<WritableFile> f = b->OpenWrite("f", ow).value();
  (void)f->Allocate(0, 0, 4096);
  ASSERT_TRUE(f->Truncate(10).ok());
  double fallocate = -1, truncate = -1;
  for (const auto& family : registry.Collect()) {
    if (family.name != "cubetorchfs_backend_requests_total") continue;
    for (const auto& m : family.metric) {
      std::string op, status;
      for (const auto& l : m.label) {
        if (l.name == "op") op = l.value;
        if (l.name == "status") status = l.value;
      }
      double sum = m.counter.value;
      if (op == "fallocate") fallocate = std::max(fallocate, 0.0) + sum;
      if (op == "truncate") truncate = std::max(truncate, 0.0) + sum;
    }
  }
  EXPECT_EQ(fallocate, 1);
  EXPECT_EQ(truncate, 1);
}

// Bytes read from the store are counted, whichever call read them; a failed read adds none.
TEST(BackendWrapperTest, MeteredReadBytesCountWhatTheStoreReturned) {
  prometheus::Registry registry;
  testing::FakeClock clock;
  auto store = std::make_unique<testing::MemBackend>();
  store->PutFile("a", std::string(1000, 'a'));
  store->PutFile("b", std::string(300, 'b'));
  std::unique_ptr<Backend> b = NewMeteredBackend(std::move(store), registry, &clock);
  char buf[4096];
  ASSERT_EQ(b->StatRead("a", sizeof(buf), buf).value().bytes, 1000u);
  const FileVersion v = b->Stat("b").value().Version();
  ASSERT_EQ(b->Read("b", v, 100, sizeof(buf), buf).value(), 200u);
  EXPECT_FALSE(b->StatRead("missing", sizeof(buf), buf).ok());
  double bytes = -1;
  for (const auto& family : registry.Collect())
    if (family.name == "cubetorchfs_backend_read_bytes_total")
      bytes = family.metric.at(0).counter.value;
  EXPECT_EQ(bytes, 1200);
}

// A store whose file writes fail with IOError (CubeFS without a writable data partition) and
// whose stats fail while `down` (the store does not answer).
class WritesFail final : public BackendWrapper {
 public:
  explicit WritesFail(std::atomic<bool>* down)
      : BackendWrapper(std::make_unique<testing::MemBackend>()), down_(down) {}
  Result<FileAttr> Stat(const std::string& path) override {
    if (down_->load()) return Status::IOError("connection refused");
    return base()->Stat(path);
  }
  Result<std::unique_ptr<WritableFile>> OpenWrite(const std::string& path,
                                                  const OpenWriteOptions& options) override {
    class Failing final : public WritableFileWrapper {
     public:
      using WritableFileWrapper::WritableFileWrapper;
      Result<size_t> Write(uint64_t, const char*, size_t) override {
        return Status::IOError("no writable data partition");
      }
      Status Flush() override { return Status::IOError("no writable data partition"); }
    };
    Result<std::unique_ptr<WritableFile>> f = base()->OpenWrite(path, options);
    if (!f.ok()) return f.status();
    return std::unique_ptr<WritableFile>(std::make_unique<Failing>(std::move(f).value()));
  }

 private:
  std::atomic<bool>* const down_;
};

// A metered WritesFail, and what its tests turn and read.
struct MeteredWritesFail {
  prometheus::Registry registry;
  testing::FakeClock clock;
  std::atomic<bool> down{false};
  std::unique_ptr<Backend> backend =
      NewMeteredBackend(std::make_unique<WritesFail>(&down), registry, &clock);
};

// A failed write of a file is its writer's error, not an outage of the store: only requests
// that fail to reach the store open one (and are logged once).
TEST(BackendWrapperTest, MeteredOutageIsNotOpenedByAFailedWrite) {
  MeteredWritesFail m;
  std::atomic<bool>& down = m.down;
  testing::FakeClock& clock = m.clock;
  Backend* b = m.backend.get();
  ASSERT_TRUE(b->Stat("").ok());
  EXPECT_FALSE(StoreDown());
  OpenWriteOptions ow;
  ow.create = true;
  std::unique_ptr<WritableFile> f = b->OpenWrite("f", ow).value();
  clock.AdvanceSeconds(0.001);
  EXPECT_FALSE(f->Write(0, "x", 1).ok());
  EXPECT_FALSE(f->Flush().ok());
  EXPECT_FALSE(StoreDown());
  down = true;
  clock.AdvanceSeconds(0.001);
  EXPECT_FALSE(b->Stat("").ok());
  EXPECT_TRUE(StoreDown());
  down = false;
  clock.AdvanceSeconds(0.001);
  EXPECT_TRUE(b->Stat("").ok());
  EXPECT_FALSE(StoreDown());
  f->Discard();
}

// An outage ends when the store answers again even if nothing else asks it: callers serve
// what they hold while InOutage(), so the metered wrapper probes the store itself.
TEST(BackendWrapperTest, MeteredOutageEndsByItsOwnProbeWhenTheStoreAnswers) {
  MeteredWritesFail m;
  std::atomic<bool>& down = m.down;
  testing::FakeClock& clock = m.clock;
  Backend* b = m.backend.get();
  EXPECT_FALSE(b->InOutage());
  // Twice: the second outage wakes the prober again, and ends the same way.
  for (int outage = 0; outage < 2; ++outage) {
    down = true;
    clock.AdvanceSeconds(0.001);
    EXPECT_FALSE(b->Stat("").ok());
    EXPECT_TRUE(b->InOutage());
    EXPECT_TRUE(StoreDown());
    // Still down a little later: the probes fail, and the outage stays.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    EXPECT_TRUE(b->InOutage());
    down = false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (b->InOutage() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(b->InOutage()) << "outage " << outage;
    EXPECT_FALSE(StoreDown());
  }
}

}  // namespace
}  // namespace cubetorchfs::cfs_client
