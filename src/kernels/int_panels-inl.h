// The panel layouts' integer products (PackedWeights: matmul_internal.h's
// q8_0, q4_k / q5_k, q4_0 / q4_1 / q5_0 / q5_1 and q6_k panels) with the
// int16 activations of int_dot-inl.h, for a few tokens: per column pair or
// four columns, the 16 rows' weights widened once and multiplied with each
// token's values broadcast, so the rows sit in lanes (no horizontal sums)
// and each panel is one stream read front to back; 256-bit kernels for
// AVX2 and up and 512-bit ones for AVX-512.
//
// Include from a file that includes <hwy/foreach_target.h>.
#if defined(PAGEKV_KERNELS_INT_PANELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_INT_PANELS_INL_H_
#undef PAGEKV_KERNELS_INT_PANELS_INL_H_
#else
#define PAGEKV_KERNELS_INT_PANELS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/int_dot-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
namespace intdot {

// Bytes ahead of the one being read that the panel kernels prefetch: the panels are
// one stream per thread, but the hardware prefetchers stop at each 4 KiB
// page and restart on every chunk of rows a thread claims. Cold from DRAM,
// two threads (BM_ColdDecode): none 14-16 GB/s, 512 15-18, 1024 16-18,
// 2048 17-20, 4096 17-20, 8192 16-18 (Intel kind).
#ifndef PAGEKV_PANEL_AHEAD
#define PAGEKV_PANEL_AHEAD 2048
#endif
// Tokens' q16 rows for the panel kernels: token t's values at xq + t *
// cols, its per-32 scales at xd + t * cols / 32, its per-16 sums (scale
// times the sum of the 16 values) at xs + t * cols / 16.
struct PanelX {
  const int16_t* xq;
  const float* xd;
  const float* xs;
  int64_t cols;
};

// Adds the pair products of 16 rows' int16 pairs (w0: rows 0-7, w1: rows
// 8-15) with one token's pair x to the token's sums.
template <bool kVnni>
inline void PairProducts(__m256i w0, __m256i w1, __m256i x, __m256i* sum) {
#if HWY_TARGET <= HWY_AVX3
  if constexpr (kVnni) {
    asm("%{evex%} vpdpwssd %2, %1, %0" : "+v"(sum[0]) : "v"(w0), "v"(x));
    asm("%{evex%} vpdpwssd %2, %1, %0" : "+v"(sum[1]) : "v"(w1), "v"(x));
    return;
  }
#endif
  sum[0] = _mm256_add_epi32(sum[0], _mm256_madd_epi16(w0, x));
  sum[1] = _mm256_add_epi32(sum[1], _mm256_madd_epi16(w1, x));
}

// Token t's values 2j and 2j + 1 from `at` on, as one int32 for the pair products.
inline __m256i XPair(const int16_t* at) {
  int32_t pair;
  std::memcpy(&pair, at, 4);
  return _mm256_set1_epi32(pair);
}

// out[t * 16 + n] = row n of a q8_0 panel (matmul.cc kQ8PanelBlockBytes:
// per block the 16 rows' f16 scales, then per pair of columns the 16 rows'
// two bytes) times token t's q16 row, for kT tokens. Per pair of columns:
// the 16 rows' bytes widened once (two loads, rows 0-7 and 8-15), one pair
// product per token against the token's two values broadcast; the rows sit
// in lanes, so there is no horizontal sum, and the panel is read front to
// back.
template <int kT, bool kVnni = false>
inline void Q8Panel(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  __m256 acc[kT][2];
  for (int t = 0; t < kT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * 16 * 34);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    __m256i sum[kT][2];
    for (int t = 0; t < kT; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
    for (int j = 0; j < 16; ++j) {
      if (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + 32 + 32 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
      const __m256i w0 = _mm256_cvtepi8_epi16(Load16(blk + 32 + 32 * j));
      const __m256i w1 = _mm256_cvtepi8_epi16(Load16(blk + 48 + 32 * j));
      for (int t = 0; t < kT; ++t) PairProducts<kVnni>(w0, w1, XPair(x.xq + t * x.cols + 32 * b + 2 * j), sum[t]);
    }
    for (int t = 0; t < kT; ++t) {
      const __m256 d = _mm256_set1_ps(x.xd[t * (x.cols / 32) + b]);
      acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][0]), _mm256_mul_ps(s0, d), acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][1]), _mm256_mul_ps(s1, d), acc[t][1]);
    }
  }
  for (int t = 0; t < kT; ++t) {
    _mm256_storeu_ps(out + t * 16, acc[t][0]);
    _mm256_storeu_ps(out + t * 16 + 8, acc[t][1]);
  }
}

