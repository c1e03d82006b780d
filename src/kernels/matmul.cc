// Y = X W^T for the model runner (see matmul.h), compiled for every Highway
// target and chosen at run time.
//
// Work: rows are cut into chunks handed to the thread pool; inside a chunk,
// tiles of 4 weight rows x up to 4 tokens accumulate 16 vectors over the
// columns, each weight vector converted to f32 once and used for every token
// of the tile. Tokens are walked in chunks small enough that their X rows
// stay in L2 while the chunk's weight rows (a few KiB) stay in L1.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/matmul.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "kernels/amx_matmul.h"
#include "kernels/matmul.h"
#include "kernels/simd-inl.h"
#include "kernels/quant_blocks-inl.h"
#include "kernels/int_dot-inl.h"
#include "layout/float16.h"

#ifndef PAGEKV_KERNELS_MATMUL_ONCE_
#define PAGEKV_KERNELS_MATMUL_ONCE_
namespace pagekv::kernels {

constexpr int64_t kQ8Block = 32;       // elements per q8_0 block
constexpr int64_t kQ8BlockBytes = 34;  // f16 scale + 32 int8
// q8_0 in panels (PackedWeights): per 16-row panel and 32-column block, the
// 16 rows' f16 scales (32 bytes), then for each pair of columns (2j, 2j + 1)
// the 16 rows' two int8 (32 bytes): the same 544 bytes as 16 q8_0 blocks,
// read front to back by every kernel, the pairs as the int16 pair products
// (vpmaddwd / vpdpwssd) take them.
constexpr int64_t kQ8PanelBlockBytes = 16 * kQ8BlockBytes;
// q4_k in panels: per 16-row panel and 256-column block, the rows' f16 d
// (32 bytes) and dmin (32), their sub-block scales [8][16] and mins [8][16]
// as bytes (256), then for each four columns c .. c + 3 the 16 rows'
// nibbles in 32 bytes: row n's byte 2n holds columns c (low nibble) and
// c + 2, byte 2n + 1 columns c + 1 and c + 3, so widened to 16-bit lanes
// the low nibbles are each row's (c, c + 1) pair and the high ones its
// (c + 2, c + 3) pair. 2368 bytes, 2.8% over the rows' own 2304.
constexpr int64_t kQ4KPanelBlockBytes = 64 + 256 + 2048;
constexpr int64_t kQ4KQuantsAt = 320;  // offset of the nibbles in a panel block
// Where element e (0..255) of row n (0..15) sits in a q4_k panel block: its
// byte, and the nibble's shift.
constexpr int64_t Q4KNibbleByte(int e, int n) { return kQ4KQuantsAt + 32 * (e / 4) + 2 * n + e % 2; }
constexpr int Q4KNibbleShift(int e) { return 4 * ((e % 4) / 2); }
// q5_k in panels: q4_k's layout with each 32-column sub-block's nibbles
// (256 bytes) followed by their fifth bits (64: two 32-byte lines, one per
// four four-column steps, as NibbleFormat lays them out below), so that the
// kernels read one stream: 320 + 8 x 320 = 2880 bytes, 2.3% over the rows'
// own 2816. Where element e of row n sits in either k-quant layout:
constexpr int64_t kQ5KPanelBlockBytes = 320 + 8 * (256 + 64);
constexpr int64_t KNibbleByte(bool fifth, int e, int n) {
  return kQ4KQuantsAt + (fifth ? 320 : 256) * (e / 32) + 32 * ((e % 32) / 4) + 2 * n + e % 2;
}
constexpr int64_t Q5KFifthByte(int e, int n) { return kQ4KQuantsAt + 320 * (e / 32) + 256 + 32 * ((e % 32) / 16) + 2 * n + e % 2; }
// q6_k in panels: per 16-row panel and 256-column block, the rows' f16 d
// (32 bytes), then per 16-element group, in the order the kernel reads
// them (one stream, as q8_0's and q4_k's): the rows' int8 scales (16
// bytes), the low four bits of the group's values as q4_k's nibbles are
// laid out (128), and their high two bits (64): row n's bytes 2n and 2n + 1
// of each 32-byte line hold, for the group's first four-column step of a
// pair, the high bits of columns c and c + 1 at bits 0-1 and of c + 2, c + 3
// at bits 4-5, and for the second the same at bits 2-3 and 6-7, so that
// shifted into place they complete the low nibbles' int16 pairs. 3360
// bytes, the rows' own.
constexpr int64_t kQ6KGroupBytes = 16 + 128 + 64;
constexpr int64_t kQ6KPanelBlockBytes = 32 + 16 * kQ6KGroupBytes;
constexpr int64_t Q6KGroupAt(int g) { return 32 + kQ6KGroupBytes * g; }
constexpr int64_t Q6KScaleByte(int g, int n) { return Q6KGroupAt(g) + n; }
constexpr int64_t Q6KLowByte(int e, int n) { return Q6KGroupAt(e / 16) + 16 + 32 * ((e % 16) / 4) + 2 * n + e % 2; }
constexpr int64_t Q6KHighByte(int e, int n) { return Q6KGroupAt(e / 16) + 144 + 32 * ((e % 16) / 8) + 2 * n + e % 2; }
constexpr int Q6KHighShift(int e) { return 2 * ((e / 4) % 2) + 4 * ((e % 4) / 2); }
// The 32-element formats with 4-bit values (q4_0, q4_1) and 5-bit ones
// (q5_0, q5_1) in panels, each value d * (q - offset) + m: per 16-row panel
// and 32-column block the rows' f16 d (32 bytes), their f16 m where the
// format has one (32), the values' low four bits as q4_k's nibbles (256:
// per four columns c .. c + 3, row n's byte 2n holds c and c + 2, byte
// 2n + 1 c + 1 and c + 3), and for the 5-bit formats the fifth bits in two
// 32-byte lines, one per four four-column steps (for step j, row n's bytes
// 2n and 2n + 1 hold at bits j % 4 and 4 + j % 4 the bits of the same
// columns as the step's nibble bytes, so that shifted into bit 4 they
// complete the nibbles' int16 pairs). The rows' own bytes, in the order the
// kernels (intdot::NibblePanel) read them.
struct NibbleFormat {
  bool min = false, fifth = false;
  int offset = 0;  // 8 (q4_0), 16 (q5_0), 0 (q4_1, q5_1: m instead)
  constexpr int64_t NibblesAt() const { return min ? 64 : 32; }
  constexpr int64_t BlockBytes() const { return NibblesAt() + 256 + (fifth ? 64 : 0); }
  constexpr int64_t NibbleByte(int e, int n) const { return NibblesAt() + 32 * (e / 4) + 2 * n + e % 2; }
  constexpr int64_t FifthByte(int e, int n) const { return NibblesAt() + 256 + 32 * (e / 16) + 2 * n + e % 2; }
  // The ggml block's own layout: d, then m, then the fifth bits (uint32), then 16 bytes of nibbles.
  constexpr int64_t SourceBitsAt() const { return min ? 4 : 2; }
  constexpr int64_t SourceNibblesAt() const { return SourceBitsAt() + (fifth ? 4 : 0); }
};
constexpr NibbleFormat NibbleFormatOf(WeightType t) {
  return t == WeightType::kQ4_0   ? NibbleFormat{false, false, 8}
         : t == WeightType::kQ4_1 ? NibbleFormat{true, false, 0}
         : t == WeightType::kQ5_0 ? NibbleFormat{false, true, 16}
         : t == WeightType::kQ5_1 ? NibbleFormat{true, true, 0}
                                  : NibbleFormat{};
}
constexpr bool IsNibbleFormat(WeightType t) {
  return t == WeightType::kQ4_0 || t == WeightType::kQ4_1 || t == WeightType::kQ5_0 || t == WeightType::kQ5_1;
}
constexpr int FifthShift(int e) { return (e / 4) % 4 + 4 * ((e % 4) / 2); }
// Element e (0..31) of row n of a nibble-format panel block, as its integer q.
inline int NibbleValue(const NibbleFormat& f, const uint8_t* blk, int e, int n) {
  const int low = (blk[f.NibbleByte(e, n)] >> Q4KNibbleShift(e)) & 0x0F;
  return f.fifth ? low | ((blk[f.FifthByte(e, n)] >> FifthShift(e)) & 1) << 4 : low;
}
// Bytes of one 16-row panel's block in a block format's panel layout (0: none).
constexpr int64_t PanelBlockBytes(WeightType t) {
  return t == WeightType::kQ8_0   ? kQ8PanelBlockBytes
         : IsNibbleFormat(t)      ? NibbleFormatOf(t).BlockBytes()
         : t == WeightType::kQ4_K ? kQ4KPanelBlockBytes
         : t == WeightType::kQ5_K ? kQ5KPanelBlockBytes
         : t == WeightType::kQ6_K ? kQ6KPanelBlockBytes
                                  : 0;
}
inline bool PanelLayout(WeightType t) { return !IsBlockQuantized(t) || PanelBlockBytes(t) > 0; }
// Bytes of one 16-row panel of `cols` columns.
inline int64_t PanelBytes(WeightType t, int64_t cols) {
  if (IsBlockQuantized(t)) return cols / FormatOf(t).block_elems * PanelBlockBytes(t);
  return cols * 16 * (t == WeightType::kF32 ? 4 : 2);
}
constexpr int kPanelRows = 16;         // rows per panel (WeightMatrix::panels)
constexpr int64_t kIntMaxTokens = 15;  // Activations::kFast runs block formats as integer products up to this many tokens
constexpr int64_t kPanelPadRows = 32;  // packed rows are padded to a multiple of this (the widest tile)
// Tokens from which the decoded-panel path beats decoding per token tile
// (and the integer path: measured on SmolLM2's Q4_1, docs/PERFORMANCE.md).
constexpr int64_t kDecodedPanelMinTokens = 16;

// One call's task, shared by every thread.
struct MatMulTask {
  WeightMatrix w;
  int64_t row_bytes = 0;  // row-major: bytes per row; panels: bytes per panel
  const float* x = nullptr;
  int64_t tokens = 0;
  float* y = nullptr;
  // Activations::kFast on a block format: X as q16 rows (int_dot-inl.h), else null.
  const int16_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xs = nullptr;
  // Set where the call runs through AMX tiles (amx_matmul.h; panels and
  // block formats from AmxMinTokens tokens): X split into bf16 hi + lo.
  const AmxActivations* amx = nullptr;
};

}  // namespace pagekv::kernels
#endif

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kTileRows = 4;
// Tokens per tile: 4 rows x 6 tokens = 24 accumulators fit AVX-512's 32
// registers with the 4 weight vectors; 16-register targets keep 4 x 4.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kTileTokens = 6;
#else
constexpr int kTileTokens = 4;
#endif

