// The CUDA paths on a real GPU: the AES-CTR kernel against OpenSSL, and the loader's pipeline
// (pinned staging slots, the copier's stream and events, decryption on the device) against the
// CPU read. Every test skips, saying why, where the build has no CUDA or the machine no device;
// any other CUDA error fails.
#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "crypto/aes_ctr.h"
#include "cuda/aes_ctr_gpu.h"
#include "cuda/h2d.h"
#include "loader/device_load.h"
#include "loader/model_file.h"
#include "loader/model_writer.h"
#include "tests/cuda/cuda_test_util.h"

#ifdef CUBETORCH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace cubetorchfs::cuda {
namespace {

#define SKIP_WITHOUT_GPU()                                                 \
  do {                                                                     \
    const std::string why = testing::NoCudaDeviceReason();                 \
    if (!why.empty()) GTEST_SKIP() << "no CUDA device or driver: " << why; \
  } while (0)

// Fast deterministic filler (splitmix64): gigabytes in about a second.
void Fill(uint8_t* p, size_t n, uint64_t seed) {
  uint64_t x = seed;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
}

// OpenSSL on the CPU, in pieces on all cores (a 4 GiB reference in about a second).
void CpuReference(const crypto::Key& key, const crypto::Iv& iv, uint64_t offset, uint8_t* p,
                  size_t n) {
  const size_t threads = std::max(1u, std::thread::hardware_concurrency());
  const size_t piece = ((n / threads) + 15) / 16 * 16 + 16;
  std::vector<std::thread> ts;
  for (size_t at = 0; at < n; at += piece) {
    ts.emplace_back([&, at] {
      const size_t len = std::min(piece, n - at);
      ASSERT_TRUE(crypto::CtrXorAt(key, iv, offset + at, p + at, len).ok());
    });
  }
  for (auto& t : ts) t.join();
}

crypto::Key KeyOf(std::mt19937_64& rng, size_t len) {
  std::vector<uint8_t> b(len);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return crypto::Key::FromBytes(b.data(), b.size()).value();
}

struct Case {
  size_t key_len;
  crypto::Iv iv;
  uint64_t offset;
  size_t len;
  unsigned misalign;
};

std::string Describe(const Case& c) {
  std::ostringstream o;
  o << "key " << c.key_len * 8 << " bits, offset " << c.offset << ", " << c.len
    << " bytes, device address +" << c.misalign;
  return o.str();
}

void CheckCase(std::mt19937_64& rng, const Case& c) {
  crypto::Key key = KeyOf(rng, c.key_len);
  std::vector<uint8_t> want(c.len);
  Fill(want.data(), want.size(), rng());
  std::vector<uint8_t> got = want;
  CpuReference(key, c.iv, c.offset, want.data(), want.size());
  Status s = CtrXorViaDevice(key.data(), key.size(), c.iv.data(), c.offset, got.data(), got.size(),
                             c.misalign);
  ASSERT_TRUE(s.ok()) << Describe(c) << ": " << s.ToString();
  if (got != want) {
    size_t i = 0;
    while (got[i] == want[i]) ++i;
    FAIL() << Describe(c) << ": first difference at byte " << i;
  }
}

crypto::Iv IvOf(std::mt19937_64& rng, int kind) {
  crypto::Iv iv;
  for (auto& b : iv) b = static_cast<uint8_t>(rng());
  if (kind == 1) {
    for (int i = 8; i < 16; ++i) iv[i] = 0xff;  // the low 64 bits carry into the high ones
    iv[15] = 0xf0;
  } else if (kind == 2) {
    iv.fill(0xff);  // wraps at 2^128 a few blocks in
    iv[15] = 0xfa;
  }
  return iv;
}

// Random sizes from 1 byte to 16 MiB, offsets and device addresses at every alignment class,
// both key sizes, counters that carry across 2^64 and wrap at 2^128.
TEST(GpuAesCtr, MatchesOpensslOnRandomCases) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(30);
  const size_t fixed[] = {1, 15, 16, 17, 31, 32, 33, 4095, 4096, 65537};
  int cases = 0;
  for (size_t key_len : {16, 32}) {
    for (int kind = 0; kind < 3; ++kind) {
      for (unsigned misalign : {0u, 1u, 8u, 15u}) {
        for (uint64_t mod : {0u, 3u, 8u, 15u}) {
          size_t len = cases % 3 == 0 ? fixed[rng() % 10] : 1 + rng() % (16u << 20);
          Case c{key_len, IvOf(rng, kind), (rng() % 4096) * 16 + mod, len, misalign};
          CheckCase(rng, c);
          if (HasFatalFailure()) return;
          ++cases;  // every third case of a fixed edge size
        }
      }
    }
  }
}

