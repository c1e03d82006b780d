#include "config.h"

#include <climits>

#include "errors.h"
#include "pagekv/dtype.h"
#include "pagekv/plan.h"
#include "pagekv/units.h"

namespace pagekv::python {
namespace {

// Values outside int32 become ones Validate() rejects with the field's name.
int32_t Narrow(int64_t v) { return v > INT32_MAX ? INT32_MAX : (v < INT32_MIN ? INT32_MIN : static_cast<int32_t>(v)); }

}  // namespace

int64_t ToBytes(const ByteSize& size, const char* what) {
  int64_t bytes = 0;
  if (const auto* n = std::get_if<int64_t>(&size)) {
    bytes = *n;
  } else {
    bytes = Take(ParseByteSize(std::get<std::string>(size)));
  }
  if (bytes <= 0) RaiseInvalid(std::string(what) + " " + std::to_string(bytes) + ": must be positive");
  return bytes;
}

Geometry BuildGeometry(const GeometryArgs& a) {
  Geometry g;
  CacheConfig& c = g.config;
  if (a.preset) {
    const ModelPreset p = Take(FindPreset(*a.preset));
    c = p.config;
    g.context_len = p.context_len;
  } else if (!a.num_layers) {
    RaiseInvalid(
        "no cache geometry: give preset=NAME (pagekv.presets() lists them), or num_layers with num_kv_heads and "
        "head_dim (or kv_lora_rank for an MLA cache)");
  }
  if (a.num_layers) c.num_layers = Narrow(*a.num_layers);
  if (a.kv_lora_rank) {
    c.kind = CacheKind::kMla;
    c.kv_lora_rank = Narrow(*a.kv_lora_rank);
    c.num_kv_heads = 0;
  }
  if (a.rope_dim) c.rope_dim = Narrow(*a.rope_dim);
  if (a.num_kv_heads) c.num_kv_heads = Narrow(*a.num_kv_heads);
  if (a.head_dim) c.head_dim = Narrow(*a.head_dim);
  if (a.num_q_heads) {
    c.num_q_heads = Narrow(*a.num_q_heads);
  } else if (!a.preset) {
    c.num_q_heads = c.kind == CacheKind::kMla ? 1 : c.num_kv_heads;  // MHA unless told
  }
  if (a.block_len) c.block_len = Narrow(*a.block_len);
  if (a.dtype) c.format = KvFormat::ForDType(Take(ParseDType(*a.dtype)), 0);
  if (a.num_blocks) {
    if (*a.num_blocks <= 0) RaiseInvalid("num_blocks " + std::to_string(*a.num_blocks) + ": must be positive");
    c.num_blocks = *a.num_blocks;
  }
  if (a.budget) {
    c.budget_bytes = ToBytes(*a.budget, "budget");
    if (!a.num_blocks) c.num_blocks = 0;  // the budget decides, not the preset
  }
  const int32_t row_elems = c.kind == CacheKind::kMla ? c.kv_lora_rank + c.rope_dim : c.head_dim;
  if (!c.format.IsPlainFloat()) c.format = KvFormat::ForDType(c.format.dtype, row_elems);
  if (a.layer_dtypes) c.layer_formats = Take(ParseLayerFormats(*a.layer_dtypes, c.num_layers, row_elems, c.format));
  return g;
}

}  // namespace pagekv::python
