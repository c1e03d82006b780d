// Block-quantized weights times int16 activations (the fast path of
// matmul.h for a few tokens): each activation row is quantized once per call
// in blocks of 32 (an f32 scale d = max |x| / 32767 and 32 int16 values).
//
// The 32-element formats (q4_0 ... q8_0: one scale, and a minimum or a
// fixed offset, per block) are widened to int16 straight from memory
// (Widen32) and take one scale per block (Tile32, four rows by one or two
// tokens).
//
// The k-quants (256-element blocks, KRow): per block, the sub-block scales
// and mins are decoded once (Head: the 6-bit fields with a few word
// operations, then eight at a time to f32), and the elements in groups of
// two or four 32-element chunks (Group), as int16 in registers: u for q4_k
// and q5_k, u times the integer sub-block scale for the formats with
// 16-element sub-blocks (q2_k, q3_k, q6_k). Each group serves a tile of up
// to four tokens before the next is decoded:
//
//   sum_i w_i x_i = sum_chunks f_c * dx_c * (sum_32 w q) + sum_16 bias * (dx * sum_16 q)
//
// The integer sums are `vpmaddwd` (i16 pairs into i32; no sum comes near
// 2^31: see KHead): 32 multiply-adds in two instructions, against four
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
#include <type_traits>
#include <utility>

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

inline __m128i Load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// 16 bytes widened to 16 int16 lanes (byte i in lane i).
inline __m256i Bytes16(const uint8_t* p) { return _mm256_cvtepu8_epi16(Load16(p)); }

// kBits bits of each lane's byte starting at bit k moved to start at bit
// kTo, every other bit cleared.
template <int k, int kTo, int kBits>
inline __m256i BitsTo(__m256i v) {
  const __m256i m = _mm256_set1_epi16(static_cast<int16_t>(((1 << kBits) - 1) << kTo));
  if constexpr (k < kTo) return _mm256_and_si256(_mm256_slli_epi16(v, kTo - k), m);
  if constexpr (k > kTo) return _mm256_and_si256(_mm256_srli_epi16(v, k - kTo), m);
  return _mm256_and_si256(v, m);
}
template <int k, int kTo>
inline __m256i BitTo(__m256i v) { return BitsTo<k, kTo, 1>(v); }
template <int k, int kTo>
inline __m256i TwoBitsTo(__m256i v) { return BitsTo<k, kTo, 2>(v); }

// Calls f(std::integral_constant<int, 0>) ... f(std::integral_constant<int, N - 1>),
// so that shifts inside f take immediates.
template <int N, class F>
inline void Unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

// The k-quants (256-element blocks) times q16 activations. Each block's
// values are written as
//
//   element e's value = f[e / 32] * w[e] + bias[e / 16]
//
// with w the small unsigned integer u of the element where the format's
// sub-blocks are 32 long (q4_k, q5_k: the sub-block's scale is in f), and u
// times the sub-block's integer scale where they are 16 long (q2_k, q3_k,
// q6_k: f is the block's d), so that one float factor serves each
// 32-element chunk. |w| <= 63 * 128 = 8064: a vpmaddwd lane's two products
// and the sum of two lanes stay below 2^31 with |q| <= 32767.
//
// KHead holds f and bias (decoded once per block and tile); Group decodes
// two chunks' w into registers, used at once for every token of the tile.
struct KHead {
  __m256 f;           // per 32-element chunk
  __m256 bias[2];     // per 16 elements
  alignas(32) int16_t sc[16];  // 16-element sub-blocks: the integer scales
};

// Eight bytes (lo: 0-3, hi: 4-7) as eight f32 lanes, times f.
inline __m256 ByteFloats(uint32_t lo, uint32_t hi, float f) {
  const __m128i b = _mm_cvtsi64_si128(static_cast<int64_t>((uint64_t{hi} << 32) | lo));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_set1_ps(f));
}

