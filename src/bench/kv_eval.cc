// EvalKv (include/pagekv/eval.h).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/forward_step.h"
#include "model/llama_model.h"
#include "model/model_loader.h"
#include "model/sampler.h"
#include "pagekv/bench.h"
#include "pagekv/eval.h"
#include "pagekv/eviction.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

// Logits at every position of `tokens`, teacher-forced through a fresh cache
// of `dtype`: [tokens.size()][vocab].
Result<std::vector<float>> AllLogits(const LlamaModel& model, DType dtype, int32_t block_len,
                                     std::span<const int32_t> tokens, int threads) {
  const int64_t blocks = (static_cast<int64_t>(tokens.size()) + block_len - 1) / block_len;
  KvCacheOptions co;
  co.config = model.CacheGeometry(block_len, dtype, blocks);
  co.prefault = false;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
  const int32_t vocab = model.config().vocab_size;
  std::vector<float> logits(tokens.size() * static_cast<size_t>(vocab));
  const SeqId seq = cache->AddSequence("eval");
  const ForwardItem item{seq, tokens, logits.data(), true};
  PAGEKV_ASSIGN_OR_RETURN(bool fit, ForwardStep(model, *cache, {&item, 1}, {threads, nullptr}));
  if (!fit) return InternalError("eval: the cache sized for the sequence did not hold it");
  return logits;
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

// Logits through a cache of `dtype` under an eviction policy, the way a
// server meets them: tokens [0, split) as one prompt step (the policy sees
// the prompt end there), then one decode step per token. Returns the logits
// predicting tokens split .. n-1: [n - split][vocab]. kept_sum gains the
// kept fraction (cached / seen) after every decode step.
Result<std::vector<float>> DecodedLogits(const LlamaModel& model, DType dtype, const std::vector<KvFormat>& layers,
                                         bool hadamard, const EvictionOptions& policy, int32_t block_len,
                                         std::span<const int32_t> tokens, int64_t split, int threads,
                                         double& kept_sum, int64_t& kept_steps) {
  const auto n = static_cast<int64_t>(tokens.size());
  KvCacheOptions co;
  co.config = model.CacheGeometry(block_len, dtype, (n + block_len - 1) / block_len);
  co.config.layer_formats = layers;
  if (hadamard) PAGEKV_RETURN_IF_ERROR(RotateQuantizedRows(co.config));
  co.prefault = false;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<TokenEvictor> evictor, TokenEvictor::Create(policy, cache->layout()));
  const int32_t vocab = model.config().vocab_size;
  std::vector<float> out(static_cast<size_t>(n - split) * static_cast<size_t>(vocab));
  const SeqId seq = cache->AddSequence("eval");
  int64_t fed = 0;
  while (fed < n - 1) {
    const int64_t step = fed == 0 ? split : 1;
    PAGEKV_ASSIGN_OR_RETURN(SequenceView view, cache->View(seq));
    const StepScores sc = evictor->BeginStep(view.num_tokens, step, fed == 0);
    ForwardItem item{seq, tokens.subspan(static_cast<size_t>(fed), static_cast<size_t>(step)),
                     out.data() + static_cast<size_t>(fed + step - split) * static_cast<size_t>(vocab), false};
    item.scores = sc.scores;
    item.score_queries = sc.score_queries;
    PAGEKV_ASSIGN_OR_RETURN(bool fit, ForwardStep(model, *cache, {&item, 1}, {threads, nullptr}));
    if (!fit) return InternalError("eval: the cache sized for the sequence did not hold it");
    PAGEKV_RETURN_IF_ERROR(evictor->EndStep(*cache, seq));
    fed += step;
    if (fed > split) {
      kept_sum += static_cast<double>(evictor->cached()) / static_cast<double>(evictor->seen());
      ++kept_steps;
    }
  }
  return out;
}

// A sampled continuation of `prompt` to `length` tokens with an f32 cache.
Result<std::vector<int32_t>> Continue(const LlamaModel& model, std::vector<int32_t> tokens, int64_t length,
                                      float temperature, uint64_t seed, int32_t block_len, int threads) {
  KvCacheOptions co;
  co.config = model.CacheGeometry(block_len, DType::kF32, (length + block_len - 1) / block_len);
  co.prefault = false;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
  const int32_t vocab = model.config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(vocab));
  SamplingOptions so;
  so.temperature = temperature;
  so.seed = seed;
  Sampler sampler(so);
  const SeqId seq = cache->AddSequence("continuation");
  size_t fed = 0;
  while (static_cast<int64_t>(tokens.size()) < length) {
    const ForwardItem item{seq, std::span<const int32_t>(tokens).subspan(fed), logits.data(), false};
    PAGEKV_ASSIGN_OR_RETURN(bool fit, ForwardStep(model, *cache, {&item, 1}, {threads, nullptr}));
    if (!fit) return InternalError("eval: the continuation outgrew its cache");
    fed = tokens.size();
    tokens.push_back(sampler.Sample(logits, tokens));
  }
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
  const LlamaModel& model = *m.model;
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
      ParseLayerFormats(o.layer_dtypes, model.config().num_layers, model.config().head_dim,
                        KvFormat::ForDType(o.kv_dtype, model.config().head_dim)));
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
                            Continue(model, p[p.contains("prompt_ids") ? "prompt_ids" : "ids"].get<std::vector<int32_t>>(), context, o.temperature,
                                     static_cast<uint64_t>(c + 1), o.block_len, o.threads));
    const int64_t split = split_of(seq.size());
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> ref, AllLogits(model, DType::kF32, o.block_len, seq, o.threads));
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> got, DecodedLogits(model, o.kv_dtype, layers, o.hadamard, policy, o.block_len, seq, split,
                                                                  o.threads, kept_sum, kept_steps));
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
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> ref, AllLogits(model, DType::kF32, o.block_len, text, o.threads));
    PAGEKV_ASSIGN_OR_RETURN(std::vector<float> got, DecodedLogits(model, o.kv_dtype, layers, o.hadamard, policy, o.block_len, text,
                                                                  text_split, o.threads, kept_sum, kept_steps));
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
