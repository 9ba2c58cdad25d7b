// The GPU AES-CTR kernel and its host API (see aes_ctr_gpu.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "cuda/aes_core.h"
#include "cuda/aes_ctr_gpu.h"

namespace cubetorchfs::cuda {

namespace {

__constant__ uint8_t kDeviceSbox[256] = {CTFS_AES_SBOX_VALUES};

struct IvBytes {
  uint8_t b[16];
};

// One thread per counter block touched by the range; grid-stride so any length fits.
// Block i covers payload bytes [first*16 + i*16, +16) clipped to [offset, offset + len).
__global__ void AesCtrKernel(AesRoundKeys rk, IvBytes iv, uint64_t first_block, unsigned skip0,
                             uint8_t* data, uint64_t len, uint64_t nblocks) {
  __shared__ uint8_t sbox[256];
  for (unsigned i = threadIdx.x; i < 256; i += blockDim.x) sbox[i] = kDeviceSbox[i];
  __syncthreads();
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nblocks;
       i += stride) {
    const uint64_t begin = i == 0 ? 0 : i * 16 - skip0;
    const unsigned ks_skip = i == 0 ? skip0 : 0;
    uint64_t n = 16 - ks_skip;
    if (n > len - begin) n = len - begin;
    uint8_t* p = data + begin;
    if (n == 16 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      // A whole, aligned block: one 16-byte load and store instead of 16 byte accesses.
      uint8_t ks[16];
      AesCtrCounter(iv.b, first_block + i, ks);
      AesEncryptBlock(sbox, rk, ks, ks);
      uint4 k;
      memcpy(&k, ks, 16);
      uint4 v = *reinterpret_cast<const uint4*>(p);
      v.x ^= k.x;
      v.y ^= k.y;
      v.z ^= k.z;
      v.w ^= k.w;
      *reinterpret_cast<uint4*>(p) = v;
    } else {
      AesCtrXorBlock(sbox, rk, iv.b, first_block + i, ks_skip, p, static_cast<unsigned>(n));
    }
  }
}

Status CudaError(const char* what, cudaError_t err) {
  return Status::IOError(std::string("AES-CTR on the GPU: ") + what + ": " +
                         cudaGetErrorString(err));
}

// RAII owner of device memory.
struct DeviceBuffer {
  void* p = nullptr;
  ~DeviceBuffer() {
    if (p != nullptr) cudaFree(p);
  }
};

}  // namespace

bool AesCtrGpuBuilt() { return true; }

Status CtrXorDevice(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                    void* device_data, size_t len, void* stream) {
  if (key_len != 16 && key_len != 32) {
    return Status::InvalidArgument("AES key must be 16 or 32 bytes, got " +
                                   std::to_string(key_len));
  }
  if (len == 0) return Status::OK();
  AesRoundKeys rk;
  AesExpandKey(kAesSbox, key, key_len, &rk);
  IvBytes ivb;
  for (int i = 0; i < 16; ++i) ivb.b[i] = iv[i];
  const unsigned skip0 = static_cast<unsigned>(offset % 16);
  const uint64_t nblocks = (skip0 + static_cast<uint64_t>(len) + 15) / 16;
  const unsigned threads = 256;
  uint64_t grid = (nblocks + threads - 1) / threads;
  if (grid > 65535ull * 16) grid = 65535ull * 16;
  auto s = static_cast<cudaStream_t>(stream);
  AesCtrKernel<<<static_cast<unsigned>(grid), threads, 0, s>>>(
      rk, ivb, offset / 16, skip0, static_cast<uint8_t*>(device_data), len, nblocks);
  volatile uint8_t* wipe = rk.bytes;  // the kernel got its own copy of the parameters
  for (size_t i = 0; i < sizeof(rk.bytes); ++i) wipe[i] = 0;
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("kernel launch", err);
  err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) return CudaError("kernel", err);
  return Status::OK();
}

Status CtrXorViaDevice(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                       uint8_t* host_data, size_t len) {
  if (len == 0) return CtrXorDevice(key, key_len, iv, offset, nullptr, 0, nullptr);
  DeviceBuffer buf;
  cudaError_t err = cudaMalloc(&buf.p, len);
  if (err != cudaSuccess) return CudaError("cudaMalloc", err);
  err = cudaMemcpy(buf.p, host_data, len, cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return CudaError("copy to device", err);
  CTFS_RETURN_IF_ERROR(CtrXorDevice(key, key_len, iv, offset, buf.p, len, nullptr));
  err = cudaMemcpy(host_data, buf.p, len, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return CudaError("copy from device", err);
  return Status::OK();
}

}  // namespace cubetorchfs::cuda
