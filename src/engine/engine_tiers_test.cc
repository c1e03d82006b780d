// The engine with KV tiers on the real stories260K model: a multi-turn
// workload whose pool cannot keep every conversation restores turn N+1's
// prefix from RAM, from disk after a restart, and from Redis in a second
// engine, always with the tokens of a run on an unlimited pool; Redis dying
// or restarting empty mid-run changes nothing but the counters.
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <mutex>

#include <gtest/gtest.h>

#include "pagekv/engine.h"
#include "testing/redis_server.h"

namespace pagekv {
namespace {

constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";

EngineOptions Options(int64_t blocks, TierOptions tiers = {}) {
  EngineOptions o;
  o.model_path = kGguf;
  o.block_len = 8;
  o.num_blocks = blocks;
  o.watermark_blocks = 0;
  o.tiers = std::move(tiers);
  return o;
}

const std::vector<std::string> kOpenings = {"Once upon a time", "Lily and Ben went to the park", "The little cat",
                                            "One day, a boy named Tom", "Sara had a red ball"};
constexpr int kTurns = 3;
constexpr int32_t kReply = 20;

// A conversation's turn: its prompt is the previous turn's prompt, reply
// and a new user line.
struct Conversation {
  std::vector<int32_t> prompt;
  std::vector<std::vector<int32_t>> replies;
};

// Runs turns [first, last) of every conversation, one turn of all of them
// at a time (so the pool sees every other conversation between two turns).
void RunTurns(Engine& e, std::vector<Conversation>& convs, int first, int last) {
  for (int t = first; t < last; ++t) {
    std::vector<RequestId> ids;
    for (Conversation& c : convs) {
      if (t > 0) {
        c.prompt.insert(c.prompt.end(), c.replies.back().begin(), c.replies.back().end());
        const std::vector<int32_t> user = e.Encode("Then they");
        c.prompt.insert(c.prompt.end(), user.begin() + 1, user.end());  // without BOS
      }
      EngineRequest r;
      r.prompt = c.prompt;
      r.max_tokens = kReply;
      r.ignore_eos = true;
      ids.push_back(*e.Submit(r));
    }
    ASSERT_TRUE(e.RunUntilIdle().ok());
    e.CheckInvariants();
    for (size_t i = 0; i < ids.size(); ++i) convs[i].replies.push_back(e.Wait(ids[i]).tokens);
  }
}

std::vector<Conversation> Start(Engine& e) {
  std::vector<Conversation> convs;
  for (const std::string& s : kOpenings) convs.push_back({e.Encode(s), {}});
  return convs;
}

const std::vector<Conversation>& Reference() {
  static const std::vector<Conversation> ref = [] {
    auto e = std::move(*Engine::Create(Options(1024)));
    std::vector<Conversation> convs = Start(*e);
    RunTurns(*e, convs, 0, kTurns);
    return convs;
  }();
  return ref;
}

void ExpectSameReplies(const std::vector<Conversation>& got, int turns) {
  const auto& want = Reference();
  for (size_t c = 0; c < got.size(); ++c) {
    for (int t = 0; t < turns; ++t) EXPECT_EQ(got[c].replies[t], want[c].replies[t]) << "conversation " << c << " turn " << t;
  }
}

class EngineTiersTest : public ::testing::Test {
 protected:
  void TearDown() override {
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }
  std::string disk_ = (std::filesystem::temp_directory_path() / ("pagekv-engine-tiers-" + std::to_string(::getpid()))).string();
};

constexpr int64_t kSmallPool = 24;  // 192 slots: a turn's batch fits, earlier conversations do not stay

TEST_F(EngineTiersTest, RamTierRestoresEarlierTurnsInsteadOfRecomputing) {
  // Without tiers the small pool recomputes; with RAM under it, it loads.
  auto plain = std::move(*Engine::Create(Options(kSmallPool)));
  std::vector<Conversation> a = Start(*plain);
  RunTurns(*plain, a, 0, kTurns);
  ExpectSameReplies(a, kTurns);
  const int64_t plain_hits = plain->Metrics().prefix.hit_blocks;

  TierOptions t;
  t.host_bytes = 8 << 20;
  auto e = std::move(*Engine::Create(Options(kSmallPool, t)));
  std::vector<Conversation> b = Start(*e);
  RunTurns(*e, b, 0, kTurns);
  ExpectSameReplies(b, kTurns);
  const EngineMetrics m = e->Metrics();
  ASSERT_TRUE(m.tiers.has_value());
  EXPECT_GT(m.prefix.tier_hit_blocks[1], 0) << "no block came back from RAM";
  EXPECT_GT(m.prefix.hit_blocks, plain_hits);
  EXPECT_EQ(m.prefix.tier_load_failures, 0);
  EXPECT_EQ(m.tiers->load_hits[1], m.prefix.tier_hit_blocks[1]);
  EXPECT_FALSE(m.model_fingerprint.empty());
  // The moves ran on the tiers' threads: every load, and copies ahead of
  // eviction that left most evictions nothing to copy.
  EXPECT_EQ(m.prefix.background_loads, m.tiers->background_loads);
  EXPECT_GE(m.prefix.background_loads, m.prefix.tier_hit_blocks[1]);
  EXPECT_GT(m.prefix.offloads_ahead, 0);
  EXPECT_GT(m.prefix.evictions_precopied, 0);
  EXPECT_EQ(m.tiers->offloads, m.prefix.offloads_ahead);

  // The same run with every move on the stepping thread: the same tokens,
  // and no background move.
  EngineOptions inline_moves = Options(kSmallPool, t);
  inline_moves.background_tier_moves = false;
  auto s = std::move(*Engine::Create(inline_moves));
  std::vector<Conversation> c = Start(*s);
  RunTurns(*s, c, 0, kTurns);
  ExpectSameReplies(c, kTurns);
  const EngineMetrics ms = s->Metrics();
  EXPECT_GT(ms.prefix.tier_hit_blocks[1], 0);
  EXPECT_EQ(ms.prefix.background_loads + ms.prefix.offloads_ahead + ms.prefix.evictions_precopied, 0);
  EXPECT_EQ(ms.prefix.evictions_copied, ms.prefix.evicted);
}

TEST_F(EngineTiersTest, APrefixLoadsFromRamWhileOtherRequestsStepAndGivesTheSameTokens) {
  // The load is held on the tiers' thread until two steps of another
  // request have run: the steps compute while it is in flight.
  std::mutex mu;
  std::condition_variable cv;
  int entered = 0;
  bool release = false;
  TierOptions t;
  t.host_bytes = 8 << 20;
  t.before_background_load = [&](const BlockMeta&) {
    std::unique_lock lock(mu);
    ++entered;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  };
  auto e = std::move(*Engine::Create(Options(kSmallPool, t)));
  std::vector<Conversation> convs = Start(*e);
  convs.resize(1);
  RunTurns(*e, convs, 0, 1);
  // A prompt as long as the pool: every cached block of the first turn
  // goes down to RAM.
  EngineRequest flush;
  for (int i = 0; i < kSmallPool * 8 - 8; ++i) flush.prompt.push_back(1 + (i * 7) % 500);
  flush.max_tokens = 7;
  flush.ignore_eos = true;
  const RequestId flush_id = *e->Submit(flush);
  ASSERT_TRUE(e->RunUntilIdle().ok());
  ASSERT_EQ(e->Wait(flush_id).finish, FinishReason::kLength);
  ASSERT_EQ(e->Metrics().prefix.tier_hit_blocks[1], 0);

  // Turn 2 of the conversation (its prefix in RAM), and a fresh request.
  Conversation& c = convs[0];
  c.prompt.insert(c.prompt.end(), c.replies.back().begin(), c.replies.back().end());
  const std::vector<int32_t> user = e->Encode("Then they");
  c.prompt.insert(c.prompt.end(), user.begin() + 1, user.end());
  EngineRequest turn;
  turn.prompt = c.prompt;
  turn.max_tokens = kReply;
  turn.ignore_eos = true;
  EngineRequest other;
  other.prompt = e->Encode("The little cat");
  other.max_tokens = 8;
  other.ignore_eos = true;
  const RequestId turn_id = *e->Submit(turn);
  const RequestId other_id = *e->Submit(other);
  const int64_t generated = e->Metrics().generated_tokens;
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(*e->Step());
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return entered > 0; }));
    const EngineMetrics m = e->Metrics();
    EXPECT_EQ(m.loading, 1) << "step " << step;
    EXPECT_EQ(m.running, 1) << "step " << step;
    EXPECT_EQ(m.generated_tokens, generated + step + 1) << "the other request did not run beside the load";
    EXPECT_FALSE(e->TryResult(turn_id).has_value());
  }
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  ASSERT_TRUE(e->RunUntilIdle().ok());
  EXPECT_EQ(e->Wait(turn_id).tokens, Reference()[0].replies[1]);
  const std::vector<int32_t> other_tokens = e->Wait(other_id).tokens;
  const EngineMetrics m = e->Metrics();
  EXPECT_GT(m.prefix.tier_hit_blocks[1], 0) << "the prefix did not come from RAM";
  EXPECT_EQ(m.prefix.tier_load_failures, 0);
  EXPECT_GE(m.prefix.background_loads, m.prefix.tier_hit_blocks[1]);
  e->CheckInvariants();

  // The fresh request alone, on a pool without tiers: the same tokens.
  auto alone = std::move(*Engine::Create(Options(kSmallPool)));
  const RequestId id = *alone->Submit(other);
  ASSERT_TRUE(alone->RunUntilIdle().ok());
  EXPECT_EQ(other_tokens, alone->Wait(id).tokens);
}