// Eight bytes as eight f32 lanes.
inline __m256 ByteLanes(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// out[t * 16 + n] = row n of a q4_k panel (matmul.cc kQ4KPanelBlockBytes)
// times token t's q16 row, for kT tokens. Per sub-block of 32 columns, the
// pair products of each row's nibbles u with the token's int16 values sum
// to an exact integer, taken once as d * sc * dx; the mins once as dmin *
// m times the sub-block's sum of X.
// kFifth: q5_k (matmul.cc kQ5KPanelBlockBytes), each sub-block's nibbles
// followed by their fifth bits, shifted into bit 4 of the same lanes as
// NibblePanel's.
template <int kT, bool kVnni = false, bool kFifth = false>
inline void Q4KPanel(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  constexpr int64_t kSubBytes = kFifth ? 256 + 64 : 256;
  __m256 acc[kT][2];
  for (int t = 0; t < kT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i fifth = _mm256_set1_epi16(0x10);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * (64 + 256 + 8 * kSubBytes));
    const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)))};
    const __m256 dmin[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32))),
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 48)))};
    for (int sub = 0; sub < 8; ++sub) {
      const uint8_t* q = blk + 320 + kSubBytes * sub;
      __m256i sum[kT][2];
      for (int t = 0; t < kT; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
      const __m256i nib = _mm256_set1_epi16(0x0F);
      if constexpr (kFifth) _mm_prefetch(reinterpret_cast<const char*>(q + 256 + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
      Unrolled<8>([&](auto jc) {  // four columns: rows 0-7's 16 bytes, then rows 8-15's
        constexpr int j = decltype(jc)::value, k = j % 4;  // q5_k's fifth bits: bits k and 4 + k
        if constexpr (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + 32 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
        const __m256i v0 = Bytes16(q + 32 * j), v1 = Bytes16(q + 32 * j + 16);
        __m256i lo0 = _mm256_and_si256(v0, nib), lo1 = _mm256_and_si256(v1, nib);
        __m256i hi0 = _mm256_srli_epi16(v0, 4), hi1 = _mm256_srli_epi16(v1, 4);
        if constexpr (kFifth) {
          const __m256i h0 = Bytes16(q + 256 + 32 * (j / 4)), h1 = Bytes16(q + 256 + 32 * (j / 4) + 16);
          lo0 = _mm256_or_si256(lo0, _mm256_and_si256(_mm256_slli_epi16(h0, 4 - k), fifth));
          lo1 = _mm256_or_si256(lo1, _mm256_and_si256(_mm256_slli_epi16(h1, 4 - k), fifth));
          hi0 = _mm256_or_si256(hi0, _mm256_and_si256(_mm256_srli_epi16(h0, k), fifth));
          hi1 = _mm256_or_si256(hi1, _mm256_and_si256(_mm256_srli_epi16(h1, k), fifth));
        }
        const int64_t c = 256 * b + 32 * sub + 4 * j;
        for (int t = 0; t < kT; ++t) {
          PairProducts<kVnni>(lo0, lo1, XPair(x.xq + t * x.cols + c), sum[t]);
          PairProducts<kVnni>(hi0, hi1, XPair(x.xq + t * x.cols + c + 2), sum[t]);
        }
      });
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_mul_ps(d[h], ByteLanes(blk + 64 + 16 * sub + 8 * h));
        const __m256 bias = _mm256_mul_ps(dmin[h], ByteLanes(blk + 192 + 16 * sub + 8 * h));
        for (int t = 0; t < kT; ++t) {
          const int64_t chunk = 8 * b + sub;  // the 32-value chunk of X
          const float* s16 = x.xs + t * (x.cols / 16) + 2 * chunk;
          const __m256 dx = _mm256_set1_ps(x.xd[t * (x.cols / 32) + chunk]);
          acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][h]), _mm256_mul_ps(scale, dx), acc[t][h]);
          acc[t][h] = _mm256_fnmadd_ps(bias, _mm256_set1_ps(s16[0] + s16[1]), acc[t][h]);
        }
      }
    }
  }
  for (int t = 0; t < kT; ++t) {
    _mm256_storeu_ps(out + t * 16, acc[t][0]);
    _mm256_storeu_ps(out + t * 16 + 8, acc[t][1]);
  }
}

