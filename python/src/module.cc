// The extension module pagekv._pagekv; python/pagekv/__init__.py re-exports
// it. Binds only the public API (include/pagekv/), as an application would.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "config.h"
#include "engine.h"
#include "errors.h"
#include "kv_cache.h"
#include "pagekv/dtype.h"
#include "pagekv/plan.h"
#include "pagekv/version.h"
#include "prefix_cache.h"
#include "tiers.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagekv::python {
namespace {

nb::dict PlanDict(const Plan& p) {
  nb::dict d;
  const CacheConfig& c = p.config;
  d["attention"] = std::string(AttentionKindName(p.attention));  // "MHA", "GQA", "MQA", "MLA"
  d["num_layers"] = c.num_layers;
  d["num_q_heads"] = c.num_q_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["kv_lora_rank"] = c.kv_lora_rank;
  d["rope_dim"] = c.rope_dim;
  d["block_len"] = c.block_len;
  d["format"] = c.format.ToString();
  std::vector<std::string> layers;
  for (const KvFormat& f : c.layer_formats) layers.push_back(f.ToString());
  d["layer_formats"] = layers;
  d["row_bytes"] = p.row_bytes;
  d["slab_bytes"] = p.slab_bytes;
  d["slab_stride"] = p.slab_stride;
  d["bytes_per_token_per_layer"] = p.bytes_per_token_per_layer;
  d["bytes_per_token"] = p.bytes_per_token;
  d["bytes_per_block"] = p.bytes_per_block;
  d["padding_bytes_per_block"] = p.padding_bytes_per_block;
  d["num_blocks"] = p.num_blocks;
  d["total_bytes"] = p.total_bytes;
  d["tokens_capacity"] = p.tokens_capacity;
  d["tail_bytes_per_sequence"] = p.tail_bytes_per_sequence;
  d["budget_bytes"] = p.budget_bytes;
  d["fits_budget"] = p.fits_budget;
  d["seq_len"] = p.seq_len;
  d["batch"] = p.batch;
  d["blocks_per_sequence"] = p.blocks_per_sequence;
  d["bytes_per_sequence"] = p.bytes_per_sequence;
  d["slack_tokens_per_sequence"] = p.slack_tokens_per_sequence;
  d["max_sequences"] = p.max_sequences;
  d["fits_batch"] = p.fits_batch;
  d["per_head_bytes_per_token"] = p.per_head_bytes_per_token;
  d["mla_reduction"] = p.mla_reduction;
  d["advice"] = p.advice;
  return d;
}

nb::dict MakePlanFor(const GeometryArgs& a, std::optional<int64_t> seq_len, std::optional<int64_t> batch) {
  GeometrySpec spec = Spec(a);
  spec.seq_len = seq_len;
  spec.batch = batch;
  const ResolvedPlanRequest r = Take(ResolvePlanRequest(spec));
  const PlanRequest& req = r.request;
  if (req.config.num_blocks == 0 && req.config.budget_bytes == 0 && req.batch == 0) {
    RaiseInvalid("no pool size: give num_blocks, budget, or batch with seq_len (a preset alone plans one "
                 "sequence of its context)");
  }
  return PlanDict(Take(MakePlan(req)));
}

}  // namespace
}  // namespace pagekv::python

NB_MODULE(_pagekv, m) {
  using namespace pagekv;
  using namespace pagekv::python;
  m.doc() = "PageKV: a paged KV-cache engine for LLM inference (the C++ library's Python module).";
  m.attr("__version__") = PAGEKV_VERSION;
  RegisterErrors(m);
  m.def(
      "plan",
      [](std::optional<std::string> preset, std::optional<int64_t> num_layers, std::optional<int64_t> num_q_heads,
         std::optional<int64_t> num_kv_heads, std::optional<int64_t> head_dim, std::optional<int64_t> kv_lora_rank,
         std::optional<int64_t> rope_dim, std::optional<int64_t> block_len, std::optional<std::string> dtype,
         std::optional<std::string> layer_dtypes, std::optional<int64_t> num_blocks, std::optional<ByteSize> budget,
         std::optional<int64_t> seq_len, std::optional<int64_t> batch) {
        GeometryArgs a{preset,   num_layers, num_q_heads, num_kv_heads, head_dim,   kv_lora_rank,
                       rope_dim, block_len,  dtype,       layer_dtypes, num_blocks, budget};
        return MakePlanFor(a, seq_len, batch);
      },
      nb::kw_only(), "preset"_a = nb::none(), "num_layers"_a = nb::none(), "num_q_heads"_a = nb::none(),
      "num_kv_heads"_a = nb::none(), "head_dim"_a = nb::none(), "kv_lora_rank"_a = nb::none(),
      "rope_dim"_a = nb::none(), "block_len"_a = nb::none(), "dtype"_a = nb::none(), "layer_dtypes"_a = nb::none(),
      "num_blocks"_a = nb::none(), "budget"_a = nb::none(), "seq_len"_a = nb::none(), "batch"_a = nb::none(),
      "The planner (`pagekv plan`): every byte of a cache before it is allocated, as a dict; the same\n"
      "numbers a KvCache of that geometry has. The pool is num_blocks, or as many blocks as fit in\n"
      "budget, or batch sequences of seq_len tokens; `advice` says what to change when it does not fit.");
  m.def(
      "presets",
      [] {
        std::vector<nb::dict> out;
        for (const ModelPreset& p : ModelPresets()) {
          nb::dict d;
          d["name"] = std::string(p.name);
          d["description"] = std::string(p.description);
          d["context_len"] = p.context_len;
          out.push_back(std::move(d));
        }
        return out;
      },
      "The named model geometries plan() and KvCache() take as preset=.");
  BindKvCache(m);
  BindPrefixCache(m);
  BindTiers(m);
  BindEngine(m);
}
