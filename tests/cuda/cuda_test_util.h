// Whether this machine can run CUDA code at all, for tests that skip without a GPU.
#pragma once

#include <string>

#ifdef CUBETORCH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace cubetorchfs::cuda::testing {

// Why this machine cannot run a CUDA kernel at all, or "" when it has a device and a driver.
// Only "no device" and "no (or too old a) driver" are reasons: any other CUDA error (a failed
// launch, an illegal address, a broken context) is not absence of hardware and must fail.
inline std::string NoCudaDeviceReason() {
#ifdef CUBETORCH_WITH_CUDA
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    return cudaGetErrorString(err);
  }
  if (err == cudaSuccess && count == 0) return "no CUDA device";
  return "";
#else
  return "built without CUDA";
#endif
}

}  // namespace cubetorchfs::cuda::testing
