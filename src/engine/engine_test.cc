// The engine and its scheduler on the real stories260K model: preemption
// and resumption, chunked prefill at every split, admission that changes
// nothing when it says no, cancellation, and invariants after every step of
// a seeded random workload, all against the same requests run alone.
#include "engine/engine_test_util.h"
#include "pagekv/engine.h"
#include "pagekv/generate.h"
#include "pagekv/synth_model.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

using engine_test::AloneOne;
using engine_test::kGguf;
using engine_test::kPrompts;
using engine_test::Options;

// Each of kPrompts alone.
std::vector<std::vector<int32_t>> Alone(int32_t max_tokens) {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& p : kPrompts) out.push_back(AloneOne(p, max_tokens));
  return out;
}

// WaitFor: nothing before the request has run (a zero timeout only looks,
// a short one expires), the result once it has, then the unknown-request
// error, as for an id never submitted.
TEST(EngineTest, WaitForLooksWaitsAndNamesUnknownRequests) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  r.prompt = e->Encode("Once upon a time");
  r.max_tokens = 4;
  r.ignore_eos = true;
  const RequestId id = *e->Submit(r);
  EXPECT_FALSE(e->WaitFor(id, std::chrono::milliseconds(0)).has_value());
  EXPECT_FALSE(e->WaitFor(id, std::chrono::milliseconds(20)).has_value()) << "nothing steps: it cannot finish";
  ASSERT_TRUE(e->RunUntilIdle().ok());
  std::optional<RequestResult> got = e->WaitFor(id, std::chrono::milliseconds(0));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->finish, FinishReason::kLength);
  EXPECT_EQ(got->tokens, AloneOne("Once upon a time", 4));
  for (const RequestId unknown : {id, id + 100}) {
    got = e->WaitFor(unknown, std::chrono::milliseconds(0));
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->finish, FinishReason::kError);
    EXPECT_EQ(got->error.code(), StatusCode::kNotFound);
  }
  // With the loop started, a waiting caller is woken by the result.
  e->Start();
  const RequestId id2 = *e->Submit(r);
  got = e->WaitFor(id2, std::chrono::seconds(60));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->tokens.size(), 4u);
  e->Stop();
}

TEST(EngineTest, ChatJsonNestedTooDeeplyIsAnErrorNotAStackOverflow) {
  auto e = std::move(*Engine::Create(Options(64)));
  const std::string deep = std::string(300000, '[') + std::string(300000, ']');
  const std::string messages = R"([{"role":"user","content":"hi","x":)" + deep + "}]";
  for (const Status& s : {e->EncodeChat(messages, true).status(), e->RenderChat(messages, true).status(),
                          e->EncodeChat(R"([{"role":"user","content":"hi"}])", true, deep).status()}) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("more than 128 levels deep"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(e->EncodeChat(R"([{"role":"user","content":"hi","x":[[[]]]}])", true).ok());
}

TEST(EngineTest, PreemptionUnderBlockPressureResumesWithIdenticalOutput) {
  const auto want = Alone(40);
  // 6 requests of ~50 tokens need ~40 blocks together; the pool has 20.
  auto e = std::move(*Engine::Create(Options(20)));
  std::vector<RequestId> ids;
  for (const std::string& p : kPrompts) {
    EngineRequest r;
    r.prompt = e->Encode(p);
    r.max_tokens = 40;
    r.ignore_eos = true;
    ids.push_back(*e->Submit(r));
  }
  while (*e->Step()) e->CheckInvariants();
  int64_t preemptions = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const RequestResult r = e->Wait(ids[i]);
    EXPECT_EQ(r.finish, FinishReason::kLength);
    EXPECT_EQ(r.tokens, want[i]) << "request " << i;
    preemptions += r.preemptions;
  }
  EXPECT_GT(preemptions, 0) << "the pool was meant to be too small";
  EXPECT_EQ(e->Metrics().preemptions, preemptions);
  EXPECT_EQ(e->Metrics().blocks_used, 0);
}

