// Loading a model file's data section into device memory: the reading threads fill pinned
// staging slots, and each filled slot is copied to the device asynchronously while the
// threads go on reading into the other slots. A slot is reused once its copy has completed.
// With `gpu_decrypt` the ciphertext is copied and decrypted on the device after the last copy;
// otherwise each thread decrypts its slot on the CPU before the copy. The integrity tag (if
// any) is checked on the CPU either way, before this returns OK.
//
// The copier is cuda::Copier, so this logic runs on the CPU in tests with a host copier.
//
// Thread safety: one call at a time per `slots` set.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "cuda/h2d.h"
#include "loader/model_file.h"

namespace cubetorchfs::loader {

struct DeviceLoadOptions {
  int threads = 0;          // reader threads (0: DefaultIoThreads())
  bool gpu_decrypt = true;  // decrypt on the device (when the file is encrypted)
};

// Copies file.data_size() bytes to `device_dst` through `slots` (host buffers of
// `slot_bytes` each, pinned for real overlap; at least 2). The copier must have at least
// slots.size() slots.
Status LoadToDevice(ModelFile& file, cuda::Copier& copier, const std::vector<uint8_t*>& slots,
                    uint64_t slot_bytes, void* device_dst, const DeviceLoadOptions& options);

}  // namespace cubetorchfs::loader
