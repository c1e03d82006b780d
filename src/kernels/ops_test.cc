// The layer ops (ops.h) on every SIMD target this CPU runs, against scalar
// references written here in double precision (RMSNorm, SwiGLU, rotary
// embedding from its definition), and, for the K / V encoders, byte for
// byte against layout/'s normative scalar codecs. Widths cover whole
// vectors, tails, and widths below one vector.
#include "kernels/ops.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention_kernel.h"
#include "layout/float16.h"
#include "layout/quantize.h"
#include "pagekv/kv_layout.h"

namespace pagekv {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class OpsTargetTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { kernels::SetTargetForTest(GetParam()); }
  void TearDown() override { kernels::SetTargetForTest(0); }
};

TEST_P(OpsTargetTest, RmsNormMatchesDoublePrecision) {
  for (int32_t width : {1, 3, 8, 17, 64, 100, 576}) {
    const int64_t rows = 5;
    const std::vector<float> x = Random(static_cast<size_t>(rows * width), 1u + static_cast<uint32_t>(width), 3.0f);
    const std::vector<float> w = Random(static_cast<size_t>(width), 7u);
    std::vector<float> out(x.size());
    const float eps = 1e-5f;
    RmsNormRows(x.data(), w.data(), rows, width, eps, out.data());
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int32_t i = 0; i < width; ++i) ss += double{x[static_cast<size_t>(r * width + i)]} * x[static_cast<size_t>(r * width + i)];
      const double scale = 1.0 / std::sqrt(ss / width + eps);
      for (int32_t i = 0; i < width; ++i) {
        const size_t k = static_cast<size_t>(r * width + i);
        const double want = w[static_cast<size_t>(i)] * scale * x[k];
        EXPECT_NEAR(out[k], want, 2e-6 * (1 + std::fabs(want))) << "width " << width << " row " << r << " i " << i;
      }
    }
    // In place gives the same.
    std::vector<float> in_place = x;
    RmsNormRows(in_place.data(), w.data(), rows, width, eps, in_place.data());
    EXPECT_EQ(in_place, out) << "width " << width;
  }
}

TEST_P(OpsTargetTest, AddsAreExact) {
  for (int64_t width : {1, 5, 16, 33, 130}) {
    const int64_t rows = 3;
    std::vector<float> x = Random(static_cast<size_t>(rows * width), 11u), y = Random(x.size(), 12u);
    const std::vector<float> bias = Random(static_cast<size_t>(width), 13u);
    std::vector<float> want = x;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < width; ++j) want[static_cast<size_t>(r * width + j)] += bias[static_cast<size_t>(j)];
    }
    AddBiasRows(x.data(), bias.data(), rows, width);
    EXPECT_EQ(x, want);
    for (size_t i = 0; i < want.size(); ++i) want[i] += y[i];
    AddInPlace(x.data(), y.data(), static_cast<int64_t>(x.size()));
    EXPECT_EQ(x, want);
  }
}

TEST_P(OpsTargetTest, SwiGluMatchesDoublePrecision) {
  for (int64_t n : {1, 7, 8, 64, 1000}) {
    std::vector<float> g = Random(static_cast<size_t>(n), 21u, 4.0f), up = Random(static_cast<size_t>(n), 22u);
    if (n >= 8) {  // far tails: silu(-100) ~ -0, silu(100) = 100
      g[0] = -100.0f;
      g[1] = 100.0f;
      g[2] = -1e30f;
      g[3] = 0.0f;
    }
    const std::vector<float> g0 = g;
    SwiGluInPlace(g.data(), up.data(), n);
    for (size_t i = 0; i < g.size(); ++i) {
      const double want = g0[i] / (1.0 + std::exp(-double{g0[i]})) * up[i];
      EXPECT_NEAR(g[i], want, 2e-6 * (1 + std::fabs(want))) << "n " << n << " i " << i << " g " << g0[i];
    }
  }
}

TEST_P(OpsTargetTest, GeluGluMatchesTheTanhFormulaInDoublePrecision) {
  for (int64_t n : {1, 7, 8, 64, 1000}) {
    std::vector<float> g = Random(static_cast<size_t>(n), 23u, 6.0f), up = Random(static_cast<size_t>(n), 24u);
    if (n >= 8) {  // far tails: gelu(-100) ~ -0, gelu(100) = 100, overflowing cubes
      g[0] = -100.0f;
      g[1] = 100.0f;
      g[2] = -1e30f;
      g[3] = 0.0f;
      g[4] = 1e30f;
    }
    const std::vector<float> g0 = g;
    GeluGluInPlace(g.data(), up.data(), n);
    for (size_t i = 0; i < g.size(); ++i) {
      const double x = g0[i];
      const double want = std::fabs(x) > 1e10 ? (x > 0 ? x : 0.0) * up[i]
                                               : 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * up[i];
      EXPECT_NEAR(g[i], want, 2e-6 * (1 + std::fabs(want))) << "n " << n << " i " << i << " g " << g0[i];
    }
  }
}

