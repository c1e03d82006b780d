// Paged decode attention on the GPU (see paged_attention.h).
//
// One CTA of 128 threads per (KV head, sequence, split). Per chunk of 64
// tokens of the split's range:
//   1. scores: thread i takes (query head g, token t) pairs; it reads the K
//      row through the block table with 16-byte loads and dots it with the
//      group's q, held in shared memory (the G query heads of a KV head read
//      each K row from L1 after the first);
//   2. online softmax: one warp per query head, max and sum over the chunk
//      by shuffles; the running max, sum and the factor that rescales the
//      accumulators in shared memory;
//   3. P.V: thread i owns dimensions i and i + 128 of every query head's
//      accumulator (registers); each token's V row is read once, coalesced
//      across the CTA, and serves all G heads.
// Each split leaves its unnormalised accumulator and (max, sum); the merge
// kernel adds the splits by their log-sum-exps. One split writes the output
// directly.
#include "cuda/paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/kv_codec.h"
#include "cuda/prefill_tile.cuh"
#include "cuda/tensor_core_kernels.h"

namespace pagekv::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 64;
constexpr int kMaxG = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;  // 2
// Tokens per softmax update in the chunk kernel: more loads in flight per
// phase and fewer barriers per token than the general kernel's 64.
constexpr int kTile = 256;

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr int kPerLoad = 4;  // 16 bytes
  __device__ static void Load(const void* p, float* out) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  }
  __device__ static float One(const void* p, int i) { return static_cast<const float*>(p)[i]; }
};
template <>
struct Elem<__half> {
  static constexpr int kPerLoad = 8;
  __device__ static void Load(const void* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ static float One(const void* p, int i) { return __half2float(static_cast<const __half*>(p)[i]); }
};
template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kPerLoad = 8;
  __device__ static void Load(const void* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ static float One(const void* p, int i) { return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]); }
};

// The 8-bit row formats: one byte per element, the row's f16 scale after its
// head_dim codes. Rows are head_dim + 2 bytes apart, so only 2-byte loads are
// aligned; eight codes are four of them. E4M3's bits placed at f16 bits 14..7
// are its value / 256, so 256 joins the row scale (the host kernels' trick,
// docs/KV_LAYOUT.md).
struct I8 {
  uint8_t b;
};
struct E4M3 {
  uint8_t b;
};
struct E5M2 {
  uint8_t b;
};
template <typename T>
constexpr bool kScaled = sizeof(T) == 1;

template <typename Code>
__device__ inline float DecodeCode(uint32_t c) {
  if constexpr (std::is_same_v<Code, I8>) {
    return codec::DecodeInt8(c);
  } else if constexpr (std::is_same_v<Code, E5M2>) {
    return codec::DecodeE5M2(c);
  } else {
    return codec::DecodeE4M3Shifted(c);
  }
}
template <typename Code>
struct Codes {
  static constexpr int kPerLoad = 8;
  __device__ static void Load(const void* p, float* out) {
    const unsigned short* w = static_cast<const unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t u = w[i];
      out[2 * i] = DecodeCode<Code>(u & 0xFFu);
      out[2 * i + 1] = DecodeCode<Code>(u >> 8);
    }
  }
  __device__ static float One(const void* p, int i) { return DecodeCode<Code>(static_cast<const uint8_t*>(p)[i]); }
};
template <>
struct Elem<I8> : Codes<I8> {};
template <>
struct Elem<E4M3> : Codes<E4M3> {};
template <>
struct Elem<E5M2> : Codes<E5M2> {};

// What a row's decoded elements are multiplied by: 1 for plain rows, the
// trailing f16 scale (x 256 for E4M3) for the 8-bit ones.
template <typename T>
__device__ inline float RowScale(const char* row, int d) {
  if constexpr (kScaled<T>) {
    const float s = codec::ScaleValue(*reinterpret_cast<const unsigned short*>(row + d));
    return std::is_same_v<T, E4M3> ? s * codec::kE4M3Unshift : s;
  } else {
    return 1.0f;
  }
}

