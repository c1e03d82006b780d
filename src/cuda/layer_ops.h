// The model's per-row and per-element ops on the GPU, the counterparts of
// kernels/ops.h with the same arithmetic in f32 (the sums of RmsNorm in
// another order), plus the moves the CUDA backend builds its block transfers
// from. Every function enqueues on `stream` and returns the launch's error
// (cudaErrorInvalidValue for a bad size); pointers are device memory.
//
// Needs only the CUDA runtime, like paged_attention.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/paged_attention.h"

namespace pagekv::cuda {

// out[r][i] = weight[i] * (x[r][i] / sqrt(mean_i(x[r][i]^2) + eps)); out may be x.
cudaError_t RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps, float* out,
                        cudaStream_t stream);
// x[r][j] += bias[j].
cudaError_t AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width, cudaStream_t stream);
// x[i] += y[i].
cudaError_t AddInPlace(float* x, const float* y, int64_t n, cudaStream_t stream);
// gate[i] = silu(gate[i]) * up[i].
cudaError_t SwiGluInPlace(float* gate, const float* up, int64_t n, cudaStream_t stream);
// gate[i] = gelu_tanh(gate[i]) * up[i].
cudaError_t GeluGluInPlace(float* gate, const float* up, int64_t n, cudaStream_t stream);
// x[i] *= s.
cudaError_t ScaleInPlace(float* x, float s, int64_t n, cudaStream_t stream);
// Rotary embedding with precomputed tables (kernels/ops.h Rope::Tables):
// each head of each row, the first rope_dims elements, pairs (2i, 2i + 1)
// or, with `halves`, (i, i + rope_dims / 2): x' = x * cos + partner * sin.
cudaError_t RopeApply(float* x, int64_t rows, int32_t width, int32_t head_dim, int32_t rope_dims, bool halves,
                      const float* cos, const float* sin, cudaStream_t stream);
// `rows` rows of `elems` floats to stored rows of `type`, dst_row_bytes
// apart (the 8-bit formats with their trailing f16 scale, encoded with the
// host encoder's arithmetic: kv_store.cu's).
cudaError_t EncodeRows(KvType type, int32_t elems, const float* src, int64_t rows, void* dst, int64_t dst_row_bytes,
                       cudaStream_t stream);
// f32 to f16 / bf16, rounded to nearest even (activations for 16-bit matmuls).
cudaError_t ToHalf(const float* x, int64_t n, void* out, cudaStream_t stream);
cudaError_t ToBf16(const float* x, int64_t n, void* out, cudaStream_t stream);

// KV store by slot mapping of rows already encoded: token t's `heads` rows
// (src: [tokens][heads] rows of row_bytes) go to slot slots[t] = block *
// block_len + offset of `plane` (head h's slab of block b at plane + h *
// head_stride + b * slab_stride); a negative slot is skipped.
cudaError_t ScatterRows(const int64_t* slots, int64_t tokens, int32_t heads, int64_t row_bytes, int32_t block_len,
                        const void* src, void* plane, int64_t head_stride, int64_t slab_stride, cudaStream_t stream);

// Reads n 16-byte vectors at `p` once, every thread a strided share (the
// device's streaming read rate: what decode attention is judged by); `sink`
// gets a value only the compiler cannot rule out.
cudaError_t ReadStream(const void* p, int64_t vectors, float* sink, cudaStream_t stream);

// Byte moves: span i copies spans[i].bytes bytes from src + spans[i].from to
// dst + spans[i].to, 16 bytes at a time where all three allow it. Spans of
// one call must not overlap each other's destinations.
struct SpanCopy {
  int64_t from = 0, to = 0, bytes = 0;
};
cudaError_t CopySpans(const SpanCopy* spans, int64_t count, const void* src, void* dst, cudaStream_t stream);

}  // namespace pagekv::cuda
