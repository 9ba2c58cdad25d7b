// h2d.h when built without CUDA: every call says so.
#include "cuda/h2d.h"

namespace cubetorchfs::cuda {

namespace {
Status NotBuilt() { return Status::NotSupported("CUDA copy: cubetorchfs was built without CUDA"); }
}  // namespace

bool CudaRuntimeBuilt() { return false; }
Result<void*> AllocPinned(size_t) { return NotBuilt(); }
void FreePinned(void*) {}
Result<std::unique_ptr<Copier>> NewCopier(int, int) { return NotBuilt(); }

}  // namespace cubetorchfs::cuda
