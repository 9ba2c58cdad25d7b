#include "common/mapped_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <utility>

namespace cubetorchfs {

namespace {
size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
}  // namespace

MappedBuffer::~MappedBuffer() {
  if (p_ != nullptr) munmap(p_, cap_);
}

size_t MappedBuffer::Rounded(size_t bytes) {
  const size_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

bool MappedBuffer::Reserve(size_t bytes) {
  if (bytes <= cap_) return true;
  const size_t want = Rounded(bytes);
  if (want < bytes) return false;  // overflow
  void* p = p_ == nullptr
                ? mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                : mremap(p_, cap_, want, MREMAP_MAYMOVE);
  if (p == MAP_FAILED) return false;
  p_ = static_cast<char*>(p);
  cap_ = want;
  return true;
}

void MappedBuffer::Swap(MappedBuffer& o) noexcept {
  std::swap(p_, o.p_);
  std::swap(size_, o.size_);
  std::swap(cap_, o.cap_);
}

}  // namespace cubetorchfs
