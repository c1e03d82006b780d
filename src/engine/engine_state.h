// The engine's state (Engine::State) and one request's record, shared by
// the engine's source files (engine.cc: creation, submission, the step
// loop; engine_text.cc: tokenizer and chat accessors). Internal to
// src/engine.
#pragma once

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
#include "engine/agreed_tiers.h"
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

namespace pagekv {

namespace engine_detail {

using Clock = std::chrono::steady_clock;


// One request's life in the engine: the scheduler's sequence, and what the
// engine keeps for the request (its callbacks, sampler, text, result).
struct Seq : Sequence {
  EngineRequest req;
  std::vector<RequestId> members;  // a SubmitShared root: its members
  Sampler sampler;
  std::string text;             // generated text
  size_t streamed = 0;          // bytes of text already sent
  size_t logprobs_sent = 0;     // generated tokens whose log-probability an update carried
  Clock::time_point submitted, first_token, last_token;
  std::optional<Clock::time_point> scheduled;  // first in a step (a fork member: its root's)
  RequestResult result;

  Seq(RequestId i, EngineRequest r) : req(std::move(r)), sampler(req.sampling) {
    id = i;
    priority = req.priority;
    max_tokens = req.max_tokens;
    extra = req.extra;
    no_prefix_hits = req.prompt_logits;
  }
};

// Generated token i of r with its log-probability and top alternatives.
inline TokenLogprob TokenLogprobAt(const RequestResult& r, size_t i) {
  TokenLogprob lp{r.tokens[i], r.token_logprobs[i], {}};
  if (i < r.step_top.size()) {
    for (const auto& [id, logit] : r.step_top[i]) lp.top.emplace_back(id, logit - r.step_logsumexp[i]);
  }
  return lp;
}

// log(sum(exp(logits))), in double around the maximum.
inline double LogSumExp(std::span<const float> logits) {
  float top = -std::numeric_limits<float>::infinity();
  for (float l : logits) top = std::max(top, l);
  if (!std::isfinite(top)) return top;
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - static_cast<double>(top));
  return static_cast<double>(top) + std::log(sum);
}

inline std::vector<std::pair<int32_t, float>> TopK(std::span<const float> logits, int32_t k) {
  const auto n = static_cast<int32_t>(logits.size());
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = i;
  k = std::min(k, n);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
           (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
  });
  std::vector<std::pair<int32_t, float>> out;
  for (int32_t i = 0; i < k; ++i) out.emplace_back(ids[static_cast<size_t>(i)], logits[static_cast<size_t>(ids[static_cast<size_t>(i)])]);
  return out;
}

}  // namespace engine_detail

// The engine's files use these unqualified.
using engine_detail::Clock;
using engine_detail::LogSumExp;
using engine_detail::Seq;
using engine_detail::TokenLogprobAt;
using engine_detail::TopK;

struct Engine::State {
  EngineOptions o;
  LoadedModel m;
  std::optional<ChatTemplate> chat;  // when the model has a template or one was named
  Status chat_error = Status::Ok();  // why there is none
  std::vector<int32_t> stop_tokens;
  std::unique_ptr<Backend> device;    // EngineOptions::device's backend (null: the CPU); outlives the cache
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<BlockTiers> tiers;  // outlives prefix, which calls it
  std::unique_ptr<AgreedTiers> agreed;  // sharded: what prefix calls, over tiers
  std::unique_ptr<PrefixCache> prefix;
  std::string fingerprint;            // of the model file, with tiers
  std::unique_ptr<KvEventPublisher> events;  // with kv_events.endpoint
  int64_t watermark = 0;
  ForwardTimings timings;             // stepping thread; copied into metrics
  int64_t peak_blocks = 0;

  // Shared with submitting threads.
  mutable std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<std::unique_ptr<Seq>> inbox;
  std::vector<RequestId> cancels;
  std::map<RequestId, RequestResult> results;
  std::unordered_map<RequestId, bool> known;  // submitted and not yet waited for: finished?
  RequestId next_id = 1;
  EngineMetrics metrics;
  int64_t queued = 0;  // inbox + waiting
  bool stopping = false;
  bool reset_requested = false;  // ResetPrefixCache, for the loop's next step
  // Serving split over ranks (EngineOptions::parallel_leader): rank 0 leads
  // (sends each step's inputs), the others follow (take them).
  bool lead = false, follow = false;
  bool follow_stopped = false;  // a follower got the leader's stop
  bool stop_sent = false;       // the leader told its followers to stop
  uint64_t resets_done = 0;
  Status reset_status = Status::Ok();
  std::vector<SequenceInfo> sequences;  // built each step (stepping thread), swapped into metrics
  std::thread loop;