TEST_F(EngineTiersTest, DiskTierRestoresAfterAnEngineRestart) {
  TierOptions t;
  t.disk_path = disk_;
  t.disk_bytes = 16 << 20;
  std::vector<Conversation> convs;
  {
    auto e = std::move(*Engine::Create(Options(kSmallPool, t)));
    convs = Start(*e);
    RunTurns(*e, convs, 0, 1);
  }
  auto e = std::move(*Engine::Create(Options(kSmallPool, t)));
  RunTurns(*e, convs, 1, kTurns);
  ExpectSameReplies(convs, kTurns);
  EXPECT_GT(e->Metrics().prefix.tier_hit_blocks[2], 0) << "nothing came back from disk";
}

TEST_F(EngineTiersTest, RedisSharesPrefixesWithASecondEngineAndItsDeathChangesNoToken) {
  testing::RedisServer redis;
  ASSERT_TRUE(redis.Start().ok());
  TierOptions t;
  t.redis_url = redis.url();
  t.redis_timeout_ms = 300;
  std::vector<Conversation> convs;
  {
    auto first = std::move(*Engine::Create(Options(kSmallPool, t)));
    convs = Start(*first);
    RunTurns(*first, convs, 0, 1);
  }
  auto second = std::move(*Engine::Create(Options(kSmallPool, t)));
  RunTurns(*second, convs, 1, 2);
  EXPECT_GT(second->Metrics().prefix.tier_hit_blocks[3], 0) << "nothing came from Redis";
  // Redis dies before the last turn, then comes back empty: same tokens.
  redis.Kill();
  RunTurns(*second, convs, 2, kTurns);
  ExpectSameReplies(convs, kTurns);
  const EngineMetrics m = second->Metrics();
  EXPECT_GT(m.tiers->tiers[0].errors, 0);
  EXPECT_FALSE(m.tiers->tiers[0].healthy);
  ASSERT_TRUE(redis.Start().ok());
}

TEST_F(EngineTiersTest, TiersNeedThePagedPrefixCache) {
  TierOptions t;
  t.host_bytes = 1 << 20;
  EngineOptions o = Options(64, t);
  o.allocator = Allocator::kContiguous;
  EXPECT_EQ(Engine::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(64, t);
  o.tiers.host_bytes = 10;  // holds no block
  EXPECT_EQ(Engine::Create(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagekv
