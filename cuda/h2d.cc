// The CUDA runtime implementation of h2d.h.
#include "cuda/h2d.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cuda/aes_ctr_gpu.h"

namespace cubetorchfs::cuda {

namespace {

Status CudaError(const std::string& what, cudaError_t err) {
  return Status::IOError(std::string("CUDA: ") + what + ": " + cudaGetErrorString(err));
}

class CudaCopier final : public Copier {
 public:
  ~CudaCopier() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    // The caller's thread keeps the device it had (torch follows the current device).
    if (prev_device_ >= 0) cudaSetDevice(prev_device_);
  }

  // REQUIRES: called on the thread that will destroy the copier.
  Status Init(int device, int slots) {
    if (cudaGetDevice(&prev_device_) != cudaSuccess) prev_device_ = -1;
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // not left behind for the next caller's launch check
      return CudaError("cudaSetDevice(" + std::to_string(device) + ")", err);
    }
    device_ = device;
    err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (err != cudaSuccess) return CudaError("cudaStreamCreate", err);
    events_.resize(static_cast<size_t>(slots), nullptr);
    for (auto& e : events_) {
      err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      if (err != cudaSuccess) return CudaError("cudaEventCreate", err);
    }
    return Status::OK();
  }

  Status CopyAsync(void* dst, const void* src, size_t len, int slot) override {
    cudaSetDevice(device_);  // the calling thread may not have picked the device yet
    cudaError_t err = cudaMemcpyAsync(dst, src, len, cudaMemcpyHostToDevice, stream_);
    if (err != cudaSuccess) return CudaError("cudaMemcpyAsync", err);
    err = cudaEventRecord(events_[static_cast<size_t>(slot)], stream_);
    if (err != cudaSuccess) return CudaError("cudaEventRecord", err);
    return Status::OK();
  }

  Status WaitSlot(int slot) override {
    cudaError_t err = cudaEventSynchronize(events_[static_cast<size_t>(slot)]);
    if (err != cudaSuccess) return CudaError("cudaEventSynchronize", err);
    return Status::OK();
  }

  Status Sync() override {
    cudaError_t err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) return CudaError("cudaStreamSynchronize", err);
    return Status::OK();
  }

  Status DecryptOnDevice(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                         void* dst, size_t len) override {
    cudaSetDevice(device_);
    return CtrXorDevice(key, key_len, iv, offset, dst, len, stream_);
  }

 private:
  int device_ = 0;
  int prev_device_ = -1;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

}  // namespace

bool CudaRuntimeBuilt() { return true; }

Result<void*> AllocPinned(size_t bytes) {
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) return CudaError("cudaHostAlloc", err);
  return p;
}

void FreePinned(void* p) {
  if (p != nullptr) cudaFreeHost(p);
}

Result<std::unique_ptr<Copier>> NewCopier(int device, int slots) {
  auto c = std::make_unique<CudaCopier>();
  CTFS_RETURN_IF_ERROR(c->Init(device, slots));
  return std::unique_ptr<Copier>(std::move(c));
}

}  // namespace cubetorchfs::cuda