// acc[r][t] += W[row r] . X[token t] over all columns, for kT tokens.
template <WeightType kType, int kT>
HWY_INLINE void Tile(const MatMulTask& task, const std::byte* const* rows, const float* x, float* out) {
  const hn::ScalableTag<float> df;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  const int64_t cols = task.w.cols;
  using V = hn::Vec<decltype(df)>;
  V acc[kTileRows][kT];
  for (int r = 0; r < kTileRows; ++r) {
    for (int t = 0; t < kT; ++t) acc[r][t] = hn::Zero(df);
  }
  int64_t c = 0;
  if constexpr (kType == WeightType::kQ8_0) {
    const hn::Rebind<int8_t, decltype(df)> di8;
    const hn::Rebind<int32_t, decltype(df)> di32;
    for (int64_t b = 0; b < cols / kQ8Block; ++b) {
      // The four rows' f16 scales, converted together (F16C on x86).
      uint16_t h4[kTileRows];
      for (int r = 0; r < kTileRows; ++r) std::memcpy(&h4[r], rows[r] + b * kQ8BlockBytes, 2);
      float s4[kTileRows];
#if HWY_TARGET != HWY_SCALAR
      const hn::CappedTag<float, kTileRows> d4;
      const hn::Rebind<hwy::float16_t, decltype(d4)> dh4;
      hn::StoreU(hn::PromoteTo(d4, hn::LoadU(dh4, reinterpret_cast<const hwy::float16_t*>(h4))), d4, s4);
#else
      for (int r = 0; r < kTileRows; ++r) s4[r] = F16ToF32(h4[r]);
#endif
      V scale[kTileRows];
      for (int r = 0; r < kTileRows; ++r) scale[r] = hn::Set(df, s4[r]);
      for (int r = 0; r < kTileRows; ++r) {
        __builtin_prefetch(rows[r] + task.row_bytes * kTileRows + b * kQ8BlockBytes, 0, 2);
      }
      for (int64_t i = 0; i < kQ8Block; i += n) {
        const int64_t col = b * kQ8Block + i;
        V xv[kT];
        for (int t = 0; t < kT; ++t) xv[t] = hn::LoadU(df, x + t * cols + col);
        for (int r = 0; r < kTileRows; ++r) {
          const auto* q = reinterpret_cast<const int8_t*>(rows[r] + b * kQ8BlockBytes + 2 + i);
          const V wv = hn::Mul(scale[r], hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, q))));
          for (int t = 0; t < kT; ++t) acc[r][t] = hn::MulAdd(wv, xv[t], acc[r][t]);
        }
      }
    }
    c = cols;
  } else {
    using T = std::conditional_t<kType == WeightType::kF32, float,
                                 std::conditional_t<kType == WeightType::kF16, hwy::float16_t, hwy::bfloat16_t>>;
    for (; c + n <= cols; c += n) {
      // The next tile's rows follow these in memory: fetch them into L2 at
      // the pace these are read (a tile's four rows are four streams the
      // hardware prefetchers follow poorly).
      for (int r = 0; r < kTileRows; ++r) {
        __builtin_prefetch(rows[r] + task.row_bytes * kTileRows + c * static_cast<int64_t>(sizeof(T)), 0, 2);
      }
      V xv[kT];
      for (int t = 0; t < kT; ++t) xv[t] = hn::LoadU(df, x + t * cols + c);
      for (int r = 0; r < kTileRows; ++r) {
        const V wv = LoadF32(df, reinterpret_cast<const T*>(rows[r]) + c);
        for (int t = 0; t < kT; ++t) acc[r][t] = hn::MulAdd(wv, xv[t], acc[r][t]);
      }
    }
  }
  // out[t][r]: the vector sums, plus the columns past the last full vector.
  for (int t = 0; t < kT; ++t) {
#if HWY_TARGET != HWY_SCALAR
    if constexpr (kTileRows == 4 && hn::MaxLanes(decltype(df)()) >= 4) {
      Sum4(df, acc[0][t], acc[1][t], acc[2][t], acc[3][t], out + t * kTileRows);
    } else
#endif
    {
      for (int r = 0; r < kTileRows; ++r) out[t * kTileRows + r] = Sum(df, acc[r][t]);
    }
    for (int64_t j = c; j < cols; ++j) {
      for (int r = 0; r < kTileRows; ++r) {
        float wj;
        if constexpr (kType == WeightType::kF32) {
          std::memcpy(&wj, rows[r] + 4 * j, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, rows[r] + 2 * j, 2);
          wj = kType == WeightType::kF16 ? F16ToF32(h) : BF16ToF32(h);
        }
        out[t * kTileRows + r] += wj * x[t * cols + j];
      }
    }
  }
}

// acc[r][t] += W[row r] . X[token t] over all columns, for kT tokens, the
// rows in a block format: each weight vector decoded in registers (u *
// scale + bias, one multiply-add) once per tile and used for every token.
template <WeightType kType, int kT>
HWY_INLINE void QuantTile(const MatMulTask& task, const std::byte* const* rows, const float* x, float* out) {
  using Tr = QuantTraits<kType>;
  constexpr int kE = Tr::kElems, kSubs = Tr::kElems / Tr::kSub;
  const int64_t block_bytes = FormatOf(kType).block_bytes;
  const hn::ScalableTag<float> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const int64_t cols = task.w.cols;
  using V = hn::Vec<decltype(df)>;
  V acc[kTileRows][kT];
  for (int r = 0; r < kTileRows; ++r) {
    for (int t = 0; t < kT; ++t) acc[r][t] = hn::Zero(df);
  }
  float scale[kTileRows][kSubs], bias[kTileRows][kSubs];
  for (int64_t b = 0; b < cols / kE; ++b) {
    for (int r = 0; r < kTileRows; ++r) {
      __builtin_prefetch(rows[r] + task.row_bytes * kTileRows + b * block_bytes, 0, 2);
      Scales<kType>(rows[r] + b * block_bytes, scale[r], bias[r]);
    }
    for (int e = 0; e < kE; e += n) {
      V xv[kT];
      for (int t = 0; t < kT; ++t) xv[t] = hn::LoadU(df, x + t * cols + b * kE + e);
      const int sub = e / Tr::kSub;
      for (int r = 0; r < kTileRows; ++r) {
        const V wv = hn::MulAdd(Elements<kType>(df, rows[r] + b * block_bytes, e), hn::Set(df, scale[r][sub]),
                                hn::Set(df, bias[r][sub]));
        for (int t = 0; t < kT; ++t) acc[r][t] = hn::MulAdd(wv, xv[t], acc[r][t]);
      }
    }
  }
  for (int t = 0; t < kT; ++t) {
#if HWY_TARGET != HWY_SCALAR
    if constexpr (kTileRows == 4 && hn::MaxLanes(decltype(df)()) >= 4) {
      Sum4(df, acc[0][t], acc[1][t], acc[2][t], acc[3][t], out + t * kTileRows);
      continue;
    }
#endif
    for (int r = 0; r < kTileRows; ++r) out[t * kTileRows + r] = Sum(df, acc[r][t]);
  }
}

template <WeightType kType, int kT>
HWY_INLINE void AnyTile(const MatMulTask& task, const std::byte* const* rows, const float* x, float* out) {
  if constexpr (kType == WeightType::kF32 || kType == WeightType::kF16 || kType == WeightType::kBF16 ||
                kType == WeightType::kQ8_0) {
    Tile<kType, kT>(task, rows, x, out);
  } else {
    QuantTile<kType, kT>(task, rows, x, out);
  }
}

#ifdef PAGEKV_HAVE_INT_DOT
// Rows [row_begin, row_end) for every token, X as q16 rows. The 32-element
// formats: tiles of four rows times one or two tokens (their accumulators
// fit the 16 registers). The k-quants: one row at a time, each block
// decoded once for all the tokens.
template <WeightType kType>
void IntRowRange(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  const int64_t cols = task.w.cols;
  if constexpr (QuantTraits<kType>::kElems == 256) {
    intdot::KRows<kType>(task.w.data, task.row_bytes, cols, row_begin, row_end, task.tokens, task.xq,
                                        task.xd, task.xs, task.y, task.w.rows);
    return;
  }
  [[maybe_unused]] const bool vnni = VnniEnabled();
  float out[2 * kTileRows];
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kTileRows) {
    const int64_t nr = std::min<int64_t>(kTileRows, row_end - r0);
    const std::byte* rows[kTileRows];
    for (int r = 0; r < kTileRows; ++r) rows[r] = task.w.data + (r0 + std::min<int64_t>(r, nr - 1)) * task.row_bytes;
    for (int64_t t = 0; t < task.tokens; t += 2) {
      const int64_t nt = std::min<int64_t>(2, task.tokens - t);
      const int16_t* xq = task.xq + t * cols;
      const float* xd = task.xd + t * (cols / 32);
      const float* xs = task.xs + t * (cols / 16);
      if constexpr (QuantTraits<kType>::kElems == 32) {
#if HWY_TARGET <= HWY_AVX3
        if (vnni) {
          if (nt == 2) {
            intdot::Tile32<kType, kTileRows, 2, true>(rows, cols, xq, xd, xs, task.row_bytes, out);
          } else {
            intdot::Tile32<kType, kTileRows, 1, true>(rows, cols, xq, xd, xs, task.row_bytes, out);
          }
        } else
#endif
        if (nt == 2) {
          intdot::Tile32<kType, kTileRows, 2>(rows, cols, xq, xd, xs, task.row_bytes, out);
        } else {
          intdot::Tile32<kType, kTileRows, 1>(rows, cols, xq, xd, xs, task.row_bytes, out);
        }
      }
      for (int64_t i = 0; i < nt; ++i) {
        std::memcpy(task.y + (t + i) * task.w.rows + r0, out + i * kTileRows, static_cast<size_t>(nr) * 4);
      }
    }
  }
}
#endif

