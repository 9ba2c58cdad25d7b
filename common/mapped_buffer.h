// A growable run of bytes in anonymous memory of its own, grown with mremap: the kernel moves
// the pages, so growing never copies the bytes and never holds the old block beside the new
// one (a std::string of 3 GB that grows holds 3 GB and its doubled copy at once, and copies
// them). For the large append-only structures a client can make the daemon build (registered
// file lists: docs/memory.md). Capacity is whole pages; what is reserved and not yet touched
// costs no memory until written.
//
// Not thread-safe; movable, not copyable.
#pragma once

#include <cstddef>
#include <cstring>
#include <utility>

namespace cubetorchfs {

class MappedBuffer {
 public:
  MappedBuffer() = default;
  ~MappedBuffer();
  MappedBuffer(MappedBuffer&& o) noexcept { Swap(o); }
  MappedBuffer& operator=(MappedBuffer&& o) noexcept {
    if (this != &o) {
      MappedBuffer gone(std::move(o));
      Swap(gone);
    }
    return *this;
  }
  MappedBuffer(const MappedBuffer&) = delete;
  MappedBuffer& operator=(const MappedBuffer&) = delete;

  // Room for at least `bytes` (rounded up to pages); false if the kernel has no memory for it
  // (the buffer is unchanged).
  bool Reserve(size_t bytes);
  // REQUIRES: size() + n <= capacity().
  void Append(const void* data, size_t n) {
    if (n == 0) return;
    std::memcpy(p_ + size_, data, n);
    size_ += n;
  }
  const char* data() const { return p_; }
  size_t size() const { return size_; }
  size_t capacity() const { return cap_; }
  // The capacity Reserve(bytes) would give.
  static size_t Rounded(size_t bytes);

 private:
  void Swap(MappedBuffer& o) noexcept;

  char* p_ = nullptr;
  size_t size_ = 0;
  size_t cap_ = 0;
};

}  // namespace cubetorchfs
