// A portable AES-128/256 block cipher and the CTR counter rule, written once as
// `__host__ __device__` functions so the CUDA kernel (aes_ctr_kernel.cu) and the CPU test suite
// run the same code; the tests check it against OpenSSL.
//
// The S-box is passed in by pointer: host code uses kAesSbox, the kernel a copy in shared
// memory (a device cannot read a host array). Byte-oriented, no T-tables: small and obviously
// correct rather than fast. No secret-dependent branches; table lookups are secret-indexed, as
// in any table AES (fine for decrypting files on a machine we own).
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

}  // namespace cubetorchfs::cuda
