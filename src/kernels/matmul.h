// Weight-matrix products for the model runner: Y = X W^T, where W holds the
// model's weights in their stored type and X a batch of activation rows.
//
//   W  [rows][cols]   f32, f16, bf16, or any ggml block format of
//                     kernels/weight_formats.h (q4_0 ... q6_k), read in place
//   X  [tokens][cols] f32
//   Y  [tokens][rows] f32
//
// One step of a batch carries every sequence's tokens through the same
// weights, so the kernel reads each weight row once per call and uses it for
// a tile of up to 4 tokens at a time from registers (4 weight rows x 4 tokens
// = 16 accumulators), converting f16 / bf16 / int8 to f32 in registers. With
// few tokens the call is bound by weight bytes; with many, by FMA throughput.
// Block-quantized rows are decoded one block at a time into an f32 tile in
// L1 (the scales and minimums applied by one multiply-add per element) and
// that tile serves every token of the tile: with one token the call costs
// the decode, with many it is bound by FMA throughput like f32 weights.
// Rows are split over the thread pool. SIMD through Highway with run-time
// dispatch (AVX-512, AVX2, SSE4, scalar). docs/PERFORMANCE.md has the
// measurements and the comparison with OpenBLAS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/weight_formats.h"
#include "pagekv/status.h"

namespace pagekv {

struct WeightMatrix {
  const std::byte* data = nullptr;
  WeightType type = WeightType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;  // a multiple of the format's block (32 or 256 elements)
  // false: row-major [rows][cols]. true: PackedWeights' panel layout, rows in
  // groups of 16 stored column by column ([rows/16][cols][16], zero rows
  // padding the count to a multiple of 32); f32, f16, bf16, and q8_0, q4_0,
  // q4_1, q5_0, q5_1, q4_k, q5_k, q6_k in their own panel layouts (matmul.cc: per panel and block the 16
  // rows' scales, then each column pair's or four columns' 16 rows together,
  // in the order the one-token kernels read them).
  bool panels = false;
};

// How the weights meet the activations. kF32: every product in f32 (the
// exact path: the same sums as a product of the decoded weights, up to
// their order, whatever the call's token count). kFast, the engine's
// default, trades the last bits for speed:
//   - block formats, calls of fewer than 16 tokens: the activations are
//     rounded to int16 in blocks of 32 (a scale per block) and the products
//     are integer dot products (kernels/int_dot-inl.h; x86 with AVX2 and up,
//     else the f32 path);
//   - calls of 16 tokens and more on a CPU with AMX-BF16 (panels and block
//     formats): Intel AMX tiles with X and W split into bf16 hi + lo
//     (kernels/amx_matmul.h: within about 3 x 2^-18 of each |x w|);
//   - everything else: the f32 path.
enum class Activations : uint8_t { kF32, kFast };

// Y[t][r] = sum_c X[t][c] * W[r][c] for t < tokens. `threads` = 0 uses the
// whole shared pool. Errors: null pointers, non-positive sizes, a block
// format with cols not a multiple of its block.
Status MatMul(const WeightMatrix& w, const float* x, int64_t tokens, float* y, int threads = 0,
              Activations activations = Activations::kF32);

// Several products of the same X in one hand-off to the pool (the q, k and
// v projections; the gate and up projections): outputs[i].y = X
// outputs[i].w^T, every w with the same column count. Same errors as MatMul.
struct MatMulOutput {
  WeightMatrix w;
  float* y = nullptr;
};
Status MatMulShared(std::span<const MatMulOutput> outputs, const float* x, int64_t tokens, int threads = 0,
                    Activations activations = Activations::kF32);

// Whether this CPU runs kFast's few-token block-format products as integer
// products (else as f32).
bool IntActivationsAvailable();

namespace kernels {
// The target the weight products dispatch to now, "+VNNI" where the
// int16-activation products use AVX-512 VNNI's vpdpwssd (AVX-512 targets on
// a CPU that has it, unless a test turned it off).
std::string MatMulTargetName();
// AVX-512 VNNI (with VL) on this CPU, and allowed (SetVnniForTest).
bool VnniEnabled();
// Tests force the path without VNNI (false) or allow it again (true);
// returns whether the CPU has it at all.
bool SetVnniForTest(bool allowed);
}  // namespace kernels

// Whether PackedWeights has a panel layout for this type (f32, f16, bf16,
// q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k).
bool HasPanelLayout(WeightType type);

// Row r of W converted to f32 (the embedding lookup); either layout.
void WeightRow(const WeightMatrix& w, int64_t r, float* out);

// A copy of a row-major f32 / f16 / bf16 / q8_0 / q4_0 / q4_1 / q5_0 / q5_1 / q4_k / q5_k / q6_k
// matrix regrouped into
// panels (WeightMatrix::panels), owned here. With panels, a product
// broadcasts each token's X element (q8_0: pair of elements) against one
// vector of 16 rows' weights, so it needs no horizontal sums and runs near
// the FMA peak even when rows are short (a model of dim 256: ~2x the
// row-major kernel from 8 tokens up); with one token it streams the same
// bytes as the row-major kernel, front to back (q8_0: the hardware
// prefetchers follow one stream instead of four interleaved rows; q4_k /
// q6_k: scales decoded once at packing).
// docs/PERFORMANCE.md has the figures. Errors: the other block formats
// (they stay row-major), a matrix already in panels, out of memory.
class PackedWeights {
 public:
  static Result<PackedWeights> Pack(const WeightMatrix& w);
  const WeightMatrix& matrix() const { return matrix_; }
  int64_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  int64_t bytes_ = 0;
  WeightMatrix matrix_;
};

}  // namespace pagekv
