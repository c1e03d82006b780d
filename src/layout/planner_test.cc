#include "pagekv/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace pagekv {
namespace {

TEST(PlannerTest, ReproducesTheSeedWorkedExample) {
  PlanRequest req;
  req.config = FindPreset("seed-deepseek-v3")->config;
  Result<Plan> p = MakePlan(req);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->total_bytes, 16374562816);
  EXPECT_EQ(p->num_blocks, 512);
  EXPECT_EQ(p->bytes_per_token, 61 * 8 * 128 * 2 * 2);
  EXPECT_EQ(p->tokens_capacity, 512 * 128);
}

TEST(PlannerTest, DeepSeekV3MlaIs70272BytesPerTokenInBf16) {
  PlanRequest req;
  req.config = FindPreset("deepseek-v3")->config;
  req.config.format = KvFormat::Plain(DType::kBF16);
  req.seq_len = 4096;
  req.batch = 1;
  Plan p = *MakePlan(req);
  EXPECT_EQ(p.bytes_per_token, 70272);
  EXPECT_EQ(p.attention, AttentionKind::kMla);
  // 128 heads x (192 + 128) x 2 bytes x 61 layers.
  EXPECT_EQ(p.per_head_bytes_per_token, 128 * 320 * 2 * 61);
  EXPECT_NEAR(p.mla_reduction, 4997120.0 / 70272.0, 1e-9);
}

TEST(PlannerTest, BudgetDerivesBlocksAndSequenceCapacity) {
  PlanRequest req;
  req.config = FindPreset("llama3-8b")->config;
  req.config.budget_bytes = int64_t{24} << 30;
  req.seq_len = 8192;
  req.batch = 4;
  Plan p = *MakePlan(req);
  // 32 layers x 8 heads x 128 dims x 2 bytes x 2 planes = 128 KiB per token.
  EXPECT_EQ(p.bytes_per_token, 131072);
  EXPECT_EQ(p.num_blocks, (int64_t{24} << 30) / (131072 * 128));
  EXPECT_EQ(p.blocks_per_sequence, 64);
  EXPECT_EQ(p.max_sequences, p.num_blocks / 64);
  EXPECT_TRUE(p.fits_batch);
  EXPECT_TRUE(p.advice.empty());
}

TEST(PlannerTest, SequencesAloneSizeThePool) {
  PlanRequest req;
  req.config = FindPreset("mistral-7b")->config;
  req.seq_len = 1000;
  req.batch = 3;
  Plan p = *MakePlan(req);
  EXPECT_EQ(p.num_blocks, 3 * 8);
  EXPECT_EQ(p.slack_tokens_per_sequence, 24);
}

TEST(PlannerTest, ExplainsWhatToChangeWhenBlocksExceedTheBudget) {
  PlanRequest req;
  req.config = FindPreset("seed-deepseek-v3")->config;
  req.config.budget_bytes = int64_t{8} << 30;
  req.seq_len = 16384;
  req.batch = 8;
  Plan p = *MakePlan(req);
  EXPECT_FALSE(p.fits_budget);
  EXPECT_FALSE(p.fits_batch);  // 512 blocks / 128 per sequence = 4 < 8
  EXPECT_EQ(p.max_sequences, 4);
  ASSERT_FALSE(p.advice.empty());
  EXPECT_NE(p.advice[0].find("at most 268 blocks fit"), std::string::npos) << p.advice[0];
}

TEST(PlannerTest, MissingPoolSizeIsAnError) {
  PlanRequest req;
  req.config = FindPreset("llama3-8b")->config;
  Result<Plan> p = MakePlan(req);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("--budget"), std::string::npos);
}

TEST(PlannerTest, UnknownPresetListsTheKnownOnes) {
  Result<ModelPreset> p = FindPreset("gpt-5");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("llama3-70b"), std::string::npos);
}

