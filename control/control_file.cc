#include "control/control_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "common/thread_annotations.h"
#include "common/unique_fd.h"

namespace cubetorchfs::control {
std::string ControlFilePath(const std::string& vol_name) {
  const char* dir = std::getenv("CUBE_TORCH_CONFIG_DIR");
  std::string d = dir && *dir ? dir : "/tmp";
  return d + "/cube_torch.config." + vol_name;
}

std::string ControlFileJson(const ControlInfo& info) {
  const nlohmann::json j = {{"vol_name", info.vol_name},
                            {"mount_point", info.mount_point},
                            {"prof", info.prof_port},
                            {"local_ip", "127.0.0.1"},
                            {"control_socket", info.control_socket},
                            {"metrics_port", info.metrics_port},
                            {"pid", info.pid},
                            {"supervisor_pid", info.supervisor_pid},
                            {"generation", info.generation},
                            {"version", info.version}};
  // Names are bytes, not always UTF-8: invalid sequences are written as U+FFFD.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Status CheckControlDir(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0)
    return Status::IOError("control file directory " + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode))
    return Status::NotDirectory("control file directory " + dir + ": not a directory");
  if (st.st_uid != 0 && st.st_uid != ::geteuid())
    return Status::PermissionDenied("control file directory " + dir + ": owned by uid " +
                                    std::to_string(st.st_uid) +
                                    ", neither root nor us; refusing to write there");
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0)
    return Status::PermissionDenied(
        "control file directory " + dir +
        ": writable by other users without the sticky bit (they could replace the file); "
        "refusing to write there (set CUBE_TORCH_CONFIG_DIR to a safe directory)");
  return Status::OK();
}

namespace {

struct Written {
  dev_t dev;
  ino_t ino;
};

Mutex g_written_mu;
std::map<std::string, Written>& WrittenFiles() REQUIRES(g_written_mu) {
  static auto* m = new std::map<std::string, Written>();  // never destroyed: used at exit
  return *m;
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string BaseOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool WriteAll(int fd, const std::string& body) {
  size_t done = 0;
  while (done < body.size()) {
    ssize_t n = ::write(fd, body.data() + done, body.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

Status WriteControlFile(const std::string& path, const ControlInfo& info) {
  const std::string dir = DirOf(path);
  CTFS_RETURN_IF_ERROR(CheckControlDir(dir));
  // A hidden name the hook does not list (it lists "cube_torch.config.*"), random, O_EXCL.
  std::string tmp = dir + "/." + BaseOf(path) + ".XXXXXX";
  UniqueFd fd(::mkostemp(tmp.data(), O_CLOEXEC));
  if (fd.get() < 0) return Status::IOError(tmp + ": " + std::strerror(errno));
  const std::string body = ControlFileJson(info);
  struct stat st {};
  // 0644 whatever the umask: the hook reading it runs as other users.
  bool ok = ::fchmod(fd.get(), 0644) == 0 && WriteAll(fd.get(), body) && ::fsync(fd.get()) == 0 &&
            ::fstat(fd.get(), &st) == 0;
  int err = errno;
  fd.reset();
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    return Status::IOError(path + ": " + std::strerror(err));
  }
  UniqueFd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() >= 0) ::fsync(dfd.get());  // the rename itself survives a crash
  MutexLock l(g_written_mu);
  WrittenFiles()[path] = Written{st.st_dev, st.st_ino};
  return Status::OK();
}

void RemoveControlFile(const std::string& path, int pid) {
  Written mine{};
  {
    MutexLock l(g_written_mu);
    auto it = WrittenFiles().find(path);
    if (it == WrittenFiles().end()) return;  // never written by us
    mine = it->second;
  }
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) return;  // gone, or a symlink (ELOOP): not ours
  struct stat st;
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      st.st_dev != mine.dev || st.st_ino != mine.ino)
    return;
  char buf[4096];
  ssize_t n = ::pread(fd.get(), buf, sizeof buf, 0);
  if (n <= 0) return;
  const nlohmann::json j =
      nlohmann::json::parse(std::string(buf, static_cast<size_t>(n)), nullptr, false);
  if (!j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer() ||
      j["pid"].get<int64_t>() != pid)
    return;
  // Still the file we wrote. The directory passed CheckControlDir (sticky or writable by
  // root/us only), so no other user can have swapped the name since the check.
  struct stat now;
  if (::lstat(path.c_str(), &now) == 0 && now.st_dev == mine.dev && now.st_ino == mine.ino &&
      ::unlink(path.c_str()) == 0) {
    MutexLock l(g_written_mu);
    WrittenFiles().erase(path);
  }
}

}  // namespace cubetorchfs::control
