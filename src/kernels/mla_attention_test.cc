// Multi-head latent attention against a double-precision reference that
// computes the UNABSORBED formula from the same weights (per head
// k = [W_UK c_kv, k_pe], v = W_UV c_kv, softmax(q.k * scale) v), so the
// absorption itself is checked, not only the latent kernel: on every SIMD
// target, for f32 / f16 / bf16 / int8 / fp8 latent rows, contexts around
// block boundaries, shuffled block tables, flash-decoding splits, and
// chunked prefill split at every position of a block. Outputs are poisoned
// with NaN first, so an unwritten element fails.
//
// Tolerances (max |out - ref| / max |ref| per query head), the reference
// reading the stored (already rounded) latent values: f32 1e-5, 16-bit
// 2e-3, 8-bit 1e-4 (only f32 arithmetic differs there).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention_kernel.h"
#include "layout/float16.h"
#include "layout/quantize.h"
#include "pagekv/attention.h"
#include "testing/reference_attention.h"

namespace pagekv {
namespace {

struct MlaGeometry {
  int32_t heads = 4, rank = 32, rope = 8, nope = 16, vdim = 16, block_len = 16;
};

double Tolerance(DType d) { return d == DType::kF32 ? 1e-5 : DTypeBits(d) == 8 ? 1e-4 : 2e-3; }

// A latent pool filled by hand (each sequence's blocks a random subset of
// the pool in random order), the stored rows kept in double, and random
// absorbed-form weights.
class MlaFixture {
 public:
  MlaFixture(const MlaGeometry& g, DType dtype, std::vector<int64_t> lengths, uint32_t seed)
      : g_(g), rng_(seed), lengths_(std::move(lengths)) {
    CacheConfig c;
    c.kind = CacheKind::kMla;
    c.num_layers = 2;
    c.num_q_heads = g.heads;
    c.head_dim = g.nope;
    c.kv_lora_rank = g.rank;
    c.rope_dim = g.rope;
    c.block_len = g.block_len;
    const int32_t row = g.rank + g.rope;
    c.format = KvFormat::ForDType(dtype, row);
    int64_t blocks = 0;
    for (int64_t n : lengths_) blocks += (n + g.block_len - 1) / g.block_len;
    c.num_blocks = blocks + 2;
    auto layout = KvLayout::Create(c);
    EXPECT_TRUE(layout.ok()) << layout.status().ToString();
    layout_ = std::make_unique<KvLayout>(*layout);
    arena_.resize(static_cast<size_t>(layout_->total_bytes() / 64 + 1));
    std::vector<int32_t> ids(static_cast<size_t>(c.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng_);
    size_t next = 0;
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t n : lengths_) {
      std::vector<BlockId> table;
      for (int64_t b = 0; b < (n + g.block_len - 1) / g.block_len; ++b) table.push_back(BlockId{ids[next++]});
      std::vector<double> rows;  // [token][rank + rope] as stored
      for (int64_t t = 0; t < n; ++t) {
        std::byte* dst = arena() + layout_->RowOffset(kLayer, 0, 0, ToInt(table[static_cast<size_t>(t / g.block_len)]),
                                                      static_cast<int32_t>(t % g.block_len));
        std::vector<float> x(static_cast<size_t>(row)), back(x.size());
        for (float& e : x) e = static_cast<float>(u(rng_));
        switch (dtype) {
          case DType::kF32:
            std::memcpy(dst, x.data(), x.size() * 4);
            back = x;
            break;
          case DType::kF16:
          case DType::kBF16:
            for (int32_t i = 0; i < row; ++i) {
              const uint16_t h = dtype == DType::kF16 ? F32ToF16(x[static_cast<size_t>(i)]) : F32ToBF16(x[static_cast<size_t>(i)]);
              std::memcpy(dst + 2 * i, &h, 2);
              back[static_cast<size_t>(i)] = dtype == DType::kF16 ? F16ToF32(h) : BF16ToF32(h);
            }
            break;
          case DType::kInt8:
            quant::EncodeInt8Row(x.data(), row, dst);
            quant::DecodeInt8Row(dst, row, back.data());
            break;
          default:
            quant::EncodeFp8Row(x.data(), row, dtype == DType::kFP8E4M3, dst);
            quant::DecodeFp8Row(dst, row, dtype == DType::kFP8E4M3, back.data());
        }
        rows.insert(rows.end(), back.begin(), back.end());
      }
      tables_.push_back(std::move(table));
      rows_.push_back(std::move(rows));
    }
    std::normal_distribution<float> wn(0.0f, 0.3f);
    w_uk_.resize(static_cast<size_t>(g.heads) * g.nope * g.rank);
    w_uv_.resize(static_cast<size_t>(g.heads) * g.vdim * g.rank);
    for (float& x : w_uk_) x = wn(rng_);
    for (float& x : w_uv_) x = wn(rng_);
  }