  // Stepping thread only.
  std::unordered_map<RequestId, std::unique_ptr<Seq>> live;
  std::unique_ptr<Scheduler> sched;
  std::mutex step_mu;        // one Step at a time

  void Emit(Seq* s, int32_t token, FinishReason finish) {
    if (!s->req.on_update) return;
    // Hold back text that may be the start of a stop string.
    size_t safe = s->text.size();
    if (finish == FinishReason::kNone) {
      for (const std::string& stop : s->req.stop) {
        for (size_t k = std::min(stop.size() - 1, s->text.size()); k > 0; --k) {
          if (s->text.compare(s->text.size() - k, k, stop, 0, k) == 0) {
            safe = std::min(safe, s->text.size() - k);
            break;
          }
        }
      }
    }
    if (finish == FinishReason::kNone) {
      // Nor the first bytes of a character a later token completes.
      for (size_t k = 1; k <= 3 && k <= safe; ++k) {
        const auto c = static_cast<unsigned char>(s->text[safe - k]);
        if ((c & 0xC0) == 0x80) continue;
        const size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        if (want > k) safe -= k;
        break;
      }
    }
    TokenUpdate u{s->id, token,
                  SanitizeUtf8(s->text.substr(std::min(s->streamed, safe), safe > s->streamed ? safe - s->streamed : 0)),
                  finish};
    s->streamed = std::max(s->streamed, safe);
    if (s->req.logprobs) {
      // The generated tokens not reported yet (an EOS that ended the
      // request is not one of them, as in the result).
      const RequestResult& r = s->result;
      const size_t have = std::min(r.tokens.size(), r.token_logprobs.size());
      for (; s->logprobs_sent < have; ++s->logprobs_sent) u.logprobs.push_back(TokenLogprobAt(r, s->logprobs_sent));
    }
    s->req.on_update(u);
  }

  // A root's end: its sequence freed, itself forgotten (it has no result).
  void Retire(Seq* s) {
    sched->Remove(s);
    live.erase(s->id);
    std::lock_guard lock(mu);
    --queued;
  }

  // A root that computed the common prefix: every member still alive gets
  // a fork of its sequence and runs from there.
  void ForkMembers(Seq* root) {
    std::vector<Sequence*> members;
    for (RequestId id : root->members) {
      if (auto it = live.find(id); it != live.end()) {
        members.push_back(it->second.get());  // else cancelled meanwhile
        it->second->scheduled = root->scheduled;
      }
    }
    sched->Fork(root, members);
    live.erase(root->id);
    std::lock_guard lock(mu);
    --queued;
  }

  // `last_token`: the token that ended it, when it is part of the output
  // (a length or stop-string end), reported in the final update.
  void Finish(Seq* s, FinishReason reason, Status error = Status::Ok(), int32_t last_token = -1) {
    if (s->root) {  // its members end the same way
      const std::vector<RequestId> members = s->members;
      Retire(s);
      for (RequestId id : members) {
        if (auto it = live.find(id); it != live.end()) Finish(it->second.get(), reason, error);
      }
      return;
    }
    sched->Remove(s);
    s->result.cached_prompt_tokens = s->cached_prompt_tokens;
    s->result.forked_prompt_tokens = s->forked_prompt_tokens;
    s->result.preemptions = s->preemptions;
    s->result.tokens_evicted = s->tokens_evicted;
    s->result.final_kv_tokens = s->final_kv_tokens;
    // The request's phases, in seconds: waiting, prompt, generation, whole.
    const auto now = Clock::now();
    auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    const Clock::time_point started = s->scheduled.value_or(now);
    s->result.queue_time = seconds(started - s->submitted);
    if (!s->result.tokens.empty()) {
      s->result.prefill_time = std::max(0.0, seconds(s->first_token - started));
      s->result.decode_time = seconds(s->last_token - s->first_token);
    } else {
      s->result.prefill_time = seconds(now - started);
    }
    s->result.e2e_time = seconds(now - s->submitted);
    s->result.finish = reason;
    s->result.error = std::move(error);
    s->result.text = SanitizeUtf8(s->text);
    {
      // Out of the running batch and the counts the metrics show before its
      // answer goes out: whoever reads the metrics after the answer
      // (llama-server's /slots, a /metrics scrape) no longer sees it
      // running or waiting; the step's Snapshot refreshes the rest.
      std::lock_guard lock(mu);
      std::erase_if(metrics.sequences, [&](const SequenceInfo& q) { return q.id == s->id; });
      metrics.running = static_cast<int64_t>(sched->running().size());
      metrics.loading = static_cast<int64_t>(sched->loading().size());
      --queued;
    }
    Emit(s, last_token, reason);
    std::unique_ptr<Seq> owned = std::move(live.at(s->id));
    live.erase(s->id);
    std::lock_guard lock(mu);
    ++metrics.finished;
    if (follow) {
      known.erase(s->id);  // no one waits on a follower's results
    } else {
      results[s->id] = std::move(s->result);
      known[s->id] = true;
    }
    done_cv.notify_all();
  }