__device__ inline float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) DecodeKernel(DecodeParams p, int32_t splits, int32_t tokens_per_split,
                                                           float* part_acc, float* part_ml) {
  const int h = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int G = p.q_heads / p.kv_heads, d = p.head_dim, bl = p.block_len;
  const int ctx = p.context_lens[seq];
  const int begin = split * tokens_per_split;
  const int end = min(ctx, begin + tokens_per_split);
  extern __shared__ float smem[];
  float* qs = smem;                // [G][d], scaled
  float* sc = qs + G * d;          // [G][kChunk]: scores, then probabilities
  float* corr = sc + G * kChunk;   // [G]
  float* m_s = corr + kMaxG;       // [G]
  float* l_s = m_s + kMaxG;        // [G]
  const float scale = p.scale > 0 ? p.scale : rsqrtf(static_cast<float>(d));
  const float* qg = p.q + (static_cast<int64_t>(seq) * p.q_heads + static_cast<int64_t>(h) * G) * d;
  for (int i = tid; i < G * d; i += kThreads) qs[i] = qg[i] * scale;
  if (tid < kMaxG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  float acc[kMaxG][kDimsPerThread];
#pragma unroll
  for (int g = 0; g < kMaxG; ++g)
#pragma unroll
    for (int k = 0; k < kDimsPerThread; ++k) acc[g][k] = 0.0f;
  __syncthreads();

  const char* kp = static_cast<const char*>(p.k_plane) + static_cast<int64_t>(h) * p.head_stride;
  const char* vp = static_cast<const char*>(p.v_plane) + static_cast<int64_t>(h) * p.head_stride;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  auto row_at = [&](const char* plane, int tok) {
    return plane + static_cast<int64_t>(table[tok / bl]) * p.slab_stride + static_cast<int64_t>(tok % bl) * p.row_bytes;
  };
  constexpr int kPer = Elem<T>::kPerLoad;
  for (int c0 = begin; c0 < end; c0 += kChunk) {
    const int n = min(kChunk, end - c0);
    // 1. Scores.
    for (int idx = tid; idx < G * kChunk; idx += kThreads) {
      const int g = idx / kChunk, t = idx % kChunk;
      float s = -INFINITY;
      if (t < n) {
        const char* row = row_at(kp, c0 + t);
        const float* qrow = qs + g * d;
        float sum = 0.0f;
        for (int j = 0; j < d; j += kPer) {
          float k[kPer];
          Elem<T>::Load(row + static_cast<int64_t>(j) * sizeof(T), k);
#pragma unroll
          for (int e = 0; e < kPer; ++e) sum = fmaf(qrow[j + e], k[e], sum);
        }
        s = sum * RowScale<T>(row, d);
      }
      sc[g * kChunk + t] = s;
    }
    __syncthreads();
    // 2. Online softmax, a warp per query head.
    for (int g = warp; g < G; g += kThreads / 32) {
      float* s = sc + g * kChunk;
      const float a = s[lane], b = s[lane + 32];
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, WarpMax(fmaxf(a, b)));
      const float pa = lane < n ? __expf(a - m_new) : 0.0f;
      const float pb = lane + 32 < n ? __expf(b - m_new) : 0.0f;
      s[lane] = pa;
      s[lane + 32] = pb;
      const float sum = WarpSum(pa + pb);
      if (lane == 0) {
        const float c = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
        corr[g] = c;
        l_s[g] = l_s[g] * c + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();
    // 3. acc = acc * corr + P . V.
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g < G) {
        const float c = corr[g];
#pragma unroll
        for (int k = 0; k < kDimsPerThread; ++k) acc[g][k] *= c;
      }
    }
    for (int t = 0; t < n; ++t) {
      const char* row = row_at(vp, c0 + t);
      const float vs = RowScale<T>(row, d);
      float v[kDimsPerThread];
#pragma unroll
      for (int k = 0; k < kDimsPerThread; ++k) {
        const int dim = tid + k * kThreads;
        v[k] = dim < d ? Elem<T>::One(row, dim) * vs : 0.0f;
      }
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) {
        if (g < G) {
          const float pg = sc[g * kChunk + t];
#pragma unroll
          for (int k = 0; k < kDimsPerThread; ++k) acc[g][k] = fmaf(pg, v[k], acc[g][k]);
        }
      }
    }
    __syncthreads();
  }
  // The split's result.
  const int64_t head0 = static_cast<int64_t>(seq) * p.q_heads + static_cast<int64_t>(h) * G;
