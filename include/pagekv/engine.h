// The serving engine: continuous batching over the paged cache.
//
// Requests are submitted from any thread; the engine's step loop (Step, or a
// background thread from Start) runs
//
//   schedule -> build batch -> forward -> sample -> postprocess
//
// The scheduler never touches tensors: each step it plans which sequences
// run and with how many tokens, within a per-step token budget. Running
// sequences come first (one decode token, or the next chunk of a prompt);
// then waiting ones are admitted, preempted ones first, while the cache has
// the blocks (it asks before it acts, and keeps a watermark of free
// blocks). Paged admission takes a request only when its whole prompt fits
// beside the blocks running prompts still need, with one more free block
// per running sequence for its next token's block: a request admitted on
// its first chunk alone would soon preempt someone to fit the rest. When a
// running sequence needs a block that does not exist, the
// lowest-priority, most recently admitted running sequence is preempted: its
// blocks are freed, and it is later resumed by recomputing its tokens (its
// published blocks are usually still cached, so that is mostly prefix hits),
// giving the same output it would have produced uninterrupted.
//
// Two allocators run the same engine: paged (blocks taken as tokens arrive,
// prompts shared through the prefix cache) and contiguous (each sequence
// reserves prompt + max_tokens slots at admission and shares nothing: the
// pre-allocation strategy of earlier servers, for comparison).
//
// Thread safety: Submit, Cancel, Wait, TryResult and Metrics may be called
// from any thread; Step from one thread at a time (or let Start run it).
// Callbacks run on the stepping thread and must not call Step.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pagekv/dist.h"
#include "pagekv/dtype.h"
#include "pagekv/eviction.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/sampling.h"
#include "pagekv/status.h"
#include "pagekv/tiers.h"

