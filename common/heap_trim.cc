#include "common/heap_trim.h"

#include <malloc.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace cubetorchfs {

bool TrimHeap() {
  static std::atomic<int64_t> last{INT64_MIN / 2};
  constexpr int64_t kMinGapNs = 500'000'000;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t prev = last.load();
  if (now - prev < kMinGapNs || !last.compare_exchange_strong(prev, now)) return false;
  ::malloc_trim(0);
  return true;
}

}  // namespace cubetorchfs