// out[t * 16 + n] = row n of a q4_0 / q4_1 / q5_0 / q5_1 panel (matmul.cc
// NibbleFormat: the rows' d, m if kMin, the nibbles, the fifth bits if
// kFifth) times token t's q16 row, for kT tokens. Per 32-column block the
// nibbles' pair products as q4_k's sub-block (each fifth bit shifted into
// bit 4 of the same int16 lanes), the exact integer sum scaled once by d x
// dx; the values' offset (kOffset x d) and m once each times the block's
// sum of X.
template <int kT, bool kVnni, bool kMin, bool kFifth, int kOffset>
inline void NibblePanel(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  constexpr int64_t kNibblesAt = kMin ? 64 : 32, kBlockBytes = kNibblesAt + 256 + (kFifth ? 64 : 0);
  __m256 acc[kT][2];
  for (int t = 0; t < kT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi16(0x0F), fifth = _mm256_set1_epi16(0x10);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kBlockBytes);
    const uint8_t* q = blk + kNibblesAt;
    __m256i sum[kT][2];
    for (int t = 0; t < kT; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
    if constexpr (kBlockBytes > 320) _mm_prefetch(reinterpret_cast<const char*>(q + PAGEKV_PANEL_AHEAD + 256), _MM_HINT_T0);
    Unrolled<8>([&](auto jc) {  // four columns: rows 0-7's 16 bytes, then rows 8-15's
      constexpr int j = decltype(jc)::value, k = j % 4;  // the fifth bits: bits k and 4 + k
      if constexpr (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + 32 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
      const __m256i v0 = Bytes16(q + 32 * j), v1 = Bytes16(q + 32 * j + 16);
      __m256i lo0 = _mm256_and_si256(v0, nib), lo1 = _mm256_and_si256(v1, nib);
      __m256i hi0 = _mm256_srli_epi16(v0, 4), hi1 = _mm256_srli_epi16(v1, 4);
      if constexpr (kFifth) {
        const uint8_t* high = q + 256 + 32 * (j / 4);
        const __m256i h0 = Bytes16(high), h1 = Bytes16(high + 16);
        lo0 = _mm256_or_si256(lo0, _mm256_and_si256(_mm256_slli_epi16(h0, 4 - k), fifth));
        lo1 = _mm256_or_si256(lo1, _mm256_and_si256(_mm256_slli_epi16(h1, 4 - k), fifth));
        hi0 = _mm256_or_si256(hi0, _mm256_and_si256(_mm256_srli_epi16(h0, k), fifth));
        hi1 = _mm256_or_si256(hi1, _mm256_and_si256(_mm256_srli_epi16(h1, k), fifth));
      }
      const int64_t c = 32 * b + 4 * j;
      for (int t = 0; t < kT; ++t) {
        PairProducts<kVnni>(lo0, lo1, XPair(x.xq + t * x.cols + c), sum[t]);
        PairProducts<kVnni>(hi0, hi1, XPair(x.xq + t * x.cols + c + 2), sum[t]);
      }
    });
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
      for (int t = 0; t < kT; ++t) {
        const float* s16 = x.xs + t * (x.cols / 16) + 2 * b;
        const __m256 dx = _mm256_set1_ps(x.xd[t * (x.cols / 32) + b]);
        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][h]), _mm256_mul_ps(d, dx), acc[t][h]);
        if constexpr (kOffset != 0) {
          acc[t][h] = _mm256_fnmadd_ps(d, _mm256_set1_ps(static_cast<float>(kOffset) * (s16[0] + s16[1])), acc[t][h]);
        }
        if constexpr (kMin) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
          acc[t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(s16[0] + s16[1]), acc[t][h]);
        }
      }
    }
  }
  for (int t = 0; t < kT; ++t) {
    _mm256_storeu_ps(out + t * 16, acc[t][0]);
    _mm256_storeu_ps(out + t * 16 + 8, acc[t][1]);
  }
}