// INT4 KIVI through the engine, the prefix cache included: a prompt's full
// blocks are sealed KIVI groups; a second request with the same prompt hits
// them and continues from an empty tail, writing the same tokens as the
// first, which match Generate's for the same format.
TEST(EngineTest, Int4KiviWithThePrefixCacheGivesTheSameTokensAsGenerate) {
  EngineOptions o = Options(64);
  o.block_len = 32;
  o.kv_dtype = DType::kInt4;
  o.kv_layer_dtypes = "0=f16";
  auto e = std::move(*Engine::Create(o));
  const std::string prompt =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends.";
  std::vector<RequestId> ids;
  for (int i = 0; i < 2; ++i) {
    EngineRequest r;
    r.prompt = e->Encode(prompt);
    r.max_tokens = 40;
    r.ignore_eos = true;
    ids.push_back(*e->Submit(r));
    ASSERT_TRUE(e->RunUntilIdle().ok());
  }
  const RequestResult first = e->Wait(ids[0]), second = e->Wait(ids[1]);
  EXPECT_GE(second.cached_prompt_tokens, 32) << "the second request was meant to hit the first one's blocks";
  EXPECT_EQ(first.tokens, second.tokens);
  EXPECT_EQ(e->Metrics().blocks_used, 0);
  GenerateOptions g;
  g.model_path = kGguf;
  g.prompts = {prompt};
  g.max_new_tokens = 40;
  g.block_len = 32;
  g.kv_dtype = DType::kInt4;
  g.kv_layer_dtypes = "0=f16";
  Result<GenerateReport> alone = Generate(g);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  EXPECT_EQ(alone->outputs[0].generated_ids, first.tokens);
}

// Token eviction in the engine: each request holds its budget (its blocks
// go back as it evicts), writes the tokens Generate writes under the same
// policy, and the prefix cache is refused with it.
TEST(EngineTest, TokenEvictionHoldsEachRequestsBudgetAndMatchesGenerate) {
  EngineOptions o = Options(256);
  o.prefix_cache = false;
  o.eviction = *ParseEvictionPolicy("h2o", 0.25);
  auto e = std::move(*Engine::Create(o));
  std::vector<RequestId> ids;
  for (size_t i = 0; i < 3; ++i) {
    EngineRequest r;
    r.prompt = e->Encode(kPrompts[i]);
    r.max_tokens = 200;
    r.ignore_eos = true;
    ids.push_back(*e->Submit(r));
  }
  int64_t peak_blocks = 0;
  while (*e->Step()) {
    e->CheckInvariants();
    peak_blocks = std::max(peak_blocks, e->Metrics().blocks_used);
  }
  // Each of 3 sequences of ~207 tokens keeps at most a quarter (52 tokens,
  // 7 blocks of 8, plus a partial one) at a time; without eviction 27 each.
  EXPECT_LE(peak_blocks, 3 * 8);
  EXPECT_GT(e->Metrics().tokens_evicted, 3 * 140);
  for (size_t i = 0; i < 3; ++i) {
    const RequestResult r = e->Wait(ids[i]);
    EXPECT_EQ(r.tokens.size(), 200u);
    GenerateOptions g;
    g.model_path = kGguf;
    g.prompts = {kPrompts[i]};
    g.max_new_tokens = 200;
    g.block_len = 8;
    g.eviction = o.eviction;
    Result<GenerateReport> alone = Generate(g);
    ASSERT_TRUE(alone.ok()) << alone.status().ToString();
    EXPECT_EQ(alone->outputs[0].generated_ids, r.tokens) << "request " << i;
  }
  EngineOptions shared = Options(64);
  shared.eviction = o.eviction;  // with the prefix cache (the default)
  const Status st = Engine::Create(shared).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("prefix cache"), std::string::npos) << st.ToString();
}

TEST(EngineTest, ChunkedPrefillAtEverySplitGivesIdenticalOutput) {
  const std::string prompt = "Once upon a time, in a big forest, there lived a bear who liked honey";
  std::vector<int32_t> want;
  for (int64_t chunk = 1; chunk <= 24; ++chunk) {
    EngineOptions o = Options(64, chunk);
    o.prefix_cache = false;
    auto e = std::move(*Engine::Create(o));
    EngineRequest r;
    r.prompt = e->Encode(prompt);
    r.max_tokens = 12;
    r.ignore_eos = true;
    const RequestId id = *e->Submit(r);
    while (*e->Step()) e->CheckInvariants();
    const RequestResult res = e->Wait(id);
    if (want.empty()) want = res.tokens;
    EXPECT_EQ(res.tokens, want) << "chunks of " << chunk << " tokens";
  }
}

