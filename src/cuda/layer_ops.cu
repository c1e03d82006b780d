// The GPU's layer ops (see layer_ops.h).
#include "cuda/layer_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/encode_row.cuh"

namespace pagekv::cuda {
namespace {

constexpr int kThreads = 256;

unsigned Grid(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, int64_t{1} << 20));
}

template <typename F>
__global__ void EachKernel(int64_t n, F f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    f(i);
  }
}

template <typename F>
cudaError_t Each(int64_t n, cudaStream_t stream, F f) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  EachKernel<<<Grid(n), kThreads, 0, stream>>>(n, f);
  return cudaGetLastError();
}

__global__ void __launch_bounds__(kThreads) RmsNormKernel(const float* x, const float* w, int32_t width, float eps,
                                                          float* out) {
  __shared__ float partial[kThreads / 32];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * width;
  float* o = out + static_cast<int64_t>(blockIdx.x) * width;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < width; i += kThreads) ss = fmaf(xr[i], xr[i], ss);
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, s);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) total += partial[i];
  const float scale = 1.0f / sqrtf(total / static_cast<float>(width) + eps);
  __syncthreads();  // every thread has read `partial` before any writes out (out may be x)
  for (int i = threadIdx.x; i < width; i += kThreads) o[i] = w[i] * (scale * xr[i]);
}

constexpr int kWarps = 4;

// EncodeRow (encode_row.cuh) over rows of a plain array: a warp per row.
__global__ void __launch_bounds__(kWarps * 32) EncodeKernel(KvType type, int32_t d, const float* src, int64_t rows,
                                                            char* dst, int64_t row_bytes) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;
  EncodeRow(type, src + r * d, d, dst + r * row_bytes, static_cast<int>(threadIdx.x % 32));
}

__global__ void CopySpansKernel(const SpanCopy* spans, const char* src, char* dst) {
  const SpanCopy sc = spans[blockIdx.x];
  const char* from = src + sc.from;
  char* to = dst + sc.to;
  const auto bits = reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to);
  int64_t done = 0;
  if (bits % 16 == 0) {
    const int64_t n = sc.bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
    done = n * 16;
  }
  for (int64_t i = done + threadIdx.x; i < sc.bytes; i += blockDim.x) to[i] = from[i];
}

__global__ void ScatterRowsKernel(const int64_t* slots, int32_t heads, int64_t row_bytes, int32_t block_len,
                                  const char* src, char* plane, int64_t head_stride, int64_t slab_stride) {
  const int64_t t = blockIdx.x;
  const int32_t h = static_cast<int32_t>(blockIdx.y);
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const char* from = src + (t * heads + h) * row_bytes;
  char* to = plane + h * head_stride + (slot / block_len) * slab_stride + (slot % block_len) * row_bytes;
  const auto bits = reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) | static_cast<uintptr_t>(row_bytes);
  if (bits % 16 == 0) {
    for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) {
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) to[i] = from[i];
  }
}

__global__ void ReadStreamKernel(const float4* p, int64_t n, float* sink) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = p[i];
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 12345.678f) *sink = acc;  // keeps the loads
}

}  // namespace

cudaError_t ReadStream(const void* p, int64_t vectors, float* sink, cudaStream_t stream) {
  if (vectors < 0) return cudaErrorInvalidValue;
  if (vectors == 0) return cudaSuccess;
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t ctas = std::min<int64_t>(static_cast<int64_t>(sms) * 8, (vectors + 255) / 256);
  ReadStreamKernel<<<static_cast<unsigned>(std::max<int64_t>(ctas, 1)), 256, 0, stream>>>(
      static_cast<const float4*>(p), vectors, sink);
  return cudaGetLastError();
}

cudaError_t ScatterRows(const int64_t* slots, int64_t tokens, int32_t heads, int64_t row_bytes, int32_t block_len,
                        const void* src, void* plane, int64_t head_stride, int64_t slab_stride, cudaStream_t stream) {
  if (tokens < 0 || tokens > 0x7fffffff || heads < 1 || heads > 65535 || row_bytes < 1 || block_len < 1) {
    return cudaErrorInvalidValue;
  }
  if (tokens == 0) return cudaSuccess;
  ScatterRowsKernel<<<dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(heads)), 64, 0, stream>>>(
      slots, heads, row_bytes, block_len, static_cast<const char*>(src), static_cast<char*>(plane), head_stride,
      slab_stride);
  return cudaGetLastError();
}

cudaError_t RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps, float* out,
                        cudaStream_t stream) {
  if (rows < 0 || width < 1 || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, width, eps, out);
  return cudaGetLastError();
}

