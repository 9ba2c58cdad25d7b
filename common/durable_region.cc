#include "common/durable_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/logging.h"

namespace cubetorchfs {
namespace {

char* MapShared(int fd, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) return nullptr;
  // A process this one forks (a helper) has no business with it.
  ::madvise(p, bytes, MADV_DONTFORK);
  // Nor a core dump: the reservation is far larger than what is written.
  ::madvise(p, bytes, MADV_DONTDUMP);
  return static_cast<char*>(p);
}

}  // namespace

DurableRegion::~DurableRegion() {
  if (p_ != nullptr) ::munmap(p_, size_);
  if (fd_ >= 0) ::close(fd_);
}

DurableRegion DurableRegion::Create(const char* name, size_t bytes) {
  Result<DurableRegion> r = TryCreate(name, bytes);
  if (!r.ok()) {
    CTFS_LOG(kError) << r.status().ToString();
    std::abort();
  }
  return std::move(r).value();
}

Result<DurableRegion> DurableRegion::TryCreate(const char* name, size_t bytes) {
  DurableRegion r;
  r.size_ = bytes;
  const int fd = ::memfd_create(name, MFD_CLOEXEC);
  if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    r.p_ = MapShared(fd, bytes);
    if (r.p_ != nullptr) {
      r.fd_ = fd;
      return r;
    }
  }
  const int err = errno;
  if (fd >= 0) ::close(fd);
  CTFS_LOG(kWarn) << "no memfd for " << name << " (" << std::strerror(err)
                  << "): it will not outlive this process";
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return Status::FromErrno(
        errno, "cannot reserve " + std::to_string(bytes) + " bytes for " + std::string(name));
  r.p_ = static_cast<char*>(p);
  return r;
}

Result<DurableRegion> DurableRegion::Adopt(int fd, size_t bytes) {
  DurableRegion r;
  r.fd_ = fd;                        // closed by r from here on
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);  // handed over with it cleared: no process this one starts
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return Status::FromErrno(errno, "fstat of an earlier process's region");
  if (static_cast<size_t>(st.st_size) != bytes)
    return Status::InvalidArgument("an earlier process's region is " + std::to_string(st.st_size) +
                                   " bytes, not " + std::to_string(bytes));
  r.p_ = MapShared(fd, bytes);
  if (r.p_ == nullptr) return Status::FromErrno(errno, "mmap of an earlier process's region");
  r.size_ = bytes;
  return r;
}

}  // namespace cubetorchfs
