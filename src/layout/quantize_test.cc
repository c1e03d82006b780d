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

// Every fp8 code decodes to a value that encodes back to the same code
// (the grid round-trips exactly), both signs, subnormals and the maximum.
TEST(Fp8Test, EveryFiniteCodeRoundTrips) {
  for (bool e4m3 : {true, false}) {
    int finite = 0;
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      const bool nan_or_inf = e4m3 ? (code & 0x7F) == 0x7F : (code & 0x7C) == 0x7C;
      if (nan_or_inf) continue;
      const float v = quant::Fp8ToF32(code, e4m3);
      ASSERT_TRUE(std::isfinite(v));
      if (v == 0.0f) continue;  // +0 and -0
      EXPECT_EQ(quant::F32ToFp8(v, e4m3), code) << (e4m3 ? "e4m3 " : "e5m2 ") << c << " " << v;
      ++finite;
    }
    EXPECT_EQ(finite, e4m3 ? 252 : 246);  // less NaN (e4m3: 2) or Inf/NaN (e5m2: 8), less the two zeros
  }
  EXPECT_EQ(quant::Fp8ToF32(0x7E, true), 448.0f);
  EXPECT_EQ(quant::Fp8ToF32(0x7B, false), 57344.0f);
  EXPECT_EQ(quant::Fp8ToF32(0x01, true), std::ldexp(1.0f, -9));   // the smallest e4m3 subnormal
  EXPECT_EQ(quant::Fp8ToF32(0x01, false), std::ldexp(1.0f, -16)); // the smallest e5m2 subnormal
  EXPECT_EQ(quant::F32ToFp8(1e9f, true), 0x7E);   // saturates, never NaN
  EXPECT_EQ(quant::F32ToFp8(-1e9f, false), 0xFB);
}

TEST(Fp8Test, RoundingIsToNearestEven) {
  // Between 1.0 (0x38) and 1.125 (0x39) in e4m3: the midpoint goes to the even code.
  EXPECT_EQ(quant::F32ToFp8(1.0625f, true), 0x38);
  EXPECT_EQ(quant::F32ToFp8(1.1875f, true), 0x3A);  // between 1.125 and 1.25: to 1.25 (even)
  EXPECT_EQ(quant::F32ToFp8(1.07f, true), 0x39);
  EXPECT_EQ(quant::F32ToFp8(15.5f, true), 0x58);    // rounds up into the next binade: 16
}

TEST(Fp8Test, RowsStayWithinTheFormatsRelativeError) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (bool e4m3 : {true, false}) {
    std::vector<float> x(64), back(64);
    for (float& v : x) v = u(rng);
    std::vector<std::byte> row(66);
    quant::EncodeFp8Row(x.data(), 64, e4m3, row.data());
    quant::DecodeFp8Row(row.data(), 64, e4m3, back.data());
    const float s = quant::Int8RowScale(row.data(), 64);
    const float rel = e4m3 ? 1.0f / 16 : 1.0f / 8;
    for (size_t i = 0; i < x.size(); ++i) {
      const float floor = s * std::ldexp(1.0f, e4m3 ? -10 : -17);  // half the smallest subnormal step
      EXPECT_LE(std::fabs(back[i] - x[i]), std::fabs(x[i]) * rel + floor) << i;
    }
  }
}

TEST(Int8RowTest, TheFormatIsStoredOnlyWithOneF16ScalePerRow) {
  EXPECT_TRUE(KvFormat::Fp8(DType::kFP8E4M3, 128).IsStoredQuantized(128));
  EXPECT_TRUE(KvFormat::ForDType(DType::kFP8E5M2, 64).IsStoredQuantized(64));
  EXPECT_FALSE(KvFormat::ForDType(DType::kInt4, 64).IsStoredQuantized(64));  // KIVI, not a per-row format
  EXPECT_TRUE(KvFormat::ForDType(DType::kInt4, 64).IsKivi());
  EXPECT_TRUE(KvFormat::Int8(128).IsStoredQuantized(128));
  EXPECT_FALSE(KvFormat::Int8(64).IsStoredQuantized(128));  // two scales per row: not read yet
  EXPECT_FALSE(KvFormat::Plain(DType::kF16).IsStoredQuantized(128));
}

