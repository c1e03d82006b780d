// Element types of cached K/V and the storage-format description that names
// them.
//
// DType lists every element type PageKV knows. KvFormat describes how a row of
// K, V or MLA latent is stored: the element type and, for the quantized types,
// how scales are grouped. Plain f32 / f16 / bf16 have no scales. The quantized
// formats a KvCache stores and the kernels read: int8 and fp8 with one f16
// scale per (token, head) row, and int4 KIVI (keys per channel over token
// groups, values per token). Other combinations can be described (configs
// and the planner accept them) but a KvCache rejects them with
// kUnimplemented.
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pagekv/status.h"

namespace pagekv {

enum class DType : uint8_t {
  kF32,      // IEEE binary32
  kF16,      // IEEE binary16
  kBF16,     // bfloat16: the top 16 bits of a binary32
  kFP8E4M3,  // 8-bit float, 4 exponent + 3 mantissa bits (OCP FP8, "fn" variant)
  kFP8E5M2,  // 8-bit float, 5 exponent + 2 mantissa bits
  kInt8,     // signed 8-bit integer, used with scales
  kInt4,     // signed 4-bit integer, two per byte, used with scales
};

// Storage bits of one element: 32, 16, 16, 8, 8, 8, 4.
int DTypeBits(DType dtype);

// Canonical name: "f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4".
std::string_view DTypeName(DType dtype);

// Parses a canonical name or an alias (float32, fp32, float16, fp16, half,
// bfloat16, e4m3, e5m2, q8, q4; case-insensitive). The error lists the
// accepted names.
Result<DType> ParseDType(std::string_view name);

// Which elements share one scale in a quantized format.
enum class ScaleAxis : uint8_t {
  kNone,        // no scales (f32, f16, bf16)
  kPerToken,    // `group_size` consecutive elements of one token's row share a scale
  kPerChannel,  // one channel over `group_size` consecutive tokens shares a scale
};

// How one K, V or latent row is stored.
struct KvFormat {
  DType dtype = DType::kF16;
  ScaleAxis scale_axis = ScaleAxis::kNone;
  int32_t group_size = 0;          // elements per scale; 0 when scale_axis == kNone
  DType scale_dtype = DType::kF16;  // storage type of each scale
  // int8 / fp8 rows: the row is stored rotated by the orthonormal Hadamard
  // transform (layout/quantize.h), which spreads a row's outlier channels
  // over all of its elements before one scale is chosen for them. The
  // attention kernels rotate the query the same way and rotate the output
  // back, so results are those of the unrotated values. Needs a power-of-two
  // row length.
  bool hadamard = false;

  static constexpr KvFormat Plain(DType d) { return KvFormat{d, ScaleAxis::kNone, 0, DType::kF16, false}; }
  // The same format with Hadamard-rotated rows (int8 and fp8 only).
  KvFormat WithHadamard() const {
    KvFormat f = *this;
    f.hadamard = true;
    return f;
  }
  // INT8 with one f16 scale per (token, head) row of `row_elems` elements
  // (docs/KV_LAYOUT.md): row_bytes = row_elems + 2.
  static constexpr KvFormat Int8(int32_t row_elems) {
    return KvFormat{DType::kInt8, ScaleAxis::kPerToken, row_elems, DType::kF16, false};
  }
  // FP8 (kFP8E4M3 or kFP8E5M2) with one f16 scale per (token, head) row:
  // row_bytes = row_elems + 2.
  static constexpr KvFormat Fp8(DType d, int32_t row_elems) {
    return KvFormat{d, ScaleAxis::kPerToken, row_elems, DType::kF16, false};
  }
  // INT4, KIVI-style (docs/KV_LAYOUT.md): keys quantized per channel over
  // groups of `group` tokens, values per token, both asymmetric 4-bit codes
  // with an f16 scale and minimum; a sequence's most recent, not-yet-full
  // group stays in f16 beside the pool until it fills. group: a power of two
  // in [8, 256] dividing block_len; head_dim even.
  static constexpr KvFormat Int4Kivi(int32_t group) {
    return KvFormat{DType::kInt4, ScaleAxis::kPerChannel, group, DType::kF16, false};
  }
  static constexpr int32_t kDefaultKiviGroup = 32;
  // The format `--kv-dtype` names for rows of row_elems elements: plain for
  // f32/f16/bf16, one f16 scale per row for int8 and fp8, KIVI with groups
  // of kDefaultKiviGroup tokens for int4.
  static KvFormat ForDType(DType d, int32_t row_elems);
  // True for the INT4 KIVI format (Int4Kivi).
  bool IsKivi() const {
    return dtype == DType::kInt4 && scale_axis == ScaleAxis::kPerChannel && scale_dtype == DType::kF16;
  }
  // True for the quantized formats a KvCache stores and the kernels read:
  // int8, fp8 E4M3 and fp8 E5M2 with one f16 scale per row (group_size == row_elems).
  bool IsStoredQuantized(int32_t row_elems) const;

  // True for f32, f16 and bf16 without scales: the formats a KvCache stores today.
  bool IsPlainFloat() const;

  // "f16", or "int8 (f16 scale per 128 elements of a token)".
  std::string ToString() const;
};

}  // namespace pagekv