#pragma unroll
  for (int g = 0; g < kMaxG; ++g) {
    if (g >= G) continue;
    const float l = l_s[g];
#pragma unroll
    for (int k = 0; k < kDimsPerThread; ++k) {
      const int dim = tid + k * kThreads;
      if (dim >= d) continue;
      if (part_acc == nullptr) {
        p.out[(head0 + g) * d + dim] = l > 0 ? acc[g][k] / l : 0.0f;
      } else {
        part_acc[((head0 + g) * splits + split) * d + dim] = acc[g][k];
      }
    }
    if (part_acc != nullptr && tid == 0) {
      part_ml[((head0 + g) * splits + split) * 2] = m_s[g];
      part_ml[((head0 + g) * splits + split) * 2 + 1] = l;
    }
  }
}

// The fast path, for head_dim / 8 a power of two (8 to 256): a thread owns
// one 16-byte chunk c of a row (C = head_dim / 8 chunks, R = 128 / C rows at
// once). Scores: the C threads of a row each dot their chunk with every
// query head's and sum by shuffles within their C lanes (a warp reads whole
// rows, coalesced). P.V: the same threads accumulate their chunk of every
// query head over the tokens t = r (mod R) in registers; the R partial sums
// are added once at the end of the split.
template <typename T, int kG>
__global__ void __launch_bounds__(kThreads) ChunkKernel(DecodeParams p, int32_t splits, int32_t tokens_per_split,
                                                          float* part_acc, float* part_ml) {
  const int h = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int G = p.q_heads / p.kv_heads, d = p.head_dim, bl = p.block_len;
  const int C = d / 8, R = kThreads / C, c = tid % C, r = tid / C;
  const int ctx = p.context_lens[seq];
  const int begin = split * tokens_per_split;
  const int end = min(ctx, begin + tokens_per_split);
  extern __shared__ float smem[];
  float* qs = smem;               // [G][d], scaled
  float* sc = qs + G * d;         // [G][kTile]
  float* corr = sc + G * kTile;   // [kMaxG]
  float* m_s = corr + kMaxG;
  float* l_s = m_s + kMaxG;
  float* red = l_s + kMaxG;       // [R][d]
  const float scale = p.scale > 0 ? p.scale : rsqrtf(static_cast<float>(d));
  const float* qg = p.q + (static_cast<int64_t>(seq) * p.q_heads + static_cast<int64_t>(h) * G) * d;
  for (int i = tid; i < G * d; i += kThreads) qs[i] = qg[i] * scale;
  if (tid < kMaxG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  float acc[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  __syncthreads();
  const char* kp = static_cast<const char*>(p.k_plane) + static_cast<int64_t>(h) * p.head_stride;
  const char* vp = static_cast<const char*>(p.v_plane) + static_cast<int64_t>(h) * p.head_stride;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  const int64_t chunk_off = static_cast<int64_t>(c) * 8 * sizeof(T);
  auto chunk_at = [&](const char* plane, int tok) {
    return plane + static_cast<int64_t>(table[tok / bl]) * p.slab_stride + static_cast<int64_t>(tok % bl) * p.row_bytes;
  };
  // This thread's 8 elements of the row at `row`, decoded and scaled.
  auto load8 = [&](const char* row, float* out) {
    const char* at = row + chunk_off;
    if constexpr (sizeof(T) == 4) {
      Elem<float>::Load(at, out);
      Elem<float>::Load(at + 16, out + 4);
    } else {
      Elem<T>::Load(at, out);
    }
    if constexpr (kScaled<T>) {
      const float s = RowScale<T>(row, d);
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] *= s;
    }
  };
  for (int c0 = begin; c0 < end; c0 += kTile) {
    const int n = min(kTile, end - c0);
    // 1. Scores (every thread runs the same number of rounds: the shuffles).
    for (int t = r; t < kTile; t += R) {
      float part[kG];
      float k[8];
      if (t < n) {
        load8(chunk_at(kp, c0 + t), k);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) k[e] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float s = 0.0f;
        if (g < G) {
          const float4 a = *reinterpret_cast<const float4*>(qs + g * d + c * 8);
          const float4 b = *reinterpret_cast<const float4*>(qs + g * d + c * 8 + 4);
          s = a.x * k[0] + a.y * k[1] + a.z * k[2] + a.w * k[3] + b.x * k[4] + b.y * k[5] + b.z * k[6] + b.w * k[7];
        }
        part[g] = s;
      }
      if (kG > 1 && C >= kG) {
        // Reduce-scatter over the row's C lanes: at each of the first
        // log2(kG) steps a lane keeps half of its values and adds its
        // partner's half of them (kG - 1 shuffles in all instead of kG per
        // step); then the one value left is summed over the remaining lanes.
        int o = C / 2, g_of_lane = 0;
#pragma unroll
        for (int half = kG / 2; half >= 1; half /= 2) {
          const bool upper = (c & o) != 0;
#pragma unroll
          for (int i = 0; i < half; ++i) {
            const float send = upper ? part[i] : part[i + half];
            const float keep = upper ? part[i + half] : part[i];
            part[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
          }
          g_of_lane = 2 * g_of_lane + (upper ? 1 : 0);
          o /= 2;
        }
        for (; o > 0; o /= 2) part[0] += __shfl_xor_sync(0xffffffffu, part[0], o);
        if ((c & (C / kG - 1)) == 0 && g_of_lane < G) sc[g_of_lane * kTile + t] = t < n ? part[0] : -INFINITY;
      } else {
        for (int o = C / 2; o > 0; o >>= 1) {
#pragma unroll
          for (int g = 0; g < kG; ++g) part[g] += __shfl_xor_sync(0xffffffffu, part[g], o);
        }
        if (c == 0) {
#pragma unroll
          for (int g = 0; g < kG; ++g) {
            if (g < G) sc[g * kTile + t] = t < n ? part[g] : -INFINITY;
          }
        }
      }
    }
    __syncthreads();
    // 2. Online softmax, a warp per query head.
    for (int g = warp; g < G; g += kThreads / 32) {
      float* s = sc + g * kTile;
      float x[kTile / 32];
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < kTile / 32; ++i) {
        x[i] = s[lane + 32 * i];
        mx = fmaxf(mx, x[i]);
      }
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, WarpMax(mx));
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kTile / 32; ++i) {
        const float e = lane + 32 * i < n ? __expf(x[i] - m_new) : 0.0f;
        s[lane + 32 * i] = e;
        sum += e;
      }
      sum = WarpSum(sum);
      if (lane == 0) {
        const float cr = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
        corr[g] = cr;
        l_s[g] = l_s[g] * cr + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();
    // 3. acc = acc * corr + P . V over this thread's tokens.
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const float cr = g < G ? corr[g] : 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= cr;
    }
    for (int t = r; t < n; t += R) {
      float v[8];
      load8(chunk_at(vp, c0 + t), v);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        const float pg = g < G ? sc[g * kTile + t] : 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(pg, v[e], acc[g][e]);
      }
    }
    __syncthreads();
  }
  // The R partial accumulators of each query head added, then the split's result.
  const int64_t head0 = static_cast<int64_t>(seq) * p.q_heads + static_cast<int64_t>(h) * G;
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    if (g >= G) break;
#pragma unroll
    for (int e = 0; e < 8; ++e) red[r * d + c * 8 + e] = acc[g][e];
    __syncthreads();
    const float l = l_s[g];
    for (int dim = tid; dim < d; dim += kThreads) {
      float s = 0.0f;
      for (int i = 0; i < R; ++i) s += red[i * d + dim];
      if (part_acc == nullptr) {
        p.out[(head0 + g) * d + dim] = l > 0 ? s / l : 0.0f;
      } else {
        part_acc[((head0 + g) * splits + split) * d + dim] = s;
      }
    }
    if (part_acc != nullptr && tid == 0) {
      part_ml[((head0 + g) * splits + split) * 2] = m_s[g];
      part_ml[((head0 + g) * splits + split) * 2 + 1] = l;
    }
    __syncthreads();
  }
}

