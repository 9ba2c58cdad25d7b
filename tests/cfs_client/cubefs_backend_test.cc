// The cubefs backend over a stand-in for CubeFS's SDK (fake_libcfs.cc, loaded by dlopen as the
// real one is), which answers as the SDK does, its pitfalls included: these tests show the
// backend's guards at work. tests/cubefs runs the same backend against a real cluster.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>

#include "cfs_client/backend.h"
#include "cfs_client/cubefs_sdk.h"
#include "tests/test_util.h"

namespace cubetorchfs::cfs_client {
namespace {

namespace fs = std::filesystem;

// A symbol of the stand-in SDK the backend loaded (null if it is not loaded).
void* FakeSymbol(const char* name) {
  void* h = ::dlopen(FAKE_LIBCFS, RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return nullptr;
  void* sym = ::dlsym(h, name);
  ::dlclose(h);  // the backend's reference keeps it loaded
  return sym;
}

int Leaked() {
  const int* n = static_cast<const int*>(FakeSymbol("fake_cfs_leaked_inodes"));
  return n ? *n : -1;
}

std::string SdkSetting(const char* key) {
  auto get = reinterpret_cast<const char* (*)(const char*)>(FakeSymbol("fake_cfs_setting"));
  return get ? get(key) : "<no stand-in SDK loaded>";
}

class CubefsBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("ctfs_cubefs_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "dir" / "sub");
    std::ofstream(root_ / "dir" / "file", std::ios::binary) << "hello world";
    auto b = NewCubefsBackend(Options());
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    backend_ = std::move(b).value();
  }
  void TearDown() override {
    backend_.reset();
    fs::remove_all(root_);
  }
  conf::CubefsOptions Options() const {
    conf::CubefsOptions o;
    o.lib = FAKE_LIBCFS;
    o.master_addr = "127.0.0.1:17010";
    o.volume = root_.string();
    o.access_key = "ak";
    o.secret_key = "sk";
    return o;
  }
  std::string Read(const std::string& rel) {
    char buf[256];
    Result<Backend::Fetched> f = backend_->StatRead(rel, sizeof(buf), buf);
    if (!f.ok()) return "<" + f.status().ToString() + ">";
    return std::string(buf, f->bytes);
  }
  static int Err(const Status& s) { return ToErrno(s); }

  fs::path root_;
  std::unique_ptr<Backend> backend_;
};

TEST(CubefsSdkTest, AMissingOrForeignLibraryIsAClearError) {
  Result<const cubefs::Sdk*> missing = cubefs::LoadSdk("/nonexistent/libcfs.so");
  EXPECT_EQ(missing.status().code(), Status::Code::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/libcfs.so"), std::string::npos);
  Result<const cubefs::Sdk*> foreign = cubefs::LoadSdk("libm.so.6");
  EXPECT_EQ(foreign.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(foreign.status().message().find("not a compatible libcfs"), std::string::npos)
      << foreign.status().ToString();
  conf::CubefsOptions o;
  o.lib = "/nonexistent/libcfs.so";
  Result<std::unique_ptr<Backend>> b = NewCubefsBackend(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message().rfind("backend.cubefs.lib: ", 0), 0u) << b.status().ToString();
}

TEST_F(CubefsBackendTest, AVolumeThatCannotBeReachedNamesMasterAddr) {
  conf::CubefsOptions o = Options();
  o.master_addr = "refuse";
  Result<std::unique_ptr<Backend>> b = NewCubefsBackend(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message().rfind("masterAddr: ", 0), 0u) << b.status().ToString();
}

TEST_F(CubefsBackendTest, RemoteCacheIsSetOrTheStartFailsNamingTheKey) {
  int* takes = static_cast<int*>(FakeSymbol("fake_cfs_takes_remote_cache"));
  ASSERT_NE(takes, nullptr);
  backend_.reset();
  conf::CubefsOptions o = Options();
  EXPECT_TRUE(NewCubefsBackend(o).ok());
  EXPECT_EQ(SdkSetting("enableRemoteCache"), "");  // off unless asked for
  o.remote_cache = true;
  *takes = 1;  // an SDK built with remote-cache support
  ASSERT_TRUE(NewCubefsBackend(o).ok());
  EXPECT_EQ(SdkSetting("enableRemoteCache"), "true");
  *takes = 0;  // the stock SDK: never read around the cache the config asks for
  Result<std::unique_ptr<Backend>> b = NewCubefsBackend(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), Status::Code::kInvalidArgument);
  const std::string& m = b.status().message();
  EXPECT_EQ(m.rfind("backend.cubefs.remote_cache: ", 0), 0u) << m;
  EXPECT_NE(m.find(FAKE_LIBCFS), std::string::npos) << m;
  EXPECT_NE(m.find("enableRemoteCache"), std::string::npos) << m;
}

TEST_F(CubefsBackendTest, TheSdkLogsOnlyIntoAPrivateDirectory) {
  // Its log files are mode 0666: only a directory of the daemon's, 0700, is given.
  fs::create_directories(root_ / "log");
  conf::CubefsOptions o = Options();
  o.log_dir = (root_ / "log").string();
  backend_.reset();
  ASSERT_TRUE(NewCubefsBackend(o).ok());
  EXPECT_EQ(SdkSetting("logDir"), (root_ / "log" / "cubefs-sdk").string());
  struct stat st {};
  ASSERT_EQ(::lstat((root_ / "log" / "cubefs-sdk").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  // A link planted in its place is not followed: no log directory then.
  fs::remove(root_ / "log" / "cubefs-sdk");
  fs::create_directories(root_ / "elsewhere");
  fs::create_directory_symlink(root_ / "elsewhere", root_ / "log" / "cubefs-sdk");
  ASSERT_TRUE(NewCubefsBackend(o).ok());
  EXPECT_EQ(SdkSetting("logDir"), "");
  EXPECT_EQ(fs::status(root_ / "elsewhere").permissions(),
            fs::status(root_ / "dir").permissions());  // untouched
}

TEST_F(CubefsBackendTest, StatListAndRead) {
  Result<FileAttr> a = backend_->Stat("dir/file");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE(a->IsRegular());
  EXPECT_EQ(a->size, 11u);
  EXPECT_EQ(a->blocks, 1u);  // rounded up (the SDK rounds down)
  EXPECT_NE(a->store_ino, 0u);
  EXPECT_EQ(a->mtime_ns % 1'000'000'000, 0);  // whole seconds, as the SDK gives them
  EXPECT_EQ(backend_->Stat("nope").status().code(), Status::Code::kNotFound);

  Result<std::vector<DirEntry>> entries = backend_->List("dir");
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  std::map<std::string, FileAttr> by_name;
  for (const DirEntry& e : *entries) by_name[e.name] = e.attr;
  ASSERT_EQ(by_name.size(), 2u);
  EXPECT_TRUE(by_name.at("sub").IsDir());
  EXPECT_EQ(by_name.at("file").size, 11u);  // matched by inode, whatever the SDK's order
  EXPECT_EQ(backend_->List("dir/file").status().code(), Status::Code::kNotDirectory);

  EXPECT_EQ(Read("dir/file"), "hello world");
  char buf[8];
  EXPECT_EQ(backend_->Read("dir/file", a->Version(), 6, sizeof(buf), buf).value(), 5u);
  EXPECT_EQ(std::string(buf, 5), "world");
  FileVersion old = a->Version();
  old.size = 3;
  EXPECT_EQ(backend_->Read("dir/file", old, 0, sizeof(buf), buf).status().code(),
            Status::Code::kStale);
  EXPECT_EQ(backend_->StatRead("dir", sizeof(buf), buf).status().code(),
            Status::Code::kIsDirectory);
}

TEST_F(CubefsBackendTest, ListingsOfManyEntriesComeInBatches) {
  for (int i = 0; i < 1100; ++i) std::ofstream(root_ / "dir" / "sub" / std::to_string(i)) << i;
  Result<std::vector<DirEntry>> entries = backend_->List("dir/sub");
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  EXPECT_EQ(entries->size(), 1100u);
  // Pages smaller and larger than the SDK's batches of 512.
  EXPECT_EQ(testing::ListInPages(*backend_, "dir/sub", 100).size(), 1100u);
  EXPECT_EQ(testing::ListInPages(*backend_, "dir/sub", 700).size(), 1100u);
  EXPECT_EQ(backend_->ListPages("dir/nope").status().code(), Status::Code::kNotFound);
}

TEST_F(CubefsBackendTest, WritesFlushAndCreateOnlyWhatTheyShould) {
  OpenWriteOptions create;
  create.create = true;
  create.exclusive = true;
  create.mode = 0640;
  auto f = backend_->OpenWrite("new", create);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ((*f)->Write(0, "abcdef", 6).value(), 6u);
  ASSERT_TRUE((*f)->Truncate(4).ok());
  EXPECT_EQ((*f)->Stat()->size, 4u);
  char buf[8];
  EXPECT_EQ((*f)->Read(0, sizeof(buf), buf).value(), 4u);
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  EXPECT_EQ(Read("new"), "abcd");
  EXPECT_EQ(backend_->Stat("new")->mode & 07777, 0640u);

  // O_EXCL the SDK ignores, and O_CREAT of an existing file it would leak an inode for.
  const int leaked = Leaked();
  ASSERT_GE(leaked, 0);
  EXPECT_EQ(backend_->OpenWrite("new", create).status().code(), Status::Code::kExists);
  create.exclusive = false;
  auto again = backend_->OpenWrite("new", create);
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE((*again)->Close().ok());
  EXPECT_EQ(Leaked(), leaked);
  EXPECT_EQ(Read("new"), "abcd");

  OpenWriteOptions trunc;
  trunc.truncate = true;
  auto t = backend_->OpenWrite("new", trunc);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->Stat()->size, 0u);
  ASSERT_TRUE((*t)->Close().ok());
  EXPECT_EQ(Read("new"), "");
  EXPECT_EQ(backend_->OpenWrite("missing", OpenWriteOptions{}).status().code(),
            Status::Code::kNotFound);
  // A directory is never opened for writing (a write to it would abort the SDK).
  create.exclusive = false;
  EXPECT_EQ(backend_->OpenWrite("dir", create).status().code(), Status::Code::kIsDirectory);
}

TEST_F(CubefsBackendTest, DirectoriesAndTheirErrors) {
  ASSERT_TRUE(backend_->Mkdir("d", 0750, -1, -1).ok());
  EXPECT_TRUE(backend_->Stat("d")->IsDir());
  EXPECT_EQ(backend_->Mkdir("d", 0750, -1, -1).status().code(), Status::Code::kExists);
  EXPECT_EQ(backend_->Mkdir("dir/file", 0750, -1, -1).status().code(), Status::Code::kExists);
  // No parents made on the way (the SDK's mkdirs would).
  EXPECT_EQ(backend_->Mkdir("x/y", 0750, -1, -1).status().code(), Status::Code::kNotFound);
  EXPECT_FALSE(fs::exists(root_ / "x"));
  EXPECT_EQ(backend_->Mkdir("dir/file/y", 0750, -1, -1).status().code(),
            Status::Code::kNotDirectory);
  EXPECT_EQ(Err(backend_->Rmdir("dir/file")), ENOTDIR);
  EXPECT_EQ(Err(backend_->Rmdir("dir")), ENOTEMPTY);
  EXPECT_TRUE(backend_->Rmdir("d").ok());
  EXPECT_EQ(Err(backend_->Unlink("dir")), EISDIR);
  EXPECT_EQ(Err(backend_->Unlink("nope")), ENOENT);
}

TEST_F(CubefsBackendTest, RenamesTheSdkWouldGetWrong) {
  // Onto itself: the SDK would delete it.
  ASSERT_TRUE(backend_->Rename("dir/file", "dir/file", false).ok());
  EXPECT_EQ(Read("dir/file"), "hello world");
  // A directory into itself: the SDK would orphan it.
  EXPECT_EQ(Err(backend_->Rename("dir", "dir/sub/inner", false)), EINVAL);
  // A file over a file, atomically; RENAME_NOREPLACE refused.
  std::ofstream(root_ / "other") << "other";
  EXPECT_EQ(Err(backend_->Rename("other", "dir/file", true)), EEXIST);
  ASSERT_TRUE(backend_->Rename("other", "dir/file", false).ok());
  EXPECT_EQ(Read("dir/file"), "other");
  // Types that do not match.
  EXPECT_EQ(Err(backend_->Rename("dir/file", "dir/sub", false)), EISDIR);
  EXPECT_EQ(Err(backend_->Rename("dir/sub", "dir/file", false)), ENOTDIR);
  // A directory over an empty one (the SDK refuses any existing name), not a full one.
  fs::create_directories(root_ / "empty");
  ASSERT_TRUE(backend_->Rename("dir/sub", "empty", false).ok());
  EXPECT_TRUE(backend_->Stat("empty")->IsDir());
  EXPECT_EQ(backend_->Stat("dir/sub").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(Err(backend_->Rename("empty", "dir", false)), ENOTEMPTY);
  EXPECT_EQ(Err(backend_->Rename("nope", "x", false)), ENOENT);
}

TEST_F(CubefsBackendTest, LinksSymlinksAttributesAndStatfs) {
  Result<FileAttr> linked = backend_->Link("dir/file", "hard");
  ASSERT_TRUE(linked.ok()) << linked.status().ToString();
  EXPECT_EQ(linked->nlink, 2u);
  EXPECT_EQ(linked->store_ino, backend_->Stat("dir/file")->store_ino);
  EXPECT_EQ(Err(backend_->Link("dir", "dirlink").status()), EPERM);
  EXPECT_EQ(Err(backend_->Link("dir/file", "hard").status()), EEXIST);
  // Both names of one file are one rename(2) no-op.
  ASSERT_TRUE(backend_->Rename("hard", "dir/file", false).ok());
  EXPECT_EQ(backend_->Stat("hard")->nlink, 2u);

  ASSERT_TRUE(backend_->Symlink("/abs/target", "sl", -1, -1).ok());
  EXPECT_TRUE(backend_->Stat("sl")->IsSymlink());
  EXPECT_EQ(Err(backend_->Symlink("rel/target", "sl2", -1, -1).status()), EOPNOTSUPP);
  EXPECT_FALSE(fs::exists(fs::symlink_status(root_ / "sl2")));
  EXPECT_EQ(Err(backend_->ReadLink("sl").status()), EOPNOTSUPP);

  AttrChange change;
  change.mode = 04600;
  change.mtime_ns = 1'500'000'000'700'000'000;
  Result<FileAttr> a = backend_->SetAttr("dir/file", change);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->mode & 07777, 0600u);
  EXPECT_EQ(a->mtime_ns, 1'500'000'000'000'000'000);  // whole seconds

  Result<FsStats> s = backend_->StatFs();
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->blocks * s->block_size, 30ull << 30);  // this volume's, not another's
  EXPECT_EQ(s->blocks_free * s->block_size, 29ull << 30);
}

}  // namespace
}  // namespace cubetorchfs::cfs_client
