// MatMul against a double-precision product of the dequantized weights, on
// every SIMD target this CPU runs, for every weight type and for shapes that
// exercise each tail: rows not a multiple of the 4-row tile, token counts not
// a multiple of the 4-token tile, columns not a multiple of the vector width.
#include "kernels/matmul.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention_kernel.h"
#include "layout/float16.h"

namespace pagekv {
namespace {

// Random weights of `type`, with their exact f32 values (what the reference uses).
struct Weights {
  std::vector<std::byte> bytes;
  std::vector<float> values;  // [rows][cols]
  WeightMatrix matrix;
};

Weights MakeWeights(WeightType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Weights w;
  w.values.resize(static_cast<size_t>(rows * cols));
  w.bytes.resize(static_cast<size_t>(rows * WeightRowBytes(type, cols)));
  for (int64_t r = 0; r < rows; ++r) {
    std::byte* row = w.bytes.data() + r * WeightRowBytes(type, cols);
    for (int64_t c = 0; c < cols; ++c) {
      float& v = w.values[static_cast<size_t>(r * cols + c)];
      v = normal(rng);
      uint16_t h;
      switch (type) {
        case WeightType::kF32: std::memcpy(row + 4 * c, &v, 4); break;
        case WeightType::kF16: h = F32ToF16(v); v = F16ToF32(h); std::memcpy(row + 2 * c, &h, 2); break;
        case WeightType::kBF16: h = F32ToBF16(v); v = BF16ToF32(h); std::memcpy(row + 2 * c, &h, 2); break;
        case WeightType::kQ8_0: break;  // below, per block
      }
    }
    if (type == WeightType::kQ8_0) {
      for (int64_t b = 0; b < cols / 32; ++b) {
        float amax = 0;
        for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(w.values[static_cast<size_t>(r * cols + b * 32 + i)]));
        const uint16_t h = F32ToF16(amax / 127.0f);
        const float scale = F16ToF32(h);
        std::byte* block = row + b * 34;
        std::memcpy(block, &h, 2);
        for (int64_t i = 0; i < 32; ++i) {
          float& v = w.values[static_cast<size_t>(r * cols + b * 32 + i)];
          const auto q = static_cast<int8_t>(scale == 0 ? 0 : std::lround(v / scale));
          block[2 + i] = static_cast<std::byte>(q);
          v = scale * static_cast<float>(q);
        }
      }
    }
  }
  w.matrix = {w.bytes.data(), type, rows, cols};
  return w;
}

void ExpectProduct(const Weights& w, int64_t tokens, uint32_t seed, int threads) {
  const int64_t rows = w.matrix.rows, cols = w.matrix.cols;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(tokens * cols));
  for (float& v : x) v = uni(rng);
  std::vector<float> y(static_cast<size_t>(tokens * rows), -1e30f);
  ASSERT_TRUE(MatMul(w.matrix, x.data(), tokens, y.data(), threads).ok());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = double{w.values[static_cast<size_t>(r * cols + c)]} * x[static_cast<size_t>(t * cols + c)];
        ref += p;
        mag += std::fabs(p);
      }
      ASSERT_NEAR(y[static_cast<size_t>(t * rows + r)], ref, 1e-5 * mag + 1e-6)
          << "token " << t << " row " << r << " (" << rows << "x" << cols << ", " << tokens << " tokens)";
    }
  }
}

class MatMulTargetTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { kernels::SetTargetForTest(GetParam()); }
  void TearDown() override { kernels::SetTargetForTest(0); }
};

TEST_P(MatMulTargetTest, EveryTypeAndTail) {
  uint32_t seed = 1;
  for (WeightType type : {WeightType::kF32, WeightType::kF16, WeightType::kBF16, WeightType::kQ8_0}) {
    const bool q8 = type == WeightType::kQ8_0;
    for (int64_t rows : {1, 3, 4, 5, 17, 64}) {
      for (int64_t cols : q8 ? std::vector<int64_t>{32, 64, 96, 288} : std::vector<int64_t>{1, 7, 16, 33, 64, 172}) {
        const Weights w = MakeWeights(type, rows, cols, seed++);
        for (int64_t tokens : {1, 2, 3, 4, 5, 9}) ExpectProduct(w, tokens, seed++, 1);
      }
    }
  }
}

TEST_P(MatMulTargetTest, ThreadedLargeMatchesReference) {
  // Large enough to take the pool (rows split in chunks) and the token chunks.
  for (WeightType type : {WeightType::kF32, WeightType::kQ8_0}) {
    const Weights w = MakeWeights(type, 301, 320, 7);
    ExpectProduct(w, 37, 8, 0);
  }
}

std::string TargetName(const ::testing::TestParamInfo<int64_t>& info) {
  kernels::SetTargetForTest(info.param);
  std::string name = kernels::DispatchedTargetName();
  kernels::SetTargetForTest(0);
  return name;
}

INSTANTIATE_TEST_SUITE_P(EveryTarget, MatMulTargetTest, ::testing::ValuesIn(kernels::SupportedTargets()), TargetName);

TEST(MatMulTest, WeightRowDequantizesQ8) {
  const Weights w = MakeWeights(WeightType::kQ8_0, 3, 64, 3);
  std::vector<float> row(64);
  WeightRow(w.matrix, 2, row.data());
  for (int64_t c = 0; c < 64; ++c) EXPECT_EQ(row[static_cast<size_t>(c)], w.values[static_cast<size_t>(128 + c)]);
}

TEST(MatMulTest, RejectsBadShapes) {
  float x[64] = {}, y[64] = {};
  std::byte data[64 * 4] = {};
  EXPECT_EQ(MatMul({data, WeightType::kF32, 0, 4}, x, 1, y).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MatMul({data, WeightType::kF32, 4, 4}, x, 0, y).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MatMul({nullptr, WeightType::kF32, 4, 4}, x, 1, y).code(), StatusCode::kInvalidArgument);
  const Status s = MatMul({data, WeightType::kQ8_0, 1, 40}, x, 1, y);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("multiple of 32"), std::string::npos);
}

}  // namespace
}  // namespace pagekv