// out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i over the splits
// that saw a token (M their largest max). One CTA per (sequence, query head).
__global__ void MergeKernel(int32_t splits, int32_t d, const float* part_acc, const float* part_ml, float* out) {
  const int64_t head = blockIdx.x;
  float m = -INFINITY;
  for (int i = 0; i < splits; ++i) {
    if (part_ml[(head * splits + i) * 2 + 1] > 0) m = fmaxf(m, part_ml[(head * splits + i) * 2]);
  }
  for (int dim = threadIdx.x; dim < d; dim += blockDim.x) {
    float num = 0.0f, den = 0.0f;
    for (int i = 0; i < splits; ++i) {
      const float l = part_ml[(head * splits + i) * 2 + 1];
      if (l <= 0) continue;
      const float w = __expf(part_ml[(head * splits + i) * 2] - m);
      num += w * part_acc[(head * splits + i) * d + dim];
      den += w * l;
    }
    out[head * d + dim] = den > 0 ? num / den : 0.0f;
  }
}

size_t SharedBytes(const DecodeParams& p) {
  const int G = p.q_heads / p.kv_heads;
  return sizeof(float) * (static_cast<size_t>(G) * p.head_dim + static_cast<size_t>(G) * std::max(kChunk, kTile) +
                          3 * kMaxG + static_cast<size_t>(kThreads) * 8);
}