cudaError_t AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width, cudaStream_t stream) {
  if (width < 1) return cudaErrorInvalidValue;
  return Each(rows * width, stream, [=] __device__(int64_t i) { x[i] += bias[i % width]; });
}

cudaError_t AddInPlace(float* x, const float* y, int64_t n, cudaStream_t stream) {
  return Each(n, stream, [=] __device__(int64_t i) { x[i] += y[i]; });
}

cudaError_t SwiGluInPlace(float* gate, const float* up, int64_t n, cudaStream_t stream) {
  return Each(n, stream, [=] __device__(int64_t i) {
    const float g = gate[i];
    // exp(-g) clamped to [-88, 88] as the host kernels do; NaN stays NaN.
    const float ng = g == g ? fminf(fmaxf(-g, -88.0f), 88.0f) : 0.0f;
    gate[i] = g / (1.0f + expf(ng)) * up[i];
  });
}

cudaError_t GeluGluInPlace(float* gate, const float* up, int64_t n, cudaStream_t stream) {
  return Each(n, stream, [=] __device__(int64_t i) {
    const float g = gate[i];
    const float c1 = -2.0f * 0.7978845608028654f, c3 = c1 * 0.044715f;
    const float m2u = g * fmaf(c3, g * g, c1);
    const float e = g == g ? fminf(fmaxf(m2u, -88.0f), 88.0f) : 0.0f;
    gate[i] = g / (1.0f + expf(e)) * up[i];
  });
}

cudaError_t ScaleInPlace(float* x, float s, int64_t n, cudaStream_t stream) {
  return Each(n, stream, [=] __device__(int64_t i) { x[i] *= s; });
}

cudaError_t RopeApply(float* x, int64_t rows, int32_t width, int32_t head_dim, int32_t rope_dims, bool halves,
                      const float* cos, const float* sin, cudaStream_t stream) {
  if (head_dim < 1 || width % head_dim != 0 || rope_dims < 0 || rope_dims > head_dim || rope_dims % 2 != 0) {
    return cudaErrorInvalidValue;
  }
  const int32_t heads = width / head_dim, pairs = rope_dims / 2;
  // One thread per pair: it reads both elements before writing either.
  return Each(rows * heads * pairs, stream, [=] __device__(int64_t i) {
    const int64_t r = i / (heads * pairs);
    const int32_t h = static_cast<int32_t>(i / pairs % heads), k = static_cast<int32_t>(i % pairs);
    float* head = x + r * width + static_cast<int64_t>(h) * head_dim;
    const float* cs = cos + r * rope_dims;
    const float* sn = sin + r * rope_dims;
    const int32_t a = halves ? k : 2 * k, b = halves ? k + pairs : 2 * k + 1;
    const float xa = head[a], xb = head[b];
    head[a] = fmaf(xa, cs[a], xb * sn[a]);
    head[b] = fmaf(xb, cs[b], xa * sn[b]);
  });
}

cudaError_t EncodeRows(KvType type, int32_t elems, const float* src, int64_t rows, void* dst, int64_t dst_row_bytes,
                       cudaStream_t stream) {
  if (elems < 1 || rows < 0 || static_cast<int32_t>(type) < 0 ||
      static_cast<int32_t>(type) > static_cast<int32_t>(KvType::kFp8E5M2) ||
      dst_row_bytes < RowBytesNeeded(type, elems) || dst_row_bytes % (ScaledRows(type) ? 1 : ElementBytes(type)) != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  EncodeKernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      type, elems, src, rows, static_cast<char*>(dst), dst_row_bytes);
  return cudaGetLastError();
}

cudaError_t ToHalf(const float* x, int64_t n, void* out, cudaStream_t stream) {
  auto* o = static_cast<__half*>(out);
  return Each(n, stream, [=] __device__(int64_t i) { o[i] = __float2half_rn(x[i]); });
}

cudaError_t ToBf16(const float* x, int64_t n, void* out, cudaStream_t stream) {
  auto* o = static_cast<__nv_bfloat16*>(out);
  return Each(n, stream, [=] __device__(int64_t i) { o[i] = __float2bfloat16_rn(x[i]); });
}

cudaError_t CopySpans(const SpanCopy* spans, int64_t count, const void* src, void* dst, cudaStream_t stream) {
  if (count < 0 || count > 0x7fffffff) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  CopySpansKernel<<<static_cast<unsigned>(count), 256, 0, stream>>>(spans, static_cast<const char*>(src),
                                                                    static_cast<char*>(dst));
  return cudaGetLastError();
}

}  // namespace pagekv::cuda
