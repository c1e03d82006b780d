// pagekv::Generate end to end on the real stories260K files.
#include <algorithm>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "pagekv/generate.h"

namespace pagekv {
namespace {

constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";
constexpr const char* kBin = "../shared/models/stories260K/stories260K.bin";
constexpr const char* kTok = "../shared/models/stories260K/tok512.bin";

nlohmann::json Golden() {
  std::ifstream in("../shared/goldens/stories260K.json");
  return nlohmann::json::parse(in);
}

TEST(GenerateTest, GreedyReproducesTheGoldenFromBothFiles) {
  const auto g = Golden()["prompts"][0];
  for (bool gguf : {true, false}) {
    GenerateOptions o;
    o.model_path = gguf ? kGguf : kBin;
    o.tokenizer_path = gguf ? "" : kTok;
    o.prompts = {g["prompt"].get<std::string>()};
    o.max_new_tokens = 64;
    std::string streamed;
    o.on_token = [&](size_t, const std::string& piece) { streamed += piece; };
    Result<GenerateReport> r = Generate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->outputs[0].prompt_ids, g["prompt_ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(r->outputs[0].generated_ids, g["generated_ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(r->outputs[0].text, g["text"].get<std::string>());
    EXPECT_EQ(g["prompt"].get<std::string>() + streamed, g["text"].get<std::string>());
    EXPECT_GT(r->stats.peak_blocks_used, 0);
  }
}

// Token eviction through Generate: a full budget changes no token of any
// policy; a 25% budget holds the pool to the budget (the blocks go back) and
// still writes (different) text; eviction refuses to share blocks.
TEST(GenerateTest, TokenEvictionHoldsTheBudgetAndAFullBudgetChangesNothing) {
  const auto g = Golden()["prompts"][0];
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = {g["prompt"].get<std::string>(), "Lily and Ben went to the park. They"};
  o.max_new_tokens = 300;
  Result<GenerateReport> full = Generate(o);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  for (const char* policy : {"streaming", "h2o", "snapkv"}) {
    o.eviction = *ParseEvictionPolicy(policy, 1.0);
    Result<GenerateReport> r = Generate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (size_t i = 0; i < 2; ++i) EXPECT_EQ(r->outputs[i].generated_ids, full->outputs[i].generated_ids) << policy;
    EXPECT_EQ(r->stats.tokens_evicted, 0);
  }
  for (const char* policy : {"streaming", "h2o"}) {
    o.eviction = *ParseEvictionPolicy(policy, 0.25);
    Result<GenerateReport> r = Generate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->outputs[0].generated_ids.size(), 300u);
    EXPECT_GT(r->stats.tokens_evicted, 400) << policy;
    // Each sequence held at most a quarter of its ~305 tokens (plus one
    // partial block), against every token without eviction.
    EXPECT_LE(r->stats.peak_blocks_used, 2 * ((305 / 4 + 15) / 16 + 1)) << policy;
    EXPECT_LT(r->stats.peak_blocks_used, full->stats.peak_blocks_used / 3) << policy;
    EXPECT_NE(r->outputs[0].generated_ids, full->outputs[0].generated_ids) << policy;
  }
  o.eviction = *ParseEvictionPolicy("h2o", 0.5);
  o.prefix_cache = true;
  const Status shared = Generate(o).status();
  EXPECT_EQ(shared.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shared.message().find("--prefix-cache"), std::string::npos) << shared.ToString();
}

// Quantized KV on the real model: INT8 keeps all 64 greedy golden tokens
// (measured); FP8 keeps the first 40 (E4M3 diverges at 44, E5M2 at 49), then
// drifts, as its 3 or 2 mantissa bits predict.
TEST(GenerateTest, QuantizedKvKeepsTheGoldenTokens) {
  const auto g = Golden()["prompts"][0];
  const auto want = g["generated_ids"].get<std::vector<int32_t>>();
  for (auto [dtype, keep] : {std::pair{DType::kInt8, 64}, std::pair{DType::kFP8E4M3, 40}, std::pair{DType::kFP8E5M2, 40}}) {
    GenerateOptions o;
    o.model_path = kGguf;
    o.prompts = {g["prompt"].get<std::string>()};
    o.max_new_tokens = 64;
    o.kv_dtype = dtype;
    Result<GenerateReport> r = Generate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const std::vector<int32_t>& got = r->outputs[0].generated_ids;
    ASSERT_EQ(got.size(), 64u);
    EXPECT_TRUE(std::equal(want.begin(), want.begin() + keep, got.begin())) << DTypeName(dtype);
    // 5 layers x K,V x 4 heads x a slab of 16 rows of (8 + a 2-byte scale) = 160 bytes, padded to 192.
    EXPECT_EQ(r->stats.bytes_per_block, 5 * 2 * 4 * 192);
  }
}

// INT4 KIVI (groups of 32 tokens, so blocks of 32): all-KIVI keeps the first
// 57 greedy golden tokens (measured; checked to 50 here, for it and for f16
// first and last layers with KIVI between), every group the prompt and the
// generation filled having been sealed into the pool on the way.
TEST(GenerateTest, Int4KiviKeepsTheGoldenTokens) {
  const auto g = Golden()["prompts"][0];
  const auto want = g["generated_ids"].get<std::vector<int32_t>>();
  for (const char* layers : {"", "0=f16,-1=f16"}) {
    GenerateOptions o;
    o.model_path = kGguf;
    o.prompts = {g["prompt"].get<std::string>()};
    o.max_new_tokens = 64;
    o.kv_dtype = DType::kInt4;
    o.kv_layer_dtypes = layers;
    o.block_len = 32;
    Result<GenerateReport> r = Generate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const std::vector<int32_t>& got = r->outputs[0].generated_ids;
    ASSERT_EQ(got.size(), 64u);
    EXPECT_TRUE(std::equal(want.begin(), want.begin() + 50, got.begin())) << layers;
  }
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = {"hi"};
  o.kv_dtype = DType::kInt4;  // block_len 16 cannot hold a 32-token group
  const Status st = Generate(o).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("block_len"), std::string::npos) << st.ToString();
}

TEST(GenerateTest, ABatchOfEightGivesTheSameTokensAsEachAlone) {
  const std::vector<std::string> prompts = {
      "Once upon a time", "Once upon a time there was a dog", "The little cat", "Lily and Ben went to the park",
      "One day, a boy", "Once upon a time, in a big forest", "Tom had a red ball", ""};
  GenerateOptions batch;
  batch.model_path = kGguf;
  batch.prompts = prompts;
  batch.max_new_tokens = 24;
  batch.block_len = 8;
  Result<GenerateReport> all = Generate(batch);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateOptions one = batch;
    one.prompts = {prompts[i]};
    one.block_len = 128;
    Result<GenerateReport> alone = Generate(one);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(all->outputs[i].generated_ids, alone->outputs[0].generated_ids) << "prompt " << i;
  }
}

