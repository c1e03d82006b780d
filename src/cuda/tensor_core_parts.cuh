// 16-bit operands for the tensor cores that keep about f32's precision: an
// f32 value x as a sum of kParts f16 (or bf16) values, each the rounding of
// what the previous ones left. Products of these parts with exact 16-bit K
// and V rows, summed in f32 by the tensor cores, give the f32 product to
// within a few ulps. Shared by the prefill and decode kernels on the tensor
// cores (paged_attention.cu, tensor_core_decode.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pagekv::cuda {

template <typename T>
struct TcParts;
template <>
struct TcParts<__half> {
  static constexpr int kParts = 2;  // 11 + 11 significant bits
  __device__ static __half From(float x) { return __float2half_rn(x); }
  __device__ static float To(__half x) { return __half2float(x); }
};
template <>
struct TcParts<__nv_bfloat16> {
  static constexpr int kParts = 3;  // 8 + 8 + 8 significant bits
  __device__ static __nv_bfloat16 From(float x) { return __float2bfloat16_rn(x); }
  __device__ static float To(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// x as a sum of kParts 16-bit values, into parts[i * stride].
template <typename T>
__device__ inline void Split(float x, T* parts, int stride) {
  float rest = x;
#pragma unroll
  for (int i = 0; i < TcParts<T>::kParts; ++i) {
    const T h = TcParts<T>::From(rest);
    parts[i * stride] = h;
    rest -= TcParts<T>::To(h);
  }
}

}  // namespace pagekv::cuda
