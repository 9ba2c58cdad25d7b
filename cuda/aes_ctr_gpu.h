// AES-CTR on the GPU: a kernel running the portable core of aes_core.h, one thread per 16-byte
// counter block, same counter rule as crypto::CtrXorAt. Built only when CUDA is enabled
// (CMake option CUBETORCH_CUDA); otherwise every call returns NotSupported("... built without
// CUDA") and callers fall back to the CPU path.
//
// Thread safety: reentrant; calls on different streams may overlap.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace cubetorchfs::cuda {

// True when this binary was built with the CUDA kernel.
bool AesCtrGpuBuilt();

// XORs the keystream into `device_data[0, len)` (device memory) for payload offsets
// [offset, offset + len), on `stream` (a cudaStream_t; null = the default stream), and waits
// for it. InvalidArgument for a bad key length; IOError naming the CUDA error otherwise.
Status CtrXorDevice(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                    void* device_data, size_t len, void* stream);

// Test/benchmark helper: copies host_data to `device_misalign` (0..15) bytes past a fresh
// device allocation, runs CtrXorDevice there, copies it back.
Status CtrXorViaDevice(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                       uint8_t* host_data, size_t len, unsigned device_misalign = 0);

}  // namespace cubetorchfs::cuda
