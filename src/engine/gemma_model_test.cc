// Gemma 3 270M (a real Q4_K_M GGUF: gemma3 architecture, 15 sliding-window
// layers of 512 tokens and 3 full-attention ones, 4 query heads over 1 KV
// head of 256, SentencePiece without a dummy prefix, no template in the
// file) against the independent float64 reference
// (tools/make_gemma_goldens.py -> tests/data/gemma3_goldens.json): token ids
// of tricky texts and of every prompt, the built-in gemma chat template's
// rendering, 64 greedy steps with their top-5 logits (one prompt of 701
// tokens, so decode runs past the window), and the mean NLL of 2,048 tokens.
//
// The model comes from scripts/fetch-model.sh gemma3 (make test fetches it):
// $PAGEKV_GEMMA3, else the fetch script's cache.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/chat.h"
#include "engine/forward_step.h"
#include "model/model_loader.h"
#include "pagekv/synth_model.h"
#include "testing/models.h"
#include "testing/sanitized.h"

namespace pagekv {
namespace {

using testing::kSanitized;

const ForwardOptions kExact{.activations = Activations::kF32};

class Gemma3Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::ifstream in("tests/data/gemma3_goldens.json");
    ASSERT_TRUE(in) << "tests/data/gemma3_goldens.json is missing";
    goldens_ = new nlohmann::ordered_json(nlohmann::ordered_json::parse(in));
    const std::string path = testing::Gemma3Path();
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0) << path << " is missing: run scripts/fetch-model.sh gemma3 (make test does)";
    Result<LoadedModel> m = LoadModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = new LoadedModel(std::move(*m));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete goldens_;
    model_ = nullptr;
    goldens_ = nullptr;
  }
  void SetUp() override {
    if (model_ == nullptr) GTEST_FAIL() << "the model did not load";
  }

  std::unique_ptr<KvCache> Cache(int64_t tokens) const {
    const int32_t bl = 16;
    auto cache = KvCache::Create({.config = model_->model->CacheGeometry(bl, DType::kF32, (tokens + bl - 1) / bl + 1),
                                  .prefault = false});
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    return std::move(*cache);
  }

  static inline nlohmann::ordered_json* goldens_ = nullptr;
  static inline LoadedModel* model_ = nullptr;
};

TEST_F(Gemma3Test, TheFileIsTheOneTheGoldensWereMadeFrom) {
  const ModelConfig& c = model_->model->config();
  EXPECT_EQ(c.arch, "gemma3");
  EXPECT_EQ(c.num_layers, 18);
  EXPECT_EQ(c.dim, 640);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 1);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.vocab_size, 262144);
  // Five sliding layers of 512 tokens, then one full one, three times.
  for (int32_t l = 0; l < 18; ++l) EXPECT_EQ(c.window(l), l % 6 == 5 ? 0 : 512) << "layer " << l;
  EXPECT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.rope_theta_local, 1e4f);
  EXPECT_EQ(model_->tokenizer->kind(), Tokenizer::Kind::kSentencePiece);
  EXPECT_TRUE(model_->tokenizer->add_bos());
  EXPECT_TRUE(model_->chat_template.empty());
}

TEST_F(Gemma3Test, TokenizerGivesSentencePiecesIdsOnEveryText) {
  const Tokenizer& tok = *model_->tokenizer;
  int n = 0;
  for (const auto& t : (*goldens_)["tokenize"]) {
    const std::string text = t["text"];
    EXPECT_EQ(tok.Encode(text, false, false, /*parse_special=*/true), t["ids"].get<std::vector<int32_t>>()) << text;
    ++n;
  }
  EXPECT_EQ(n, 8);
  for (const auto& p : (*goldens_)["prompts"]) {
    const std::vector<int32_t> want = p["ids"].get<std::vector<int32_t>>();
    const std::string prompt = p["prompt"];
    if (p["kind"] == "chat") {
      EXPECT_EQ(tok.Encode(prompt, false, false, true), want) << prompt;  // the template writes <bos>
    } else if (p["kind"] == "plain") {
      EXPECT_EQ(tok.EncodePrompt(prompt, true), want) << prompt;
      EXPECT_EQ(tok.Decode(want), prompt);  // lossless: no dummy prefix to strip
    }
  }
  const auto& nll = (*goldens_)["nll"];
  std::ifstream in(nll["file"].get<std::string>(), std::ios::binary);
  ASSERT_TRUE(in) << nll["file"] << " is missing (Debian's base-files package carries it)";
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = tok.EncodePrompt(text, true);
  const std::vector<int32_t> want = nll["ids"].get<std::vector<int32_t>>();
  ASSERT_GE(ids.size(), want.size());
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(want.size())), want);
}