TEST(PlannerTest, EveryPresetPlans) {
  for (const ModelPreset& preset : ModelPresets()) {
    PlanRequest req;
    req.config = preset.config;
    req.seq_len = preset.context_len;
    req.batch = 1;
    Result<Plan> p = MakePlan(req);
    EXPECT_TRUE(p.ok()) << preset.name << ": " << p.status().ToString();
  }
}

}  // namespace
// The rules `pagekv plan` and the Python module share: a preset, then the
// fields given; errors name the field as the caller spells it.
TEST(ResolvePlanRequestTest, PresetThenFieldsAndErrorsInTheCallersNames) {
  GeometrySpec g;
  g.preset = "llama3-8b";
  g.dtype = "int8";
  g.num_layers = 4;
  auto r = ResolvePlanRequest(g);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->request.config.num_layers, 4);
  EXPECT_EQ(r->request.config.num_kv_heads, 8) << "the preset's, not overridden";
  EXPECT_EQ(r->request.config.format.dtype, DType::kInt8);
  EXPECT_TRUE(r->one_full_context);
  EXPECT_EQ(r->request.seq_len, r->context_len);
  EXPECT_EQ(r->request.batch, 1);
  g.budget_bytes = int64_t{1} << 30;
  r = ResolvePlanRequest(g);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->one_full_context);
  EXPECT_EQ(r->request.config.budget_bytes, int64_t{1} << 30);

  GeometrySpec custom;
  custom.num_layers = 2;
  custom.num_kv_heads = 4;
  custom.head_dim = 64;
  custom.batch = 3;
  r = ResolvePlanRequest(custom);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->request.config.num_q_heads, 4) << "MHA unless told";
  EXPECT_EQ(r->title, "custom geometry");
  EXPECT_FALSE(r->one_full_context);

  GeometryNames flags;
  flags.num_layers = "--layers";
  flags.batch = "--batch";
  const Status none = ResolvePlanRequest(GeometrySpec{}, flags).status();
  EXPECT_EQ(none.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.message().find("--layers"), std::string::npos) << none.ToString();
  custom.batch = 0;
  const Status bad = ResolvePlanRequest(custom, flags).status();
  EXPECT_NE(bad.message().find("--batch 0: must be positive"), std::string::npos) << bad.ToString();
  EXPECT_NE(ResolvePlanRequest(custom).status().message().find("batch 0"), std::string::npos);
  GeometrySpec unknown;
  unknown.preset = "no-such-model";
  EXPECT_EQ(ResolvePlanRequest(unknown).status().code(), StatusCode::kNotFound);
}

}  // namespace pagekv

