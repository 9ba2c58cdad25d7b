// The GPU AES-CTR kernel and its host API (see aes_ctr_gpu.h).
//
// The rounds are the word (T-table) form of aes_core.h. Each lane reads T0 from its own copy in
// shared memory, laid out so that lane l's copy sits in bank l: 32 lanes' lookups never wait on
// each other (one 256-word table would serialize a warp's random lookups on bank conflicts).
// 32 copies take 32 KiB of shared memory per block.
//
// The range is cut into 16-byte chunks aligned in memory (AesCtrLayoutOf): whole chunks are one
// 16-byte load and store. Where the payload offset and the address disagree mod 16, a chunk
// needs the end of one keystream block and the start of the next: lane l encrypts block l and
// takes block l + 1 from lane l + 1 with a shuffle, so a warp covers 31 chunks with 32 blocks.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "cuda/aes_core.h"
#include "cuda/aes_ctr_gpu.h"

namespace cubetorchfs::cuda {

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kLanes = 32;
constexpr size_t kTableBytes = 256 * kLanes * sizeof(uint32_t);

__constant__ uint8_t kDeviceSbox[256] = {CTFS_AES_SBOX_VALUES};

// Lane `lane`'s copy of T0: entry x at word x * 32 + lane, in bank `lane`.
struct LaneT0 {
  const uint32_t* t;
  __device__ uint32_t operator()(unsigned x) const { return t[x * kLanes]; }
};

template <int Rounds>
__global__ void __launch_bounds__(kThreads)
    AesCtrKernel(AesWordKeys rk, uint64_t iv_hi, uint64_t iv_lo, AesCtrLayout l, int64_t rel0,
                 uint8_t* data, uint64_t len) {
  extern __shared__ uint32_t table[];
  for (unsigned i = threadIdx.x; i < 256 * kLanes; i += blockDim.x) {
    table[i] = AesT0Entry(kDeviceSbox, i / kLanes);
  }
  __syncthreads();
  const unsigned lane = threadIdx.x % kLanes;
  const LaneT0 t0{table + lane};
  const unsigned per_warp = l.shift == 0 ? kLanes : kLanes - 1;
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kLanes;
  // The loop condition is the same for the 32 lanes of a warp, so the shuffle has them all.
  for (uint64_t c0 = warp * per_warp; c0 < l.chunks; c0 += warps * per_warp) {
    const uint64_t c = c0 + lane;
    uint32_t a[4], ks[4];
    AesCtrCounterWords(iv_hi, iv_lo, l.block0 + c, a);
    AesEncryptWords<Rounds>(t0, rk, a);
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = AesBswap(a[i]);
    if (l.shift == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) ks[i] = a[i];
    } else {
      uint32_t b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) b[i] = __shfl_down_sync(0xffffffffu, a[i], 1);
      AesKeystreamShifted(a, b, l.shift, ks);
    }
    if (lane < per_warp && c < l.chunks) {
      AesXorChunk(data, len, rel0 + static_cast<int64_t>(16 * c), ks);
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

template <int Rounds>
Status Launch(const AesWordKeys& wk, const uint8_t* iv, uint64_t offset, uint8_t* data, size_t len,
              cudaStream_t stream) {
  const AesCtrLayout l = AesCtrLayoutOf(reinterpret_cast<uintptr_t>(data), len, offset);
  const int64_t rel0 =
      static_cast<int64_t>(l.base) - static_cast<int64_t>(reinterpret_cast<uintptr_t>(data));
  // Enough blocks to fill every multiprocessor, each looping over its share: the table is
  // built once per block, not once per 8 KiB.
  int device = 0, sms = 1, per_sm = 1;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, AesCtrKernel<Rounds>, kThreads,
                                                        kTableBytes);
  }
  if (err != cudaSuccess) return CudaError("device query", err);
  const unsigned per_block = (kThreads / kLanes) * (kLanes - 1);  // chunks per block and pass
  const uint64_t needed = (l.chunks + per_block - 1) / per_block;
  const uint64_t full = static_cast<uint64_t>(sms) * static_cast<uint64_t>(per_sm > 0 ? per_sm : 1);
  const unsigned grid = static_cast<unsigned>(needed < full ? needed : full);
  // A failed call before this one (by anyone on this thread) leaves its error to be read: take
  // it now, so the check below sees this launch's error alone.
  (void)cudaGetLastError();
  AesCtrKernel<Rounds><<<grid, kThreads, kTableBytes, stream>>>(
      wk, AesLoadBe64(iv), AesLoadBe64(iv + 8), l, rel0, data, len);
  err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("kernel launch", err);
  return Status::OK();
}

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
  AesWordKeys wk;
  AesWordKeysFrom(rk, &wk);
  auto s = static_cast<cudaStream_t>(stream);
  auto* data = static_cast<uint8_t*>(device_data);
  Status launched = rk.rounds == 10 ? Launch<10>(wk, iv, offset, data, len, s)
                                    : Launch<14>(wk, iv, offset, data, len, s);
  // The launch took its own copy of the parameters.
  volatile uint8_t* wipe = rk.bytes;
  for (size_t i = 0; i < sizeof(rk.bytes); ++i) wipe[i] = 0;
  volatile uint32_t* wipe_words = wk.w;
  for (size_t i = 0; i < sizeof(wk.w) / sizeof(wk.w[0]); ++i) wipe_words[i] = 0;
  CTFS_RETURN_IF_ERROR(launched);
  cudaError_t err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) return CudaError("kernel", err);
  return Status::OK();
}

Status CtrXorViaDevice(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                       uint8_t* host_data, size_t len, unsigned device_misalign) {
  if (len == 0) return CtrXorDevice(key, key_len, iv, offset, nullptr, 0, nullptr);
  if (device_misalign > 15) return Status::InvalidArgument("device_misalign above 15");
  DeviceBuffer buf;
  cudaError_t err = cudaMalloc(&buf.p, len + 16);
  if (err != cudaSuccess) return CudaError("cudaMalloc", err);
  uint8_t* at = static_cast<uint8_t*>(buf.p) + device_misalign;
  err = cudaMemcpy(at, host_data, len, cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return CudaError("copy to device", err);
  CTFS_RETURN_IF_ERROR(CtrXorDevice(key, key_len, iv, offset, at, len, nullptr));
  err = cudaMemcpy(host_data, at, len, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return CudaError("copy from device", err);
  return Status::OK();
}

}  // namespace cubetorchfs::cuda
