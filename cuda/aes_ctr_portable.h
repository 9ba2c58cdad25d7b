// CPU AES-CTR over the portable core in aes_core.h — the same code the CUDA kernel runs, so
// tests can check the kernel's arithmetic against OpenSSL without a GPU. Same counter rule and
// in-place contract as crypto::CtrXorAt; much slower than OpenSSL (use that for real work).
//
// Thread safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace cubetorchfs::cuda {

// XORs data[0, len) with the keystream at payload offsets [offset, offset + len).
// InvalidArgument unless key_len is 16 or 32. `iv` points at 16 bytes.
Status CtrXorAtPortable(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                        uint8_t* data, size_t len);

// The same result by the CUDA kernel's method: the word (T-table) rounds, the counter as two
// 64-bit halves, and the range cut into 16-byte chunks aligned in memory (AesCtrLayoutOf), each
// chunk's keystream taken from two blocks where the payload offset and the address disagree
// mod 16. What the kernel does per warp (a lane's neighbour block through a shuffle) is here a
// second encryption; everything else is the same code.
Status CtrXorAtWords(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                     uint8_t* data, size_t len);

}  // namespace cubetorchfs::cuda
