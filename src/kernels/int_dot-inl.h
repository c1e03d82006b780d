// Block-quantized weights times int16 activations (the fast path of
// matmul.h for a few tokens): each activation row is quantized once per call
// in blocks of 32 (an f32 scale d = max |x| / 32767 and 32 int16 values),
// and each 32-element chunk of a k-quant weight row is unpacked to 32 small
// unsigned integers u with a per-16 scale and bias, so that
//
//   sum_i w_i x_i = dx * sum_16 scale * (sum u_i q_i) + sum_16 bias * (dx * sum q_i)
//
// The 32-element formats (q4_0 ... q8_0: one scale, and a minimum or a
// fixed offset, per block) are widened to int16 straight from memory
// (Widen32) and take one scale per block (Tile32).
//
// The integer sums are `vpmaddwd` (i16 pairs into i32; u <= 63 and |q| <=
// 32767 cannot overflow): 32 multiply-adds in two instructions, against four
// FMAs and the conversions of the f32 path. x86 AVX2 and AVX-512 targets
// (256-bit registers); elsewhere the f32 path runs.
//
// Why 16 bits and not 8 (ggml's q8 activations): the inputs of some
// products (SwiGLU's output, the final norm's) have outlier channels, and
// rounded to 8 bits per block of 32 they moved SmolLM2's logits by up to
// 0.3, enough to flip greedy choices with a clear 0.2 margin; 16 bits are
// within 1/65534 of each block's largest value, and on AVX2 `vpmaddwd` does
// as many multiply-adds per instruction as `vpmaddubsw` followed by the
// `vpmaddwd` that widens its sums. docs/PERFORMANCE.md has the figures.
//
// Include from a file that includes <hwy/foreach_target.h>.
#if defined(PAGEKV_KERNELS_INT_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_INT_DOT_INL_H_
#undef PAGEKV_KERNELS_INT_DOT_INL_H_
#else
#define PAGEKV_KERNELS_INT_DOT_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/quant_blocks-inl.h"

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#include <immintrin.h>
#endif

// Defined for the targets this file compiles the kernels into (re-decided
// for every target).
#undef PAGEKV_HAVE_INT_DOT

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define PAGEKV_HAVE_INT_DOT 1