  static constexpr int32_t kLayer = 1;
  std::byte* arena() { return reinterpret_cast<std::byte*>(arena_.data()); }
  PagedKv Kv() { return {layout_.get(), arena(), kLayer}; }
  std::span<const BlockId> Table(size_t i) const { return tables_[i]; }
  MlaWeights Weights() const { return {w_uk_.data(), w_uv_.data(), g_.nope, g_.vdim}; }
  std::mt19937& rng() { return rng_; }

  // The unabsorbed attention of sequence i's queries q ([nq][heads][nope +
  // rope], query j at position n - nq + j) in double: [nq][heads][vdim].
  // weights, when given: [n] += the softmax weight every head of every query
  // gave each token (what the kernels report for token eviction).
  std::vector<double> Reference(size_t i, const float* q, int64_t nq, double scale,
                                std::vector<double>* weights = nullptr) const {
    const int64_t n = lengths_[i];
    const int32_t row = g_.rank + g_.rope;
    const std::vector<double>& lat = rows_[i];
    // Per head and token: k_nope = W_UK c, v = W_UV c.
    std::vector<double> k(static_cast<size_t>(n * g_.heads * (g_.nope + g_.rope)));
    std::vector<double> v(static_cast<size_t>(n * g_.heads * g_.vdim));
    for (int64_t t = 0; t < n; ++t) {
      const double* c = lat.data() + t * row;
      for (int32_t h = 0; h < g_.heads; ++h) {
        double* kt = k.data() + (t * g_.heads + h) * (g_.nope + g_.rope);
        for (int32_t a = 0; a < g_.nope; ++a) {
          double sum = 0;
          for (int32_t r = 0; r < g_.rank; ++r) sum += static_cast<double>(w_uk_[(static_cast<size_t>(h) * g_.nope + a) * g_.rank + r]) * c[r];
          kt[a] = sum;
        }
        for (int32_t e = 0; e < g_.rope; ++e) kt[g_.nope + e] = c[g_.rank + e];
        double* vt = v.data() + (t * g_.heads + h) * g_.vdim;
        for (int32_t a = 0; a < g_.vdim; ++a) {
          double sum = 0;
          for (int32_t r = 0; r < g_.rank; ++r) sum += static_cast<double>(w_uv_[(static_cast<size_t>(h) * g_.vdim + a) * g_.rank + r]) * c[r];
          vt[a] = sum;
        }
      }
    }
    const int32_t qk = g_.nope + g_.rope;
    std::vector<double> out(static_cast<size_t>(nq * g_.heads * g_.vdim), 0.0);
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t last = n - nq + j;
      for (int32_t h = 0; h < g_.heads; ++h) {
        const float* qh = q + (j * g_.heads + h) * qk;
        std::vector<double> logit(static_cast<size_t>(last + 1));
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t t = 0; t <= last; ++t) {
          const double* kt = k.data() + (t * g_.heads + h) * qk;
          double dot = 0;
          for (int32_t a = 0; a < qk; ++a) dot += static_cast<double>(qh[a]) * kt[a];
          logit[static_cast<size_t>(t)] = dot * scale;
          m = std::max(m, logit[static_cast<size_t>(t)]);
        }
        double denom = 0;
        double* o = out.data() + (j * g_.heads + h) * g_.vdim;
        for (int64_t t = 0; t <= last; ++t) {
          const double p = std::exp(logit[static_cast<size_t>(t)] - m);
          denom += p;
          const double* vt = v.data() + (t * g_.heads + h) * g_.vdim;
          for (int32_t a = 0; a < g_.vdim; ++a) o[a] += p * vt[a];
        }
        for (int32_t a = 0; a < g_.vdim; ++a) o[a] /= denom;
        if (weights != nullptr) {
          weights->resize(static_cast<size_t>(n), 0.0);
          for (int64_t t = 0; t <= last; ++t) (*weights)[static_cast<size_t>(t)] += std::exp(logit[static_cast<size_t>(t)] - m) / denom;
        }
      }
    }
    return out;
  }

 private:
  struct alignas(64) Line {
    std::byte b[64];
  };
  MlaGeometry g_;
  std::mt19937 rng_;
  std::vector<int64_t> lengths_;
  std::unique_ptr<KvLayout> layout_;
  std::vector<Line> arena_;
  std::vector<std::vector<BlockId>> tables_;
  std::vector<std::vector<double>> rows_;
  std::vector<float> w_uk_, w_uv_;
};

std::vector<float> RandomQ(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  std::vector<float> q(n);
  for (float& x : q) x = u(rng);
  return q;
}

class MlaTargetTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { kernels::SetTargetForTest(GetParam()); }
  void TearDown() override { kernels::SetTargetForTest(0); }
};

