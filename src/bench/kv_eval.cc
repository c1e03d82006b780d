// EvalKv (include/pagekv/eval.h).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/engine_internal.h"
#include "model/model.h"
#include "model/model_loader.h"
#include "pagekv/bench.h"
#include "pagekv/engine.h"
#include "pagekv/eval.h"
#include "pagekv/eviction.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

// An engine over the loaded model for one cache configuration: paged, no
// prefix cache, a pool for `tokens` tokens, each prompt in one step.
Result<std::unique_ptr<Engine>> EvalEngine(const KvEvalOptions& o, const LoadedModel& m, DType dtype,
                                           const std::string& layer_dtypes, bool hadamard,
                                           const EvictionOptions& policy, int64_t tokens) {
  EngineOptions eo;
  eo.model_path = o.model_path;
  eo.block_len = o.block_len;
  eo.kv_dtype = dtype;
  eo.kv_layer_dtypes = layer_dtypes;
  eo.kv_hadamard = hadamard;
  eo.eviction = policy;
  eo.prefix_cache = false;
  // Every cache group's blocks (a sliding-window model's hybrid cache).
  PAGEKV_ASSIGN_OR_RETURN(const CacheConfig geometry, EngineCacheGeometry(eo, *m.model));
  PAGEKV_ASSIGN_OR_RETURN(const KvLayout layout, KvLayout::Create(geometry));
  eo.num_blocks = layout.BlocksHeld(tokens, std::max<int64_t>(tokens, 1)) + layout.num_groups();
  eo.watermark_blocks = 0;
  eo.max_step_tokens = std::max<int64_t>(tokens, 1);
  eo.max_running = 1;
  eo.threads = o.threads;
  return CreateEngineWithModel(eo, m);
}

// Runs one request to its end on `e`, stepping it here; after each decode
// step (each step after the first), `after_decode(fed tokens, KV tokens
// held)` hears what the sequence holds.
Result<RequestResult> RunOne(Engine& e, EngineRequest r,
                             const std::function<void(int64_t, int64_t)>& after_decode = nullptr) {
  const auto prompt = static_cast<int64_t>(r.prompt.size());
  PAGEKV_ASSIGN_OR_RETURN(RequestId id, e.Submit(std::move(r)));
  std::optional<RequestResult> done;
  for (int64_t step = 0; !done; ++step) {
    PAGEKV_ASSIGN_OR_RETURN(bool worked, e.Step());
    done = e.TryResult(id);
    if (step > 0 && after_decode) {
      after_decode(prompt + step, done ? done->final_kv_tokens : e.Metrics().tokens_stored);
    }
    if (!worked && !done) return InternalError("eval: the engine stopped before the request finished");
  }
  if (done->finish == FinishReason::kError) return done->error;
  return std::move(*done);
}

// Logits at every position of `tokens`, teacher-forced through an f32
// cache: [tokens.size()][vocab].
Result<std::vector<float>> AllLogits(const KvEvalOptions& o, const LoadedModel& m, std::span<const int32_t> tokens) {
  const auto n = static_cast<int64_t>(tokens.size());
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, EvalEngine(o, m, DType::kF32, "", false, {}, n));
  EngineRequest r;
  r.prompt.assign(tokens.begin(), tokens.end());
  r.max_tokens = 0;  // score only
  r.prompt_logits = true;
  PAGEKV_ASSIGN_OR_RETURN(RequestResult res, RunOne(*e, std::move(r)));
  return std::move(res.prompt_logits);
}

