// Scheduler (scheduler.h): admission, preemption, the step plan.
#include "scheduler/scheduler.h"

#include <algorithm>
#include <string>

#include "base/check.h"

namespace pagekv {

Scheduler::Scheduler(const SchedulerOptions& options, KvCache& cache, PrefixCache* prefix)
    : o_(options), cache_(cache), prefix_(prefix) {}

void Scheduler::Enqueue(Sequence* s) {
  auto at = std::find_if(waiting_.begin(), waiting_.end(),
                         [&](const Sequence* w) { return !w->preempted && w->priority < s->priority; });
  waiting_.insert(at, s);
}

int64_t Scheduler::Outstanding() const {
  int64_t n = 0;
  for (const Sequence* s : running_) n += s->reserved_blocks - static_cast<int64_t>((*cache_.View(*s->seq)).blocks.size());
  return n;
}

void Scheduler::Release(Sequence* s) {
  if (!s->seq) return;
  if (s->evictor) {
    s->tokens_evicted += s->evictor->stats().tokens_evicted;
    s->final_kv_tokens = s->evictor->cached();
  } else {
    s->final_kv_tokens = s->computed;
  }
  PAGEKV_CHECK((prefix_ ? prefix_->Free(*s->seq) : cache_.Free(*s->seq)).ok());
  s->seq.reset();
  s->evictor.reset();
}

void Scheduler::Preempt(Sequence* s, StepPlan& plan) {
  Release(s);
  s->computed = 0;
  s->reserved_blocks = 0;
  s->preempted = true;
  ++s->preemptions;
  running_.erase(std::find(running_.begin(), running_.end(), s));
  waiting_.push_front(s);
  plan.preempted.push_back(s);
}

void Scheduler::Remove(Sequence* s) {
  Release(s);  // a loading sequence's Free waits for its loads
  if (auto it = std::find(running_.begin(), running_.end(), s); it != running_.end()) running_.erase(it);
  if (auto it = std::find(loading_.begin(), loading_.end(), s); it != loading_.end()) loading_.erase(it);
  if (auto it = std::find(waiting_.begin(), waiting_.end(), s); it != waiting_.end()) waiting_.erase(it);
}

void Scheduler::Fork(Sequence* root, std::span<Sequence* const> members) {
  for (Sequence* m : members) {
    m->seq = *cache_.Fork(*root->seq, "request " + std::to_string(m->id));
    m->computed = root->computed;
    m->awaiting_fork = false;
    m->admitted_once = true;
    m->forked_prompt_tokens = root->computed;
    m->admit_order = admit_counter_++;
    running_.push_back(m);
  }
  Remove(root);
}

void Scheduler::Admitted(Sequence* s) {
  if (!s->admitted_once) {
    s->cached_prompt_tokens = s->computed;
    s->admitted_once = true;
  }
}

void Scheduler::TakeLoaded() {
  if (prefix_ == nullptr || loading_.empty()) return;
  for (const PrefixCache::Loaded& l : prefix_->TakeLoaded()) {
    auto it = std::find_if(loading_.begin(), loading_.end(), [&](const Sequence* s) { return *s->seq == l.seq; });
    PAGEKV_CHECK_MSG(it != loading_.end(), "the prefix cache finished loading a sequence of no request");
    Sequence* s = *it;
    loading_.erase(it);
    s->computed = l.num_tokens;
    Admitted(s);
    running_.push_back(s);  // admit_order from its admission: sorted into place below
  }
}

void Scheduler::WaitForLoads(std::chrono::milliseconds timeout) {
  if (prefix_ != nullptr && !loading_.empty()) prefix_->WaitForBackground(timeout);
}

StepPlan Scheduler::Plan() {
  TakeLoaded();
  StepPlan plan;
  int64_t budget = o_.max_step_tokens;
  int64_t planned_blocks = 0;
  const bool paged = o_.paged;
  int64_t outstanding = paged ? 0 : Outstanding();
  auto available = [&] { return cache_.FreeBlockCount() - planned_blocks - outstanding; };
  auto add = [&](Sequence* s, int64_t n) {
    plan.items.push_back({s, n, !s->root && s->computed + n == static_cast<int64_t>(s->tokens.size())});
    budget -= n;
  };
  std::stable_sort(running_.begin(), running_.end(), [](const Sequence* a, const Sequence* b) {
    return a->priority != b->priority ? a->priority > b->priority : a->admit_order < b->admit_order;
  });
  // 1. Running sequences: a decode token or the next prompt chunk each.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* s = running_[i];
    const int64_t n = std::min(s->remaining(), budget);
    const int64_t need = (*cache_.BlocksNeeded(*s->seq, n)).total();
    bool preempted_self = false;
    if (paged) {
      while (available() < need) {
        Sequence* victim = running_.back();  // lowest priority, most recently admitted
        preempted_self = victim == s;
        Preempt(victim, plan);
        if (preempted_self) break;
      }
    } else {
      outstanding -= need;  // contiguous: comes out of its reservation
    }
    if (preempted_self) continue;
    add(s, n);
    planned_blocks += need;
    ++i;
  }
  // Paged: the blocks the running sequences still need for tokens they
  // already have (the rest of a prompt prefilled in chunks) stay out of
  // admission's reach, and a new request is admitted only when its whole
  // prompt fits beside them: admitting on its first chunk alone would
  // preempt someone a step later to make room for the rest.
  int64_t owed = 0;
  if (paged) {
    for (const Sequence* s : running_) {
      int64_t n = 0;
      for (const StepPlan::Item& p : plan.items) n = p.seq == s ? p.count : n;
      owed += std::max<int64_t>(0, BlocksFor(static_cast<int64_t>(s->tokens.size())) - BlocksFor(s->computed + n));
    }
    for (const Sequence* s : loading_) {  // its reservation covers the loads; the rest is owed
      owed += std::max<int64_t>(0, BlocksFor(static_cast<int64_t>(s->tokens.size())) -
                                       static_cast<int64_t>((*cache_.View(*s->seq)).blocks.size()));
    }
  }
  // 2. Admission, in queue order, while the blocks exist (ask, then act).
  while (budget > 0 && static_cast<int64_t>(running_.size() + loading_.size()) < o_.max_running && !waiting_.empty()) {
    Sequence* s = waiting_.front();
    PrefixMatch match;
    int64_t need;
    if (paged) {
      if (prefix_) match = *prefix_->Lookup(s->tokens, s->extra, s->no_prefix_hits ? 0 : -1);
      int64_t claimed = 0;
      const std::vector<BlockId> hit = match.AllBlocks();  // a hybrid cache's: every group's
      for (BlockId b : hit) claimed += cache_.BlockRefCount(b) == 0 ? 1 : 0;
      const int64_t n = std::min(static_cast<int64_t>(s->tokens.size()) - match.num_tokens, budget);
      need = std::max<int64_t>(0, BlocksFor(match.num_tokens + n) - static_cast<int64_t>(hit.size())) + claimed;
      const int64_t rest = BlocksFor(static_cast<int64_t>(s->tokens.size())) - BlocksFor(match.num_tokens + n);
      // Beyond the watermark, one free block per running sequence: each
      // may need its next block before the admission after this one, and
      // taking it from the newcomer by preemption costs a recomputation
      // (2,000-request Azure run: preemptions 426 -> 94, PERFORMANCE.md).
      const int64_t headroom = o_.watermark + static_cast<int64_t>(running_.size());
      if (available() - owed - need - rest < headroom) break;
      owed += rest;
    } else {
      need = BlocksFor(s->prompt_len + s->max_tokens);
    }
    if (available() - need < o_.watermark) break;
    if (prefix_) {
      const int64_t free_before = cache_.FreeBlockCount();
      PrefixCache::Admitted a = *prefix_->AddSequence(s->tokens, s->extra, "request " + std::to_string(s->id),
                                                      s->no_prefix_hits ? 0 : -1, o_.background_tier_moves);
      s->seq = a.seq;
      s->computed = a.match.num_tokens;
      if (a.loading_blocks > 0) {
        // It runs once loaded: the blocks it took are out of the free count
        // already, and nothing of it is planned this step.
        planned_blocks += need - (free_before - cache_.FreeBlockCount());
        planned_blocks = std::max<int64_t>(planned_blocks, 0);
        s->preempted = false;
        s->admit_order = admit_counter_++;
        waiting_.pop_front();
        loading_.push_back(s);
        plan.loading.push_back(s);
        continue;
      }
    } else {
      s->seq = cache_.AddSequence("request " + std::to_string(s->id));
      s->computed = 0;
      if (o_.eviction.policy != EvictionPolicy::kNone) {
        s->evictor = std::move(*TokenEvictor::Create(o_.eviction, cache_.layout()));  // validated by the engine
      }
    }
    Admitted(s);
    const int64_t n = std::min(s->remaining(), budget);
    if (paged) {
      planned_blocks += need;
    } else {
      // Reserve the whole request; the first chunk's blocks move from the
      // reservation to this step's plan.
      s->reserved_blocks = need;
      outstanding += need - BlocksFor(n);
      planned_blocks += BlocksFor(n);
    }
    s->preempted = false;
    s->admit_order = admit_counter_++;
    waiting_.pop_front();
    running_.push_back(s);
    add(s, n);
  }
  // 3. Background copies: the cached blocks the next step would evict (past
  // those this step's reservations take), so that their evictions copy
  // nothing on the allocation path.
  if (prefix_ && paged && o_.background_tier_moves) {
    const int64_t plain_free = cache_.FreeBlockCount() - cache_.CachedFreeBlockCount();
    const int64_t evicted_now = std::max<int64_t>(0, planned_blocks - plain_free);
    const int64_t next_step = BlocksFor(o_.max_step_tokens) + static_cast<int64_t>(running_.size());
    const int64_t evicted_next = std::max<int64_t>(0, next_step - std::max<int64_t>(0, plain_free - planned_blocks));
    plan.offloads = prefix_->OffloadAhead(evicted_now, evicted_next);
  }
  // 4. The next few waiting requests: fetch their lower-tier blocks from
  // disk or Redis while this step computes.
  if (prefix_ && o_.prefetch) {
    int n = 0;
    for (auto it = waiting_.begin(); it != waiting_.end() && n < 4; ++it, ++n) {
      if ((*it)->prefetched || (*it)->no_prefix_hits) continue;
      (*it)->prefetched = true;
      prefix_->Prefetch((*it)->tokens, (*it)->extra);
    }
  }
  return plan;
}