const DType kDtypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kInt8, DType::kFP8E4M3, DType::kFP8E5M2};

TEST_P(MlaTargetTest, DecodeMatchesTheUnabsorbedReference) {
  MlaGeometry g;
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.nope + g.rope));
  for (DType d : kDtypes) {
    const int32_t bl = g.block_len;
    const std::vector<int64_t> lengths = {1, bl - 1, bl, bl + 1, 5 * bl + 3};
    MlaFixture f(g, d, lengths, 17);
    std::vector<DecodeSeq> seqs;
    for (size_t i = 0; i < lengths.size(); ++i) seqs.push_back({f.Table(i), lengths[i]});
    const int32_t qk = g.nope + g.rope;
    std::vector<float> q = RandomQ(f.rng(), lengths.size() * g.heads * qk);
    for (const int64_t split : {int64_t{0}, int64_t{bl}, int64_t{2 * bl}}) {
      std::vector<float> out(lengths.size() * g.heads * g.vdim, std::nanf(""));
      AttentionOptions o;
      o.split_tokens = split;
      o.num_threads = 2;
      ASSERT_TRUE(MlaDecodeAttention(f.Kv(), seqs, q.data(), f.Weights(), out.data(), o).ok());
      for (size_t i = 0; i < lengths.size(); ++i) {
        const std::vector<double> ref = f.Reference(i, q.data() + i * g.heads * qk, 1, scale);
        EXPECT_LE(testing::MaxRowRelError(out.data() + i * g.heads * g.vdim, ref, g.heads, g.vdim), Tolerance(d))
            << DTypeName(d) << " length " << lengths[i] << " split " << split;
      }
    }
  }
}

// Token eviction on a latent cache: the weights the kernels report per
// cached token are the sum over every query head (all share the one latent
// row), in decode with flash-decoding splits and in prefill.
TEST_P(MlaTargetTest, ReportedWeightsAreEveryHeadsSoftmaxWeightPerToken) {
  MlaGeometry g;
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.nope + g.rope));
  const int32_t qk = g.nope + g.rope;
  const int64_t n = 3 * g.block_len + 7;
  MlaFixture f(g, DType::kF32, {n}, 41);
  std::vector<float> q = RandomQ(f.rng(), static_cast<size_t>(n) * g.heads * qk);
  for (const int64_t split : {int64_t{0}, int64_t{g.block_len}}) {
    std::vector<float> scores(static_cast<size_t>(n), 0.0f), out(static_cast<size_t>(g.heads) * g.vdim);
    const DecodeSeq seq{f.Table(0), n, scores.data()};
    AttentionOptions o;
    o.split_tokens = split;
    ASSERT_TRUE(MlaDecodeAttention(f.Kv(), std::span(&seq, 1), q.data(), f.Weights(), out.data(), o).ok());
    std::vector<double> want;
    f.Reference(0, q.data(), 1, scale, &want);
    double total = 0;
    for (int64_t t = 0; t < n; ++t) {
      EXPECT_NEAR(scores[static_cast<size_t>(t)], want[static_cast<size_t>(t)], 1e-5) << "token " << t << " split " << split;
      total += scores[static_cast<size_t>(t)];
    }
    EXPECT_NEAR(total, g.heads, 1e-4) << "every head's weights sum to one";
  }
  // Prefill: the last 5 queries' weights.
  std::vector<float> scores(static_cast<size_t>(n), 0.0f), out(static_cast<size_t>(n) * g.heads * g.vdim);
  const PrefillSeq seq{f.Table(0), n, n, scores.data(), 5};
  ASSERT_TRUE(MlaPrefillAttention(f.Kv(), std::span(&seq, 1), q.data(), f.Weights(), out.data()).ok());
  std::vector<double> want;
  f.Reference(0, q.data() + (n - 5) * g.heads * qk, 5, scale, &want);
  for (int64_t t = 0; t < n; ++t) EXPECT_NEAR(scores[static_cast<size_t>(t)], want[static_cast<size_t>(t)], 1e-5) << "token " << t;
}

