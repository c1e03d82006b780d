// pagekv::Generate (include/pagekv/generate.h): a client of the Engine.
// It encodes the prompts, sizes the pool for them, submits them (as one
// shared group, whose common prefix the engine prefills once and forks; or,
// with the prefix cache, the first prompt before the rest, so they hit its
// published blocks) and steps the engine until every request is done,
// reading the report from the results and the engine's metrics.
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>

#include "base/checked_math.h"
#include "engine/chat.h"
#include "engine/engine_internal.h"
#include "model/model_loader.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "pagekv/generate.h"
#include "pagekv/plan.h"

namespace pagekv {
namespace {

// Tensor parallel ranks fail together while preparing: a rank that returns
// early (its model file missing, a prompt that does not fit) still meets
// the others at the agreement they wait in, so none is left in a
// collective with a rank that exited.
class RankAgreement {
 public:
  explicit RankAgreement(Communicator* tp) : tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr) {}
  RankAgreement(const RankAgreement&) = delete;
  RankAgreement& operator=(const RankAgreement&) = delete;
  ~RankAgreement() {
    if (tp_ != nullptr && !done_) (void)tp_->AllOk(false);
  }
  Status Agree() {
    done_ = true;
    if (tp_ == nullptr) return Status::Ok();
    PAGEKV_ASSIGN_OR_RETURN(const bool all, tp_->AllOk(true));
    if (!all) {
      return FailedPreconditionError("another tensor parallel rank failed while preparing (its error says why); rank " +
                                     std::to_string(tp_->rank()) + " stopped with it");
    }
    return Status::Ok();
  }

 private:
  Communicator* tp_;
  bool done_ = false;
};

}  // namespace

