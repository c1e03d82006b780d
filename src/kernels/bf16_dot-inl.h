// bf16 K and V through AVX-512 BF16's `vdpbf16ps` (two bf16 products summed
// into each f32 lane), for the decode kernel's score and accumulation tiles.
// Compiled into the AVX-512 targets only and used where the CPU has the
// instructions (Zen 4, Sapphire Rapids and later); elsewhere the kernel
// widens bf16 to f32 and runs FMAs.
//
// Why: at G = 8 the widening takes FMA slots (about one cycle per vector on
// Zen 4, docs/PERFORMANCE.md), and bf16 values need none here: `vdpbf16ps`
// reads them as they are stored. Accuracy: the other operand (q for the
// scores, the probabilities for P.V) is f32; it is split into a bf16 high
// part and a bf16 remainder, x = hi + lo, and both go through the
// instruction. Products of two bf16 are exact in f32 and the sums are f32,
// so the result differs from f32 FMAs over the widened values only by
// x - hi - lo (under 2^-16 |x|) and the order of the additions.
//
// P.V pairs tokens: rows t and t + 1 interleaved 16 bits at a time within
// each 128-bit block (`vpunpck[lh]wd`), so one lane's pair is the same
// dimension of both tokens and the broadcast operand is (p_t, p_t+1). Per 32
// dimensions the low interleave covers dimensions {0-3, 8-11, 16-19, 24-27}
// and the high one the other 16: the accumulators hold that order and are
// permuted from and back to natural order at a tile's load and store.
//
// Include from a file that includes <hwy/foreach_target.h>, after
// kernels/kv_rows-inl.h and kernels/simd-inl.h.
#if defined(PAGEKV_KERNELS_BF16_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_BF16_DOT_INL_H_
#undef PAGEKV_KERNELS_BF16_DOT_INL_H_
#else
#define PAGEKV_KERNELS_BF16_DOT_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>

#include "kernels/kv_rows-inl.h"
#include "kernels/simd-inl.h"

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// The target's own features plus AVX-512 BF16: Highway's functions (a
// subset) still inline into these. The target's string is repeated because
// clang's attribute replaces the one Highway's pragma applies (GCC adds).
#undef PAGEKV_BF16_DOT_ATTR
#define PAGEKV_BF16_DOT_ATTR __attribute__((target(HWY_TARGET_STR ",avx512bf16")))

namespace bf16dot {

// Dimensions per instruction (32 bf16 in a 512-bit register).
constexpr int32_t kDims = 32;
// Probability pairs per row in PairedProbs (a compile-time stride, so one
// pointer with constant offsets reaches every row).
constexpr int32_t kPairStride = kMaxBlockLen / 2;

PAGEKV_BF16_DOT_ATTR HWY_INLINE __m512bh LoadBh(const void* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// hi = x with its low 16 bits cleared (exact in bf16), lo = x - hi (exact in
// f32) rounded to bf16: 32 values of x in, their bf16 hi and lo parts out in
// the same order.
PAGEKV_BF16_DOT_ATTR HWY_INLINE void Split32(__m512 x0, __m512 x1, uint16_t* hi, uint16_t* lo) {
  const __m512i mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x0), mask));
  const __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x1), mask));
  // cvtne2ps(a, b): b's 16 values in the low half, a's in the high half.
  _mm512_storeu_si512(hi, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(h1, h0)));
  _mm512_storeu_si512(lo, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0))));
}

// q's rows ([rows][d] f32, d a multiple of 32) split into bf16 hi and lo.
PAGEKV_BF16_DOT_ATTR inline void SplitRows(const float* q, int32_t rows, int32_t d, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < int64_t{rows} * d; i += kDims) {
    Split32(_mm512_loadu_ps(q + i), _mm512_loadu_ps(q + i + 16), hi + i, lo + i);
  }
}

// Probabilities of kG rows (p[g * stride + t], t < n) as (p_t, p_t+1) pairs
// of bf16 hi and lo parts: pair i of row g at [g * kPairStride + i], token
// 2i in the low 16 bits. Tokens at or past n read as 0.
template <int kG>
PAGEKV_BF16_DOT_ATTR HWY_INLINE void PairedProbs(const float* p, int32_t stride, int64_t n, uint32_t* hi, uint32_t* lo) {
  for (int g = 0; g < kG; ++g) {
    for (int64_t t = 0; t < n; t += kDims) {
      const int64_t left = n - t;
      const __mmask16 m0 = left >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m1 = left >= 32 ? __mmask16{0xFFFF} : left <= 16 ? __mmask16{0} : static_cast<__mmask16>((1u << (left - 16)) - 1);
      const float* src = p + g * stride + t;
      Split32(_mm512_maskz_loadu_ps(m0, src), _mm512_maskz_loadu_ps(m1, src + 16),
              reinterpret_cast<uint16_t*>(hi + g * kPairStride + t / 2),
              reinterpret_cast<uint16_t*>(lo + g * kPairStride + t / 2));
    }
  }
}

