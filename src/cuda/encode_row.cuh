// One K / V row encoded by a warp into the cache's row format: f32 / f16 /
// bf16 converted, the 8-bit formats with the row's largest magnitude (a warp
// reduction) and the host encoder's arithmetic (kv_codec.h), so the bytes are
// layout/quantize.cc's. Shared by the KV store (kv_store.cu) and the layer
// ops' row encoding (layer_ops.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kv_codec.h"
#include "cuda/paged_attention.h"

namespace pagekv::cuda {

__device__ inline float WarpMaxF(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One row of d values from x into `row`, by the warp.
__device__ inline void EncodeRow(KvType type, const float* x, int d, char* row, int lane) {
  switch (type) {
    case KvType::kF32:
      for (int j = lane; j < d; j += 32) reinterpret_cast<float*>(row)[j] = x[j];
      return;
    case KvType::kF16:
      for (int j = lane; j < d; j += 32) reinterpret_cast<__half*>(row)[j] = __float2half_rn(x[j]);
      return;
    case KvType::kBF16:
      for (int j = lane; j < d; j += 32) reinterpret_cast<__nv_bfloat16*>(row)[j] = __float2bfloat16_rn(x[j]);
      return;
    default:
      break;
  }
  float amax = 0.0f;
  for (int j = lane; j < d; j += 32) amax = fmaxf(amax, fabsf(x[j]));
  amax = WarpMaxF(amax);
  const unsigned short s16 = codec::ScaleAtLeast(amax / codec::CodeTop(type == KvType::kInt8, type == KvType::kFp8E4M3));
  const float s = codec::ScaleValue(s16);
  auto* out = reinterpret_cast<uint8_t*>(row);
  for (int j = lane; j < d; j += 32) {
    if (type == KvType::kInt8) {
      out[j] = codec::Int8Code(x[j], s);
    } else {
      out[j] = s > 0.0f ? codec::F32ToFp8(x[j] / s, type == KvType::kFp8E4M3) : 0;
    }
  }
  if (lane == 0) {  // byte stores: the scale's address is 2-byte aligned only when head_dim is even
    out[d] = static_cast<uint8_t>(s16 & 0xFF);
    out[d + 1] = static_cast<uint8_t>(s16 >> 8);
  }
}

}  // namespace pagekv::cuda
