// pagekv::Generate: load, encode, prefill the shared prefix once, fork, decode
// step by step, free each sequence when done. See include/pagekv/generate.h.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>

#include "base/checked_math.h"
#include "engine/chat.h"
#include "engine/forward_step.h"
#include "model/gguf_file.h"
#include "model/llama_model.h"
#include "model/model_loader.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "prefix/kv_event_publisher.h"
#include "pagekv/generate.h"
#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"

namespace pagekv {
namespace {

std::vector<std::pair<int32_t, float>> TopK(const float* logits, int32_t n, int32_t k) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = i;
  k = std::min(k, n);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<std::pair<int32_t, float>> out;
  for (int32_t i = 0; i < k; ++i) out.emplace_back(ids[static_cast<size_t>(i)], logits[ids[static_cast<size_t>(i)]]);
  return out;
}

}  // namespace

Result<GenerateReport> Generate(const GenerateOptions& o) {
  if (o.prompts.empty()) return InvalidArgumentError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file");
  const bool stop_at_eos = o.stop_at_eos || o.chat;
  if (o.max_new_tokens < 0 || (o.max_new_tokens == 0 && !stop_at_eos)) {
    return InvalidArgumentError("-n " + std::to_string(o.max_new_tokens) +
                                ": generate at least 1 token (0, until a stop token, needs --chat or --stop-at-eos)");
  }
  PAGEKV_RETURN_IF_ERROR(Sampler::Validate(o.sampling));
  const bool evicting = o.eviction.policy != EvictionPolicy::kNone;
  PAGEKV_RETURN_IF_ERROR(o.eviction.Validate());
  if (evicting && (o.prefix_cache || TiersConfigured(o.tiers) || !o.kv_events_endpoint.empty())) {
    return InvalidArgumentError("--kv-policy " + std::string(EvictionPolicyName(o.eviction.policy)) +
                                " rewrites a sequence's blocks, so it cannot share them: drop --prefix-cache, the KV "
                                "tiers and --kv-events, or use --kv-policy none");
  }
  PAGEKV_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(o.model_path, o.tokenizer_path));
  const LlamaModel& model = *loaded.model;
  const Tokenizer& tok = *loaded.tokenizer;
  const int32_t vocab = model.config().vocab_size;

  GenerateReport report;
  std::vector<std::vector<int32_t>> ids;
  int64_t blocks_needed = 1;
  std::optional<ChatTemplate> chat;
  if (o.chat) {
    PAGEKV_ASSIGN_OR_RETURN(ChatTemplate c, ChatTemplate::Create(loaded.chat_template, o.chat_template, tok));
    chat = std::move(c);
  }
  const std::vector<int32_t> stop_tokens = chat ? chat->stop_tokens() : loaded.stop_tokens;
  // 0 new tokens: until a stop token or the end of the context.
  std::vector<int32_t> max_new(o.prompts.size(), o.max_new_tokens);
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
    const int64_t context = model.config().context_len;
    if (o.max_new_tokens == 0) {
      max_new[i] = static_cast<int32_t>(std::max<int64_t>(1, context - static_cast<int64_t>(p.size())));
    }
    if (static_cast<int64_t>(p.size()) + max_new[i] > context && o.truncate_prompts && context - max_new[i] >= 2) {
      // Keep the first token (BOS) and the most recent ones.
      const auto keep = static_cast<size_t>(context - max_new[i]);
      p.erase(p.begin() + 1, p.end() - static_cast<std::ptrdiff_t>(keep - 1));
      ++report.stats.truncated_prompts;
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
    blocks_needed += CeilDiv(total, o.block_len);
  }
  KvCacheOptions co;
  co.config = model.CacheGeometry(o.block_len, o.kv_dtype, o.num_blocks > 0 ? o.num_blocks : blocks_needed);
  PAGEKV_ASSIGN_OR_RETURN(co.config.layer_formats,
                          ParseLayerFormats(o.kv_layer_dtypes, model.config().num_layers, model.config().head_dim,
                                            co.config.format));
  if (o.kv_hadamard) PAGEKV_RETURN_IF_ERROR(RotateQuantizedRows(co.config));
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
  const KvLayout& layout = cache->layout();
  GenerateStats& st = report.stats;
  st.blocks_total = layout.num_blocks();
  st.bytes_per_block = layout.bytes_per_block();
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& p = ids[i];
    st.contiguous_bytes += (static_cast<int64_t>(p.size()) + max_new[i]) * layout.bytes_per_token();
    st.contiguous_max_len_bytes += int64_t{model.config().context_len} * layout.bytes_per_token();
  }
  auto track = [&] {
    st.peak_blocks_used = std::max(st.peak_blocks_used, layout.num_blocks() - cache->FreeBlockCount());
  };
  auto out_of_blocks = [&] {
    return ResourceExhaustedError("the KV pool of " + std::to_string(layout.num_blocks()) +
                                  " blocks is full: raise the block count or generate fewer tokens");
  };

  // 1. Sharing. Without a prefix cache: the longest common prefix,
  //    prefilled once and forked to every prompt (each prompt keeps at least
  //    its last token to compute). With one: prompt 1 is prefilled and its
  //    full blocks published first; the others then hit them.
  size_t lcp = 0;
  if (ids.size() > 1 && !o.prefix_cache && !TiersConfigured(o.tiers) && !evicting) {
    size_t shortest = ids[0].size();
    for (const auto& p : ids) shortest = std::min(shortest, p.size());
    while (lcp + 1 < shortest &&
           std::all_of(ids.begin(), ids.end(), [&](const auto& p) { return p[lcp] == ids[0][lcp]; })) {
      ++lcp;
    }
  }
  st.shared_prefix_tokens = static_cast<int64_t>(lcp);
  std::unique_ptr<BlockTiers> tiers;  // outlives prefix_cache, which calls it
  std::unique_ptr<PrefixCache> prefix_cache;
  std::unique_ptr<KvEventPublisher> events;
  ExtraKeys extra = o.extra_keys;
  if (TiersConfigured(o.tiers)) {
    PAGEKV_ASSIGN_OR_RETURN(std::string fingerprint, FileFingerprint(o.model_path));
    if (extra.model_fingerprint.empty()) extra.model_fingerprint = fingerprint;
    TierOptions to = o.tiers;
    if (to.redis_namespace.empty()) to.redis_namespace = "pagekv:" + fingerprint;
    PAGEKV_ASSIGN_OR_RETURN(tiers, BlockTiers::Create(to, o.block_len, cache->block_payload_bytes()));
  }
  if (o.prefix_cache || !o.kv_events_endpoint.empty() || tiers) {
    PAGEKV_RETURN_IF_ERROR(PrefixCache::ValidateExtraKeys(extra));
    PrefixCacheOptions po;
    po.record_events = !o.kv_events_endpoint.empty();
    po.tiers = tiers.get();
    PAGEKV_ASSIGN_OR_RETURN(prefix_cache, PrefixCache::Create(*cache, po));
  }
  if (!o.kv_events_endpoint.empty()) {
    PAGEKV_ASSIGN_OR_RETURN(events, KvEventPublisher::Create(o.kv_events_endpoint));
    if (o.kv_events_wait_ms > 0) events->WaitForSubscriber(o.kv_events_wait_ms);
  }
  auto publish_events = [&]() -> Status {
    if (events == nullptr) return Status::Ok();
    const std::vector<KvEvent> batch = prefix_cache->DrainEvents();
    return events->Publish(batch);
  };
  auto release = [&](SeqId s) { return prefix_cache ? prefix_cache->Free(s) : cache->Free(s); };
  ForwardTimings timings;
  const ForwardOptions forward{o.threads, &timings};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<SeqId> seqs;
  std::vector<float> logits;
  if (lcp > 0) {
    const SeqId root = cache->AddSequence("shared prefix");
    const ForwardItem prefix{root, std::span<const int32_t>(ids[0]).subspan(0, lcp), nullptr, false};
    PAGEKV_ASSIGN_OR_RETURN(bool fit, ForwardStep(model, *cache, {&prefix, 1}, forward));
    if (!fit) return out_of_blocks();
    for (size_t i = 0; i < ids.size(); ++i) {
      PAGEKV_ASSIGN_OR_RETURN(SeqId s, cache->Fork(root, "prompt " + std::to_string(i + 1)));
      seqs.push_back(s);
    }
    track();
    PAGEKV_RETURN_IF_ERROR(cache->Free(root));
  } else if (!prefix_cache) {
    for (size_t i = 0; i < ids.size(); ++i) seqs.push_back(cache->AddSequence("prompt " + std::to_string(i + 1)));
  }

  // Eviction: one evictor per sequence, told of every step.
  std::vector<std::unique_ptr<TokenEvictor>> evictors(ids.size());
  if (evicting) {
    for (auto& e : evictors) {
      PAGEKV_ASSIGN_OR_RETURN(e, TokenEvictor::Create(o.eviction, layout));
    }
  }
  auto begin_step = [&](size_t i, ForwardItem& item, bool prompt_ends) {
    if (!evicting) return;
    const StepScores sc = evictors[i]->BeginStep(evictors[i]->cached(), static_cast<int64_t>(item.tokens.size()),
                                                 prompt_ends);
    item.scores = sc.scores;
    item.score_queries = sc.score_queries;
  };
  auto end_step = [&](size_t i) -> Status {
    return evicting ? evictors[i]->EndStep(*cache, seqs[i]) : Status::Ok();
  };

  // 2. The rest of every prompt in one step, then the first sampled token.
  std::vector<Sampler> samplers;
  const uint64_t run_seed = o.sampling.seed.has_value() ? 0 : Sampler::FreshSeed();  // unseeded: a fresh stream per run
  std::vector<int32_t> next(ids.size());
  std::vector<std::vector<int32_t>> history = ids;
  report.outputs.resize(ids.size());
  logits.assign(ids.size() * static_cast<size_t>(vocab), 0.0f);
  std::vector<ForwardItem> items;
  std::vector<size_t> start(ids.size(), lcp);  // the first position each prompt computes
  if (prefix_cache) seqs.assign(ids.size(), SeqId{});
  // Prefill steps: one (all prompts), or with the prefix cache two (prompt 1,
  // then the rest, which may hit what prompt 1 published).
  const size_t first_group = prefix_cache && ids.size() > 1 ? 1 : ids.size();
  for (auto [begin, end] : {std::pair<size_t, size_t>{0, first_group}, std::pair<size_t, size_t>{first_group, ids.size()}}) {
    if (begin == end) continue;
    items.clear();
    for (size_t i = begin; i < end; ++i) {
      GenerateOutput& out = report.outputs[i];
      out.prompt = o.prompts[i];
      out.prompt_ids = ids[i];
      SamplingOptions so = o.sampling;
      so.seed = o.sampling.seed.value_or(run_seed) + i;  // independent streams, reproducible per prompt
      samplers.emplace_back(so);
      if (prefix_cache) {
        PAGEKV_ASSIGN_OR_RETURN(PrefixCache::Admitted a,
                                prefix_cache->AddSequence(ids[i], extra, "prompt " + std::to_string(i + 1)));
        seqs[i] = a.seq;
        start[i] = static_cast<size_t>(a.match.num_tokens);
        st.prefix_hit_tokens += a.match.num_tokens;
        st.prefix_hit_blocks += static_cast<int64_t>(a.match.blocks.size());
      }
      const auto rest = std::span<const int32_t>(ids[i]).subspan(start[i]);
      if (cache->BlocksNeeded(seqs[i], static_cast<int64_t>(rest.size()))->copy_on_write) ++st.copy_on_write_blocks;
      st.prefill_tokens_computed += static_cast<int64_t>(rest.size());
      items.push_back({seqs[i], rest, logits.data() + i * static_cast<size_t>(vocab), false});
      begin_step(i, items.back(), true);
    }
    PAGEKV_ASSIGN_OR_RETURN(bool fit, ForwardStep(model, *cache, items, forward));
    if (!fit) return out_of_blocks();
    track();
    for (size_t i = begin; i < end; ++i) PAGEKV_RETURN_IF_ERROR(end_step(i));
    if (prefix_cache) {
      for (size_t i = begin; i < end; ++i) PAGEKV_RETURN_IF_ERROR(prefix_cache->Publish(seqs[i], ids[i]));
      PAGEKV_RETURN_IF_ERROR(publish_events());
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::span<const float> last(logits.data() + i * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
    if (o.top_logits > 0) report.outputs[i].step_top.push_back(TopK(last.data(), vocab, o.top_logits));
    next[i] = samplers[i].Sample(last, history[i]);
  }
  const auto t1 = std::chrono::steady_clock::now();
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  const ForwardTimings prefill_timings = timings;

  // 3. Decode: one step carries one token of every live sequence; each is
  //    freed the moment it is done (its length reached, or a stop token).
  std::vector<bool> done(ids.size(), false);
  std::vector<Utf8Stream> text_streams(ids.size());  // streamed text in whole characters
  auto finish = [&](size_t i) -> Status {
    done[i] = true;
    if (o.on_token) {
      if (std::string rest = text_streams[i].Finish(); !rest.empty()) o.on_token(i, rest);
    }
    return release(seqs[i]);
  };
  const int32_t longest = *std::max_element(max_new.begin(), max_new.end());
  for (int32_t k = 0; k < longest; ++k) {
    items.clear();
    std::vector<size_t> owner;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (done[i]) continue;
      GenerateOutput& out = report.outputs[i];
      const int32_t prev = history[i].back();
      if (stop_at_eos && std::find(stop_tokens.begin(), stop_tokens.end(), next[i]) != stop_tokens.end()) {
        out.stopped = true;
        PAGEKV_RETURN_IF_ERROR(finish(i));
        continue;
      }
      out.generated_ids.push_back(next[i]);
      history[i].push_back(next[i]);
      if (o.on_token) {
        if (std::string piece = text_streams[i].Push(tok.DecodePiece(prev, next[i])); !piece.empty()) o.on_token(i, piece);
      }
      if (k + 1 == max_new[i]) {
        PAGEKV_RETURN_IF_ERROR(finish(i));
        continue;
      }
      items.push_back({seqs[i], {&next[i], 1}, logits.data() + i * static_cast<size_t>(vocab), false});
      begin_step(i, items.back(), false);
      owner.push_back(i);
    }
    if (items.empty()) break;
    PAGEKV_ASSIGN_OR_RETURN(bool step_fit, ForwardStep(model, *cache, items, forward));
    if (!step_fit) return out_of_blocks();
    st.decode_tokens += static_cast<int64_t>(items.size());
    track();
    for (size_t i : owner) PAGEKV_RETURN_IF_ERROR(end_step(i));
    for (size_t i : owner) {
      if (prefix_cache) PAGEKV_RETURN_IF_ERROR(prefix_cache->Publish(seqs[i], history[i]));  // blocks as they fill
      const std::span<const float> step(logits.data() + i * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
      if (o.top_logits > 0) report.outputs[i].step_top.push_back(TopK(step.data(), vocab, o.top_logits));
      next[i] = samplers[i].Sample(step, history[i]);
    }
    PAGEKV_RETURN_IF_ERROR(publish_events());
  }
  st.decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  for (const auto& e : evictors) {  // each evictor keeps its counts after its sequence is freed
    if (e == nullptr) continue;
    st.tokens_evicted += e->stats().tokens_evicted;
    st.final_cached_tokens += e->cached();
  }
  if (events != nullptr) st.kv_event_batches = static_cast<int64_t>(events->batches_sent());
  if (prefix_cache) {
    const PrefixCacheStats ps = prefix_cache->Stats();
    st.prefix_blocks_published = ps.inserted;
    st.prefix_blocks_evicted = ps.evicted;
    st.host_hit_blocks = ps.tier_hit_blocks[static_cast<int>(Tier::kHost)];
    st.disk_hit_blocks = ps.tier_hit_blocks[static_cast<int>(Tier::kDisk)];
    st.redis_hit_blocks = ps.tier_hit_blocks[static_cast<int>(Tier::kRedis)];
  }
  if (tiers) {
    tiers->Drain();  // written through before we report (and before exit)
    for (const TierStats& t : tiers->Stats().tiers) st.tier_errors += t.errors + t.corrupt;
  }
  st.prefill_attention_seconds = prefill_timings.attention;
  st.decode_attention_seconds = timings.attention - prefill_timings.attention;
  st.decode_matmul_seconds = timings.matmul - prefill_timings.matmul;
  st.peak_bytes = st.peak_blocks_used * st.bytes_per_block;
  st.peak_utilization = static_cast<double>(st.peak_blocks_used) / static_cast<double>(st.blocks_total);
  for (size_t i = 0; i < ids.size(); ++i) {
    report.outputs[i].text = tok.Decode(history[i]);
    report.outputs[i].completion = SanitizeUtf8(tok.Decode(report.outputs[i].generated_ids));
  }
  return report;
}

}  // namespace pagekv