void LogSoftmax(const float* x, int32_t n, std::vector<double>& out) {
  out.resize(static_cast<size_t>(n));
  double m = -std::numeric_limits<double>::infinity();
  for (int32_t i = 0; i < n; ++i) m = std::max(m, static_cast<double>(x[i]));
  double sum = 0;
  for (int32_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - m);
  const double lse = m + std::log(sum);
  for (int32_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<double>(x[i]) - lse;
}

int32_t ArgMax(const float* x, int32_t n) { return static_cast<int32_t>(std::max_element(x, x + n) - x); }

// Logits through a cache of the evaluated format under an eviction policy,
// the way a server meets them: tokens [0, split) as one prompt step (the
// policy sees the prompt end there), then one decode step per token, the
// text's own tokens fed back (teacher forcing). Returns the logits
// predicting tokens split .. n-1: [n - split][vocab]. kept_sum gains the
// kept fraction (held / fed) after every decode step.
Result<std::vector<float>> DecodedLogits(const KvEvalOptions& o, const LoadedModel& m, const EvictionOptions& policy,
                                         std::span<const int32_t> tokens, int64_t split, double& kept_sum,
                                         int64_t& kept_steps) {
  const auto n = static_cast<int64_t>(tokens.size());
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                          EvalEngine(o, m, o.kv_dtype, o.layer_dtypes, o.hadamard, policy, n));
  EngineRequest r;
  r.prompt.assign(tokens.begin(), tokens.begin() + split);
  r.forced_tokens.assign(tokens.begin() + split, tokens.end());
  r.max_tokens = static_cast<int32_t>(n - split);
  r.ignore_eos = true;
  r.return_logits = true;
  PAGEKV_ASSIGN_OR_RETURN(RequestResult res, RunOne(*e, std::move(r), [&](int64_t fed, int64_t held) {
                            kept_sum += static_cast<double>(held) / static_cast<double>(fed);
                            ++kept_steps;
                          }));
  return std::move(res.logits);
}

// A sampled continuation of `prompt` to `length` tokens with an f32 cache.
Result<std::vector<int32_t>> Continue(const KvEvalOptions& o, const LoadedModel& m, std::vector<int32_t> tokens,
                                      int64_t length, uint64_t seed) {
  if (static_cast<int64_t>(tokens.size()) >= length) return tokens;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, EvalEngine(o, m, DType::kF32, "", false, {}, length));
  EngineRequest r;
  r.prompt = tokens;
  r.max_tokens = static_cast<int32_t>(length - static_cast<int64_t>(tokens.size()));
  r.ignore_eos = true;
  r.sampling.temperature = o.temperature;
  r.sampling.seed = seed;
  PAGEKV_ASSIGN_OR_RETURN(RequestResult res, RunOne(*e, std::move(r)));
  tokens.insert(tokens.end(), res.tokens.begin(), res.tokens.end());
  return tokens;
}

}  // namespace