// head_dim / 8 a power of two: the chunk kernel.
bool ChunkShape(int32_t d) {
  const int32_t chunks = d / 8;
  return d % 8 == 0 && chunks >= 1 && chunks <= 32 && (chunks & (chunks - 1)) == 0;
}

template <typename T>
void LaunchChunk(const DecodeParams& p, dim3 grid, size_t shared, cudaStream_t stream, int32_t splits, int32_t tps,
                 float* acc, float* ml) {
  const int G = p.q_heads / p.kv_heads;
  if (G <= 1) {
    ChunkKernel<T, 1><<<grid, kThreads, shared, stream>>>(p, splits, tps, acc, ml);
  } else if (G <= 2) {
    ChunkKernel<T, 2><<<grid, kThreads, shared, stream>>>(p, splits, tps, acc, ml);
  } else if (G <= 4) {
    ChunkKernel<T, 4><<<grid, kThreads, shared, stream>>>(p, splits, tps, acc, ml);
  } else if (G <= 8) {
    ChunkKernel<T, 8><<<grid, kThreads, shared, stream>>>(p, splits, tps, acc, ml);
  } else {
    ChunkKernel<T, 16><<<grid, kThreads, shared, stream>>>(p, splits, tps, acc, ml);
  }
}

bool Valid(const DecodeParams& p) {
  if (p.num_seqs < 1 || p.kv_heads < 1 || p.q_heads < p.kv_heads || p.q_heads % p.kv_heads != 0) return false;
  if (p.q_heads / p.kv_heads > kMaxG || p.head_dim < 8 || p.head_dim > kMaxHeadDim || p.head_dim % 8 != 0) return false;
  if (p.block_len < 1 || p.max_blocks < 1 || p.row_bytes < 1 || p.slab_stride < 1) return false;
  if (static_cast<int32_t>(p.type) < 0 || static_cast<int32_t>(p.type) > static_cast<int32_t>(KvType::kFp8E5M2)) return false;
  const int64_t align = ScaledRows(p.type) ? 2 : 16;
  if (p.row_bytes < RowBytesNeeded(p.type, p.head_dim) || p.row_bytes % align != 0 || p.slab_stride % align != 0 ||
      p.head_stride % align != 0) {
    return false;
  }
  return p.k_plane != nullptr && p.v_plane != nullptr && p.block_tables != nullptr && p.context_lens != nullptr &&
         p.q != nullptr && p.out != nullptr;
}


// --- Prefill ------------------------------------------------------------------

constexpr int kPrefillRows = 16;  // rows (query, head) per CTA
constexpr int kPrefillKeys = 32;  // keys per tile: a lane each
constexpr int kPrefillWarps = kThreads / 32;
constexpr int kPrefillRowsPerWarp = kPrefillRows / kPrefillWarps;  // 4
constexpr int kPrefillDimsPerLane = kMaxHeadDim / 32;              // 8

