// A cache geometry from Python keyword arguments: a named preset (the
// planner's table), then every field the caller gave, exactly as
// `pagekv plan` reads its flags.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>

#include "pagekv/kv_layout.h"
#include "pagekv/plan.h"

namespace pagekv::python {

// A byte count as Python callers write it: 67108864 or "64MiB".
using ByteSize = std::variant<int64_t, std::string>;

struct GeometryArgs {
  std::optional<std::string> preset;
  std::optional<int64_t> num_layers, num_q_heads, num_kv_heads, head_dim;
  std::optional<int64_t> kv_lora_rank, rope_dim;  // either set: an MLA cache
  std::optional<int64_t> block_len;
  std::optional<std::string> dtype;        // "f16", "bf16", "int8", "fp8_e4m3", "int4", ...
  std::optional<std::string> layer_dtypes; // "0=f16,-1=f16" (first and last layers in f16, the base dtype elsewhere)
  std::optional<int64_t> num_blocks;
  std::optional<ByteSize> budget;
};

struct Geometry {
  CacheConfig config;
  int64_t context_len = 0;  // the preset's trained context; 0 without a preset
};

// The library's rules (ResolvePlanRequest) over the keyword arguments.
GeometrySpec Spec(const GeometryArgs& a);

// Raises pagekv.InvalidArgumentError (or NotFoundError for an unknown
// preset) naming the argument.
Geometry BuildGeometry(const GeometryArgs& a);

// Raises InvalidArgumentError for a negative or malformed size.
int64_t ToBytes(const ByteSize& size, const char* what);

}  // namespace pagekv::python
