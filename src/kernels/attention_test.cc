// Paged attention against the double-precision reference, on every SIMD
// target this CPU supports (forced one at a time), over the shapes that catch
// indexing bugs: contexts of 1, block_len - 1, block_len, block_len + 1 and
// many blocks; shuffled, non-contiguous block tables; sequences of different
// lengths in one batch; G = 1, 4, 8; head_dims with and without a vector
// tail; chunked prefill split at every position of a block. Outputs are
// poisoned with NaN first, so an unwritten element fails.
//
// Tolerances (max |out - ref| / max |ref| per query head), against a
// reference computed from the stored (already rounded) K and V values:
//   f32 KV: 1e-5;  f16 and bf16 KV: 2e-3;  int8 and fp8 KV: 1e-4 (the reference reads
//   the dequantized values, so only f32 arithmetic differs; the quantization
//   error itself is bounded by the codec's tests in layout/).
#include "pagekv/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/amx_attention.h"
#include "kernels/attention_kernel.h"
#include "layout/float16.h"
#include "layout/quantize.h"
#include "kernels/paged_fixture.h"
#include "testing/reference_attention.h"

namespace pagekv {
namespace {

using testing::PagedFixture;
using testing::RandomQ;
using testing::Tolerance;

// Max over query heads of max |out - ref| / max |ref|.
struct Shape {
  int32_t q_heads, kv_heads, head_dim;
};

class AttentionTargetTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { kernels::SetTargetForTest(GetParam()); }
  void TearDown() override { kernels::SetTargetForTest(0); }
};

// One prefill call over sequences of `lengths` tokens whose last `queries`
// are the queries (whole prompts and trailing chunks), each sequence against
// the reference within `tol`.
void CheckPrefill(const Shape& s, DType dtype, int32_t block_len, const std::vector<int64_t>& lengths,
                  const std::vector<int64_t>& queries, uint32_t seed, int threads, double tol, const std::string& what) {
  PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, block_len, dtype, lengths, seed);
  std::vector<PrefillSeq> seqs;
  int64_t total_q = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    seqs.push_back({f.Table(i), lengths[i], queries[i]});
    total_q += queries[i];
  }
  const size_t per_query = static_cast<size_t>(s.q_heads) * s.head_dim;
  std::vector<float> q = RandomQ(f.rng(), per_query * static_cast<size_t>(total_q));
  std::vector<float> out(q.size(), std::nanf(""));
  AttentionOptions opts;
  opts.num_threads = threads;
  ASSERT_TRUE(PagedPrefillAttention(f.Kv(0), seqs, q.data(), out.data(), opts).ok());
  size_t at = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(at * per_query),
                           q.begin() + static_cast<std::ptrdiff_t>((at + static_cast<size_t>(queries[i])) * per_query));
    const std::vector<double> ref = testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, qd,
                                                                queries[i], f.K(i, 0), f.V(i, 0), lengths[i]);
    EXPECT_LE(testing::MaxRowRelError(out.data() + at * per_query, ref, queries[i] * s.q_heads, s.head_dim), tol)
        << what << ": sequence " << i << " length " << lengths[i] << " queries " << queries[i] << " head_dim "
        << s.head_dim << " block_len " << block_len;
    at += static_cast<size_t>(queries[i]);
  }
}

// tol < 0: Tolerance(dtype).
void CheckDecode(const Shape& s, DType dtype, int32_t block_len, const AttentionOptions& opts, uint32_t seed,
                 double tol = -1) {
  const std::vector<int64_t> lengths = {1, block_len - 1, block_len, block_len + 1, 5 * block_len + 3};
  PagedFixture f(2, s.q_heads, s.kv_heads, s.head_dim, block_len, dtype, lengths, seed);
  const int32_t layer = 1;
  std::vector<DecodeSeq> seqs;
  for (size_t i = 0; i < lengths.size(); ++i) seqs.push_back({f.Table(i), lengths[i]});
  const size_t per_seq = static_cast<size_t>(s.q_heads) * s.head_dim;
  std::vector<float> q = RandomQ(f.rng(), per_seq * lengths.size());
  std::vector<float> out(q.size(), std::nanf(""));
  Status st = PagedDecodeAttention(f.Kv(layer), seqs, q.data(), out.data(), opts);
  ASSERT_TRUE(st.ok()) << st.ToString();
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_seq),
                           q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_seq));
    testing::ReferenceShape rs{s.q_heads, s.kv_heads, s.head_dim, opts.scale, opts.softcap};
    const std::vector<double> ref = testing::ReferenceAttention(rs, qd, 1, f.K(i, layer), f.V(i, layer), lengths[i]);
    const double err = testing::MaxRowRelError(out.data() + i * per_seq, ref, s.q_heads, s.head_dim);
    EXPECT_LE(err, tol < 0 ? Tolerance(dtype) : tol) << DTypeName(dtype) << " q_heads=" << s.q_heads << " kv_heads=" << s.kv_heads
                                     << " head_dim=" << s.head_dim << " block_len=" << block_len
                                     << " context=" << lengths[i] << " split=" << opts.split_tokens;
  }
}

TEST_P(AttentionTargetTest, DecodeMatchesReferenceForEveryShapeAndDtype) {
  uint32_t seed = 1;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kInt8, DType::kFP8E4M3, DType::kFP8E5M2}) {
    for (Shape s : {Shape{4, 4, 64}, Shape{8, 2, 128}, Shape{16, 2, 80}, Shape{8, 1, 96}, Shape{4, 2, 256},
                    Shape{8, 4, 8}, Shape{6, 3, 13}}) {
      CheckDecode(s, dtype, 16, {}, seed++);
    }
  }
}

