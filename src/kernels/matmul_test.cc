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

#include "kernels/amx_matmul.h"
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

// Byte offsets of a block's half-precision scale fields (weight_formats.h).
std::vector<int> HalfOffsets(WeightType t) {
  switch (t) {
    case WeightType::kQ4_1: case WeightType::kQ5_1: case WeightType::kQ4_K: case WeightType::kQ5_K: return {0, 2};
    case WeightType::kQ2_K: return {80, 82};
    case WeightType::kQ3_K: return {108};
    case WeightType::kQ6_K: return {208};
    default: return {0};
  }
}

// Random blocks (every bit random but the scales, kept finite and of a
// realistic size), with their values from the normative decoder.
Weights MakeBlockWeights(WeightType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  Weights w;
  w.bytes.resize(static_cast<size_t>(rows * WeightRowBytes(type, cols)));
  for (auto& b : w.bytes) b = static_cast<std::byte>(rng());
  const WeightFormat& f = FormatOf(type);
  for (size_t at = 0; at < w.bytes.size(); at += static_cast<size_t>(f.block_bytes)) {
    for (int off : HalfOffsets(type)) {
      const uint16_t h = F32ToF16(normal(rng));
      std::memcpy(w.bytes.data() + at + off, &h, 2);
    }
  }
  w.values.resize(static_cast<size_t>(rows * cols));
  DecodeWeights(type, w.bytes.data(), rows * cols, w.values.data());
  w.matrix = {w.bytes.data(), type, rows, cols};
  return w;
}

Weights MakeWeights(WeightType type, int64_t rows, int64_t cols, uint32_t seed) {
  if (IsBlockQuantized(type) && type != WeightType::kQ8_0) return MakeBlockWeights(type, rows, cols, seed);
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
        default: break;  // q8_0: below, per block
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

// `matrix`: w's own, or its panel copy (PackedWeights).
void ExpectProduct(const Weights& w, int64_t tokens, uint32_t seed, int threads, const WeightMatrix* matrix = nullptr,
                   Activations activations = Activations::kF32) {
  const WeightMatrix& m = matrix != nullptr ? *matrix : w.matrix;
  const int64_t rows = w.matrix.rows, cols = w.matrix.cols;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(tokens * cols));
  for (float& v : x) v = uni(rng);
  std::vector<float> y(static_cast<size_t>(tokens * rows), -1e30f);
  ASSERT_TRUE(MatMul(m, x.data(), tokens, y.data(), threads, activations).ok());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = double{w.values[static_cast<size_t>(r * cols + c)]} * x[static_cast<size_t>(t * cols + c)];
        ref += p;
        mag += std::fabs(p);
      }
      ASSERT_NEAR(y[static_cast<size_t>(t * rows + r)], ref, 1e-5 * mag + 1e-6)
          << "token " << t << " row " << r << " (" << rows << "x" << cols << ", " << tokens << " tokens"
          << (m.panels ? ", panels)" : ")");
    }
  }
}

// The fast path's product of `m` (w's own matrix or its panels) with a
// random X, against a double product of X as the integer kernels see it
// when `rounded` (int16 per 32 values: d = max |x| / 32767, round(x / d),
// a quantizer written here), else of X itself.
void ExpectFastProduct(const Weights& w, const WeightMatrix& m, int64_t tokens, uint32_t seed, bool rounded) {
  const int64_t rows = m.rows, cols = m.cols;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(tokens * cols));
  for (float& v : x) v = uni(rng);
  std::vector<double> xr(x.begin(), x.end());  // X as the product sees it
  if (rounded) {
    for (size_t b = 0; b < x.size() / 32; ++b) {
      float amax = 0;
      for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
      const float d = amax / 32767.0f;
      for (size_t i = 0; i < 32; ++i) xr[b * 32 + i] = d == 0 ? 0.0 : double{d} * std::nearbyint(x[b * 32 + i] / d);
    }
  }
  std::vector<float> y(static_cast<size_t>(tokens * rows), NAN);
  ASSERT_TRUE(MatMul(m, x.data(), tokens, y.data(), 1, Activations::kFast).ok());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = double{w.values[static_cast<size_t>(r * cols + c)]} * xr[static_cast<size_t>(t * cols + c)];
        ref += p;
        mag += std::fabs(p);
      }
      ASSERT_NEAR(y[static_cast<size_t>(t * rows + r)], ref, 2e-5 * mag + 1e-6)
          << FormatOf(m.type).name << " token " << t << " row " << r << " of " << rows << "x" << cols << ", " << tokens
          << " tokens" << (m.panels ? ", panels" : "") << (rounded ? ", X rounded" : "");
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

