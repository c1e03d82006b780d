// Y = X W^T for the model runner (see matmul.h): the kernels, compiled for
// every Highway target and chosen at run time (matmul_driver.cc cuts a
// call's rows into chunks for the thread pool and calls them).
//
// Work: inside a chunk,
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
#include "kernels/int_panels-inl.h"
#include "kernels/matmul_internal.h"
#include "kernels/panel_decode-inl.h"
#include "layout/float16.h"

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
}  // namespace pagekv
#endif  // HWY_ONCE