// Rows [row_begin, row_end) for every token.
template <WeightType kType>
void RowRange(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
#ifdef PAGEKV_HAVE_INT_DOT
  if constexpr (kType != WeightType::kF32 && kType != WeightType::kF16 && kType != WeightType::kBF16) {
    if (task.xq != nullptr) return IntRowRange<kType>(task, row_begin, row_end);
  }
#endif
  const int64_t cols = task.w.cols;
  // Tokens per pass: their X rows (cols floats each) fit in ~256 KiB of L2.
  const int64_t token_chunk = std::max<int64_t>(kTileTokens, (int64_t{256} << 10) / (cols * 4) / kTileTokens * kTileTokens);
  float out[kTileTokens * kTileRows];
  for (int64_t t0 = 0; t0 < task.tokens; t0 += token_chunk) {
    const int64_t t_end = std::min(task.tokens, t0 + token_chunk);
    for (int64_t r0 = row_begin; r0 < row_end; r0 += kTileRows) {
      const int64_t nr = std::min<int64_t>(kTileRows, row_end - r0);
      const std::byte* rows[kTileRows];
      // A short last tile repeats its last row and stores only the valid ones.
      for (int r = 0; r < kTileRows; ++r) rows[r] = task.w.data + (r0 + std::min<int64_t>(r, nr - 1)) * task.row_bytes;
      for (int64_t t = t0; t < t_end; t += kTileTokens) {
        const int64_t nt = std::min<int64_t>(kTileTokens, t_end - t);
        const float* x = task.x + t * cols;
        switch (nt) {
          case 6: if constexpr (kTileTokens >= 6) { AnyTile<kType, 6>(task, rows, x, out); } break;
          case 5: if constexpr (kTileTokens >= 5) { AnyTile<kType, 5>(task, rows, x, out); } break;
          case 4: AnyTile<kType, 4>(task, rows, x, out); break;
          case 3: AnyTile<kType, 3>(task, rows, x, out); break;
          case 2: AnyTile<kType, 2>(task, rows, x, out); break;
          default: AnyTile<kType, 1>(task, rows, x, out); break;
        }
        for (int64_t i = 0; i < nt; ++i) {
          std::memcpy(task.y + (t + i) * task.w.rows + r0, out + i * kTileRows, static_cast<size_t>(nr) * 4);
        }
      }
    }
  }
}

// ---- Panels (WeightMatrix::panels): kPanelRows rows per panel, stored
// column by column, so one vector load brings one column's element of 16
// rows. Tile: kTileVecs vectors of rows x kPanelTokens tokens of
// accumulators, each token's element broadcast from X: no horizontal sums,
// and every weight vector converted once per tile.
const hn::CappedTag<float, kPanelRows> dp;
constexpr int kPanelLanes = static_cast<int>(hn::MaxLanes(dp));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kPanelTileRows = 32;  // two panels: 2 x 12 accumulators of 32 registers
constexpr int kPanelAccs = 24;
#else
constexpr int kPanelTileRows = 16;  // one panel: 12 accumulators of 16 registers
constexpr int kPanelAccs = 12;
#endif
constexpr int kTileVecs = kPanelTileRows / kPanelLanes;
constexpr int kPanelTokens = kPanelAccs / kTileVecs > 0 ? kPanelAccs / kTileVecs : 1;
static_assert(kPanelTileRows % kPanelRows == 0 || kPanelRows % kPanelTileRows == 0);

// out[t][0 .. kPanelTileRows) = rows of the tile starting at `w` (a panel
// start) times token t's X row.
// `prefetch`, when set: the next tile's weights, fetched into L2 at the pace
// this tile's are read (one tile's worth of bytes over the columns).
// Not inlined: its accumulators take all but three registers of AVX2, and
// inlined into a caller with more live values (DecodedPanelRange) GCC kept
// one of them on the stack, a store and reload in every column's chain
// (2560 x 768 q4_k at 128 tokens: 40 GFLOP/s against 68 for q4_1).
template <typename T, int kT>
HWY_NOINLINE void PanelTile(const T* HWY_RESTRICT w, int64_t panel_elems, const float* HWY_RESTRICT x, int64_t cols,
                          float* HWY_RESTRICT out, int64_t out_stride, const char* prefetch = nullptr) {
  constexpr int64_t kTileBytesPerCol = kPanelTileRows * static_cast<int64_t>(sizeof(T));
  using V = hn::Vec<decltype(dp)>;
  constexpr int kVecsPerPanel = kPanelRows / kPanelLanes;
  V acc[kTileVecs][kT];
  for (int v = 0; v < kTileVecs; ++v) {
    for (int t = 0; t < kT; ++t) acc[v][t] = hn::Zero(dp);
  }
  const T* wv_at[kTileVecs];
  for (int v = 0; v < kTileVecs; ++v) wv_at[v] = w + (v / kVecsPerPanel) * panel_elems + (v % kVecsPerPanel) * kPanelLanes;
  for (int64_t c = 0; c < cols; ++c) {
    if (prefetch != nullptr) {
      for (int64_t b = 0; b < kTileBytesPerCol; b += 64) __builtin_prefetch(prefetch + c * kTileBytesPerCol + b, 0, 2);
    }
    V wv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) wv[v] = LoadF32(dp, wv_at[v] + c * kPanelRows);
    for (int t = 0; t < kT; ++t) {
      const V xb = hn::Set(dp, x[t * cols + c]);
      for (int v = 0; v < kTileVecs; ++v) acc[v][t] = hn::MulAdd(wv[v], xb, acc[v][t]);
    }
  }
  for (int t = 0; t < kT; ++t) {
    for (int v = 0; v < kTileVecs; ++v) hn::StoreU(acc[v][t], dp, out + t * out_stride + v * kPanelLanes);
  }
}

// PanelTile for a run-time token count in [1, kPanelTokens].
template <typename T, int kT = kPanelTokens>
HWY_INLINE void PanelTileN(int64_t nt, const T* HWY_RESTRICT w, int64_t panel_elems, const float* HWY_RESTRICT x,
                           int64_t cols, float* HWY_RESTRICT out, int64_t out_stride, const char* prefetch) {
  if constexpr (kT == 1) {
    PanelTile<T, 1>(w, panel_elems, x, cols, out, out_stride, prefetch);
  } else {
    if (nt == kT) return PanelTile<T, kT>(w, panel_elems, x, cols, out, out_stride, prefetch);
    PanelTileN<T, kT - 1>(nt, w, panel_elems, x, cols, out, out_stride, prefetch);
  }
}

// Rows [row_begin, row_end) (multiples of kPanelTileRows, the end possibly
// past w.rows into the zero padding) for every token.
template <typename T>
void PanelRange(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  const int64_t cols = task.w.cols, rows = task.w.rows;
  const int64_t panel_elems = cols * kPanelRows;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if (task.amx != nullptr) {
    static_assert(kPanelTileRows == 32);
    constexpr AmxPanelType kType = std::is_same_v<T, float>              ? AmxPanelType::kF32
                                   : std::is_same_v<T, hwy::float16_t> ? AmxPanelType::kF16
                                                                         : AmxPanelType::kBF16;
    // Up to kAmxMaxRows rows at a time (the panels' padding completes the last 32-row tile).
    const int64_t per_task = AmxRowsPerTask(cols);
    for (int64_t r0 = row_begin; r0 < std::min(row_end, rows); r0 += per_task) {
      const int64_t n = std::min<int64_t>({per_task, rows - r0, row_end - r0});
      AmxStagePanels(0, static_cast<int>((n + 31) / 32 * 2), reinterpret_cast<const T*>(task.w.data) + (r0 / kPanelRows) * panel_elems,
                     kType, panel_elems, cols);
      AmxMultiplyStaged(*task.amx, static_cast<int>(n), kType == AmxPanelType::kBF16, task.y + r0, rows);
    }
    return;
  }
#endif
  // Tokens per pass: their X rows fit in ~256 KiB of L2 beside the tile's weights.
  const int64_t token_chunk = std::max<int64_t>(kPanelTokens, (int64_t{256} << 10) / (cols * 4) / kPanelTokens * kPanelTokens);
  HWY_ALIGN float scratch[kPanelTokens * kPanelTileRows];
  for (int64_t t0 = 0; t0 < task.tokens; t0 += token_chunk) {
    const int64_t t_end = std::min(task.tokens, t0 + token_chunk);
    for (int64_t r0 = row_begin; r0 < row_end; r0 += kPanelTileRows) {
      const T* w = reinterpret_cast<const T*>(task.w.data) + (r0 / kPanelRows) * panel_elems;
      const int64_t nr = std::min<int64_t>(kPanelTileRows, rows - r0);
      if (nr <= 0) break;  // only padding rows left (a 16-row tile of the 32-row padding)
      // The next tile's weights (contiguous after these) are fetched into
      // L2 while the first token tile runs: it would otherwise wait on DRAM
      // for every line of its rows.
      const char* next = r0 + kPanelTileRows < row_end
                             ? reinterpret_cast<const char*>(w + (kPanelTileRows / kPanelRows) * panel_elems)
                             : nullptr;
      // The chunk's tokens in tiles of near-equal width (30 tokens: 10 + 10
      // + 10 rather than 12 + 12 + 6), so no tile runs short of accumulators.
      const int64_t n_tokens = t_end - t0;
      const int64_t tiles = (n_tokens + kPanelTokens - 1) / kPanelTokens;
      for (int64_t tile = 0, t = t0; tile < tiles; ++tile) {
        const char* prefetch = tile == 0 ? next : nullptr;
        const int64_t nt = n_tokens / tiles + (tile < n_tokens % tiles ? 1 : 0);
        const float* x = task.x + t * cols;
        // Full tiles write Y in place; a tile with padding rows goes through scratch.
        const bool direct = nr == kPanelTileRows;
        float* out = direct ? task.y + t * rows + r0 : scratch;
        const int64_t stride = direct ? rows : kPanelTileRows;
        PanelTileN<T>(nt, w, panel_elems, x, cols, out, stride, prefetch);
        if (!direct) {
          for (int64_t i = 0; i < nt; ++i) {
            std::memcpy(task.y + (t + i) * rows + r0, scratch + i * kPanelTileRows, static_cast<size_t>(nr) * 4);
          }
        }
        t += nt;
      }
    }
  }
}