namespace intdot {

// a0 . b0 + a1 . b1 in int16 pairs, lanes as `vpmaddwd` leaves them. With
// kVnni (AVX-512 targets, on a CPU with AVX-512 VNNI: the caller checks
// kernels::VnniEnabled()) the second product and the sum are one
// `vpdpwssd`; the same exact integers either way (weights |w| <= 128,
// activations |q| <= 32767: no sum comes near 2^31; vpdpwssd does not
// saturate). Written as EVEX-encoded inline assembly: Highway 1.0.3's
// AVX3_DL target enables AVX-VNNI (the VEX form), which some AVX-512 VNNI
// CPUs lack (this project's AMD machines), so the compiler's own
// `_mm256_dpwssd_epi32` there is an illegal instruction.
template <bool kVnni = false>
inline __m256i DotPairs(__m256i a0, __m256i b0, __m256i a1, __m256i b1) {
#if HWY_TARGET <= HWY_AVX3
  if constexpr (kVnni) {
    __m256i acc = _mm256_madd_epi16(a0, b0);
    asm("%{evex%} vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a1), "v"(b1));
    return acc;
  }
#endif
  return _mm256_add_epi32(_mm256_madd_epi16(a0, b0), _mm256_madd_epi16(a1, b1));
}

// One 32-element chunk of a weight row: the values are u * scale + bias,
// scale and bias per 16 elements (lanes 0-3 of the integer sums cover
// elements 0-15, lanes 4-7 elements 16-31).
struct Chunk {
  __m256i u;          // 32 unsigned bytes
  __m256 scale;       // low half: elements 0-15, high half: 16-31
  float bias[2];
};

// (v >> shift) & mask per byte, for a run-time shift.
inline __m256i ShiftMask(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

inline __m256i Load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256 Halves(float lo, float hi) { return _mm256_setr_m128(_mm_set1_ps(lo), _mm_set1_ps(hi)); }

// The per-block constants of a 256-element (k-quant) block, decoded once per row.
struct KScales {
  float scale[16];
  float bias[16];
};

template <WeightType kType>
inline void BlockScales(const std::byte* b, KScales& k) {
  float scale[16], bias[16];
  Scales<kType>(b, scale, bias);
  constexpr int kSubs = 256 / QuantTraits<kType>::kSub;
  for (int i = 0; i < 16; ++i) {  // per 16 elements
    k.scale[i] = scale[i * kSubs / 16];
    k.bias[i] = bias[i * kSubs / 16];
  }
}

// Chunk c (32 elements) of block b, whose scales `k` are decoded.
template <WeightType kType>
inline Chunk Unpack(const std::byte* b, int c, const KScales& k) {
  const auto* u = reinterpret_cast<const uint8_t*>(b);
  Chunk out;
  const int s0 = 2 * c;
  out.scale = Halves(k.scale[s0], k.scale[s0 + 1]);
  out.bias[0] = k.bias[s0];
  out.bias[1] = k.bias[s0 + 1];
  static_assert(QuantTraits<kType>::kElems == 256, "32-element formats go through Widen32 and Tile32");
  if constexpr (kType == WeightType::kQ2_K) {
    const int half = c / 4, s = c % 4;
    out.u = ShiftMask(Load32(u + 16 + half * 32), 2 * s, 3);
  } else if constexpr (kType == WeightType::kQ3_K) {
    const int half = c / 4, s = c % 4;
    const __m256i q = ShiftMask(Load32(u + 32 + half * 32), 2 * s, 3);
    const __m256i h = ShiftMask(Load32(u), half * 4 + s, 1);
    out.u = _mm256_or_si256(q, _mm256_slli_epi16(h, 2));
  } else if constexpr (kType == WeightType::kQ4_K || kType == WeightType::kQ5_K) {
    constexpr bool kFive = kType == WeightType::kQ5_K;
    const int j = c / 2, upper = c % 2;
    __m256i q = ShiftMask(Load32(u + (kFive ? 48 : 16) + j * 32), 4 * upper, 0x0F);
    if constexpr (kFive) {
      const __m256i h = ShiftMask(Load32(u + 16), 2 * j + upper, 1);
      q = _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
    }
    out.u = q;
  } else if constexpr (kType == WeightType::kQ6_K) {
    const int half = c / 4, kk = c % 4;
    const __m256i lo = ShiftMask(Load32(u + half * 64 + (kk & 1) * 32), (kk >> 1) * 4, 0x0F);
    const __m256i hi = ShiftMask(Load32(u + 128 + half * 32), 2 * kk, 3);
    out.u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  return out;
}

// The 32 unsigned weight bytes as two vectors of 16 int16 (elements 0-15, 16-31).
inline void Widen(__m256i w, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
  hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[t * kRows + r] = W[row r] . X[token t] for kRows rows and kT tokens,
// X given as q16 rows (xq: int16 [tokens][cols], xd: f32 [tokens][cols / 32],
// xs: f32 [tokens][cols / 16] = xd times the sum of the 16 values).
template <WeightType kType, int kRows, int kT>
inline void Tile(const std::byte* const* rows, int64_t cols, const int16_t* xq, const float* xd, const float* xs,
                 int64_t row_step, float* out) {
  using Tr = QuantTraits<kType>;
  constexpr int kChunks = Tr::kElems / 32;
  const int64_t block_bytes = FormatOf(kType).block_bytes;
  __m256 acc[kRows][kT];
  float bias[kRows][kT];
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kT; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      bias[r][t] = 0;
    }
  }
  KScales ks[kRows];
  const int64_t x_blocks = cols / 32;
  for (int64_t b = 0; b < cols / Tr::kElems; ++b) {
    for (int r = 0; r < kRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + row_step * kRows + b * block_bytes), _MM_HINT_T1);
      BlockScales<kType>(rows[r] + b * block_bytes, ks[r]);
    }
    for (int c = 0; c < kChunks; ++c) {
      const int64_t xb = b * kChunks + c;  // the 32-element block of X
      __m256i xlo[kT], xhi[kT];
      __m256 dx[kT];
      for (int t = 0; t < kT; ++t) {
        xlo[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + xb * 32));
        xhi[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + xb * 32 + 16));
        dx[t] = _mm256_set1_ps(xd[t * x_blocks + xb]);
      }
      for (int r = 0; r < kRows; ++r) {
        const Chunk w = Unpack<kType>(rows[r] + b * block_bytes, c, ks[r]);
        __m256i wlo, whi;
        Widen(w.u, wlo, whi);
        // Sums of elements 0-15 in lanes 0-3 and of 16-31 in lanes 4-7, as
        // the per-16 scale vector expects.
        for (int t = 0; t < kT; ++t) {
          const __m256i slo = _mm256_madd_epi16(wlo, xlo[t]), shi = _mm256_madd_epi16(whi, xhi[t]);
          const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(slo, shi, 0x20), _mm256_permute2x128_si256(slo, shi, 0x31));
          const __m256 sums = _mm256_cvtepi32_ps(s);
          acc[r][t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(w.scale, dx[t]), acc[r][t]);
          const float* s16 = xs + t * 2 * x_blocks + 2 * xb;
          bias[r][t] += w.bias[0] * s16[0] + w.bias[1] * s16[1];
        }
      }
    }
  }
  for (int t = 0; t < kT; ++t) {
    for (int r = 0; r < kRows; ++r) out[t * kRows + r] = HSum(acc[r][t]) + bias[r][t];
  }
}

