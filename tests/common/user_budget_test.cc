#include "common/user_budget.h"

#include <gtest/gtest.h>

namespace cubetorchfs {
namespace {

TEST(UserBudgetTest, OneUserIsBoundedAndOthersKeepTheirShare) {
  UserBudget b(/*per_uid=*/3, /*total=*/5);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(b.Take(1000));
  EXPECT_FALSE(b.Take(1000)) << "past the per-user bound";
  EXPECT_TRUE(b.Take(1001, 2));
  EXPECT_FALSE(b.Take(1002)) << "past the total";
  EXPECT_FALSE(b.Take(-1)) << "an unknown user still counts in the total";
  EXPECT_EQ(b.held(), 5u);
  EXPECT_EQ(b.held(1000), 3u);
  b.Give(1000);
  EXPECT_TRUE(b.Take(1002));
  b.Give(1234, 7);  // nothing taken: nothing given back
  EXPECT_EQ(b.held(), 5u);
}

TEST(UserBudgetTest, ATakeLargerThanWhatIsLeftTakesNothing) {
  UserBudget b(/*per_uid=*/100, /*total=*/150);
  EXPECT_TRUE(b.Take(1, 90));
  EXPECT_FALSE(b.Take(1, 20));  // 110 > 100 for user 1
  EXPECT_FALSE(b.Take(2, 61));  // 151 > 150 in all
  EXPECT_TRUE(b.Take(-1, 60));  // unknown: the total only
  EXPECT_EQ(b.held(), 150u);
  b.Give(-1, 60);
  b.Give(1, 90);
  EXPECT_EQ(b.held(), 0u);
}

}  // namespace
}  // namespace cubetorchfs
