#include "common/clock.h"

#include <chrono>
#include <thread>

namespace cubetorchfs {
namespace {

class SteadyClock final : public Clock {
 public:
  uint64_t NowNanos() override {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }
  void SleepMicros(uint64_t micros) override {
    std::this_thread::sleep_for(std::chrono::microseconds(micros));
  }
};

}  // namespace

Clock* SystemClock() {
  static SteadyClock clock;
  return &clock;
}

}  // namespace cubetorchfs