// scores[g][t0 + i] = q[g] . k[t0 + i] for kG rows and kT tokens.
template <int kG, int kT>
PAGEKV_BF16_DOT_ATTR HWY_INLINE void ScoreTile(const std::byte* HWY_RESTRICT k, int64_t row_bytes, int64_t t0, int32_t d,
                                               const uint16_t* HWY_RESTRICT qhi, const uint16_t* HWY_RESTRICT qlo,
                                               float* HWY_RESTRICT scores, int32_t stride) {
  __m512 a[kG][kT];
  for (int g = 0; g < kG; ++g)
    for (int i = 0; i < kT; ++i) a[g][i] = _mm512_setzero_ps();
  for (int32_t j = 0; j < d; j += kDims) {
    __m512bh kv[kT];
    for (int i = 0; i < kT; ++i) kv[i] = LoadBh(k + (t0 + i) * row_bytes + 2 * j);
    for (int g = 0; g < kG; ++g) {
      const __m512bh h = LoadBh(qhi + g * d + j);
      const __m512bh l = LoadBh(qlo + g * d + j);
      for (int i = 0; i < kT; ++i) a[g][i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g][i], h, kv[i]), l, kv[i]);
    }
  }
  const hn::ScalableTag<float> df;
  using V = hn::Vec<decltype(df)>;
  if constexpr ((kG * kT) % 4 == 0) {
    const __m512* flat = &a[0][0];  // index g * kT + i
    for (int x = 0; x < kG * kT; x += 4) {
      float sums[4];
      Sum4(df, V{flat[x]}, V{flat[x + 1]}, V{flat[x + 2]}, V{flat[x + 3]}, sums);
      for (int y = 0; y < 4; ++y) scores[((x + y) / kT) * stride + t0 + (x + y) % kT] = sums[y];
    }
  } else {
    for (int g = 0; g < kG; ++g)
      for (int i = 0; i < kT; ++i) scores[g * stride + t0 + i] = _mm512_reduce_add_ps(a[g][i]);
  }
}

// Scores of kG rows over tokens [0, n), prefetching the next block's rows.
template <int kG>
PAGEKV_BF16_DOT_ATTR void ScoreRows(const std::byte* HWY_RESTRICT k, int64_t row_bytes, int64_t n, int32_t d,
                                    const uint16_t* HWY_RESTRICT qhi, const uint16_t* HWY_RESTRICT qlo,
                                    float* HWY_RESTRICT scores, int32_t stride, const Prefetcher& next) {
  constexpr int kT = 16 / kG;  // 16 accumulators
  int64_t t = 0;
  for (; t + kT <= n; t += kT) {
    for (int i = 0; i < kT; ++i) next.Row(t + i);
    ScoreTile<kG, kT>(k, row_bytes, t, d, qhi, qlo, scores, stride);
  }
  for (; t < n; ++t) {
    next.Row(t);
    ScoreTile<kG, 1>(k, row_bytes, t, d, qhi, qlo, scores, stride);
  }
}

// Natural order (dimensions 0-15, 16-31) to the interleaves' order and back.
PAGEKV_BF16_DOT_ATTR HWY_INLINE void ToPairOrder(__m512 n0, __m512 n1, __m512& lo, __m512& hi) {
  lo = _mm512_shuffle_f32x4(n0, n1, _MM_SHUFFLE(2, 0, 2, 0));  // blocks 0, 2 of each: dims 0-3, 8-11, 16-19, 24-27
  hi = _mm512_shuffle_f32x4(n0, n1, _MM_SHUFFLE(3, 1, 3, 1));
}
PAGEKV_BF16_DOT_ATTR HWY_INLINE void FromPairOrder(__m512 lo, __m512 hi, __m512& n0, __m512& n1) {
  const __m512 x = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));  // lo0 lo1 hi0 hi1
  const __m512 y = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
  n0 = _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(3, 1, 2, 0));  // lo0 hi0 lo1 hi1
  n1 = _mm512_shuffle_f32x4(y, y, _MM_SHUFFLE(3, 1, 2, 0));
}