TEST_P(MlaTargetTest, ChunkedPrefillAtEveryPositionOfABlockMatchesTheReference) {
  MlaGeometry g;
  g.block_len = 8;
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.nope + g.rope));
  const int32_t qk = g.nope + g.rope;
  for (DType d : {DType::kF32, DType::kBF16, DType::kInt8}) {
    const int64_t n = 3 * g.block_len + 5;
    MlaFixture f(g, d, {n}, 23);
    std::vector<float> q_all = RandomQ(f.rng(), static_cast<size_t>(n) * g.heads * qk);
    // The whole prompt's reference, then every split into two chunks.
    const std::vector<double> ref = f.Reference(0, q_all.data(), n, scale);
    for (int64_t first = 1; first < n; first += (first < 2 * g.block_len ? 1 : 5)) {
      std::vector<float> out(static_cast<size_t>(n) * g.heads * g.vdim, std::nanf(""));
      const PrefillSeq chunk1{f.Table(0), first, first};
      ASSERT_TRUE(MlaPrefillAttention(f.Kv(), std::span(&chunk1, 1), q_all.data(), f.Weights(), out.data()).ok());
      const PrefillSeq chunk2{f.Table(0), n, n - first};
      ASSERT_TRUE(MlaPrefillAttention(f.Kv(), std::span(&chunk2, 1), q_all.data() + first * g.heads * qk, f.Weights(),
                                      out.data() + first * g.heads * g.vdim)
                      .ok());
      EXPECT_LE(testing::MaxRowRelError(out.data(), ref, n * g.heads, g.vdim), Tolerance(d)) << DTypeName(d) << " split at " << first;
    }
  }
}

std::string TargetName(const ::testing::TestParamInfo<int64_t>& info) { return kernels::TargetName(info.param); }

INSTANTIATE_TEST_SUITE_P(EveryTarget, MlaTargetTest, ::testing::ValuesIn(kernels::SupportedTargets()), TargetName);

// DeepSeek-V3's shape: 128 heads over rank 512 + rope 64 (the most rows one
// task carries), one long context split for flash-decoding.
TEST(MlaAttentionTest, DeepSeekV3ShapeMatchesTheReference) {
  MlaGeometry g;
  g.heads = 128;
  g.rank = 512;
  g.rope = 64;
  g.nope = 128;
  g.vdim = 128;
  g.block_len = 64;
  MlaFixture f(g, DType::kBF16, {300}, 5);
  const DecodeSeq seq{f.Table(0), 300};
  std::vector<float> q = RandomQ(f.rng(), static_cast<size_t>(g.heads) * (g.nope + g.rope));
  for (float& x : q) x *= 0.2f;  // keep the softmax from collapsing onto one token at this width
  std::vector<float> out(static_cast<size_t>(g.heads) * g.vdim, std::nanf(""));
  AttentionOptions o;
  o.split_tokens = 128;
  ASSERT_TRUE(MlaDecodeAttention(f.Kv(), std::span(&seq, 1), q.data(), f.Weights(), out.data(), o).ok());
  const std::vector<double> ref = f.Reference(0, q.data(), 1, 1.0 / std::sqrt(192.0));
  EXPECT_LE(testing::MaxRowRelError(out.data(), ref, g.heads, g.vdim), 2e-3);
}

TEST(MlaAttentionTest, BadInputIsNamedAndWritesNothing) {
  MlaGeometry g;
  MlaFixture f(g, DType::kF16, {10}, 3);
  const DecodeSeq seq{f.Table(0), 10};
  std::vector<float> q(static_cast<size_t>(g.heads) * (g.nope + g.rope), 0.1f);
  std::vector<float> out(static_cast<size_t>(g.heads) * g.vdim, 7.0f);
  MlaWeights none{};
  Status s = MlaDecodeAttention(f.Kv(), std::span(&seq, 1), q.data(), none, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("w_uk"), std::string::npos) << s.ToString();
  const DecodeSeq empty{f.Table(0), 0};
  s = MlaDecodeAttention(f.Kv(), std::span(&empty, 1), q.data(), f.Weights(), out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; })) << "nothing written";
  // A per-head layout is not a latent cache.
  CacheConfig c;
  c.num_layers = 1;
  c.num_q_heads = 4;
  c.num_kv_heads = 4;
  c.head_dim = 16;
  c.block_len = 16;
  c.num_blocks = 4;
  const KvLayout per_head = *KvLayout::Create(c);
  std::vector<std::byte> arena(static_cast<size_t>(per_head.total_bytes()));
  s = MlaDecodeAttention({&per_head, arena.data(), 0}, std::span(&seq, 1), q.data(), f.Weights(), out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not an MLA"), std::string::npos) << s.ToString();
  // int4 KIVI latent rows are refused by name.
  CacheConfig m;
  m.kind = CacheKind::kMla;
  m.num_layers = 1;
  m.num_q_heads = 4;
  m.head_dim = 16;
  m.kv_lora_rank = 32;
  m.rope_dim = 8;
  m.block_len = 32;
  m.num_blocks = 4;
  m.format = KvFormat::ForDType(DType::kInt4, 40);
  if (auto kivi = KvLayout::Create(m); kivi.ok()) {
    std::vector<std::byte> a2(static_cast<size_t>(kivi->total_bytes()));
    s = MlaDecodeAttention({&*kivi, a2.data(), 0}, std::span(&seq, 1), q.data(), f.Weights(), out.data());
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.ToString();
  }
}

}  // namespace
}  // namespace pagekv