// bf16 K/V through AVX-512 BF16 dot products (where the CPU has them) and
// through widening to f32: both at f32 accuracy against the reference, which
// reads the same stored bf16 values. Groups of 1 to 8 rows (and 6: a pass of
// four then one of two), head_dims that are and are not multiples of 32 (80:
// the widening path), odd and even token counts, one token, block edges.
TEST_P(AttentionTargetTest, DecodeBf16DotProductsKeepF32Accuracy) {
  uint32_t seed = 70;
  for (bool dot : {true, false}) {
    const bool cpu_has = kernels::SetBf16DotForTest(dot);
    if (dot && !cpu_has) continue;  // only the widening path exists here
    for (int32_t block_len : {16, 128}) {
      for (Shape s : {Shape{4, 4, 64}, Shape{8, 2, 128}, Shape{8, 1, 128}, Shape{12, 2, 64}, Shape{6, 2, 96},
                      Shape{4, 2, 256}, Shape{16, 2, 80}, Shape{2, 1, 32}}) {
        CheckDecode(s, DType::kBF16, block_len, {}, seed++, 2e-5);
      }
    }
  }
  kernels::ClearBf16DotForTest();
}

// bf16 and f16 K/V through AMX tiles (kernels/amx_attention.cc, where the
// CPU has AMX-BF16; AVX-512 targets only; f16 rows split into exact bf16 hi
// + lo as they are read) and through the vector kernel: both at f32
// accuracy against the reference. Groups of 8 to 32 rows (one and two tile
// groups, rows that do not fill a tile), head_dims 32 to 256, block_len 16
// (updates over several blocks, a step over two), 32, 64 and 128, decode
// over every context edge and causal prefill with trailing chunks (f16 from
// 16 rows, where the tiles start for it); with
// AMX, the outputs must also differ in some bit from the vector kernel's
// (the tiles did run).
TEST_P(AttentionTargetTest, Bf16AndF16ThroughAmxTilesKeepF32Accuracy) {
  const bool avx512 = kernels::TargetName(GetParam()).rfind("AVX3", 0) == 0;
  if (!kernels::SetAmxForTest(true) || !avx512) {
    GTEST_SKIP() << "AMX-BF16 tiles not used here: the CPU or kernel lacks them or the target is "
                 << kernels::TargetName(GetParam()) << " (the vector kernel is tested by the other cases)";
  }
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    uint32_t seed = dtype == DType::kBF16 ? 300 : 500;
    // f16 takes the tiles from 16 rows (kMinRowsF16), bf16 from 8.
    const std::vector<std::pair<Shape, int32_t>> cases =
        dtype == DType::kBF16
            ? std::vector<std::pair<Shape, int32_t>>{{{8, 1, 128}, 16}, {{16, 2, 64}, 16}, {{32, 1, 128}, 32},
                                                     {{12, 1, 256}, 64}, {{64, 8, 128}, 128}, {{8, 1, 32}, 128}}
            : std::vector<std::pair<Shape, int32_t>>{{{16, 1, 128}, 16}, {{32, 2, 64}, 16}, {{24, 1, 128}, 32},
                                                     {{16, 1, 256}, 64}, {{128, 8, 128}, 128}, {{16, 1, 32}, 128}};
    for (const auto& [s, bl] : cases) {
      for (bool amx : {true, false}) {
        kernels::SetAmxForTest(amx);
        CheckDecode(s, dtype, bl, {}, seed, 2e-5);
      }
      // Same inputs, both paths: they must not be bit-identical.
      const std::vector<int64_t> lengths = {3 * bl + 5};
      PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, bl, dtype, lengths, seed + 1000);
      const DecodeSeq seq{f.Table(0), lengths[0]};
      const std::vector<float> q = RandomQ(f.rng(), static_cast<size_t>(s.q_heads) * s.head_dim);
      std::vector<float> with(q.size()), without(q.size());
      kernels::SetAmxForTest(true);
      ASSERT_TRUE(PagedDecodeAttention(f.Kv(0), {&seq, 1}, q.data(), with.data()).ok());
      kernels::SetAmxForTest(false);
      ASSERT_TRUE(PagedDecodeAttention(f.Kv(0), {&seq, 1}, q.data(), without.data()).ok());
      EXPECT_NE(std::memcmp(with.data(), without.data(), with.size() * sizeof(float)), 0)
          << "the AMX path did not run for q_heads=" << s.q_heads << " kv_heads=" << s.kv_heads;
      ++seed;
    }
    // Causal prefill: 8 query heads over 1 KV head, whole prompts and a
    // trailing chunk, rows per task far above one tile group.
    for (int32_t bl : {16, 128}) {
      for (bool amx : {true, false}) {
        kernels::SetAmxForTest(amx);
        CheckPrefill({8, 1, 128}, dtype, bl, {bl + 3, 3 * bl + 7}, {bl + 3, 2 * bl + 1}, 400 + bl, 1, 2e-5,
                     amx ? "AMX tiles" : "vector kernel");
      }
    }
  }
  kernels::SetAmxForTest(true);
}

TEST_P(AttentionTargetTest, DecodeSplitIntoChunksMergesExactly) {
  AttentionOptions opts;
  opts.split_tokens = 16;  // every block its own chunk
  opts.num_threads = 2;
  CheckDecode({8, 2, 64}, DType::kF16, 16, opts, 11);
  opts.split_tokens = 48;  // chunks of three blocks
  CheckDecode({8, 1, 128}, DType::kBF16, 16, opts, 12);
  opts.split_tokens = 1;   // rounded up to one block
  CheckDecode({4, 4, 32}, DType::kF32, 16, opts, 13);
}

