// Engine::SubmitShared on stories260K: a group whose common prefix a root
// sequence prefills once and forks to every member (or, with the prefix
// cache, shares through it), against each prompt generated alone; forked
// members under preemption and cancellation; a bad member queues none.
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/engine_test_util.h"
#include "pagekv/engine.h"

namespace pagekv {
namespace {

using engine_test::AloneOne;
using engine_test::Options;

// Prompts that begin alike, each run alone: the reference for SubmitShared.
const std::vector<std::string> kShared = {
    "Once upon a time, in a big forest, there lived a bear. He", "Once upon a time, in a big forest, there lived a bear. One day",
    "Once upon a time, in a big forest, there lived a bear. The bear", "Once upon a time, in a big forest, there lived a"};

// Without the prefix cache: SubmitShared forks.
EngineOptions ForkOptions(int64_t blocks) {
  EngineOptions o = Options(blocks);
  o.prefix_cache = false;
  return o;
}

std::vector<EngineRequest> SharedRequests(const Engine& e, int32_t max_tokens) {
  std::vector<EngineRequest> out;
  for (const std::string& p : kShared) {
    EngineRequest r;
    r.prompt = e.Encode(p);
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    out.push_back(std::move(r));
  }
  return out;
}

TEST(EngineSharedTest, TheCommonPrefixIsPrefilledOnceForkedAndGivesTheSameTokens) {
  auto e = std::move(*Engine::Create(ForkOptions(256)));
  std::vector<EngineRequest> requests = SharedRequests(*e, 24);
  size_t lcp = 0;
  while (std::all_of(requests.begin(), requests.end(), [&](const EngineRequest& r) {
    return lcp + 1 < r.prompt.size() && r.prompt[lcp] == requests[0].prompt[lcp];
  })) {
    ++lcp;
  }
  ASSERT_GT(lcp, 8u);
  ASSERT_NE(lcp % 8, 0u) << lcp;  // a partly filled shared block: copy-on-write
  const std::vector<RequestId> ids = *e->SubmitShared(std::move(requests));
  ASSERT_EQ(ids.size(), kShared.size());
  int64_t steps = 0;
  while (*e->Step()) {
    e->CheckInvariants();
    ++steps;
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const RequestResult r = e->Wait(ids[i]);
    EXPECT_EQ(r.finish, FinishReason::kLength);
    EXPECT_EQ(r.tokens, AloneOne(kShared[i], 24)) << "prompt " << i;
    EXPECT_EQ(r.forked_prompt_tokens, static_cast<int64_t>(lcp));
  }
  const EngineMetrics m = e->Metrics();
  // The first three members copy the shared partial block; the last one
  // writes it in place (nobody else holds it by then).
  EXPECT_EQ(m.copy_on_write_blocks, static_cast<int64_t>(kShared.size()) - 1);
  EXPECT_EQ(m.blocks_used, 0);
  EXPECT_EQ(m.finished, static_cast<int64_t>(kShared.size()));
  EXPECT_EQ(steps, 1 + 1 + 23);  // the prefix, the rest of every prompt, 23 decodes
}

TEST(EngineSharedTest, ForkedMembersSurvivePreemptionAndCancellation) {
  // 4 requests of ~40 tokens on 12 blocks of 8: members are preempted and
  // recomputed; one is cancelled before the fork.
  auto e = std::move(*Engine::Create(ForkOptions(12)));
  const std::vector<RequestId> ids = *e->SubmitShared(SharedRequests(*e, 24));
  ASSERT_TRUE(e->Cancel(ids[1]));
  while (*e->Step()) e->CheckInvariants();
  EXPECT_GT(e->Metrics().preemptions, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    const RequestResult r = e->Wait(ids[i]);
    if (i == 1) {
      EXPECT_EQ(r.finish, FinishReason::kCancelled);
      continue;
    }
    EXPECT_EQ(r.tokens, AloneOne(kShared[i], 24)) << "prompt " << i;
  }
  EXPECT_EQ(e->Metrics().blocks_used, 0);
}

TEST(EngineSharedTest, ABadRequestQueuesNoneAndThePrefixCacheSharesWithoutForks) {
  auto e = std::move(*Engine::Create(ForkOptions(64)));
  std::vector<EngineRequest> requests = SharedRequests(*e, 8);
  requests[2].prompt.push_back(99999);
  const Status s = e->SubmitShared(std::move(requests)).status();
  EXPECT_NE(s.message().find("outside the vocabulary"), std::string::npos) << s.ToString();
  EXPECT_FALSE(*e->Step());
  EXPECT_EQ(e->Metrics().waiting, 0);
  // With the prefix cache on, a group is plain requests (nothing forked).
  auto p = std::move(*Engine::Create(Options(64)));  // the prefix cache on
  const std::vector<RequestId> ids = *p->SubmitShared(SharedRequests(*p, 8));
  ASSERT_TRUE(p->RunUntilIdle().ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    const RequestResult r = p->Wait(ids[i]);
    EXPECT_EQ(r.forked_prompt_tokens, 0);
    EXPECT_EQ(r.tokens, AloneOne(kShared[i], 8)) << "prompt " << i;
  }
}

}  // namespace
}  // namespace pagekv
