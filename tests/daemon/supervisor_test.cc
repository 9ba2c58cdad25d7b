#include <gtest/gtest.h>

#include <optional>

#include "daemon/supervisor.h"

namespace cubetorchfs::daemon {
namespace {

// A worker that keeps crashing is restarted at once, then after longer and longer waits, and
// given up after kMaxRestarts within kRestartWindowS (the supervisor unmounts then).
TEST(RestartBudgetTest, SpacesRestartsAndGivesUpPastTheBudget) {
  RestartBudget budget;
  double now = 100;
  const double waits[] = {0, 0.25, 0.5, 1, 2};
  static_assert(sizeof(waits) / sizeof(waits[0]) == kMaxRestarts);
  for (double want : waits) {
    std::optional<double> wait = budget.OnCrash(now);
    ASSERT_TRUE(wait.has_value());
    EXPECT_DOUBLE_EQ(*wait, want);
    now += *wait + 1;  // the new worker ran a second, then crashed
  }
  EXPECT_FALSE(budget.OnCrash(now).has_value());
}

// Crashes further apart than the window never spend the budget: a mount that crashes once an
// hour is restarted every time, and at once.
TEST(RestartBudgetTest, CrashesOutsideTheWindowAreForgotten) {
  RestartBudget budget;
  for (int i = 0; i < 3 * kMaxRestarts; ++i) {
    std::optional<double> wait = budget.OnCrash(1000.0 + i * (kRestartWindowS + 1));
    ASSERT_TRUE(wait.has_value()) << i;
    EXPECT_DOUBLE_EQ(*wait, 0) << i;
  }
  // A burst after a quiet hour gets the whole budget again.
  const double t = 1e6;
  for (int i = 0; i < kMaxRestarts; ++i) ASSERT_TRUE(budget.OnCrash(t + i).has_value()) << i;
  EXPECT_FALSE(budget.OnCrash(t + kMaxRestarts).has_value());
  EXPECT_TRUE(budget.OnCrash(t + kRestartWindowS + kMaxRestarts).has_value());
}

}  // namespace
}  // namespace cubetorchfs::daemon