TEST_P(AttentionTargetTest, DecodeWithScaleAndSoftcap) {
  AttentionOptions opts;
  opts.scale = 0.5f;
  opts.softcap = 5.0f;
  CheckDecode({8, 2, 64}, DType::kF32, 16, opts, 21);
}

TEST_P(AttentionTargetTest, DecodeWithLargeBlocks) {
  CheckDecode({32, 8, 128}, DType::kF16, 128, {}, 31);
}

TEST_P(AttentionTargetTest, ChunkedPrefillSplitAtEveryPositionOfABlockMatchesReference) {
  const int32_t bl = 16;
  const Shape s{8, 2, 32};
  const int64_t prompt = 2 * bl + 5;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kInt8, DType::kFP8E4M3, DType::kFP8E5M2}) {
    PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, bl, dtype, {prompt}, 40 + static_cast<uint32_t>(dtype));
    const size_t per_query = static_cast<size_t>(s.q_heads) * s.head_dim;
    std::vector<float> q = RandomQ(f.rng(), per_query * prompt);
    std::vector<double> qd(q.begin(), q.end());
    const std::vector<double> ref = testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, qd,
                                                                prompt, f.K(0, 0), f.V(0, 0), prompt);
    for (int64_t split = 1; split <= bl; ++split) {
      std::vector<float> out(q.size(), std::nanf(""));
      // Chunk 1: tokens [0, split); chunk 2: [split, prompt).
      PrefillSeq first{f.Table(0), split, split};
      ASSERT_TRUE(PagedPrefillAttention(f.Kv(0), {&first, 1}, q.data(), out.data()).ok());
      PrefillSeq second{f.Table(0), prompt, prompt - split};
      ASSERT_TRUE(PagedPrefillAttention(f.Kv(0), {&second, 1}, q.data() + split * per_query,
                                        out.data() + split * per_query).ok());
      const double err = testing::MaxRowRelError(out.data(), ref, prompt * s.q_heads, s.head_dim);
      EXPECT_LE(err, Tolerance(dtype)) << DTypeName(dtype) << " split at " << split;
    }
  }
}

// Sliding windows: every query sees only its last `window` positions; the
// table entries of blocks wholly before the window point at a block of NaN
// (a hybrid cache has freed them), so reading one fails the comparison.
TEST_P(AttentionTargetTest, SlidingWindowMatchesReferenceAndNeverReadsBlocksBeforeIt) {
  const int32_t bl = 16;
  const std::vector<int64_t> lengths = {1, bl - 1, bl, bl + 1, 5 * bl + 3, 200};
  uint32_t seed = 300;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kInt8, DType::kFP8E4M3, DType::kFP8E5M2}) {
    for (Shape s : {Shape{8, 8, 32}, Shape{8, 2, 64}, Shape{16, 2, 32}}) {
      PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, bl, dtype, lengths, ++seed);
      const size_t per_query = static_cast<size_t>(s.q_heads) * s.head_dim;
      for (int64_t window : {int64_t{1}, int64_t{7}, int64_t{bl}, int64_t{bl + 1}, int64_t{40}}) {
        // Decode, in one call (chunks of two blocks for the long ones).
        std::vector<std::vector<BlockId>> tables;
        std::vector<DecodeSeq> seqs;
        for (size_t i = 0; i < lengths.size(); ++i) {
          std::vector<BlockId> t(f.Table(i).begin(), f.Table(i).end());
          const int64_t first = std::max<int64_t>(0, lengths[i] - window);
          for (int64_t b = 0; b < first / bl; ++b) t[static_cast<size_t>(b)] = f.PoisonBlock();
          tables.push_back(std::move(t));
        }
        for (size_t i = 0; i < lengths.size(); ++i) {
          DecodeSeq d{tables[i], lengths[i]};
          d.window = window;
          seqs.push_back(d);
        }
        std::vector<float> q = RandomQ(f.rng(), per_query * lengths.size());
        std::vector<float> out(q.size(), std::nanf(""));
        AttentionOptions opts;
        opts.split_tokens = 2 * bl;
        opts.num_threads = 2;
        Status st = PagedDecodeAttention(f.Kv(0), seqs, q.data(), out.data(), opts);
        ASSERT_TRUE(st.ok()) << st.ToString();
        for (size_t i = 0; i < lengths.size(); ++i) {
          std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_query),
                                 q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_query));
          testing::ReferenceShape rs{s.q_heads, s.kv_heads, s.head_dim, 0, 0, window};
          const std::vector<double> ref = testing::ReferenceAttention(rs, qd, 1, f.K(i, 0), f.V(i, 0), lengths[i]);
          EXPECT_LE(testing::MaxRowRelError(out.data() + i * per_query, ref, s.q_heads, s.head_dim), Tolerance(dtype))
              << "decode " << DTypeName(dtype) << " G=" << s.q_heads / s.kv_heads << " window " << window
              << " context " << lengths[i];
        }
        // Chunked prefill of the 200-token sequence, split in two at several
        // points; each call's table is poisoned before its first query's window.
        const size_t last = lengths.size() - 1;
        const int64_t n = lengths[last];
        std::vector<float> pq = RandomQ(f.rng(), per_query * static_cast<size_t>(n));
        std::vector<double> pqd(pq.begin(), pq.end());
        testing::ReferenceShape rs{s.q_heads, s.kv_heads, s.head_dim, 0, 0, window};
        const std::vector<double> ref = testing::ReferenceAttention(rs, pqd, n, f.K(last, 0), f.V(last, 0), n);
        for (int64_t split : {int64_t{1}, int64_t{23}, int64_t{bl * 5}, n - 1}) {
          std::vector<float> out2(pq.size(), std::nanf(""));
          for (const auto& [from, to] : {std::pair{int64_t{0}, split}, std::pair{split, n}}) {
            std::vector<BlockId> t(f.Table(last).begin(), f.Table(last).end());
            for (int64_t b = 0; b < std::max<int64_t>(0, from + 1 - window) / bl; ++b) t[static_cast<size_t>(b)] = f.PoisonBlock();
            PrefillSeq p{t, to, to - from};
            p.window = window;
            st = PagedPrefillAttention(f.Kv(0), {&p, 1}, pq.data() + from * per_query, out2.data() + from * per_query,
                                       opts);
            ASSERT_TRUE(st.ok()) << st.ToString();
          }
          EXPECT_LE(testing::MaxRowRelError(out2.data(), ref, n * s.q_heads, s.head_dim), Tolerance(dtype))
              << "prefill " << DTypeName(dtype) << " G=" << s.q_heads / s.kv_heads << " window " << window
              << " split at " << split;
        }
      }
    }
  }
}

