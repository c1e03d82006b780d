#include "model/sampler.h"

#include <map>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(SamplerTest, GreedyPicksTheLowestIdOnTies) {
  Sampler s({});
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 2.0f};
  EXPECT_EQ(s.Sample(logits, {}), 1);
}

TEST(SamplerTest, TopKOneAndTinyTopPAreGreedyAtAnyTemperature) {
  const std::vector<float> logits = {0.5f, 0.1f, 2.0f, 1.9f};
  Sampler k1({.temperature = 5.0f, .top_k = 1, .seed = 3});
  Sampler p0({.temperature = 5.0f, .top_p = 1e-6f, .seed = 3});
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(k1.Sample(logits, {}), 2);
    EXPECT_EQ(p0.Sample(logits, {}), 2);
  }
}

TEST(SamplerTest, SameSeedSameTokensAndTheDistributionFollowsTheLogits) {
  const std::vector<float> logits = {0.0f, std::log(3.0f), 0.0f, -100.0f};  // p = 0.2, 0.6, 0.2, ~0
  Sampler a({.temperature = 1.0f, .seed = 42}), b({.temperature = 1.0f, .seed = 42});
  std::map<int32_t, int> counts;
  for (int i = 0; i < 20000; ++i) {
    const int32_t x = a.Sample(logits, {});
    ASSERT_EQ(x, b.Sample(logits, {}));
    ++counts[x];
  }
  EXPECT_NEAR(counts[1] / 20000.0, 0.6, 0.02);
  EXPECT_NEAR(counts[0] / 20000.0, 0.2, 0.02);
  EXPECT_EQ(counts[3], 0);
}

TEST(SamplerTest, RepetitionPenaltyDiscouragesSeenTokens) {
  const std::vector<float> logits = {2.0f, 1.9f};
  Sampler s({.repetition_penalty = 1.2f});
  EXPECT_EQ(s.Sample(logits, std::vector<int32_t>{0}), 1);  // 2.0 / 1.2 < 1.9
  EXPECT_EQ(s.Sample(logits, std::vector<int32_t>{}), 0);
}

TEST(SamplerTest, PresenceAndFrequencyPenaltiesCountOnlyGeneratedTokens) {
  const std::vector<float> logits = {2.0f, 1.5f, 0.0f};
  const std::vector<int32_t> history = {0, 0, 1, 0};  // a prompt of two tokens, then 1, 0 generated
  // Both generated: 2.0 - 0.6 = 1.4 against 1.5 - 0.6 = 0.9.
  EXPECT_EQ(Sampler({.presence_penalty = 0.6f}).Sample(logits, history, 2), 0);
  // Frequency: token 0 counted once among the generated (not the prompt's two): 2.0 - 0.3 = 1.7 > 1.5 - 0.3.
  EXPECT_EQ(Sampler({.frequency_penalty = 0.3f}).Sample(logits, history, 2), 0);
  // Counted over the whole history, token 0 (three times) would lose: 2.0 - 0.9 < 1.5 - 0.3.
  EXPECT_EQ(Sampler({.frequency_penalty = 0.3f}).Sample(logits, history, 0), 1);
  // Only what occurred is penalised; a negative penalty encourages it.
  EXPECT_EQ(Sampler({.presence_penalty = 2.0f}).Sample(logits, history, 3), 1);
  EXPECT_EQ(Sampler({.presence_penalty = -2.0f}).Sample(std::vector<float>{2.0f, 1.5f, 0.5f}, std::vector<int32_t>{2}, 0), 2);
}

TEST(SamplerTest, LogitBiasShiftsAndBans) {
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f};
  EXPECT_EQ(Sampler({.logit_bias = {{2, 5.0f}}}).Sample(logits, {}), 2);
  EXPECT_EQ(Sampler({.logit_bias = {{0, -100.0f}}}).Sample(logits, {}), 1);
  Sampler hot({.temperature = 1.0f, .logit_bias = {{0, -100.0f}, {1, -100.0f}}, .seed = 5});
  for (int i = 0; i < 200; ++i) EXPECT_EQ(hot.Sample(logits, {}), 2);
}

TEST(SamplerTest, InvalidOptionsNameTheField) {
  EXPECT_NE(Sampler::Validate({.presence_penalty = 2.5f}).message().find("presence_penalty"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.frequency_penalty = -3.0f}).message().find("frequency_penalty"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.logit_bias = {{1, 101.0f}}}).message().find("logit_bias"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.logit_bias = {{-1, 1.0f}}}).message().find("negative"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.temperature = -1.0f}).message().find("temperature"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.top_k = -2}).message().find("top_k"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.top_p = 0.0f}).message().find("top_p"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.repetition_penalty = 0.5f}).message().find("repetition_penalty"), std::string::npos);
  EXPECT_TRUE(Sampler::Validate({}).ok());
}

}  // namespace
}  // namespace pagekv
