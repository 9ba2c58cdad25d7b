// The GPU AES-CTR API when built without CUDA: every call says so.
#include "cuda/aes_ctr_gpu.h"

namespace cubetorchfs::cuda {

namespace {
Status NotBuilt() {
  return Status::NotSupported("AES-CTR on the GPU: cubetorchfs was built without CUDA");
}
}  // namespace

bool AesCtrGpuBuilt() { return false; }

Status CtrXorDevice(const uint8_t*, size_t, const uint8_t*, uint64_t, void*, size_t, void*) {
  return NotBuilt();
}

Status CtrXorViaDevice(const uint8_t*, size_t, const uint8_t*, uint64_t, uint8_t*, size_t,
                       unsigned) {
  return NotBuilt();
}

}  // namespace cubetorchfs::cuda