// Rows [row_begin, row_end) (row_end <= w.rows) for every token, each tile
// of kPanelTileRows rows decoded once by decode(r0, nr, buffer) into two f32
// panels (the layout PackedWeights gives f32 weights; rows past nr zero) in
// a per-thread buffer that stays in L2, then multiplied over every token:
// through the AMX tiles where the call takes them, else the panel kernel.
// So the decoding is paid once per tile rather than once per few tokens.
template <class Decode>
void DecodedTiles(const MatMulTask& task, int64_t row_begin, int64_t row_end, const Decode& decode) {
  const int64_t cols = task.w.cols, rows = task.w.rows;
  const int64_t panel_elems = cols * kPanelRows;
  // Per-thread, grown to the widest matrix seen; 64-byte aligned for the
  // panel kernel's loads.
  thread_local hwy::AlignedFreeUniquePtr<float[]> panel_buf;
  thread_local int64_t panel_cap = 0;
  if (panel_cap < kPanelTileRows * cols) {
    panel_cap = kPanelTileRows * cols;
    panel_buf = hwy::AllocateAligned<float>(static_cast<size_t>(panel_cap));
  }
  float* const buffer = panel_buf.get();
  HWY_ALIGN float scratch[kPanelTokens * kPanelTileRows];
  [[maybe_unused]] int64_t amx_first = row_begin;  // the first row staged for the AMX tiles, not yet multiplied
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kPanelTileRows) {
    const int64_t nr = std::min<int64_t>(kPanelTileRows, row_end - r0);
    decode(r0, nr, buffer);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    // AMX: each decoded tile staged as B tiles, up to AmxRowsPerTask rows
    // at a time multiplied over every token.
    if (task.amx != nullptr) {
      static_assert(kPanelTileRows == 32 && kAmxMaxRows % 32 == 0);
      AmxStagePanels(static_cast<int>((r0 - amx_first) / kPanelRows), 2, buffer, AmxPanelType::kF32, panel_elems, cols);
      const int64_t staged_end = std::min(r0 + kPanelTileRows, row_end);
      if (staged_end == row_end || staged_end - amx_first >= AmxRowsPerTask(cols)) {
        AmxMultiplyStaged(*task.amx, static_cast<int>(staged_end - amx_first), false, task.y + amx_first, rows);
        amx_first = staged_end;
      }
      continue;
    }
#endif
    const int64_t tiles = (task.tokens + kPanelTokens - 1) / kPanelTokens;
    for (int64_t tile = 0, t = 0; tile < tiles; ++tile) {
      const int64_t nt = task.tokens / tiles + (tile < task.tokens % tiles ? 1 : 0);
      const bool direct = nr == kPanelTileRows;
      float* out = direct ? task.y + t * rows + r0 : scratch;
      const int64_t stride = direct ? rows : kPanelTileRows;
      PanelTileN<float>(nt, buffer, panel_elems, task.x + t * cols, cols, out, stride, nullptr);
      if (!direct) {
        for (int64_t i = 0; i < nt; ++i) {
          std::memcpy(task.y + (t + i) * rows + r0, scratch + i * kPanelTileRows, static_cast<size_t>(nr) * 4);
        }
      }
      t += nt;
    }
  }
}

// Row-major block-quantized rows for many tokens (DecodedTiles): four rows
// at a time decoded, then transposed into the panels.
template <WeightType kType>
void DecodedPanelRange(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  using Tr = QuantTraits<kType>;
  const int64_t cols = task.w.cols;
  const int64_t panel_elems = cols * kPanelRows;
  const int64_t block_bytes = FormatOf(kType).block_bytes;
  thread_local std::vector<float> row_buf;  // four decoded rows, row-major
  row_buf.resize(static_cast<size_t>(4 * cols));
  const hn::ScalableTag<float> df;
  const int n = static_cast<int>(hn::Lanes(df));
  float scale[Tr::kElems / Tr::kSub], bias[Tr::kElems / Tr::kSub];
  DecodedTiles(task, row_begin, row_end, [&](int64_t r0, int64_t nr, float* buffer) {
    for (int64_t g = 0; g < kPanelTileRows; g += 4) {  // four rows at a time, decoded then transposed
      for (int64_t k = 0; k < 4; ++k) {
        float* row = row_buf.data() + k * cols;
        if (g + k >= nr) {
          std::fill(row, row + cols, 0.0f);
          continue;
        }
        const std::byte* src = task.w.data + (r0 + g + k) * task.row_bytes;
        for (int64_t b = 0; b < cols / Tr::kElems; ++b) {
          Scales<kType>(src + b * block_bytes, scale, bias);
          for (int e = 0; e < Tr::kElems; e += n) {
            hn::StoreU(hn::MulAdd(Elements<kType>(df, src + b * block_bytes, e), hn::Set(df, scale[e / Tr::kSub]),
                                  hn::Set(df, bias[e / Tr::kSub])),
                       df, row + b * Tr::kElems + e);
          }
        }
      }
      // Column c of rows g..g+3 is four consecutive floats of the panel.
      float* panel = buffer + (g / kPanelRows) * panel_elems + g % kPanelRows;
      const float* r4 = row_buf.data();
#if HWY_TARGET != HWY_SCALAR
      const hn::Full128<float> d4;
      for (int64_t c = 0; c < cols; c += 4) {  // cols: a multiple of 32
        const auto a = hn::LoadU(d4, r4 + c), b = hn::LoadU(d4, r4 + cols + c);
        const auto e = hn::LoadU(d4, r4 + 2 * cols + c), f = hn::LoadU(d4, r4 + 3 * cols + c);
        const auto ab_lo = hn::InterleaveLower(d4, a, b), ef_lo = hn::InterleaveLower(d4, e, f);
        const auto ab_hi = hn::InterleaveUpper(d4, a, b), ef_hi = hn::InterleaveUpper(d4, e, f);
        hn::StoreU(hn::ConcatLowerLower(d4, ef_lo, ab_lo), d4, panel + (c + 0) * kPanelRows);
        hn::StoreU(hn::ConcatUpperUpper(d4, ef_lo, ab_lo), d4, panel + (c + 1) * kPanelRows);
        hn::StoreU(hn::ConcatLowerLower(d4, ef_hi, ab_hi), d4, panel + (c + 2) * kPanelRows);
        hn::StoreU(hn::ConcatUpperUpper(d4, ef_hi, ab_hi), d4, panel + (c + 3) * kPanelRows);
      }
#else
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t k = 0; k < 4; ++k) panel[c * kPanelRows + k] = r4[k * cols + c];
      }
#endif
    }
  });
}

// ---- q8_0 in panels (PackedWeights; the layout in kQ8PanelBlockBytes'
// comment). out = the 16 rows' f32 panel [cols][16]: per k-pair, each
// row's two bytes split (the even byte is the low one, sign-extended by a
// shift pair) and scaled.
void DecodeQ8Panel(const std::byte* panel, int64_t cols, float* HWY_RESTRICT out) {
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<int16_t, decltype(df)> d16;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / kQ8Block; ++b) {
    const std::byte* blk = panel + b * kQ8PanelBlockBytes;
    const auto* scales = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* pairs = reinterpret_cast<const int16_t*>(blk + 2 * kPanelRows);
    for (int j = 0; j < kQ8Block / 2; ++j) {
      float* even = out + (b * kQ8Block + 2 * j) * kPanelRows;
      for (int r = 0; r < kPanelRows; r += n) {
        const auto v = hn::LoadU(d16, pairs + j * kPanelRows + r);
        const auto s = hn::PromoteTo(df, hn::LoadU(dh, scales + r));
        const auto lo = hn::ShiftRight<8>(hn::ShiftLeft<8>(v)), hi = hn::ShiftRight<8>(v);
        hn::StoreU(hn::Mul(hn::ConvertTo(df, hn::PromoteTo(d32, lo)), s), df, even + r);
        hn::StoreU(hn::Mul(hn::ConvertTo(df, hn::PromoteTo(d32, hi)), s), df, even + kPanelRows + r);
      }
    }
  }
}

// ---- q4_k and q5_k in panels (the layouts in kQ4KPanelBlockBytes' and
// kQ5KPanelBlockBytes' comments; kFifth: q5_k's fifth bits). out =
// the 16 rows' f32 panel [cols][16]: per sub-block the rows' d * sc and
// dmin * m, per pair of columns each row's two nibbles.
template <bool kFifth>
void DecodeKPanel(const std::byte* panel, int64_t cols, float* out) {
  constexpr int64_t kBlockBytes = kFifth ? kQ5KPanelBlockBytes : kQ4KPanelBlockBytes;
#if HWY_TARGET == HWY_SCALAR
  if constexpr (kFifth) {  // element by element on the scalar target, as DecodeQ6KPanel
    for (int64_t b = 0; b < cols / 256; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kBlockBytes);
      for (int n = 0; n < kPanelRows; ++n) {
        uint16_t h;
        std::memcpy(&h, blk + 2 * n, 2);
        const float d = F16ToF32(h);
        std::memcpy(&h, blk + 32 + 2 * n, 2);
        const float dmin = F16ToF32(h);
        for (int e = 0; e < 256; ++e) {
          const int q = ((blk[KNibbleByte(true, e, n)] >> Q4KNibbleShift(e)) & 0x0F) |
                        ((blk[Q5KFifthByte(e, n)] >> FifthShift(e)) & 1) << 4;
          out[(b * 256 + e) * kPanelRows + n] = d * static_cast<float>(blk[64 + 16 * (e / 32) + n]) * static_cast<float>(q) -
                                                dmin * static_cast<float>(blk[192 + 16 * (e / 32) + n]);
        }
      }
    }
    return;
  }