template <WeightType kType>
inline void Head(const std::byte* b, KHead& k) {
  static_assert(QuantTraits<kType>::kElems == 256, "the 32-element formats go through Widen32 and Tile32");
  const auto* u = reinterpret_cast<const uint8_t*>(b);
  if constexpr (QuantTraits<kType>::kSub == 32) {
    // The 6-bit scales and mins of the 8 sub-blocks (weight_formats.cc has
    // the bit map), as bytes: scales 0-3 and 4-7, mins 0-3 and 4-7.
    uint32_t a[3];
    std::memcpy(a, u + 4, 12);
    const uint32_t s_lo = a[0] & 0x3F3F3F3F, m_lo = a[1] & 0x3F3F3F3F;
    const uint32_t s_hi = (a[2] & 0x0F0F0F0F) | (((a[0] >> 6) & 0x03030303) << 4);
    const uint32_t m_hi = ((a[2] >> 4) & 0x0F0F0F0F) | (((a[1] >> 6) & 0x03030303) << 4);
    k.f = ByteFloats(s_lo, s_hi, HalfAt(b));
    const __m256 m = ByteFloats(m_lo, m_hi, -HalfAt(b + 2));  // per chunk; the bias is per 16
    const __m256 lo = _mm256_unpacklo_ps(m, m), hi = _mm256_unpackhi_ps(m, m);
    k.bias[0] = _mm256_permute2f128_ps(lo, hi, 0x20);
    k.bias[1] = _mm256_permute2f128_ps(lo, hi, 0x31);
    return;
  }
  // Sub-blocks of 16: the integer scales as bytes, and d as every chunk's
  // factor; the bias per sub-block is the format's offset times its scale
  // (q2_k: its min).
  __m128i sc;
  float d;
  if constexpr (kType == WeightType::kQ6_K) {
    sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192));
    d = HalfAt(b + 208);
  } else if constexpr (kType == WeightType::kQ3_K) {
    // 16 6-bit scales: low nibbles from bytes 0-7, top two bits from 8-11.
    uint32_t a[4];
    std::memcpy(a, u + 96, 12);
    const uint32_t top = a[2];
    a[2] = ((a[0] >> 4) & 0x0F0F0F0F) | (((top >> 4) & 0x03030303) << 4);
    a[3] = ((a[1] >> 4) & 0x0F0F0F0F) | (((top >> 6) & 0x03030303) << 4);
    a[0] = (a[0] & 0x0F0F0F0F) | ((top & 0x03030303) << 4);
    a[1] = (a[1] & 0x0F0F0F0F) | (((top >> 2) & 0x03030303) << 4);
    sc = _mm_sub_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)), _mm_set1_epi8(32));
    d = HalfAt(b + 108);
  } else {  // q2_k: scale in the low nibble, min in the high one
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    sc = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    const __m128i mins = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    const __m256 dmin = _mm256_set1_ps(-HalfAt(b + 82));
    k.bias[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)), dmin);
    k.bias[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8))), dmin);
    d = HalfAt(b + 80);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(k.sc), _mm256_cvtepi8_epi16(sc));  // broadcast from memory by Group
  k.f = _mm256_set1_ps(d);
  if constexpr (kType != WeightType::kQ2_K) {
    const __m256 f = _mm256_set1_ps(d * (kType == WeightType::kQ6_K ? -32.0f : -4.0f));
    k.bias[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), f);
    k.bias[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), f);
  }
}

// The two chunks group g (0-3) decodes: those that share their bytes.
// q6_k: chunks 4 (g / 2) + g % 2 and that + 2 (the low and high nibbles of
// the same ql bytes); the others: 2g and 2g + 1.
template <WeightType kType>
constexpr int ChunkOf(int g, int i) {
  return kType == WeightType::kQ6_K ? 4 * (g / 2) + g % 2 + 2 * i : 2 * g + i;
}