// The file has no template: the engine falls back to the built-in gemma
// one, which renders every conversation as the reference's Gemma 3 template.
TEST_F(Gemma3Test, TheBuiltInGemmaTemplateRendersAsTheReference) {
  EXPECT_EQ(ChatTemplate::FallbackTemplateName(model_->model->config().arch), "gemma");
  Result<ChatTemplate> chat = ChatTemplate::Create(model_->chat_template, "gemma", *model_->tokenizer);
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();
  int n = 0;
  for (const auto& p : (*goldens_)["prompts"]) {
    if (p["kind"] != "chat") continue;
    Result<std::string> out = chat->Render(p["messages"], true);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(*out, p["prompt"].get<std::string>());
    Result<std::vector<int32_t>> ids = chat->Encode(p["messages"], true);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, p["ids"].get<std::vector<int32_t>>());
    ++n;
  }
  EXPECT_EQ(n, 6);
  const std::vector<int32_t>& stops = chat->stop_tokens();
  EXPECT_NE(std::find(stops.begin(), stops.end(), *model_->tokenizer->TokenId("<end_of_turn>")), stops.end());
}

// The exact path (f32 activations): every greedy step equals the
// reference's and its top-5 logits agree within 1e-3 relative, the long
// prompt's included (the sliding layers then read only their last 512).
TEST_F(Gemma3Test, GreedyStepsAndLogitsMatchTheReference) {
  const int32_t vocab = model_->model->config().vocab_size;
  double worst = 0;
  size_t prompts = 0;
  for (const auto& p : (*goldens_)["prompts"]) {
    if (kSanitized && prompts >= 1 && p["kind"] != "long") continue;
    ++prompts;
    const std::vector<int32_t> ids = p["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> want = p["greedy"].get<std::vector<int32_t>>();
    const size_t steps = kSanitized ? 4 : want.size();
    auto cache = Cache(static_cast<int64_t>(ids.size() + steps));
    const SeqId seq = cache->AddSequence();
    std::vector<float> logits(static_cast<size_t>(vocab));
    ForwardItem item{seq, ids, logits.data(), false};
    ASSERT_TRUE(*ForwardStep(*model_->model, *cache, {&item, 1}, kExact));
    for (size_t k = 0; k < steps; ++k) {
      const auto& top = p["top5"][k];
      for (size_t j = 0; j < 5; ++j) {
        const int32_t id = top["ids"][j];
        const double ref = top["logits"][j];
        const double err = std::fabs(logits[static_cast<size_t>(id)] - ref) / std::max(1.0, std::fabs(ref));
        worst = std::max(worst, err);
        ASSERT_LE(err, 1e-3) << "step " << k << " of " << p["prompt"] << ": token " << id << " logit "
                             << logits[static_cast<size_t>(id)] << ", reference " << ref;
      }
      const auto next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      ASSERT_EQ(next, want[k]) << "step " << k << " of " << p["prompt"] << " (reference margin " << top["margin"] << ")";
      const std::vector<int32_t> one{next};
      ForwardItem step{seq, one, logits.data(), false};
      ASSERT_TRUE(*ForwardStep(*model_->model, *cache, {&step, 1}, kExact));
    }
  }
  EXPECT_EQ(prompts, kSanitized ? 2u : 13u);
  std::printf("worst relative logit error over the reference's top-5: %.2e\n", worst);
}

// The hybrid cache (6 groups of 3 layers: the 3 full layers keep every
// token, the 15 sliding ones only their 512-token window) against the
// uniform one that keeps everything and masks: the long prompt (701 tokens,
// in chunks of 128) and greedy steps past the window give the same logits
// bit for bit, and the reference's greedy ids.
TEST_F(Gemma3Test, HybridCacheGivesTheUniformCachesLogitsBitForBit) {
  const Model& model = *model_->model;
  const int32_t vocab = model.config().vocab_size;
  for (const auto& p : (*goldens_)["prompts"]) {
    if (p["kind"] != "long") continue;
    const std::vector<int32_t> ids = p["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> want = p["greedy"].get<std::vector<int32_t>>();
    const size_t steps = kSanitized ? 4 : want.size();
    auto run = [&](bool hybrid, int64_t& held) {
      const int32_t bl = 16;
      CacheConfig c = model.CacheGeometry(bl, DType::kF32, 6 * (static_cast<int64_t>(ids.size() + steps) / bl + 2));
      if (hybrid) c.layer_windows = model.config().layer_windows;
      auto cache = std::move(*KvCache::Create({.config = c, .prefault = false}));
      EXPECT_EQ(cache->layout().num_groups(), hybrid ? 6 : 1);
      const SeqId seq = cache->AddSequence();
      std::vector<std::vector<float>> out;
      std::vector<float> logits(static_cast<size_t>(vocab));
      for (size_t at = 0; at < ids.size(); at += 128) {
        const std::vector<int32_t> chunk(ids.begin() + static_cast<std::ptrdiff_t>(at),
                                         ids.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), at + 128)));
        ForwardItem item{seq, chunk, logits.data(), false};
        EXPECT_TRUE(*ForwardStep(model, *cache, {&item, 1}, kExact));
      }
      out.push_back(logits);
      for (size_t k = 0; k + 1 < steps; ++k) {
        const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        EXPECT_EQ(next, want[k]) << "step " << k;
        ForwardItem item{seq, std::span<const int32_t>(&next, 1), logits.data(), false};
        EXPECT_TRUE(*ForwardStep(model, *cache, {&item, 1}, kExact));
        out.push_back(logits);
      }
      held = cache->Stats().blocks_used * cache->layout().bytes_per_block();
      return out;
    };
    int64_t uniform_bytes = 0, hybrid_bytes = 0;
    const auto uniform = run(false, uniform_bytes), hybrid = run(true, hybrid_bytes);
    ASSERT_EQ(uniform.size(), hybrid.size());
    for (size_t i = 0; i < uniform.size(); ++i) {
      ASSERT_EQ(std::memcmp(uniform[i].data(), hybrid[i].data(), uniform[i].size() * sizeof(float)), 0) << "step " << i;
    }
    // 3 of 18 layers keep ~765 tokens, 15 keep ~512 + a block: about 3/4.
    EXPECT_LT(hybrid_bytes, uniform_bytes * 4 / 5) << uniform_bytes << " vs " << hybrid_bytes;
    std::printf("KV bytes after %zu steps: uniform %lld, hybrid %lld\n", steps, static_cast<long long>(uniform_bytes),
                static_cast<long long>(hybrid_bytes));
    return;
  }
  FAIL() << "the goldens have no long prompt";
}

