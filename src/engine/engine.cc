// Engine (include/pagekv/engine.h): request queues, the scheduler, the step
// loop. The scheduler (scheduler/) only plans and moves sequences between
// queues; Step runs the plan through the model and post-processes.
#include "pagekv/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "base/check.h"
#include "engine/chat.h"
#include "engine/engine_internal.h"
#include "engine/forward_step.h"
#include "model/model.h"
#include "model/model_loader.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "pagekv/kv_cache.h"
#include "prefix/kv_event_publisher.h"
#include "scheduler/scheduler.h"
#include "engine/engine_state.h"

namespace pagekv {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kEos:
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "none";
}


Engine::Engine(std::unique_ptr<State> state) : state_(std::move(state)) {}

Engine::~Engine() {
  Stop();
  std::lock_guard step(state_->step_mu);
  state_->TakeInbox();
  while (!state_->live.empty()) state_->Finish(state_->live.begin()->second.get(), FinishReason::kCancelled);
}

std::string_view KvGroupsName(KvGroups g) {
  switch (g) {
    case KvGroups::kAuto: return "auto";
    case KvGroups::kHybrid: return "hybrid";
    case KvGroups::kUniform: return "uniform";
  }
  return "?";
}

Result<KvGroups> ParseKvGroups(std::string_view s) {
  for (KvGroups g : {KvGroups::kAuto, KvGroups::kHybrid, KvGroups::kUniform}) {
    if (s == KvGroupsName(g)) return g;
  }
  return InvalidArgumentError("unknown KV cache kind '" + std::string(s) + "': use auto, hybrid or uniform");
}

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& o) {
  PAGEKV_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(o.model_path, o.tokenizer_path, o.parallel));
  return CreateEngineWithModel(o, std::move(m));
}

Result<CacheConfig> EngineCacheGeometry(const EngineOptions& o, const Model& model) {
  CacheConfig c = model.CacheGeometry(o.block_len, o.kv_dtype, 1);
  const ModelConfig& mc = model.config();
  if (!mc.hybrid()) return c;
  if (o.kv_groups != KvGroups::kUniform) c.layer_windows = mc.layer_windows;
  return c;
}

namespace {

// This rank's shard of a split model, e.g. "tp0of2-pp1of2" (a context rank
// adds "-cp0of2"); empty when not split. It names the rank's tier keys.
std::string ShardName(const ModelParallel& p) {
  if (!p.active()) return {};
  std::string name;
  for (const auto& [axis, c] : {std::pair{"tp", p.tensor.get()}, std::pair{"pp", p.pipeline.get()}, std::pair{"cp", p.context.get()}}) {
    if (c == nullptr || c->size() < 2) continue;
    if (!name.empty()) name += "-";
    name += std::string(axis) + std::to_string(c->rank()) + "of" + std::to_string(c->size());
  }
  return name;
}

// The KvCacheOptions::shard_tag of a tensor rank and pipeline stage (16
// bits each of rank, size; never 0).
uint64_t ShardTag(const ModelParallel& p) {
  auto field = [](const Communicator* c, bool size) -> uint64_t {
    return c == nullptr ? (size ? 1 : 0) : static_cast<uint64_t>(size ? c->size() : c->rank()) & 0xffff;
  };
  if (p.tensor == nullptr && p.pipeline == nullptr) return 0;
  return 1 | field(p.tensor.get(), false) << 1 | field(p.tensor.get(), true) << 17 | field(p.pipeline.get(), false) << 33 |
         (field(p.pipeline.get(), true) & 0x7fff) << 49;
}

}  // namespace