size_t PrefillSharedBytes(int32_t d) {
  return sizeof(float) * (static_cast<size_t>(kPrefillKeys) * (d + 1) + static_cast<size_t>(kPrefillKeys) * d +
                          static_cast<size_t>(kPrefillRows) * d) +
         sizeof(int) * kPrefillKeys;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) PrefillKernel(PrefillParams p) {
  extern __shared__ float smem[];
  const int d = p.head_dim;
  float* ks = smem;                          // [kPrefillKeys][d + 1]: padded, so lane t's row reads hit distinct banks
  float* vs = ks + kPrefillKeys * (d + 1);   // [kPrefillKeys][d]
  float* qs = vs + kPrefillKeys * d;         // [kPrefillRows][d]
  int* held = reinterpret_cast<int*>(qs + kPrefillRows * d);  // [kPrefillKeys]
  const int h = static_cast<int>(blockIdx.x), seq = static_cast<int>(blockIdx.y);
  const int G = p.q_heads / p.kv_heads;
  const int queries_per_cta = kPrefillRows / G;  // >= 1: G <= 16
  const int rows = queries_per_cta * G;
  const PrefillTile tile = PrefillTileOf(p, seq, queries_per_cta);
  if (tile.nq == 0) return;
  const int nq = tile.nq;
  const int64_t first_pos = tile.first_pos, last_pos = tile.last_pos, key_lo = tile.key_lo, row0 = tile.row0;
  const int32_t window = tile.window;
  const float scale = tile.scale;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  for (int i = tid; i < rows * d; i += kThreads) {
    const int r = i / d, j = i % d, qi = r / G, g = r % G;
    qs[i] = qi < nq ? p.q[((row0 + qi) * p.q_heads + h * G + g) * d + j] : 0.0f;
  }
  float acc[kPrefillRowsPerWarp][kPrefillDimsPerLane];
  float m[kPrefillRowsPerWarp], l[kPrefillRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kPrefillRowsPerWarp; ++k) {
    m[k] = -INFINITY;
    l[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < kPrefillDimsPerLane; ++i) acc[k][i] = 0.0f;
  }
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  const char* kbase = static_cast<const char*>(p.k_plane) + h * p.head_stride;
  const char* vbase = static_cast<const char*>(p.v_plane) + h * p.head_stride;
  for (int64_t start = key_lo; start <= last_pos; start += kPrefillKeys) {
    __syncthreads();  // the previous tile is read
    if (tid < kPrefillKeys) {
      const int64_t tok = start + tid;
      held[tid] = tok <= last_pos && table[tok / p.block_len] >= 0;
    }
    for (int i = tid; i < kPrefillKeys * d; i += kThreads) {
      const int t = i / d, j = i % d;
      const int64_t tok = start + t;
      float kv = 0.0f, vv = 0.0f;
      if (tok <= last_pos) {
        const int32_t b = table[tok / p.block_len];
        if (b >= 0) {
          const int64_t off = b * p.slab_stride + (tok % p.block_len) * p.row_bytes;
          const char* kr = kbase + off;
          const char* vr = vbase + off;
          kv = Elem<T>::One(kr, j) * RowScale<T>(kr, d);
          vv = Elem<T>::One(vr, j) * RowScale<T>(vr, d);
        }
      }
      ks[t * (d + 1) + j] = kv;
      vs[t * d + j] = vv;
    }
    __syncthreads();
    const int64_t tok = start + lane;
#pragma unroll
    for (int k = 0; k < kPrefillRowsPerWarp; ++k) {
      const int r = warp + k * kPrefillWarps;
      if (r >= rows || r / G >= nq) continue;  // warp-uniform
      const int64_t pos = first_pos + r / G;
      const int64_t lo = window > 0 ? pos - window + 1 : 0;
      const bool sees = held[lane] && tok <= pos && tok >= lo;
      float s = -INFINITY;
      if (sees) {
        const float* qr = qs + r * d;
        const float* kr = ks + lane * (d + 1);
        float dot = 0.0f;
        for (int j = 0; j < d; ++j) dot = fmaf(qr[j], kr[j], dot);
        s = dot * scale;
        if (p.softcap > 0) s = p.softcap * tanhf(s / p.softcap);
      }
      const float m_new = fmaxf(m[k], WarpMax(s));
      if (m_new == -INFINITY) continue;  // nothing seen yet (warp-uniform)
      const float alpha = expf(m[k] - m_new);  // 0 when m was -inf
      const float e = sees ? expf(s - m_new) : 0.0f;
      l[k] = l[k] * alpha + WarpSum(e);
      m[k] = m_new;
#pragma unroll
      for (int i = 0; i < kPrefillDimsPerLane; ++i) acc[k][i] *= alpha;
      for (int t = 0; t < kPrefillKeys; ++t) {
        const float pt = __shfl_sync(0xffffffffu, e, t);
        if (pt == 0.0f) continue;  // warp-uniform
#pragma unroll
        for (int i = 0; i < kPrefillDimsPerLane; ++i) {
          const int j = lane + 32 * i;
          if (j < d) acc[k][i] = fmaf(pt, vs[t * d + j], acc[k][i]);
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPrefillRowsPerWarp; ++k) {
    const int r = warp + k * kPrefillWarps;
    if (r >= rows || r / G >= nq) continue;
    const int64_t row = row0 + r / G;
    const int head = h * G + r % G;
    float* o = p.out + (row * p.q_heads + head) * d;
    const float inv = l[k] > 0 ? 1.0f / l[k] : 0.0f;
#pragma unroll
    for (int i = 0; i < kPrefillDimsPerLane; ++i) {
      const int j = lane + 32 * i;
      if (j < d) o[j] = acc[k][i] * inv;
    }
    if (p.lse != nullptr && lane == 0) p.lse[row * p.q_heads + head] = l[k] > 0 ? m[k] + logf(l[k]) : -INFINITY;
  }
}

template <typename T>
cudaError_t LaunchPrefill(const PrefillParams& p, dim3 grid, size_t shared, cudaStream_t stream) {
  if (shared > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(PrefillKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shared));
        e != cudaSuccess) {
      return e;
    }
  }
  PrefillKernel<T><<<grid, kThreads, shared, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

int32_t Splits(const DecodeParams& p, int32_t longest_context, int32_t multiprocessors) {
  if (longest_context <= 0 || p.block_len <= 0) return 1;
  const int32_t blocks = (longest_context + p.block_len - 1) / p.block_len;
  if (p.blocks_per_split > 0) return (blocks + p.blocks_per_split - 1) / p.blocks_per_split;
  // About 8 CTAs per multiprocessor, at least 256 tokens a split (on the
  // H200 8 against 4: MHA 0.42-0.48 -> 0.65-0.74 of the read bandwidth at
  // batch 8, G = 8 0.11-0.18 -> 0.13-0.20, G = 4 0.23-0.32 -> 0.20-0.32).
  const int64_t ctas = static_cast<int64_t>(p.num_seqs) * p.kv_heads;
  const int64_t want = std::max<int64_t>(1, (8LL * multiprocessors + ctas - 1) / ctas);
  const int64_t most = std::max<int64_t>(1, (longest_context + 255) / 256);
  return static_cast<int32_t>(std::min(want, most));
}

size_t ScratchBytes(const DecodeParams& p, int32_t splits) {
  return sizeof(float) * static_cast<size_t>(p.num_seqs) * p.q_heads * splits * (p.head_dim + 2);
}

cudaError_t PagedDecodeAttention(const DecodeParams& p, int32_t splits, cudaStream_t stream) {
  if (!Valid(p) || splits < 1 || (splits > 1 && p.scratch == nullptr)) return cudaErrorInvalidValue;
  // Tokens per split: whole blocks, enough of them to cover the longest
  // context the tables can hold in `splits` pieces.
  const int64_t capacity = static_cast<int64_t>(p.max_blocks) * p.block_len;
  const int64_t per_blocks = p.blocks_per_split > 0 ? p.blocks_per_split : (p.max_blocks + splits - 1) / splits;
  if (static_cast<int64_t>(splits) * per_blocks < p.max_blocks) return cudaErrorInvalidValue;  // tokens left out
  const int32_t tokens_per_split = static_cast<int32_t>(std::min<int64_t>(capacity, per_blocks * p.block_len));
  float* part_acc = nullptr;
  float* part_ml = nullptr;
  if (splits > 1) {
    part_acc = static_cast<float*>(p.scratch);
    part_ml = part_acc + static_cast<size_t>(p.num_seqs) * p.q_heads * splits * p.head_dim;
  }
  const dim3 grid(static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(splits));
  const size_t shared = SharedBytes(p);
  if (p.tensor_cores && TensorCoreDecodeShape(p)) {
    if (cudaError_t e = LaunchTensorCoreDecode(p, splits, tokens_per_split, part_acc, part_ml, stream); e != cudaSuccess) {
      return e;
    }
  } else if (ChunkShape(p.head_dim) && p.use_chunk_kernel) {
    switch (p.type) {
      case KvType::kF32:
        LaunchChunk<float>(p, grid, shared, stream, splits, tokens_per_split, part_acc, part_ml);
        break;
      case KvType::kF16:
        LaunchChunk<__half>(p, grid, shared, stream, splits, tokens_per_split, part_acc, part_ml);
        break;
      case KvType::kBF16:
        LaunchChunk<__nv_bfloat16>(p, grid, shared, stream, splits, tokens_per_split, part_acc, part_ml);
        break;
      case KvType::kInt8:
        LaunchChunk<I8>(p, grid, shared, stream, splits, tokens_per_split, part_acc, part_ml);
        break;
      case KvType::kFp8E4M3:
        LaunchChunk<E4M3>(p, grid, shared, stream, splits, tokens_per_split, part_acc, part_ml);
        break;
      case KvType::kFp8E5M2:
        LaunchChunk<E5M2>(p, grid, shared, stream, splits, tokens_per_split, part_acc, part_ml);
        break;
    }
  } else {
    auto general = [&](auto tag) {
      using T = decltype(tag);
      DecodeKernel<T><<<grid, kThreads, shared, stream>>>(p, splits, tokens_per_split, part_acc, part_ml);
    };
    switch (p.type) {
      case KvType::kF32:
        general(float{});
        break;
      case KvType::kF16:
        general(__half{});
        break;
      case KvType::kBF16:
        general(__nv_bfloat16{});
        break;
      case KvType::kInt8:
        general(I8{});
        break;
      case KvType::kFp8E4M3:
        general(E4M3{});
        break;
      case KvType::kFp8E5M2:
        general(E5M2{});
        break;
    }
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (splits > 1) {
    MergeKernel<<<static_cast<unsigned>(p.num_seqs * p.q_heads), std::min(p.head_dim, 256), 0, stream>>>(
        splits, p.head_dim, part_acc, part_ml, p.out);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

cudaError_t PagedPrefillAttention(const PrefillParams& p, cudaStream_t stream) {
  if (p.num_seqs < 1 || p.kv_heads < 1 || p.q_heads < p.kv_heads || p.q_heads % p.kv_heads != 0 ||
      p.q_heads / p.kv_heads > kMaxG || p.head_dim < 1 || p.head_dim > kMaxHeadDim || p.block_len < 1 ||
      p.max_blocks < 1 || p.max_query_len < 0 || p.softcap < 0) {
    return cudaErrorInvalidValue;
  }
  if (static_cast<int32_t>(p.type) < 0 || static_cast<int32_t>(p.type) > static_cast<int32_t>(KvType::kFp8E5M2) ||
      p.row_bytes < RowBytesNeeded(p.type, p.head_dim) || p.slab_stride < p.block_len * p.row_bytes) {
    return cudaErrorInvalidValue;
  }
  if (p.k_plane == nullptr || p.v_plane == nullptr || p.block_tables == nullptr || p.context_lens == nullptr ||
      p.query_lens == nullptr || p.query_starts == nullptr || p.q == nullptr || p.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.max_query_len == 0) return cudaSuccess;
  if (p.tensor_cores) {
    if (!TensorCorePrefillShape(p)) return cudaErrorInvalidValue;
    return LaunchTensorCorePrefill(p, stream);
  }
  const int queries_per_cta = kPrefillRows / (p.q_heads / p.kv_heads);
  const int64_t tiles = (static_cast<int64_t>(p.max_query_len) + queries_per_cta - 1) / queries_per_cta;
  if (tiles > 65535 || p.num_seqs > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(tiles));
  const size_t shared = PrefillSharedBytes(p.head_dim);
  switch (p.type) {
    case KvType::kF32:
      return LaunchPrefill<float>(p, grid, shared, stream);
    case KvType::kF16:
      return LaunchPrefill<__half>(p, grid, shared, stream);
    case KvType::kBF16:
      return LaunchPrefill<__nv_bfloat16>(p, grid, shared, stream);
    case KvType::kInt8:
      return LaunchPrefill<I8>(p, grid, shared, stream);
    case KvType::kFp8E4M3:
      return LaunchPrefill<E4M3>(p, grid, shared, stream);
    case KvType::kFp8E5M2:
      return LaunchPrefill<E5M2>(p, grid, shared, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagekv::cuda