  // Queues one checked request (mu held); a root has no result to wait for.
  RequestId EnqueueLocked(EngineRequest r, bool awaiting_fork, bool root = false) {
    if (tiers && r.extra.model_fingerprint.empty()) r.extra.model_fingerprint = fingerprint;
    // A leader's followers must sample as it does: an unseeded request gets
    // its seed here, and it travels with the request.
    if (lead && !r.sampling.seed) r.sampling.seed = Sampler::FreshSeed();
    const RequestId id = next_id++;
    auto s = std::make_unique<Seq>(id, std::move(r));
    s->tokens = s->req.prompt;
    s->prompt_len = static_cast<int64_t>(s->tokens.size());
    s->submitted = Clock::now();
    s->result.id = id;
    s->result.prompt_tokens = s->prompt_len;
    s->awaiting_fork = awaiting_fork;
    s->root = root;
    inbox.push_back(std::move(s));
    if (!root) known[id] = false;
    ++queued;
    return id;
  }

  // Moves new requests into the waiting queue and applies cancellations.
  void TakeInbox() {
    std::vector<std::unique_ptr<Seq>> fresh;
    std::vector<RequestId> cancel;
    bool reset = false;
    GrabInputs(reset, fresh, cancel);
    Admit(std::move(fresh), std::move(cancel));
  }

  // What arrived since the last step: the reset request, new requests and
  // cancellations, taken at once.
  void GrabInputs(bool& reset, std::vector<std::unique_ptr<Seq>>& fresh, std::vector<RequestId>& cancel) {
    std::lock_guard lock(mu);
    reset = reset_requested;
    reset_requested = false;
    while (!inbox.empty()) {
      fresh.push_back(std::move(inbox.front()));
      inbox.pop_front();
    }
    cancel.swap(cancels);
  }

  // A step's inputs, leader to followers (msgpack; engine_parallel.cc).
  Status SendInputs(bool reset, const std::vector<std::unique_ptr<Seq>>& fresh, const std::vector<RequestId>& cancel, bool stop);
  // A follower: the leader's next inputs into the inbox, cancellations and
  // reset request, as if submitted here; `stop` when the leader stopped.
  Status ReceiveInputs(bool& stop);

  void Admit(std::vector<std::unique_ptr<Seq>> fresh, std::vector<RequestId> cancel) {
    for (auto& f : fresh) {
      Seq* s = f.get();
      live.emplace(s->id, std::move(f));
      if (s->awaiting_fork) continue;  // its root brings it in
      sched->Enqueue(s);
    }
    for (RequestId id : cancel) {
      if (auto it = live.find(id); it != live.end()) Finish(it->second.get(), FinishReason::kCancelled);
    }
  }

  // Refreshes the metrics snapshot readers see.
  // The prefix cache's keys dropped (step_mu held), the event published.
  Status ResetPrefixNow() {
    prefix->Clear();
    if (events) return events->Publish(prefix->DrainEvents());
    return Status::Ok();
  }

