// Text generation with a llama-family model on the paged cache: the library
// behind `pagekv generate`.
//
// Loads a GGUF model (or a llama2.c checkpoint with its tokenizer.bin),
// encodes the prompts, prefills their longest common prefix once and forks
// it to every prompt (the forks share those blocks; the first write to a
// shared, partly filled block copies it), then decodes all sequences step by
// step, sampling each next token, and frees every sequence the moment it is
// done. Reports the text, the ids and what the cache did.
//
// Thread safety: Generate uses the process-wide kernel thread pool; run one
// call at a time per process for meaningful statistics.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "pagekv/dist.h"
#include "pagekv/dtype.h"
#include "pagekv/engine.h"
#include "pagekv/eviction.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/sampling.h"
#include "pagekv/status.h"
#include "pagekv/tiers.h"

namespace pagekv {


struct GenerateOptions {
  std::string model_path;      // .gguf, or a llama2.c .bin (then tokenizer_path is required)
  std::string tokenizer_path;  // llama2.c tokenizer.bin
  // Split over processes (EngineOptions::parallel): every rank calls
  // Generate with the same options and gets the same report.
  ModelParallel parallel;
  std::vector<std::string> prompts;  // generated together as one batch
  // Tokens to generate per prompt; 0 = until a stop token (chat, or
  // stop_at_eos) or the model's context ends.
  int32_t max_new_tokens = 64;
  // End a sequence at the model's end-of-sequence token and the chat
  // template's end-of-turn tokens (which are not part of the output).
  // Without it (and without chat) every prompt gets exactly max_new_tokens.
  bool stop_at_eos = false;
  // Chat: each prompt is one user message (after system_prompt, when set),
  // rendered through the model's chat template (or chat_template: a
  // built-in name, chatml / llama3 / llama2 / mistral / gemma / phi3 /
  // zephyr, or a template file) and encoded with its special tokens. Implies
  // stop_at_eos.
  bool chat = false;
  std::string chat_template;
  std::string system_prompt;
  SamplingOptions sampling;
  int32_t block_len = 16;
  DType kv_dtype = DType::kF32;
  KvGroups kv_groups = KvGroups::kAuto;  // sliding-window models (EngineOptions::kv_groups)
  std::string kv_layer_dtypes;  // per-layer overrides, e.g. "0=f16,-1=f16" (ParseLayerFormats in kv_layout.h)
  bool kv_hadamard = false;     // int8 / fp8 rows stored Hadamard-rotated (RotateQuantizedRows)
  int64_t num_blocks = 0;  // 0 = enough for every prompt plus max_new_tokens
  int32_t top_logits = 0;  // > 0: record the top-k (id, logit) of every step
  int threads = 0;         // 0 = every hardware thread
  std::string device = "cpu";  // EngineOptions::device: "cpu", "cuda" or "cuda:N"
  bool exact_products = false;  // EngineOptions::exact_products
  bool tensor_cores = false;    // EngineOptions::tensor_cores
  bool cuda_graphs = false;     // EngineOptions::cuda_graphs
  // A prompt that does not fit the context with max_new_tokens: an error,
  // or, when set, keep its first token (BOS) and its most recent tokens.
  bool truncate_prompts = false;
  // Share KV through the prefix cache (content-addressed full blocks)
  // instead of forking the prompts' common prefix. Same tokens either way.
  bool prefix_cache = false;
  ExtraKeys extra_keys;  // with prefix_cache: salt, adapter id, model fingerprint
  // Publish the prefix cache's KV events (implies prefix_cache) over ZeroMQ
  // at kv_events.endpoint (e.g. tcp://127.0.0.1:5557), one batch per step.
  KvEventsOptions kv_events;
  // Lower KV tiers under the prefix cache (implies prefix_cache): blocks
  // published here are written through to disk and Redis, and prompts find
  // blocks earlier runs or other processes left there. extra_keys'
  // model_fingerprint defaults to the model file's.
  TierOptions tiers;
  // Token eviction per sequence (pagekv/eviction.h): streaming, h2o or
  // snapkv at a budget. Not with the prefix cache, tiers or KV events
  // (eviction rewrites blocks those would share); prompts are then not forked.
  EvictionOptions eviction;
  // Called with (prompt index, decoded text of the new token) as tokens are made.
  std::function<void(size_t, const std::string&)> on_token;
};

struct GenerateOutput {
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> generated_ids;  // without the stop token that ended them
  std::string text;  // the decoded prompt and generation
  std::string completion;  // the decoded generation alone
  bool stopped = false;    // ended by a stop token (else by length)
  // With top_logits > 0: per step, the top-k ids and logits.
  std::vector<std::vector<std::pair<int32_t, float>>> step_top;
};

struct GenerateStats {
  int64_t blocks_total = 0;
  int64_t peak_blocks_used = 0;
  int64_t bytes_per_block = 0;
  int64_t peak_bytes = 0;                // peak_blocks_used * bytes_per_block
  double peak_utilization = 0;           // peak_blocks_used / blocks_total
  int64_t shared_prefix_tokens = 0;      // prefilled once, shared by every prompt
  int64_t contiguous_bytes = 0;          // what reserving (prompt + max_new_tokens) per prompt costs
  int64_t contiguous_max_len_bytes = 0;  // what reserving the model's whole context per prompt costs
  int64_t kv_bytes_per_token = 0;        // the cache's, every layer
  // A latent (MLA) cache: what per-head K and V for every query head would
  // cost per token (the planner's per_head_bytes_per_token); 0 otherwise.
  int64_t per_head_bytes_per_token = 0;
  int64_t copy_on_write_blocks = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t decode_tokens = 0;
  int64_t truncated_prompts = 0;        // prompts cut to fit (truncate_prompts)
  int64_t prefill_tokens_computed = 0;  // prompt tokens run through the model (shared ones once)
  int64_t prefix_hit_tokens = 0;        // prefix cache: prompt tokens found cached, not computed
  int64_t prefix_hit_blocks = 0;
  int64_t prefix_blocks_published = 0;
  int64_t prefix_blocks_evicted = 0;
  int64_t kv_event_batches = 0;         // published to kv_events_endpoint
  int64_t host_hit_blocks = 0;          // prefix blocks loaded from each lower tier
  int64_t disk_hit_blocks = 0;
  int64_t redis_hit_blocks = 0;
  int64_t tier_errors = 0;              // I/O failures and corrupt payloads (each a miss, recomputed)
  int64_t tokens_evicted = 0;           // eviction: tokens dropped from every sequence
  int64_t final_cached_tokens = 0;      // eviction: tokens the sequences held at their last step
  double prefill_attention_seconds = 0;  // of prefill_seconds, in the attention kernels
  double decode_attention_seconds = 0;   // of decode_seconds, in the attention kernels
  double decode_matmul_seconds = 0;      // of decode_seconds, in weight products
};

struct GenerateReport {
  std::vector<GenerateOutput> outputs;
  GenerateStats stats;
};

// Errors: missing or corrupt model/tokenizer files (named), no prompts, an
// empty prompt list entry is allowed (BOS only), max_new_tokens < 0 (or 0
// without a way to stop), a chat template that is missing or fails, invalid
// sampling values, a prompt longer than the model's context, a KV dtype the
// cache does not store.
Result<GenerateReport> Generate(const GenerateOptions& options);

}  // namespace pagekv