#endif
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<uint32_t, decltype(df)> d32u;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / 256; ++b) {
    const std::byte* blk = panel + b * kBlockBytes;
    const auto* d = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* dmin = d + kPanelRows;
    const auto* u8 = reinterpret_cast<const uint8_t*>(blk);
    for (int sub = 0; sub < 8; ++sub) {
      for (int r = 0; r < kPanelRows; r += n) {
        const auto sc = hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8, u8 + 64 + 16 * sub + r)));
        const auto m = hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8, u8 + 192 + 16 * sub + r)));
        const auto scale = hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, d + r)), sc);
        const auto bias = hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, dmin + r)), m);
        for (int j = 0; j < 8; ++j) {  // the sub-block's four-column groups
          const int quad = 8 * sub + j;
          // Rows r.. : byte 2n (columns 4 quad and + 2), 2n + 1 (+ 1 and + 3).
          hn::Vec<decltype(d8)> e0, e1;  // bytes 2n and 2n + 1 of rows r..
          hn::LoadInterleaved2(d8, u8 + KNibbleByte(kFifth, 4 * quad, r), e0, e1);
          const auto nib = hn::Set(d32u, 0x0F);
          const auto b0 = hn::PromoteTo(d32u, e0), b1 = hn::PromoteTo(d32u, e1);
          float* col = out + (b * 256 + 4 * quad) * kPanelRows + r;
          auto q0 = hn::And(b0, nib), q1 = hn::And(b1, nib), q2 = hn::ShiftRight<4>(b0), q3 = hn::ShiftRight<4>(b1);
          if constexpr (kFifth) {
            hn::Vec<decltype(d8)> h0, h1;
            hn::LoadInterleaved2(d8, u8 + Q5KFifthByte(4 * quad, r), h0, h1);
            const auto ha = hn::PromoteTo(d32u, h0), hc = hn::PromoteTo(d32u, h1);
            const int sh = j % 4;  // the fifth bits' place for this step
            const auto one = hn::Set(d32u, 1);
            auto bit = [&](auto high, int at) { return hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(high, sh + at), one)); };
            q0 = hn::Or(q0, bit(ha, 0));
            q1 = hn::Or(q1, bit(hc, 0));
            q2 = hn::Or(q2, bit(ha, 4));
            q3 = hn::Or(q3, bit(hc, 4));
          }
          const auto u0 = hn::ConvertTo(df, hn::BitCast(d32, q0));
          const auto u1 = hn::ConvertTo(df, hn::BitCast(d32, q1));
          const auto u2 = hn::ConvertTo(df, hn::BitCast(d32, q2));
          const auto u3 = hn::ConvertTo(df, hn::BitCast(d32, q3));
          hn::StoreU(hn::MulSub(scale, u0, bias), df, col);
          hn::StoreU(hn::MulSub(scale, u1, bias), df, col + kPanelRows);
          hn::StoreU(hn::MulSub(scale, u2, bias), df, col + 2 * kPanelRows);
          hn::StoreU(hn::MulSub(scale, u3, bias), df, col + 3 * kPanelRows);
        }
      }
    }
  }
}

// ---- q4_0 / q4_1 / q5_0 / q5_1 in panels (NibbleFormat's comment). out =
// the 16 rows' f32 panel [cols][16]: per block each row's d * (q - offset) + m.
template <WeightType kType>
void DecodeNibblePanel(const std::byte* panel, int64_t cols, float* out) {
  constexpr NibbleFormat f = NibbleFormatOf(kType);
#if HWY_TARGET == HWY_SCALAR
  // Element by element on the scalar target, as DecodeQ6KPanel.
  for (int64_t b = 0; b < cols / 32; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * f.BlockBytes());
    for (int n = 0; n < kPanelRows; ++n) {
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      float m = 0.0f;
      if constexpr (f.min) {
        std::memcpy(&h, blk + 32 + 2 * n, 2);
        m = F16ToF32(h);
      }
      for (int e = 0; e < 32; ++e) {
        out[(b * 32 + e) * kPanelRows + n] = d * static_cast<float>(NibbleValue(f, blk, e, n) - f.offset) + m;
      }
    }
  }
  return;
#endif
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<uint32_t, decltype(df)> d32u;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / 32; ++b) {
    const std::byte* blk = panel + b * f.BlockBytes();
    const auto* d = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* u8 = reinterpret_cast<const uint8_t*>(blk);
    for (int r = 0; r < kPanelRows; r += n) {
      const auto scale = hn::PromoteTo(df, hn::LoadU(dh, d + r));
      // d * q + bias, bias = m or -offset * d.
      const auto bias = f.min ? hn::PromoteTo(df, hn::LoadU(dh, d + kPanelRows + r))
                              : hn::Mul(scale, hn::Set(df, -static_cast<float>(f.offset)));
      for (int quad = 0; quad < 8; ++quad) {
        hn::Vec<decltype(d8)> l0, l1;  // bytes 2n and 2n + 1 of rows r..
        hn::LoadInterleaved2(d8, u8 + f.NibbleByte(4 * quad, r), l0, l1);
        const auto nib = hn::Set(d32u, 0x0F);
        auto a = hn::PromoteTo(d32u, l0), c = hn::PromoteTo(d32u, l1);
        auto q0 = hn::And(a, nib), q1 = hn::And(c, nib), q2 = hn::ShiftRight<4>(a), q3 = hn::ShiftRight<4>(c);
        if constexpr (f.fifth) {
          hn::Vec<decltype(d8)> h0, h1;
          hn::LoadInterleaved2(d8, u8 + f.FifthByte(4 * quad, r), h0, h1);
          const auto ha = hn::PromoteTo(d32u, h0), hc = hn::PromoteTo(d32u, h1);
          const int sh = quad % 4;  // the fifth bits' place for this step
          const auto one = hn::Set(d32u, 1);
          auto bit = [&](auto high, int at) { return hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(high, sh + at), one)); };
          q0 = hn::Or(q0, bit(ha, 0));
          q1 = hn::Or(q1, bit(hc, 0));
          q2 = hn::Or(q2, bit(ha, 4));
          q3 = hn::Or(q3, bit(hc, 4));
        }
        float* col = out + (b * 32 + 4 * quad) * kPanelRows + r;
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q0)), bias), df, col);
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q1)), bias), df, col + kPanelRows);
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q2)), bias), df, col + 2 * kPanelRows);
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q3)), bias), df, col + 3 * kPanelRows);
      }
    }
  }
}

// ---- q6_k in panels (the layout in kQ6KPanelBlockBytes' comment). out =
// the 16 rows' f32 panel [cols][16]: per four columns each row's low
// nibbles and high bits, times d x the group's scale, less 32 of them.
void DecodeQ6KPanel(const std::byte* panel, int64_t cols, float* out) {
#if HWY_TARGET == HWY_SCALAR
  // The vector form below left the panel unwritten on the scalar target
  // (GCC 12, the first matrix of a test, and not when instrumented; not
  // understood); the scalar target reads the layout element by element.
  for (int64_t b = 0; b < cols / 256; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kQ6KPanelBlockBytes);
    for (int n = 0; n < kPanelRows; ++n) {
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      for (int e = 0; e < 256; ++e) {
        const int low = (blk[Q6KLowByte(e, n)] >> (4 * ((e % 4) / 2))) & 0x0F;
        const int high = (blk[Q6KHighByte(e, n)] >> Q6KHighShift(e)) & 3;
        const float scale = d * static_cast<float>(static_cast<int8_t>(blk[Q6KScaleByte(e / 16, n)]));
        out[(b * 256 + e) * kPanelRows + n] = scale * static_cast<float>(low | high << 4) - scale * 32.0f;
      }
    }
  }
  return;
#endif
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<int8_t, decltype(df)> d8s;
  const hn::Rebind<uint32_t, decltype(df)> d32u;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / 256; ++b) {
    const std::byte* blk = panel + b * kQ6KPanelBlockBytes;
    const auto* d = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* u8 = reinterpret_cast<const uint8_t*>(blk);
    const auto* s8 = reinterpret_cast<const int8_t*>(blk);
    for (int g = 0; g < 16; ++g) {  // 16-element groups: four four-column steps
      for (int r = 0; r < kPanelRows; r += n) {
        const auto scale = hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, d + r)),
                                   hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8s, s8 + Q6KScaleByte(g, r)))));
        const auto offset = hn::Mul(scale, hn::Set(df, 32.0f));
        for (int j = 0; j < 4; ++j) {
          const int quad = 4 * g + j;
          hn::Vec<decltype(d8)> l0, l1, h0, h1;  // bytes 2n and 2n + 1 of rows r..
          hn::LoadInterleaved2(d8, u8 + Q6KLowByte(4 * quad, r), l0, l1);
          hn::LoadInterleaved2(d8, u8 + Q6KHighByte(4 * quad, r), h0, h1);
          const auto a = hn::PromoteTo(d32u, l0), c = hn::PromoteTo(d32u, l1);
          const auto ha = hn::PromoteTo(d32u, h0), hc = hn::PromoteTo(d32u, h1);
          const int sh = 2 * (quad % 2);  // the high bits' place for this group
          const auto three = hn::Set(d32u, 3), nib = hn::Set(d32u, 0x0F);
          auto q6 = [&](auto low, auto high, int at) {
            const auto hi2 = hn::And(hn::ShiftRightSame(high, sh + at), three);
            return hn::ConvertTo(df, hn::BitCast(d32, hn::Or(low, hn::ShiftLeft<4>(hi2))));
          };
          float* col = out + (b * 256 + 4 * quad) * kPanelRows + r;
          hn::StoreU(hn::MulSub(scale, q6(hn::And(a, nib), ha, 0), offset), df, col);
          hn::StoreU(hn::MulSub(scale, q6(hn::And(c, nib), hc, 0), offset), df, col + kPanelRows);
          hn::StoreU(hn::MulSub(scale, q6(hn::ShiftRight<4>(a), ha, 4), offset), df, col + 2 * kPanelRows);
          hn::StoreU(hn::MulSub(scale, q6(hn::ShiftRight<4>(c), hc, 4), offset), df, col + 3 * kPanelRows);
        }
      }
    }
  }
}