// Past 2^32 bytes (64-bit indexing in the kernel) and at 1 GiB with nothing aligned.
TEST(GpuAesCtr, MatchesOpensslAtGigabytes) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(31);
  CheckCase(rng, Case{16, IvOf(rng, 1), 13, (size_t{1} << 30) + 7, 3});
  if (HasFatalFailure()) return;
  CheckCase(rng, Case{32, IvOf(rng, 0), 8, (size_t{4} << 30) + 3, 0});
}

TEST(GpuAesCtr, RejectsABadKeyLength) {
  SKIP_WITHOUT_GPU();
  uint8_t key[24] = {}, iv[16] = {}, data[4] = {};
  EXPECT_EQ(CtrXorViaDevice(key, 24, iv, 0, data, 4).code(), Status::Code::kInvalidArgument);
}

TEST(GpuCopier, ABadDeviceIndexIsAClearError) {
  SKIP_WITHOUT_GPU();
  auto c = NewCopier(4096, 2);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("cudaSetDevice"), std::string::npos) << c.status().ToString();
}

#ifdef CUBETORCH_WITH_CUDA
class GpuLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string name = "ctfs_gpu_test_";
    name += std::to_string(::getpid());
    dir_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    std::filesystem::remove_all(dir_);
    ::unsetenv("VETURBOIO_KEY");
  }
  std::filesystem::path dir_;
};

// The loader's device pipeline with a real copier and pinned slots equals the CPU read, plain
// and encrypted, decrypting on the device or on the CPU, with slots reused many times.
TEST_F(GpuLoadTest, PipelineEqualsTheCpuRead) {
  SKIP_WITHOUT_GPU();
  std::vector<std::vector<uint8_t>> data;
  std::vector<loader::SaveTensor> ts;
  const uint64_t sizes[] = {(37u << 20) + 4, 13, (5u << 20) + 6, 4096};
  for (size_t i = 0; i < 4; ++i) {
    data.emplace_back(sizes[i]);
    Fill(data.back().data(), sizes[i], i + 40);
    loader::SaveTensor t;
    t.name = "t";
    t.name += std::to_string(i);
    t.dtype = loader::Dtype::kU8;
    t.shape = {sizes[i]};
    t.data = data.back().data();
    t.len = sizes[i];
    ts.push_back(t);
  }
  const std::string plain = (dir_ / "p.safetensors").string();
  const std::string enc = (dir_ / "e.safetensors").string();
  ASSERT_TRUE(loader::SaveSafetensors(plain, ts, {}, {}).ok());
  ::setenv("VETURBOIO_KEY", "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=", 1);
  loader::SaveOptions so;
  so.encrypt = true;
  ASSERT_TRUE(loader::SaveSafetensors(enc, ts, {}, so).ok());
  for (const std::string& path : {plain, enc}) {
    for (uint64_t slot_bytes : {uint64_t{4} << 20, uint64_t{16} << 20}) {
      for (bool gpu_decrypt : {true, false}) {
        auto f = loader::ModelFile::Open(path, {});
        ASSERT_TRUE(f.ok()) << f.status().ToString();
        const uint64_t n = (*f)->data_size();
        std::vector<uint8_t> want(n);
        ASSERT_TRUE((*f)->ReadData(want.data(), n, {}).ok());
        std::vector<uint8_t*> slots;
        for (int i = 0; i < 4; ++i) {
          auto p = AllocPinned(slot_bytes);
          ASSERT_TRUE(p.ok()) << p.status().ToString();
          slots.push_back(static_cast<uint8_t*>(*p));
        }
        auto copier = NewCopier(0, 4);
        ASSERT_TRUE(copier.ok()) << copier.status().ToString();
        void* dev = nullptr;
        ASSERT_EQ(cudaMalloc(&dev, n), cudaSuccess);
        loader::DeviceLoadOptions o;
        o.threads = 8;
        o.gpu_decrypt = gpu_decrypt;
        Status s = loader::LoadToDevice(**f, **copier, slots, slot_bytes, dev, o);
        std::vector<uint8_t> got(n);
        ASSERT_EQ(cudaMemcpy(got.data(), dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
        cudaFree(dev);
        (*copier).reset();
        for (uint8_t* p : slots) FreePinned(p);
        ASSERT_TRUE(s.ok()) << path << ": " << s.ToString();
        EXPECT_TRUE(got == want) << path << " slots of " << slot_bytes << " gpu_decrypt "
                                 << gpu_decrypt;
      }
    }
  }
}
#endif

}  // namespace
}  // namespace cubetorchfs::cuda