TEST_P(AttentionTargetTest, PrefillBatchOfDifferentLengthsAndGroups) {
  const int32_t bl = 16;
  for (Shape s : {Shape{4, 4, 64}, Shape{8, 2, 128}, Shape{16, 2, 16}, Shape{8, 1, 24}}) {
    // Full prompts and trailing chunks.
    CheckPrefill(s, DType::kF16, bl, {1, bl, bl + 1, 3 * bl + 7}, {1, bl, 5, 3 * bl + 7}, 50, 2, 2e-3, "f16 batch");
  }
}

// Attention weights for token eviction: summed over the group and the scored
// queries, against the reference's; starting from a non-zero buffer proves
// they are added, not written. Each weight is a probability, so the absolute
// tolerance is that of the outputs.
void CheckWeights(const std::vector<double>& ref, const std::vector<float>& got, float base, double tol,
                  const std::string& what) {
  ASSERT_EQ(ref.size(), got.size());
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::fabs(got[i] - base - ref[i]));
  EXPECT_LE(worst, tol) << what;
}

// INT4 KIVI, on every target: sealed groups read from the pool (keys per
// channel, values per row), the rest from the sequence's f16 tail; against
// the reference over the same decoded values. Lengths cover an empty tail,
// a one-token tail, a tail of all but one, and many blocks; decode with and
// without splitting, and prefill in chunks.
TEST_P(AttentionTargetTest, Int4KiviMatchesReferenceOverSealedGroupsAndTheTail) {
  const Shape s{8, 2, 64};
  const int32_t g = 16, bl = 32;
  const std::vector<int64_t> lengths = {1, 16, 17, 31, 32, 4 * 32 + 5};
  CacheConfig c;
  c.num_layers = 1;
  c.num_q_heads = s.q_heads;
  c.num_kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.block_len = bl;
  c.format = KvFormat::Int4Kivi(g);
  int64_t blocks = 0;
  for (int64_t n : lengths) blocks += (n + bl - 1) / bl;
  c.num_blocks = blocks;
  const KvLayout layout = *KvLayout::Create(c);
  std::vector<std::byte> arena(static_cast<size_t>(layout.total_bytes()));
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::vector<BlockId>> tables;
  std::vector<std::vector<std::byte>> tails;
  std::vector<std::vector<double>> ks, vs;  // [token][head][dim] as the kernel must see them
  int32_t next = static_cast<int32_t>(blocks) - 1;  // tables run backwards through the pool
  const int32_t d = s.head_dim;
  for (int64_t n : lengths) {
    std::vector<BlockId> table;
    for (int64_t b = 0; b < (n + bl - 1) / bl; ++b) table.push_back(BlockId{next--});
    std::vector<std::byte> tail(static_cast<size_t>(layout.tail_bytes_per_sequence()));
    std::vector<double> kd(static_cast<size_t>(n * s.kv_heads * d)), vd(kd.size());
    for (int32_t h = 0; h < s.kv_heads; ++h) {
      for (int64_t first = 0; first < n; first += g) {
        const int64_t rows = std::min<int64_t>(g, n - first);
        std::vector<float> kx(static_cast<size_t>(g * d)), vx(kx.size()), kb(kx.size()), vb(kx.size());
        for (float& x : kx) x = u(rng);
        for (float& x : vx) x = u(rng);
        for (int32_t i = 0; i < d; ++i) kx[static_cast<size_t>(i)] *= i == 5 ? 30.0f : 1.0f;  // an outlier channel
        if (rows == g) {  // sealed: into the block
          const int64_t block = ToInt(table[static_cast<size_t>(first / bl)]);
          std::byte* kg = arena.data() + layout.SlabOffset(0, 0, h, block) + (first % bl) / g * quant::Int4KeyGroupBytes(g, d);
          std::byte* vr = arena.data() + layout.SlabOffset(0, 1, h, block) + (first % bl) * quant::Int4ValueRowBytes(d);
          quant::EncodeInt4KeyGroup(kx.data(), g, d, kg);
          quant::DecodeInt4KeyGroup(kg, g, d, kb.data());
          for (int32_t t = 0; t < g; ++t) {
            quant::EncodeInt4ValueRow(vx.data() + t * d, d, vr + t * quant::Int4ValueRowBytes(d));
            quant::DecodeInt4ValueRow(vr + t * quant::Int4ValueRowBytes(d), d, vb.data() + t * d);
          }
        } else {  // the tail, in f16
          for (int64_t i = 0; i < rows * d; ++i) {
            const uint16_t hk = F32ToF16(kx[static_cast<size_t>(i)]), hv = F32ToF16(vx[static_cast<size_t>(i)]);
            std::memcpy(tail.data() + layout.TailOffset(0, 0, h) + 2 * i, &hk, 2);
            std::memcpy(tail.data() + layout.TailOffset(0, 1, h) + 2 * i, &hv, 2);
            kb[static_cast<size_t>(i)] = F16ToF32(hk);
            vb[static_cast<size_t>(i)] = F16ToF32(hv);
          }
        }
        for (int64_t t = 0; t < rows; ++t) {
          for (int32_t i = 0; i < d; ++i) {
            kd[static_cast<size_t>(((first + t) * s.kv_heads + h) * d + i)] = kb[static_cast<size_t>(t * d + i)];
            vd[static_cast<size_t>(((first + t) * s.kv_heads + h) * d + i)] = vb[static_cast<size_t>(t * d + i)];
          }
        }
      }
    }
    tables.push_back(std::move(table));
    tails.push_back(std::move(tail));
    ks.push_back(std::move(kd));
    vs.push_back(std::move(vd));
  }
  const PagedKv kv{&layout, arena.data(), 0};
  const size_t per_seq = static_cast<size_t>(s.q_heads) * d;
  std::vector<float> q = RandomQ(rng, per_seq * lengths.size());
  for (int64_t split : {int64_t{0}, int64_t{32}}) {
    std::vector<DecodeSeq> seqs;
    for (size_t i = 0; i < lengths.size(); ++i) seqs.push_back({tables[i], lengths[i], nullptr, tails[i].data()});
    std::vector<float> out(q.size(), std::nanf(""));
    AttentionOptions opts;
    opts.split_tokens = split;
    ASSERT_TRUE(PagedDecodeAttention(kv, seqs, q.data(), out.data(), opts).ok());
    for (size_t i = 0; i < lengths.size(); ++i) {
      std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_seq),
                             q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_seq));
      const std::vector<double> ref = testing::ReferenceAttention({s.q_heads, s.kv_heads, d, 0, 0}, qd, 1, ks[i], vs[i], lengths[i]);
      EXPECT_LE(testing::MaxRowRelError(out.data() + i * per_seq, ref, s.q_heads, d), 1e-4)
          << "context " << lengths[i] << " split " << split;
    }
  }
  // Sliding windows over sealed groups and the tail; blocks wholly before
  // the window are kNoBlock (reading one would fault, or fail under ASan).
  for (int64_t window : {int64_t{5}, int64_t{20}, int64_t{33}}) {
    std::vector<std::vector<BlockId>> cut_tables;
    std::vector<DecodeSeq> seqs;
    for (size_t i = 0; i < lengths.size(); ++i) {
      std::vector<BlockId> t = tables[i];
      for (int64_t b = 0; b < std::max<int64_t>(0, lengths[i] - window) / bl; ++b) t[static_cast<size_t>(b)] = kNoBlock;
      cut_tables.push_back(std::move(t));
    }
    for (size_t i = 0; i < lengths.size(); ++i) {
      DecodeSeq sq{cut_tables[i], lengths[i], nullptr, tails[i].data()};
      sq.window = window;
      seqs.push_back(sq);
    }
    std::vector<float> out(q.size(), std::nanf(""));
    ASSERT_TRUE(PagedDecodeAttention(kv, seqs, q.data(), out.data()).ok());
    for (size_t i = 0; i < lengths.size(); ++i) {
      std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_seq),
                             q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_seq));
      const std::vector<double> ref =
          testing::ReferenceAttention({s.q_heads, s.kv_heads, d, 0, 0, window}, qd, 1, ks[i], vs[i], lengths[i]);
      EXPECT_LE(testing::MaxRowRelError(out.data() + i * per_seq, ref, s.q_heads, d), 1e-4)
          << "context " << lengths[i] << " window " << window;
    }
  }
  // Prefill of the longest sequence in two chunks (split inside a group).
  const size_t last = lengths.size() - 1;
  const int64_t n = lengths[last];
  std::vector<float> pq = RandomQ(rng, per_seq * static_cast<size_t>(n)), pout(pq.size(), std::nanf(""));
  const int64_t cut = 40;
  // The first chunk sees a cache of `cut` tokens: its groups up to 32 sealed, 32..39 in the tail.
  std::vector<std::byte> cut_tail(tails[last].size());
  for (int32_t h = 0; h < s.kv_heads; ++h) {
    for (int32_t p = 0; p < 2; ++p) {
      for (int64_t t = 0; t < cut - 32; ++t) {
        for (int32_t i = 0; i < d; ++i) {
          const double x = (p == 0 ? ks : vs)[last][static_cast<size_t>(((32 + t) * s.kv_heads + h) * d + i)];
          const uint16_t hx = F32ToF16(static_cast<float>(x));
          std::memcpy(cut_tail.data() + layout.TailOffset(0, p, h) + 2 * (t * d + i), &hx, 2);
        }
      }
    }
  }
  PrefillSeq first{tables[last], cut, cut, nullptr, 0, cut_tail.data()};
  ASSERT_TRUE(PagedPrefillAttention(kv, {&first, 1}, pq.data(), pout.data()).ok());
  PrefillSeq second{tables[last], n, n - cut, nullptr, 0, tails[last].data()};
  ASSERT_TRUE(PagedPrefillAttention(kv, {&second, 1}, pq.data() + cut * per_seq, pout.data() + cut * per_seq).ok());
  std::vector<double> pqd(pq.begin(), pq.end());
  const std::vector<double> pref = testing::ReferenceAttention({s.q_heads, s.kv_heads, d, 0, 0}, pqd, n, ks[last], vs[last], n);
  EXPECT_LE(testing::MaxRowRelError(pout.data() + cut * per_seq, std::vector<double>(pref.begin() + static_cast<std::ptrdiff_t>(cut * per_seq), pref.end()),
                     (n - cut) * s.q_heads, d), 1e-4);
  // Tokens 32..39 are in the pool for the second chunk but the tail for the
  // first: the first chunk's rows 32..39 of the reference used the decoded
  // group values, so compare only its queries before 32.
  EXPECT_LE(testing::MaxRowRelError(pout.data(), pref, 32 * s.q_heads, d), 1e-4);
  // A KIVI layer without its tail, and with attention weights, is refused.
  DecodeSeq no_tail{tables[2], lengths[2]};
  std::vector<float> out(per_seq);
  EXPECT_EQ(PagedDecodeAttention(kv, {&no_tail, 1}, q.data(), out.data()).code(), StatusCode::kInvalidArgument);
  std::vector<float> w(static_cast<size_t>(s.kv_heads * lengths[2]));
  DecodeSeq weights{tables[2], lengths[2], w.data(), tails[2].data()};
  EXPECT_EQ(PagedDecodeAttention(kv, {&weights, 1}, q.data(), out.data()).code(), StatusCode::kUnimplemented);
}

