// A stand-in for CubeFS's C SDK (libcfs.so) over a local directory, for the cubefs backend's
// unit tests on machines without CubeFS. It answers as the SDK does, its pitfalls included,
// so that the backend's guards are tested: O_EXCL is ignored, O_CREAT of an existing file
// "leaks" (counted), cfs_mkdirs succeeds on an existing name, cfs_rmdir of a file is EINVAL,
// a rename onto itself deletes the file, a directory is renamed over nothing, cfs_write to a
// directory aborts (the SDK's Go panic), times are whole seconds, new entries are root's.
//
// The volume is the directory named by volName; masterAddr "refuse" makes start fail.
// Exported with C linkage under the SDK's names, with the structures of libcfs.h as
// cfs_client/cubefs_sdk.h declares them.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cfs_client/cubefs_sdk.h"

namespace {

using cubetorchfs::cfs_client::cubefs::Dirent;
using cubetorchfs::cfs_client::cubefs::GoSlice;
using cubetorchfs::cfs_client::cubefs::StatInfo;
using cubetorchfs::cfs_client::cubefs::VolInfo;

struct File {
  int fd = -1;
  bool is_dir = false;
  std::string path;  // the volume's path
  std::vector<Dirent> listing;
  size_t cursor = 0;
  bool listed = false;
};

std::mutex g_mu;
std::map<std::string, std::string> g_settings;
std::map<int, File> g_files;
int g_next_fd = 3;
std::map<uint64_t, std::string> g_ino_paths;  // inode → volume path, learned by listings

std::string Real(const char* path) {
  std::string p = path;
  if (p.empty() || p[0] != '/') p = "/" + p;
  return g_settings["volName"] + p;
}

int Neg() { return -errno; }

void Fill(const struct stat& st, StatInfo* out) {
  std::memset(out, 0, sizeof(*out));
  out->ino = st.st_ino;
  out->size = static_cast<uint64_t>(st.st_size);
  out->blocks = static_cast<uint64_t>(st.st_size) >> 9;
  out->atime = static_cast<uint64_t>(st.st_atim.tv_sec);
  out->mtime = static_cast<uint64_t>(st.st_mtim.tv_sec);
  out->ctime = static_cast<uint64_t>(st.st_ctim.tv_sec);
  out->mode = st.st_mode & (S_IFMT | 0777);
  out->nlink = static_cast<uint32_t>(st.st_nlink);
  out->blk_size = 4096;
  out->uid = st.st_uid;
  out->gid = st.st_gid;
}

}  // namespace

