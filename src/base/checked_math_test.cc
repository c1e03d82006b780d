#include "base/checked_math.h"

#include <limits>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(CheckedMathTest, DetectsOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(CheckedMul(1 << 20, 1 << 20), int64_t{1} << 40);
  EXPECT_FALSE(CheckedMul(kMax / 2 + 1, 2).has_value());
  EXPECT_FALSE(CheckedAdd(kMax, 1).has_value());
  EXPECT_EQ(CheckedProduct({61, 8, 512, 128 * 128 * 2, 2}), 16374562816);
  EXPECT_FALSE(CheckedProduct({1 << 30, 1 << 30, 1 << 30}).has_value());
}

TEST(CheckedMathTest, RoundingHelpers) {
  EXPECT_EQ(RoundUp(0, 64), 0);
  EXPECT_EQ(RoundUp(1, 64), 64);
  EXPECT_EQ(RoundUp(128, 64), 128);
  EXPECT_EQ(CeilDiv(0, 8), 0);
  EXPECT_EQ(CeilDiv(8, 8), 1);
  EXPECT_EQ(CeilDiv(9, 8), 2);
  EXPECT_TRUE(IsPowerOfTwo(1024));
  EXPECT_FALSE(IsPowerOfTwo(100));
  EXPECT_FALSE(IsPowerOfTwo(0));
}

}  // namespace
}  // namespace pagekv