namespace pagekv {

using RequestId = int64_t;
struct LoadedModel;  // model/model_loader.h

enum class FinishReason : uint8_t { kNone, kLength, kEos, kStop, kCancelled, kError };
const char* FinishReasonName(FinishReason r);  // "length", "stop" (EOS or a stop string), "cancelled", "error"

// One new token of a request (or its end: finish != kNone, token -1 when the
// end carries no token).
// One generated token's log-probability under the model and, with
// top_logits, the top alternatives' (id, log-probability).
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

struct TokenUpdate {
  RequestId id = 0;
  int32_t token = -1;
  // Text completed by this token: whole UTF-8 characters only (a character
  // split over tokens comes with its last one), stop strings cut.
  std::string text;
  FinishReason finish = FinishReason::kNone;
  // With EngineRequest::logprobs: the tokens generated since the previous
  // update (one, or none at an end that carries no token), as
  // RequestResult's token_logprobs / step_top give them.
  std::vector<TokenLogprob> logprobs;
};

struct EngineRequest {
  std::vector<int32_t> prompt;         // token ids; Engine::Encode makes them from text
  int32_t max_tokens = 16;             // >= 1 (0: score the prompt only, with prompt_logits); what the contiguous allocator reserves for
  // Benchmarks: end after this many tokens (a trace's output length) as if
  // the model had stopped; 0 = off. Reservations still see max_tokens.
  int32_t stop_at_tokens = 0;
  SamplingOptions sampling;
  std::vector<std::string> stop;       // stop strings: generation ends before the first one
  bool ignore_eos = false;             // do not end at EOS / end-of-turn tokens (Engine::stop_tokens)
  int32_t priority = 0;                // higher runs first and is preempted last
  ExtraKeys extra;                     // prefix-cache salt etc.
  int32_t top_logits = 0;              // > 0: record the top-k (id, logit) of every sampled step
  // Record every sampled token's log-probability under the model (the
  // log-softmax of the raw logits, before temperature or penalties) and each
  // step's log-sum-exp (a logit minus it is that token's log-probability).
  bool logprobs = false;
  // Scoring a known text: the tokens to emit, in order, instead of sampled
  // ones (teacher forcing; at least max_tokens of them; stop conditions
  // still apply). Empty: sample.
  std::vector<int32_t> forced_tokens;
  bool return_logits = false;          // every sampled step's logits into RequestResult::logits
  // The logits at every prompt position into RequestResult::prompt_logits.
  // The whole prompt is then computed (no prefix-cache hit and no shared
  // group prefix, since cached positions have no logits).
  bool prompt_logits = false;
  std::function<void(const TokenUpdate&)> on_update;  // streaming, optional
};

struct RequestResult {
  RequestId id = 0;
  std::vector<int32_t> tokens;  // generated
  std::string text;             // generated text (up to a stop string)
  FinishReason finish = FinishReason::kNone;
  Status error;                 // with kError
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // found in the prefix cache at first admission
  int64_t preemptions = 0;
  double time_to_first_token = 0;    // seconds from submission
  std::vector<double> inter_token;   // seconds between consecutive tokens
  // Seconds waiting (submission to its first step), in the prompt (first
  // step to first token), generating (first token to last) and in all.
  double queue_time = 0, prefill_time = 0, decode_time = 0, e2e_time = 0;
  // With top_logits > 0: per sampled step, the top-k ids and logits.
  std::vector<std::vector<std::pair<int32_t, float>>> step_top;
  // With logprobs: per sampled step, the token's log-probability and the
  // log-sum-exp of the step's logits.
  std::vector<float> token_logprobs;
  std::vector<float> step_logsumexp;
  // SubmitShared: prompt tokens prefilled once for the whole group and
  // forked to this request (0 when it computed its whole prompt).
  int64_t forked_prompt_tokens = 0;
  // Token eviction: tokens this request's evictor dropped, and the tokens
  // its sequence held at its last step.
  int64_t tokens_evicted = 0;
  int64_t final_kv_tokens = 0;
  // return_logits: [sampled steps][vocab], row i the distribution token i
  // was taken from. prompt_logits: [prompt tokens][vocab], row i after
  // prompt token i (the last row is logits' first).
  std::vector<float> logits;
  std::vector<float> prompt_logits;
};

// A finished request's generated tokens with their log-probabilities
// (with EngineRequest::logprobs; the top ones with top_logits), as its
// updates carried them.
std::vector<TokenLogprob> TokenLogprobs(const RequestResult& r);


enum class Allocator : uint8_t { kPaged, kContiguous };

// Models with sliding-window layers (gemma3): how the cache holds them.
//   kHybrid: cache groups (CacheConfig::layer_windows): one block table per
//     group of layers in the one pool; a sliding group holds only the
//     blocks its window reaches (about W tokens), a full group every token.
//   kUniform: one table for every layer, every layer keeping every token;
//     the kernels apply the windows as a mask (the same results, bit for
//     bit; for comparison).
//   kAuto: hybrid.
// Models without windows always get one uniform table.
enum class KvGroups : uint8_t { kAuto, kHybrid, kUniform };
std::string_view KvGroupsName(KvGroups g);           // "auto", "hybrid", "uniform"
Result<KvGroups> ParseKvGroups(std::string_view s);  // the names above

struct EngineOptions {
  std::string model_path;      // GGUF, or llama2.c .bin with tokenizer_path
  std::string tokenizer_path;
  // Split over processes (pagekv/dist.h, docs/SHARDING.md): this process
  // is one rank, holding its share of the heads (tensor parallel) or of the
  // layers (pipeline parallel) and their KV; every rank runs an engine with
  // the same options and the same requests in the same order, and they step
  // together. Empty: the whole model here. Not yet with KV tiers, KV events
  // or token eviction.
  ModelParallel parallel;
  // Serving split over ranks: rank 0's engine takes the requests (Submit,
  // Cancel, ResetPrefixCache, from any thread, as usual) and sends each
  // step's new inputs to the other ranks, whose engines run Follow() and
  // take them as if submitted there (the same ids, seeds and order). The
  // leader's Stop() (or destruction) ends its followers' Follow(). Without
  // it, every rank must be given the same requests itself (Generate).
  bool parallel_leader = false;
  int32_t block_len = 16;
  DType kv_dtype = DType::kF32;
  KvGroups kv_groups = KvGroups::kAuto;  // sliding-window models: hybrid or uniform cache
  std::string kv_layer_dtypes;  // per-layer overrides, e.g. "0=f16,-1=f16" (ParseLayerFormats)
  bool kv_hadamard = false;     // int8 / fp8 rows stored Hadamard-rotated (RotateQuantizedRows)
  int64_t num_blocks = 0;        // the pool; or
  int64_t kv_budget_bytes = 0;   // a byte budget (at most one of the two; neither: one full context)
  int64_t max_step_tokens = 256; // tokens per step over all sequences (chunked prefill)
  int32_t max_running = 256;     // sequences per step
  int64_t watermark_blocks = -1; // free blocks kept at admission; -1 = 1% of the pool
  int64_t max_queue = 1 << 20;   // waiting requests beyond which Submit refuses
  Allocator allocator = Allocator::kPaged;
  bool prefix_cache = true;      // paged only
  // Token eviction per request (pagekv/eviction.h): each running sequence
  // keeps its budget of tokens. Needs the paged allocator without the prefix
  // cache and tiers (eviction rewrites blocks they would share). A preempted
  // request is recomputed from all its tokens as one prompt, so its kept set
  // (and later tokens) may differ from an uninterrupted run.
  EvictionOptions eviction;
  int threads = 0;
  // Where the KV pool lives and the model runs: "cpu", or "cuda" / "cuda:N"
  // (an NVIDIA GPU through the CUDA backend: the llama / qwen2 and gemma3 runners, f32,
  // f16, bf16, int8 and fp8 KV; not with --tp / --pp / --cp, token eviction,
  // int4 KIVI or Hadamard-rotated rows; a build made where the CUDA toolkit
  // was found). Errors name what is missing and the fix.
  std::string device = "cpu";
  // Weight products in f32 throughout (the exact path: kernels/matmul.h
  // Activations::kF32) instead of the fast one (int16 activations for a few
  // tokens on the CPU, AMX tiles for many; f16 on a GPU). Slower; what the
  // device-against-CPU and reference comparisons run.
  bool exact_products = false;
  // On a CUDA device: attention of f16 / bf16 caches (head_dim a multiple of
  // 16 up to 128) on the tensor cores, prompt chunks and decode steps
  // (cuda/paged_attention.h TensorCorePrefillShape, TensorCoreDecodeShape),
  // with the same f32 accuracy. Off until those kernels have been run on a
  // GPU (scripts/cuda-device-check.sh); an error with --device cpu.
  bool tensor_cores = false;
  // On a CUDA device: decode steps recorded and launched as CUDA graphs (one
  // launch per step instead of one per kernel; cuda/step_graphs.h), a graph
  // kept from an earlier step replayed while the launches repeat. Off until
  // run on a GPU (scripts/cuda-device-check.sh); an error with --device cpu.
  bool cuda_graphs = false;
  // Multi-head latent attention models (deepseek2) over a prompt chunk: the
  // absorbed form (latent rows read by every head), the unabsorbed one
  // (per-head keys and values materialised from the latent rows once, then
  // read by the chunk's queries), or kAuto: per chunk, the one with fewer
  // multiply-adds (unabsorbed for long chunks). Decode is always absorbed.
  enum class MlaPrefill : uint8_t { kAuto, kAbsorbed, kUnabsorbed };
  MlaPrefill mla_prefill = MlaPrefill::kAuto;
  // Tensor parallel: each sum over the ranks (after the attention output and
  // feed-forward down projections) runs while the other half of that
  // projection is multiplied (ForwardOptions::overlap_communication).
  // false: the same arithmetic, each sum waited for at once.
  bool overlap_communication = true;
  // The chat template: empty = the model's (tokenizer.chat_template; ChatML
  // when the model has none), else a built-in name (chatml, llama3, llama2,
  // mistral, gemma, phi3, zephyr) or a Jinja file.
  std::string chat_template;
  // Lower KV tiers under the prefix cache (paged with prefix_cache only):
  // blocks evicted from the pool move to RAM / disk / Redis, and admission
  // loads a prefix that continues there instead of recomputing it. A
  // preempted sequence's published blocks take the same way (preemption by
  // swap: they come back from RAM on resume; only its last, partly filled
  // block is recomputed). None configured by default. With any tier, every
  // request's model_fingerprint defaults to the model file's, and Redis
  // keys are namespaced by it.
  TierOptions tiers;
  // Tier moves off the stepping thread: a prefix found in a lower tier is
  // loaded by the tiers' threads while other requests' steps run (the
  // request starts the step after its loads finish), and the cached blocks
  // the next step would evict are copied down during the current one.
  // false: loaded at admission and copied at eviction, on the stepping
  // thread (the same tokens, measured by the tier tests).
  bool background_tier_moves = true;
  // Publish the prefix cache's KV events (vLLM's msgpack format over
  // ZeroMQ, docs/KV_EVENTS.md) at kv_events.endpoint, one batch per step.
  // Needs the prefix cache.
  KvEventsOptions kv_events;
};

// A running request's state (llama-server's /slots): its cache holds
// kv_tokens in kv_blocks blocks (a block shared with another sequence
// counts for each).
struct SequenceInfo {
  RequestId id = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int64_t kv_tokens = 0, kv_blocks = 0;
  bool prefilling = false;  // its prompt is not all computed yet
  int32_t priority = 0;
};

struct EngineMetrics {
  int64_t blocks_total = 0, blocks_used = 0, blocks_free = 0, blocks_cached = 0;
  int64_t waiting = 0, running = 0, preemptions = 0;
  int64_t loading = 0;  // admitted, their prefix loading from a lower tier
  int64_t finished = 0, prompt_tokens = 0, generated_tokens = 0;
  int64_t steps = 0;
  int64_t slots_reserved = 0;  // contiguous: reserved slots of running sequences; paged: allocated slots
  int64_t tokens_stored = 0;   // KV slots holding tokens of running sequences
  int64_t tokens_evicted = 0;  // token eviction: tokens dropped so far
  int64_t peak_blocks_used = 0;     // the most blocks in use right after a step's forward pass
  int64_t copy_on_write_blocks = 0; // shared partly filled blocks copied before a write
  int64_t bytes_per_block = 0, bytes_per_token = 0;  // the pool's geometry
  int32_t kv_groups = 1;            // cache groups (a hybrid cache of a sliding-window model: more than 1)
  int64_t kv_event_batches = 0;     // published to kv_events_endpoint
  // Of the running sequences' block tables: entries whose block is the one
  // right after the previous entry's in memory (id + 1), over all entries
  // that have a previous one; 1 when there are none. What the attention
  // kernels read as one run (docs/PERFORMANCE.md, "Consecutive blocks").
  double table_contiguity = 1;
  // Time in the model's forward pass (seconds, accumulated), and of it in
  // the attention kernels and in the weight products.
  double forward_seconds = 0, attention_seconds = 0, matmul_seconds = 0;
  double communication_seconds = 0;  // tensor parallel: in the collectives between the ranks
  PrefixCacheStats prefix;
  std::vector<SequenceInfo> sequences;  // the running batch at the last step
  std::optional<TiersStats> tiers;  // when tiers are configured
  std::string model_fingerprint;    // of the model file, with tiers
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();  // stops the loop; unfinished requests end as cancelled
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Text to prompt ids (with the model's own BOS convention, special tokens
  // written in the text parsed), and generated ids to text.
  std::vector<int32_t> Encode(const std::string& text) const;
  // llama-server's /tokenize: with add_special the model's BOS / EOS
  // convention, without it none; parse_special: special tokens written in
  // the text become their ids.
  std::vector<int32_t> Encode(const std::string& text, bool add_special, bool parse_special) const;
  // One token's bytes on its own (a byte-level piece may be part of a UTF-8
  // character; a control token is its text, e.g. "<|im_end|>").
  std::string TokenPiece(int32_t token) const;
  std::string Decode(const std::vector<int32_t>& tokens, int32_t prev) const;
  // Ids to text from the start of a sequence (the tokenizer's own rule for
  // the first token).
  std::string Detokenize(const std::vector<int32_t>& tokens) const;
  // A conversation (a JSON array of OpenAI-style messages; `tools_json`: an
  // array of tool definitions, or empty) rendered through the chat template
  // (the model's, or EngineOptions::chat_template) and encoded. Errors
  // (kInvalidArgument): malformed JSON, no template, a template that fails
  // or raises (its message).
  Result<std::vector<int32_t>> EncodeChat(const std::string& messages_json, bool add_generation_prompt = true,
                                          const std::string& tools_json = {}) const;
  // The conversation rendered through the chat template, as text (what
  // EncodeChat encodes with special tokens parsed and no BOS of its own).
  Result<std::string> RenderChat(const std::string& messages_json, bool add_generation_prompt = true) const;
  int32_t context_len() const;
  int32_t vocab_size() const;  // token ids are in [0, vocab_size)
  // The most bytes of text one token stands for: a text of n bytes is at
  // least n / max_token_bytes() tokens (a bound checked before encoding).
  int32_t max_token_bytes() const;
  int32_t eos_id() const;
  // Tokens that end a request (EOS and the template's end-of-turn tokens).
  const std::vector<int32_t>& stop_tokens() const;
  // Which chat template EncodeChat renders (for logs): the model's, a
  // built-in's name or a file's, or ChatML for a model that has none.
  std::string chat_template_name() const;

  // Queues a request. Errors (nothing queued): empty prompt, a prompt plus
  // max_tokens past the context (the limit stated), token ids outside the
  // vocabulary, invalid sampling or extra keys, a full queue (kUnavailable),
  // a request that could never fit the pool.
  Result<RequestId> Submit(EngineRequest request);
  // Queues requests whose prompts begin alike: their longest common prefix
  // (each keeps at least its last prompt token to compute) is prefilled
  // once, then forked to every request, which shares those blocks (the
  // first write to a shared, partly filled block copies it). Paged allocator
  // without the prefix cache or token eviction (with the prefix cache,
  // Submit shares full blocks anyway); otherwise, or when the prompts share
  // nothing, the same as Submit of each. All or nothing: an error queues
  // none (the same errors as Submit).
  Result<std::vector<RequestId>> SubmitShared(std::vector<EngineRequest> requests);
  // Ends a request (waiting or running) as cancelled; its blocks are freed at
  // the next step boundary. False when it is unknown or already finished.
  bool Cancel(RequestId id);
  // Drops every prefix-cache key of the pool between two steps (an
  // AllBlocksCleared KV event, published at once); running requests keep
  // their blocks, lower tiers keep theirs. With the loop started, it is
  // done by the loop before its next step (this call waits for it).
  // Errors: no prefix cache.
  Status ResetPrefixCache();

  // One iteration; false when there was nothing to do.
  Result<bool> Step();
  // Steps until every submitted request has finished.
  // A follower of a parallel_leader engine (rank > 0): steps with the
  // leader, on the inputs it sends, until the leader stops. Errors: not a
  // follower, a collective that failed.
  Status Follow();
  Status RunUntilIdle();
  // A background thread that steps whenever there is work.
  void Start();
  void Stop();

  // Blocks until the request finishes (and forgets it).
  RequestResult Wait(RequestId id);
  std::optional<RequestResult> TryResult(RequestId id);
  // Wait with a deadline: the result (then forgotten), the error result Wait
  // gives for an unknown id, or nullopt when the request has not finished
  // within `timeout` (zero: look only). For callers that must wake now and
  // then (a Python caller checking for Ctrl-C).
  std::optional<RequestResult> WaitFor(RequestId id, std::chrono::milliseconds timeout);

  EngineMetrics Metrics() const;
  // Waits until the KV tiers have written every block queued for them.
  void DrainTiers();
  // Aborts with a message when the cache, the prefix cache or the
  // scheduler's bookkeeping disagree. Call between steps.
  void CheckInvariants() const;

 private:
  struct State;
  explicit Engine(std::unique_ptr<State> state);
  // Generate (engine/generate.cc) builds an engine around a model it has
  // already loaded to size the pool (engine/engine_internal.h).
  friend Result<std::unique_ptr<Engine>> CreateEngineWithModel(const EngineOptions& options, LoadedModel model);
  std::unique_ptr<State> state_;
};

}  // namespace pagekv
