// The scheduler of the serving engine: it owns the waiting and running
// queues and decides, each step, which sequences run with how many tokens,
// within a per-step token budget. It never touches tensors; its output is a
// plain value (StepPlan) the engine turns into a batch.
//
// Running sequences come first (one decode token, or the next chunk of a
// prompt); then waiting ones are admitted, preempted ones first, while the
// cache has the blocks (it asks before it acts, and keeps a watermark of free
// blocks). Paged admission takes a request only when its whole prompt fits
// beside the blocks running prompts still need, with one more free block per
// running sequence for its next token's block. When a running sequence needs
// a block that does not exist, the lowest-priority, most recently admitted
// running sequence is preempted: its blocks are freed and it waits to be
// recomputed. Contiguous allocation (for comparison) reserves prompt +
// max_tokens blocks at admission and never preempts.
//
// With background tier moves, a request whose prefix continues in RAM, on
// disk or in Redis is admitted with its blocks reserved and waits in a
// loading list while the tiers' threads fill them; the plan after the last
// load answers moves it to the running queue (with what was loaded, the
// rest to compute). Each plan also has the cached blocks that the next
// step would evict copied down while this one computes.
//
// Thread safety: one thread (the engine's stepping thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "pagekv/eviction.h"
#include "pagekv/ids.h"
#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"

namespace pagekv {

// One request as the scheduler sees it (the engine's request extends it).
struct Sequence {
  virtual ~Sequence() = default;
  int64_t id = 0;
  int32_t priority = 0;        // higher runs first and is preempted last
  int32_t max_tokens = 0;      // what the contiguous allocator reserves for
  ExtraKeys extra;             // prefix-cache keys
  std::vector<int32_t> tokens; // prompt, then generated
  int64_t prompt_len = 0;
  int64_t computed = 0;        // tokens whose KV is in the cache
  std::optional<SeqId> seq;    // while running
  int64_t admit_order = -1;
  int64_t reserved_blocks = 0; // contiguous allocator
  bool preempted = false;
  bool admitted_once = false;
  bool prefetched = false;     // lower-tier hits requested ahead of admission
  bool no_prefix_hits = false; // computes its whole prompt (its prompt logits are wanted)
  // A group's root prefills the common prefix for its members and samples
  // nothing; a member waits, out of the queues, until Fork.
  bool root = false;
  bool awaiting_fork = false;
  std::unique_ptr<TokenEvictor> evictor;  // token eviction, while running
  // Counters for the request's result.
  int64_t cached_prompt_tokens = 0;  // found in the prefix cache at first admission
  int64_t forked_prompt_tokens = 0;
  int64_t preemptions = 0;
  int64_t tokens_evicted = 0;
  int64_t final_kv_tokens = 0;       // tokens its sequence held when last released

  int64_t remaining() const { return static_cast<int64_t>(tokens.size()) - computed; }
};

struct SchedulerOptions {
  int64_t max_step_tokens = 256;  // tokens per step over all sequences (chunked prefill)
  int32_t max_running = 256;      // sequences per step
  bool paged = true;              // else contiguous reservations
  int32_t block_len = 16;
  int64_t watermark = 0;          // free blocks kept at admission
  EvictionOptions eviction;       // token eviction per admitted sequence (paged, no prefix cache)
  bool prefetch = false;          // ask the prefix cache's tiers for the next waiting prompts
  // With the prefix cache's tiers: a request whose prefix continues in a
  // lower tier waits, out of the running queue, while the tiers' threads
  // load it into its reserved blocks (other sequences' steps go on), and
  // the cached blocks the next steps would evict are copied down during
  // this one. false: loads on admission and copies on eviction, in line.
  bool background_tier_moves = false;
};

// One step's plan: which sequences run with how many tokens, and who was
// preempted to make room (their blocks freed, back at the head of the queue).
struct StepPlan {
  struct Item {
    Sequence* seq = nullptr;
    int64_t count = 0;
    bool samples = false;  // the step completes what the sequence has: a token is sampled
  };
  std::vector<Item> items;
  std::vector<Sequence*> preempted;
  // Background tier moves this plan started: sequences admitted to load
  // their prefix (they run once loaded), and cached blocks being copied
  // down ahead of their eviction.
  std::vector<Sequence*> loading;
  int64_t offloads = 0;
};

class Scheduler {
 public:
  // `prefix` may be null (no prefix cache); both must outlive the scheduler.
  Scheduler(const SchedulerOptions& options, KvCache& cache, PrefixCache* prefix);

  // Queues a sequence to be admitted (by priority, after preempted ones).
  void Enqueue(Sequence* s);
  StepPlan Plan();
  // Frees a sequence's KV and takes it out of the queues (it finished, was
  // cancelled or failed).
  void Remove(Sequence* s);
  // A root whose prefix is computed: every member gets a fork of its
  // sequence and runs from there; the root is removed.
  void Fork(Sequence* root, std::span<Sequence* const> members);

  const std::vector<Sequence*>& running() const { return running_; }
  // Admitted, their prefix loading from a lower tier (background_tier_moves).
  const std::vector<Sequence*>& loading() const { return loading_; }
  // Waits (up to `timeout`) for a background tier move to finish.
  void WaitForLoads(std::chrono::milliseconds timeout);
  const std::deque<Sequence*>& waiting() const { return waiting_; }
  // Slots of the running sequences: tokens stored, and (contiguous) reserved.
  int64_t StoredTokens() const;
  int64_t ReservedSlots() const;

  // Aborts with a message when the queues and the cache disagree: every
  // running sequence holds a sequence of its computed length, no waiting one
  // holds any, the cache holds no other.
  void CheckInvariants() const;

 private:
  // Blocks a sequence of `tokens` tokens holds over its cache groups (a
  // hybrid cache's sliding groups only their window's).
  int64_t BlocksFor(int64_t tokens) const { return cache_.layout().BlocksHeld(tokens, o_.max_step_tokens); }
  int64_t Outstanding() const;  // blocks contiguous sequences reserved but do not hold yet
  void Release(Sequence* s);
  void Preempt(Sequence* s, StepPlan& plan);
  void TakeLoaded();
  void Admitted(Sequence* s);

  SchedulerOptions o_;
  KvCache& cache_;
  PrefixCache* prefix_;
  std::deque<Sequence*> waiting_;   // preempted first, then by priority, then arrival
  std::vector<Sequence*> running_;  // by priority (high first), then admission order
  std::vector<Sequence*> loading_;  // admission order
  int64_t admit_counter_ = 0;
};

}  // namespace pagekv