// One forward pass over 2,048 tokens (its last 1,536 positions see only
// their window on the sliding layers), in prompt chunks of 300 so that the
// windows also cross chunk boundaries.
TEST_F(Gemma3Test, MeanNllOfTheLicenceTextMatchesTheReference) {
  const auto& nll = (*goldens_)["nll"];
  std::vector<int32_t> ids = nll["ids"].get<std::vector<int32_t>>();
  if (kSanitized) ids.resize(600);
  const int32_t vocab = model_->model->config().vocab_size;
  auto cache = Cache(static_cast<int64_t>(ids.size()));
  const SeqId seq = cache->AddSequence();
  std::vector<float> logits;
  double total = 0;
  for (size_t at = 0; at < ids.size(); at += 300) {
    const std::vector<int32_t> chunk(ids.begin() + static_cast<std::ptrdiff_t>(at),
                                     ids.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), at + 300)));
    logits.assign(chunk.size() * static_cast<size_t>(vocab), 0.0f);
    ForwardItem item{seq, chunk, logits.data(), true};
    ASSERT_TRUE(*ForwardStep(*model_->model, *cache, {&item, 1}, kExact));
    for (size_t j = 0; j < chunk.size() && at + j + 1 < ids.size(); ++j) {
      const float* row = logits.data() + j * static_cast<size_t>(vocab);
      const float mx = *std::max_element(row, row + vocab);
      double sum = 0;
      for (int32_t t = 0; t < vocab; ++t) sum += std::exp(static_cast<double>(row[t]) - mx);
      total += -(static_cast<double>(row[ids[at + j + 1]]) - mx - std::log(sum));
    }
  }
  const double mean = total / static_cast<double>(ids.size() - 1);
  if (!kSanitized) {
    const double ref = nll["mean_nll"];
    EXPECT_NEAR(mean, ref, 1e-4 * ref) << "mean NLL over " << ids.size() << " tokens";
    std::printf("mean NLL %.6f, reference %.6f\n", mean, ref);
  } else {
    EXPECT_GT(mean, 0.5);
    EXPECT_LT(mean, 8.0);
  }
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// A model whose every layer slides (tiny-gemma3 with no full layer: one
// cache group, Mistral-style): after each step the blocks no future query's
// window reaches are released (KvCache::ReleaseBefore), so a sequence never
// holds more than ceil(W / block_len) + 1 blocks, and every step's logits
// are bit for bit those of the same run on a cache that keeps everything
// (the kernels read only the window either way).
TEST(SlidingWindowCacheTest, ReleasingOutOfWindowBlocksChangesNoLogit) {
  SynthModelSpec spec = *FindSynthModelPreset("tiny-gemma3");
  spec.sliding_pattern = spec.num_layers + 1;  // every layer slides
  const std::string path = "/tmp/pagekv-gemma3-all-sliding-" + std::to_string(::getpid()) + ".gguf";
  ASSERT_TRUE(WriteSynthModel(spec, 8, "f32", path).ok());
  Result<LoadedModel> m = LoadModel(path);
  std::remove(path.c_str());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const Model& model = *m->model;
  const int32_t window = spec.sliding_window, bl = 8;
  for (int32_t l = 0; l < spec.num_layers; ++l) ASSERT_EQ(model.config().window(l), window);
  const int32_t vocab = model.config().vocab_size;
  std::mt19937 rng(4);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 50; ++i) prompt.push_back(static_cast<int32_t>(3 + rng() % 500));
  auto run = [&](bool release, std::vector<std::vector<float>>& steps, int64_t& most_blocks) {
    auto cache = std::move(*KvCache::Create({.config = model.CacheGeometry(bl, DType::kF16, 64), .prefault = false}));
    const SeqId seq = cache->AddSequence();
    std::vector<float> logits(static_cast<size_t>(vocab));
    int64_t len = 0;
    auto step = [&](std::span<const int32_t> tokens) {
      ForwardItem item{seq, {tokens.begin(), tokens.end()}, logits.data(), false};
      ASSERT_TRUE(*ForwardStep(model, *cache, {&item, 1}));
      len += static_cast<int64_t>(tokens.size());
      steps.push_back(logits);
      if (release && len + 1 - window > 0) {
        ASSERT_TRUE(cache->ReleaseBefore(seq, len + 1 - window).ok());
      }
      cache->CheckInvariants();
      most_blocks = std::max(most_blocks, cache->StatsFor(seq)->num_blocks);
    };
    for (size_t at = 0; at < prompt.size(); at += 16) {
      step(std::span<const int32_t>(prompt).subspan(at, std::min<size_t>(16, prompt.size() - at)));
    }
    for (int k = 0; k < 60; ++k) {
      const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      step(std::span<const int32_t>(&next, 1));
    }
  };
  std::vector<std::vector<float>> kept, released;
  int64_t kept_blocks = 0, released_blocks = 0;
  run(false, kept, kept_blocks);
  run(true, released, released_blocks);
  ASSERT_EQ(kept.size(), released.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    ASSERT_EQ(std::memcmp(kept[i].data(), released[i].data(), kept[i].size() * sizeof(float)), 0) << "step " << i;
  }
  // The window's blocks (ceil(32 / 8) = 4) plus the one being filled, plus
  // a prompt chunk's: a chunk of 16 reserves its blocks before the release.
  EXPECT_LE(released_blocks, (window + bl - 1) / bl + 1 + 16 / bl);
  EXPECT_EQ(kept_blocks, (50 + 60 + bl - 1) / bl);
}

}  // namespace
}  // namespace pagekv