Result<GenerateReport> Generate(const GenerateOptions& o) {
  RankAgreement agreement(o.parallel.all.get());
  if (o.prompts.empty()) return InvalidArgumentError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file");
  const bool stop_at_eos = o.stop_at_eos || o.chat;
  if (o.max_new_tokens < 0 || (o.max_new_tokens == 0 && !stop_at_eos)) {
    return InvalidArgumentError("-n " + std::to_string(o.max_new_tokens) +
                                ": generate at least 1 token (0, until a stop token, needs --chat or --stop-at-eos)");
  }
  PAGEKV_RETURN_IF_ERROR(Sampler::Validate(o.sampling));
  const bool evicting = o.eviction.policy != EvictionPolicy::kNone;
  PAGEKV_RETURN_IF_ERROR(o.eviction.Validate());
  if (evicting && (o.prefix_cache || TiersConfigured(o.tiers) || !o.kv_events.endpoint.empty())) {
    return InvalidArgumentError("--kv-policy " + std::string(EvictionPolicyName(o.eviction.policy)) +
                                " rewrites a sequence's blocks, so it cannot share them: drop --prefix-cache, the KV "
                                "tiers and --kv-events, or use --kv-policy none");
  }
  PAGEKV_RETURN_IF_ERROR(KvCache::CheckSlices(o.block_len, o.parallel.context_size()));
  PAGEKV_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(o.model_path, o.tokenizer_path, o.parallel));
  const Tokenizer& tok = *loaded.tokenizer;
  const int64_t context = loaded.model->config().context_len;

  GenerateReport report;
  GenerateStats& st = report.stats;
  std::vector<std::vector<int32_t>> ids;
  std::optional<ChatTemplate> chat;
  if (o.chat) {
    const std::string name = o.chat_template.empty() && loaded.chat_template.empty()
                                 ? ChatTemplate::FallbackTemplateName(loaded.model->config().arch)
                                 : o.chat_template;
    PAGEKV_ASSIGN_OR_RETURN(ChatTemplate c, ChatTemplate::Create(loaded.chat_template, name, tok));
    chat = std::move(c);
  }
  // 0 new tokens: until a stop token or the end of the context.
  std::vector<int32_t> max_new(o.prompts.size(), o.max_new_tokens);
  int64_t blocks_needed = 1;
  std::vector<int64_t> totals;  // per prompt: its tokens and the new ones
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    if (chat) {
      nlohmann::ordered_json messages = nlohmann::ordered_json::array();
      if (!o.system_prompt.empty()) messages.push_back({{"role", "system"}, {"content", o.system_prompt}});
      messages.push_back({{"role", "user"}, {"content", o.prompts[i]}});
      PAGEKV_ASSIGN_OR_RETURN(std::vector<int32_t> p, chat->Encode(messages, /*add_generation_prompt=*/true));
      ids.push_back(std::move(p));
    } else {
      ids.push_back(tok.EncodePrompt(o.prompts[i], /*parse_special=*/true));
    }
    std::vector<int32_t>& p = ids.back();
    if (o.max_new_tokens == 0) {
      max_new[i] = static_cast<int32_t>(std::max<int64_t>(1, context - static_cast<int64_t>(p.size())));
    }
    if (static_cast<int64_t>(p.size()) + max_new[i] > context && o.truncate_prompts && context - max_new[i] >= 2) {
      // Keep the first token (BOS) and the most recent ones.
      const auto keep = static_cast<size_t>(context - max_new[i]);
      p.erase(p.begin() + 1, p.end() - static_cast<std::ptrdiff_t>(keep - 1));
      ++st.truncated_prompts;
    }
    const int64_t total = static_cast<int64_t>(p.size()) + max_new[i];
    if (total > context) {
      return OutOfRangeError("prompt " + std::to_string(i + 1) + " has " + std::to_string(p.size()) +
                             " tokens; with -n " + std::to_string(max_new[i]) + " it needs " +
                             std::to_string(total) + " positions, more than the model's context of " +
                             std::to_string(context) +
                             (max_new[i] + 2 > context ? ": lower -n"
                                                       : ": shorten the prompt, lower -n, or pass --truncate-prompt "
                                                         "to keep its most recent tokens"));
    }
    totals.push_back(total);
  }

  // The engine: a pool for every prompt plus its tokens (no watermark), and
  // a step that takes every prompt at once (the prefill is one step, as
  // large as the prompts together).
  int64_t prompt_tokens = 0;
  for (const auto& p : ids) prompt_tokens += static_cast<int64_t>(p.size());
  const bool sharing = o.prefix_cache || !o.kv_events.endpoint.empty() || TiersConfigured(o.tiers);
  EngineOptions eo;
  eo.model_path = o.model_path;
  eo.tokenizer_path = o.tokenizer_path;
  eo.parallel = o.parallel;
  eo.block_len = o.block_len;
  eo.kv_dtype = o.kv_dtype;
  eo.kv_groups = o.kv_groups;
  eo.kv_layer_dtypes = o.kv_layer_dtypes;
  eo.kv_hadamard = o.kv_hadamard;
  eo.max_step_tokens = std::max<int64_t>(1, prompt_tokens);
  eo.max_running = static_cast<int32_t>(std::max<size_t>(1, ids.size()));
  eo.watermark_blocks = 0;
  eo.max_queue = static_cast<int64_t>(ids.size()) + 1;
  eo.prefix_cache = sharing;
  eo.eviction = o.eviction;
  eo.threads = o.threads;
  eo.device = o.device;
  eo.exact_products = o.exact_products;
  eo.tensor_cores = o.tensor_cores;
  eo.cuda_graphs = o.cuda_graphs;
  eo.tiers = o.tiers;
  eo.kv_events = o.kv_events;
  {
    // Every cache group's blocks (a hybrid cache's sliding groups: their
    // window, during the one prefill step as large as all prompts).
    PAGEKV_ASSIGN_OR_RETURN(const CacheConfig geometry, EngineCacheGeometry(eo, *loaded.model));
    PAGEKV_ASSIGN_OR_RETURN(const KvLayout layout, KvLayout::Create(geometry));
    for (int64_t total : totals) blocks_needed += layout.BlocksHeld(total, std::max<int64_t>(1, prompt_tokens));
  }
  eo.num_blocks = o.num_blocks > 0 ? o.num_blocks : blocks_needed;
  ExtraKeys extra = o.extra_keys;
  if (sharing) PAGEKV_RETURN_IF_ERROR(PrefixCache::ValidateExtraKeys(extra));
  if (loaded.model->config().mla()) {
    PlanRequest pr;
    pr.config = loaded.model->CacheGeometry(o.block_len, o.kv_dtype, 1);
    if (Result<Plan> plan = MakePlan(pr); plan.ok()) st.per_head_bytes_per_token = plan->per_head_bytes_per_token;
  }
  // What the requests' callbacks touch lives longer than the engine: an
  // early return destroys the engine, which finishes every request.
  std::vector<bool> first_seen(ids.size(), false);
  size_t first_count = 0;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, CreateEngineWithModel(eo, std::move(loaded)));
  const EngineMetrics geometry = engine->Metrics();
  st.blocks_total = geometry.blocks_total > 0 ? geometry.blocks_total : eo.num_blocks;
  st.bytes_per_block = geometry.bytes_per_block;
  st.kv_bytes_per_token = geometry.bytes_per_token;
  for (size_t i = 0; i < ids.size(); ++i) {
    st.contiguous_bytes += (static_cast<int64_t>(ids[i].size()) + max_new[i]) * geometry.bytes_per_token;
    st.contiguous_max_len_bytes += context * geometry.bytes_per_token;
  }

  // Requests: independent sampling streams, reproducible per prompt.
  uint64_t run_seed = o.sampling.seed.has_value() ? 0 : Sampler::FreshSeed();
  PAGEKV_RETURN_IF_ERROR(agreement.Agree());
  if (o.parallel.active()) {
    // Every rank samples the same tokens: rank 0's seed.
    PAGEKV_RETURN_IF_ERROR(o.parallel.all->Broadcast(&run_seed, sizeof run_seed, 0));
  }
  std::map<RequestId, size_t> prompt_of;
  std::vector<EngineRequest> requests;
  for (size_t i = 0; i < ids.size(); ++i) {
    EngineRequest r;
    r.prompt = ids[i];
    r.max_tokens = max_new[i];
    r.sampling = o.sampling;
    r.sampling.seed = o.sampling.seed.value_or(run_seed) + i;
    r.ignore_eos = !stop_at_eos;
    r.extra = extra;
    r.top_logits = o.top_logits;
    r.on_update = [&, i](const TokenUpdate& u) {
      if (!first_seen[i]) {
        first_seen[i] = true;
        ++first_count;
      }
      if (o.on_token && !u.text.empty()) o.on_token(i, u.text);
    };
    requests.push_back(std::move(r));
  }
  // The prefill is over once every prompt has its first token (or ended).
  const auto t0 = std::chrono::steady_clock::now();
  auto t1 = t0;
  EngineMetrics at_prefill;
  bool prefilled = false;
  auto step = [&]() -> Result<bool> {
    PAGEKV_ASSIGN_OR_RETURN(bool worked, engine->Step());
    if (!prefilled && first_count == ids.size()) {
      prefilled = true;
      t1 = std::chrono::steady_clock::now();
      at_prefill = engine->Metrics();
    }
    return worked;
  };
  auto submit = [&](size_t begin, size_t end) -> Status {
    std::vector<EngineRequest> group;
    for (size_t i = begin; i < end; ++i) group.push_back(std::move(requests[i]));
    PAGEKV_ASSIGN_OR_RETURN(std::vector<RequestId> got, engine->SubmitShared(std::move(group)));
    for (size_t k = 0; k < got.size(); ++k) prompt_of[got[k]] = begin + k;
    return Status::Ok();
  };
  if (sharing && ids.size() > 1) {
    // Prompt 1 first: its full blocks are published when its prefill step
    // ends, and the other prompts then find them.
    PAGEKV_RETURN_IF_ERROR(submit(0, 1));
    while (!first_seen[0]) {
      PAGEKV_ASSIGN_OR_RETURN(bool worked, step());
      if (!worked) break;
    }
    PAGEKV_RETURN_IF_ERROR(submit(1, ids.size()));
  } else {
    PAGEKV_RETURN_IF_ERROR(submit(0, ids.size()));
  }
  for (;;) {
    PAGEKV_ASSIGN_OR_RETURN(bool worked, step());
    if (!worked) break;
  }
  const auto t2 = std::chrono::steady_clock::now();
  if (!prefilled) at_prefill = engine->Metrics();

  report.outputs.resize(ids.size());
  for (const auto& [id, i] : prompt_of) {
    std::optional<RequestResult> r = engine->TryResult(id);
    if (!r.has_value()) {
      return ResourceExhaustedError("the KV pool of " + std::to_string(eo.num_blocks) + " blocks cannot hold prompt " +
                                    std::to_string(i + 1) + ": raise the block count or generate fewer tokens");
    }
    if (r->finish == FinishReason::kError) return r->error;
    GenerateOutput& out = report.outputs[i];
    out.prompt = o.prompts[i];
    out.prompt_ids = ids[i];
    out.generated_ids = r->tokens;
    out.stopped = r->finish == FinishReason::kEos || r->finish == FinishReason::kStop;
    out.step_top = std::move(r->step_top);
    std::vector<int32_t> history = ids[i];
    history.insert(history.end(), out.generated_ids.begin(), out.generated_ids.end());
    out.text = engine->Detokenize(history);
    out.completion = SanitizeUtf8(engine->Detokenize(out.generated_ids));
    st.shared_prefix_tokens = std::max(st.shared_prefix_tokens, r->forked_prompt_tokens);
    st.prefix_hit_tokens += r->cached_prompt_tokens;
    st.prefix_hit_blocks += r->cached_prompt_tokens / o.block_len;  // hits are whole blocks
    st.prefill_tokens_computed += static_cast<int64_t>(ids[i].size()) - r->cached_prompt_tokens - r->forked_prompt_tokens;
    st.tokens_evicted += r->tokens_evicted;
    st.final_cached_tokens += r->final_kv_tokens;
  }
  st.prefill_tokens_computed += st.shared_prefix_tokens;  // the shared prefix, once
  engine->DrainTiers();  // written through before we report (and before exit)
  const EngineMetrics m = engine->Metrics();
  st.peak_blocks_used = m.peak_blocks_used;
  st.copy_on_write_blocks = m.copy_on_write_blocks;
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  st.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  st.decode_tokens = m.generated_tokens - static_cast<int64_t>(ids.size());
  st.prefill_attention_seconds = at_prefill.attention_seconds;
  st.decode_attention_seconds = m.attention_seconds - at_prefill.attention_seconds;
  st.decode_matmul_seconds = m.matmul_seconds - at_prefill.matmul_seconds;
  st.kv_event_batches = m.kv_event_batches;
  if (sharing) {
    st.prefix_blocks_published = m.prefix.inserted;
    st.prefix_blocks_evicted = m.prefix.evicted;
    st.host_hit_blocks = m.prefix.tier_hit_blocks[static_cast<int>(Tier::kHost)];
    st.disk_hit_blocks = m.prefix.tier_hit_blocks[static_cast<int>(Tier::kDisk)];
    st.redis_hit_blocks = m.prefix.tier_hit_blocks[static_cast<int>(Tier::kRedis)];
  }
  if (m.tiers) {
    for (const TierStats& t : m.tiers->tiers) st.tier_errors += t.errors + t.corrupt;
  }
  st.peak_bytes = st.peak_blocks_used * st.bytes_per_block;
  st.peak_utilization = static_cast<double>(st.peak_blocks_used) / static_cast<double>(st.blocks_total);
  return report;
}

}  // namespace pagekv