// out[t * 16 + n] = row n of a q6_k panel (matmul.cc kQ6KPanelBlockBytes)
// times token t's q16 row, for kT tokens. Per four columns, each row's low
// nibbles widened as q4_k's, the high two bits shifted into bits 4-5 of
// the same int16 lanes; per 16-element group the exact integer sum scaled
// once by d x the group's scale, and the values' offset of 32 taken from
// the group's sum of X.
template <int kT, bool kVnni = false>
inline void Q6KPanel(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  __m256 acc[kT][2];
  for (int t = 0; t < kT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi16(0x0F), top = _mm256_set1_epi16(0x30);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * (32 + 256 + 2048 + 1024));
    const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)))};
    for (int g = 0; g < 16; ++g) {
      __m256i sum[kT][2];
      for (int t = 0; t < kT; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
      const uint8_t* grp = blk + 32 + 208 * g;  // scales, low nibbles, high bits
      const uint8_t* high = grp + 144;
      Unrolled<4>([&](auto jc) {
        constexpr int j = decltype(jc)::value, kSh = 2 * (j % 2);  // the group's high bits: bits kSh and 4 + kSh
        _mm_prefetch(reinterpret_cast<const char*>(grp + 64 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
        const uint8_t* low = grp + 16 + 32 * j;
        const __m256i v0 = Bytes16(low), v1 = Bytes16(low + 16);
        const __m256i h0 = Bytes16(high + 32 * (j / 2)), h1 = Bytes16(high + 32 * (j / 2) + 16);
        const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, nib), _mm256_and_si256(_mm256_slli_epi16(h0, 4 - kSh), top));
        const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, nib), _mm256_and_si256(_mm256_slli_epi16(h1, 4 - kSh), top));
        const __m256i hi0 = _mm256_or_si256(_mm256_srli_epi16(v0, 4), _mm256_and_si256(_mm256_srli_epi16(h0, kSh), top));
        const __m256i hi1 = _mm256_or_si256(_mm256_srli_epi16(v1, 4), _mm256_and_si256(_mm256_srli_epi16(h1, kSh), top));
        const int64_t c = 256 * b + 16 * g + 4 * j;
        for (int t = 0; t < kT; ++t) {
          PairProducts<kVnni>(lo0, lo1, XPair(x.xq + t * x.cols + c), sum[t]);
          PairProducts<kVnni>(hi0, hi1, XPair(x.xq + t * x.cols + c + 2), sum[t]);
        }
      });
      for (int h = 0; h < 2; ++h) {
        const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 8 * h));
        const __m256 scale = _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
        for (int t = 0; t < kT; ++t) {
          const __m256 dx = _mm256_set1_ps(x.xd[t * (x.cols / 32) + 8 * b + g / 2]);
          const float s16 = x.xs[t * (x.cols / 16) + 16 * b + g];
          acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][h]), _mm256_mul_ps(scale, dx), acc[t][h]);
          acc[t][h] = _mm256_fnmadd_ps(scale, _mm256_set1_ps(32.0f * s16), acc[t][h]);
        }
      }
    }
  }
  for (int t = 0; t < kT; ++t) {
    _mm256_storeu_ps(out + t * 16, acc[t][0]);
    _mm256_storeu_ps(out + t * 16 + 8, acc[t][1]);
  }
}

#if HWY_TARGET <= HWY_AVX3
// The AVX-512 forms of Q8Panel and Q4KPanel: the 16 rows in one register,
// half the instructions per column pair (a panel kernel with one token
// issues about one instruction per 5 bytes of q4_k, where the 256-bit form
// issues one per 2 and falls behind DRAM).
template <bool kVnni>
inline __m512i PairProducts512(__m512i w, __m512i x, __m512i sum) {
  if constexpr (kVnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(w), "v"(x));
    return sum;
  }
  return _mm512_add_epi32(sum, _mm512_madd_epi16(w, x));
}

template <int kS>
inline __m512i SumAll(const __m512i* v) {
  __m512i s = v[0];
  for (int a = 1; a < kS; ++a) s = _mm512_add_epi32(s, v[a]);
  return s;
}

inline __m512i XPair512(const int16_t* at) {
  int32_t pair;
  std::memcpy(&pair, at, 4);
  return _mm512_set1_epi32(pair);
}

inline __m512 ByteLanes512(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int kT, bool kVnni = false, int kS = 4 / kT>
inline void Q8Panel512(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  __m512 acc[kT];
  for (int t = 0; t < kT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * 16 * 34);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    // kS independent sums per token: a pair product's latency is several
    // cycles, and one chain of 16 would bound the loop.
    __m512i sum[kT][kS];
    for (int t = 0; t < kT; ++t) {
      for (int a = 0; a < kS; ++a) sum[t][a] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 16; ++j) {
      if (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + 32 + 32 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * j)));
      for (int t = 0; t < kT; ++t) {
        sum[t][j % kS] = PairProducts512<kVnni>(w, XPair512(x.xq + t * x.cols + 32 * b + 2 * j), sum[t][j % kS]);
      }
    }
    for (int t = 0; t < kT; ++t) {
      const __m512 d = _mm512_set1_ps(x.xd[t * (x.cols / 32) + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(SumAll<kS>(sum[t])), _mm512_mul_ps(s, d), acc[t]);
    }
  }
  for (int t = 0; t < kT; ++t) _mm512_storeu_ps(out + t * 16, acc[t]);
}