// Hadamard-rotated int8 / fp8 rows: the kernel rotates the query and the
// output, so attention equals the reference over the unrotated values
// (H^T of each stored row), in decode (with and without the split merge)
// and in prefill.
TEST_P(AttentionTargetTest, HadamardRotatedRowsMatchReferenceOverTheUnrotatedValues) {
  for (DType dtype : {DType::kInt8, DType::kFP8E4M3}) {
    const Shape s{8, 2, 64};
    const std::vector<int64_t> lengths = {1, 16, 5 * 16 + 3};
    PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, 16, dtype, lengths, 81, {}, true);
    ASSERT_TRUE(f.layout().format(0).hadamard);
    const size_t per_seq = static_cast<size_t>(s.q_heads) * s.head_dim;
    std::vector<float> q = RandomQ(f.rng(), per_seq * lengths.size());
    for (int64_t split : {int64_t{0}, int64_t{16}}) {
      std::vector<DecodeSeq> seqs;
      for (size_t i = 0; i < lengths.size(); ++i) seqs.push_back({f.Table(i), lengths[i]});
      std::vector<float> out(q.size(), std::nanf(""));
      AttentionOptions opts;
      opts.split_tokens = split;
      ASSERT_TRUE(PagedDecodeAttention(f.Kv(0), seqs, q.data(), out.data(), opts).ok());
      for (size_t i = 0; i < lengths.size(); ++i) {
        std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_seq),
                               q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_seq));
        const std::vector<double> ref = testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, qd, 1,
                                                                    f.K(i, 0), f.V(i, 0), lengths[i]);
        EXPECT_LE(testing::MaxRowRelError(out.data() + i * per_seq, ref, s.q_heads, s.head_dim), 1e-4)
            << DTypeName(dtype) << " context " << lengths[i] << " split " << split;
      }
    }
    const int64_t n = lengths[2];
    std::vector<float> pq = RandomQ(f.rng(), per_seq * static_cast<size_t>(n)), pout(pq.size(), std::nanf(""));
    PrefillSeq p{f.Table(2), n, n};
    ASSERT_TRUE(PagedPrefillAttention(f.Kv(0), {&p, 1}, pq.data(), pout.data()).ok());
    std::vector<double> pqd(pq.begin(), pq.end());
    const std::vector<double> pref =
        testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, pqd, n, f.K(2, 0), f.V(2, 0), n);
    EXPECT_LE(testing::MaxRowRelError(pout.data(), pref, n * s.q_heads, s.head_dim), 1e-4) << DTypeName(dtype) << " prefill";
  }
}