// One pair of tokens (row r0 at `row`, its partner's chunks in r1) into the
// accumulators of AccumulateTile; phi / plo point at the pair's probabilities.
template <int kG, int kC>
PAGEKV_BF16_DOT_ATTR HWY_INLINE void PairStep(__m512 (&a)[kG][2 * kC], const std::byte* HWY_RESTRICT row,
                                              const __m512i (&r1)[kC], const uint32_t* phi, const uint32_t* plo) {
  __m512bh lo[kC], hi[kC];
  for (int x = 0; x < kC; ++x) {
    const __m512i r0 = _mm512_loadu_si512(row + x * 2 * kDims);
    lo[x] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(r0, r1[x]));
    hi[x] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(r0, r1[x]));
  }
  for (int g = 0; g < kG; ++g) {
    const auto ph = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(phi[g * kPairStride])));
    const auto pl = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(plo[g * kPairStride])));
    for (int x = 0; x < kC; ++x) {
      a[g][2 * x] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g][2 * x], ph, lo[x]), pl, lo[x]);
      a[g][2 * x + 1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g][2 * x + 1], ph, hi[x]), pl, hi[x]);
    }
  }
}

// acc[g][j0, j0 + 32 kC) = acc * corr[g] + sum_t p[g][t] v[t] for kG rows,
// tokens [0, n), kC chunks of 32 dimensions (2 kC accumulators per row).
template <int kG, int kC>
PAGEKV_BF16_DOT_ATTR HWY_INLINE void AccumulateTile(const std::byte* HWY_RESTRICT v, int64_t row_bytes, int64_t n,
                                                    int32_t d, int32_t j0, const uint32_t* HWY_RESTRICT phi,
                                                    const uint32_t* HWY_RESTRICT plo, const float* corr,
                                                    float* HWY_RESTRICT acc, const Prefetcher& next) {
  __m512 a[kG][2 * kC];
  for (int g = 0; g < kG; ++g) {
    const __m512 c = _mm512_set1_ps(corr[g]);
    for (int x = 0; x < kC; ++x) {
      const float* src = acc + g * d + j0 + x * kDims;
      ToPairOrder(_mm512_mul_ps(_mm512_loadu_ps(src), c), _mm512_mul_ps(_mm512_loadu_ps(src + 16), c), a[g][2 * x],
                  a[g][2 * x + 1]);
    }
  }
  const std::byte* col = v + 2 * int64_t{j0};
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    next.Row(t);
    next.Row(t + 1);
    __m512i r1[kC];
    for (int x = 0; x < kC; ++x) r1[x] = _mm512_loadu_si512(col + (t + 1) * row_bytes + x * 2 * kDims);
    PairStep<kG, kC>(a, col + t * row_bytes, r1, phi + t / 2, plo + t / 2);
  }
  if (t < n) {  // odd count: the last token paired with zeros (its partner's probability is 0 too)
    next.Row(t);
    __m512i r1[kC];
    for (int x = 0; x < kC; ++x) r1[x] = _mm512_setzero_si512();
    PairStep<kG, kC>(a, col + t * row_bytes, r1, phi + t / 2, plo + t / 2);
  }
  for (int g = 0; g < kG; ++g) {
    for (int x = 0; x < kC; ++x) {
      __m512 n0, n1;
      FromPairOrder(a[g][2 * x], a[g][2 * x + 1], n0, n1);
      float* dst = acc + g * d + j0 + x * kDims;
      _mm512_storeu_ps(dst, n0);
      _mm512_storeu_ps(dst + 16, n1);
    }
  }
}

// acc[g] = acc[g] * corr[g] + sum_t p[g][t] v[t] for kG rows, tokens [0, n);
// the first tile prefetches `next`.
template <int kG>
PAGEKV_BF16_DOT_ATTR void AccumulateRows(const std::byte* HWY_RESTRICT v, int64_t row_bytes, int64_t n, int32_t d,
                                         const float* HWY_RESTRICT p, int32_t stride, const float* corr,
                                         float* HWY_RESTRICT acc, const Prefetcher& next) {
  HWY_ALIGN uint32_t phi[kG * kPairStride], plo[kG * kPairStride];
  PairedProbs<kG>(p, stride, n, phi, plo);
  // Chunks of 32 dimensions per tile: 2 accumulators each, up to 16 in all.
  constexpr int kC = kG >= 4 ? 2 : 4;
  const Prefetcher none;
  int32_t j0 = 0;
  for (; j0 + kC * kDims <= d; j0 += kC * kDims) {
    AccumulateTile<kG, kC>(v, row_bytes, n, d, j0, phi, plo, corr, acc, j0 == 0 ? next : none);
  }
  for (; j0 < d; j0 += kDims) AccumulateTile<kG, 1>(v, row_bytes, n, d, j0, phi, plo, corr, acc, j0 == 0 ? next : none);
}

}  // namespace bf16dot
#endif  // x86 AVX-512

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // PAGEKV_KERNELS_BF16_DOT_INL_H_ toggle
