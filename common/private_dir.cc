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

// Makes `dir` as `create` says (parents 0755, as mkdir -p would); errors are reported later,
// when the directory is opened.
Status MakeDir(const std::string& dir, const std::string& what, CreateDir create, mode_t mode) {
  if (create != CreateDir::kNo && ::mkdir(dir.c_str(), mode) != 0 && errno == ENOENT &&
      create == CreateDir::kWithParents) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(dir).parent_path(), ec);
    if (ec) return Status::IOError(what + ": " + ec.message());
    ::mkdir(dir.c_str(), mode);
  }
  return Status::OK();
}

Status RefuseLinks(const std::string& dir, const std::string& what) {
  const std::string link = SymlinkInPath(dir);
  if (link.empty()) return Status::OK();
  char target[PATH_MAX];
  const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
  target[n > 0 ? n : 0] = '\0';
  return Status::PermissionDenied(what + ": " + link + " is a symlink (to " + target +
                                  "); refusing it (name the real directory)");
}

// Opens `dir` (never through a link at its name) and checks its owner and its ancestors; an
// empty fd when it is missing and `create` is kNo.
Result<UniqueFd> OpenOwnedDir(const std::string& dir, const std::string& what,
                              std::string_view holds, CreateDir create, struct stat* st) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    struct stat l;
    if (::lstat(dir.c_str(), &l) == 0 && S_ISLNK(l.st_mode))
      return Status::PermissionDenied(what +
                                      " is a symlink; refusing it (name the real directory)");
    if (err == ENOENT && create == CreateDir::kNo) return UniqueFd();
    return Status::IOError(what + ": " + std::strerror(err));
  }
  if (::fstat(fd.get(), st) != 0) return Status::IOError(what + ": " + std::strerror(errno));
  if (st->st_uid != ::geteuid() && st->st_uid != 0)
    return Status::PermissionDenied(what + " is owned by uid " + std::to_string(st->st_uid) +
                                    ", another user; refusing it (it would see " +
                                    std::string(holds) + ")");
  std::string bad;
  if (!AncestorsAreSafe(dir, &bad))
    return Status::PermissionDenied(what + ": " + bad +
                                    " above it lets another user replace it; "
                                    "refusing it (put it in a directory only root can change)");
  return fd;
}

}  // namespace

std::string SymlinkInPath(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(path, ec).lexically_normal();
  if (ec) return "";
  std::filesystem::path p = abs.root_path();
  for (const auto& part : abs.relative_path()) {
    if (part.empty()) continue;
    p /= part;
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0) return "";
    if (S_ISLNK(st.st_mode)) return p.string();
  }
  return "";
}

Status EnsureDaemonDir(const std::string& dir, std::string_view key, std::string_view holds,
                       CreateDir create, mode_t create_mode) {
  const std::string what = std::string(key) + ": " + dir;
  CTFS_RETURN_IF_ERROR(RefuseLinks(dir, what));
  CTFS_RETURN_IF_ERROR(MakeDir(dir, what, create, create_mode));
  CTFS_RETURN_IF_ERROR(RefuseLinks(dir, what));  // none planted while it was made
  struct stat st;
  CTFS_ASSIGN_OR_RETURN(UniqueFd fd, OpenOwnedDir(dir, what, holds, create, &st));
  if (fd.get() < 0) return Status::OK();  // missing, and may be
  if ((st.st_mode & 022) != 0 && (st.st_mode & S_ISVTX) == 0)
    return Status::PermissionDenied(what + " (mode " + Octal(st.st_mode) +
                                    ") lets other users replace what is in it; refusing it");
  return Status::OK();
}

Status EnsurePrivateDir(const std::string& dir, std::string_view key, std::string_view holds,
                        CreateDir create) {
  const std::string what = std::string(key) + ": " + dir;
  CTFS_RETURN_IF_ERROR(RefuseLinks(dir, what));
  CTFS_RETURN_IF_ERROR(MakeDir(dir, what, create, 0700));
  CTFS_RETURN_IF_ERROR(RefuseLinks(dir, what));
  struct stat st;
  CTFS_ASSIGN_OR_RETURN(UniqueFd fd, OpenOwnedDir(dir, what, holds, create, &st));
  if (fd.get() < 0) return Status::OK();  // missing, and may be
  if ((st.st_mode & 07777) != 0700) {
    if (::fchmod(fd.get(), 0700) != 0)
      return Status::IOError(what + ": chmod 0700: " + std::strerror(errno));
    CTFS_LOG(kInfo) << key << ": " << dir << " was mode " << Octal(st.st_mode) << ", made 0700 ("
                    << holds << " is private to the daemon)";
  }
  return Status::OK();
}

}  // namespace cubetorchfs