extern "C" {

int fake_cfs_leaked_inodes = 0;  // O_CREAT opens of an existing file (the SDK leaks each)
// Nonzero: takes "enableRemoteCache", as an SDK built with remote-cache support does (the
// stock SDK refuses it as any unknown key).
int fake_cfs_takes_remote_cache = 0;

// A setting as cfs_set_client last took it ("" if never), for the tests.
const char* fake_cfs_setting(const char* key) {
  std::lock_guard<std::mutex> l(g_mu);
  return g_settings[key].c_str();
}

int64_t cfs_new_client() {
  std::lock_guard<std::mutex> l(g_mu);
  g_settings.clear();
  return 1;
}

int cfs_set_client(int64_t id, char* key, char* val) {
  if (id != 1) return -EINVAL;
  const std::string k = key;
  if (k != "masterAddr" && k != "volName" && k != "accessKey" && k != "secretKey" &&
      k != "logDir" && k != "logLevel" && k != "followerRead" &&
      !(k == "enableRemoteCache" && fake_cfs_takes_remote_cache != 0))
    return -EINVAL;
  std::lock_guard<std::mutex> l(g_mu);
  g_settings[k] = val;
  return 0;
}

int cfs_start_client(int64_t id) {
  std::lock_guard<std::mutex> l(g_mu);
  if (id != 1 || g_settings["masterAddr"] == "refuse") return -EIO;
  struct stat st;
  if (::stat(g_settings["volName"].c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return -EIO;
  return 0;
}

void cfs_close_client(int64_t) {}

int cfs_getattr(int64_t, char* path, StatInfo* out) {
  struct stat st;
  if (::lstat(Real(path).c_str(), &st) != 0) return Neg();
  Fill(st, out);
  return 0;
}

int cfs_setattr(int64_t, char* path, StatInfo* in, int valid) {
  const std::string real = Real(path);
  if ((valid & 1) && ::fchmodat(AT_FDCWD, real.c_str(), in->mode & 0777, 0) != 0) return Neg();
  if ((valid & 6) && ::lchown(real.c_str(), (valid & 2) ? in->uid : static_cast<uid_t>(-1),
                              (valid & 4) ? in->gid : static_cast<gid_t>(-1)) != 0)
    return Neg();
  if (valid & 24) {
    struct timespec ts[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
    if (valid & 16) ts[0] = {static_cast<time_t>(in->atime), 0};
    if (valid & 8) ts[1] = {static_cast<time_t>(in->mtime), 0};
    if (::utimensat(AT_FDCWD, real.c_str(), ts, AT_SYMLINK_NOFOLLOW) != 0) return Neg();
  }
  return 0;
}

int cfs_open(int64_t, char* path, int flags, mode_t mode) {
  const std::string real = Real(path);
  struct stat st;
  const bool exists = ::lstat(real.c_str(), &st) == 0;
  if ((flags & O_CREAT) && (flags & O_ACCMODE) == O_RDONLY) return -EACCES;
  File f;
  f.path = path;
  if (exists && S_ISDIR(st.st_mode)) {
    if (flags & O_CREAT) return -EINVAL;
    f.is_dir = true;
    f.fd = ::open(real.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } else {
    if ((flags & O_CREAT) && exists) {
      std::lock_guard<std::mutex> l(g_mu);
      ++fake_cfs_leaked_inodes;
    }
    // O_EXCL is ignored; the mode loses every bit but the permissions.
    const int real_flags = (flags & (O_ACCMODE | O_CREAT | O_TRUNC)) | O_CLOEXEC | O_NOFOLLOW;
    f.fd = ::open(real.c_str(), real_flags, mode & 0777);
  }
  if (f.fd < 0) return Neg();
  std::lock_guard<std::mutex> l(g_mu);
  const int id = g_next_fd++;
  g_files[id] = std::move(f);
  return id;
}

int cfs_flush(int64_t, int fd) {
  std::lock_guard<std::mutex> l(g_mu);
  return g_files.count(fd) ? 0 : -EBADFD;
}

void cfs_close(int64_t, int fd) {
  std::lock_guard<std::mutex> l(g_mu);
  auto it = g_files.find(fd);
  if (it == g_files.end()) return;
  ::close(it->second.fd);
  g_files.erase(it);
}

static int RealFd(int fd, bool* is_dir = nullptr) {
  std::lock_guard<std::mutex> l(g_mu);
  auto it = g_files.find(fd);
  if (it == g_files.end()) return -1;
  if (is_dir) *is_dir = it->second.is_dir;
  return it->second.fd;
}

int cfs_truncate(int64_t, int fd, size_t size) {
  bool dir = false;
  const int real = RealFd(fd, &dir);
  if (real < 0) return -EBADFD;
  if (dir) return -EIO;
  return ::ftruncate(real, static_cast<off_t>(size)) == 0 ? 0 : -EIO;
}

ssize_t cfs_write(int64_t, int fd, void* buf, size_t size, off_t off) {
  bool dir = false;
  const int real = RealFd(fd, &dir);
  if (real < 0) return -EBADFD;
  if (dir) std::abort();  // the SDK's Go panic
  ssize_t n = ::pwrite(real, buf, size, off);
  return n < 0 ? -EIO : n;
}

ssize_t cfs_read(int64_t, int fd, void* buf, size_t size, off_t off) {
  bool dir = false;
  const int real = RealFd(fd, &dir);
  if (real < 0) return -EBADFD;
  if (dir) return -EIO;
  ssize_t n = ::pread(real, buf, size, off);
  return n < 0 ? -EIO : n;
}

int cfs_readdir(int64_t, int fd, GoSlice dirents, int count) {
  if (count > dirents.len) std::abort();  // the SDK's Go panic
  std::lock_guard<std::mutex> l(g_mu);
  auto it = g_files.find(fd);
  if (it == g_files.end()) return -EBADFD;
  File& f = it->second;
  if (!f.listed) {  // the whole directory at the first call, sorted by name
    f.listed = true;
    DIR* d = ::opendir(Real(f.path.c_str()).c_str());
    if (d == nullptr) return -EIO;
    while (struct dirent* e = ::readdir(d)) {
      if (!std::strcmp(e->d_name, ".") || !std::strcmp(e->d_name, "..")) continue;
      Dirent out{};
      out.ino = e->d_ino;
      const size_t len = std::min(std::strlen(e->d_name), sizeof(out.name) - 1);
      std::memcpy(out.name, e->d_name, len);
      out.name_len = static_cast<uint32_t>(len);
      f.listing.push_back(out);
      std::string child = f.path == "/" ? "/" : f.path + "/";
      g_ino_paths[e->d_ino] = child + e->d_name;
    }
    ::closedir(d);
    std::sort(f.listing.begin(), f.listing.end(),
              [](const Dirent& a, const Dirent& b) { return std::strcmp(a.name, b.name) < 0; });
  }
  int n = 0;
  auto* out = static_cast<Dirent*>(dirents.data);
  while (n < count && f.cursor < f.listing.size()) out[n++] = f.listing[f.cursor++];
  return n;
}

int cfs_batch_get_inodes(int64_t, int, void* iids, GoSlice stats, int count) {
  if (count > stats.len) std::abort();
  const auto* inos = static_cast<const uint64_t*>(iids);
  auto* out = static_cast<StatInfo*>(stats.data);
  int n = 0;
  // In reverse: the SDK's answer is in no particular order.
  for (int i = count - 1; i >= 0; --i) {
    std::string path;
    {
      std::lock_guard<std::mutex> l(g_mu);
      auto it = g_ino_paths.find(inos[i]);
      if (it == g_ino_paths.end()) continue;
      path = it->second;
    }
    struct stat st;
    if (::lstat(Real(path.c_str()).c_str(), &st) != 0 || st.st_ino != inos[i]) continue;
    Fill(st, &out[n++]);
  }
  return n;
}

int cfs_mkdirs(int64_t, char* path, mode_t mode) {
  std::string real = Real(path), done;
  size_t pos = g_settings["volName"].size();
  // Creates missing parents; an existing name, even a file, is success.
  while (pos != std::string::npos) {
    pos = real.find('/', pos + 1);
    const std::string part = real.substr(0, pos);
    if (::mkdir(part.c_str(), mode & 0777) != 0 && errno != EEXIST) return Neg();
  }
  return 0;
}

int cfs_rmdir(int64_t, char* path) {
  struct stat st;
  const std::string real = Real(path);
  if (::lstat(real.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) return -EINVAL;
  return ::rmdir(real.c_str()) == 0 ? 0 : Neg();
}

int cfs_unlink(int64_t, char* path) { return ::unlink(Real(path).c_str()) == 0 ? 0 : Neg(); }

int cfs_rename(int64_t, char* from, char* to, uint8_t overwritten) {
  const std::string a = Real(from), b = Real(to);
  if (a == b) return ::unlink(a.c_str()) == 0 || ::rmdir(a.c_str()) == 0 ? 0 : Neg();
  struct stat sa, sb;
  if (::lstat(a.c_str(), &sa) != 0) return Neg();
  if (::lstat(b.c_str(), &sb) == 0) {
    if (S_ISDIR(sa.st_mode) != S_ISDIR(sb.st_mode)) return -EAGAIN;
    if (S_ISDIR(sa.st_mode) || !overwritten) return -EEXIST;
  }
  return ::rename(a.c_str(), b.c_str()) == 0 ? 0 : Neg();
}

int cfs_symlink(int64_t, char* target, char* path) {
  std::string t = target;
  if (t.empty() || t[0] != '/') t = "/" + t;  // made absolute against the cwd, "/"
  return ::symlink(t.c_str(), Real(path).c_str()) == 0 ? 0 : Neg();
}

int cfs_link(int64_t, char* from, char* to) {
  struct stat st;
  if (::lstat(Real(from).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return -EPERM;
  return ::link(Real(from).c_str(), Real(to).c_str()) == 0 ? 0 : Neg();
}

int cfs_list_vols(int64_t, GoSlice vols, int count) {
  if (count > vols.len || count < 2) std::abort();
  auto* out = static_cast<VolInfo*>(vols.data);
  std::memcpy(out[0].name, "another", 8);
  out[0].total_size = 1ull << 40;
  std::lock_guard<std::mutex> l(g_mu);
  const std::string vol = g_settings["volName"];
  std::memcpy(out[1].name, vol.data(), std::min(vol.size(), sizeof(out[1].name)));  // no NUL
  out[1].total_size = 30ull << 30;
  out[1].used_size = 1ull << 30;
  return 2;
}

}  // extern "C"