// Panels: rows around the 16-row panel and 32-row padding, token counts
// around the 12-token (AVX-512) / 6- and 3-token tiles and their remainders.
// Every ggml block format: rows around the 4-row tile, several blocks per
// row, token counts around every tile width; and the embedding lookup.
TEST_P(MatMulTargetTest, EveryBlockFormat) {
  uint32_t seed = 500;
  for (WeightType type : {WeightType::kQ4_0, WeightType::kQ4_1, WeightType::kQ5_0, WeightType::kQ5_1, WeightType::kQ2_K,
                          WeightType::kQ3_K, WeightType::kQ4_K, WeightType::kQ5_K, WeightType::kQ6_K}) {
    const int64_t block = FormatOf(type).block_elems;
    for (int64_t rows : {1, 4, 5, 19}) {
      for (int64_t blocks : {1, 2, 3}) {
        const Weights w = MakeWeights(type, rows, blocks * block, seed++);
        for (int64_t tokens : {1, 2, 3, 5, 6, 7, 13}) ExpectProduct(w, tokens, seed++, 1);
        std::vector<float> row(static_cast<size_t>(blocks * block));
        WeightRow(w.matrix, rows - 1, row.data());
        for (int64_t c = 0; c < blocks * block; ++c) {
          ASSERT_EQ(row[static_cast<size_t>(c)], w.values[static_cast<size_t>((rows - 1) * blocks * block + c)]);
        }
      }
    }
    EXPECT_EQ(PackedWeights::Pack(MakeWeights(type, 4, block, 1).matrix).ok(),
              type == WeightType::kQ4_0 || type == WeightType::kQ4_1 || type == WeightType::kQ5_0 ||
                  type == WeightType::kQ5_1 || type == WeightType::kQ4_K || type == WeightType::kQ5_K ||
                  type == WeightType::kQ6_K)
        << "only q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k and q6_k have a panel layout";
    std::vector<float> x(block / 2), y(4);
    const Weights bad = MakeWeights(type, 1, block, 2);
    EXPECT_EQ(MatMul({bad.matrix.data, type, 1, block / 2}, x.data(), 1, y.data()).code(), StatusCode::kInvalidArgument);
  }
}

// The integer activation path: X rounded to int16 per 32 values by a
// quantizer written here (the reference), then the same double-precision
// product; on targets without the integer kernels kFast is the f32 path.
TEST_P(MatMulTargetTest, IntActivationsMatchAProductOfTheRoundedActivations) {
  uint32_t seed = 900;
  const bool integer = IntActivationsAvailable();
  for (WeightType type : {WeightType::kQ8_0, WeightType::kQ4_0, WeightType::kQ4_1, WeightType::kQ5_0, WeightType::kQ5_1,
                          WeightType::kQ2_K, WeightType::kQ3_K, WeightType::kQ4_K, WeightType::kQ5_K, WeightType::kQ6_K}) {
    const int64_t block = FormatOf(type).block_elems;
    for (int64_t rows : {1, 4, 7}) {
      for (int64_t blocks : {1, 3}) {
        const int64_t cols = blocks * std::max<int64_t>(block, 64);
        const Weights w = MakeWeights(type, rows, cols, seed++);
        for (int64_t tokens : {1, 2, 3, 7, 15, 16}) ExpectFastProduct(w, w.matrix, tokens, seed++, integer && tokens < 16);
      }
    }
  }
}

