// GPU micro-benchmarks of the loader's CUDA paths, against the plain CUDA reference measured
// in the same run. Prints one JSON object per line (bench/gpu_bench.py reads them):
//
//   memcpy_pinned   cudaMemcpy host-to-device of N bytes from one pinned buffer (the reference)
//   copier          the loader's copier: N bytes through 8 pinned 16 MiB staging slots, each
//                   copy on the copier's stream with a per-slot event, a slot reused once its
//                   event completes (the loader's copy path without the file reads)
//   d2d             cudaMemcpy device-to-device of N bytes: bytes read + written per second,
//                   a measure of the device's memory bandwidth
//   decrypt         AES-CTR in place over N device bytes (CtrXorDevice), AES-128 and AES-256,
//                   a payload offset aligned to the address (0) and not (8)
//
// Usage: gpu_bench [--gib N] [--rounds R]   (defaults 1 GiB, 5 rounds; every figure is the
// median of R rounds, with min and max)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/aes_ctr_gpu.h"
#include "cuda/h2d.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "gpu_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(err));
}

void Check(const cubetorchfs::Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}

template <class F>
void Report(const char* name, const std::string& extra, size_t bytes, double factor, int rounds,
            F&& run) {
  run();  // warm-up: first-touch of the pages, module load, clocks up
  std::vector<double> s;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = Clock::now();
    run();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  const double med = s[s.size() / 2];
  const double gbs = factor * static_cast<double>(bytes) / med / 1e9;
  std::printf(
      "{\"name\": \"%s\"%s, \"bytes\": %zu, \"median_s\": %.6f, \"min_s\": %.6f, \"max_s\": %.6f, "
      "\"gb_per_s\": %.2f}\n",
      name, extra.c_str(), bytes, med, s.front(), s.back(), gbs);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 1;
  int rounds = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--gib" && i + 1 < argc) {
      gib = std::atof(argv[++i]);
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: gpu_bench [--gib N] [--rounds R]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (gib <= 0 || gib > 64 || rounds < 1 || rounds > 100) Die("--gib 0..64, --rounds 1..100");
  const size_t n = static_cast<size_t>(gib * (1ull << 30)) / 16 * 16;

  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf(
      "{\"name\": \"device\", \"device\": \"%s\", \"sms\": %d, \"memory_bytes\": %zu, "
      "\"driver\": %d, \"runtime\": %d}\n",
      prop.name, prop.multiProcessorCount, prop.totalGlobalMem, driver, runtime);

  void* dev = nullptr;
  void* dev2 = nullptr;
  Check(cudaMalloc(&dev, n), "cudaMalloc");
  Check(cudaMalloc(&dev2, n), "cudaMalloc");
  auto pinned = cubetorchfs::cuda::AllocPinned(n);
  Check(pinned.status(), "AllocPinned");
  std::memset(*pinned, 0x5a, n);

  Report("memcpy_pinned", "", n, 1.0, rounds,
         [&] { Check(cudaMemcpy(dev, *pinned, n, cudaMemcpyHostToDevice), "cudaMemcpy"); });

  const int kSlots = 8;
  const size_t kSlot = 16u << 20;
  std::vector<uint8_t*> slots;
  for (int i = 0; i < kSlots; ++i) {
    auto p = cubetorchfs::cuda::AllocPinned(kSlot);
    Check(p.status(), "AllocPinned");
    std::memset(*p, i, kSlot);
    slots.push_back(static_cast<uint8_t*>(*p));
  }
  auto copier = cubetorchfs::cuda::NewCopier(0, kSlots);
  Check(copier.status(), "NewCopier");
  Report("copier", ", \"slots\": 8, \"slot_bytes\": 16777216", n, 1.0, rounds, [&] {
    int slot = 0;
    std::vector<bool> used(kSlots, false);
    for (size_t at = 0; at < n; at += kSlot) {
      if (used[static_cast<size_t>(slot)]) Check((*copier)->WaitSlot(slot), "WaitSlot");
      const size_t len = std::min(kSlot, n - at);
      Check((*copier)->CopyAsync(static_cast<uint8_t*>(dev) + at, slots[static_cast<size_t>(slot)],
                                 len, slot),
            "CopyAsync");
      used[static_cast<size_t>(slot)] = true;
      slot = (slot + 1) % kSlots;
    }
    Check((*copier)->Sync(), "Sync");
  });

  Report("d2d", ", \"counts\": \"read+written\"", n, 2.0, rounds, [&] {
    Check(cudaMemcpy(dev2, dev, n, cudaMemcpyDeviceToDevice), "cudaMemcpy D2D");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // a D2D cudaMemcpy returns early
  });

  uint8_t key[32], iv[16];
  for (int i = 0; i < 32; ++i) key[i] = static_cast<uint8_t>(i * 7 + 1);
  for (int i = 0; i < 16; ++i) iv[i] = static_cast<uint8_t>(0xf0 + i);
  for (size_t key_len : {size_t{16}, size_t{32}}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{8}}) {
      std::string extra = ", \"key_bits\": " + std::to_string(key_len * 8) +
                          ", \"offset\": " + std::to_string(offset);
      Report("decrypt", extra, n, 1.0, rounds, [&] {
        Check(cubetorchfs::cuda::CtrXorDevice(key, key_len, iv, offset, dev, n, nullptr),
              "CtrXorDevice");
      });
    }
  }
  copier->reset();
  for (uint8_t* p : slots) cubetorchfs::cuda::FreePinned(p);
  cubetorchfs::cuda::FreePinned(*pinned);
  cudaFree(dev);
  cudaFree(dev2);
  return 0;
}
