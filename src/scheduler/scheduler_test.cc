// The scheduler on a real KvCache, without a model: the plan it returns for
// budgets, priorities, pool pressure, contiguous reservations and forks, the
// engine's part (computing the planned tokens) played by Reserve.
#include "scheduler/scheduler.h"

#include <memory>
#include <vector>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

std::unique_ptr<KvCache> MakeCache(int64_t blocks, int32_t block_len = 8) {
  CacheConfig c;
  c.num_layers = 1;
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.block_len = block_len;
  c.format = KvFormat::Plain(DType::kF32);
  c.num_blocks = blocks;
  auto cache = KvCache::Create({.config = c, .huge_pages = false, .prefault = false});
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return std::move(*cache);
}

std::unique_ptr<Sequence> MakeSeq(int64_t id, int64_t prompt, int32_t priority = 0, int32_t max_tokens = 8) {
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->priority = priority;
  s->max_tokens = max_tokens;
  s->tokens.assign(static_cast<size_t>(prompt), 7);
  s->prompt_len = prompt;
  return s;
}

// What the engine does with a plan: reserve the planned slots and count them
// computed; a sampling item appends one generated token.
void Execute(KvCache& cache, const StepPlan& plan) {
  for (const StepPlan::Item& p : plan.items) {
    ASSERT_TRUE(*cache.Reserve(*p.seq->seq, p.count));
    p.seq->computed += p.count;
    if (p.samples) p.seq->tokens.push_back(3);
  }
}

TEST(SchedulerTest, RunningFirstThenAdmissionWithinTheTokenBudget) {
  auto cache = MakeCache(64);
  SchedulerOptions o;
  o.max_step_tokens = 10;
  o.block_len = 8;
  Scheduler sched(o, *cache, nullptr);
  auto a = MakeSeq(1, 6), b = MakeSeq(2, 6);
  sched.Enqueue(a.get());
  sched.Enqueue(b.get());
  StepPlan p1 = sched.Plan();
  ASSERT_EQ(p1.items.size(), 2u);
  EXPECT_EQ(p1.items[0].seq, a.get());
  EXPECT_EQ(p1.items[0].count, 6);
  EXPECT_TRUE(p1.items[0].samples);
  EXPECT_EQ(p1.items[1].count, 4);  // the budget's rest: a chunk of b's prompt
  EXPECT_FALSE(p1.items[1].samples);
  Execute(*cache, p1);
  sched.CheckInvariants();
  StepPlan p2 = sched.Plan();
  ASSERT_EQ(p2.items.size(), 2u);
  EXPECT_EQ(p2.items[0].count, 1);  // a decodes
  EXPECT_EQ(p2.items[1].count, 2);  // b's last chunk, then it samples
  EXPECT_TRUE(p2.items[1].samples);
  Execute(*cache, p2);
  sched.Remove(a.get());
  sched.Remove(b.get());
  EXPECT_EQ(cache->num_sequences(), 0);
  sched.CheckInvariants();
}

TEST(SchedulerTest, PressurePreemptsTheLowestPriorityMostRecentAndItComesBackFirst) {
  auto cache = MakeCache(4);  // 32 slots
  SchedulerOptions o;
  o.block_len = 8;
  Scheduler sched(o, *cache, nullptr);
  auto high = MakeSeq(1, 7, /*priority=*/1), low = MakeSeq(2, 3);
  sched.Enqueue(low.get());
  sched.Enqueue(high.get());
  EXPECT_EQ(sched.waiting().front(), high.get());  // by priority
  // Both grow a token a step until the pool runs out: low is preempted,
  // never high, and waits at the head of the queue.
  bool preempted = false;
  for (int i = 0; i < 40 && !preempted; ++i) {
    const StepPlan p = sched.Plan();
    preempted = !p.preempted.empty();
    if (preempted) {
      EXPECT_EQ(p.preempted[0], low.get());
      EXPECT_FALSE(low->seq.has_value());
      EXPECT_EQ(low->computed, 0);
      EXPECT_EQ(low->preemptions, 1);
      EXPECT_EQ(sched.waiting().front(), low.get());
      EXPECT_TRUE(high->seq.has_value());
    }
    Execute(*cache, p);
    sched.CheckInvariants();
  }
  EXPECT_TRUE(preempted);
}

TEST(SchedulerTest, ContiguousReservesPromptPlusMaxTokensAtAdmission) {
  auto cache = MakeCache(8);
  SchedulerOptions o;
  o.paged = false;
  o.block_len = 8;
  Scheduler sched(o, *cache, nullptr);
  auto a = MakeSeq(1, 4, 0, /*max_tokens=*/28), b = MakeSeq(2, 4, 0, 28);  // 4 blocks each
  auto c = MakeSeq(3, 4, 0, 28);
  sched.Enqueue(a.get());
  sched.Enqueue(b.get());
  sched.Enqueue(c.get());
  StepPlan p = sched.Plan();
  EXPECT_EQ(p.items.size(), 2u);  // the third does not fit the reservations
  EXPECT_EQ(a->reserved_blocks, 4);
  EXPECT_EQ(sched.ReservedSlots(), 64);
  EXPECT_EQ(sched.waiting().size(), 1u);
  Execute(*cache, p);
  sched.CheckInvariants();
}

TEST(SchedulerTest, AForkedGroupRunsFromTheRootsPrefix) {
  auto cache = MakeCache(16);
  SchedulerOptions o;
  o.block_len = 8;
  Scheduler sched(o, *cache, nullptr);
  auto root = MakeSeq(1, 6);
  root->root = true;
  auto m1 = MakeSeq(2, 8), m2 = MakeSeq(3, 9);
  m1->awaiting_fork = m2->awaiting_fork = true;
  sched.Enqueue(root.get());
  StepPlan p = sched.Plan();
  ASSERT_EQ(p.items.size(), 1u);
  EXPECT_FALSE(p.items[0].samples);  // a root samples nothing
  Execute(*cache, p);
  Sequence* members[] = {m1.get(), m2.get()};
  sched.Fork(root.get(), members);
  EXPECT_FALSE(root->seq.has_value());
  EXPECT_EQ(m1->computed, 6);
  EXPECT_EQ(m2->forked_prompt_tokens, 6);
  EXPECT_EQ(cache->View(*m1->seq)->blocks[0], cache->View(*m2->seq)->blocks[0]);  // shared
  sched.CheckInvariants();
  p = sched.Plan();
  ASSERT_EQ(p.items.size(), 2u);
  EXPECT_EQ(p.items[0].count, 2);
  EXPECT_EQ(p.items[1].count, 3);
  Execute(*cache, p);
  EXPECT_EQ(cache->CopyOnWriteCount(), 1);  // the shared partial block, copied once
  sched.CheckInvariants();
}

}  // namespace
}  // namespace pagekv
