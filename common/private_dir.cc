#include "common/private_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/logging.h"
#include "common/unique_fd.h"

namespace cubetorchfs {
namespace {

std::string Octal(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// The directories above `dir` (resolved), each owned by root or us and closed to others'
// writes unless sticky; the first that is not, in *bad.
bool AncestorsAreSafe(const std::string& dir, std::string* bad) {
  char resolved[PATH_MAX];
  if (::realpath(dir.c_str(), resolved) == nullptr) return true;  // reported by the caller
  std::filesystem::path p(resolved);
  for (p = p.parent_path();; p = p.parent_path()) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0) return true;
    const bool owner_ok = st.st_uid == 0 || st.st_uid == ::geteuid();
    const bool others_write = (st.st_mode & 022) != 0 && (st.st_mode & S_ISVTX) == 0;
    if (!owner_ok || others_write) {
      *bad =
          p.string() + " (uid " + std::to_string(st.st_uid) + ", mode " + Octal(st.st_mode) + ")";
      return false;
    }
    if (p == p.root_path()) return true;
  }
}

}  // namespace

Status EnsurePrivateDir(const std::string& dir, std::string_view key, std::string_view holds,
                        CreateDir create) {
  const std::string what = std::string(key) + ": " + dir;
  if (create != CreateDir::kNo && ::mkdir(dir.c_str(), 0700) != 0 && errno == ENOENT &&
      create == CreateDir::kWithParents) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(dir).parent_path(), ec);
    if (ec) return Status::IOError(what + ": " + ec.message());
    ::mkdir(dir.c_str(), 0700);
  }
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    struct stat l;
    if (::lstat(dir.c_str(), &l) == 0 && S_ISLNK(l.st_mode))
      return Status::PermissionDenied(what +
                                      " is a symlink; refusing it (name the real directory)");
    if (err == ENOENT && create == CreateDir::kNo) return Status::OK();
    return Status::IOError(what + ": " + std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::IOError(what + ": " + std::strerror(errno));
  if (st.st_uid != ::geteuid() && st.st_uid != 0)
    return Status::PermissionDenied(what + " is owned by uid " + std::to_string(st.st_uid) +
                                    ", another user; refusing it (it would see " +
                                    std::string(holds) + ")");
  std::string bad;
  if (!AncestorsAreSafe(dir, &bad))
    return Status::PermissionDenied(what + ": " + bad +
                                    " above it lets another user replace it; "
                                    "refusing it (put it in a directory only root can change)");
  if ((st.st_mode & 07777) != 0700) {
    if (::fchmod(fd.get(), 0700) != 0)
      return Status::IOError(what + ": chmod 0700: " + std::strerror(errno));
    CTFS_LOG(kInfo) << key << ": " << dir << " was mode " << Octal(st.st_mode) << ", made 0700 ("
                    << holds << " is private to the daemon)";
  }
  return Status::OK();
}

}  // namespace cubetorchfs