Result<KvEvalReport> EvalKv(const KvEvalOptions& o) {
  PAGEKV_ASSIGN_OR_RETURN(EvictionOptions policy, ParseEvictionPolicy(o.policy, o.budget));
  if (policy.policy == EvictionPolicy::kNone && o.budget != 1) {
    return InvalidArgumentError("eval kv: policy none keeps every token; its budget must be 1 (got " +
                                std::to_string(o.budget) + ")");
  }
  if (o.continuations < 0 || o.continuations > 64) return InvalidArgumentError("eval kv: continuations must be in 0..64");
  if (!(o.prompt_fraction > 0 && o.prompt_fraction < 1)) {
    return InvalidArgumentError("eval kv: prompt_fraction " + std::to_string(o.prompt_fraction) + " outside (0, 1)");
  }
  std::ifstream in(o.goldens_path);
  if (!in) return NotFoundError("eval kv: cannot read the goldens file '" + o.goldens_path + "'");
  nlohmann::json goldens;
  try {
    in >> goldens;
  } catch (const std::exception& e) {
    return InvalidArgumentError("eval kv: goldens '" + o.goldens_path + "' is not JSON: " + e.what());
  }
  // Two layouts: ../shared's (prompts[].prompt_ids, nll.token_ids) and
  // tools/reference.py's (prompts[].ids, nll.ids).
  const char* text_key = goldens.contains("nll") && goldens["nll"].contains("token_ids") ? "token_ids" : "ids";
  if (!goldens.contains("nll") || !goldens["nll"].contains(text_key) || !goldens.contains("prompts") ||
      !goldens["prompts"].is_array() || goldens["prompts"].empty()) {
    return InvalidArgumentError("eval kv: goldens '" + o.goldens_path + "' lacks prompts or nll.token_ids (or nll.ids)");
  }
  for (const auto& p : goldens["prompts"]) {
    if (!p.contains("prompt_ids") && !p.contains("ids")) {
      return InvalidArgumentError("eval kv: a prompt of goldens '" + o.goldens_path + "' has no prompt_ids (or ids)");
    }
  }
  if (o.max_len < 0 || o.max_len == 1) return InvalidArgumentError("eval kv: max_len must be 0 (the context) or at least 2");
  PAGEKV_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(o.model_path, o.tokenizer_path));
  const Model& model = *m.model;
  const int32_t vocab = model.config().vocab_size;
  // The trained context: the goldens' seq_len when they give one (a GGUF may
  // state a longer context than the model was trained for).
  int64_t context = model.config().context_len;
  if (goldens.contains("config") && goldens["config"].contains("seq_len")) {
    context = std::min<int64_t>(context, goldens["config"]["seq_len"].get<int64_t>());
  }
  if (o.max_len > 0) context = std::min<int64_t>(context, o.max_len);
  // The format must be one the cache stores: check before any work.
  PAGEKV_ASSIGN_OR_RETURN(
      std::vector<KvFormat> layers,
      ParseLayerFormats(o.layer_dtypes, model.config().num_layers, model.config().kv_row_elems(),
                        KvFormat::ForDType(o.kv_dtype, model.config().kv_row_elems())));
  {
    KvCacheOptions co;
    co.config = model.CacheGeometry(o.block_len, o.kv_dtype, 1);
    co.config.layer_formats = layers;
    if (o.hadamard) PAGEKV_RETURN_IF_ERROR(RotateQuantizedRows(co.config));
    co.prefault = false;
    PAGEKV_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::Create(co.config));
    PAGEKV_RETURN_IF_ERROR(KvCache::Create(co).status());
    PAGEKV_RETURN_IF_ERROR(TokenEvictor::Create(policy, layout).status());  // e.g. eviction of int4 KIVI rows
  }

  KvEvalReport r;
  r.kv_dtype = std::string(DTypeName(o.kv_dtype)) + (o.hadamard ? "+hadamard" : "") +
               (o.layer_dtypes.empty() ? "" : "," + o.layer_dtypes);
  r.policy = o.policy;
  r.budget = o.budget;
  {
    CacheConfig cf = model.CacheGeometry(o.block_len, o.kv_dtype, 1);
    cf.layer_formats = layers;
    PAGEKV_ASSIGN_OR_RETURN(KvLayout lf, KvLayout::Create(cf));
    PAGEKV_ASSIGN_OR_RETURN(KvLayout lh, KvLayout::Create(model.CacheGeometry(o.block_len, DType::kF16, 1)));
    r.bytes_per_token = lf.bytes_per_token();
    r.bytes_per_token_f16 = lh.bytes_per_token();
    r.bytes_ratio_vs_f16 = static_cast<double>(r.bytes_per_token) / static_cast<double>(r.bytes_per_token_f16);
  }

  // 1. Sampled continuations to the full context: the first prompt_fraction
  // as the prompt, the rest decoded under the format and policy, compared
  // with the f32 cache's next-token distributions.
  const auto& prompts = goldens["prompts"];
  std::vector<double> lp_ref, lp;
  double kl_sum = 0, kept_sum = 0;
  int64_t agree = 0, kept_steps = 0;
  auto split_of = [&](size_t n) {
    return std::clamp<int64_t>(static_cast<int64_t>(o.prompt_fraction * static_cast<double>(n)), 1,
                               static_cast<int64_t>(n) - 1);
  };
  for (int32_t c = 0; c < o.continuations; ++c) {
    const auto& p = prompts[static_cast<size_t>(c) % prompts.size()];
    PAGEKV_ASSIGN_OR_RETURN(std::vector<int32_t> seq,
                            Continue(o, m, p[p.contains("prompt_ids") ? "prompt_ids" : "ids"].get<std::vector<int32_t>>(),
                                     context, static_cast<uint64_t>(c + 1)));
    const int64_t split = split_of(seq.size());
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> ref, AllLogits(o, m, seq));
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> got, DecodedLogits(o, m, policy, seq, split, kept_sum, kept_steps));
    for (size_t t = static_cast<size_t>(split) - 1; t + 1 < seq.size(); ++t) {
      const float* a = ref.data() + t * static_cast<size_t>(vocab);
      const float* b = got.data() + (t + 1 - static_cast<size_t>(split)) * static_cast<size_t>(vocab);
      LogSoftmax(a, vocab, lp_ref);
      LogSoftmax(b, vocab, lp);
      double kl = 0;
      for (int32_t i = 0; i < vocab; ++i) kl += std::exp(lp_ref[static_cast<size_t>(i)]) * (lp_ref[static_cast<size_t>(i)] - lp[static_cast<size_t>(i)]);
      kl = std::max(kl, 0.0);
      kl_sum += kl;
      r.kl_max = std::max(r.kl_max, kl);
      agree += ArgMax(a, vocab) == ArgMax(b, vocab) ? 1 : 0;
      ++r.positions;
    }
  }
  if (r.positions > 0) {
    r.kl_mean = kl_sum / static_cast<double>(r.positions);
    r.top1_agreement = static_cast<double>(agree) / static_cast<double>(r.positions);
  }

  // 2. The golden text's mean NLL over its decoded part, both caches.
  std::vector<int32_t> text = goldens["nll"][text_key].get<std::vector<int32_t>>();
  if (static_cast<int64_t>(text.size()) > context) text.resize(static_cast<size_t>(context));
  if (text.size() < 3) return InvalidArgumentError("eval kv: the goldens' NLL text has fewer than 3 tokens");
  const int64_t text_split = split_of(text.size());
  {
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> ref, AllLogits(o, m, text));
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> got, DecodedLogits(o, m, policy, text, text_split, kept_sum, kept_steps));
    double nll_ref = 0, nll = 0;
    for (size_t t = static_cast<size_t>(text_split) - 1; t + 1 < text.size(); ++t) {
      LogSoftmax(ref.data() + t * static_cast<size_t>(vocab), vocab, lp);
      nll_ref -= lp[static_cast<size_t>(text[t + 1])];
      LogSoftmax(got.data() + (t + 1 - static_cast<size_t>(text_split)) * static_cast<size_t>(vocab), vocab, lp);
      nll -= lp[static_cast<size_t>(text[t + 1])];
    }
    const auto scored = static_cast<double>(static_cast<int64_t>(text.size()) - text_split);
    r.nll_ref = nll_ref / scored;
    r.nll = nll / scored;
  }
  r.nll_change_rel = (r.nll - r.nll_ref) / r.nll_ref;
  r.kept_fraction = kept_steps > 0 ? kept_sum / static_cast<double>(kept_steps) : 1.0;
  r.effective_bytes_ratio_vs_f16 = r.bytes_ratio_vs_f16 * r.kept_fraction;

  // 3. Decode kernel speed, f16 against the format, on the memory-bound MHA shape.
  if (o.measure_speed) {
    AttentionBenchOptions bo;
    bo.set = BenchSet::kDefault;  // every axis replaced below
    bo.num_threads = o.threads;
    bo.scalar_baseline = false;
    bo.batches = {8};
    // A policy's decode reads only the kept tokens: the format's run is at
    // the measured mean kept fraction of the context (whole blocks), f16's
    // at the full one.
    const int64_t kept_context =
        std::max<int64_t>(128, (static_cast<int64_t>(4096 * r.kept_fraction) + 127) / 128 * 128);
    bo.block_lens = {128};
    bo.heads = {{32, 32}};
    bo.contexts = {4096};
    bo.dtypes = {DType::kF16};
    PAGEKV_ASSIGN_OR_RETURN(AttentionBenchReport base, RunAttentionBench(bo));
    bo.contexts = {kept_context};
    bo.dtypes = {o.kv_dtype};
    bo.attention_weights = policy.policy == EvictionPolicy::kH2O;  // its every step reports them
    PAGEKV_ASSIGN_OR_RETURN(AttentionBenchReport mine, RunAttentionBench(bo));
    if (base.results.size() == 1 && mine.results.size() == 1 && mine.results[0].seconds_per_call > 0) {
      r.decode_speedup_vs_f16 = base.results[0].seconds_per_call / mine.results[0].seconds_per_call;
      r.speed_shape = "decode, 32 query / 32 KV heads of 128, batch 8, block_len 128; f16 at context 4096, " +
                      std::string(DTypeName(o.kv_dtype)) + " at " + std::to_string(kept_context) + " kept tokens" +
                      (o.layer_dtypes.empty() ? "" : " (the base format; overridden layers run at their own speed)");
    }
  }
  return r;
}

}  // namespace pagekv