// AVX-512 VNNI's vpdpwssd sums the same integers as vpmaddwd + vpaddd, so
// the 32-element formats' int16 products come out bit for bit the same with
// it and without it (forced off), on every target (those without AVX-512
// never take it).
TEST_P(MatMulTargetTest, VnniGivesTheSameProductsBitForBit) {
  if (!kernels::SetVnniForTest(true)) GTEST_SKIP() << "this CPU has no AVX-512 VNNI";
  uint32_t seed = 1700;
  for (WeightType type : {WeightType::kQ8_0, WeightType::kQ4_0, WeightType::kQ4_1, WeightType::kQ5_0, WeightType::kQ5_1}) {
    for (int64_t tokens : {1, 2, 5}) {
      const int64_t rows = 9, cols = 256;
      const Weights w = MakeWeights(type, rows, cols, seed++);
      std::mt19937 rng(seed++);
      std::uniform_real_distribution<float> uni(-3.0f, 3.0f);
      std::vector<float> x(static_cast<size_t>(tokens * cols));
      for (float& v : x) v = uni(rng);
      std::vector<float> with(static_cast<size_t>(tokens * rows)), without(with.size());
      kernels::SetVnniForTest(true);
      ASSERT_TRUE(MatMul(w.matrix, x.data(), tokens, with.data(), 1, Activations::kFast).ok());
      kernels::SetVnniForTest(false);
      ASSERT_TRUE(MatMul(w.matrix, x.data(), tokens, without.data(), 1, Activations::kFast).ok());
      kernels::SetVnniForTest(true);
      for (size_t i = 0; i < with.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(with[i]), std::bit_cast<uint32_t>(without[i]))
            << FormatOf(type).name << " tokens " << tokens << " output " << i;
      }
    }
  }
}

TEST_P(MatMulTargetTest, PanelsEveryTypeAndTail) {
  uint32_t seed = 100;
  for (WeightType type : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
    for (int64_t rows : {1, 15, 16, 17, 31, 32, 33, 70}) {
      for (int64_t cols : {1, 7, 16, 33, 172}) {
        const Weights w = MakeWeights(type, rows, cols, seed++);
        Result<PackedWeights> packed = PackedWeights::Pack(w.matrix);
        ASSERT_TRUE(packed.ok()) << packed.status().message();
        ASSERT_TRUE(packed->matrix().panels);
        for (int64_t tokens : {1, 2, 3, 5, 6, 7, 11, 12, 13, 25, 31}) ExpectProduct(w, tokens, seed++, 1, &packed->matrix());
        // The embedding lookup reads a row back out of the panels.
        std::vector<float> row(static_cast<size_t>(cols));
        for (int64_t r : {int64_t{0}, rows / 2, rows - 1}) {
          WeightRow(packed->matrix(), r, row.data());
          for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(row[static_cast<size_t>(c)], w.values[static_cast<size_t>(r * cols + c)]);
        }
      }
    }
  }
}

