// Writes a safetensors file, plain or encrypted in the veTurboIO header format with our
// integrity tag (crypto/integrity.h).
//
// The file appears atomically: bytes go to "<path>.tmp.<pid>" in the same directory, which is
// fsynced and renamed over `path` (then the directory is fsynced), so a crash leaves either
// the old file or the new one. Encrypted files get a fresh random IV (never a reused
// keystream); the key comes from the key sources of crypto/key_source.h and its size picks
// CTR-128 or CTR-256.
//
// Thread safety: reentrant.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "loader/safetensors.h"

namespace cubetorchfs::loader {

struct SaveTensor {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<uint64_t> shape;
  const uint8_t* data = nullptr;  // the tensor's bytes, little-endian, contiguous
  uint64_t len = 0;               // must equal the shape's byte size
};

struct SaveOptions {
  bool encrypt = false;
  int threads = 0;  // 0: DefaultIoThreads()
};

// Tensors are written in the order given (callers usually sort by alignment, then name).
// InvalidArgument naming the tensor for a size that does not match its shape or a duplicate
// name; IOError naming the path for a failed write.
Status SaveSafetensors(const std::string& path, const std::vector<SaveTensor>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const SaveOptions& options);

}  // namespace cubetorchfs::loader
