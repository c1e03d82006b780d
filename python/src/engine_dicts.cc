// engine_dicts.h: the engine's results as Python dicts.
#include "engine_dicts.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace pagekv::python {
namespace {

nb::object FinishName(FinishReason r) {
  if (r == FinishReason::kNone) return nb::none();
  return nb::str(FinishReasonName(r));
}

nb::list LogprobList(const std::vector<TokenLogprob>& lps) {
  nb::list out;
  for (const TokenLogprob& t : lps) {
    nb::dict d;
    d["token"] = t.token;
    d["logprob"] = t.logprob;
    nb::list top;
    for (const auto& [id, lp] : t.top) top.append(nb::make_tuple(id, lp));
    d["top"] = top;
    out.append(d);
  }
  return out;
}

nb::object FloatArray(std::vector<float> v, size_t rows) {
  if (v.empty()) return nb::none();
  auto* owned = new std::vector<float>(std::move(v));
  nb::capsule free(owned, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  const size_t cols = rows == 0 ? owned->size() : owned->size() / rows;
  return nb::cast(nb::ndarray<nb::numpy, float, nb::ndim<2>>(owned->data(), {rows, cols}, free));
}

}  // namespace

nb::dict UpdateDict(const TokenUpdate& u) {
  nb::dict d;
  d["id"] = u.id;
  d["token"] = u.token >= 0 ? nb::cast(u.token) : nb::none();
  d["text"] = u.text;
  d["finish"] = FinishName(u.finish);
  if (!u.logprobs.empty()) d["logprobs"] = LogprobList(u.logprobs);
  return d;
}

nb::dict ResultDict(RequestResult r) {
  nb::dict d;
  d["id"] = r.id;
  d["tokens"] = r.tokens;
  d["text"] = r.text;
  d["finish"] = FinishName(r.finish);
  d["error"] = r.finish == FinishReason::kError ? nb::cast(r.error.ToString()) : nb::none();
  d["prompt_tokens"] = r.prompt_tokens;
  d["cached_prompt_tokens"] = r.cached_prompt_tokens;
  d["preemptions"] = r.preemptions;
  d["time_to_first_token"] = r.time_to_first_token;
  d["queue_time"] = r.queue_time;
  d["prefill_time"] = r.prefill_time;
  d["decode_time"] = r.decode_time;
  d["e2e_time"] = r.e2e_time;
  d["inter_token"] = r.inter_token;
  if (!r.token_logprobs.empty()) {
    d["logprobs"] = LogprobList(TokenLogprobs(r));
  }
  if (!r.step_top.empty()) {
    nb::list steps;
    for (const auto& step : r.step_top) {
      nb::list top;
      for (const auto& [id, logit] : step) top.append(nb::make_tuple(id, logit));
      steps.append(top);
    }
    d["top_logits"] = steps;
  }
  const size_t steps = r.tokens.size() + (r.finish == FinishReason::kEos || r.finish == FinishReason::kStop ? 1 : 0);
  if (!r.logits.empty()) d["logits"] = FloatArray(std::move(r.logits), std::max<size_t>(1, std::min(steps, r.logits.size())));
  if (!r.prompt_logits.empty()) d["prompt_logits"] = FloatArray(std::move(r.prompt_logits), static_cast<size_t>(r.prompt_tokens));
  return d;
}

nb::dict MetricsDict(const EngineMetrics& m) {
  nb::dict d;
  d["blocks_total"] = m.blocks_total;
  d["blocks_used"] = m.blocks_used;
  d["blocks_free"] = m.blocks_free;
  d["blocks_cached"] = m.blocks_cached;
  d["waiting"] = m.waiting;
  d["running"] = m.running;
  d["loading"] = m.loading;
  d["preemptions"] = m.preemptions;
  d["finished"] = m.finished;
  d["prompt_tokens"] = m.prompt_tokens;
  d["generated_tokens"] = m.generated_tokens;
  d["steps"] = m.steps;
  d["slots_reserved"] = m.slots_reserved;
  d["tokens_stored"] = m.tokens_stored;
  d["peak_blocks_used"] = m.peak_blocks_used;
  d["copy_on_write_blocks"] = m.copy_on_write_blocks;
  d["bytes_per_block"] = m.bytes_per_block;
  d["bytes_per_token"] = m.bytes_per_token;
  d["table_contiguity"] = m.table_contiguity;
  d["forward_seconds"] = m.forward_seconds;
  d["attention_seconds"] = m.attention_seconds;
  d["matmul_seconds"] = m.matmul_seconds;
  nb::dict p;
  p["lookups"] = m.prefix.lookups;
  p["requested_tokens"] = m.prefix.requested_tokens;
  p["hit_tokens"] = m.prefix.hit_tokens;
  p["hit_blocks"] = m.prefix.hit_blocks;
  p["inserted"] = m.prefix.inserted;
  p["evicted"] = m.prefix.evicted;
  p["cached_blocks"] = m.prefix.cached_blocks;
  p["token_hit_rate"] = m.prefix.token_hit_rate;
  d["prefix"] = p;
  nb::list seqs;
  for (const SequenceInfo& s : m.sequences) {
    nb::dict q;
    q["id"] = s.id;
    q["prompt_tokens"] = s.prompt_tokens;
    q["generated_tokens"] = s.generated_tokens;
    q["kv_tokens"] = s.kv_tokens;
    q["kv_blocks"] = s.kv_blocks;
    q["prefilling"] = s.prefilling;
    q["priority"] = s.priority;
    seqs.append(q);
  }
  d["sequences"] = seqs;
  return d;
}

nb::dict GenerateStatsDict(const GenerateStats& s) {
  nb::dict d;
  d["blocks_total"] = s.blocks_total;
  d["peak_blocks_used"] = s.peak_blocks_used;
  d["bytes_per_block"] = s.bytes_per_block;
  d["peak_bytes"] = s.peak_bytes;
  d["peak_utilization"] = s.peak_utilization;
  d["shared_prefix_tokens"] = s.shared_prefix_tokens;
  d["contiguous_bytes"] = s.contiguous_bytes;
  d["copy_on_write_blocks"] = s.copy_on_write_blocks;
  d["prefill_seconds"] = s.prefill_seconds;
  d["decode_seconds"] = s.decode_seconds;
  d["decode_tokens"] = s.decode_tokens;
  d["prefill_tokens_computed"] = s.prefill_tokens_computed;
  d["prefix_hit_tokens"] = s.prefix_hit_tokens;
  d["truncated_prompts"] = s.truncated_prompts;
  return d;
}

}  // namespace pagekv::python