TEST(GenerateTest, PromptsWithACommonPrefixShareItsBlocks) {
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = {"Once upon a time there was a little girl named Lily. She", "Once upon a time there was a little girl named Lily. One day",
               "Once upon a time there was a little girl named Lily. Her mom"};
  o.max_new_tokens = 16;
  o.block_len = 8;
  Result<GenerateReport> r = Generate(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GT(r->stats.shared_prefix_tokens, 8);
  EXPECT_LT(r->stats.peak_bytes, r->stats.contiguous_bytes);
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    GenerateOptions one = o;
    one.prompts = {o.prompts[i]};
    EXPECT_EQ(Generate(one)->outputs[0].generated_ids, r->outputs[i].generated_ids);
  }
}

TEST(GenerateTest, SamplingIsReproducibleForASeed) {
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = {"The dog"};
  o.max_new_tokens = 32;
  o.sampling = {.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = 7};
  const auto a = Generate(o)->outputs[0].generated_ids;
  EXPECT_EQ(Generate(o)->outputs[0].generated_ids, a);
  o.sampling.seed = 8;
  EXPECT_NE(Generate(o)->outputs[0].generated_ids, a);
}

TEST(GenerateTest, BadInputIsNamed) {
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = {"hi"};
  o.max_new_tokens = 0;
  EXPECT_NE(Generate(o).status().message().find("-n 0"), std::string::npos);
  o.max_new_tokens = 4;
  o.model_path = "../shared/models/missing.gguf";
  EXPECT_EQ(Generate(o).status().code(), StatusCode::kNotFound);
  o.model_path = kBin;
  EXPECT_NE(Generate(o).status().message().find("--tokenizer"), std::string::npos);
  o.model_path = kGguf;
  o.max_new_tokens = 100000;
  EXPECT_EQ(Generate(o).status().code(), StatusCode::kOutOfRange);
  o.max_new_tokens = 4;
  o.prompts.clear();
  EXPECT_EQ(Generate(o).status().code(), StatusCode::kInvalidArgument);
  o.prompts = {"hi"};
  o.sampling.top_p = 2.0f;
  EXPECT_NE(Generate(o).status().message().find("top_p"), std::string::npos);
}

