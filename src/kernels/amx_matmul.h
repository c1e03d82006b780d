// Weight products (matmul.h) through Intel AMX-BF16 tiles, for calls of
// many tokens (prefill) on CPUs that have them.
//
// Y = X W^T with X the A tiles (16 tokens x 32 columns, row-major as the
// activations are) and W the B tiles (32 columns x 16 rows, pairs of
// columns interleaved per row: the "VNNI" layout), converted from the
// weights' 16-row panels (PackedWeights, or block formats decoded into an
// f32 panel per tile) once per 32-row tile and call. Each C tile (16 tokens
// x 16 rows, f32) is stored straight into Y.
//
// Accuracy: the tiles multiply bf16 (8 significant bits), so X and W are
// split into bf16 hi + lo, each rounded to nearest even (x - hi - lo within
// 2^-18 |x|), and each product is hi.hi + lo.hi + hi.lo, the products exact
// in f32 and summed in f32: within about 3 x 2^-18 of |x w| per term (the
// f32 path's own rounding is 2^-24 per sum). bf16 weights are exact as
// hi (two products), f16 weights exactly hi + lo.
#pragma once

#include <cstdint>

#include "kernels/weight_formats.h"

namespace pagekv::kernels {

// Whether the AMX weight products may run: the CPU and kernel allow AMX-BF16
// (amx_support.h) and no test turned the path off. SetAmxMatMulForTest
// returns whether the CPU and kernel allow it at all.
bool AmxMatMulEnabled();
bool SetAmxMatMulForTest(bool allowed);

// Fewest tokens a call needs to take the tiles: measured against the f32
// vector kernels (docs/PERFORMANCE.md): bf16 weights win from 16 tokens,
// block formats break even at 16 and win from 32, f32 / f16 panels lose at
// 16 and win from 32.
constexpr int64_t AmxMinTokens(WeightType type) { return type == WeightType::kBF16 ? 16 : 32; }

// One call's X split for the tiles: tokens_pad x cols bf16 each (tile-major,
// amx_matmul.cc TileOffset), the rows
// past `tokens` zero, tokens_pad a multiple of 32.
struct AmxActivations {
  const uint16_t* hi = nullptr;
  const uint16_t* lo = nullptr;
  int64_t tokens = 0, tokens_pad = 0, cols = 0;
};

inline int64_t AmxPaddedTokens(int64_t tokens) { return (tokens + 31) / 32 * 32; }

// Fills tokens [t_begin, t_end) of hi and lo (each AmxPaddedTokens(tokens)
// x cols; tokens past `tokens` zero) from x [tokens][cols]. cols: a
// multiple of 32. Call only where AmxMatMulEnabled().
void AmxSplitActivations(const float* x, int64_t tokens, int64_t cols, int64_t t_begin, int64_t t_end, uint16_t* hi,
                         uint16_t* lo);

enum class AmxPanelType : uint8_t { kF32, kF16, kBF16 };

// Most rows one multiplication takes (the tasks matmul.cc hands to its
// threads): X is streamed once per this many rows.
inline constexpr int kAmxMaxRows = 128;

// The rows a task stages (a multiple of 32, at most kAmxMaxRows) and the
// tokens the multiplication walks at a time (a multiple of 32): their B and
// A tiles (4 bytes per weight or activation, hi and lo) stay within about
// 768 and 512 KiB of the core's 2 MiB L2, since what spills is read back at
// DRAM speed on the machines measured (docs/PERFORMANCE.md).
inline int64_t AmxRowsPerTask(int64_t cols) {
  const int64_t fit = (int64_t{768} << 10) / (cols * 4) / 32 * 32;
  return fit < 32 ? 32 : fit > kAmxMaxRows ? kAmxMaxRows : fit;
}
inline int64_t AmxTokensPerChunk(int64_t cols) {
  const int64_t fit = (int64_t{512} << 10) / (cols * 4) / 32 * 32;
  return fit < 32 ? 32 : fit;
}

// Converts `count` 16-row panels of W ([cols][16] elements of `type` each,
// `panel_elems` elements apart) into B tiles, as panels first .. first +
// count - 1 of the calling thread's staging buffer (first + count <=
// AmxRowsPerTask(cols) / 16). cols: a multiple of 32.
void AmxStagePanels(int first, int count, const void* panels, AmxPanelType type, int64_t panel_elems, int64_t cols);

// y[t * y_stride + i] = sum_c X[t][c] W[i][c] for t < x.tokens and
// i < valid_rows (<= kAmxMaxRows), W the rows staged on this thread (every
// panel up to the 32-row tile that holds row valid_rows - 1; rows past
// valid_rows are multiplied but never written out). w_exact: every staged
// panel was bf16 (its lo parts are zero and skipped). Call only where
// AmxMatMulEnabled().
void AmxMultiplyStaged(const AmxActivations& x, int valid_rows, bool w_exact, float* y, int64_t y_stride);

}  // namespace pagekv::kernels
