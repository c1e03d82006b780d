// Prefill and chunked-prefill attention on the tensor cores (see
// TensorCorePrefillShape in paged_attention.h): WMMA 16x16x16 tiles, one
// CTA of 4 warps per (KV head, sequence, 64 rows of query x group head),
// keys in tiles of 64 copied once into shared memory; S = Q K^T and O += P V
// with Q and P in 16-bit parts (tensor_core_parts.cuh); the online softmax
// in f32 over S in shared memory, O accumulated there.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "cuda/prefill_tile.cuh"
#include "cuda/tensor_core_kernels.h"
#include "cuda/tensor_core_parts.cuh"

namespace pagekv::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kTcRows = 64;   // rows (query, head) per CTA: 16 per warp
constexpr int kTcKeys = 64;   // keys per tile
constexpr int kTcMaxDim = 128;

size_t TcSharedBytes(int32_t d, int parts) {
  return static_cast<size_t>(parts) * kTcRows * d * 2      // Q parts
         + 2 * static_cast<size_t>(kTcKeys) * d * 2        // K, V tiles
         + static_cast<size_t>(kTcRows) * kTcKeys * 4      // S
         + static_cast<size_t>(parts) * kTcRows * kTcKeys * 2  // P parts
         + static_cast<size_t>(kTcRows) * d * 4            // O
         + 3 * kTcRows * 4 + kTcKeys * 4;                  // m, l, alpha; held
}

template <typename T>
__global__ void __launch_bounds__(kThreads) TensorCorePrefillKernel(PrefillParams p) {
  namespace wmma = nvcuda::wmma;
  constexpr int kParts = TcParts<T>::kParts;
  extern __shared__ __align__(32) unsigned char tc_smem[];
  const int d = p.head_dim;
  T* qs = reinterpret_cast<T*>(tc_smem);                    // [kParts][kTcRows][d]
  T* ks = qs + kParts * kTcRows * d;                        // [kTcKeys][d]
  T* vs = ks + kTcKeys * d;                                 // [kTcKeys][d]
  float* ss = reinterpret_cast<float*>(vs + kTcKeys * d);   // [kTcRows][kTcKeys]
  T* ps = reinterpret_cast<T*>(ss + kTcRows * kTcKeys);     // [kParts][kTcRows][kTcKeys]
  float* os = reinterpret_cast<float*>(ps + kParts * kTcRows * kTcKeys);  // [kTcRows][d]
  float* ms = os + kTcRows * d;
  float* ls = ms + kTcRows;
  float* alphas = ls + kTcRows;
  int* held = reinterpret_cast<int*>(alphas + kTcRows);

  const int h = static_cast<int>(blockIdx.x), seq = static_cast<int>(blockIdx.y);
  const int G = p.q_heads / p.kv_heads;
  const int queries_per_cta = kTcRows / G;
  const int rows = queries_per_cta * G;
  const PrefillTile tile = PrefillTileOf(p, seq, queries_per_cta);
  if (tile.nq == 0) return;
  const int nq = tile.nq;
  const int64_t first_pos = tile.first_pos, last_pos = tile.last_pos, key_lo = tile.key_lo, row0 = tile.row0;
  const int32_t window = tile.window;
  const float scale = tile.scale;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  // Q's parts (rows past the CTA's queries: zeros), O = 0, m = -inf, l = 0.
  for (int i = tid; i < kTcRows * d; i += kThreads) {
    const int r = i / d, j = i % d, qi = r / G, g = r % G;
    const float x = r < rows && qi < nq ? p.q[((row0 + qi) * p.q_heads + h * G + g) * d + j] : 0.0f;
    Split<T>(x, qs + i, kTcRows * d);
    os[i] = 0.0f;
  }
  if (tid < kTcRows) {
    ms[tid] = -INFINITY;
    ls[tid] = 0.0f;
  }
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  const char* kbase = static_cast<const char*>(p.k_plane) + h * p.head_stride;
  const char* vbase = static_cast<const char*>(p.v_plane) + h * p.head_stride;
  const int chunks = d / 8;  // 16-byte chunks of a row
  for (int64_t start = key_lo; start <= last_pos; start += kTcKeys) {
    __syncthreads();  // the previous tile is read, Q / O / m / l written
    if (tid < kTcKeys) {
      const int64_t tok = start + tid;
      held[tid] = tok <= last_pos && table[tok / p.block_len] >= 0;
    }
    for (int i = tid; i < kTcKeys * chunks; i += kThreads) {
      const int t = i / chunks, c = i % chunks;
      const int64_t tok = start + t;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (tok <= last_pos) {
        const int32_t b = table[tok / p.block_len];
        if (b >= 0) {
          const int64_t off = b * p.slab_stride + (tok % p.block_len) * p.row_bytes + c * 16;
          kv = *reinterpret_cast<const uint4*>(kbase + off);
          vv = *reinterpret_cast<const uint4*>(vbase + off);
        }
      }
      reinterpret_cast<uint4*>(ks + t * d)[c] = kv;
      reinterpret_cast<uint4*>(vs + t * d)[c] = vv;
    }
    __syncthreads();
    // S = Q K^T for this warp's 16 rows: K [keys][d] row-major is K^T
    // column-major with ldm d.
    const int wr = warp * 16;
    for (int kf = 0; kf < kTcKeys / 16; ++kf) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int kk = 0; kk < d / 16; ++kk) {
        MmaParts<T, wmma::col_major>(acc, qs + wr * d + kk * 16, d, kTcRows * d, ks + kf * 16 * d + kk * 16, d);
      }
      wmma::store_matrix_sync(ss + wr * kTcKeys + kf * 16, acc, kTcKeys, wmma::mem_row_major);
    }
    __syncwarp();
    // Online softmax: two lanes per row, 32 keys each.
    {
      const int r = wr + lane / 2, half = lane % 2;
      const int qi = r / G;
      const bool active = r < rows && qi < nq;
      const int64_t pos = first_pos + qi;
      const int64_t lo = window > 0 ? pos - window + 1 : 0;
      float* srow = ss + r * kTcKeys + half * 32;
      float tile_max = -INFINITY;
      for (int t = 0; t < 32; ++t) {
        const int key = half * 32 + t;
        const int64_t tok = start + key;
        float s = -INFINITY;
        if (active && held[key] && tok <= pos && tok >= lo) {
          s = srow[t] * scale;
          if (p.softcap > 0) s = p.softcap * tanhf(s / p.softcap);
        }
        srow[t] = s;
        tile_max = fmaxf(tile_max, s);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      const float m_old = ms[r];
      const float m_new = fmaxf(m_old, tile_max);
      float sum = 0.0f;
      for (int t = 0; t < 32; ++t) {
        const float e = m_new == -INFINITY || srow[t] == -INFINITY ? 0.0f : expf(srow[t] - m_new);
        sum += e;
        Split<T>(e, ps + r * kTcKeys + half * 32 + t, kTcRows * kTcKeys);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      if (half == 0) {
        const float alpha = m_new == -INFINITY ? 1.0f : expf(m_old - m_new);  // 0 when m was -inf
        alphas[r] = alpha;
        ls[r] = ls[r] * alpha + sum;
        ms[r] = m_new;
      }
    }
    __syncwarp();
    for (int i = lane; i < 16 * d; i += 32) {
      const int r = wr + i / d;
      os[r * d + i % d] *= alphas[r];
    }
    __syncwarp();
    // O += P V: V [keys][d] row-major is the B operand as is.
    for (int of = 0; of < d / 16; ++of) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, os + wr * d + of * 16, d, wmma::mem_row_major);
      for (int kk = 0; kk < kTcKeys / 16; ++kk) {
        MmaParts<T, wmma::row_major>(acc, ps + wr * kTcKeys + kk * 16, kTcKeys, kTcRows * kTcKeys,
                                     vs + kk * 16 * d + of * 16, d);
      }
      wmma::store_matrix_sync(os + wr * d + of * 16, acc, d, wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int i = tid; i < kTcRows * d; i += kThreads) {
    const int r = i / d, j = i % d, qi = r / G;
    if (r >= rows || qi >= nq) continue;
    const int64_t row = row0 + qi;
    const int head = h * G + r % G;
    const float l = ls[r];
    p.out[(row * p.q_heads + head) * d + j] = l > 0 ? os[i] / l : 0.0f;
    if (j == 0 && p.lse != nullptr) p.lse[row * p.q_heads + head] = l > 0 ? ms[r] + logf(l) : -INFINITY;
  }
}

