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

TEST(SamplerTest, InvalidOptionsNameTheField) {
  EXPECT_NE(Sampler::Validate({.temperature = -1.0f}).message().find("temperature"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.top_k = -2}).message().find("top_k"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.top_p = 0.0f}).message().find("top_p"), std::string::npos);
  EXPECT_NE(Sampler::Validate({.repetition_penalty = 0.5f}).message().find("repetition_penalty"), std::string::npos);
  EXPECT_TRUE(Sampler::Validate({}).ok());
}

}  // namespace
}  // namespace pagekv