TEST(EngineTest, AdmissionThatSaysNoChangesNothing) {
  auto e = std::move(*Engine::Create(Options(16)));  // 128 token slots
  auto prompt_of = [&](const std::string& phrase) {
    std::string text;
    while (e->Encode(text).size() < 100) text += phrase;
    return e->Encode(text);
  };
  EngineRequest a_req, b_req;
  a_req.prompt = prompt_of("Once upon a time ");
  b_req.prompt = prompt_of("The little cat ran ");
  a_req.max_tokens = b_req.max_tokens = 8;
  a_req.ignore_eos = b_req.ignore_eos = true;
  const RequestId a = *e->Submit(a_req);
  ASSERT_TRUE(*e->Step());
  e->CheckInvariants();
  const EngineMetrics before = e->Metrics();
  // b needs 13 blocks next to a's 13: the scheduler says no, and b waits.
  const RequestId b = *e->Submit(b_req);
  ASSERT_TRUE(*e->Step());
  const EngineMetrics after = e->Metrics();
  EXPECT_EQ(after.running, 1);
  EXPECT_EQ(after.waiting, 1);
  EXPECT_EQ(after.preemptions, before.preemptions);
  EXPECT_EQ(after.blocks_used, before.blocks_used) << "a's next token fits its last block; b took nothing";
  EXPECT_EQ(after.prefix.lookups, before.prefix.lookups) << "asking is not admitting";
  e->CheckInvariants();
  ASSERT_TRUE(e->RunUntilIdle().ok());
  EXPECT_EQ(e->Wait(a).tokens.size(), 8u);
  EXPECT_EQ(e->Wait(b).tokens.size(), 8u);
  // A request that could never fit is refused at submission.
  EngineRequest huge = a_req;
  huge.max_tokens = 40;
  EXPECT_EQ(e->Submit(huge).status().code(), StatusCode::kResourceExhausted);
}

// Paged admission asks for a request's whole prompt, not its first chunk:
// b's first chunk would fit beside a, but all of b would not, and admitting
// it on its first chunk would preempt it (or a) a few steps later.
TEST(EngineTest, AdmissionWaitsUntilTheWholePromptFits) {
  auto e = std::move(*Engine::Create(Options(16, 32)));  // 128 slots, 32 tokens per step
  auto prompt_of = [&](const std::string& phrase, size_t tokens) {
    std::string text;
    while (e->Encode(text).size() < tokens) text += phrase;
    return e->Encode(text);
  };
  EngineRequest a_req, b_req;
  a_req.prompt = prompt_of("Once upon a time ", 50);   // 7 blocks
  b_req.prompt = prompt_of("The little cat ran ", 80);  // 10 blocks
  ASSERT_LE(a_req.prompt.size(), 56u);
  ASSERT_LE(b_req.prompt.size(), 88u);
  a_req.max_tokens = b_req.max_tokens = 8;
  a_req.ignore_eos = b_req.ignore_eos = true;
  const RequestId a = *e->Submit(a_req);
  ASSERT_TRUE(*e->Step());  // a's first chunk
  const RequestId b = *e->Submit(b_req);
  ASSERT_TRUE(*e->Step());  // a's last chunk; b's first would fit the budget and the free blocks
  EXPECT_EQ(e->Metrics().running, 1);
  EXPECT_EQ(e->Metrics().waiting, 1) << "b's whole prompt does not fit beside a";
  e->CheckInvariants();
  ASSERT_TRUE(e->RunUntilIdle().ok());
  EXPECT_EQ(e->Metrics().preemptions, 0);
  EXPECT_EQ(e->Wait(a).tokens.size(), 8u);
  EXPECT_EQ(e->Wait(b).tokens.size(), 8u);
}