// The Hadamard transform is orthonormal (norms and dot products kept) and
// its own inverse; it spreads one outlier over the whole row.
TEST(HadamardTest, OrthonormalSelfInverseAndSpreadsOutliers) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int32_t n : {1, 2, 8, 64, 128}) {
    std::vector<float> a(static_cast<size_t>(n)), b(a.size());
    for (float& x : a) x = u(rng);
    for (float& x : b) x = u(rng);
    double dot = 0, norm = 0;
    for (int32_t i = 0; i < n; ++i) {
      dot += a[static_cast<size_t>(i)] * b[static_cast<size_t>(i)];
      norm += a[static_cast<size_t>(i)] * a[static_cast<size_t>(i)];
    }
    std::vector<float> ha = a, hb = b;
    quant::HadamardInPlace(ha.data(), n);
    quant::HadamardInPlace(hb.data(), n);
    double hdot = 0, hnorm = 0;
    for (int32_t i = 0; i < n; ++i) {
      hdot += ha[static_cast<size_t>(i)] * hb[static_cast<size_t>(i)];
      hnorm += ha[static_cast<size_t>(i)] * ha[static_cast<size_t>(i)];
    }
    EXPECT_NEAR(hdot, dot, 1e-4) << n;
    EXPECT_NEAR(hnorm, norm, 1e-4) << n;
    quant::HadamardInPlace(ha.data(), n);
    for (int32_t i = 0; i < n; ++i) EXPECT_NEAR(ha[static_cast<size_t>(i)], a[static_cast<size_t>(i)], 1e-5) << n;
  }
  std::vector<float> spike(8, 0.0f);
  spike[3] = 8.0f;
  quant::HadamardInPlace(spike.data(), 8);
  for (float x : spike) EXPECT_NEAR(std::fabs(x), 8.0f / std::sqrt(8.0f), 1e-5);
}

// INT4 KIVI: values per row and keys per channel over a group, each code
// within half a step (plus the f16 rounding of the minimum) of the input;
// values on the grid round-trip exactly; the bytes are as documented.
TEST(Int4KiviTest, ValueRowsAndKeyGroupsStayWithinHalfAStep) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2.0f, 3.0f);
  const int32_t d = 16, g = 32;
  EXPECT_EQ(quant::Int4ValueRowBytes(d), 12);
  EXPECT_EQ(quant::Int4KeyGroupBytes(g, d), 32 * 8 + 16 * 4);
  std::vector<float> x(static_cast<size_t>(g * d)), back(x.size());
  for (float& v : x) v = u(rng);
  // A channel with an outlier: per-channel scales keep the other channels fine.
  for (int32_t t = 0; t < g; ++t) x[static_cast<size_t>(t * d + 3)] *= 40.0f;
  std::vector<std::byte> group(static_cast<size_t>(quant::Int4KeyGroupBytes(g, d)));
  quant::EncodeInt4KeyGroup(x.data(), g, d, group.data());
  quant::DecodeInt4KeyGroup(group.data(), g, d, back.data());
  for (int32_t c = 0; c < d; ++c) {
    float s, m;
    quant::Int4KeyParams(group.data(), g, d, c, s, m);
    float lo = x[static_cast<size_t>(c)];
    for (int32_t t = 0; t < g; ++t) lo = std::min(lo, x[static_cast<size_t>(t * d + c)]);
    for (int32_t t = 0; t < g; ++t) {
      const size_t i = static_cast<size_t>(t * d + c);
      EXPECT_LE(std::fabs(back[i] - x[i]), s / 2 + std::fabs(m - lo) + 1e-6f) << "channel " << c;
    }
    if (c != 3) {
      EXPECT_LT(s, 5.0f / 15 * 1.01f) << "channel " << c << " paid for channel 3's outlier";
    }
  }
  std::vector<std::byte> row(12);
  quant::EncodeInt4ValueRow(x.data(), d, row.data());
  quant::DecodeInt4ValueRow(row.data(), d, back.data());
  float s, m;
  quant::Int4ValueParams(row.data(), d, s, m);
  for (int32_t i = 0; i < d; ++i) EXPECT_LE(std::fabs(back[static_cast<size_t>(i)] - x[static_cast<size_t>(i)]), s / 2 + 0.01f);
  // On the grid: c * 0.25 + (-1) with codes 0..15 in use.
  for (int32_t i = 0; i < d; ++i) x[static_cast<size_t>(i)] = static_cast<float>(i % 16) * 0.25f - 1.0f;
  quant::EncodeInt4ValueRow(x.data(), d, row.data());
  quant::DecodeInt4ValueRow(row.data(), d, back.data());
  for (int32_t i = 0; i < d; ++i) EXPECT_EQ(back[static_cast<size_t>(i)], x[static_cast<size_t>(i)]);
  // A constant row: scale 0, every value exact.
  std::fill(x.begin(), x.begin() + d, 0.75f);
  quant::EncodeInt4ValueRow(x.data(), d, row.data());
  quant::DecodeInt4ValueRow(row.data(), d, back.data());
  for (int32_t i = 0; i < d; ++i) EXPECT_EQ(back[static_cast<size_t>(i)], 0.75f);
}

}  // namespace
}  // namespace pagekv