namespace pagekv {
namespace {

// Gemma 3 270M in bf16, block_len 128: 18 layers x 1 KV head x 256 x 2 bytes
// x K and V = 18,432 bytes per token in a uniform cache. The hybrid cache's
// full group (3 layers) keeps every token, each of the 5 sliding groups
// (3 layers, window 512) ceil(511 / 128) + 1 = 5 blocks.
TEST(PlannerTest, GemmaPresetsSayHowMuchLessTheHybridCacheNeeds) {
  const ResolvedPlanRequest r = *ResolvePlanRequest(GeometrySpec{.preset = "gemma3-270m", .seq_len = 32768, .batch = 1});
  const Plan p = *MakePlan(r.request);
  ASSERT_EQ(p.groups.size(), 6u);
  EXPECT_EQ(p.layers_per_block, 3);
  EXPECT_EQ(p.groups[0].window, 0);
  EXPECT_EQ(p.groups[0].layers, (std::vector<int32_t>{5, 11, 17}));
  EXPECT_EQ(p.bytes_per_block, 3 * 2 * 256 * 2 * 128);
  EXPECT_EQ(p.blocks_per_sequence, 256 + 5 * 5);
  ASSERT_EQ(p.savings.size(), 3u);  // 8K, 32K (= seq_len), 128K
  const int64_t block = 3 * 2 * 256 * 2 * 128;
  EXPECT_EQ(p.savings[1].tokens, 32768);
  EXPECT_EQ(p.savings[1].uniform_bytes, int64_t{256} * 6 * block);
  EXPECT_EQ(p.savings[1].hybrid_bytes, int64_t{256 + 25} * block);
  EXPECT_EQ(p.savings[2].hybrid_bytes, int64_t{1024 + 25} * block);
  // The same preset as a uniform cache: no groups, ceil(T / 128) blocks of 6x.
  const ResolvedPlanRequest u =
      *ResolvePlanRequest(GeometrySpec{.preset = "gemma3-270m", .seq_len = 32768, .batch = 1, .uniform = true});
  const Plan q = *MakePlan(u.request);
  EXPECT_TRUE(q.groups.empty());
  EXPECT_EQ(q.bytes_per_block, 6 * block);
  EXPECT_EQ(q.blocks_per_sequence, 256);
  // Custom windows: every layer but every 4th slides over 1024.
  const ResolvedPlanRequest c = *ResolvePlanRequest(
      GeometrySpec{.num_layers = 8, .num_kv_heads = 2, .head_dim = 64, .seq_len = 4096, .batch = 1, .sliding_window = 1024,
                   .sliding_pattern = 4});
  EXPECT_EQ(c.request.config.layer_windows, (std::vector<int32_t>{1024, 1024, 1024, 0, 1024, 1024, 1024, 0}));
  EXPECT_EQ(MakePlan(c.request)->groups.size(), 4u);  // 6 + 2 layers: groups of 2
  EXPECT_FALSE(ResolvePlanRequest(GeometrySpec{.num_layers = 8, .num_kv_heads = 2, .head_dim = 64, .sliding_pattern = 4}).ok());
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

TEST(ShardHeadsTest, SplitsOrReplicatesKvHeadsAndNamesTheSizesThatWork) {
  // 32 query heads over 8 KV heads (Llama 3 8B) at 4 ranks: 8 and 2 each.
  Result<HeadShard> s = ShardHeads(32, 8, 3, 4);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->q_heads, 8);
  EXPECT_EQ(s->q_head0, 24);
  EXPECT_EQ(s->kv_heads, 2);
  EXPECT_EQ(s->kv_head0, 6);
  EXPECT_EQ(s->kv_replicas, 1);
  // Every rank's query heads read only the KV heads it holds, at every size
  // that works, split or replicated.
  for (const auto& [q, kv] : std::vector<std::pair<int, int>>{{32, 8}, {8, 2}, {4, 1}, {9, 3}, {12, 12}, {16, 4}}) {
    for (int size = 1; size <= q; ++size) {
      const bool works = q % size == 0 && (kv % size == 0 || size % kv == 0);
      for (int rank = 0; rank < size; ++rank) {
        Result<HeadShard> h = ShardHeads(q, kv, rank, size);
        ASSERT_EQ(h.ok(), works) << q << "/" << kv << " at " << size;
        if (!h.ok()) continue;
        const int group = q / kv;
        for (int j = 0; j < h->q_heads; ++j) {
          const int kv_head = (h->q_head0 + j) / group;
          EXPECT_GE(kv_head, h->kv_head0);
          EXPECT_LT(kv_head, h->kv_head0 + h->kv_heads);
        }
        EXPECT_EQ(h->q_heads % h->kv_heads, 0) << "a uniform group size on the rank";
        EXPECT_EQ(h->kv_heads * size, std::max(kv, size));
      }
    }
  }
  Result<HeadShard> bad = ShardHeads(9, 3, 0, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("use one of 1, 3, 9"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(ShardHeads(8, 4, 2, 2).ok()) << "a rank outside the size";
  EXPECT_FALSE(ShardHeads(8, 3, 0, 1).ok()) << "not a GQA layer";
}

TEST(ShardHeadsTest, SplitsRowsInWholeBlocks) {
  // SmolLM2-135M's 1536 hidden units in q8_0 blocks of 32 over 3 ranks.
  int64_t next = 0;
  for (int r = 0; r < 3; ++r) {
    Result<std::pair<int64_t, int64_t>> range = ShardRange(1536, 32, r, 3);
    ASSERT_TRUE(range.ok());
    EXPECT_EQ(range->first, next);
    EXPECT_EQ(range->first % 32, 0);
    EXPECT_EQ(range->second - range->first, 512);
    next = range->second;
  }
  EXPECT_EQ(next, 1536);
  // 160 = 5 blocks over 4 ranks: 1, 1, 1, 2 blocks, covering all.
  int64_t covered = 0;
  for (int r = 0; r < 4; ++r) covered += ShardRange(160, 32, r, 4)->second - ShardRange(160, 32, r, 4)->first;
  EXPECT_EQ(covered, 160);
  EXPECT_FALSE(ShardRange(160, 32, 0, 6).ok()) << "fewer blocks than ranks";
  EXPECT_FALSE(ShardRange(100, 32, 0, 2).ok()) << "not whole blocks";
}

}  // namespace
}  // namespace pagekv
