// 16-bit operands for the tensor cores that keep about f32's precision: an
// f32 value x as a sum of kParts f16 (or bf16) values, each the rounding of
// what the previous ones left. Products of these parts with exact 16-bit K
// and V rows, summed in f32 by the tensor cores, give the f32 product to
// within a few ulps. Shared by the prefill and decode kernels on the tensor
// cores (paged_attention.cu, tensor_core_decode.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

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

// acc += A B on the tensor cores with A in parts: B a 16x16 tile at b
// (leading dimension ldb, layout L), A's parts 16x16 row-major tiles at
// a + part * part_stride (leading dimension lda). The warp's call.
template <typename T, typename L>
__device__ inline void MmaParts(nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>& acc, const T* a,
                                int lda, int part_stride, const T* b, int ldb) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, L> fb;
  wmma::load_matrix_sync(fb, b, ldb);
#pragma unroll
  for (int part = 0; part < TcParts<T>::kParts; ++part) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + part * part_stride, lda);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

}  // namespace pagekv::cuda