// Group g's two chunks of block b: w[2i] elements 0-15 of chunk
// ChunkOf(g, i), w[2i + 1] elements 16-31.
template <WeightType kType, int g>
inline void Group(const std::byte* b, const KHead& k, __m256i* w) {
  const auto* u = reinterpret_cast<const uint8_t*>(b);
  const __m256i nib = _mm256_set1_epi16(0x0F);
  if constexpr (QuantTraits<kType>::kSub == 32) {
    // Chunk 2g: low nibbles of qs[32 g ..], chunk 2g + 1: their high
    // nibbles; q5_k's fifth bit of chunk c's element l is bit c of qh[l].
    constexpr bool kFive = kType == WeightType::kQ5_K;
    const uint8_t* qs = u + (kFive ? 48 : 16) + 32 * g;
    for (int h = 0; h < 2; ++h) {
      const __m256i v = Bytes16(qs + 16 * h);
      w[h] = _mm256_and_si256(v, nib);
      w[2 + h] = _mm256_srli_epi16(v, 4);
      if constexpr (kFive) {
        const __m256i qh = Bytes16(u + 16 + 16 * h);
        w[h] = _mm256_or_si256(w[h], BitTo<2 * g, 4>(qh));
        w[2 + h] = _mm256_or_si256(w[2 + h], BitTo<2 * g + 1, 4>(qh));
      }
    }
    return;
  }
  // Elements 16 h .. 16 h + 15 of chunk c: u times the scale of sub-block 2c + h.
  auto put = [&](int i, int h, __m256i v) {
    w[2 * i + h] = _mm256_mullo_epi16(v, _mm256_set1_epi16(k.sc[2 * ChunkOf<kType>(g, i) + h]));
  };
  for (int h = 0; h < 2; ++h) {
    if constexpr (kType == WeightType::kQ6_K) {
      // Chunk 4 half + kk: the nibble (kk >> 1) of ql[64 half + 32 (kk & 1)
      // + l] and bits 2 kk, 2 kk + 1 of qh[32 half + l] above it; here
      // kk = g % 2 and g % 2 + 2.
      constexpr int half = g / 2, kk = g % 2;
      const __m256i a = Bytes16(u + 64 * half + 32 * kk + 16 * h);
      const __m256i q = Bytes16(u + 128 + 32 * half + 16 * h);
      put(0, h, _mm256_or_si256(_mm256_and_si256(a, nib), TwoBitsTo<2 * kk, 4>(q)));
      put(1, h, _mm256_or_si256(_mm256_srli_epi16(a, 4), TwoBitsTo<2 * kk + 4, 4>(q)));
    } else {
      // Chunk 4 half + s: bits 2s, 2s + 1 of qs[32 half + l]; q3_k adds 4
      // where bit 4 half + s of hmask[l] is set; here s = 2 (g % 2) + i.
      constexpr int half = g / 2;
      const __m256i q = Bytes16(u + (kType == WeightType::kQ2_K ? 16 : 32) + 32 * half + 16 * h);
      [[maybe_unused]] const __m256i hm = kType == WeightType::kQ3_K ? Bytes16(u + 16 * h) : _mm256_setzero_si256();
      Unrolled<2>([&](auto i) {
        constexpr int sft = 2 * (g % 2) + i;
        __m256i v = TwoBitsTo<2 * sft, 0>(q);
        if constexpr (kType == WeightType::kQ3_K) v = _mm256_or_si256(v, BitTo<4 * half + sft, 2>(hm));
        put(i, h, v);
      });
    }
  }
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[t] = W[row] . X[token t] for kT tokens of a k-quant row, X as q16 rows
// (xq: int16 [tokens][cols], xd: f32 [tokens][cols / 32], xs: f32
// [tokens][cols / 16] = xd times the sum of the 16 values), each group of
// chunks decoded once for the kT tokens.
template <WeightType kType, int kT>
inline void KRow(const std::byte* row, int64_t cols, const int16_t* xq, const float* xd, const float* xs, float* out,
                 int64_t ahead) {
  // Accumulators per token: with few tokens, several, so that the FMA
  // chain of one block (10 dependent FMAs) does not bound the loop.
  constexpr int kA = kT == 1 ? 4 : kT == 2 ? 2 : 1;
  const int64_t block_bytes = FormatOf(kType).block_bytes;
  const int64_t x_blocks = cols / 32;
  __m256 acc[kT][kA];
  for (int t = 0; t < kT; ++t) {
    for (int a = 0; a < kA; ++a) acc[t][a] = _mm256_setzero_ps();
  }
  KHead k;
  for (int64_t b = 0; b < cols / 256; ++b) {
    const std::byte* blk = row + b * block_bytes;
    // The rows a few ahead, from DRAM: the hardware prefetchers stop at
    // each 4 KiB page and restart on every chunk of rows a thread claims.
    for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + ahead + off), _MM_HINT_T0);
    Head<kType>(blk, k);
    __m256 dd[kT];  // per chunk: f times the token's scale of those 32 values
    for (int t = 0; t < kT; ++t) {
      dd[t] = _mm256_mul_ps(k.f, _mm256_loadu_ps(xd + t * x_blocks + 8 * b));
      const float* s16 = xs + t * 2 * x_blocks + 16 * b;
      acc[t][0] = _mm256_fmadd_ps(k.bias[0], _mm256_loadu_ps(s16), acc[t][0]);
      acc[t][kA - 1] = _mm256_fmadd_ps(k.bias[1], _mm256_loadu_ps(s16 + 8), acc[t][kA - 1]);
    }
    Unrolled<4>([&](auto g) {
      __m256i w[4];
      Group<kType, g>(blk, k, w);
      for (int i = 0; i < 2; ++i) {
        const int c = ChunkOf<kType>(g, i);
        const __m256i lane = _mm256_set1_epi32(c);
        for (int t = 0; t < kT; ++t) {
          const auto* x = reinterpret_cast<const __m256i*>(xq + t * cols + 256 * b + 32 * c);
          const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w[2 * i], _mm256_loadu_si256(x)),
                                             _mm256_madd_epi16(w[2 * i + 1], _mm256_loadu_si256(x + 1)));
          __m256& a = acc[t][c % kA];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_permutevar8x32_ps(dd[t], lane), a);
        }
      }
    });
  }
  for (int t = 0; t < kT; ++t) {
    __m256 sum = acc[t][0];
    for (int a = 1; a < kA; ++a) sum = _mm256_add_ps(sum, acc[t][a]);
    out[t] = HSum(sum);
  }
}

