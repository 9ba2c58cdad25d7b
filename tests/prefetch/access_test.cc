#include "prefetch/access.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "control/control_server.h"
#include "tests/test_util.h"

namespace cubetorchfs::prefetch {
namespace {

namespace fs = std::filesystem;

Caller User(uid_t uid, std::vector<gid_t> groups = {}) {
  Caller c;
  c.uid = uid;
  c.gid = uid;
  c.groups = std::move(groups);
  return c;
}

cfs_client::FileAttr Attr(mode_t mode, uid_t uid, gid_t gid) {
  cfs_client::FileAttr a;
  a.mode = mode;
  a.uid = uid;
  a.gid = gid;
  return a;
}

TEST(MayAccessTest, OwnerGroupOtherAsTheKernelChecks) {
  const auto f = Attr(S_IFREG | 0640, 1000, 50);
  EXPECT_TRUE(MayAccess(f, User(1000), R_OK));
  EXPECT_TRUE(MayAccess(f, User(1001, {50}), R_OK));
  EXPECT_FALSE(MayAccess(f, User(1001), R_OK));
  // The owner's bits apply to the owner even when "other" would allow more.
  EXPECT_FALSE(MayAccess(Attr(S_IFREG | 0047, 1000, 50), User(1000), R_OK));
  EXPECT_TRUE(MayAccess(Attr(S_IFDIR | 0711, 0, 0), User(1001), X_OK));
  EXPECT_FALSE(MayAccess(Attr(S_IFDIR | 0700, 0, 0), User(1001), X_OK));
  EXPECT_TRUE(MayAccess(Attr(S_IFREG | 0000, 5, 5), User(0), R_OK));  // root reads anything
}

TEST(PeerTest, TcpPeerIsTheKernelsWordOrARefusal) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  EXPECT_FALSE(TcpPeer(pair[0]).ok());  // not a loopback TCP connection: refused
  Result<Caller> unix_peer = UnixPeer(pair[0]);
  ASSERT_TRUE(unix_peer.ok());
  EXPECT_EQ(unix_peer->uid, ::geteuid());
  EXPECT_EQ(unix_peer->pid, ::getpid());
  ::close(pair[0]);
  ::close(pair[1]);
  // A real loopback connection: the kernel names this process's uid.
  int srv = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(srv, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(srv, 1), 0);
  ASSERT_EQ(::getsockname(srv, reinterpret_cast<sockaddr*>(&a), &len), 0);
  int cli = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(cli, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  int conn = ::accept(srv, nullptr, nullptr);
  ASSERT_GE(conn, 0);
  Result<Caller> tcp_peer = TcpPeer(conn);
  ASSERT_TRUE(tcp_peer.ok()) << tcp_peer.status().ToString();
  EXPECT_EQ(tcp_peer->uid, ::geteuid());
  ::close(conn);
  ::close(cli);
  // A peer that sends and closes before the daemon asks: its socket is now a closed remnant
  // the kernel reports with uid 0 (as root). It must be refused, not taken for root.
  cli = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(cli, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::write(cli, "GET / HTTP/1.1\r\n\r\n", 18), 18);
  ::close(cli);
  conn = ::accept(srv, nullptr, nullptr);
  ASSERT_GE(conn, 0);
  Result<Caller> closed = TcpPeer(conn);
  EXPECT_FALSE(closed.ok()) << "a closed peer was taken for uid " << closed->uid;
  ::close(conn);
  ::close(srv);
}

TEST(CheckJsonShapeTest, DepthAndElementsWithoutParsing) {
  EXPECT_TRUE(control::CheckJsonShape(R"({"paths": ["a", "b"]})", 4, 10).ok());
  EXPECT_FALSE(control::CheckJsonShape(std::string(100, '['), 16, 1000).ok());
  EXPECT_FALSE(control::CheckJsonShape("[0,0,0,0,0,0]", 4, 5).ok());
  // Brackets and commas inside strings (escaped quotes too) are not structure.
  EXPECT_TRUE(control::CheckJsonShape(R"(["[[[[[,,,,,\"[[[[,,,,"])", 2, 2).ok());
}

// Found by tests/fuzz/fuzz_json_shape: the first value of an array (after '[', not ',') was
// not counted, so 131072 arrays of one-element arrays nested 15 deep, a 4 MiB body within the
// default limits, parsed to 2 million values (122 MiB of heap for one request).
TEST(CheckJsonShapeTest, CountsTheFirstValueOfEveryArray) {
  EXPECT_FALSE(control::CheckJsonShape("[1]", 16, 1).ok());
  EXPECT_TRUE(control::CheckJsonShape("[1]", 16, 2).ok());
  EXPECT_FALSE(control::CheckJsonShape("[[[[1]]]]", 16, 4).ok());
  EXPECT_TRUE(control::CheckJsonShape("[[[[1]]]]", 16, 5).ok());
  const std::string group = std::string(15, '[') + "0" + std::string(15, ']');
  std::string body = "[" + group;
  for (int i = 1; i < (1 << 17); ++i) body += "," + group;
  body += "]";
  const control::ControlServer::Options defaults;
  EXPECT_FALSE(
      control::CheckJsonShape(body, defaults.max_json_depth, defaults.max_json_elements).ok());
  // Objects' values follow ':', each counted once: what clients send passes as before.
  EXPECT_TRUE(control::CheckJsonShape(R"({"a": {"b": {"c": 1}}})", 16, 4).ok());
  EXPECT_TRUE(control::CheckJsonShape(R"({"paths": ["a", "b"]})", 16, 4).ok());
}

// A bare number of 16 MiB briefly took 125-171 MiB to parse: numbers and literals are short.
TEST(CheckJsonShapeTest, RefusesHugeNumbersAndLiterals) {
  EXPECT_TRUE(
      control::CheckJsonShape(R"({"pid": 1234567, "x": -1.5e+300, "t": true})", 16, 8).ok());
  EXPECT_TRUE(control::CheckJsonShape(std::string(64, '9'), 16, 8).ok());
  EXPECT_FALSE(control::CheckJsonShape(std::string(65, '9'), 16, 8).ok());
  std::string huge(1, '[');
  huge.append(16 << 20, '1');
  huge.push_back(']');
  EXPECT_FALSE(control::CheckJsonShape(huge, 16, 8).ok());
  // Inside a string, length is the body limit's business: a long path passes.
  std::string path = "[\"";
  path.append(4000, 'a');
  path.append("\"]");
  EXPECT_TRUE(control::CheckJsonShape(path, 16, 8).ok());
}

// A store with a symlinked class folder, links out of it, and private parts.
class PathResolverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("ctfs_access_" + std::to_string(::getpid()));
    fs::remove_all(base_);
    root_ = base_ / "root";
    fs::create_directories(root_ / "data" / "cls");
    fs::create_directories(base_ / "outside");
    std::ofstream(root_ / "data" / "cls" / "img") << "x";
    std::ofstream(base_ / "outside" / "secret") << "s";
    fs::create_symlink("cls", root_ / "data" / "alias");             // inside: followed
    fs::create_symlink("../../outside", root_ / "data" / "escape");  // climbs out
    fs::create_symlink(base_ / "outside", root_ / "data" / "abs");   // absolute
    fs::create_symlink("loop", root_ / "data" / "loop");
    fs::create_directories(root_ / "closed");
    std::ofstream(root_ / "closed" / "f") << "c";
    ::chmod((root_ / "closed").c_str(), 0700);
    std::ofstream(root_ / "data" / "private") << "p";
    ::chmod((root_ / "data" / "private").c_str(), 0600);
    auto b = cfs_client::NewPosixBackend(root_);
    ASSERT_TRUE(b.ok());
    backend_ = std::move(b).value();
    resolver_ = std::make_unique<PathResolver>(PathResolver::Options{}, backend_.get(), &clock_);
  }
  void TearDown() override { fs::remove_all(base_); }

  Reject Why(const std::string& path, const Caller& c,
             PathResolver::Depth depth = PathResolver::Depth::kFile) {
    Reject why = Reject::kNone;
    Result<PathResolver::Resolved> r = resolver_->Resolve(path, c, true, &why, depth);
    EXPECT_EQ(r.ok(), why == Reject::kNone) << path;
    return why;
  }

  fs::path base_, root_;
  testing::FakeClock clock_;
  std::unique_ptr<cfs_client::Backend> backend_;
  std::unique_ptr<PathResolver> resolver_;
};

TEST_F(PathResolverTest, AFifoIsNotReportedAsADirectory) {
  ASSERT_EQ(::mkfifo((root_ / "data" / "fifo").c_str(), 0644), 0);
  Reject why = Reject::kNone;
  Result<PathResolver::Resolved> r = resolver_->Resolve("data/fifo", User(0), true, &why);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(why, Reject::kNotFile);
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument) << r.status().ToString();
  r = resolver_->Resolve("data/cls", User(0), true, &why);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kIsDirectory) << r.status().ToString();
}

TEST_F(PathResolverTest, RelativeLinksInsideTheStoreAreFollowed) {
  Reject why;
  auto r = resolver_->Resolve("data/alias/img", User(0), true, &why);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->path, "data/cls/img");
  EXPECT_TRUE(r->attr.IsRegular());
}

TEST_F(PathResolverTest, LinksOutOfTheStoreAreRefused) {
  EXPECT_EQ(Why("data/escape/secret", User(0)), Reject::kSymlink);
  EXPECT_EQ(Why("data/abs/secret", User(0)), Reject::kSymlink);
  EXPECT_EQ(Why("data/loop/x", User(0)), Reject::kLoop);
  EXPECT_EQ(Why("data/escape/secret", User(0), PathResolver::Depth::kDirectories),
            Reject::kSymlink);
}

TEST_F(PathResolverTest, TheCallersRightsDecide) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to own the files";
  EXPECT_EQ(Why("closed/f", User(1000)), Reject::kPermission);
  EXPECT_EQ(Why("closed/f", User(1000), PathResolver::Depth::kDirectories), Reject::kPermission);
  EXPECT_EQ(Why("data/private", User(1000)), Reject::kPermission);
  // Published paths have their file checked at fetch: the directories alone pass here.
  EXPECT_EQ(Why("data/private", User(1000), PathResolver::Depth::kDirectories), Reject::kNone);
  EXPECT_EQ(Why("closed/f", User(0)), Reject::kNone);
  EXPECT_EQ(Why("data/cls/img", User(1000)), Reject::kNone);
  EXPECT_EQ(Why("data/cls", User(1000)), Reject::kNotFile);
  EXPECT_EQ(Why("data/none", User(1000)), Reject::kNotFound);
}

// One request's memo of searchable directories answers exactly as resolving each path on its
// own: a directory enters it only once checked for this caller, a symlinked one never (its
// target is resolved each time), and a directory not in it is checked as usual.
TEST_F(PathResolverTest, ARequestsSearchedDirectoriesChangeNoAnswer) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to own the files";
  const std::vector<std::string> paths = {"data/cls/img",       "data/alias/img", "closed/f",
                                          "data/escape/secret", "data/private",   "data/cls/img",
                                          "closed/f",           "data/none",      "data/alias/img"};
  for (const Caller& who : {User(1000), User(0)}) {
    PathResolver::Searched searched;
    for (const std::string& p : paths) {
      Reject alone = Why(p, who);
      Reject why = Reject::kNone;
      Result<PathResolver::Resolved> r =
          resolver_->Resolve(p, who, true, &why, PathResolver::Depth::kFile, &searched);
      EXPECT_EQ(why, alone) << p;
      EXPECT_EQ(r.ok(), alone == Reject::kNone) << p;
    }
    EXPECT_TRUE(searched.root);
    EXPECT_EQ(searched.dirs.count("data/alias"), 0u);  // a symlink: never taken as searched
    EXPECT_EQ(searched.dirs.count("data/cls"), 1u);
    EXPECT_EQ(searched.dirs.count("closed"), who.uid == 0 ? 1u : 0u);
  }
}

}  // namespace
}  // namespace cubetorchfs::prefetch