Result<std::unique_ptr<Engine>> CreateEngineWithModel(const EngineOptions& o, LoadedModel model) {
  if (o.max_step_tokens < 1) return InvalidArgumentError("engine: max_step_tokens must be at least 1");
  if (o.max_running < 1) return InvalidArgumentError("engine: max_running must be at least 1");
  if (o.num_blocks < 0 || o.kv_budget_bytes < 0 || (o.num_blocks > 0 && o.kv_budget_bytes > 0)) {
    return InvalidArgumentError("engine: give the pool as num_blocks or as kv_budget_bytes (at most one, not negative)");
  }
  if (o.block_len < 1) return InvalidArgumentError("engine: block_len must be at least 1");
  PAGEKV_RETURN_IF_ERROR(KvCache::CheckSlices(o.block_len, o.parallel.context_size()));
  if (o.parallel.active()) {
    if (model.model->ranks() != o.parallel.all.get()) {
      return InvalidArgumentError("engine: tensor / pipeline parallel needs the model loaded as this rank's shard (LoadModel with the same ModelParallel)");
    }
    if (!o.kv_events.endpoint.empty() || o.eviction.policy != EvictionPolicy::kNone) {
      return UnimplementedError("engine: a model split over ranks runs without KV events and token eviction for now "
                                "(events would come from every rank; evictions would have to be agreed)");
    }
  }
  auto st = std::make_unique<Engine::State>();
  st->o = o;
  st->m = std::move(model);
  st->stop_tokens = st->m.stop_tokens;
  // A model without a template (a base model) chats in its family's format
  // when that is fixed (gemma), else in ChatML, as llama.cpp's server does;
  // the name says so.
  std::string chat_name = o.chat_template;
  if (chat_name.empty() && st->m.chat_template.empty()) {
    chat_name = ChatTemplate::FallbackTemplateName(st->m.model->config().arch);
    if (chat_name.empty()) chat_name = "chatml";
  }
  if (Result<ChatTemplate> chat = ChatTemplate::Create(st->m.chat_template, chat_name, *st->m.tokenizer); chat.ok()) {
    st->chat = std::move(*chat);
    for (int32_t t : st->chat->stop_tokens()) {
      if (std::find(st->stop_tokens.begin(), st->stop_tokens.end(), t) == st->stop_tokens.end()) st->stop_tokens.push_back(t);
    }
  } else if (!o.chat_template.empty()) {
    return chat.status();  // a named template that does not work: say so now
  } else {
    st->chat_error = chat.status();  // chat requests get it; completions still work
  }
  KvCacheOptions co;
  const ModelConfig& mc = st->m.model->config();
  PAGEKV_ASSIGN_OR_RETURN(co.config, EngineCacheGeometry(o, *st->m.model));
  int64_t num_blocks = o.num_blocks;
  if (num_blocks == 0 && o.kv_budget_bytes == 0) {
    // One full context (every group's blocks for it), and the watermark above it.
    PAGEKV_ASSIGN_OR_RETURN(const KvLayout one, KvLayout::Create(co.config));
    const int64_t context = one.BlocksHeld(mc.context_len, o.max_step_tokens) + one.num_groups();
    num_blocks = o.watermark_blocks >= 0 ? context + o.watermark_blocks : (context * 100 + 98) / 99 + 1;
  }
  co.config.num_blocks = num_blocks;
  co.config.budget_bytes = o.kv_budget_bytes;
  if (o.kv_budget_bytes > 0) co.config.num_blocks = 0;
  PAGEKV_ASSIGN_OR_RETURN(co.config.layer_formats,
                          ParseLayerFormats(o.kv_layer_dtypes, st->m.model->config().num_layers,
                                            st->m.model->config().kv_row_elems(), co.config.format));
  if (co.config.num_layers != mc.num_layers) {
    // A pipeline stage: its layers' formats (given for the whole model).
    // A byte budget becomes a block count every stage computes alike: what
    // the largest stage's blocks fit in it (all ranks must have the same
    // number of blocks, since they allocate in step).
    const std::vector<KvFormat> all_formats = co.config.layer_formats;
    auto stage_config = [&](int32_t first, int32_t count) {
      CacheConfig c = co.config;
      c.num_layers = count;
      if (!all_formats.empty()) c.layer_formats.assign(all_formats.begin() + first, all_formats.begin() + first + count);
      return c;
    };
    if (o.kv_budget_bytes > 0) {
      const int stages = o.parallel.pipeline_size();
      int64_t widest = 0;
      for (int s = 0; s < stages; ++s) {
        const int32_t first = mc.num_layers * s / stages, count = mc.num_layers * (s + 1) / stages - first;
        CacheConfig c = stage_config(first, count);
        c.budget_bytes = 0;
        c.num_blocks = 1;
        // Context parallel: a rank's blocks are its slices of them.
        const int cp = o.parallel.context_size();
        if (cp > 1 && c.block_len % cp == 0) c.block_len /= cp;
        if (o.kv_hadamard) PAGEKV_RETURN_IF_ERROR(RotateQuantizedRows(c));
        PAGEKV_ASSIGN_OR_RETURN(const KvLayout layout, KvLayout::Create(c));
        widest = std::max(widest, layout.bytes_per_block());
      }
      co.config.budget_bytes = 0;
      co.config.num_blocks = o.kv_budget_bytes / std::max<int64_t>(1, widest);
      if (co.config.num_blocks < 1) {
        return InvalidArgumentError("engine: a KV budget of " + std::to_string(o.kv_budget_bytes) +
                                    " bytes holds no block of the largest pipeline stage (" + std::to_string(widest) + " bytes)");
      }
    }
    const int64_t blocks = co.config.num_blocks;
    const int64_t budget = co.config.budget_bytes;
    co.config = stage_config(st->m.model->first_layer(), co.config.num_layers);
    co.config.num_blocks = blocks;
    co.config.budget_bytes = budget;
  }
  if (o.kv_hadamard) PAGEKV_RETURN_IF_ERROR(RotateQuantizedRows(co.config));
  // Context parallel: this rank's slice of every block.
  co.slices = o.parallel.context_size();
  co.slice = o.parallel.context_rank();
  // Tensor ranks and pipeline stages: blocks of another shard are never this
  // one's (context slices are told apart by the cache itself).
  const std::string shard = ShardName(o.parallel);
  co.shard_tag = ShardTag(o.parallel);
  PAGEKV_ASSIGN_OR_RETURN(st->device, MakeDeviceBackend(o.device, {o.tensor_cores, o.cuda_graphs}));
  if (st->device != nullptr) {
    if (o.parallel.active()) {
      return InvalidArgumentError("--device " + o.device + " with --tp / --pp / --cp is not supported: split models run on the CPU");
    }
    if (o.eviction.policy != EvictionPolicy::kNone) {
      return InvalidArgumentError("--device " + o.device + " with token eviction (--kv-policy) is not supported: eviction "
                                  "rewrites rows on the host; use --kv-policy none or --device cpu");
    }
    co.backend = st->device.get();
  }
  PAGEKV_ASSIGN_OR_RETURN(st->cache, KvCache::Create(co));
  if (o.eviction.policy != EvictionPolicy::kNone) {
    PAGEKV_RETURN_IF_ERROR(o.eviction.Validate());
    if (st->m.model->config().hybrid()) {
      return InvalidArgumentError("engine: token eviction (--kv-policy) on a model with sliding-window layers (" +
                                  st->m.model->config().arch +
                                  ") is not supported: eviction moves the positions a window counts; use --kv-policy none");
    }
    if (o.allocator != Allocator::kPaged || o.prefix_cache || TiersConfigured(o.tiers)) {
      return InvalidArgumentError(
          "engine: token eviction rewrites a sequence's blocks, so it needs the paged allocator without the prefix "
          "cache or KV tiers (serve: --no-prefix-cache)");
    }
    PAGEKV_RETURN_IF_ERROR(TokenEvictor::Create(o.eviction, st->cache->layout()).status());
  }
  if (TiersConfigured(o.tiers)) {
    if (o.allocator != Allocator::kPaged || !o.prefix_cache) {
      return InvalidArgumentError("engine: KV tiers need the paged allocator with the prefix cache");
    }
    PAGEKV_ASSIGN_OR_RETURN(st->fingerprint, FileFingerprint(o.model_path));
    TierOptions to = o.tiers;
    if (to.redis_namespace.empty()) to.redis_namespace = "pagekv:" + st->fingerprint;
    if (!shard.empty()) {
      // Each rank's tiers hold its shard, under keys of its own: a Redis
      // namespace and a disk cache file per shard.
      to.redis_namespace += ":" + shard;
      if (!to.disk_path.empty()) to.disk_path += "." + shard;
    }
    PAGEKV_ASSIGN_OR_RETURN(st->tiers, BlockTiers::Create(to, o.block_len, st->cache->block_payload_bytes()));
    if (o.parallel.active()) st->agreed = std::make_unique<AgreedTiers>(*st->tiers, o.parallel.all);
    st->metrics.model_fingerprint = st->fingerprint;
  }
  if (!o.kv_events.endpoint.empty() && (o.allocator != Allocator::kPaged || !o.prefix_cache)) {
    return InvalidArgumentError("engine: KV events come from the prefix cache: they need the paged allocator with it");
  }
  if (o.allocator == Allocator::kPaged && o.prefix_cache) {
    PrefixCacheOptions po;
    po.tiers = st->agreed ? static_cast<LowerTiers*>(st->agreed.get()) : st->tiers.get();
    po.record_events = !o.kv_events.endpoint.empty();
    PAGEKV_ASSIGN_OR_RETURN(st->prefix, PrefixCache::Create(*st->cache, po));
  }
  if (!o.kv_events.endpoint.empty()) {
    const KvEventsOptions& ko = o.kv_events;
    KvEventWire wire;
    wire.topic = ko.topic ? *ko.topic : DefaultKvEventsTopic(ko, o.model_path);
    wire.hash_bytes = ko.hash_bytes;
    wire.data_parallel_rank = ko.data_parallel_rank;
    wire.replay_endpoint = ko.replay_endpoint;
    wire.buffer_batches = ko.buffer_batches;
    PAGEKV_ASSIGN_OR_RETURN(st->events, KvEventPublisher::Create(ko.endpoint, std::move(wire)));
    if (ko.wait_ms > 0) st->events->WaitForSubscriber(ko.wait_ms);
  }
  st->metrics.kv_groups = st->cache->layout().num_groups();
  st->metrics.bytes_per_block = st->cache->arena_layout().bytes_per_block();  // this rank's
  st->metrics.bytes_per_token = st->cache->layout().bytes_per_token() / st->cache->slices();  // this rank's share
  const int64_t blocks = st->cache->layout().num_blocks();
  st->metrics.blocks_total = blocks;  // before the first step's snapshot too (/props, /metrics)
  st->metrics.blocks_free = st->cache->FreeBlockCount();
  st->watermark = o.watermark_blocks >= 0 ? o.watermark_blocks : blocks / 100;
  if (st->watermark >= blocks) return InvalidArgumentError("engine: the watermark leaves no block to allocate");
  SchedulerOptions so;
  so.max_step_tokens = o.max_step_tokens;
  so.max_running = o.max_running;
  so.paged = o.allocator == Allocator::kPaged;
  so.block_len = o.block_len;
  so.watermark = st->watermark;
  so.eviction = o.eviction;
  so.prefetch = st->tiers != nullptr;
  // Sharded: in line (a background move ends at a time no two ranks share).
  so.background_tier_moves = st->tiers != nullptr && o.background_tier_moves && !o.parallel.active();
  st->sched = std::make_unique<Scheduler>(so, *st->cache, st->prefix.get());
  if (o.parallel.active() && o.parallel_leader) {
    st->lead = o.parallel.all->rank() == 0;
    st->follow = !st->lead;
  }
  return std::unique_ptr<Engine>(new Engine(std::move(st)));
}

