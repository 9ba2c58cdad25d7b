// A portable AES-128/256 block cipher and the CTR counter rule, written once as
// `__host__ __device__` functions so the CUDA kernel (aes_ctr_kernel.cu) and the CPU test suite
// run the same code; the tests check it against OpenSSL.
//
// The S-box is passed in by pointer: host code uses kAesSbox, the kernel a copy in shared
// memory (a device cannot read a host array). Two forms: the byte-oriented rounds, small and
// obviously correct (the reference the tests hold everything else to), and the word (T-table)
// rounds and chunk layout the kernel runs, below. No secret-dependent branches; table lookups
// are secret-indexed, as in any table AES (fine for decrypting files on a machine we own).
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define CTFS_HD __host__ __device__
#else
#define CTFS_HD
#endif

namespace cubetorchfs::cuda {

// clang-format off
// The AES S-box (FIPS-197 figure 7), as an initializer list usable for host and __constant__
// arrays alike.
#define CTFS_AES_SBOX_VALUES                                                                    \
  0x63, 0x7c, 0x77, 0x7b, 0xf2, 0x6b, 0x6f, 0xc5, 0x30, 0x01, 0x67, 0x2b, 0xfe, 0xd7, 0xab,    \
      0x76, 0xca, 0x82, 0xc9, 0x7d, 0xfa, 0x59, 0x47, 0xf0, 0xad, 0xd4, 0xa2, 0xaf, 0x9c, 0xa4, \
      0x72, 0xc0, 0xb7, 0xfd, 0x93, 0x26, 0x36, 0x3f, 0xf7, 0xcc, 0x34, 0xa5, 0xe5, 0xf1, 0x71, \
      0xd8, 0x31, 0x15, 0x04, 0xc7, 0x23, 0xc3, 0x18, 0x96, 0x05, 0x9a, 0x07, 0x12, 0x80, 0xe2, \
      0xeb, 0x27, 0xb2, 0x75, 0x09, 0x83, 0x2c, 0x1a, 0x1b, 0x6e, 0x5a, 0xa0, 0x52, 0x3b, 0xd6, \
      0xb3, 0x29, 0xe3, 0x2f, 0x84, 0x53, 0xd1, 0x00, 0xed, 0x20, 0xfc, 0xb1, 0x5b, 0x6a, 0xcb, \
      0xbe, 0x39, 0x4a, 0x4c, 0x58, 0xcf, 0xd0, 0xef, 0xaa, 0xfb, 0x43, 0x4d, 0x33, 0x85, 0x45, \
      0xf9, 0x02, 0x7f, 0x50, 0x3c, 0x9f, 0xa8, 0x51, 0xa3, 0x40, 0x8f, 0x92, 0x9d, 0x38, 0xf5, \
      0xbc, 0xb6, 0xda, 0x21, 0x10, 0xff, 0xf3, 0xd2, 0xcd, 0x0c, 0x13, 0xec, 0x5f, 0x97, 0x44, \
      0x17, 0xc4, 0xa7, 0x7e, 0x3d, 0x64, 0x5d, 0x19, 0x73, 0x60, 0x81, 0x4f, 0xdc, 0x22, 0x2a, \
      0x90, 0x88, 0x46, 0xee, 0xb8, 0x14, 0xde, 0x5e, 0x0b, 0xdb, 0xe0, 0x32, 0x3a, 0x0a, 0x49, \
      0x06, 0x24, 0x5c, 0xc2, 0xd3, 0xac, 0x62, 0x91, 0x95, 0xe4, 0x79, 0xe7, 0xc8, 0x37, 0x6d, \
      0x8d, 0xd5, 0x4e, 0xa9, 0x6c, 0x56, 0xf4, 0xea, 0x65, 0x7a, 0xae, 0x08, 0xba, 0x78, 0x25, \
      0x2e, 0x1c, 0xa6, 0xb4, 0xc6, 0xe8, 0xdd, 0x74, 0x1f, 0x4b, 0xbd, 0x8b, 0x8a, 0x70, 0x3e, \
      0xb5, 0x66, 0x48, 0x03, 0xf6, 0x0e, 0x61, 0x35, 0x57, 0xb9, 0x86, 0xc1, 0x1d, 0x9e, 0xe1, \
      0xf8, 0x98, 0x11, 0x69, 0xd9, 0x8e, 0x94, 0x9b, 0x1e, 0x87, 0xe9, 0xce, 0x55, 0x28, 0xdf, \
      0x8c, 0xa1, 0x89, 0x0d, 0xbf, 0xe6, 0x42, 0x68, 0x41, 0x99, 0x2d, 0x0f, 0xb0, 0x54, 0xbb, \
      0x16
// clang-format on

inline constexpr uint8_t kAesSbox[256] = {CTFS_AES_SBOX_VALUES};

inline constexpr int kAesMaxRounds = 14;

// Expanded key: (rounds + 1) round keys of 16 bytes.
struct AesRoundKeys {
  uint8_t bytes[(kAesMaxRounds + 1) * 16];
  int rounds;  // 10 for AES-128, 14 for AES-256
};

CTFS_HD inline uint8_t AesXtime(uint8_t x) {
  return static_cast<uint8_t>((x << 1) ^ ((x >> 7) * 0x1b));
}

// FIPS-197 key expansion. REQUIRES key_len is 16 or 32 (anything else expands as AES-128 from
// the first 16 bytes; callers validate first).
CTFS_HD inline void AesExpandKey(const uint8_t* sbox, const uint8_t* key, size_t key_len,
                                 AesRoundKeys* out) {
  const int nk = key_len == 32 ? 8 : 4;
  out->rounds = nk + 6;
  const int total_words = 4 * (out->rounds + 1);
  uint8_t* w = out->bytes;
  for (int i = 0; i < nk * 4; ++i) w[i] = key[i];
  uint8_t rcon = 1;
  for (int i = nk; i < total_words; ++i) {
    uint8_t t0 = w[(i - 1) * 4 + 0], t1 = w[(i - 1) * 4 + 1];
    uint8_t t2 = w[(i - 1) * 4 + 2], t3 = w[(i - 1) * 4 + 3];
    if (i % nk == 0) {
      const uint8_t r0 = t0;  // RotWord then SubWord, then Rcon
      t0 = static_cast<uint8_t>(sbox[t1] ^ rcon);
      t1 = sbox[t2];
      t2 = sbox[t3];
      t3 = sbox[r0];
      rcon = AesXtime(rcon);
    } else if (nk > 6 && i % nk == 4) {
      t0 = sbox[t0];
      t1 = sbox[t1];
      t2 = sbox[t2];
      t3 = sbox[t3];
    }
    w[i * 4 + 0] = static_cast<uint8_t>(w[(i - nk) * 4 + 0] ^ t0);
    w[i * 4 + 1] = static_cast<uint8_t>(w[(i - nk) * 4 + 1] ^ t1);
    w[i * 4 + 2] = static_cast<uint8_t>(w[(i - nk) * 4 + 2] ^ t2);
    w[i * 4 + 3] = static_cast<uint8_t>(w[(i - nk) * 4 + 3] ^ t3);
  }
}

// Encrypts one 16-byte block (in and out may alias).
CTFS_HD inline void AesEncryptBlock(const uint8_t* sbox, const AesRoundKeys& rk, const uint8_t* in,
                                    uint8_t* out) {
  uint8_t s[16];
  for (int i = 0; i < 16; ++i) s[i] = static_cast<uint8_t>(in[i] ^ rk.bytes[i]);
  for (int round = 1; round <= rk.rounds; ++round) {
    // SubBytes + ShiftRows: state is column-major, s[c*4 + r]; row r rotates left by r.
    uint8_t t[16];
    for (int c = 0; c < 4; ++c) {
      for (int r = 0; r < 4; ++r) t[c * 4 + r] = sbox[s[((c + r) & 3) * 4 + r]];
    }
    if (round != rk.rounds) {  // MixColumns
      for (int c = 0; c < 4; ++c) {
        const uint8_t a0 = t[c * 4], a1 = t[c * 4 + 1], a2 = t[c * 4 + 2], a3 = t[c * 4 + 3];
        const uint8_t all = static_cast<uint8_t>(a0 ^ a1 ^ a2 ^ a3);
        t[c * 4 + 0] = static_cast<uint8_t>(a0 ^ all ^ AesXtime(static_cast<uint8_t>(a0 ^ a1)));
        t[c * 4 + 1] = static_cast<uint8_t>(a1 ^ all ^ AesXtime(static_cast<uint8_t>(a1 ^ a2)));
        t[c * 4 + 2] = static_cast<uint8_t>(a2 ^ all ^ AesXtime(static_cast<uint8_t>(a2 ^ a3)));
        t[c * 4 + 3] = static_cast<uint8_t>(a3 ^ all ^ AesXtime(static_cast<uint8_t>(a3 ^ a0)));
      }
    }
    const uint8_t* k = rk.bytes + round * 16;
    for (int i = 0; i < 16; ++i) s[i] = static_cast<uint8_t>(t[i] ^ k[i]);
  }
  for (int i = 0; i < 16; ++i) out[i] = s[i];
}

// out = iv + block as a 128-bit big-endian integer, wrapping at 2^128.
CTFS_HD inline void AesCtrCounter(const uint8_t* iv, uint64_t block, uint8_t* out) {
  uint64_t carry = block;
  for (int i = 15; i >= 0; --i) {
    const uint64_t sum = static_cast<uint64_t>(iv[i]) + (carry & 0xff);
    out[i] = static_cast<uint8_t>(sum);
    carry = (carry >> 8) + (sum >> 8);
  }
}

// XORs the keystream block for counter block `block` into data[0, n) starting `skip` bytes
// into that keystream block. REQUIRES skip + n <= 16.
CTFS_HD inline void AesCtrXorBlock(const uint8_t* sbox, const AesRoundKeys& rk, const uint8_t* iv,
                                   uint64_t block, unsigned skip, uint8_t* data, unsigned n) {
  uint8_t ks[16];
  AesCtrCounter(iv, block, ks);
  AesEncryptBlock(sbox, rk, ks, ks);
  for (unsigned i = 0; i < n; ++i) data[i] ^= ks[skip + i];
}

// ---- The word-oriented (T-table) form the CUDA kernel runs --------------------------------------
// The state and the round keys as four big-endian column words (row 0 in the top byte); a round is
// 16 lookups in one table and 16 XORs. T0[x] = (2·S[x], S[x], S[x], 3·S[x]); the tables of rows
// 1-3 are T0 rotated right by 8, 16 and 24 bits, and the last round's S-box is T0's second byte.
// The lookup is a callable `uint32_t t0(unsigned x)`, so the kernel can read a copy of T0 in its
// own shared-memory bank and the CPU tests a plain array: both run this code.

CTFS_HD inline uint32_t AesRotr(uint32_t v, unsigned n) {
  return (v >> n) | (v << ((32u - n) & 31u));
}

CTFS_HD inline uint32_t AesBswap(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

CTFS_HD inline uint32_t AesT0Entry(const uint8_t* sbox, unsigned x) {
  const uint32_t s = sbox[x];
  const uint32_t s2 = AesXtime(static_cast<uint8_t>(s));
  return (s2 << 24) | (s << 16) | (s << 8) | (s2 ^ s);
}

struct AesWordKeys {
  uint32_t w[(kAesMaxRounds + 1) * 4];
  int rounds;
};

CTFS_HD inline void AesWordKeysFrom(const AesRoundKeys& rk, AesWordKeys* out) {
  out->rounds = rk.rounds;
  for (int i = 0; i < (rk.rounds + 1) * 4; ++i) {
    const uint8_t* b = rk.bytes + i * 4;
    out->w[i] = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
  }
}

// Encrypts the state s (big-endian column words) in place with `Rounds` rounds (10 or 14).
template <int Rounds, class T0>
CTFS_HD inline void AesEncryptWords(const T0& t0, const AesWordKeys& k, uint32_t s[4]) {
  uint32_t a0 = s[0] ^ k.w[0], a1 = s[1] ^ k.w[1], a2 = s[2] ^ k.w[2], a3 = s[3] ^ k.w[3];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 1; r < Rounds; ++r) {
    const uint32_t b0 = t0(a0 >> 24) ^ AesRotr(t0((a1 >> 16) & 255u), 8) ^
                        AesRotr(t0((a2 >> 8) & 255u), 16) ^ AesRotr(t0(a3 & 255u), 24) ^ k.w[4 * r];
    const uint32_t b1 = t0(a1 >> 24) ^ AesRotr(t0((a2 >> 16) & 255u), 8) ^
                        AesRotr(t0((a3 >> 8) & 255u), 16) ^ AesRotr(t0(a0 & 255u), 24) ^
                        k.w[4 * r + 1];
    const uint32_t b2 = t0(a2 >> 24) ^ AesRotr(t0((a3 >> 16) & 255u), 8) ^
                        AesRotr(t0((a0 >> 8) & 255u), 16) ^ AesRotr(t0(a1 & 255u), 24) ^
                        k.w[4 * r + 2];
    const uint32_t b3 = t0(a3 >> 24) ^ AesRotr(t0((a0 >> 16) & 255u), 8) ^
                        AesRotr(t0((a1 >> 8) & 255u), 16) ^ AesRotr(t0(a2 & 255u), 24) ^
                        k.w[4 * r + 3];
    a0 = b0;
    a1 = b1;
    a2 = b2;
    a3 = b3;
  }
  // Last round: SubBytes and ShiftRows only; S[x] is byte 2 of T0[x].
  // Column c of the output takes row r from column c + r (ShiftRows).
  auto column = [&t0](uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) -> uint32_t {
    auto sb = [&t0](uint32_t x) -> uint32_t { return (t0(x) >> 16) & 255u; };
    return (sb(c0 >> 24) << 24) | (sb((c1 >> 16) & 255u) << 16) | (sb((c2 >> 8) & 255u) << 8) |
           sb(c3 & 255u);
  };
  const uint32_t* kl = k.w + 4 * Rounds;
  s[0] = column(a0, a1, a2, a3) ^ kl[0];
  s[1] = column(a1, a2, a3, a0) ^ kl[1];
  s[2] = column(a2, a3, a0, a1) ^ kl[2];
  s[3] = column(a3, a0, a1, a2) ^ kl[3];
}

// The counter block iv + block (128-bit big-endian, wrapping at 2^128) as column words; iv_hi
// and iv_lo are the IV's first and last 8 bytes read big-endian.
CTFS_HD inline void AesCtrCounterWords(uint64_t iv_hi, uint64_t iv_lo, uint64_t block,
                                       uint32_t s[4]) {
  const uint64_t lo = iv_lo + block;
  const uint64_t hi = iv_hi + (lo < iv_lo ? 1u : 0u);
  s[0] = static_cast<uint32_t>(hi >> 32);
  s[1] = static_cast<uint32_t>(hi);
  s[2] = static_cast<uint32_t>(lo >> 32);
  s[3] = static_cast<uint32_t>(lo);
}

CTFS_HD inline uint64_t AesLoadBe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

// How the kernel cuts a range into 16-byte chunks aligned in memory, whatever the address and
// the payload offset. Chunk c covers addresses [base + 16c, + 16); its keystream is bytes
// [shift, shift + 16) of keystream blocks (block0 + c) and (block0 + c + 1) laid end to end
// (only the first when shift is 0). Bytes of a chunk outside [data, data + len) are left alone.
struct AesCtrLayout {
  uint64_t base;    // data rounded down to 16
  uint64_t chunks;  // 16-byte chunks from base that touch [data, data + len)
  uint64_t block0;  // counter block (relative to the IV) of chunk 0's first keystream block
  unsigned shift;   // 0..15
};

CTFS_HD inline AesCtrLayout AesCtrLayoutOf(uint64_t data, uint64_t len, uint64_t offset) {
  AesCtrLayout l;
  l.base = data & ~uint64_t{15};
  l.chunks = (data + len - l.base + 15) / 16;
  // The keystream position of the byte at `base` is offset - (data - base), which may be below
  // a block boundary of offset; those bytes are outside the range and never written.
  const int d = static_cast<int>(offset % 16) - static_cast<int>(data - l.base);
  l.shift = static_cast<unsigned>((d + 16) % 16);
  l.block0 = offset / 16 - (d < 0 ? 1u : 0u);  // wraps for offset < 16: those bytes are unused
  return l;
}

// Keystream bytes [shift, shift + 16) of a || b, each four words in memory order (byte 0 of a
// block in the low byte of its word 0, as a little-endian load of the data sees it).
template <unsigned Q>
CTFS_HD inline void AesShiftPick(const uint32_t m[8], unsigned bits, uint32_t out[4]) {
  for (unsigned i = 0; i < 4; ++i) {
    const uint32_t lo = m[i + Q], hi = m[i + Q + 1];
    out[i] = bits == 0 ? lo : (lo >> bits) | (hi << (32u - bits));
  }
}

CTFS_HD inline void AesKeystreamShifted(const uint32_t a[4], const uint32_t b[4], unsigned shift,
                                        uint32_t out[4]) {
  const uint32_t m[8] = {a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]};
  const unsigned bits = (shift & 3u) * 8u;
  switch (shift >> 2) {  // constant indices, so a GPU keeps m in registers
    case 0:
      AesShiftPick<0>(m, bits, out);
      break;
    case 1:
      AesShiftPick<1>(m, bits, out);
      break;
    case 2:
      AesShiftPick<2>(m, bits, out);
      break;
    default:
      AesShiftPick<3>(m, bits, out);
      break;
  }
}