// Rows ahead of the one being read that KRows prefetches.
#ifndef PAGEKV_KROWS_AHEAD
#define PAGEKV_KROWS_AHEAD 4
#endif
inline constexpr int64_t kKRowsAhead = PAGEKV_KROWS_AHEAD;

// y[t * y_stride + r] = W[row r] . X[token t] for rows [row_begin,
// row_end) of a k-quant matrix and every token, in tiles of up to 4 tokens.
template <WeightType kType>
inline void KRows(const std::byte* w, int64_t row_bytes, int64_t cols, int64_t row_begin, int64_t row_end,
                  int64_t tokens, const int16_t* xq, const float* xd, const float* xs, float* y, int64_t y_stride) {
  const int64_t x_blocks = cols / 32;
  const int64_t ahead = kKRowsAhead * row_bytes;
  float out[4];
  for (int64_t r = row_begin; r < row_end; ++r) {
    const std::byte* row = w + r * row_bytes;
    for (int64_t t = 0; t < tokens; t += 4) {
      const int64_t nt = std::min<int64_t>(4, tokens - t);
      const int16_t* q = xq + t * cols;
      const float* d = xd + t * x_blocks;
      const float* s = xs + t * 2 * x_blocks;
      switch (nt) {
        case 4: KRow<kType, 4>(row, cols, q, d, s, out, t == 0 ? ahead : 0); break;
        case 3: KRow<kType, 3>(row, cols, q, d, s, out, t == 0 ? ahead : 0); break;
        case 2: KRow<kType, 2>(row, cols, q, d, s, out, t == 0 ? ahead : 0); break;
        default: KRow<kType, 1>(row, cols, q, d, s, out, t == 0 ? ahead : 0); break;
      }
      for (int64_t i = 0; i < nt; ++i) y[(t + i) * y_stride + r] = out[i];
    }
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
    __m256 dd[kT];  // d[r] * dx[t] in lanes r and 4 + r, broadcast in registers below
    for (int t = 0; t < kT; ++t) {
      xlo[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + b * 32));
      xhi[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + b * 32 + 16));
      const __m128 d4 = _mm_mul_ps(d, _mm_set1_ps(xd[t * blocks + b]));
      dd[t] = _mm256_set_m128(d4, d4);
      if constexpr (kType != WeightType::kQ8_0) {
        const float sx = xs[t * 2 * blocks + 2 * b] + xs[t * 2 * blocks + 2 * b + 1];
        bias[t] = _mm_fmadd_ps(m, _mm_set1_ps(sx), bias[t]);
      }
    }
    Unrolled<kRows>([&](auto r) {
      constexpr int kLane = decltype(r)::value * 0x55;  // lane r of each half, as an immediate
      __m256i wlo, whi;
      Widen32<kType>(rows[r] + at, wlo, whi);
      for (int t = 0; t < kT; ++t) {
        const __m256i s = DotPairs<kVnni>(wlo, xlo[t], whi, xhi[t]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_permute_ps(dd[t], kLane), acc[r][t]);
      }
    });
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