// AMX-BF16 tiles (kernels/amx_matmul.cc) for the fast path's calls of 16
// tokens and more, X and W split into bf16 hi + lo: the f32 path's
// tolerance on every panel type and block format, around the 16-token
// tiles, the 32-row tiles and their padding; on the AVX-512 target the tiles
// must actually run (their sums differ from the vector kernel's in the last
// bits), never on the other targets, and never on the exact path (kF32:
// bit for bit the same with the tiles allowed or not).
TEST_P(MatMulTargetTest, AmxTilesKeepTheF32Accuracy) {
  if (!kernels::SetAmxMatMulForTest(true)) GTEST_SKIP() << "this CPU (or its kernel) has no AMX-BF16 tiles";
  const bool avx512 = kernels::TargetName(GetParam()).rfind("AVX3", 0) == 0;
  EXPECT_EQ(kernels::MatMulTargetName().find("+AMX") != std::string::npos, avx512) << kernels::MatMulTargetName();
  uint32_t seed = 2100;
  int differed = 0, compared = 0;  // calls that should take the tiles
  auto check = [&](const Weights& w, const WeightMatrix& m, int64_t tokens) {
    const bool tiles = avx512 && tokens >= kernels::AmxMinTokens(m.type);
    ExpectProduct(w, tokens, seed, 1, &m, Activations::kFast);
    std::mt19937 rng(seed++);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(tokens * m.cols));
    for (float& v : x) v = uni(rng);
    std::vector<float> with(static_cast<size_t>(tokens * m.rows)), without(with.size()), exact(with.size());
    ASSERT_TRUE(MatMul(m, x.data(), tokens, with.data(), 1, Activations::kFast).ok());
    ASSERT_TRUE(MatMul(m, x.data(), tokens, exact.data(), 1, Activations::kF32).ok());
    kernels::SetAmxMatMulForTest(false);
    ASSERT_TRUE(MatMul(m, x.data(), tokens, without.data(), 1, Activations::kFast).ok());
    kernels::SetAmxMatMulForTest(true);
    ASSERT_EQ(exact, without) << "the exact path must not depend on whether the tiles are allowed";
    if (tiles) {
      ++compared;
      differed += with != without ? 1 : 0;
    } else {
      ASSERT_EQ(with, without) << "no tiles below " << kernels::AmxMinTokens(m.type) << " tokens (" << tokens << ")";
    }
  };
  for (WeightType type : {WeightType::kF32, WeightType::kF16, WeightType::kBF16}) {
    for (int64_t rows : {1, 16, 17, 32, 33, 70}) {
      for (int64_t cols : {32, 96, 288}) {
        const Weights w = MakeWeights(type, rows, cols, seed++);
        Result<PackedWeights> packed = PackedWeights::Pack(w.matrix);
        ASSERT_TRUE(packed.ok());
        for (int64_t tokens : {16, 17, 31, 32, 33, 50, 64}) check(w, packed->matrix(), tokens);
      }
    }
  }
  for (WeightType type : {WeightType::kQ8_0, WeightType::kQ4_1, WeightType::kQ5_0, WeightType::kQ4_K, WeightType::kQ6_K,
                          WeightType::kQ3_K}) {
    const int64_t block = FormatOf(type).block_elems;
    for (int64_t rows : {3, 32, 45}) {
      for (int64_t blocks : {1, 3}) {
        const Weights w = MakeWeights(type, rows, blocks * std::max<int64_t>(block, 64), seed++);
        for (int64_t tokens : {16, 32, 33}) check(w, w.matrix, tokens);
      }
    }
  }
  if (avx512) {
    EXPECT_GT(differed, compared / 2) << "the AMX tiles did not run";
  }
}

// q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k and q6_k in panels: the exact path (the panels decoded to f32) on
// every tail of the 16-row panels, their 32-row padding and the token
// tiles; the fast path's few tokens (the panel's integer kernel, X rounded
// to int16 per 32 values: against the same double product of the rounded X
// as the row-major integer path) and many (AMX tiles where the CPU has
// them, else f32); the rows read back for the embedding lookup.
TEST_P(MatMulTargetTest, BlockPanelsEveryPathAndTail) {
  uint32_t seed = 3100;
  const bool integer = IntActivationsAvailable();
  for (WeightType type : {WeightType::kQ8_0, WeightType::kQ4_0, WeightType::kQ4_1, WeightType::kQ5_0, WeightType::kQ5_1,
                          WeightType::kQ4_K, WeightType::kQ5_K, WeightType::kQ6_K})
  for (int64_t rows : {1, 15, 16, 17, 31, 32, 33, 70}) {
    for (int64_t cols : FormatOf(type).block_elems == 32 ? std::vector<int64_t>{32, 64, 288} : std::vector<int64_t>{256, 768}) {
      SCOPED_TRACE(FormatOf(type).name);
      const Weights w = MakeWeights(type, rows, cols, seed++);
      Result<PackedWeights> packed = PackedWeights::Pack(w.matrix);
      ASSERT_TRUE(packed.ok()) << packed.status().message();
      const WeightMatrix& m = packed->matrix();
      ASSERT_TRUE(m.panels);
      for (int64_t tokens : {1, 2, 3, 5, 13, 16, 17, 33}) ExpectProduct(w, tokens, seed++, 1, &m);
      for (int64_t tokens : {32, 33, 50}) ExpectProduct(w, tokens, seed++, 1, &m, Activations::kFast);
      for (int64_t tokens : {1, 2, 3, 7, 15}) ExpectFastProduct(w, m, tokens, seed++, integer);
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r : {int64_t{0}, rows / 2, rows - 1}) {
        WeightRow(m, r, row.data());
        for (int64_t c = 0; c < cols; ++c) {
          const float want = w.values[static_cast<size_t>(r * cols + c)];
          ASSERT_NEAR(row[static_cast<size_t>(c)], want, 1e-6f * std::fabs(want)) << "row " << r << " column " << c;
        }
      }
    }
  }
}