template <int kT, bool kVnni = false, int kS = 4 / kT, bool kFifth = false>
inline void Q4KPanel512(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  constexpr int64_t kSubBytes = kFifth ? 256 + 64 : 256;
  __m512 acc[kT];
  for (int t = 0; t < kT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i nibbles = _mm512_set1_epi16(0x0F), fifth = _mm512_set1_epi16(0x10);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * (64 + 256 + 8 * kSubBytes));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    for (int sub = 0; sub < 8; ++sub) {
      const uint8_t* q = blk + 320 + kSubBytes * sub;
      __m512i sum[kT][kS];
      for (int t = 0; t < kT; ++t) {
        for (int a = 0; a < kS; ++a) sum[t][a] = _mm512_setzero_si512();
      }
      if constexpr (kFifth) _mm_prefetch(reinterpret_cast<const char*>(q + 256 + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
      Unrolled<8>([&](auto jc) {  // four columns: the 16 rows' 32 bytes widened to 16-bit lanes
        constexpr int j = decltype(jc)::value, k = j % 4;
        if constexpr (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + 32 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j)));
        __m512i lo = _mm512_and_si512(v, nibbles), hi = _mm512_srli_epi16(v, 4);  // pairs (c, c + 1), (c + 2, c + 3)
        if constexpr (kFifth) {  // A | (B & C), imm 0xF8: the fifth bit into bit 4
          const __m512i h =
              _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 256 + 32 * (j / 4))));
          lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(h, 4 - k), fifth, 0xF8);
          hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi16(h, k), fifth, 0xF8);
        }
        const int64_t c = 256 * b + 32 * sub + 4 * j;
        for (int t = 0; t < kT; ++t) {
          const int a = (2 * j) % kS;
          sum[t][a] = PairProducts512<kVnni>(lo, XPair512(x.xq + t * x.cols + c), sum[t][a]);
          sum[t][(a + 1) % kS] = PairProducts512<kVnni>(hi, XPair512(x.xq + t * x.cols + c + 2), sum[t][(a + 1) % kS]);
        }
      });
      const __m512 scale = _mm512_mul_ps(d, ByteLanes512(blk + 64 + 16 * sub));
      const __m512 bias = _mm512_mul_ps(dmin, ByteLanes512(blk + 192 + 16 * sub));
      for (int t = 0; t < kT; ++t) {
        const int64_t chunk = 8 * b + sub;
        const float* s16 = x.xs + t * (x.cols / 16) + 2 * chunk;
        const __m512 dx = _mm512_set1_ps(x.xd[t * (x.cols / 32) + chunk]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(SumAll<kS>(sum[t])), _mm512_mul_ps(scale, dx), acc[t]);
        acc[t] = _mm512_fnmadd_ps(bias, _mm512_set1_ps(s16[0] + s16[1]), acc[t]);
      }
    }
  }
  for (int t = 0; t < kT; ++t) _mm512_storeu_ps(out + t * 16, acc[t]);
}
template <int kT, bool kVnni, bool kMin, bool kFifth, int kOffset, int kS = 4 / kT>
inline void NibblePanel512(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  constexpr int64_t kNibblesAt = kMin ? 64 : 32, kBlockBytes = kNibblesAt + 256 + (kFifth ? 64 : 0);
  __m512 acc[kT];
  for (int t = 0; t < kT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi16(0x0F), fifth = _mm512_set1_epi16(0x10);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kBlockBytes);
    const uint8_t* q = blk + kNibblesAt;
    __m512i sum[kT][kS];
    for (int t = 0; t < kT; ++t) {
      for (int a = 0; a < kS; ++a) sum[t][a] = _mm512_setzero_si512();
    }
    if constexpr (kBlockBytes > 320) _mm_prefetch(reinterpret_cast<const char*>(q + PAGEKV_PANEL_AHEAD + 256), _MM_HINT_T0);
    Unrolled<8>([&](auto jc) {  // four columns: the 16 rows' 32 bytes widened to 16-bit lanes
      constexpr int j = decltype(jc)::value, k = j % 4;
      if constexpr (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + 32 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j)));
      __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_srli_epi16(v, 4);  // pairs (c, c + 1), (c + 2, c + 3)
      if constexpr (kFifth) {
        const __m512i h =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 256 + 32 * (j / 4))));
        // A | (B & C), imm 0xF8: the nibbles with the fifth bit in bit 4.
        lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(h, 4 - k), fifth, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi16(h, k), fifth, 0xF8);
      }
      const int64_t c = 32 * b + 4 * j;
      for (int t = 0; t < kT; ++t) {
        const int a = (2 * j) % kS;
        sum[t][a] = PairProducts512<kVnni>(lo, XPair512(x.xq + t * x.cols + c), sum[t][a]);
        sum[t][(a + 1) % kS] = PairProducts512<kVnni>(hi, XPair512(x.xq + t * x.cols + c + 2), sum[t][(a + 1) % kS]);
      }
    });
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    for (int t = 0; t < kT; ++t) {
      const float* s16 = x.xs + t * (x.cols / 16) + 2 * b;
      const __m512 dx = _mm512_set1_ps(x.xd[t * (x.cols / 32) + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(SumAll<kS>(sum[t])), _mm512_mul_ps(d, dx), acc[t]);
      if constexpr (kOffset != 0) {
        acc[t] = _mm512_fnmadd_ps(d, _mm512_set1_ps(static_cast<float>(kOffset) * (s16[0] + s16[1])), acc[t]);
      }
      if constexpr (kMin) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(s16[0] + s16[1]), acc[t]);
      }
    }
  }
  for (int t = 0; t < kT; ++t) _mm512_storeu_ps(out + t * 16, acc[t]);
}
template <int kT, bool kVnni = false, int kS = 4 / kT>
inline void Q6KPanel512(const std::byte* panel, int64_t blocks, const PanelX& x, float* out) {
  __m512 acc[kT];
  for (int t = 0; t < kT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi16(0x0F), top = _mm512_set1_epi16(0x30);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * (32 + 256 + 2048 + 1024));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    for (int g = 0; g < 16; ++g) {
      __m512i sum[kT][kS];
      for (int t = 0; t < kT; ++t) {
        for (int a = 0; a < kS; ++a) sum[t][a] = _mm512_setzero_si512();
      }
      const uint8_t* grp = blk + 32 + 208 * g;  // scales, low nibbles, high bits
      const uint8_t* high = grp + 144;
      Unrolled<4>([&](auto jc) {
        constexpr int j = decltype(jc)::value, kSh = 2 * (j % 2);
        _mm_prefetch(reinterpret_cast<const char*>(grp + 64 * j + PAGEKV_PANEL_AHEAD), _MM_HINT_T0);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 16 + 32 * j)));
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + 32 * (j / 2))));
        // A | (B & C), imm 0xF8: the low nibbles with the high bits in 4-5.
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(v, nib), _mm512_slli_epi16(h, 4 - kSh), top, 0xF8);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_srli_epi16(h, kSh), top, 0xF8);
        const int64_t c = 256 * b + 16 * g + 4 * j;
        for (int t = 0; t < kT; ++t) {
          const int a = (2 * j) % kS;
          sum[t][a] = PairProducts512<kVnni>(lo, XPair512(x.xq + t * x.cols + c), sum[t][a]);
          sum[t][(a + 1) % kS] = PairProducts512<kVnni>(hi, XPair512(x.xq + t * x.cols + c + 2), sum[t][(a + 1) % kS]);
        }
      });
      const __m512 scale = _mm512_mul_ps(
          d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp)))));
      for (int t = 0; t < kT; ++t) {
        const __m512 dx = _mm512_set1_ps(x.xd[t * (x.cols / 32) + 8 * b + g / 2]);
        const float s16 = x.xs[t * (x.cols / 16) + 16 * b + g];
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(SumAll<kS>(sum[t])), _mm512_mul_ps(scale, dx), acc[t]);
        acc[t] = _mm512_fnmadd_ps(scale, _mm512_set1_ps(32.0f * s16), acc[t]);
      }
    }
  }
  for (int t = 0; t < kT; ++t) _mm512_storeu_ps(out + t * 16, acc[t]);
}
#endif  // AVX-512

}  // namespace intdot
#endif  // x86 AVX2 and up

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