// A 32-element block's weights as two vectors of 16 int16 (elements 0-15,
// 16-31) straight from memory: one widening load, then the nibbles (and
// the fifth bits) split in 16-bit lanes, where no cross-lane step is needed.
inline __m256i FifthBits16(uint32_t bits) {  // lane i: 0x10 where bit i of the low 16 bits is set
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        static_cast<int16_t>(-32768));
  const __m256i v = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits & 0xFFFF)), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi16(v, bit), _mm256_set1_epi16(0x10));
}

template <WeightType kType>
inline void Widen32(const std::byte* b, __m256i& lo, __m256i& hi) {
  const auto* u = reinterpret_cast<const uint8_t*>(b);
  auto load16 = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  if constexpr (kType == WeightType::kQ8_0) {
    lo = _mm256_cvtepi8_epi16(load16(u + 2));
    hi = _mm256_cvtepi8_epi16(load16(u + 18));
  } else {
    constexpr bool kFive = kType == WeightType::kQ5_0 || kType == WeightType::kQ5_1;
    constexpr int kQs = kType == WeightType::kQ4_0 ? 2 : kType == WeightType::kQ4_1 ? 4 : kType == WeightType::kQ5_0 ? 6 : 8;
    const __m256i v = _mm256_cvtepu8_epi16(load16(u + kQs));  // byte i in lane i
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));          // element i: low nibble of byte i
    hi = _mm256_srli_epi16(v, 4);                              // element 16 + i: its high nibble
    if constexpr (kFive) {
      uint32_t qh;
      std::memcpy(&qh, b + (kType == WeightType::kQ5_1 ? 4 : 2), 4);
      lo = _mm256_or_si256(lo, FifthBits16(qh));
      hi = _mm256_or_si256(hi, FifthBits16(qh >> 16));
    }
  }
}

// The 32-element formats (one scale per block, and for q4_1 / q5_1 one
// minimum): the kRows rows' f16 constants converted together, their
// products with each token's scale (and the minimums' terms) taken four
// rows at a time, one scale per (row, token) and block, no per-16 split.
template <WeightType kType, int kRows, int kT, bool kVnni = false>
inline void Tile32(const std::byte* const* rows, int64_t cols, const int16_t* xq, const float* xd, const float* xs,
                   int64_t row_step, float* out) {
  static_assert(kRows == 4, "the f16 constants of four rows convert in one instruction");
  constexpr bool kMin = kType == WeightType::kQ4_1 || kType == WeightType::kQ5_1;
  constexpr float kOffset = kType == WeightType::kQ4_0 ? 8.0f : kType == WeightType::kQ5_0 ? 16.0f : 0.0f;
  const int64_t block_bytes = FormatOf(kType).block_bytes;
  const int64_t blocks = cols / 32;
  __m256 acc[kRows][kT];
  __m128 bias[kT];  // the four rows' minimum (or offset) terms
  for (int t = 0; t < kT; ++t) {
    bias[t] = _mm_setzero_ps();
    for (int r = 0; r < kRows; ++r) acc[r][t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * block_bytes;
    if ((at & 63) < block_bytes) {  // once per cache line of each row
      for (int r = 0; r < kRows; ++r) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + row_step * kRows + at + 64), _MM_HINT_T1);
    }
    alignas(16) uint16_t hd[4], hm[4];
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(&hd[r], rows[r] + at, 2);
      if constexpr (kMin) std::memcpy(&hm[r], rows[r] + at + 2, 2);
    }
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hd)));
    __m128 m;
    if constexpr (kMin) {
      m = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hm)));
    } else {
      m = _mm_mul_ps(d, _mm_set1_ps(-kOffset));
    }
    __m256i xlo[kT], xhi[kT];
    alignas(16) float dd[kT][4];  // d[r] * dx[t], broadcast from memory below
    for (int t = 0; t < kT; ++t) {
      xlo[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + b * 32));
      xhi[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + b * 32 + 16));
      _mm_store_ps(dd[t], _mm_mul_ps(d, _mm_set1_ps(xd[t * blocks + b])));
      if constexpr (kType != WeightType::kQ8_0) {
        const float sx = xs[t * 2 * blocks + 2 * b] + xs[t * 2 * blocks + 2 * b + 1];
        bias[t] = _mm_fmadd_ps(m, _mm_set1_ps(sx), bias[t]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      __m256i wlo, whi;
      Widen32<kType>(rows[r] + at, wlo, whi);
      for (int t = 0; t < kT; ++t) {
        const __m256i s = DotPairs<kVnni>(wlo, xlo[t], whi, xhi[t]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&dd[t][r]), acc[r][t]);
      }
    }
  }
  for (int t = 0; t < kT; ++t) {
    alignas(16) float bt[4];
    _mm_store_ps(bt, bias[t]);
    for (int r = 0; r < kRows; ++r) out[t * kRows + r] = HSum(acc[r][t]) + bt[r];
  }
}

}  // namespace intdot

#endif  // x86 AVX2 and up

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
