// Time behind an interface so cache and file-system logic can be tested without sleeps.
//
// Thread safety: implementations must be safe to call from any thread.
#pragma once

#include <cstdint>
#include <memory>

namespace cubetorchfs {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic nanoseconds; only differences are meaningful.
  virtual uint64_t NowNanos() = 0;
  virtual void SleepMicros(uint64_t micros) = 0;
};

// The real monotonic clock. Never null; lives for the whole process.
Clock* SystemClock();

}  // namespace cubetorchfs
