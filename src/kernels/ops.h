// The per-row operations of a transformer layer besides the weight products
// and attention: RMSNorm, rotary embedding, SwiGLU, bias and residual adds,
// and the conversion of K / V rows to the cache's storage format. Each is
// compiled for every Highway target and dispatched at run time like the
// matmul and attention kernels (kernels::SetTargetForTest forces a target);
// ops_test.cc checks every target against scalar references.
//
// Rows are contiguous: `rows` x `width` floats, row r at x + r * width.
// Thread safety: stateless; callers split rows over threads as they like
// (every op works row by row, so the split never changes a result).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pagekv/dtype.h"

namespace pagekv {

// out[r][i] = weight[i] * (x[r][i] / sqrt(mean_i(x[r][i]^2) + eps)).
// out may be x.
void RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps, float* out);

// x[r][j] += bias[j].
void AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width);

// x[i] += y[i].
void AddInPlace(float* x, const float* y, int64_t n);

// gate[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)).
void SwiGluInPlace(float* gate, const float* up, int64_t n);

// gate[i] = gelu(gate[i]) * up[i] with GELU's tanh approximation (Gemma's
// GeGLU, ggml_gelu): gelu(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g +
// 0.044715 g^3), computed as g / (1 + exp(-2u)).
void GeluGluInPlace(float* gate, const float* up, int64_t n);

// x[i] *= s.
void ScaleInPlace(float* x, float s, int64_t n);

// Rotary position embedding of the first rope_dims dimensions of each head:
// pairs (2i, 2i + 1) (llama's GGUF convention) or, with halves, (i, i +
// rope_dims / 2) (NEOX: qwen2) turn by pos * theta^(-2i / rope_dims), each
// frequency divided by freq_divisors[i] when given (llama3 / rope_freqs),
// angles times freq_scale (linear scaling), or YaRN's blend of scaled and
// unscaled angles between its correction dimensions with cos / sin scaled
// by its magnitude factor (ggml's rope_yarn, beta_fast 32, beta_slow 1).
struct RopeParams {
  int32_t head_dim = 0;
  int32_t rope_dims = 0;  // even, <= head_dim
  bool halves = false;
  float theta = 10000.0f;
  float freq_scale = 1.0f;
  bool yarn = false;
  float yarn_attn_factor = 1.0f;
  int32_t yarn_orig_context = 0;
  std::vector<float> freq_divisors;  // [rope_dims / 2], or empty
};

// The per-frequency constants of a RopeParams, computed once (at load).
class Rope {
 public:
  explicit Rope(RopeParams params);
  const RopeParams& params() const { return p_; }
  // Tables for rows at `positions`: cos[r][rope_dims] and sin[r][rope_dims],
  // laid out so that the rotated x' = x * cos + partner(x) * sin lane by lane
  // (partner: the other element of each pair; sin carries its sign). Angles
  // are computed in double.
  void Tables(std::span<const int64_t> positions, float* cos, float* sin) const;
  // Rotates `rows` rows of `width` floats (whole heads: width a multiple of
  // head_dim) in place, row r with the tables' row r.
  void Apply(float* x, int64_t rows, int32_t width, const float* cos, const float* sin) const;

 private:
  RopeParams p_;
  std::vector<double> freq_, mix_;
  double mscale_ = 1.0;
};

// Bytes one row of `elems` values takes in the K / V rows EncodeKvRows
// writes for `format`: the cache's row (FormatRowBytes) for plain and per-row
// scaled formats, f16 for KIVI (the cache quantizes each group of tokens
// when it fills).
int64_t EncodedRowBytes(const KvFormat& format, int32_t elems);

// Converts `rows` rows of `elems` floats to `format`'s rows, dst + r *
// EncodedRowBytes: f32 copied, f16 / bf16 rounded to nearest even (KIVI
// rows as f16), int8 / fp8 with one f16 scale per row after the row's
// Hadamard rotation when the format says so. Bit-identical to the scalar
// encoders of layout/ on every target.
void EncodeKvRows(const KvFormat& format, int32_t elems, const float* src, int64_t rows, std::byte* dst);

}  // namespace pagekv