// Block-format panels (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k), rows [row_begin, row_end) for every
// token: X as q16 rows (the fast path's few tokens, x86) through the
// panel's integer kernel, two tokens at a time; else the panels decoded to
// f32 once per 32-row tile (DecodedTiles).
template <WeightType kType>
void BlockPanelRange(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  const int64_t cols = task.w.cols, rows = task.w.rows;
  const int64_t panel_bytes = PanelBytes(kType, cols);
  row_end = std::min(row_end, rows);
#ifdef PAGEKV_HAVE_INT_DOT
  if (task.xq != nullptr) {
    [[maybe_unused]] const bool vnni = VnniEnabled();
    float out[2 * kPanelRows];
    for (int64_t r0 = row_begin; r0 < row_end; r0 += kPanelRows) {
      const std::byte* panel = task.w.data + (r0 / kPanelRows) * panel_bytes;
      const int64_t nr = std::min<int64_t>(kPanelRows, row_end - r0);
      for (int64_t t = 0; t < task.tokens; t += 2) {
        const int64_t nt = std::min<int64_t>(2, task.tokens - t);
        const intdot::PanelX x{task.xq + t * cols, task.xd + t * (cols / 32), task.xs + t * (cols / 16), cols};
        auto run = [&]<int kT, bool kVnni>() {
#if HWY_TARGET <= HWY_AVX3
          if constexpr (kType == WeightType::kQ8_0) {
            intdot::Q8Panel512<kT, kVnni>(panel, cols / 32, x, out);
          } else if constexpr (IsNibbleFormat(kType)) {
            constexpr NibbleFormat f = NibbleFormatOf(kType);
            intdot::NibblePanel512<kT, kVnni, f.min, f.fifth, f.offset>(panel, cols / 32, x, out);
          } else if constexpr (kType == WeightType::kQ4_K || kType == WeightType::kQ5_K) {
            intdot::Q4KPanel512<kT, kVnni, 4 / kT, kType == WeightType::kQ5_K>(panel, cols / 256, x, out);
          } else {
            intdot::Q6KPanel512<kT, kVnni>(panel, cols / 256, x, out);
          }
#else
          if constexpr (kType == WeightType::kQ8_0) {
            intdot::Q8Panel<kT, kVnni>(panel, cols / 32, x, out);
          } else if constexpr (IsNibbleFormat(kType)) {
            constexpr NibbleFormat f = NibbleFormatOf(kType);
            intdot::NibblePanel<kT, kVnni, f.min, f.fifth, f.offset>(panel, cols / 32, x, out);
          } else if constexpr (kType == WeightType::kQ4_K || kType == WeightType::kQ5_K) {
            intdot::Q4KPanel<kT, kVnni, kType == WeightType::kQ5_K>(panel, cols / 256, x, out);
          } else {
            intdot::Q6KPanel<kT, kVnni>(panel, cols / 256, x, out);
          }
#endif
        };
#if HWY_TARGET <= HWY_AVX3
        if (vnni) {
          if (nt == 2) {
            run.template operator()<2, true>();
          } else {
            run.template operator()<1, true>();
          }
        } else
#endif
        if (nt == 2) {
          run.template operator()<2, false>();
        } else {
          run.template operator()<1, false>();
        }
        for (int64_t i = 0; i < nt; ++i) {
          std::memcpy(task.y + (t + i) * rows + r0, out + i * kPanelRows, static_cast<size_t>(nr) * 4);
        }
      }
    }
    return;
  }
#endif
  const int64_t panel_elems = cols * kPanelRows;
  DecodedTiles(task, row_begin, row_end, [&](int64_t r0, int64_t, float* buffer) {
    // Rows past the matrix are the packing's zero padding (to 32 rows).
    for (int p = 0; p < kPanelTileRows / kPanelRows; ++p) {
      const std::byte* panel = task.w.data + (r0 / kPanelRows + p) * panel_bytes;
      if constexpr (kType == WeightType::kQ8_0) {
        DecodeQ8Panel(panel, cols, buffer + p * panel_elems);
      } else if constexpr (IsNibbleFormat(kType)) {
        DecodeNibblePanel<kType>(panel, cols, buffer + p * panel_elems);
      } else if constexpr (kType == WeightType::kQ4_K || kType == WeightType::kQ5_K) {
        DecodeKPanel<kType == WeightType::kQ5_K>(panel, cols, buffer + p * panel_elems);
      } else {
        DecodeQ6KPanel(panel, cols, buffer + p * panel_elems);
      }
    }
  });
}

void PanelRangeImpl(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  switch (task.w.type) {
    case WeightType::kF32: return PanelRange<float>(task, row_begin, row_end);
    case WeightType::kF16: return PanelRange<hwy::float16_t>(task, row_begin, row_end);
    case WeightType::kBF16: return PanelRange<hwy::bfloat16_t>(task, row_begin, row_end);
    case WeightType::kQ8_0: return BlockPanelRange<WeightType::kQ8_0>(task, row_begin, row_end);
    case WeightType::kQ4_0: return BlockPanelRange<WeightType::kQ4_0>(task, row_begin, row_end);
    case WeightType::kQ4_1: return BlockPanelRange<WeightType::kQ4_1>(task, row_begin, row_end);
    case WeightType::kQ5_0: return BlockPanelRange<WeightType::kQ5_0>(task, row_begin, row_end);
    case WeightType::kQ5_1: return BlockPanelRange<WeightType::kQ5_1>(task, row_begin, row_end);
    case WeightType::kQ4_K: return BlockPanelRange<WeightType::kQ4_K>(task, row_begin, row_end);
    case WeightType::kQ5_K: return BlockPanelRange<WeightType::kQ5_K>(task, row_begin, row_end);
    case WeightType::kQ6_K: return BlockPanelRange<WeightType::kQ6_K>(task, row_begin, row_end);
    default: return;  // the other block formats are never packed (PackWeights refuses them)
  }
}

void RowRangeImpl(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  if (IsBlockQuantized(task.w.type) && task.tokens >= kDecodedPanelMinTokens) {
    switch (task.w.type) {
      case WeightType::kQ8_0: return DecodedPanelRange<WeightType::kQ8_0>(task, row_begin, row_end);
      case WeightType::kQ4_0: return DecodedPanelRange<WeightType::kQ4_0>(task, row_begin, row_end);
      case WeightType::kQ4_1: return DecodedPanelRange<WeightType::kQ4_1>(task, row_begin, row_end);
      case WeightType::kQ5_0: return DecodedPanelRange<WeightType::kQ5_0>(task, row_begin, row_end);
      case WeightType::kQ5_1: return DecodedPanelRange<WeightType::kQ5_1>(task, row_begin, row_end);
      case WeightType::kQ2_K: return DecodedPanelRange<WeightType::kQ2_K>(task, row_begin, row_end);
      case WeightType::kQ3_K: return DecodedPanelRange<WeightType::kQ3_K>(task, row_begin, row_end);
      case WeightType::kQ4_K: return DecodedPanelRange<WeightType::kQ4_K>(task, row_begin, row_end);
      case WeightType::kQ5_K: return DecodedPanelRange<WeightType::kQ5_K>(task, row_begin, row_end);
      case WeightType::kQ6_K: return DecodedPanelRange<WeightType::kQ6_K>(task, row_begin, row_end);
      default: break;
    }
  }
  switch (task.w.type) {
    case WeightType::kF32: return RowRange<WeightType::kF32>(task, row_begin, row_end);
    case WeightType::kF16: return RowRange<WeightType::kF16>(task, row_begin, row_end);
    case WeightType::kBF16: return RowRange<WeightType::kBF16>(task, row_begin, row_end);
    case WeightType::kQ8_0: return RowRange<WeightType::kQ8_0>(task, row_begin, row_end);
    case WeightType::kQ4_0: return RowRange<WeightType::kQ4_0>(task, row_begin, row_end);
    case WeightType::kQ4_1: return RowRange<WeightType::kQ4_1>(task, row_begin, row_end);
    case WeightType::kQ5_0: return RowRange<WeightType::kQ5_0>(task, row_begin, row_end);
    case WeightType::kQ5_1: return RowRange<WeightType::kQ5_1>(task, row_begin, row_end);
    case WeightType::kQ2_K: return RowRange<WeightType::kQ2_K>(task, row_begin, row_end);
    case WeightType::kQ3_K: return RowRange<WeightType::kQ3_K>(task, row_begin, row_end);
    case WeightType::kQ4_K: return RowRange<WeightType::kQ4_K>(task, row_begin, row_end);
    case WeightType::kQ5_K: return RowRange<WeightType::kQ5_K>(task, row_begin, row_end);
    case WeightType::kQ6_K: return RowRange<WeightType::kQ6_K>(task, row_begin, row_end);
  }
}

const char* MatMulTargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

bool VnniTargetImpl() {
#if defined(PAGEKV_HAVE_INT_DOT) && HWY_TARGET <= HWY_AVX3
  return true;
#else
  return false;
#endif
}

// Whether this target takes the AMX tiles (the AVX-512 ones; tests that
// force a narrower target test that target's own kernels).
bool AmxTargetImpl() { return HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3; }

bool IntDotImpl() {
#ifdef PAGEKV_HAVE_INT_DOT
  return true;
#else
  return false;
#endif
}