TEST(EngineTest, CancellationFreesBlocksAtTheNextStep) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  r.prompt = e->Encode("Once upon a time");
  r.max_tokens = 100;
  r.ignore_eos = true;
  std::vector<TokenUpdate> updates;
  r.on_update = [&](const TokenUpdate& u) { updates.push_back(u); };
  const RequestId id = *e->Submit(r);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(*e->Step());
  EXPECT_GT(e->Metrics().blocks_used, 0);
  EXPECT_TRUE(e->Cancel(id));
  EXPECT_FALSE(*e->Step());
  EXPECT_EQ(e->Metrics().blocks_used, 0);
  const RequestResult res = e->Wait(id);
  EXPECT_EQ(res.finish, FinishReason::kCancelled);
  ASSERT_FALSE(updates.empty());
  EXPECT_EQ(updates.back().finish, FinishReason::kCancelled);
  EXPECT_FALSE(e->Cancel(id));
  e->CheckInvariants();
}

// The metrics a reader sees once a request's answer is out (its final
// update, on the stepping thread; a /metrics scrape right after the
// response) no longer count it running or waiting, though the step that
// finished it has not ended yet.
TEST(EngineTest, AFinishedRequestLeavesTheCountsBeforeItsAnswerGoesOut) {
  auto e = std::move(*Engine::Create(Options(64)));
  std::vector<std::pair<int64_t, int64_t>> seen;  // (running, waiting) at each final update
  auto request = [&](int32_t max_tokens) {
    EngineRequest r;
    r.prompt = e->Encode("Once upon a time");
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.on_update = [&](const TokenUpdate& u) {
      if (u.finish == FinishReason::kNone) return;
      const EngineMetrics m = e->Metrics();
      seen.emplace_back(m.running, m.waiting);
    };
    return *e->Submit(r);
  };
  const RequestId a = request(3), b = request(6);
  ASSERT_TRUE(e->RunUntilIdle().ok());
  EXPECT_EQ(e->Wait(a).tokens.size(), 3u);
  EXPECT_EQ(e->Wait(b).tokens.size(), 6u);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], std::make_pair(int64_t{1}, int64_t{0})) << "a's answer: b still runs, nothing waits";
  EXPECT_EQ(seen[1], std::make_pair(int64_t{0}, int64_t{0})) << "b's answer: nothing runs or waits";
  const EngineMetrics m = e->Metrics();
  EXPECT_EQ(m.running, 0);
  EXPECT_EQ(m.waiting, 0);
  EXPECT_EQ(m.finished, 2);
}

TEST(EngineTest, StopStringsAndStreamingAgreeWithTheResult) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  r.prompt = e->Encode("Once upon a time");
  r.max_tokens = 60;
  r.stop = {"Lily"};
  std::string streamed;
  std::vector<int32_t> streamed_tokens;
  FinishReason last = FinishReason::kNone;
  r.on_update = [&](const TokenUpdate& u) {
    streamed += u.text;
    if (u.token >= 0) streamed_tokens.push_back(u.token);
    last = u.finish;
  };
  const RequestId id = *e->Submit(r);
  ASSERT_TRUE(e->RunUntilIdle().ok());
  const RequestResult res = e->Wait(id);
  EXPECT_EQ(res.finish, FinishReason::kStop);  // the golden continuation names Lily early
  EXPECT_EQ(res.text.find("Lily"), std::string::npos);
  EXPECT_EQ(streamed, res.text);
  EXPECT_EQ(last, FinishReason::kStop);
  EXPECT_EQ(streamed_tokens, res.tokens) << "every token is in an update, the last one in the final update";
  // A length end: the final update carries the last token too.
  r.stop.clear();
  r.max_tokens = 5;
  r.ignore_eos = true;
  streamed.clear();
  streamed_tokens.clear();
  const RequestId id2 = *e->Submit(r);
  ASSERT_TRUE(e->RunUntilIdle().ok());
  const RequestResult res2 = e->Wait(id2);
  EXPECT_EQ(res2.finish, FinishReason::kLength);
  EXPECT_EQ(streamed_tokens, res2.tokens);
  EXPECT_EQ(streamed, res2.text);
}