TEST_P(MatMulTargetTest, ThreadedLargeMatchesReference) {
  // Large enough to take the pool (rows split in chunks) and the token chunks.
  for (WeightType type : {WeightType::kF32, WeightType::kQ8_0, WeightType::kQ4_K}) {
    const Weights w = MakeWeights(type, 301, type == WeightType::kQ4_K ? 512 : 320, 7);
    ExpectProduct(w, 37, 8, 0);
  }
  // Panels, with more tokens than one L2 chunk (256 KiB of X rows).
  const Weights w = MakeWeights(WeightType::kF16, 301, 320, 9);
  Result<PackedWeights> packed = PackedWeights::Pack(w.matrix);
  ASSERT_TRUE(packed.ok());
  ExpectProduct(w, 37, 10, 0, &packed->matrix());
  ExpectProduct(w, 230, 11, 0, &packed->matrix());
}

// Products sharing X in one hand-off equal the products one at a time, for
// a mix of layouts and types, on one thread and on the pool.
TEST(MatMulTest, SharedEqualsSeparate) {
  const Weights a = MakeWeights(WeightType::kF32, 300, 96, 21), b = MakeWeights(WeightType::kF16, 45, 96, 22),
                c = MakeWeights(WeightType::kQ8_0, 70, 96, 23);
  Result<PackedWeights> pa = PackedWeights::Pack(a.matrix);
  ASSERT_TRUE(pa.ok());
  const int64_t tokens = 29;
  std::vector<float> x(static_cast<size_t>(tokens * 96));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (float& v : x) v = uni(rng);
  for (int threads : {1, 0}) {
    const std::vector<WeightMatrix> ms = {pa->matrix(), b.matrix, c.matrix};
    std::vector<std::vector<float>> shared(3), separate(3);
    std::vector<MatMulOutput> outs;
    for (size_t i = 0; i < 3; ++i) {
      shared[i].assign(static_cast<size_t>(tokens * ms[i].rows), NAN);
      separate[i].assign(shared[i].size(), NAN);
      outs.push_back({ms[i], shared[i].data()});
      ASSERT_TRUE(MatMul(ms[i], x.data(), tokens, separate[i].data(), threads).ok());
    }
    ASSERT_TRUE(MatMulShared(outs, x.data(), tokens, threads).ok());
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(shared[i], separate[i]) << "output " << i << ", threads " << threads;
  }
  const Weights other = MakeWeights(WeightType::kF32, 4, 32, 24);
  const std::vector<MatMulOutput> mismatched = {{a.matrix, x.data()}, {other.matrix, x.data()}};
  EXPECT_EQ(MatMulShared(mismatched, x.data(), 1).code(), StatusCode::kInvalidArgument);
}

TEST(MatMulTest, PackRefusesTheOtherBlockFormatsAndPackedInput) {
  const Weights q3 = MakeWeights(WeightType::kQ3_K, 4, 256, 3);  // a format without a panel layout
  EXPECT_EQ(PackedWeights::Pack(q3.matrix).status().code(), StatusCode::kInvalidArgument);
  const Weights q8 = MakeWeights(WeightType::kQ8_0, 4, 64, 3);
  Result<PackedWeights> q8p = PackedWeights::Pack(q8.matrix);
  ASSERT_TRUE(q8p.ok());
  EXPECT_EQ(PackedWeights::Pack(q8p->matrix()).status().code(), StatusCode::kInvalidArgument);
  const Weights f = MakeWeights(WeightType::kF32, 4, 8, 3);
  Result<PackedWeights> packed = PackedWeights::Pack(f.matrix);
  ASSERT_TRUE(packed.ok());
  EXPECT_EQ(PackedWeights::Pack(packed->matrix()).status().code(), StatusCode::kInvalidArgument);
}

std::string TargetName(const ::testing::TestParamInfo<int64_t>& info) { return kernels::TargetName(info.param); }

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
