// Paged decode attention on the tensor cores, for grouped-query attention:
// the G query heads of a KV head (one query token each) are the M
// dimension of 16 x 16 x 16 WMMA tiles, padded to 16 rows, so each K and V
// row read from memory feeds G heads at the tensor cores' rate instead of
// 4 G fp32 flops per element on the CUDA cores (at G = 8 the CUDA-core
// kernel needs more fp32 flops than the H200 has to keep up with its memory:
// docs/PERFORMANCE.md).
//
// One CTA of 4 warps per (KV head, sequence, split), as the CUDA-core
// kernel, and the same merge. The split's tokens go in phases of kPhase:
//   1. scores: tiles of 64 keys copied into shared memory with 16-byte
//      loads (coalesced along each row), each warp S = Q K^T for 16 of them
//      (Q in kParts 16-bit parts, so the product keeps about f32's
//      precision with K exact: tensor_core_parts.cuh), S for the whole
//      phase kept in shared memory;
//   2. softmax over the phase: its max, the exps, their sum, and the factor
//      that rescales what earlier phases accumulated;
//   3. O += P V: tiles of 64 values, P split into parts, each warp owning
//      16-column slices of O in accumulator fragments for the whole phase.
// Between phases the fragments go through shared memory once to be
// rescaled (a fragment's element-to-row mapping is opaque), that is once
// per kPhase tokens rather than once per tile.
#include "cuda/tensor_core_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "cuda/tensor_core_parts.cuh"

namespace pagekv::cuda {
namespace {

constexpr int kThreads = 128;          // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 16;              // the group's query heads, padded
constexpr int kKeys = 64;              // keys per tile: 16 per warp
constexpr int kPhase = 256;            // keys per softmax update
constexpr int kMaxDim = 128;
constexpr int kMaxSlices = kMaxDim / 16 / kWarps;  // O's 16-column slices per warp
constexpr int kMaxG = 16;

size_t SharedBytes(int32_t d, int parts) {
  return static_cast<size_t>(parts) * kRows * d * 2     // Q parts
         + static_cast<size_t>(kKeys) * d * 2           // the K or V tile
         + static_cast<size_t>(kRows) * kPhase * 4      // S, then P, of the phase
         + static_cast<size_t>(parts) * kRows * kKeys * 2  // P parts of a tile
         + static_cast<size_t>(kRows) * d * 4           // O, when it goes through shared memory
         + 3 * kRows * 4;                               // m, l, alpha
}

// A tile of kKeys rows of one plane, fetched into registers with 16-byte
// loads (coalesced along each row) and then stored into shared memory, so
// the next tile's loads are in flight while this one's products run.
constexpr int kMaxLoads = kKeys * (kMaxDim / 8) / kThreads;  // 16-byte loads per thread

struct TileLoader {
  const DecodeParams* p;
  const int32_t* table;   // this sequence's block table
  uint4 regs[kMaxLoads];

  // Rows [t0, t0 + kKeys) of `plane` (this KV head's K or V) in the phase
  // at token `start`; rows at or past n: zeros.
  __device__ void Fetch(const char* plane, int start, int t0, int n) {
    const int chunks = p->head_dim / 8;
#pragma unroll
    for (int l = 0; l < kMaxLoads; ++l) {
      const int i = static_cast<int>(threadIdx.x) + l * kThreads;
      const int t = i / chunks, c = i % chunks;
      regs[l] = make_uint4(0, 0, 0, 0);
      if (t < kKeys && t0 + t < n) {
        const int tok = start + t0 + t;
        const int64_t off = static_cast<int64_t>(table[tok / p->block_len]) * p->slab_stride +
                            static_cast<int64_t>(tok % p->block_len) * p->row_bytes + c * 16;
        regs[l] = *reinterpret_cast<const uint4*>(plane + off);
      }
    }
  }
  template <typename T>
  __device__ void Store(T* tile) const {
    const int chunks = p->head_dim / 8;
#pragma unroll
    for (int l = 0; l < kMaxLoads; ++l) {
      const int i = static_cast<int>(threadIdx.x) + l * kThreads;
      const int t = i / chunks, c = i % chunks;
      if (t < kKeys) reinterpret_cast<uint4*>(tile + t * p->head_dim)[c] = regs[l];
    }
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) TensorCoreDecodeKernel(DecodeParams p, int32_t splits,
                                                                    int32_t tokens_per_split, float* part_acc,
                                                                    float* part_ml) {
  namespace wmma = nvcuda::wmma;
  constexpr int kParts = TcParts<T>::kParts;
  extern __shared__ __align__(32) unsigned char tcd_smem[];
  const int d = p.head_dim;
  T* qs = reinterpret_cast<T*>(tcd_smem);                   // [kParts][kRows][d]
  T* tile = qs + kParts * kRows * d;                        // [kKeys][d]
  float* ss = reinterpret_cast<float*>(tile + kKeys * d);   // [kRows][kPhase]
  T* ps = reinterpret_cast<T*>(ss + kRows * kPhase);        // [kParts][kRows][kKeys]
  float* os = reinterpret_cast<float*>(ps + kParts * kRows * kKeys);  // [kRows][d]
  float* ms = os + kRows * d;
  float* ls = ms + kRows;
  float* alphas = ls + kRows;

  const int h = static_cast<int>(blockIdx.x), seq = static_cast<int>(blockIdx.y), split = static_cast<int>(blockIdx.z);
  const int tid = threadIdx.x, warp = tid / 32;
  const int G = p.q_heads / p.kv_heads;
  const int ctx = p.context_lens[seq];
  const int begin = split * tokens_per_split;
  const int end = min(ctx, begin + tokens_per_split);
  const float scale = p.scale > 0 ? p.scale : rsqrtf(static_cast<float>(d));
  const int64_t head0 = static_cast<int64_t>(seq) * p.q_heads + static_cast<int64_t>(h) * G;

  // Q's parts, scaled (rows past G: zeros); m = -inf, l = 0.
  for (int i = tid; i < kRows * d; i += kThreads) {
    const int r = i / d;
    const float x = r < G ? p.q[(head0 + r) * d + i % d] * scale : 0.0f;
    Split<T>(x, qs + i, kRows * d);
  }
  if (tid < kRows) {
    ms[tid] = -INFINITY;
    ls[tid] = 0.0f;
  }
  const int slices = d / 16;  // O's 16-column slices: warp w owns w, w + 4
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[kMaxSlices];
#pragma unroll
  for (int s = 0; s < kMaxSlices; ++s) wmma::fill_fragment(o[s], 0.0f);

  const char* kplane = static_cast<const char*>(p.k_plane) + static_cast<int64_t>(h) * p.head_stride;
  const char* vplane = static_cast<const char*>(p.v_plane) + static_cast<int64_t>(h) * p.head_stride;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  // One set of registers: the K tiles and V tiles of a phase are fetched in
  // turn, each while the previous one's products run.
  TileLoader loader{&p, table, {}};
  if (begin < end) loader.Fetch(kplane, begin, 0, min(kPhase, end - begin));
  for (int start = begin; start < end; start += kPhase) {
    const int n = min(kPhase, end - start);
    // 1. S = Q K^T over the phase, a tile of 64 keys at a time.
    for (int t0 = 0; t0 < n; t0 += kKeys) {
      __syncthreads();  // the tile is free (and Q, m, l written)
      loader.Store(tile);
      __syncthreads();
      if (t0 + kKeys < n) {
        loader.Fetch(kplane, start, t0 + kKeys, n);  // in flight during the products below
      } else {
        loader.Fetch(vplane, start, 0, n);  // the phase's first V tile, in flight during the softmax
      }
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      // K [keys][d] row-major is K^T column-major with ldm d.
      for (int kk = 0; kk < d / 16; ++kk) {
        MmaParts<T, wmma::col_major>(acc, qs + kk * 16, d, kRows * d, tile + warp * 16 * d + kk * 16, d);
      }
      wmma::store_matrix_sync(ss + t0 + warp * 16, acc, kPhase, wmma::mem_row_major);
    }
    __syncthreads();
    // 2. The softmax over the phase's n keys: 8 threads per row.
    {
      const int r = tid / 8, sub = tid % 8;
      float* srow = ss + r * kPhase;
      float mx = -INFINITY;
      for (int t = sub; t < n; t += 8) mx = fmaxf(mx, srow[t]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      const float m_old = ms[r];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      for (int t = sub; t < kPhase; t += 8) {
        const float e = t < n ? expf(srow[t] - m_new) : 0.0f;
        srow[t] = e;
        sum += e;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      __syncwarp();
      if (sub == 0) {
        const float alpha = expf(m_old - m_new);  // 0 on the first phase (m_old = -inf)
        alphas[r] = alpha;
        ls[r] = ls[r] * alpha + sum;
        ms[r] = m_new;
      }
    }
    __syncthreads();
    // What earlier phases accumulated, rescaled through shared memory.
    if (start != begin) {
      for (int s = 0; s < kMaxSlices; ++s) {
        const int slice = warp + s * kWarps;
        if (slice < slices) wmma::store_matrix_sync(os + slice * 16, o[s], d, wmma::mem_row_major);
      }
      __syncthreads();
      for (int i = tid; i < kRows * d; i += kThreads) os[i] *= alphas[i / d];
      __syncthreads();
      for (int s = 0; s < kMaxSlices; ++s) {
        const int slice = warp + s * kWarps;
        if (slice < slices) wmma::load_matrix_sync(o[s], os + slice * 16, d, wmma::mem_row_major);
      }
    }
    // 3. O += P V, a tile of 64 values at a time.
    for (int t0 = 0; t0 < n; t0 += kKeys) {
      __syncthreads();  // the tile and the P parts are free
      loader.Store(tile);
      for (int i = tid; i < kRows * kKeys; i += kThreads) {
        const int r = i / kKeys, t = i % kKeys;
        Split<T>(ss[r * kPhase + t0 + t], ps + i, kRows * kKeys);  // zeros past n
      }
      __syncthreads();
      if (t0 + kKeys < n) {
        loader.Fetch(vplane, start, t0 + kKeys, n);
      } else if (start + kPhase < end) {
        loader.Fetch(kplane, start + kPhase, 0, min(kPhase, end - start - kPhase));  // the next phase's first K tile
      }
      for (int s = 0; s < kMaxSlices; ++s) {
        const int slice = warp + s * kWarps;
        if (slice >= slices) break;
        // V [keys][d] row-major is the B operand as is.
        for (int kk = 0; kk < kKeys / 16; ++kk) {
          MmaParts<T, wmma::row_major>(o[s], ps + kk * 16, kKeys, kRows * kKeys, tile + kk * 16 * d + slice * 16, d);
        }
      }
    }
  }
  // The split's result: O through shared memory, then per row.
  __syncthreads();
  for (int s = 0; s < kMaxSlices; ++s) {
    const int slice = warp + s * kWarps;
    if (slice < slices) wmma::store_matrix_sync(os + slice * 16, o[s], d, wmma::mem_row_major);
  }
  __syncthreads();
  for (int i = tid; i < G * d; i += kThreads) {
    const int r = i / d, j = i % d;
    const float l = ls[r];
    if (part_acc == nullptr) {
      p.out[(head0 + r) * d + j] = l > 0 ? os[i] / l : 0.0f;
    } else {
      part_acc[((head0 + r) * splits + split) * d + j] = os[i];
    }
  }
  if (part_ml != nullptr && tid < G) {
    part_ml[((head0 + tid) * splits + split) * 2] = ms[tid];
    part_ml[((head0 + tid) * splits + split) * 2 + 1] = ls[tid];
  }
}

template <typename T>
cudaError_t Launch(const DecodeParams& p, int32_t splits, int32_t tps, float* part_acc, float* part_ml,
                   cudaStream_t stream) {
  const size_t shared = SharedBytes(p.head_dim, TcParts<T>::kParts);
  if (cudaError_t e = cudaFuncSetAttribute(TensorCoreDecodeKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared));
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid(static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(splits));
  TensorCoreDecodeKernel<T><<<grid, kThreads, shared, stream>>>(p, splits, tps, part_acc, part_ml);
  return cudaGetLastError();
}

}  // namespace

bool TensorCoreDecodeShape(const DecodeParams& p) {
  return (p.type == KvType::kF16 || p.type == KvType::kBF16) && p.head_dim % 16 == 0 && p.head_dim >= 16 &&
         p.head_dim <= kMaxDim && p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0 && p.q_heads / p.kv_heads <= kMaxG &&
         p.row_bytes % 16 == 0 && p.slab_stride % 16 == 0 && p.head_stride % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.k_plane) % 16 == 0 && reinterpret_cast<uintptr_t>(p.v_plane) % 16 == 0;
}

cudaError_t LaunchTensorCoreDecode(const DecodeParams& p, int32_t splits, int32_t tokens_per_split, float* part_acc,
                                   float* part_ml, cudaStream_t stream) {
  if (!TensorCoreDecodeShape(p)) return cudaErrorInvalidValue;
  return p.type == KvType::kF16 ? Launch<__half>(p, splits, tokens_per_split, part_acc, part_ml, stream)
                                : Launch<__nv_bfloat16>(p, splits, tokens_per_split, part_acc, part_ml, stream);
}

}  // namespace pagekv::cuda
