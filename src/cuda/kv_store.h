// KV writes and block copies on the GPU, in the byte layout of
// docs/KV_LAYOUT.md (the same planes, strides and block ids as
// paged_attention.h reads).
//
// StoreKv writes one layer's new K and V rows by slot mapping: token i of
// the step goes to slot slots[i] = block * block_len + offset of every KV
// head's slab, converted to the cache's type; the 8-bit formats are encoded
// on the GPU with the rule of layout/quantize.cc, so the bytes equal the
// host encoder's (the test checks it bit for bit). A negative slot is a
// padding token and is skipped; a slot past the arena is skipped and
// counted in *bad_slots, never written.
//
// CopyBlocks copies whole blocks (every KV head's slab of each listed plane)
// from src to dst: copy-on-write of a shared block and compaction. The
// pairs of one call run concurrently, so no pair's dst may be another
// pair's src.
//
// Needs only the CUDA runtime, like paged_attention.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/paged_attention.h"

namespace pagekv::cuda {

struct StoreParams {
  KvType type = KvType::kF16;
  int32_t num_tokens = 0, kv_heads = 0, head_dim = 0, block_len = 0;
  int64_t num_blocks = 0;  // blocks per (layer, head) in the arena: slots >= num_blocks * block_len are refused
  // Device pointers. Plane layout as in DecodeParams.
  void* k_plane = nullptr;
  void* v_plane = nullptr;
  int64_t head_stride = 0, slab_stride = 0, row_bytes = 0;  // bytes; row_bytes >= RowBytesNeeded(type, head_dim)
  const int64_t* slots = nullptr;  // [num_tokens]
  const float* k = nullptr;        // [num_tokens][kv_heads][head_dim]
  const float* v = nullptr;
  int32_t* bad_slots = nullptr;    // optional: incremented per (token, head) row whose slot is past the arena
};

// Errors: a shape outside the limits (cudaErrorInvalidValue: no planes,
// head_dim < 1, rows too short for the type, strides not multiples of the
// element size), or the launch's error.
cudaError_t StoreKv(const StoreParams& p, cudaStream_t stream);

struct BlockCopy {
  int32_t src = 0, dst = 0;
};

struct CopyParams {
  void* const* planes = nullptr;  // device array: base of each plane copied (every layer's K and V)
  int32_t num_planes = 0, kv_heads = 0;
  int64_t head_stride = 0, slab_stride = 0;
  int64_t slab_bytes = 0;  // bytes of a block's slab that hold rows (block_len * row_bytes)
  int64_t num_blocks = 0;  // pairs naming a block >= num_blocks are skipped and counted
  const BlockCopy* pairs = nullptr;  // device array
  int32_t num_pairs = 0;
  int32_t* bad_pairs = nullptr;  // optional counter
};

cudaError_t CopyBlocks(const CopyParams& p, cudaStream_t stream);

}  // namespace pagekv::cuda
