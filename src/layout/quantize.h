// The normative scalar encode/decode of quantized KV rows. Kernels have SIMD
// versions; these define the bytes.
//
// INT8, one scale per (token, head) row (KvFormat::Int8(head_dim)):
//
//   row = [E x int8 values][f16 scale]          row_bytes = E + 2
//   s   = the smallest f16 >= max_i |x_i| / 127 (0 for an all-zero row)
//   q_i = clamp(round_half_even(x_i / s), -127, 127)
//   x_i ~ q_i * s                               |error| <= s / 2 per element
//
// Values on the grid (x_i = k_i * s with s an f16 and |k_i| <= 127, one of
// them 127) round-trip exactly.
//
// FP8 (E4M3 "fn": bias 7, max 448, no infinities; E5M2: bias 15, max 57344),
// one scale per (token, head) row (KvFormat::Fp8(dtype, head_dim)):
//
//   row = [E x fp8 codes][f16 scale]          row_bytes = E + 2
//   s   = the smallest f16 >= max_i |x_i| / max_fp8   (0 for an all-zero row)
//   c_i = fp8(x_i / s), round to nearest even, subnormals kept
//   x_i ~ value(c_i) * s                      relative error <= 2^-4 (E4M3), 2^-3 (E5M2)
//                                             near the top, absolute s * 2^-9 / 2^-16 at the bottom
//
// value(c) is the code's f16 with the bits placed so that E5M2 is exactly the
// top byte of an f16 and E4M3's 4-bit exponent lands 8 below: decode is a
// shift, an f16 to f32 conversion and (E4M3) a multiply by 256.
// INT4 KIVI (KvFormat::Int4Kivi(G)), asymmetric 4-bit codes c in [0, 15]:
//
//   x ~ c * s + m,  s = the smallest f16 >= (max - min) / 15 (0 when max == min),
//                   m = the f16 nearest min, c = clamp(round_half_even((x - m) / s), 0, 15)
//   |error| <= s / 2 plus m's f16 rounding (at most half an f16 ulp of min)
//
// Two codes per byte, element 2i in the low nibble of byte i.
//   value row (per token): [D/2 code bytes][f16 s][f16 m]        D/2 + 4 bytes
//   key group (per channel over G tokens):
//     [G rows of D/2 code bytes][D f16 s][D f16 m]               G*D/2 + 4*D bytes
//   (scales and minimums each contiguous, so a kernel converts them a vector at a time)
// Values on the grid (x = c * s + m with s, m f16 and both 0 and 15 used)
// round-trip exactly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagekv::quant {

// The orthonormal Hadamard transform of x[0, n) in place (Sylvester order,
// scaled by 1/sqrt(n)); its own inverse. REQUIRES: n a power of two. Rows of
// a Hadamard-rotated format (KvFormat::hadamard) are encoded from H x.
void HadamardInPlace(float* x, int32_t n);

// The smallest f16 >= want (0 for 0), as bits: a row scale that never needs
// clamping (rounding to nearest could land below it, by up to 3% where f16
// is subnormal).
uint16_t ScaleAtLeast(float want);

void EncodeInt8Row(const float* x, int32_t n, std::byte* row);
void DecodeInt8Row(const std::byte* row, int32_t n, float* x);
// The row's scale (for kernels that apply it after a dot product).
float Int8RowScale(const std::byte* row, int32_t n);

// fp8: dtype is DType::kFP8E4M3 or DType::kFP8E5M2.
uint8_t F32ToFp8(float x, bool e4m3);  // x within the format's range (saturates otherwise)
float Fp8ToF32(uint8_t c, bool e4m3);
void EncodeFp8Row(const float* x, int32_t n, bool e4m3, std::byte* row);
void DecodeFp8Row(const std::byte* row, int32_t n, bool e4m3, float* x);

// int4 KIVI. REQUIRES: d even.
int64_t Int4ValueRowBytes(int32_t d);             // d / 2 + 4
int64_t Int4KeyGroupBytes(int32_t g, int32_t d);  // g * d / 2 + 4 * d
void EncodeInt4ValueRow(const float* x, int32_t d, std::byte* row);
void DecodeInt4ValueRow(const std::byte* row, int32_t d, float* x);
// x: [g][d] (row t of the group at x + t * d); group: Int4KeyGroupBytes.
void EncodeInt4KeyGroup(const float* x, int32_t g, int32_t d, std::byte* group);
void DecodeInt4KeyGroup(const std::byte* group, int32_t g, int32_t d, float* x);
// The f16 (scale, minimum) pair of a key group's channel c, and of a value row.
void Int4KeyParams(const std::byte* group, int32_t g, int32_t d, int32_t c, float& scale, float& min);
void Int4ValueParams(const std::byte* row, int32_t d, float& scale, float& min);

}  // namespace pagekv::quant
