#include "common/trusted_file.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/unique_fd.h"

namespace cubetorchfs {

std::string OwnerName(uid_t uid) {
  std::string out = "uid " + std::to_string(uid);
  passwd pw{};
  passwd* found = nullptr;
  std::vector<char> buf(4096);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr)
    out += std::string(" (") + found->pw_name + ")";
  return out;
}

bool TrustedOwner(uid_t uid) { return uid == 0 || uid == ::getuid() || uid == ::geteuid(); }

Result<std::string> ReadTrustedControlFile(const std::string& path) {
  const std::string what = "control file " + path;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no control file");
    struct stat l;
    if (errno == ELOOP && ::lstat(path.c_str(), &l) == 0)
      return Status::PermissionDenied(what + " is a symlink (owned by " + OwnerName(l.st_uid) +
                                      "), not trusted");
    return Status::IOError(path + ": " + std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::IOError(path + ": " + std::strerror(errno));
  const std::string owner = OwnerName(st.st_uid);
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
    return Status::PermissionDenied(what + " is not a plain file (owned by " + owner +
                                    "), not trusted");
  if (!TrustedOwner(st.st_uid))
    return Status::PermissionDenied(what + " is owned by " + owner +
                                    ", neither root nor this user, not trusted");
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    return Status::PermissionDenied(what + " (owned by " + owner +
                                    ") is writable by group or others, not trusted");
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOError(path + ": " + std::strerror(errno));
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (1u << 20)) return Status::Corruption(path + ": control file too large");
  }
  return text;
}

}  // namespace cubetorchfs