TEST_P(OpsTargetTest, ScaleMultipliesEveryElement) {
  for (int64_t n : {1, 7, 8, 64, 1000}) {
    std::vector<float> x = Random(static_cast<size_t>(n), 25u), want = x;
    for (float& v : want) v *= 25.298221f;
    ScaleInPlace(x.data(), 25.298221f, n);
    EXPECT_EQ(x, want);
  }
}

// Rotary embedding straight from its definition, in double.
std::vector<double> RopeReference(const RopeParams& p, const std::vector<float>& x, int64_t rows, int32_t width,
                                  const std::vector<int64_t>& pos) {
  std::vector<double> out(x.begin(), x.end());
  const int32_t half = p.rope_dims / 2;
  double mscale = 1.0, lo = 0, hi = 0;
  if (p.yarn) {
    auto corr = [&](double rot) {
      return p.rope_dims * std::log(p.yarn_orig_context / (rot * 2 * std::numbers::pi)) / (2 * std::log(double{p.theta}));
    };
    lo = std::max(0.0, std::floor(corr(32.0)));
    hi = std::min(p.rope_dims - 1.0, std::ceil(corr(1.0)));
    mscale = p.yarn_attn_factor * (1.0 + 0.1 * std::log(1.0 / p.freq_scale));
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t h = 0; h < width; h += p.head_dim) {
      for (int32_t i = 0; i < half; ++i) {
        double f = std::pow(double{p.theta}, -2.0 * i / p.rope_dims);
        if (!p.freq_divisors.empty()) f /= p.freq_divisors[static_cast<size_t>(i)];
        const double e = static_cast<double>(pos[static_cast<size_t>(r)]) * f, s = e * p.freq_scale;
        const double m = p.yarn ? 1.0 - std::clamp((i - lo) / std::max(0.001, hi - lo), 0.0, 1.0) : 0.0;
        const double angle = p.yarn ? s * (1 - m) + e * m : s;
        const size_t a = static_cast<size_t>(r * width + h + (p.halves ? i : 2 * i));
        const size_t b = static_cast<size_t>(r * width + h + (p.halves ? i + half : 2 * i + 1));
        const double xa = x[a], xb = x[b];
        out[a] = (xa * std::cos(angle) - xb * std::sin(angle)) * mscale;
        out[b] = (xb * std::cos(angle) + xa * std::sin(angle)) * mscale;
      }
    }
  }
  return out;
}

TEST_P(OpsTargetTest, RopeMatchesItsDefinition) {
  struct Case {
    const char* name;
    RopeParams p;
    int32_t heads;
  };
  std::vector<Case> cases;
  cases.push_back({"pairs", {64, 64, false, 10000.0f}, 3});
  cases.push_back({"halves", {64, 64, true, 1000000.0f}, 2});
  cases.push_back({"partial pairs 20 of 64", {64, 20, false, 10000.0f}, 2});
  cases.push_back({"partial halves 24 of 32", {32, 24, true, 10000.0f}, 4});
  cases.push_back({"tiny head 6", {6, 6, false, 500.0f}, 5});
  RopeParams linear{48, 48, false, 10000.0f, 0.25f};
  cases.push_back({"linear", linear, 2});
  RopeParams yarn{64, 64, true, 10000.0f, 0.125f, true, 1.0f, 4096};
  cases.push_back({"yarn", yarn, 2});
  RopeParams divisors{32, 32, false, 500000.0f};
  for (int i = 0; i < 16; ++i) divisors.freq_divisors.push_back(1.0f + static_cast<float>(i) * 0.5f);
  cases.push_back({"freq divisors", divisors, 2});
  for (const Case& c : cases) {
    const Rope rope(c.p);
    const int32_t width = c.p.head_dim * c.heads;
    const std::vector<int64_t> pos = {0, 1, 7, 100, 4095, 31999};
    const auto rows = static_cast<int64_t>(pos.size());
    std::vector<float> x = Random(static_cast<size_t>(rows * width), 31u);
    const std::vector<double> want = RopeReference(c.p, x, rows, width, pos);
    std::vector<float> cos(static_cast<size_t>(rows * c.p.rope_dims)), sin(cos.size());
    rope.Tables(pos, cos.data(), sin.data());
    rope.Apply(x.data(), rows, width, cos.data(), sin.data());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_NEAR(x[i], want[i], 2e-5 * (1 + std::fabs(want[i]))) << c.name << " element " << i;
    }
  }
}

