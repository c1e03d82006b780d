// KV writes and block copies on the GPU (see kv_store.h).
//
// StoreKv: one warp per (token, KV head) row pair, lanes over head_dim; the
// 8-bit formats take the row's largest magnitude by a warp reduction, then
// encode each element with the host encoder's arithmetic (the same f32
// divisions and round-half-even, so the same bytes). CopyBlocks: one CTA per
// (pair, plane x head) slab, 16-byte copies where both slabs and the length
// allow it.
#include "cuda/kv_store.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/encode_row.cuh"

namespace pagekv::cuda {
namespace {

constexpr int kWarps = 4;

__global__ void __launch_bounds__(kWarps * 32) StoreKernel(StoreParams p) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= static_cast<int64_t>(p.num_tokens) * p.kv_heads) return;
  const int64_t token = pair / p.kv_heads;
  const int h = static_cast<int>(pair % p.kv_heads);
  const int64_t slot = p.slots[token];
  if (slot < 0) return;  // padding
  if (slot >= p.num_blocks * p.block_len) {
    if (lane == 0 && p.bad_slots != nullptr) atomicAdd(p.bad_slots, 1);
    return;
  }
  const int64_t off = static_cast<int64_t>(h) * p.head_stride + (slot / p.block_len) * p.slab_stride +
                      (slot % p.block_len) * p.row_bytes;
  const int64_t src = (token * p.kv_heads + h) * p.head_dim;
  EncodeRow(p.type, p.k + src, p.head_dim, static_cast<char*>(p.k_plane) + off, lane);
  EncodeRow(p.type, p.v + src, p.head_dim, static_cast<char*>(p.v_plane) + off, lane);
}

__global__ void CopyKernel(CopyParams p) {
  const BlockCopy pc = p.pairs[blockIdx.x];
  if (pc.src < 0 || pc.dst < 0 || pc.src >= p.num_blocks || pc.dst >= p.num_blocks) {
    if (blockIdx.y == 0 && threadIdx.x == 0 && p.bad_pairs != nullptr) atomicAdd(p.bad_pairs, 1);
    return;
  }
  if (pc.src == pc.dst) return;
  const int plane = static_cast<int>(blockIdx.y) / p.kv_heads, h = static_cast<int>(blockIdx.y) % p.kv_heads;
  char* base = static_cast<char*>(p.planes[plane]) + static_cast<int64_t>(h) * p.head_stride;
  const char* from = base + pc.src * p.slab_stride;
  char* to = base + pc.dst * p.slab_stride;
  const auto bits = reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) | static_cast<uintptr_t>(p.slab_bytes);
  if (bits % 16 == 0) {
    const int64_t n = p.slab_bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
  } else {
    for (int64_t i = threadIdx.x; i < p.slab_bytes; i += blockDim.x) to[i] = from[i];
  }
}

}  // namespace

cudaError_t StoreKv(const StoreParams& p, cudaStream_t stream) {
  if (static_cast<int32_t>(p.type) < 0 || static_cast<int32_t>(p.type) > static_cast<int32_t>(KvType::kFp8E5M2)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens < 0 || p.kv_heads < 1 || p.head_dim < 1 || p.block_len < 1 || p.num_blocks < 1) return cudaErrorInvalidValue;
  const int64_t elem = ElementBytes(p.type);
  if (p.row_bytes < RowBytesNeeded(p.type, p.head_dim) || p.row_bytes % elem != 0 || p.slab_stride % elem != 0 ||
      p.head_stride % elem != 0 || p.slab_stride < p.block_len * p.row_bytes) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.k_plane == nullptr || p.v_plane == nullptr || p.slots == nullptr || p.k == nullptr || p.v == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.kv_heads;
  StoreKernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t CopyBlocks(const CopyParams& p, cudaStream_t stream) {
  if (p.num_pairs < 0 || p.num_planes < 0 || p.kv_heads < 1 || p.slab_bytes < 0 || p.slab_bytes > p.slab_stride ||
      p.num_blocks < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.num_pairs == 0 || p.num_planes == 0) return cudaSuccess;
  if (p.planes == nullptr || p.pairs == nullptr || static_cast<int64_t>(p.num_planes) * p.kv_heads > 65535) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(p.num_pairs), static_cast<unsigned>(p.num_planes * p.kv_heads));
  CopyKernel<<<grid, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace pagekv::cuda
