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

struct HostT0 {
  uint32_t t[256];
  HostT0() {
    for (unsigned x = 0; x < 256; ++x) t[x] = AesT0Entry(kAesSbox, x);
  }
  uint32_t operator()(unsigned x) const { return t[x]; }
};

template <int Rounds>
void XorChunks(const AesWordKeys& wk, const uint8_t* iv, uint64_t offset, uint8_t* data,
               size_t len) {
  static const HostT0 t0;
  const AesCtrLayout l = AesCtrLayoutOf(reinterpret_cast<uintptr_t>(data), len, offset);
  const uint64_t iv_hi = AesLoadBe64(iv), iv_lo = AesLoadBe64(iv + 8);
  const int64_t rel0 =
      static_cast<int64_t>(l.base) - static_cast<int64_t>(reinterpret_cast<uintptr_t>(data));
  for (uint64_t c = 0; c < l.chunks; ++c) {
    uint32_t a[4], b[4], ks[4];
    AesCtrCounterWords(iv_hi, iv_lo, l.block0 + c, a);
    AesEncryptWords<Rounds>(t0, wk, a);
    for (auto& w : a) w = AesBswap(w);
    if (l.shift == 0) {
      for (int i = 0; i < 4; ++i) ks[i] = a[i];
    } else {
      AesCtrCounterWords(iv_hi, iv_lo, l.block0 + c + 1, b);
      AesEncryptWords<Rounds>(t0, wk, b);
      for (auto& w : b) w = AesBswap(w);
      AesKeystreamShifted(a, b, l.shift, ks);
    }
    AesXorChunk(data, len, rel0 + static_cast<int64_t>(16 * c), ks);
  }
}

}  // namespace

Status CtrXorAtWords(const uint8_t* key, size_t key_len, const uint8_t* iv, uint64_t offset,
                     uint8_t* data, size_t len) {
  if (key_len != 16 && key_len != 32) {
    return Status::InvalidArgument("AES key must be 16 or 32 bytes, got " +
                                   std::to_string(key_len));
  }
  if (len == 0) return Status::OK();
  AesRoundKeys rk;
  RoundKeysWiper wiper{rk};
  AesExpandKey(kAesSbox, key, key_len, &rk);
  AesWordKeys wk;
  AesWordKeysFrom(rk, &wk);
  if (rk.rounds == 10) {
    XorChunks<10>(wk, iv, offset, data, len);
  } else {
    XorChunks<14>(wk, iv, offset, data, len);
  }
  volatile uint32_t* wipe = wk.w;
  for (size_t i = 0; i < sizeof(wk.w) / sizeof(wk.w[0]); ++i) wipe[i] = 0;
  return Status::OK();
}

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