// Values that exercise every rounding branch of the encoders: normal,
// subnormal in f16, past f16's range, zeros, infinities, a quiet NaN.
std::vector<float> EdgeValues(size_t n, uint32_t seed) {
  std::vector<float> v = Random(n, seed, 2.0f);
  const float edges[] = {0.0f, -0.0f, 1e-6f, -3e-8f, 65504.0f, 65520.0f, 70000.0f, -1e9f, 1.0009765625f,
                         std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::quiet_NaN(), 2.5e-41f};
  for (size_t i = 0; i < std::size(edges) && i * 3 < n; ++i) v[i * 3] = edges[i];
  return v;
}

TEST_P(OpsTargetTest, EncodeKvRowsIsBitIdenticalToTheScalarCodecs) {
  for (int32_t elems : {8, 16, 64, 128}) {
    for (int64_t rows : {1, 5}) {
      const std::vector<float> edge = EdgeValues(static_cast<size_t>(rows * elems), 41u + static_cast<uint32_t>(elems));
      const std::vector<float> finite = Random(static_cast<size_t>(rows * elems), 43u, 5.0f);
      for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
        const KvFormat f = KvFormat::Plain(d);
        std::vector<std::byte> got(static_cast<size_t>(rows * EncodedRowBytes(f, elems))), want(got.size());
        EncodeKvRows(f, elems, edge.data(), rows, got.data());
        for (size_t i = 0; i < edge.size(); ++i) {
          if (d == DType::kF32) {
            std::memcpy(want.data() + 4 * i, &edge[i], 4);
          } else {
            const uint16_t h = d == DType::kF16 ? F32ToF16(edge[i]) : F32ToBF16(edge[i]);
            std::memcpy(want.data() + 2 * i, &h, 2);
          }
        }
        EXPECT_EQ(got, want) << DTypeName(d) << " elems " << elems << " rows " << rows;
      }
      const KvFormat kivi = KvFormat::Int4Kivi(32);
      std::vector<std::byte> got(static_cast<size_t>(rows * EncodedRowBytes(kivi, elems))), want(got.size());
      EncodeKvRows(kivi, elems, edge.data(), rows, got.data());
      for (size_t i = 0; i < edge.size(); ++i) {
        const uint16_t h = F32ToF16(edge[i]);
        std::memcpy(want.data() + 2 * i, &h, 2);
      }
      EXPECT_EQ(got, want) << "kivi staging elems " << elems;
      for (DType d : {DType::kInt8, DType::kFP8E4M3, DType::kFP8E5M2}) {
        for (bool hadamard : {false, true}) {
          KvFormat f = d == DType::kInt8 ? KvFormat::Int8(elems) : KvFormat::Fp8(d, elems);
          if (hadamard) f = f.WithHadamard();
          const int64_t row = EncodedRowBytes(f, elems);
          ASSERT_EQ(row, FormatRowBytes(f, elems));
          std::vector<float> x = finite;
          x[0] = 0.0f;  // and one all-zero row
          if (rows > 1) std::fill(x.begin() + elems, x.begin() + 2 * elems, 0.0f);
          std::vector<std::byte> g(static_cast<size_t>(rows * row)), w(g.size());
          EncodeKvRows(f, elems, x.data(), rows, g.data());
          for (int64_t r = 0; r < rows; ++r) {
            std::vector<float> v(x.begin() + r * elems, x.begin() + (r + 1) * elems);
            if (hadamard) quant::HadamardInPlace(v.data(), elems);
            if (d == DType::kInt8) {
              quant::EncodeInt8Row(v.data(), elems, w.data() + r * row);
            } else {
              quant::EncodeFp8Row(v.data(), elems, d == DType::kFP8E4M3, w.data() + r * row);
            }
          }
          EXPECT_EQ(g, w) << DTypeName(d) << (hadamard ? " hadamard" : "") << " elems " << elems << " rows " << rows;
        }
      }
    }
  }
}

std::string TargetName(const ::testing::TestParamInfo<int64_t>& info) { return kernels::TargetName(info.param); }

INSTANTIATE_TEST_SUITE_P(EveryTarget, OpsTargetTest, ::testing::ValuesIn(kernels::SupportedTargets()), TargetName);

}  // namespace
}  // namespace pagekv