std::vector<TokenLogprob> TokenLogprobs(const RequestResult& r) {
  std::vector<TokenLogprob> out;
  const size_t steps = std::min(r.tokens.size(), r.token_logprobs.size());
  for (size_t i = 0; i < steps; ++i) out.push_back(TokenLogprobAt(r, i));
  return out;
}

void Engine::DrainTiers() {
  if (state_->tiers) state_->tiers->Drain();
}

namespace {

// Submit's checks of one request (nothing queued).
Status CheckRequest(const Engine& engine, const Model& model, const KvCache& cache, int64_t watermark,
                    int32_t block_len, const EngineRequest& r) {
  if (r.prompt.empty()) return InvalidArgumentError("the prompt is empty: give at least one token (BOS)");
  if (r.max_tokens < 1 && !(r.max_tokens == 0 && r.prompt_logits)) {
    return InvalidArgumentError("max_tokens " + std::to_string(r.max_tokens) +
                                ": must be at least 1 (0 only to score a prompt, with prompt_logits)");
  }
  const int32_t vocab = model.config().vocab_size;
  for (int32_t t : r.prompt) {
    if (t < 0 || t >= vocab) {
      return InvalidArgumentError("token id " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  const int64_t total = static_cast<int64_t>(r.prompt.size()) + r.max_tokens;
  if (total > engine.context_len()) {
    return OutOfRangeError("the prompt has " + std::to_string(r.prompt.size()) + " tokens; with max_tokens " +
                           std::to_string(r.max_tokens) + " it needs " + std::to_string(total) +
                           " positions, more than the model's context of " + std::to_string(engine.context_len()));
  }
  PAGEKV_RETURN_IF_ERROR(Sampler::Validate(r.sampling));
  for (const auto& [id, bias] : r.sampling.logit_bias) {
    if (id >= vocab) {
      return InvalidArgumentError("logit_bias: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab) + ")");
    }
  }
  PAGEKV_RETURN_IF_ERROR(PrefixCache::ValidateExtraKeys(r.extra));
  if (r.top_logits < 0) return InvalidArgumentError("top_logits " + std::to_string(r.top_logits) + ": must be >= 0");
  if (!r.forced_tokens.empty()) {
    if (static_cast<int64_t>(r.forced_tokens.size()) < r.max_tokens) {
      return InvalidArgumentError("forced_tokens has " + std::to_string(r.forced_tokens.size()) +
                                  " tokens for max_tokens " + std::to_string(r.max_tokens) +
                                  ": give at least max_tokens of them");
    }
    for (int32_t t : r.forced_tokens) {
      if (t < 0 || t >= vocab) {
        return InvalidArgumentError("forced token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                    std::to_string(vocab) + ")");
      }
    }
  }
  const int64_t blocks = (total + block_len - 1) / block_len;
  if (blocks > cache.layout().num_blocks() - watermark) {
    return ResourceExhaustedError("the request needs " + std::to_string(blocks) + " KV blocks; the pool has " +
                                  std::to_string(cache.layout().num_blocks()) + " (less a watermark of " +
                                  std::to_string(watermark) + ")");
  }
  return Status::Ok();
}

}  // namespace

Result<RequestId> Engine::Submit(EngineRequest r) {
  State& st = *state_;
  PAGEKV_RETURN_IF_ERROR(CheckRequest(*this, *st.m.model, *st.cache, st.watermark, st.o.block_len, r));
  std::lock_guard lock(st.mu);
  if (st.queued >= st.o.max_queue) {
    return UnavailableError("the queue is full (" + std::to_string(st.o.max_queue) + " requests): retry later");
  }
  const RequestId id = st.EnqueueLocked(std::move(r), false);
  st.work_cv.notify_all();
  return id;
}

Result<std::vector<RequestId>> Engine::SubmitShared(std::vector<EngineRequest> requests) {
  State& st = *state_;
  for (const EngineRequest& r : requests) {
    PAGEKV_RETURN_IF_ERROR(CheckRequest(*this, *st.m.model, *st.cache, st.watermark, st.o.block_len, r));
  }
  // The longest common prefix, each prompt keeping at least one token.
  size_t lcp = 0;
  const bool any_prompt_logits =
      std::any_of(requests.begin(), requests.end(), [](const EngineRequest& r) { return r.prompt_logits; });
  if (requests.size() > 1 && st.o.allocator == Allocator::kPaged && !st.prefix &&
      st.o.eviction.policy == EvictionPolicy::kNone && !any_prompt_logits) {
    size_t shortest = requests[0].prompt.size();
    for (const EngineRequest& r : requests) shortest = std::min(shortest, r.prompt.size());
    while (lcp + 1 < shortest && std::all_of(requests.begin(), requests.end(), [&](const EngineRequest& r) {
             return r.prompt[lcp] == requests[0].prompt[lcp];
           })) {
      ++lcp;
    }
  }
  std::lock_guard lock(st.mu);
  const auto extra = static_cast<int64_t>(requests.size()) + (lcp > 0 ? 1 : 0);
  if (st.queued + extra > st.o.max_queue) {
    return UnavailableError("the queue cannot take " + std::to_string(requests.size()) + " more requests (" +
                            std::to_string(st.o.max_queue) + " at most): retry later");
  }
  std::vector<RequestId> ids;
  int32_t priority = requests.empty() ? 0 : requests[0].priority;
  for (const EngineRequest& r : requests) priority = std::max(priority, r.priority);
  std::vector<int32_t> prefix = lcp > 0 ? std::vector<int32_t>(requests[0].prompt.begin(), requests[0].prompt.begin() + static_cast<std::ptrdiff_t>(lcp))
                                        : std::vector<int32_t>{};
  for (EngineRequest& r : requests) ids.push_back(st.EnqueueLocked(std::move(r), lcp > 0));
  if (lcp > 0) {
    EngineRequest root;
    root.prompt = std::move(prefix);
    root.max_tokens = 1;
    root.priority = priority;
    root.sampling.seed = 0;  // samples nothing
    const RequestId id = st.EnqueueLocked(std::move(root), false, /*root=*/true);
    Seq* r = st.inbox.back().get();
    PAGEKV_CHECK(r->id == id);
    r->members = ids;
  }
  st.work_cv.notify_all();
  return ids;
}


bool Engine::Cancel(RequestId id) {
  std::lock_guard lock(state_->mu);
  auto it = state_->known.find(id);
  if (it == state_->known.end() || it->second) return false;
  state_->cancels.push_back(id);
  state_->work_cv.notify_all();
  return true;
}

Status Engine::ResetPrefixCache() {
  State& st = *state_;
  if (!st.prefix) return FailedPreconditionError("engine: no prefix cache to reset (it is off)");
  {
    std::unique_lock lock(st.mu);
    if (st.loop.joinable()) {
      // The loop takes it before its next step (taking step_mu here could
      // wait behind a loop that steps without pause).
      const uint64_t target = st.resets_done + 1;
      st.reset_requested = true;
      st.work_cv.notify_all();
      st.done_cv.wait(lock, [&] { return st.resets_done >= target || st.stopping; });
      return st.resets_done >= target ? st.reset_status : UnavailableError("engine: stopped before the reset");
    }
  }
  std::lock_guard step(st.step_mu);
  return st.ResetPrefixNow();
}

Result<bool> Engine::Step() {
  State& st = *state_;
  std::lock_guard step(st.step_mu);
  if (st.follow) {
    if (st.follow_stopped) return FailedPreconditionError("engine: the leader has stopped this follower");
    bool stop = false;
    if (Status s = st.ReceiveInputs(stop); !s.ok()) {
      // The leader's inputs did not arrive whole: this rank cannot step
      // with the others any more; end the job rather than hang it.
      std::fprintf(stderr, "pagekv: rank %d could not take the leader's step inputs: %s; aborting every rank\n",
                   st.o.parallel.all->rank(), s.message().c_str());
      st.o.parallel.all->Abort(3);
    }
    if (stop) {
      st.follow_stopped = true;
      return false;
    }
  }
  bool reset = false;
  std::vector<std::unique_ptr<Seq>> fresh;
  std::vector<RequestId> cancel;
  st.GrabInputs(reset, fresh, cancel);
  if (st.lead) {
    if (st.stop_sent) return FailedPreconditionError("engine: this leader has stopped its followers");
    if (Status s = st.SendInputs(reset, fresh, cancel, false); !s.ok()) {
      // The followers wait for this step's inputs: end the job, not hang it.
      std::fprintf(stderr, "pagekv: the leader could not send a step's inputs: %s; aborting every rank\n", s.message().c_str());
      st.o.parallel.all->Abort(3);
    }
  }
  if (reset) {
    const Status done = st.ResetPrefixNow();
    std::lock_guard lock(st.mu);
    st.reset_status = done;
    ++st.resets_done;
    st.done_cv.notify_all();
  }
  st.Admit(std::move(fresh), std::move(cancel));
  const StepPlan plan = st.sched->Plan();
  if (!plan.preempted.empty()) {
    std::lock_guard lock(st.mu);
    st.metrics.preemptions += static_cast<int64_t>(plan.preempted.size());
  }
  if (plan.items.empty()) {
    PAGEKV_CHECK_MSG(st.sched->running().empty(), "scheduler: running sequences but nothing planned");
    st.Snapshot();
    if (!st.sched->loading().empty()) {
      // Nothing to compute until a prefix arrives from a lower tier.
      st.sched->WaitForLoads(std::chrono::milliseconds(20));
      return true;
    }
    return false;
  }
  // Build the batch: every planned sequence's next tokens; logits where a
  // sample follows; the attention weights an evicting sequence's policy
  // needs (the step that completes the prompt marks its end).
  const int32_t vocab = st.m.model->config().vocab_size;
  std::vector<float> logits(plan.items.size() * static_cast<size_t>(vocab));
  std::vector<std::vector<float>> all_rows(plan.items.size());  // items whose prompt logits are wanted
  std::vector<ForwardItem> items;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const StepPlan::Item& p = plan.items[i];
    Seq* s = static_cast<Seq*>(p.seq);
    if (!s->scheduled) s->scheduled = Clock::now();
    items.push_back({*s->seq, std::span<const int32_t>(s->tokens).subspan(static_cast<size_t>(s->computed), static_cast<size_t>(p.count)),
                     p.samples ? logits.data() + i * static_cast<size_t>(vocab) : nullptr, false});
    if (s->req.prompt_logits && s->computed < s->prompt_len) {
      all_rows[i].resize(static_cast<size_t>(p.count) * static_cast<size_t>(vocab));
      items[i].logits = all_rows[i].data();
      items[i].all_logits = true;
    }
    if (s->evictor) {
      const bool prompt_ends = s->computed < s->prompt_len && s->computed + p.count >= s->prompt_len;
      const StepScores sc = s->evictor->BeginStep(s->evictor->cached(), p.count, prompt_ends);
      items[i].scores = sc.scores;
      items[i].score_queries = sc.score_queries;
    }
  }
  static_assert(static_cast<int>(ForwardOptions::MlaPrefill::kAbsorbed) == static_cast<int>(EngineOptions::MlaPrefill::kAbsorbed) &&
                static_cast<int>(ForwardOptions::MlaPrefill::kUnabsorbed) == static_cast<int>(EngineOptions::MlaPrefill::kUnabsorbed));
  ForwardOptions fo{st.o.threads, &st.timings};
  fo.mla_prefill = static_cast<ForwardOptions::MlaPrefill>(st.o.mla_prefill);
  if (st.o.exact_products) fo.activations = Activations::kF32;
  fo.overlap_communication = st.o.overlap_communication;
  // A hybrid cache's sliding groups release after the step's blocks are
  // published (below), so that they stay cached for a later hit there.
  const bool release_after_publish = st.prefix != nullptr && st.cache->layout().hybrid();
  Result<bool> fit = ForwardStep(*st.m.model, *st.cache, items, fo, nullptr, !release_after_publish);
  if (!fit.ok() || !*fit) {
    const Status error = fit.ok() ? InternalError("scheduler planned a step the pool could not hold") : fit.status();
    for (const StepPlan::Item& p : plan.items) st.Finish(static_cast<Seq*>(p.seq), FinishReason::kError, error);
    return error;
  }
  st.peak_blocks = std::max(st.peak_blocks, st.cache->layout().num_blocks() - st.cache->FreeBlockCount());
  // Postprocess: count the computed tokens, publish full blocks, sample.
  std::vector<Seq*> prefixed;  // roots whose common prefix is computed
  for (size_t i = 0; i < plan.items.size(); ++i) {
    Seq* s = static_cast<Seq*>(plan.items[i].seq);
    s->computed += plan.items[i].count;
    if (s->root) {
      if (release_after_publish) PAGEKV_RETURN_IF_ERROR(st.cache->ReleaseOutOfWindow(*s->seq).status());
      if (s->computed == static_cast<int64_t>(s->tokens.size())) prefixed.push_back(s);
      continue;
    }
    if (st.prefix) PAGEKV_RETURN_IF_ERROR(st.prefix->Publish(*s->seq, s->tokens));
    if (release_after_publish) PAGEKV_RETURN_IF_ERROR(st.cache->ReleaseOutOfWindow(*s->seq).status());
    if (s->evictor) {
      const int64_t before = s->evictor->stats().tokens_evicted;
      PAGEKV_RETURN_IF_ERROR(s->evictor->EndStep(*st.cache, *s->seq));
      std::lock_guard lock(st.mu);
      st.metrics.tokens_evicted += s->evictor->stats().tokens_evicted - before;
    }
    if (!all_rows[i].empty()) {
      // Rows of prompt positions to the result; a sample takes the last.
      const int64_t first = s->computed - plan.items[i].count;
      std::vector<float>& out = s->result.prompt_logits;
      out.resize(static_cast<size_t>(s->prompt_len) * static_cast<size_t>(vocab));
      const int64_t rows = std::min(plan.items[i].count, s->prompt_len - first);
      std::memcpy(out.data() + static_cast<size_t>(first) * static_cast<size_t>(vocab), all_rows[i].data(),
                  static_cast<size_t>(rows) * static_cast<size_t>(vocab) * sizeof(float));
      if (!plan.items[i].samples) continue;
      if (s->req.max_tokens == 0) {  // scored, nothing to generate
        st.Finish(s, FinishReason::kLength);
        continue;
      }
      std::memcpy(logits.data() + i * static_cast<size_t>(vocab),
                  all_rows[i].data() + static_cast<size_t>(plan.items[i].count - 1) * static_cast<size_t>(vocab),
                  static_cast<size_t>(vocab) * sizeof(float));
    } else if (items[i].logits == nullptr) {
      continue;
    }
    const std::span<const float> row(logits.data() + i * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
    if (s->req.top_logits > 0) s->result.step_top.push_back(TopK(row, s->req.top_logits));
    if (s->req.return_logits) s->result.logits.insert(s->result.logits.end(), row.begin(), row.end());
    const size_t generated_so_far = s->tokens.size() - static_cast<size_t>(s->prompt_len);
    const int32_t token = !s->req.forced_tokens.empty() && generated_so_far < s->req.forced_tokens.size()
                              ? s->req.forced_tokens[generated_so_far]
                              : s->sampler.Sample(row, s->tokens, static_cast<size_t>(s->prompt_len));
    if (s->req.logprobs) {
      const double lse = LogSumExp(row);
      s->result.token_logprobs.push_back(static_cast<float>(static_cast<double>(row[static_cast<size_t>(token)]) - lse));
      s->result.step_logsumexp.push_back(static_cast<float>(lse));
    }
    const size_t had = s->result.tokens.size();
    const FinishReason end = st.Accept(s, token);
    if (end == FinishReason::kNone) {
      st.Emit(s, token, FinishReason::kNone);
    } else {
      // The final update carries the token when it joined the output (not
      // an EOS / end-of-turn token).
      st.Finish(s, end, Status::Ok(), s->result.tokens.size() > had ? token : -1);
    }
  }
  for (Seq* root : prefixed) st.ForkMembers(root);
  if (st.events) PAGEKV_RETURN_IF_ERROR(st.events->Publish(st.prefix->DrainEvents()));
  st.Snapshot();
  return true;
}

Status Engine::RunUntilIdle() {
  for (;;) {
    PAGEKV_ASSIGN_OR_RETURN(bool worked, Step());
    std::lock_guard lock(state_->mu);
    if (!worked && state_->queued == 0) return Status::Ok();
    if (!worked && state_->inbox.empty() && state_->cancels.empty()) {
      return InternalError("engine: requests are waiting but none can be scheduled");
    }
  }
}

void Engine::Start() {
  State& st = *state_;
  std::lock_guard lock(st.mu);
  if (st.loop.joinable()) return;
  st.stopping = false;
  st.loop = std::thread([this] {
    State& s = *state_;
    for (;;) {
      {
        std::unique_lock lock(s.mu);
        s.work_cv.wait(lock, [&] { return s.stopping || s.queued > 0 || !s.cancels.empty() || s.reset_requested; });
        if (s.stopping) return;
      }
      Result<bool> worked = Step();
      if (worked.ok() && !*worked) {
        std::unique_lock lock(s.mu);
        s.work_cv.wait_for(lock, std::chrono::milliseconds(2));  // nothing schedulable yet
      }
    }
  });
}

void Engine::Stop() {
  State& st = *state_;
  std::thread t;
  {
    std::lock_guard lock(st.mu);
    st.stopping = true;
    st.work_cv.notify_all();
    t = std::move(st.loop);
  }
  if (t.joinable()) t.join();
  // A leader's followers stop with it (from this thread: the loop is gone,
  // so the ranks' collectives stay in order).
  std::lock_guard step(st.step_mu);
  if (st.lead && !st.stop_sent) {
    if (Status s = st.SendInputs(false, {}, {}, true); !s.ok()) {
      std::fprintf(stderr, "pagekv: the leader could not stop its followers: %s\n", s.message().c_str());
    }
    st.stop_sent = true;
  }
}

Status Engine::Follow() {
  State& st = *state_;
  if (!st.follow) return FailedPreconditionError("engine: Follow() is for ranks other than 0 of a parallel_leader engine");
  {
    std::lock_guard step(st.step_mu);
    if (st.follow_stopped) return FailedPreconditionError("engine: the leader has stopped this follower");
  }
  for (;;) {
    // A failed step failed on every rank alike (the step's requests end
    // with the error on the leader, which answers them): go on, as the
    // leader's loop does.
    (void)Step();
    std::lock_guard step(st.step_mu);
    if (st.follow_stopped) return Status::Ok();
  }
}

RequestResult Engine::Wait(RequestId id) {
  std::unique_lock lock(state_->mu);
  state_->done_cv.wait(lock, [&] { return state_->results.count(id) > 0 || state_->known.count(id) == 0; });
  auto it = state_->results.find(id);
  if (it == state_->results.end()) return RequestResult{id, {}, {}, FinishReason::kError, NotFoundError("unknown request")};
  RequestResult r = std::move(it->second);
  state_->results.erase(it);
  state_->known.erase(id);
  return r;
}

std::optional<RequestResult> Engine::WaitFor(RequestId id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(state_->mu);
  const bool ended = state_->done_cv.wait_for(
      lock, timeout, [&] { return state_->results.count(id) > 0 || state_->known.count(id) == 0; });
  if (!ended) return std::nullopt;
  auto it = state_->results.find(id);
  if (it == state_->results.end()) return RequestResult{id, {}, {}, FinishReason::kError, NotFoundError("unknown request")};
  RequestResult r = std::move(it->second);
  state_->results.erase(it);
  state_->known.erase(id);
  return r;
}

std::optional<RequestResult> Engine::TryResult(RequestId id) {
  std::lock_guard lock(state_->mu);
  auto it = state_->results.find(id);
  if (it == state_->results.end()) return std::nullopt;
  RequestResult r = std::move(it->second);
  state_->results.erase(it);
  state_->known.erase(id);
  return r;
}

EngineMetrics Engine::Metrics() const {
  EngineMetrics m;
  {
    std::lock_guard lock(state_->mu);
    m = state_->metrics;
    m.waiting = state_->queued - m.running - m.loading;
  }
  // Read by the caller, not each step: a store's counters share its lock
  // with its I/O, which the step loop must never wait for.
  if (state_->tiers) m.tiers = state_->tiers->Stats();
  return m;
}

void Engine::CheckInvariants() const {
  State& st = *state_;
  std::lock_guard step(st.step_mu);
  st.cache->CheckInvariants();
  if (st.prefix) st.prefix->CheckInvariants();
  st.sched->CheckInvariants();
  if (st.tiers) st.tiers->CheckInvariants();
}

}  // namespace pagekv