// X's rows as q16 (int_dot-inl.h): per 32 values a scale max |x| / 32767
// and the values rounded to int16; per 16 the scale times their sum.
void QuantizeQ16Impl(const float* x, int64_t tokens, int64_t cols, int16_t* xq, float* xd, float* xs) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<int32_t, decltype(df)> di32;
  const hn::Rebind<int16_t, decltype(df)> di16;
  const int64_t n = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < cols / 32; ++b) {
      const float* v = x + t * cols + b * 32;
      auto amax = hn::Zero(df);
      for (int64_t i = 0; i < 32; i += n) amax = hn::Max(amax, hn::Abs(hn::LoadU(df, v + i)));
      const float m = hn::GetLane(hn::MaxOfLanes(df, amax));
      const float d = m / 32767.0f;
      const auto vd = hn::Set(df, d == 0 ? 1.0f : d);  // all zeros: any divisor gives zeros
      int16_t* q = xq + t * cols + b * 32;
      for (int64_t i = 0; i < 32; i += n) {
        const auto r = hn::NearestInt(hn::Div(hn::LoadU(df, v + i), vd));  // round(x / d), ties to even
        hn::StoreU(hn::DemoteTo(di16, r), di16, q + i);
      }
      xd[t * (cols / 32) + b] = d;
      for (int h = 0; h < 2; ++h) {
        int32_t sum = 0;
        for (int i = 0; i < 16; ++i) sum += q[16 * h + i];
        xs[t * (cols / 16) + 2 * b + h] = d * static_cast<float>(sum);
      }
    }
  }
  (void)di32;
}

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagekv {
namespace kernels {
HWY_EXPORT(RowRangeImpl);
HWY_EXPORT(PanelRangeImpl);
HWY_EXPORT(IntDotImpl);
HWY_EXPORT(QuantizeQ16Impl);
HWY_EXPORT(MatMulTargetNameImpl);
HWY_EXPORT(VnniTargetImpl);
HWY_EXPORT(AmxTargetImpl);
namespace {
std::atomic<bool> vnni_allowed{true};
}  // namespace
bool CpuHasAvx512Vnni() {
#if HWY_ARCH_X86 && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}
bool VnniEnabled() { return CpuHasAvx512Vnni() && vnni_allowed.load(std::memory_order_relaxed); }
bool SetVnniForTest(bool allowed) {
  vnni_allowed.store(allowed, std::memory_order_relaxed);
  return CpuHasAvx512Vnni();
}
bool AmxTarget() { return HWY_DYNAMIC_DISPATCH(AmxTargetImpl)(); }
std::string MatMulTargetName() {
  const bool vnni = HWY_DYNAMIC_DISPATCH(VnniTargetImpl)() && VnniEnabled();
  const bool amx = AmxTarget() && AmxMatMulEnabled();
  return std::string(HWY_DYNAMIC_DISPATCH(MatMulTargetNameImpl)()) + (vnni ? "+VNNI" : "") + (amx ? "+AMX" : "");
}
void RowRange(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  HWY_DYNAMIC_DISPATCH(RowRangeImpl)(task, row_begin, row_end);
}
void PanelRange(const MatMulTask& task, int64_t row_begin, int64_t row_end) {
  HWY_DYNAMIC_DISPATCH(PanelRangeImpl)(task, row_begin, row_end);
}
bool IntDot() { return HWY_DYNAMIC_DISPATCH(IntDotImpl)(); }
void QuantizeQ16(const float* x, int64_t tokens, int64_t cols, int16_t* xq, float* xd, float* xs) {
  HWY_DYNAMIC_DISPATCH(QuantizeQ16Impl)(x, tokens, cols, xq, xd, xs);
}
}  // namespace kernels

bool IntActivationsAvailable() { return kernels::IntDot(); }

Status MatMul(const WeightMatrix& w, const float* x, int64_t tokens, float* y, int threads, Activations activations) {
  const MatMulOutput one{w, y};
  return MatMulShared({&one, 1}, x, tokens, threads, activations);
}

Status MatMulShared(std::span<const MatMulOutput> outputs, const float* x, int64_t tokens, int threads,
                    Activations activations) {
  if (x == nullptr) return InvalidArgumentError("matmul: null pointer");
  std::vector<kernels::MatMulTask> tasks;
  std::vector<int64_t> row_ends, first_chunk;  // per output; first_chunk has one more entry
  tasks.reserve(outputs.size());
  int64_t work = 0, chunks = 0;
  // Chunks of 32 rows (a few per thread at least) for load balance; panels
  // end on the padded row count (a multiple of the widest tile).
  // With the AMX tiles, chunks of kAmxMaxRows rows (X is streamed once per chunk).
  auto takes_amx = [&](const WeightMatrix& w) {
    return (w.panels || IsBlockQuantized(w.type)) && tokens >= kernels::AmxMinTokens(w.type);
  };
  bool amx_call = activations == Activations::kFast && !outputs.empty() && outputs[0].w.cols % 32 == 0 &&
                  kernels::AmxMatMulEnabled() && kernels::AmxTarget();
  if (amx_call) {
    bool any = false;
    for (const MatMulOutput& out : outputs) any = any || takes_amx(out.w);
    amx_call = any;
  }
  const int64_t kChunkRows = amx_call ? kernels::AmxRowsPerTask(outputs[0].w.cols) : kernels::kPanelPadRows;
  for (const MatMulOutput& out : outputs) {
    const WeightMatrix& w = out.w;
    if (w.data == nullptr || out.y == nullptr) return InvalidArgumentError("matmul: null pointer");
    if (w.rows <= 0 || w.cols <= 0 || tokens <= 0) {
      return InvalidArgumentError("matmul: rows, cols and tokens must be positive (got " + std::to_string(w.rows) +
                                  ", " + std::to_string(w.cols) + ", " + std::to_string(tokens) + ")");
    }
    const WeightFormat& f = FormatOf(w.type);
    if (w.cols % f.block_elems != 0) {
      return InvalidArgumentError("matmul: " + std::string(f.name) + " rows need a multiple of " +
                                  std::to_string(f.block_elems) + " columns, got " + std::to_string(w.cols));
    }
    if (w.panels && !kernels::PanelLayout(w.type)) {
      return InvalidArgumentError("matmul: " + std::string(f.name) + " weights are never in panels");
    }
    if (w.cols != outputs[0].w.cols) return InvalidArgumentError("matmul: products sharing X need the same column count");
    tasks.push_back({w, WeightRowBytes(w.type, w.cols), x, tokens, out.y});
    row_ends.push_back(w.panels ? (w.rows + kernels::kPanelPadRows - 1) / kernels::kPanelPadRows * kernels::kPanelPadRows : w.rows);
    first_chunk.push_back(chunks);
    chunks += (row_ends.back() + kChunkRows - 1) / kChunkRows;
    work += w.rows * w.cols * tokens;
  }
  first_chunk.push_back(chunks);
  // The integer path: X quantized once for every block-format product of the call.
  bool integer = activations == Activations::kFast && tokens <= kernels::kIntMaxTokens && outputs[0].w.cols % 32 == 0;
  if (integer) {
    integer = false;
    for (const kernels::MatMulTask& t : tasks) integer = integer || IsBlockQuantized(t.w.type);
    integer = integer && IntActivationsAvailable();
  }
  if (integer) {
    const int64_t cols = outputs[0].w.cols;
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> xd, xs;
    xq.resize(static_cast<size_t>(tokens * cols));
    xd.resize(static_cast<size_t>(tokens * cols / 32));
    xs.resize(static_cast<size_t>(tokens * cols / 16));
    kernels::QuantizeQ16(x, tokens, cols, xq.data(), xd.data(), xs.data());
    for (kernels::MatMulTask& t : tasks) {
      if (!IsBlockQuantized(t.w.type)) continue;
      t.xq = xq.data();
      t.xd = xd.data();
      t.xs = xs.data();
    }
  }
  // AMX tiles for many tokens (amx_matmul.h): X split once for every
  // product of the call that takes them (panels, block formats).
  static_assert(kernels::AmxMinTokens(WeightType::kQ8_0) >= kernels::kDecodedPanelMinTokens);
  kernels::AmxActivations amx_x;
  if (amx_call) {
    {
      const int64_t cols = outputs[0].w.cols;
      amx_x = {nullptr, nullptr, tokens, kernels::AmxPaddedTokens(tokens), cols};
      thread_local std::vector<uint16_t> xhi, xlo;
      xhi.resize(static_cast<size_t>(amx_x.tokens_pad * cols));
      xlo.resize(xhi.size());
      // Split on the pool too (it reads X from memory once, at the memory's pace).
      const int64_t pieces = amx_x.tokens_pad / 32;
      uint16_t* const hi = xhi.data();  // this thread's buffers (inside the lambda the names are the worker's)
      uint16_t* const lo = xlo.data();
      auto split = [=](int64_t i) { kernels::AmxSplitActivations(x, tokens, cols, 32 * i, 32 * (i + 1), hi, lo); };
      if (threads == 1 || pieces == 1 || ThreadPool::Shared().RunningAlone()) {
        for (int64_t i = 0; i < pieces; ++i) split(i);
      } else {
        ThreadPool::Shared().ParallelFor(pieces, threads, split);
      }
      amx_x.hi = xhi.data();
      amx_x.lo = xlo.data();
      for (kernels::MatMulTask& t : tasks) {
        if (takes_amx(t.w)) t.amx = &amx_x;
      }
    }
  }
  auto run = [&](size_t o, int64_t begin, int64_t end) {
    end = std::min(end, row_ends[o]);
    if (tasks[o].w.panels) {
      kernels::PanelRange(tasks[o], begin, end);
    } else {
      kernels::RowRange(tasks[o], begin, end);
    }
  };
  // Below ~256 K multiply-adds a call is cheaper on one thread than the
  // hand-off to the pool.
  if (threads == 1 || work < (int64_t{1} << 18) || ThreadPool::Shared().RunningAlone()) {
    for (size_t o = 0; o < tasks.size(); ++o) run(o, 0, row_ends[o]);
    return Status::Ok();
  }
  ThreadPool::Shared().ParallelFor(chunks, threads, [&](int64_t i) {
    const auto o = static_cast<size_t>(std::upper_bound(first_chunk.begin(), first_chunk.end(), i) - first_chunk.begin() - 1);
    const int64_t begin = (i - first_chunk[o]) * kChunkRows;
    run(o, begin, begin + kChunkRows);
  });
  return Status::Ok();
}

Result<PackedWeights> PackedWeights::Pack(const WeightMatrix& w) {
  if (w.data == nullptr || w.rows <= 0 || w.cols <= 0) return InvalidArgumentError("pack weights: empty matrix");
  if (w.panels) return InvalidArgumentError("pack weights: the matrix is already in panels");
  if (!kernels::PanelLayout(w.type)) {
    return InvalidArgumentError("pack weights: " + std::string(FormatOf(w.type).name) +
                                " rows stay row-major (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k and q6_k have a panel layout)");
  }
  const int64_t block = FormatOf(w.type).block_elems;
  if (w.cols % block != 0) {
    return InvalidArgumentError("pack weights: " + std::string(FormatOf(w.type).name) + " rows need a multiple of " +
                                std::to_string(block) + " columns, got " + std::to_string(w.cols));
  }
  const int64_t padded = (w.rows + kernels::kPanelPadRows - 1) / kernels::kPanelPadRows * kernels::kPanelPadRows;
  PackedWeights p;
  const int64_t panel_bytes = kernels::PanelBytes(w.type, w.cols);
  p.bytes_ = padded / kernels::kPanelRows * panel_bytes;
  p.data_.reset(static_cast<std::byte*>(std::aligned_alloc(64, static_cast<size_t>((p.bytes_ + 63) / 64 * 64))));
  if (p.data_ == nullptr) return ResourceExhaustedError("pack weights: out of memory for " + std::to_string(p.bytes_) + " bytes");
  std::memset(p.data_.get(), 0, static_cast<size_t>(p.bytes_));
  const int64_t row_bytes = WeightRowBytes(w.type, w.cols);
  if (w.type == WeightType::kQ6_K) {
    // kQ6KPanelBlockBytes: per panel and block, the rows' d, their group
    // scales, then the values' low nibbles and high bits.
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int n = static_cast<int>(r % kernels::kPanelRows);
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / 256; ++b) {
        const auto* in = reinterpret_cast<const uint8_t*>(src + b * FormatOf(w.type).block_bytes);
        auto* out = reinterpret_cast<uint8_t*>(panel + b * kernels::kQ6KPanelBlockBytes);
        std::memcpy(out + 2 * n, in + 208, 2);
        for (int g = 0; g < 16; ++g) out[kernels::Q6KScaleByte(g, n)] = in[192 + g];
        for (int e = 0; e < 256; ++e) {
          // weight_formats.cc's order: half h, then four runs of 32 (k).
          const int h = e / 128, k = (e % 128) / 32, l = e % 32;
          const uint8_t ql = in[64 * h + l + 32 * (k % 2)];
          const int low = k < 2 ? ql & 0x0F : ql >> 4;
          const int high = (in[128 + 32 * h + l] >> (2 * k)) & 3;
          out[kernels::Q6KLowByte(e, n)] |= static_cast<uint8_t>(low << (4 * ((e % 4) / 2)));
          out[kernels::Q6KHighByte(e, n)] |= static_cast<uint8_t>(high << kernels::Q6KHighShift(e));
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  if (kernels::IsNibbleFormat(w.type)) {
    // kernels::NibbleFormat: per panel and block, the rows' d (and m), then
    // their values' low nibbles (and fifth bits).
    const kernels::NibbleFormat f = kernels::NibbleFormatOf(w.type);
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int n = static_cast<int>(r % kernels::kPanelRows);
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / 32; ++b) {
        const std::byte* in = src + b * FormatOf(w.type).block_bytes;
        auto* out = reinterpret_cast<uint8_t*>(panel + b * f.BlockBytes());
        std::memcpy(out + 2 * n, in, 2);
        if (f.min) std::memcpy(out + 32 + 2 * n, in + 2, 2);
        uint32_t fifth = 0;
        if (f.fifth) std::memcpy(&fifth, in + f.SourceBitsAt(), 4);
        const auto* qs = reinterpret_cast<const uint8_t*>(in + f.SourceNibblesAt());
        for (int e = 0; e < 32; ++e) {  // element e: qs[e]'s low nibble, then qs[e - 16]'s high one; bit e
          const int low = e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4;
          out[f.NibbleByte(e, n)] |= static_cast<uint8_t>(low << kernels::Q4KNibbleShift(e));
          if (f.fifth) out[f.FifthByte(e, n)] |= static_cast<uint8_t>(((fifth >> e) & 1) << kernels::FifthShift(e));
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  if (w.type == WeightType::kQ4_K || w.type == WeightType::kQ5_K) {
    // kQ4KPanelBlockBytes / kQ5KPanelBlockBytes: per panel and block, the
    // rows' d and dmin, their sub-block scales and mins as bytes, then per
    // pair of columns the rows' two nibbles (q5_k: each sub-block's fifth
    // bits after its nibbles).
    const bool fifth = w.type == WeightType::kQ5_K;
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int64_t n = r % kernels::kPanelRows;
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / 256; ++b) {
        const std::byte* in = src + b * FormatOf(w.type).block_bytes;
        auto* out = reinterpret_cast<uint8_t*>(panel + b * kernels::PanelBlockBytes(w.type));
        std::memcpy(out + 2 * n, in, 2);
        std::memcpy(out + 32 + 2 * n, in + 2, 2);
        for (int j = 0; j < 8; ++j) Q4KScaleMin(in, j, out[64 + 16 * j + n], out[192 + 16 * j + n]);  // q5_k's sit alike
        // q5_k: the fifth bits qh[32] at 16 (element e's is bit e / 32 of qh[e % 32]), the nibbles after.
        const auto* qh = reinterpret_cast<const uint8_t*>(in + 16);
        const auto* qs = reinterpret_cast<const uint8_t*>(in + (fifth ? 48 : 16));
        // Element e: chunk e / 64 of qs's 32-byte groups, the low nibble
        // for the first 32 of the chunk, the high one for the rest.
        auto nibble = [&](int e) { return e % 64 < 32 ? qs[32 * (e / 64) + e % 64] & 0x0F : qs[32 * (e / 64) + e % 64 - 32] >> 4; };
        for (int e = 0; e < 256; ++e) {
          out[kernels::KNibbleByte(fifth, e, static_cast<int>(n))] |= static_cast<uint8_t>(nibble(e) << kernels::Q4KNibbleShift(e));
          if (fifth) {
            out[kernels::Q5KFifthByte(e, static_cast<int>(n))] |=
                static_cast<uint8_t>(((qh[e % 32] >> (e / 32)) & 1) << kernels::FifthShift(e));
          }
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  if (w.type == WeightType::kQ8_0) {
    // kQ8PanelBlockBytes: per panel and block, the rows' scales, then per
    // pair of columns the rows' two bytes.
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int64_t n = r % kernels::kPanelRows;
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / kernels::kQ8Block; ++b) {
        const std::byte* in = src + b * kernels::kQ8BlockBytes;
        std::byte* out = panel + b * kernels::kQ8PanelBlockBytes;
        std::memcpy(out + 2 * n, in, 2);
        for (int64_t j = 0; j < kernels::kQ8Block / 2; ++j) {
          std::memcpy(out + 2 * kernels::kPanelRows + j * 2 * kernels::kPanelRows + 2 * n, in + 2 + 2 * j, 2);
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  const int64_t elem = w.type == WeightType::kF32 ? 4 : 2;
  for (int64_t r = 0; r < w.rows; ++r) {
    const std::byte* src = w.data + r * row_bytes;
    std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * w.cols * kernels::kPanelRows * elem;
    const int64_t lane = r % kernels::kPanelRows;
    for (int64_t c = 0; c < w.cols; ++c) {
      std::memcpy(panel + (c * kernels::kPanelRows + lane) * elem, src + c * elem, static_cast<size_t>(elem));
    }
  }
  p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
  return p;
}

bool HasPanelLayout(WeightType type) { return kernels::PanelLayout(type); }

void WeightRow(const WeightMatrix& w, int64_t r, float* out) {
  if (w.type == WeightType::kQ6_K && w.panels) {
    const int n = static_cast<int>(r % kernels::kPanelRows);
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * kernels::PanelBytes(w.type, w.cols);
    for (int64_t b = 0; b < w.cols / 256; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kernels::kQ6KPanelBlockBytes);
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      for (int e = 0; e < 256; ++e) {
        const int low = (blk[kernels::Q6KLowByte(e, n)] >> (4 * ((e % 4) / 2))) & 0x0F;
        const int high = (blk[kernels::Q6KHighByte(e, n)] >> kernels::Q6KHighShift(e)) & 3;
        const auto sc = static_cast<int8_t>(blk[kernels::Q6KScaleByte(e / 16, n)]);
        out[b * 256 + e] = d * static_cast<float>(sc) * static_cast<float>((low | high << 4) - 32);
      }
    }
    return;
  }
  if (kernels::IsNibbleFormat(w.type) && w.panels) {
    const kernels::NibbleFormat f = kernels::NibbleFormatOf(w.type);
    const int n = static_cast<int>(r % kernels::kPanelRows);
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * kernels::PanelBytes(w.type, w.cols);
    for (int64_t b = 0; b < w.cols / 32; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * f.BlockBytes());
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      float m = 0.0f;
      if (f.min) {
        std::memcpy(&h, blk + 32 + 2 * n, 2);
        m = F16ToF32(h);
      }
      for (int e = 0; e < 32; ++e) out[b * 32 + e] = d * static_cast<float>(kernels::NibbleValue(f, blk, e, n) - f.offset) + m;
    }
    return;
  }
  if ((w.type == WeightType::kQ4_K || w.type == WeightType::kQ5_K) && w.panels) {
    const bool fifth = w.type == WeightType::kQ5_K;
    const int64_t n = r % kernels::kPanelRows;
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * kernels::PanelBytes(w.type, w.cols);
    for (int64_t b = 0; b < w.cols / 256; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kernels::PanelBlockBytes(w.type));
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      std::memcpy(&h, blk + 32 + 2 * n, 2);
      const float dmin = F16ToF32(h);
      for (int e = 0; e < 256; ++e) {
        const int sub = e / 32;
        int u = (blk[kernels::KNibbleByte(fifth, e, static_cast<int>(n))] >> kernels::Q4KNibbleShift(e)) & 0x0F;
        if (fifth) u |= ((blk[kernels::Q5KFifthByte(e, static_cast<int>(n))] >> kernels::FifthShift(e)) & 1) << 4;
        out[b * 256 + e] = d * static_cast<float>(blk[64 + 16 * sub + n]) * static_cast<float>(u) -
                           dmin * static_cast<float>(blk[192 + 16 * sub + n]);
      }
    }
    return;
  }
  if (w.type == WeightType::kQ8_0 && w.panels) {
    const int64_t n = r % kernels::kPanelRows;
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * (w.cols / kernels::kQ8Block * kernels::kQ8PanelBlockBytes);
    for (int64_t b = 0; b < w.cols / kernels::kQ8Block; ++b) {
      const std::byte* blk = panel + b * kernels::kQ8PanelBlockBytes;
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float scale = F16ToF32(h);
      for (int64_t e = 0; e < kernels::kQ8Block; ++e) {
        const auto q = static_cast<int8_t>(blk[2 * kernels::kPanelRows + (e / 2) * 2 * kernels::kPanelRows + 2 * n + e % 2]);
        out[b * kernels::kQ8Block + e] = scale * static_cast<float>(q);
      }
    }
    return;
  }
  if (IsBlockQuantized(w.type)) {  // row-major only
    DecodeWeights(w.type, w.data + r * WeightRowBytes(w.type, w.cols), w.cols, out);
    return;
  }
  // Element i of row r: adjacent to element i - 1 in a row-major matrix;
  // in panels, kPanelRows elements (one column of the panel) further on.
  const int64_t elem = w.type == WeightType::kF32 ? 4 : 2;
  const std::byte* p = w.panels ? w.data + ((r / kernels::kPanelRows) * w.cols * kernels::kPanelRows + r % kernels::kPanelRows) * elem
                                : w.data + r * WeightRowBytes(w.type, w.cols);
  const int64_t step = w.panels ? kernels::kPanelRows * elem : elem;
  uint16_t h;
  for (int64_t i = 0; i < w.cols; ++i) {
    switch (w.type) {
      case WeightType::kF32: std::memcpy(&out[i], p + step * i, 4); break;
      case WeightType::kF16: std::memcpy(&h, p + step * i, 2); out[i] = F16ToF32(h); break;
      case WeightType::kBF16: std::memcpy(&h, p + step * i, 2); out[i] = BF16ToF32(h); break;
      default: break;  // block formats: above
    }
  }
}

}  // namespace pagekv
#endif  // HWY_ONCE
