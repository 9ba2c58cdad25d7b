// Memory that outlives the process: the pages of a memfd, mapped shared over one reserved
// range. A supervisor that holds the memfd (daemon/supervisor.h) can give the pages of a
// process that died to the next one, which maps them again and finds what was written,
// up to the last store the dead process made. The memfd is as large as the reservation from
// the start and sparse: a page costs memory only once written.
//
// Movable, not copyable; not thread-safe (the bytes are the caller's to guard).
#pragma once

#include <cstddef>
#include <utility>

#include "common/status.h"

namespace cubetorchfs {

class DurableRegion {
 public:
  DurableRegion() = default;
  ~DurableRegion();
  DurableRegion(DurableRegion&& o) noexcept { Swap(o); }
  DurableRegion& operator=(DurableRegion&& o) noexcept {
    if (this != &o) {
      DurableRegion gone(std::move(o));
      Swap(gone);
    }
    return *this;
  }
  DurableRegion(const DurableRegion&) = delete;
  DurableRegion& operator=(const DurableRegion&) = delete;

  // A fresh region of `bytes` (zero-filled) in a new memfd named `name`. Where no memfd can be
  // made, anonymous private memory: the region then works but dies with the process
  // (durable() is false).
  static DurableRegion Create(const char* name, size_t bytes);
  // As Create, but an error where not even anonymous memory can be reserved (`ulimit -v`),
  // rather than an abort: for a region the caller can do without.
  static Result<DurableRegion> TryCreate(const char* name, size_t bytes);
  // The region in `fd` (a memfd another process left), of exactly `bytes`; takes `fd`, which
  // is closed with the region or on failure.
  static Result<DurableRegion> Adopt(int fd, size_t bytes);

  char* data() const { return p_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }  // -1 where not durable
  bool durable() const { return fd_ >= 0; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  void Swap(DurableRegion& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(size_, o.size_);
    std::swap(fd_, o.fd_);
  }

  char* p_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace cubetorchfs