  void Snapshot() {
    // O(running) per step: the pool's counters, and the running sequences'
    // lengths (exactly the cache's sequences, CheckInvariants says).
    const int64_t total = cache->layout().num_blocks(), free = cache->FreeBlockCount();
    const int64_t stored = sched->StoredTokens(), reserved = sched->ReservedSlots();
    sequences.clear();
    int64_t links = 0, consecutive = 0;
    for (const Sequence* q : sched->running()) {
      if (q->seq) {
        const Result<SequenceView> view = cache->View(*q->seq);
        if (view.ok()) {
          const std::span<const BlockId> b = view->blocks;
          for (size_t i = 1; i < b.size(); ++i) consecutive += ToInt(b[i]) == ToInt(b[i - 1]) + 1 ? 1 : 0;
          links += b.empty() ? 0 : static_cast<int64_t>(b.size()) - 1;
        }
      }
      if (q->root) continue;  // a group's prefill, not a request
      const int64_t generated_tokens = static_cast<int64_t>(q->tokens.size()) - q->prompt_len;
      sequences.push_back({static_cast<RequestId>(q->id), q->prompt_len, std::max<int64_t>(0, generated_tokens), q->computed,
                           (q->computed + o.block_len - 1) / o.block_len, q->computed < q->prompt_len, q->priority});
    }
    std::lock_guard lock(mu);
    metrics.sequences.swap(sequences);
    EngineMetrics& mx = metrics;
    ++mx.steps;  // (generated_tokens: counted as each token is accepted, in Accept)
    mx.blocks_total = total;
    mx.blocks_used = total - free;
    mx.blocks_free = free;
    mx.blocks_cached = cache->CachedFreeBlockCount();
    mx.running = static_cast<int64_t>(sched->running().size());
    mx.loading = static_cast<int64_t>(sched->loading().size());
    mx.waiting = queued - mx.running - mx.loading;
    mx.tokens_stored = stored;
    mx.slots_reserved = o.allocator == Allocator::kContiguous ? reserved : mx.blocks_used * o.block_len;
    mx.peak_blocks_used = peak_blocks;
    mx.copy_on_write_blocks = cache->CopyOnWriteCount();
    mx.table_contiguity = links > 0 ? static_cast<double>(consecutive) / static_cast<double>(links) : 1.0;
    mx.forward_seconds = timings.total;
    mx.attention_seconds = timings.attention;
    mx.matmul_seconds = timings.matmul;
    mx.communication_seconds = timings.communication;
    if (events) mx.kv_event_batches = static_cast<int64_t>(events->batches_sent());
    if (prefix) mx.prefix = prefix->Stats();
  }

  // Appends a sampled token; returns how the request ends (kNone: it goes on).
  FinishReason Accept(Seq* s, int32_t token) {
    const auto now = Clock::now();
    {
      // Counted before the token (or the answer it ends) can reach a
      // client: whoever reads the metrics after an answer sees its tokens.
      std::lock_guard lock(mu);
      ++metrics.generated_tokens;
      if (s->result.tokens.empty()) metrics.prompt_tokens += s->prompt_len;  // a prompt counts once its first token is out
    }
    if (s->result.tokens.empty()) {
      s->first_token = now;
      s->result.time_to_first_token = std::chrono::duration<double>(now - s->submitted).count();
    } else {
      s->result.inter_token.push_back(std::chrono::duration<double>(now - s->last_token).count());
    }
    s->last_token = now;
    if (!s->req.ignore_eos && std::find(stop_tokens.begin(), stop_tokens.end(), token) != stop_tokens.end()) {
      return FinishReason::kEos;
    }
    const int32_t prev = s->tokens.back();
    s->tokens.push_back(token);
    s->result.tokens.push_back(token);
    s->text += m.tokenizer->DecodePiece(prev, token);
    for (const std::string& stop : s->req.stop) {
      if (const size_t at = s->text.find(stop); at != std::string::npos) {
        s->text.resize(at);
        return FinishReason::kStop;
      }
    }
    const auto n = static_cast<int64_t>(s->result.tokens.size());
    if (n >= s->req.max_tokens) return FinishReason::kLength;
    if (s->req.stop_at_tokens > 0 && n >= s->req.stop_at_tokens) return FinishReason::kEos;
    return FinishReason::kNone;
  }
};

}  // namespace pagekv