TEST(EngineTest, ASeededRandomWorkloadKeepsEveryInvariant) {
  std::mt19937 rng(5);
  auto e = std::move(*Engine::Create(Options(24, 32)));
  std::vector<RequestId> ids;
  for (int step = 0; step < 400; ++step) {
    const int action = static_cast<int>(rng() % 10);
    if (action < 3 && ids.size() < 40) {
      EngineRequest r;
      r.prompt = e->Encode(kPrompts[rng() % kPrompts.size()]);
      r.max_tokens = 1 + static_cast<int32_t>(rng() % 30);
      r.priority = static_cast<int32_t>(rng() % 3);
      r.sampling.temperature = rng() % 2 == 0 ? 0.0f : 0.8f;
      r.sampling.seed = rng();
      ids.push_back(*e->Submit(r));
    } else if (action == 3 && !ids.empty()) {
      e->Cancel(ids[rng() % ids.size()]);
    }
    ASSERT_TRUE(e->Step().ok());
    e->CheckInvariants();
  }
  ASSERT_TRUE(e->RunUntilIdle().ok());
  e->CheckInvariants();
  for (RequestId id : ids) {
    const RequestResult r = e->Wait(id);
    EXPECT_NE(r.finish, FinishReason::kNone);
    EXPECT_NE(r.finish, FinishReason::kError) << r.error.ToString();
  }
  EXPECT_EQ(e->Metrics().blocks_used, 0);
}

TEST(EngineTest, ManyThreadsSubmitWhileTheLoopRuns) {
  auto e = std::move(*Engine::Create(Options(64)));
  e->Start();
  std::vector<std::thread> threads;
  std::vector<std::vector<int32_t>> got(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      EngineRequest r;
      r.prompt = e->Encode(kPrompts[static_cast<size_t>(t) % kPrompts.size()]);
      r.max_tokens = 16;
      r.ignore_eos = true;
      got[static_cast<size_t>(t)] = e->Wait(*e->Submit(r)).tokens;
    });
  }
  for (auto& t : threads) t.join();
  e->Stop();
  const auto want = Alone(16);
  for (int t = 0; t < 8; ++t) EXPECT_EQ(got[static_cast<size_t>(t)], want[static_cast<size_t>(t) % kPrompts.size()]);
}

TEST(EngineTest, BadRequestsAreNamed) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  EXPECT_EQ(e->Submit(r).status().code(), StatusCode::kInvalidArgument);
  r.prompt = {1, 99999};
  EXPECT_NE(e->Submit(r).status().message().find("outside the vocabulary"), std::string::npos);
  r.prompt = {1};
  r.max_tokens = 5000;
  EXPECT_EQ(e->Submit(r).status().code(), StatusCode::kOutOfRange);
  r.max_tokens = 4;
  r.sampling.top_p = 3;
  EXPECT_EQ(e->Submit(r).status().code(), StatusCode::kInvalidArgument);
  EngineOptions o = Options(64);
  o.max_queue = 1;
  auto small = std::move(*Engine::Create(o));
  EngineRequest ok;
  ok.prompt = {1};
  ASSERT_TRUE(small->Submit(ok).ok());
  EXPECT_EQ(small->Submit(ok).status().code(), StatusCode::kUnavailable);
}

// A request's phases: waiting (it is submitted, then the engine sleeps
// before stepping), prompt, generation; they add up to its whole time, and
// its prompt counts in the engine's prompt tokens once.
TEST(EngineTest, EachRequestReportsItsQueuePrefillAndDecodeTimes) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  r.prompt = e->Encode("Once upon a time");
  r.max_tokens = 6;
  r.ignore_eos = true;
  const RequestId id = *e->Submit(r);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  ASSERT_TRUE(e->RunUntilIdle().ok());
  const RequestResult res = e->Wait(id);
  ASSERT_EQ(res.tokens.size(), 6u);
  EXPECT_GE(res.queue_time, 0.025);
  EXPECT_GT(res.prefill_time, 0);
  EXPECT_GT(res.decode_time, 0);
  double gaps = 0;
  for (double g : res.inter_token) gaps += g;
  EXPECT_NEAR(res.decode_time, gaps, 1e-6);  // first token to last
  EXPECT_NEAR(res.time_to_first_token, res.queue_time + res.prefill_time, 1e-6);
  EXPECT_GE(res.e2e_time + 1e-9, res.queue_time + res.prefill_time + res.decode_time);
  EXPECT_LT(res.e2e_time, res.queue_time + res.prefill_time + res.decode_time + 0.05);
  EXPECT_EQ(e->Metrics().prompt_tokens, static_cast<int64_t>(r.prompt.size()));
}

