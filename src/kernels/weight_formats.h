// Weight storage formats the model runner reads in place: plain f32 / f16 /
// bf16 rows and ggml's block-quantized formats, byte for byte as GGUF files
// store them (little-endian; "half" = IEEE binary16):
//
//   type  elems bytes  block layout                                   value
//   q4_0    32    18   half d; u8 qs[16]                               d * (q - 8)
//   q4_1    32    20   half d, m; u8 qs[16]                            d * q + m
//   q5_0    32    22   half d; u32 qh; u8 qs[16]                       d * (q - 16)
//   q5_1    32    24   half d, m; u32 qh; u8 qs[16]                    d * q + m
//   q8_0    32    34   half d; i8 qs[32]                               d * q
//   q2_k   256    84   u8 scales[16]; u8 qs[64]; half d, dmin          d*sc*q - dmin*m
//   q3_k   256   110   u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d  d*(sc-32)*(q-4*!h)
//   q4_k   256   144   half d, dmin; u8 scales[12]; u8 qs[128]         d*sc*q - dmin*m
//   q5_k   256   176   half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
//   q6_k   256   210   u8 ql[128]; u8 qh[64]; i8 scales[16]; half d    d*sc*(q-32)
//
// 32-element blocks: qs[j] holds element j in its low nibble and element
// j + 16 in its high one; q5's fifth bit of element j is bit j of qh.
// 256-element blocks are cut into sub-blocks of 16 (q2_k, q3_k, q6_k) or 32
// (q4_k, q5_k) elements with their own 4-, 6- or 8-bit scales (and mins);
// DecodeWeights below is the normative definition of every bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace pagekv {

enum class WeightType : uint8_t {
  kF32, kF16, kBF16, kQ8_0,  // the first four keep their values
  kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K,
};
inline constexpr int kNumWeightTypes = 13;

struct WeightFormat {
  std::string_view name;  // as ggml names it ("q4_k")
  int32_t block_elems;    // 1 for plain types
  int32_t block_bytes;    // bytes of one block (of one element for plain types)
};

const WeightFormat& FormatOf(WeightType type);
inline bool IsBlockQuantized(WeightType t) { return FormatOf(t).block_elems > 1; }

// Bytes one row of `cols` elements occupies. REQUIRES: cols a multiple of
// the format's block_elems.
int64_t WeightRowBytes(WeightType type, int64_t cols);

// Normative scalar decoder: n elements (a multiple of block_elems) stored
// at `data` in `type`, as f32. Every SIMD kernel is tested against it.
void DecodeWeights(WeightType type, const std::byte* data, int64_t n, float* out);

// q4_k / q5_k: the 6-bit scale and min of sub-block j (0..7) of the block at
// `block` (its 12 packed bytes after d and dmin); element e of sub-block j
// is d * sc * u - dmin * m.
void Q4KScaleMin(const std::byte* block, int j, uint8_t& sc, uint8_t& m);

}  // namespace pagekv
