// The normative INT8 row codec: exact on its grid, within half a step
// elsewhere, zero rows, clamping, and the stored byte order.
#include "layout/quantize.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "layout/float16.h"
#include "pagekv/dtype.h"

namespace pagekv {
namespace {

TEST(Int8RowTest, ValuesOnTheGridRoundTripExactly) {
  const float s = F16ToF32(F32ToF16(0.0123f));
  std::vector<float> x;
  for (int k = -127; k <= 127; k += 7) x.push_back(static_cast<float>(k) * s);
  x.push_back(127 * s);
  const auto n = static_cast<int32_t>(x.size());
  std::vector<std::byte> row(static_cast<size_t>(n) + 2);
  quant::EncodeInt8Row(x.data(), n, row.data());
  std::vector<float> back(x.size());
  quant::DecodeInt8Row(row.data(), n, back.data());
  EXPECT_EQ(back, x);
  EXPECT_EQ(quant::Int8RowScale(row.data(), n), s);
  EXPECT_EQ(static_cast<int8_t>(row[0]), -127);  // values first, then the f16 scale
}

TEST(Int8RowTest, ErrorIsAtMostHalfAStepForRandomRows) {
  std::mt19937 rng(5);
  for (int32_t n : {1, 8, 13, 64, 128, 256}) {
    for (float range : {1e-3f, 1.0f, 300.0f}) {
      std::uniform_real_distribution<float> u(-range, range);
      std::vector<float> x(static_cast<size_t>(n)), back(x.size());
      for (float& v : x) v = u(rng);
      std::vector<std::byte> row(static_cast<size_t>(n) + 2);
      quant::EncodeInt8Row(x.data(), n, row.data());
      quant::DecodeInt8Row(row.data(), n, back.data());
      const float s = quant::Int8RowScale(row.data(), n);
      for (size_t i = 0; i < x.size(); ++i) {
        // Half a step (the scale rounds up, so nothing is clamped), plus float rounding.
        EXPECT_LE(std::fabs(back[i] - x[i]), s * 0.5f * (1 + 1e-5f)) << n << " " << range;
        EXPECT_LE(std::fabs(x[i]) / s, 127.0f);
      }
    }
  }
}

TEST(Int8RowTest, AZeroRowHasAZeroScaleAndDecodesToZeros) {
  std::vector<float> x(16, 0.0f), back(16, 1.0f);
  std::vector<std::byte> row(18, std::byte{0x55});
  quant::EncodeInt8Row(x.data(), 16, row.data());
  quant::DecodeInt8Row(row.data(), 16, back.data());
  EXPECT_EQ(back, x);
  EXPECT_EQ(quant::Int8RowScale(row.data(), 16), 0.0f);
}

TEST(Int8RowTest, TheFormatIsStoredOnlyWithOneF16ScalePerRow) {
  EXPECT_TRUE(KvFormat::Int8(128).IsStoredQuantized(128));
  EXPECT_FALSE(KvFormat::Int8(64).IsStoredQuantized(128));  // two scales per row: not read yet
  EXPECT_FALSE(KvFormat::Plain(DType::kF16).IsStoredQuantized(128));
}

}  // namespace
}  // namespace pagekv