TEST(EngineTest, TopLogitsAreRecordedForEverySampledStep) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  r.prompt = e->Encode("Once upon a time");
  r.max_tokens = 6;
  r.ignore_eos = true;
  r.top_logits = 3;
  const RequestId id = *e->Submit(r);
  ASSERT_TRUE(e->RunUntilIdle().ok());
  const RequestResult res = e->Wait(id);
  ASSERT_EQ(res.step_top.size(), res.tokens.size());
  for (size_t i = 0; i < res.tokens.size(); ++i) {
    ASSERT_EQ(res.step_top[i].size(), 3u);
    EXPECT_EQ(res.step_top[i][0].first, res.tokens[i]);  // greedy: the top id is the token
    EXPECT_GE(res.step_top[i][0].second, res.step_top[i][1].second);
    EXPECT_GE(res.step_top[i][1].second, res.step_top[i][2].second);
  }
  r.top_logits = -1;
  EXPECT_EQ(e->Submit(r).status().code(), StatusCode::kInvalidArgument);
}

TEST(EngineTest, LogprobsAreTheLogSoftmaxOfEachSampledStep) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  r.prompt = e->Encode("Once upon a time");
  r.max_tokens = 5;
  r.ignore_eos = true;
  r.sampling.temperature = 0.8f;
  r.sampling.seed = 3;
  r.logprobs = true;
  r.return_logits = true;
  r.top_logits = 2;
  std::vector<TokenLogprob> streamed;  // what the updates carried, token by token
  r.on_update = [&](const TokenUpdate& u) { streamed.insert(streamed.end(), u.logprobs.begin(), u.logprobs.end()); };
  const RequestId id = *e->Submit(r);
  ASSERT_TRUE(e->RunUntilIdle().ok());
  const RequestResult res = e->Wait(id);
  ASSERT_EQ(res.token_logprobs.size(), res.tokens.size());
  ASSERT_EQ(streamed.size(), res.tokens.size());
  for (size_t i = 0; i < res.tokens.size(); ++i) {
    EXPECT_EQ(streamed[i].token, res.tokens[i]);
    EXPECT_EQ(streamed[i].logprob, res.token_logprobs[i]);
    ASSERT_EQ(streamed[i].top.size(), 2u);
    EXPECT_EQ(streamed[i].top[0].second, res.step_top[i][0].second - res.step_logsumexp[i]);
  }
  ASSERT_EQ(res.step_logsumexp.size(), res.tokens.size());
  const size_t vocab = res.logits.size() / res.tokens.size();
  for (size_t i = 0; i < res.tokens.size(); ++i) {
    // The reference: log-softmax in long double over the recorded logits.
    const float* row = res.logits.data() + i * vocab;
    long double top = row[0], sum = 0;
    for (size_t v = 0; v < vocab; ++v) top = std::max<long double>(top, row[v]);
    for (size_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<long double>(row[v]) - top);
    const long double lse = top + std::log(sum);
    EXPECT_NEAR(res.step_logsumexp[i], static_cast<double>(lse), 1e-4);
    EXPECT_NEAR(res.token_logprobs[i], static_cast<double>(row[res.tokens[i]] - lse), 1e-4);
    EXPECT_LE(res.token_logprobs[i], 0.0f);
    EXPECT_LE(res.step_top[i][0].second - res.step_logsumexp[i], 0.0f);
  }
}

RequestResult RunAlone(Engine& e, const EngineRequest& r) {
  const RequestId id = *e.Submit(r);
  EXPECT_TRUE(e.RunUntilIdle().ok());
  return e.Wait(id);
}