// Per-layer formats: each layer's rows, slabs and strides follow its own
// format, and the kernels read each layer by its own.
TEST_P(AttentionTargetTest, EveryLayerOfAMixedFormatLayoutMatchesReference) {
  const Shape s{8, 2, 32};
  const std::vector<DType> layers = {DType::kF16, DType::kInt8, DType::kFP8E4M3, DType::kF32, DType::kBF16};
  const std::vector<int64_t> lengths = {1, 16, 3 * 16 + 5};
  PagedFixture f(5, s.q_heads, s.kv_heads, s.head_dim, 16, DType::kF16, lengths, 61, layers);
  ASSERT_FALSE(f.layout().uniform());
  const size_t per_seq = static_cast<size_t>(s.q_heads) * s.head_dim;
  std::vector<float> q = RandomQ(f.rng(), per_seq * lengths.size());
  std::vector<DecodeSeq> seqs;
  for (size_t i = 0; i < lengths.size(); ++i) seqs.push_back({f.Table(i), lengths[i]});
  for (int32_t l = 0; l < 5; ++l) {
    std::vector<float> out(q.size(), std::nanf(""));
    ASSERT_TRUE(PagedDecodeAttention(f.Kv(l), seqs, q.data(), out.data()).ok());
    for (size_t i = 0; i < lengths.size(); ++i) {
      std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_seq),
                             q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_seq));
      const std::vector<double> ref = testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, qd, 1,
                                                                  f.K(i, l), f.V(i, l), lengths[i]);
      EXPECT_LE(testing::MaxRowRelError(out.data() + i * per_seq, ref, s.q_heads, s.head_dim), Tolerance(layers[static_cast<size_t>(l)]))
          << "layer " << l << " (" << DTypeName(layers[static_cast<size_t>(l)]) << ") context " << lengths[i];
    }
  }
}

