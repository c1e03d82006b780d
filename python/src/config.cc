#include "config.h"

#include "errors.h"
#include "pagekv/dtype.h"
#include "pagekv/plan.h"
#include "pagekv/units.h"

namespace pagekv::python {

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

GeometrySpec Spec(const GeometryArgs& a) {
  GeometrySpec g;
  g.preset = a.preset;
  g.num_layers = a.num_layers;
  g.num_q_heads = a.num_q_heads;
  g.num_kv_heads = a.num_kv_heads;
  g.head_dim = a.head_dim;
  g.kv_lora_rank = a.kv_lora_rank;
  g.rope_dim = a.rope_dim;
  g.block_len = a.block_len;
  g.dtype = a.dtype;
  g.layer_dtypes = a.layer_dtypes;
  g.num_blocks = a.num_blocks;
  if (a.budget) g.budget_bytes = ToBytes(*a.budget, "budget");
  return g;
}

Geometry BuildGeometry(const GeometryArgs& a) {
  ResolvedPlanRequest r = Take(ResolvePlanRequest(Spec(a)));
  return Geometry{std::move(r.request.config), r.context_len};
}

}  // namespace pagekv::python