TEST(GenerateTest, APromptPastTheContextIsAnErrorUnlessTruncationIsAsked) {
  std::string lng;
  for (int i = 0; i < 700; ++i) lng += "Once upon a time ";
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = {lng};
  o.max_new_tokens = 8;
  const Status s = Generate(o).status();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("--truncate-prompt"), std::string::npos);
  o.truncate_prompts = true;
  o.threads = 1;
  Result<GenerateReport> r = Generate(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->stats.truncated_prompts, 1);
  const auto& ids = r->outputs[0].prompt_ids;
  EXPECT_EQ(static_cast<int64_t>(ids.size()) + 8, 2048);  // exactly the context
  EXPECT_EQ(ids[0], 1);                                     // BOS kept
  EXPECT_EQ(r->outputs[0].generated_ids.size(), 8u);
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

TEST(GeneratePrefixCacheTest, SameTokensWithThePrefixCacheOnAndOffAndTheSharedBlocksAreSkipped) {
  const std::string shared =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day,";
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = {shared + " she saw", shared + " her mom", shared + " a big dog", "The cat sat"};
  o.max_new_tokens = 40;
  o.block_len = 8;
  Result<GenerateReport> off = Generate(o);
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  o.prefix_cache = true;
  Result<GenerateReport> on = Generate(o);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    EXPECT_EQ(on->outputs[i].generated_ids, off->outputs[i].generated_ids) << "prompt " << i;
  }
  // Prompts 2 and 3 hit every full block of the shared prefix prompt 1
  // published; prompt 4 shares nothing.
  const int64_t shared_tokens = static_cast<int64_t>(on->outputs[0].prompt_ids.size());
  EXPECT_GE(on->stats.prefix_hit_blocks, 2 * ((shared_tokens - 3) / 8));
  EXPECT_EQ(on->stats.prefix_hit_tokens, on->stats.prefix_hit_blocks * 8);
  int64_t prompt_tokens = 0;
  for (const auto& out : on->outputs) prompt_tokens += static_cast<int64_t>(out.prompt_ids.size());
  EXPECT_EQ(on->stats.prefill_tokens_computed, prompt_tokens - on->stats.prefix_hit_tokens);
  EXPECT_GT(on->stats.prefix_blocks_published, 0);
  // A salt keeps tenants apart: the same prompts under different salts in
  // one run would not hit each other; an empty salt is refused.
  o.extra_keys.cache_salt = "";
  EXPECT_EQ(Generate(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagekv
