#include "cuda/aes_ctr_portable.h"

#include <algorithm>
#include <string>

#include "cuda/aes_core.h"

namespace cubetorchfs::cuda {

namespace {

// Wipes the expanded key on every exit path.
struct RoundKeysWiper {
  AesRoundKeys& rk;
  ~RoundKeysWiper() {
    volatile uint8_t* p = rk.bytes;
    for (size_t i = 0; i < sizeof(rk.bytes); ++i) p[i] = 0;
  }
};

}  // namespace

Status CtrXorAtPortable(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                        uint8_t* data, size_t len) {
  if (key_len != 16 && key_len != 32) {
    return Status::InvalidArgument("AES key must be 16 or 32 bytes, got " +
                                   std::to_string(key_len));
  }
  AesRoundKeys rk;
  RoundKeysWiper wiper{rk};
  AesExpandKey(kAesSbox, key, key_len, &rk);
  uint64_t block = offset / 16;
  unsigned skip = static_cast<unsigned>(offset % 16);
  size_t done = 0;
  while (done < len) {
    const unsigned n = static_cast<unsigned>(std::min<size_t>(16 - skip, len - done));
    AesCtrXorBlock(kAesSbox, rk, iv, block, skip, data + done, n);
    done += n;
    ++block;
    skip = 0;
  }
  return Status::OK();
}

}  // namespace cubetorchfs::cuda