TEST_P(AttentionTargetTest, DecodeAttentionWeightsMatchReference) {
  for (int64_t split : {int64_t{0}, int64_t{16}}) {  // one task per head, and every block its own chunk
    for (DType dtype : {DType::kF32, DType::kF16, DType::kInt8}) {
      const Shape s{8, 2, 32};
      const std::vector<int64_t> lengths = {1, 17, 5 * 16 + 3};
      PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, 16, dtype, lengths, 70 + static_cast<uint32_t>(split));
      const size_t per_seq = static_cast<size_t>(s.q_heads) * s.head_dim;
      std::vector<float> q = RandomQ(f.rng(), per_seq * lengths.size()), out(q.size());
      std::vector<std::vector<float>> w;
      std::vector<DecodeSeq> seqs;
      for (size_t i = 0; i < lengths.size(); ++i) w.emplace_back(static_cast<size_t>(s.kv_heads * lengths[i]), 0.25f);
      for (size_t i = 0; i < lengths.size(); ++i) {
        seqs.push_back({f.Table(i), lengths[i], i == 1 ? nullptr : w[i].data()});  // one unscored in the batch
      }
      AttentionOptions opts;
      opts.split_tokens = split;
      opts.softcap = 8.0f;
      ASSERT_TRUE(PagedDecodeAttention(f.Kv(0), seqs, q.data(), out.data(), opts).ok());
      for (size_t i = 0; i < lengths.size(); ++i) {
        if (i == 1) {
          for (float x : w[i]) ASSERT_EQ(x, 0.25f);
          continue;
        }
        std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_seq),
                               q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_seq));
        std::vector<double> ref_w;
        testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 8.0}, qd, 1, f.K(i, 0), f.V(i, 0),
                                    lengths[i], &ref_w);
        CheckWeights(ref_w, w[i], 0.25f, 4 * Tolerance(dtype),
                     std::string(DTypeName(dtype)) + " context " + std::to_string(lengths[i]) + " split " +
                         std::to_string(split));
      }
    }
  }
}

TEST_P(AttentionTargetTest, PrefillAttentionWeightsOfTheLastQueriesMatchReference) {
  const Shape s{8, 2, 16};
  const int64_t prompt = 3 * 16 + 7;  // with G = 4, tiles of 16 queries: several tiles share a head
  // block_len 64: a block spans several of the lanes kernel's 16-token
  // sub-blocks, whose weights are rescaled to the block's max at its end.
  for (const auto& [window, block_len] : {std::pair<int64_t, int32_t>{0, 16}, {1, 16}, {20, 16}, {0, 64}, {20, 64}}) {
    PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, block_len, DType::kF32, {prompt}, 90);
    const size_t per_query = static_cast<size_t>(s.q_heads) * s.head_dim;
    std::vector<float> q = RandomQ(f.rng(), per_query * prompt), out(q.size());
    std::vector<float> w(static_cast<size_t>(s.kv_heads * prompt), 0.0f);
    PrefillSeq p{f.Table(0), prompt, prompt, w.data(), window};
    AttentionOptions opts;
    opts.num_threads = 2;
    ASSERT_TRUE(PagedPrefillAttention(f.Kv(0), {&p, 1}, q.data(), out.data(), opts).ok());
    std::vector<double> qd(q.begin(), q.end()), ref_w;
    testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, qd, prompt, f.K(0, 0), f.V(0, 0), prompt,
                                &ref_w, window);
    CheckWeights(ref_w, w, 0.0f, 1e-4, "window " + std::to_string(window) + ", block_len " + std::to_string(block_len));
    // Every scored query's weights sum to 1 per query head: G * (queries) per KV head.
    double total = 0;
    for (float x : w) total += x;
    EXPECT_NEAR(total, static_cast<double>(s.q_heads) * (window == 0 ? prompt : window), 1e-3);
  }
  PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, 16, DType::kF32, {prompt}, 91);
  std::vector<float> q(static_cast<size_t>(s.q_heads * s.head_dim * prompt)), out(q.size()),
      w(static_cast<size_t>(s.kv_heads * prompt));
  PrefillSeq bad{f.Table(0), prompt, 4, w.data(), 5};
  EXPECT_EQ(PagedPrefillAttention(f.Kv(0), {&bad, 1}, q.data(), out.data()).code(), StatusCode::kInvalidArgument);
}

std::string TargetName(const ::testing::TestParamInfo<int64_t>& info) { return kernels::TargetName(info.param); }

INSTANTIATE_TEST_SUITE_P(EveryTarget, AttentionTargetTest, ::testing::ValuesIn(kernels::SupportedTargets()),
                         TargetName);

TEST(AttentionTest, ForcingATargetChangesTheDispatch) {
  const std::vector<int64_t> targets = kernels::SupportedTargets();
  ASSERT_GE(targets.size(), 2u) << "expected at least one SIMD target besides scalar";
  std::vector<std::string> names;
  for (int64_t t : targets) {
    kernels::SetTargetForTest(t);
    names.push_back(kernels::DispatchedTargetName());
  }
  kernels::SetTargetForTest(0);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end());
}

class AttentionBadInputTest : public ::testing::Test {
 protected:
  AttentionBadInputTest() : f_(2, 8, 2, 16, 16, DType::kF32, {20}, 7) {}
  PagedFixture f_;
  std::vector<float> q_ = std::vector<float>(8 * 16 * 20), out_ = std::vector<float>(8 * 16 * 20);
};

TEST_F(AttentionBadInputTest, ShortBlockTableIsAnError) {
  DecodeSeq s{f_.Table(0).subspan(0, 1), 20};
  Status st = PagedDecodeAttention(f_.Kv(0), {&s, 1}, q_.data(), out_.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("needs 2"), std::string::npos) << st.message();
}

