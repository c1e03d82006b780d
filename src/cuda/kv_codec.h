// The per-element arithmetic of the 8-bit KV rows (docs/KV_LAYOUT.md), for
// the GPU's store and attention kernels and for the host: every function is
// __host__ __device__, so kv_codec_test.cu checks the very code the kernels
// run against the host's normative encoders (layout/quantize.cc) on a
// machine without a GPU. Each function follows its host counterpart step
// for step (the same f32 divisions, round-half-even and saturation), so a
// row stored on the GPU holds the bytes the host would have written.
//
// Needs nvcc (cuda_fp16.h's conversions are host-callable there).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace pagekv::cuda::codec {

// E4M3 codes are decoded as f16 bit patterns worth value / 256 (the exponent
// biases differ by 8): multiply by this to get the value.
inline constexpr float kE4M3Unshift = 256.0f;

// The largest magnitude a row's scale maps to: int8 127, E4M3 448, E5M2 57344.
__host__ __device__ inline float CodeTop(bool int8, bool e4m3) { return int8 ? 127.0f : e4m3 ? 448.0f : 57344.0f; }

// The smallest f16 >= want (quantize.cc ScaleAtLeast), as bits.
__host__ __device__ inline unsigned short ScaleAtLeast(float want) {
  unsigned short b = __half_as_ushort(__float2half_rn(want));
  if (__half2float(__ushort_as_half(b)) < want) ++b;  // the next f16 up (positive, finite)
  return b;
}

__host__ __device__ inline float ScaleValue(unsigned short s16) { return __half2float(__ushort_as_half(s16)); }

// x / s rounded half to even and clamped to [-127, 127] (s > 0), as the byte.
__host__ __device__ inline uint8_t Int8Code(float x, float s) {
  const float q = s > 0.0f ? rintf(x / s) : 0.0f;
  return static_cast<uint8_t>(static_cast<int8_t>(fminf(fmaxf(q, -127.0f), 127.0f)));
}

// quantize.cc F32ToFp8: x (already divided by the row's scale) to an E4M3
// or E5M2 code, saturating at the largest finite value; NaN maps to +-0.
__host__ __device__ inline uint8_t F32ToFp8(float x, bool e4m3) {
  const int mant_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const float max = e4m3 ? 448.0f : 57344.0f;
  const uint8_t sign = signbit(x) ? 0x80 : 0x00;
  float a = fabsf(x);
  if (!(a == a)) a = 0.0f;
  a = fminf(a, max);
  const int min_exp = 1 - bias;
  int e;
  frexpf(a, &e);
  e -= 1;
  if (a == 0.0f || e < min_exp) e = min_exp;
  const float step = ldexpf(1.0f, e - mant_bits);
  int q = static_cast<int>(rintf(a / step));
  const int one = 1 << mant_bits;
  if (q >= 2 * one) {
    q >>= 1;
    ++e;
  }
  int exp_field, mant_field;
  if (q < one) {
    exp_field = 0;
    mant_field = q;
  } else {
    exp_field = e + bias;
    mant_field = q - one;
  }
  uint8_t code = static_cast<uint8_t>(sign | (exp_field << mant_bits) | mant_field);
  const uint8_t top = e4m3 ? 0x7E : 0x7B;
  if ((code & 0x7F) > top) code = static_cast<uint8_t>(sign | top);
  return code;
}

// One code's value before the row scale: int8 q; E5M2 its value; E4M3 its
// value / kE4M3Unshift (one shift and an f16 conversion, no branch).
__host__ __device__ inline float DecodeInt8(uint32_t c) {
  return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(c)));
}
__host__ __device__ inline float DecodeE5M2(uint32_t c) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>((c & 0xFFu) << 8)));
}
__host__ __device__ inline float DecodeE4M3Shifted(uint32_t c) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(((c & 0x80u) << 8) | ((c & 0x7Fu) << 7))));
}

}  // namespace pagekv::cuda::codec