namespace cubetorchfs::prefetch {
namespace {

// A store whose Stat takes a while and says how many ran at once.
class SlowStat final : public cfs_client::BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
  Result<cfs_client::FileAttr> Stat(const std::string& path) override {
    const int now = ++running_;
    int seen = most_.load();
    while (now > seen && !most_.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    --running_;
    ++calls_;
    return BackendWrapper::Stat(path);
  }
  std::atomic<int> running_{0}, most_{0}, calls_{0};
};

// A request naming files of many directories the mount has not seen: their attributes are
// asked for several at a time before the paths are resolved one by one, which then asks the
// store nothing more; the answers are the same.
TEST(PathResolverWarmTest, DirectoriesOfARequestAreAskedForAFewAtATime) {
  const fs::path root = fs::temp_directory_path() / ("ctfs_warm_" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::vector<std::string> dirs, files;
  for (int d = 0; d < 40; ++d) {
    const std::string dir = "train/c" + std::to_string(d);
    fs::create_directories(root / dir);
    std::ofstream(root / dir / "f.jpg") << "x";
    dirs.push_back(dir);
    files.push_back(dir + "/f.jpg");
  }
  dirs.push_back("train");
  auto store = std::make_unique<SlowStat>(cfs_client::NewPosixBackend(root).value());
  SlowStat* slow = store.get();
  testing::FakeClock clock;
  PathResolver resolver(PathResolver::Options{}, slow, &clock);
  resolver.Warm(dirs);
  EXPECT_EQ(slow->calls_.load(), 42);  // the directories and the root they are found in
  EXPECT_GE(slow->most_.load(), 2);
  EXPECT_LE(slow->most_.load(), static_cast<int>(PathResolver::kWarmThreads));
  PathResolver::Searched searched;
  for (const std::string& f : files) {
    Reject why = Reject::kNone;
    EXPECT_TRUE(
        resolver.Resolve(f, User(1000), false, &why, PathResolver::Depth::kDirectories, &searched)
            .ok())
        << f;
  }
  EXPECT_EQ(slow->calls_.load(), 42);  // nothing more: every directory was warm
  resolver.Warm(dirs);                 // all cached: nothing asked
  EXPECT_EQ(slow->calls_.load(), 42);
  fs::remove_all(root);
}

}  // namespace
}  // namespace cubetorchfs::prefetch
