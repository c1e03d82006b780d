// The engine with KV tiers on the real stories260K model: a multi-turn
// workload whose pool cannot keep every conversation restores turn N+1's
// prefix from RAM, from disk after a restart, and from Redis in a second
// engine, always with the tokens of a run on an unlimited pool; Redis dying
// or restarting empty mid-run changes nothing but the counters.
#include <unistd.h>

#include <filesystem>

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