template <typename T>
cudaError_t Launch(const PrefillParams& p, cudaStream_t stream) {
  const int queries_per_cta = kTcRows / (p.q_heads / p.kv_heads);
  const int64_t tiles = (static_cast<int64_t>(p.max_query_len) + queries_per_cta - 1) / queries_per_cta;
  if (tiles > 65535 || p.num_seqs > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(tiles));
  const size_t shared = TcSharedBytes(p.head_dim, TcParts<T>::kParts);
  if (cudaError_t e = cudaFuncSetAttribute(TensorCorePrefillKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared));
      e != cudaSuccess) {
    return e;
  }
  TensorCorePrefillKernel<T><<<grid, kThreads, shared, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool TensorCorePrefillShape(const PrefillParams& p) {
  return (p.type == KvType::kF16 || p.type == KvType::kBF16) && p.head_dim % 16 == 0 && p.head_dim >= 16 &&
         p.head_dim <= kTcMaxDim && p.row_bytes % 16 == 0 && p.slab_stride % 16 == 0 && p.head_stride % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.k_plane) % 16 == 0 && reinterpret_cast<uintptr_t>(p.v_plane) % 16 == 0;
}

cudaError_t LaunchTensorCorePrefill(const PrefillParams& p, cudaStream_t stream) {
  if (!TensorCorePrefillShape(p)) return cudaErrorInvalidValue;
  return p.type == KvType::kF16 ? Launch<__half>(p, stream) : Launch<__nv_bfloat16>(p, stream);
}

}  // namespace pagekv::cuda