TEST(EngineTest, ForcedTokensScoreAKnownTextAndPromptLogitsAgreeWithItsSteps) {
  EngineOptions o = Options(64);
  o.prefix_cache = false;  // every run computes the same steps
  auto e = std::move(*Engine::Create(o));
  const size_t vocab = 512;  // stories260K
  EngineRequest greedy;
  greedy.prompt = e->Encode("Once upon a time");
  greedy.max_tokens = 8;
  greedy.ignore_eos = true;
  greedy.return_logits = true;
  const RequestResult g = RunAlone(*e, greedy);
  ASSERT_EQ(g.tokens.size(), 8u);
  ASSERT_EQ(g.logits.size(), 8 * vocab);
  for (size_t k = 0; k < 8; ++k) {  // greedy: each token is its row's argmax
    const float* row = g.logits.data() + k * vocab;
    EXPECT_EQ(std::max_element(row, row + vocab) - row, g.tokens[k]) << "row " << k;
  }

  // Forcing the greedy text gives its logits bit for bit; forcing other
  // tokens emits exactly those, from the same first row on.
  EngineRequest forced = greedy;
  forced.forced_tokens = g.tokens;
  const RequestResult f = RunAlone(*e, forced);
  EXPECT_EQ(f.tokens, g.tokens);
  EXPECT_EQ(f.logits, g.logits);
  std::vector<int32_t> other(g.tokens.rbegin(), g.tokens.rend());
  other[0] = (g.tokens[0] + 1) % static_cast<int32_t>(vocab);
  forced.forced_tokens = other;
  const RequestResult x = RunAlone(*e, forced);
  EXPECT_EQ(x.tokens, other);
  EXPECT_TRUE(std::equal(x.logits.begin(), x.logits.begin() + vocab, g.logits.begin())) << "the prompt's row changed";
  EXPECT_FALSE(std::equal(x.logits.begin() + vocab, x.logits.end(), g.logits.begin() + vocab)) << "other tokens, same rows";

  // The prompt plus the text scored in one prompt: its rows after the
  // prompt are the decode steps' (prefill arithmetic, so to rounding), and
  // the prompt's rows end with the first sampled row.
  EngineRequest score;
  score.prompt = greedy.prompt;
  score.prompt.insert(score.prompt.end(), g.tokens.begin(), g.tokens.end() - 1);
  score.max_tokens = 0;
  score.prompt_logits = true;
  const RequestResult s = RunAlone(*e, score);
  EXPECT_TRUE(s.tokens.empty());
  EXPECT_EQ(s.finish, FinishReason::kLength);
  ASSERT_EQ(s.prompt_logits.size(), score.prompt.size() * vocab);
  const size_t p = greedy.prompt.size();
  for (size_t k = 0; k < 8; ++k) {
    for (size_t v = 0; v < vocab; ++v) {
      ASSERT_NEAR(s.prompt_logits[(p - 1 + k) * vocab + v], g.logits[k * vocab + v], 1e-3) << "row " << k;
    }
  }

  // With the prefix cache, a request that wants its prompt's logits takes
  // no hit: every row is there.
  auto cached = std::move(*Engine::Create(Options(64)));
  RunAlone(*cached, greedy);
  const RequestResult again = RunAlone(*cached, score);
  EXPECT_EQ(again.cached_prompt_tokens, 0);
  EXPECT_EQ(again.prompt_logits, s.prompt_logits);

  EngineRequest bad = greedy;
  bad.forced_tokens = {1, 2};  // fewer than max_tokens
  EXPECT_EQ(e->Submit(bad).status().code(), StatusCode::kInvalidArgument);
  bad.forced_tokens.assign(8, 512);  // outside the vocabulary
  EXPECT_EQ(e->Submit(bad).status().code(), StatusCode::kInvalidArgument);
  bad = greedy;
  bad.max_tokens = 0;  // nothing to do without prompt_logits
  EXPECT_EQ(e->Submit(bad).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// One request in a fresh pool holds blocks in order (the free list starts
// 0, 1, 2, ...), so every table entry follows the one before it; a finished
// engine has no tables at all (1 by definition).
TEST(EngineMetricsTest, TableContiguityCountsEntriesThatFollowThePreviousBlock) {
  auto e = std::move(*Engine::Create(Options(64)));
  EngineRequest r;
  r.prompt = e->Encode(kPrompts[0]);
  r.max_tokens = 40;
  r.ignore_eos = true;
  const RequestId id = *e->Submit(r);
  int64_t steps_with_links = 0;
  while (*e->Step()) {
    const EngineMetrics m = e->Metrics();
    EXPECT_GE(m.table_contiguity, 0.0);
    EXPECT_LE(m.table_contiguity, 1.0);
    if (m.running == 1 && m.tokens_stored > 2 * 8) {
      ++steps_with_links;
      EXPECT_EQ(m.table_contiguity, 1.0) << "a lone table in a fresh pool is one run";
    }
  }
  (void)e->Wait(id);
  EXPECT_GT(steps_with_links, 0);
  EXPECT_EQ(e->Metrics().table_contiguity, 1.0);
}

TEST(EngineContiguousTest, TheContiguousAllocatorReservesUpFrontNeverPreemptsAndGivesTheSameTokens) {
  const auto want = Alone(40);
  EngineOptions o = Options(20);
  o.allocator = Allocator::kContiguous;
  auto e = std::move(*Engine::Create(o));
  std::vector<RequestId> ids;
  for (const std::string& p : kPrompts) {
    EngineRequest r;
    r.prompt = e->Encode(p);
    r.max_tokens = 40;
    r.ignore_eos = true;
    ids.push_back(*e->Submit(r));
  }
  int64_t peak_running = 0;
  while (*e->Step()) {
    e->CheckInvariants();
    const EngineMetrics m = e->Metrics();
    peak_running = std::max(peak_running, m.running);
    EXPECT_GE(m.slots_reserved, m.tokens_stored);
  }
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(e->Wait(ids[i]).tokens, want[i]) << i;
  EXPECT_EQ(e->Metrics().preemptions, 0);
  EXPECT_LE(peak_running, 3) << "each request reserves ~6-7 of the 20 blocks";
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// A model with sliding-window layers (tiny-gemma3: windows of 32 tokens on
// four of six layers) through the engine: prompts of 40-90 tokens chunked
// at 24, then 48 tokens each, all in one batch, give each prompt's tokens
// alone (the windows cut inside prompt chunks and during decode); token
// eviction is refused at creation, naming the flag.
TEST(EngineTest, SlidingWindowModelBatchesAsItRunsAlone) {
  const std::string path = "/tmp/pagekv-engine-gemma3-" + std::to_string(::getpid()) + ".gguf";
  ASSERT_TRUE(WriteSynthModel(*FindSynthModelPreset("tiny-gemma3"), 5, "f32", path).ok());
  EngineOptions o;
  o.model_path = path;
  o.block_len = 8;
  o.num_blocks = 256;
  o.max_step_tokens = 24;
  o.watermark_blocks = 0;
  std::mt19937 rng(9);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : {40, 65, 90}) {
    std::vector<int32_t> p{1};
    for (int64_t i = 1; i < n; ++i) p.push_back(static_cast<int32_t>(3 + rng() % 500));
    prompts.push_back(std::move(p));
  }
  auto run = [&](const std::vector<size_t>& which) {
    auto e = std::move(*Engine::Create(o));
    std::vector<RequestId> ids;
    for (size_t i : which) {
      EngineRequest r;
      r.prompt = prompts[i];
      r.max_tokens = 48;
      r.ignore_eos = true;
      ids.push_back(*e->Submit(r));
    }
    EXPECT_TRUE(e->RunUntilIdle().ok());
    std::vector<std::vector<int32_t>> out;
    for (RequestId id : ids) out.push_back(e->Wait(id).tokens);
    return out;
  };
  const std::vector<std::vector<int32_t>> together = run({0, 1, 2});
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<std::vector<int32_t>> alone = run({i});
    ASSERT_EQ(alone[0].size(), 48u);
    EXPECT_EQ(together[i], alone[0]) << "prompt " << i;
  }
  o.prefix_cache = false;
  o.eviction = *ParseEvictionPolicy("h2o", 0.5);
  Result<std::unique_ptr<Engine>> evicting = Engine::Create(o);
  ASSERT_FALSE(evicting.ok());
  EXPECT_NE(evicting.status().message().find("--kv-policy"), std::string::npos) << evicting.status().message();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pagekv