TEST_F(AttentionBadInputTest, BlockIdOutsideThePoolIsAnError) {
  std::vector<BlockId> table = {f_.Table(0)[0], BlockId{9999}};
  DecodeSeq s{table, 20};
  EXPECT_EQ(PagedDecodeAttention(f_.Kv(0), {&s, 1}, q_.data(), out_.data()).code(), StatusCode::kInvalidArgument);
  PrefillSeq p{table, 20, 20};
  EXPECT_EQ(PagedPrefillAttention(f_.Kv(0), {&p, 1}, q_.data(), out_.data()).code(), StatusCode::kInvalidArgument);
}

TEST_F(AttentionBadInputTest, SlidingWindowTablesAndArguments) {
  // 20 tokens, window 3: block 0 is wholly before the window and may be
  // kNoBlock; block 1 may not.
  std::vector<BlockId> table = {kNoBlock, f_.Table(0)[1]};
  DecodeSeq s{table, 20};
  EXPECT_EQ(PagedDecodeAttention(f_.Kv(0), {&s, 1}, q_.data(), out_.data()).code(), StatusCode::kInvalidArgument);
  s.window = 3;
  EXPECT_TRUE(PagedDecodeAttention(f_.Kv(0), {&s, 1}, q_.data(), out_.data()).ok());
  PrefillSeq p{table, 20, 2};
  p.window = 3;
  EXPECT_TRUE(PagedPrefillAttention(f_.Kv(0), {&p, 1}, q_.data(), out_.data()).ok());
  p.num_queries = 4;  // the first query (position 16) sees from 14: block 0
  EXPECT_EQ(PagedPrefillAttention(f_.Kv(0), {&p, 1}, q_.data(), out_.data()).code(), StatusCode::kInvalidArgument);
  s.window = -1;
  Status st = PagedDecodeAttention(f_.Kv(0), {&s, 1}, q_.data(), out_.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("window"), std::string::npos) << st.message();
  std::vector<float> scores(2 * 20);
  DecodeSeq scored{f_.Table(0), 20, scores.data()};
  scored.window = 3;
  EXPECT_EQ(PagedDecodeAttention(f_.Kv(0), {&scored, 1}, q_.data(), out_.data()).code(), StatusCode::kUnimplemented);
}

TEST_F(AttentionBadInputTest, NullArenaLayerOutOfRangeAndEmptySequence) {
  DecodeSeq s{f_.Table(0), 20};
  PagedKv kv = f_.Kv(0);
  kv.arena = nullptr;
  EXPECT_EQ(PagedDecodeAttention(kv, {&s, 1}, q_.data(), out_.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PagedDecodeAttention(f_.Kv(2), {&s, 1}, q_.data(), out_.data()).code(), StatusCode::kOutOfRange);
  DecodeSeq empty{f_.Table(0), 0};
  EXPECT_EQ(PagedDecodeAttention(f_.Kv(0), {&empty, 1}, q_.data(), out_.data()).code(), StatusCode::kInvalidArgument);
  PrefillSeq too_many{f_.Table(0), 20, 21};
  EXPECT_EQ(PagedPrefillAttention(f_.Kv(0), {&too_many, 1}, q_.data(), out_.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PagedDecodeAttention(f_.Kv(0), {&s, 1}, nullptr, out_.data()).code(), StatusCode::kInvalidArgument);
}

// An MLA latent cache is read as one "KV head" (the latent row, both key and
// value) shared by every query head, q and out in latent space: the same as
// MQA over those rows (the absorbed form's inner step; mla_attention_test.cc
// checks the whole absorbed attention against the unabsorbed formula).
TEST(AttentionMlaTest, AnMlaLayoutIsOneLatentRowSharedByEveryQueryHead) {
  CacheConfig c;
  c.kind = CacheKind::kMla;
  c.num_layers = 1;
  c.num_q_heads = 4;
  c.kv_lora_rank = 16;
  c.rope_dim = 4;
  c.block_len = 8;
  c.num_blocks = 4;
  c.format = KvFormat::Plain(DType::kF32);
  KvLayout l = *KvLayout::Create(c);
  struct alignas(64) Line { std::byte b[64]; };
  std::vector<Line> lines(static_cast<size_t>(l.total_bytes() / 64 + 1));
  std::byte* arena = reinterpret_cast<std::byte*>(lines.data());
  const std::vector<BlockId> table = {BlockId{2}, BlockId{0}};
  const int64_t n = 11;
  const int32_t row = 20;
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<double> kv;
  for (int64_t t = 0; t < n; ++t) {
    float* dst = reinterpret_cast<float*>(arena + l.RowOffset(0, 0, 0, ToInt(table[static_cast<size_t>(t / 8)]),
                                                              static_cast<int32_t>(t % 8)));
    for (int32_t x = 0; x < row; ++x) {
      dst[x] = u(rng);
      kv.push_back(dst[x]);
    }
  }
  std::vector<float> q = RandomQ(rng, 4 * row);
  std::vector<float> out(4 * row, std::nanf(""));
  DecodeSeq s{table, n};
  ASSERT_TRUE(PagedDecodeAttention({&l, arena, 0}, {&s, 1}, q.data(), out.data()).ok());
  testing::ReferenceShape shape{4, 1, row, 0, 0};  // 1 / sqrt(rank + rope): no per-head dim given
  const std::vector<double> ref =
      testing::ReferenceAttention(shape, std::vector<double>(q.begin(), q.end()), 1, kv, kv, n);
  EXPECT_LE(testing::MaxRowRelError(out.data(), ref, 4, row), 1e-5);
}

}  // namespace
}  // namespace pagekv