// XORs one chunk's keystream (memory-order words) into the bytes of the chunk that starts `rel`
// bytes from `data` (rel may be negative: the first chunk) and lie in [data, data + len); a
// whole chunk with one 16-byte access, the edges byte by byte.
CTFS_HD inline void AesXorChunk(uint8_t* data, uint64_t len, int64_t rel, const uint32_t ks[4]) {
  if (rel >= 0 && static_cast<uint64_t>(rel) + 16 <= len) {
    uint8_t* chunk = data + rel;  // 16-aligned by construction
#if defined(__CUDA_ARCH__)
    uint4 v = *reinterpret_cast<uint4*>(chunk);
    v.x ^= ks[0];
    v.y ^= ks[1];
    v.z ^= ks[2];
    v.w ^= ks[3];
    *reinterpret_cast<uint4*>(chunk) = v;
#else
    for (int i = 0; i < 4; ++i) {
      uint32_t v;
      __builtin_memcpy(&v, chunk + 4 * i, 4);
      v ^= ks[i];
      __builtin_memcpy(chunk + 4 * i, &v, 4);
    }
#endif
    return;
  }
  for (int j = 0; j < 16; ++j) {
    const int64_t k = rel + j;
    if (k >= 0 && static_cast<uint64_t>(k) < len) {
      data[k] ^= static_cast<uint8_t>(ks[j / 4] >> (8 * (j % 4)));
    }
  }
}

}  // namespace cubetorchfs::cuda