int64_t Scheduler::StoredTokens() const {
  int64_t n = 0;
  for (const Sequence* s : running_) n += s->evictor ? s->evictor->cached() : s->computed;
  return n;
}

int64_t Scheduler::ReservedSlots() const {
  int64_t n = 0;
  for (const Sequence* s : running_) n += s->reserved_blocks * o_.block_len;
  return n;
}

void Scheduler::CheckInvariants() const {
  int64_t sequences = 0;
  for (const Sequence* s : running_) {
    PAGEKV_CHECK_MSG(s->seq.has_value(), "a running request has no sequence");
    const SequenceView view = *cache_.View(*s->seq);  // evicted tokens were computed, then dropped
    PAGEKV_CHECK_MSG(view.num_tokens + view.evicted == s->computed, "a running request's KV length disagrees");
    PAGEKV_CHECK_MSG(!s->awaiting_fork, "a member awaiting its fork is running");
    if (s->evictor) {
      s->evictor->CheckInvariants();
      PAGEKV_CHECK_MSG(s->evictor->cached() == view.num_tokens, "an evictor's slots disagree with its sequence");
    }
    ++sequences;
  }
  for (const Sequence* s : loading_) {
    PAGEKV_CHECK_MSG(s->seq.has_value(), "a loading request has no sequence");
    PAGEKV_CHECK_MSG(std::find(running_.begin(), running_.end(), s) == running_.end(), "a loading request is running");
    ++sequences;
  }
  for (const Sequence* s : waiting_) {
    PAGEKV_CHECK_MSG(!s->seq.has_value(), "a waiting request holds a sequence");
    PAGEKV_CHECK_MSG(!s->awaiting_fork, "a member awaiting its fork is queued");
  }
  PAGEKV_CHECK_MSG(cache_.num_sequences() == sequences, "the cache holds sequences of no running request");
}

}  // namespace pagekv
