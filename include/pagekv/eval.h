// KV-compression fidelity: what storing KV in a smaller format costs on a
// real model, measured against the uncompressed f32 cache (`pagekv eval kv`).
//
// On a llama model (stories260K and SmolLM2 in docs/PERFORMANCE.md), seeded sampled
// continuations of the goldens' prompts up to the model's full context are
// run the way a server meets them: the first half (prompt_fraction) as one
// prompt step, the rest one decode step per token through a cache of the
// format under test with the eviction policy applied; the reference is the
// f32 cache keeping every token. At every decoded position the two
// next-token distributions are compared (KL divergence, top-1 agreement).
// The golden NLL text is split and scored the same way (relative change of
// the mean NLL of its decoded part). Bytes per token come from the layout,
// the kept fraction from the policy; the decode speed-up from the paged
// decode kernel on the attention benchmark's memory-bound MHA shape, f16 at
// context 4096 against the format at the budget's kept tokens, in the same
// run.
//
// Thread safety: uses the process-wide kernel thread pool; one at a time.
#pragma once

#include <cstdint>
#include <string>

#include "pagekv/dtype.h"
#include "pagekv/status.h"

namespace pagekv {

struct KvEvalOptions {
  std::string model_path;       // GGUF, or llama2.c .bin with tokenizer_path
  std::string tokenizer_path;
  std::string goldens_path;     // e.g. ../shared/goldens/stories260K.json (prompts and the NLL text)
  DType kv_dtype = DType::kInt8;
  std::string layer_dtypes;     // per-layer overrides of kv_dtype, e.g. "0=f16,-1=f16" (ParseLayerFormats)
  bool hadamard = false;        // int8 / fp8 rows stored Hadamard-rotated (RotateQuantizedRows)
  std::string policy = "none";  // token eviction: none, streaming, h2o, snapkv (pagekv/eviction.h)
  double budget = 1.0;          // fraction of tokens kept, (0, 1]; 1 with policy none
  double prompt_fraction = 0.5; // each sequence's first part, prefilled as the prompt; the rest is decoded
  int32_t continuations = 4;    // sampled sequences (seeds 1..n), each to the full context
  int64_t max_len = 0;          // > 0: sequences and the NLL text end at this many tokens (a long context's cost)
  float temperature = 1.0f;
  int32_t block_len = 32;         // a multiple of int4 KIVI's 32-token groups
  bool measure_speed = true;    // the decode kernel comparison (a few seconds)
  int threads = 0;
};

struct KvEvalReport {
  std::string kv_dtype, policy;  // kv_dtype: the dtype, then any layer overrides ("int8,0=f16,-1=f16")
  double budget = 1;
  int64_t positions = 0;         // next-token distributions compared (the decoded parts)
  double kl_mean = 0;            // mean KL(P_f32 || P_format), nats
  double kl_max = 0;
  double top1_agreement = 0;     // 0..1
  double nll_ref = 0, nll = 0;   // mean NLL of the golden text, f32 cache and format
  double nll_change_rel = 0;     // (nll - nll_ref) / nll_ref
  int64_t bytes_per_token = 0;   // this model, all layers, K and V, scales included
  int64_t bytes_per_token_f16 = 0;
  double bytes_ratio_vs_f16 = 0;
  double kept_fraction = 1;      // mean over decode steps of cached / seen tokens
  double effective_bytes_ratio_vs_f16 = 0;  // bytes_ratio_vs_f16 * kept_fraction
  double decode_speedup_vs_f16 = 0;  // 0 when not measured
  std::string speed_shape;           // the kernel shape it was measured on
};

// Errors (before any work): unreadable model or goldens (named), a format
// the cache does not store, an unknown policy, a budget outside (0, 1] (or
// other than 1 with policy none), a prompt_fraction outside (0, 1).
Result<KvEvalReport> EvalKv(const KvEvalOptions& options);

}  // namespace pagekv
