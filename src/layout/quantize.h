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
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagekv::quant {

void EncodeInt8Row(const float* x, int32_t n, std::byte* row);
void DecodeInt8Row(const std::byte* row, int32_t n, float* x);
// The row's scale (for kernels that apply it after a dot product).
float Int8RowScale(const std::byte* row, int32_t n);

}  // namespace pagekv::quant
