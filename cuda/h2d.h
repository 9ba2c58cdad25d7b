// Host-to-device copies for the loader: pinned host memory and an asynchronous copier with
// one completion event per staging slot, so a slot's bytes can go to the GPU while the
// reading threads fill the other slots. Built with CUDA when CUBETORCH_CUDA is on; otherwise
// every call returns NotSupported("... built without CUDA").
//
// The copier is an interface so the loader's pipeline (loader/device_load.h) can be tested on
// the CPU with a host implementation.
//
// Thread safety: a Copier may be called from several threads at once (CUDA streams and events
// are thread-safe); AllocPinned/FreePinned are reentrant.
#pragma once

#include <cstddef>
#include <memory>

#include "common/status.h"

namespace cubetorchfs::cuda {

// True when this binary was built with the CUDA runtime.
bool CudaRuntimeBuilt();

// Page-locked host memory (cudaHostAlloc, portable). NotSupported without CUDA.
Result<void*> AllocPinned(size_t bytes);
void FreePinned(void* p);

// Thread safety: CopyAsync and WaitSlot are called from many read threads at once (each for
// a slot it holds); an implementation must allow that. Sync and DecryptOnDevice are called
// by one thread, after the copies.
class Copier {
 public:
  virtual ~Copier() = default;
  // Starts copying src[0, len) (host) to dst (device); `slot`'s event completes with it.
  virtual Status CopyAsync(void* dst, const void* src, size_t len, int slot) = 0;
  // Waits until the last copy started on `slot` has finished (its source may be reused).
  virtual Status WaitSlot(int slot) = 0;
  // Waits for every copy started so far.
  virtual Status Sync() = 0;
  // Device-side AES-CTR over dst[0, len) for payload offsets [offset, offset + len), after
  // every copy started so far (same stream); waits for it.
  virtual Status DecryptOnDevice(const uint8_t* key, size_t key_len, const uint8_t* iv,
                                 uint64_t offset, void* dst, size_t len) = 0;
};

// A copier on a new stream of CUDA device `device` with `slots` events. NotSupported without
// CUDA; IOError naming the CUDA error (e.g. no device) otherwise.
Result<std::unique_ptr<Copier>> NewCopier(int device, int slots);

}  // namespace cubetorchfs::cuda
