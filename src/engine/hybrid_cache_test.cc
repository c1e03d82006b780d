// A sliding-window model (tiny-gemma3: windows of 32 tokens on four of six
// layers) over a hybrid cache (one block table per group of layers, sliding
// groups releasing what their window passed) against the same model over a
// uniform cache that keeps every token of every layer and applies the
// windows as a mask: every logit of every step is bit for bit the same,
// through chunked prompts, decode far past the window, forks with
// copy-on-write and batching, while the sliding groups never hold more than
// ceil(W / block_len) + 1 blocks; and through the engine, with preemption
// under a small pool.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/checked_math.h"
#include "engine/forward_step.h"
#include "model/model_loader.h"
#include "pagekv/engine.h"
#include "pagekv/generate.h"
#include "pagekv/synth_model.h"

namespace pagekv {
namespace {

class HybridCacheModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = new std::string("/tmp/pagekv-hybrid-gemma3-" + std::to_string(::getpid()) + ".gguf");
    ASSERT_TRUE(WriteSynthModel(*FindSynthModelPreset("tiny-gemma3"), 11, "f32", *path_).ok());
    Result<LoadedModel> m = LoadModel(*path_);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = new LoadedModel(std::move(*m));
  }
  static void TearDownTestSuite() {
    std::remove(path_->c_str());
    delete model_;
    delete path_;
  }
  static std::unique_ptr<KvCache> Cache(bool hybrid, int32_t bl, int64_t blocks) {
    CacheConfig c = model_->model->CacheGeometry(bl, DType::kF16, blocks);
    if (hybrid) c.layer_windows = model_->model->config().layer_windows;
    return std::move(*KvCache::Create({.config = c, .prefault = false}));
  }
  static inline std::string* path_ = nullptr;
  static inline LoadedModel* model_ = nullptr;
};

TEST_F(HybridCacheModelTest, EveryLogitEqualsTheUniformCacheWithAMask) {
  const Model& model = *model_->model;
  const int32_t vocab = model.config().vocab_size, window = 32, bl = 8;
  ASSERT_TRUE(model.config().hybrid());
  std::mt19937 rng(21);
  // Two prompts of 70 and 45 tokens, chunked at random sizes; then both
  // decode 80 tokens in one batch; after 30 a third sequence forks the
  // first and all three continue (copy-on-write of each group's last block).
  std::vector<std::vector<int32_t>> prompts(2);
  for (int64_t i = 0; i < 70; ++i) prompts[0].push_back(static_cast<int32_t>(3 + rng() % 500));
  for (int64_t i = 0; i < 45; ++i) prompts[1].push_back(static_cast<int32_t>(3 + rng() % 500));
  std::vector<int64_t> chunks;
  for (int i = 0; i < 40; ++i) chunks.push_back(1 + static_cast<int64_t>(rng() % 23));
  struct Run {
    std::vector<std::vector<float>> logits;  // every step's, every item's, in order
    int64_t most_sliding_blocks = 0, peak_blocks = 0, copies = 0;
  };
  auto run = [&](bool hybrid) {
    Run out;
    auto cache = Cache(hybrid, bl, 400);
    std::vector<SeqId> seqs{cache->AddSequence(), cache->AddSequence()};
    std::vector<std::vector<float>> logits(3, std::vector<float>(static_cast<size_t>(vocab)));
    std::vector<int32_t> next(3);
    auto step = [&](std::vector<ForwardItem> items) {
      const Result<bool> ok = ForwardStep(model, *cache, items);
      ASSERT_TRUE(ok.ok()) << ok.status().ToString();
      ASSERT_TRUE(*ok);
      cache->CheckInvariants();
      for (const ForwardItem& it : items) {
        out.logits.emplace_back(it.logits, it.logits + vocab);
        for (int32_t g = 0; g < cache->layout().num_groups(); ++g) {
          const SequenceView v = *cache->View(it.seq, g);
          if (v.window > 0) {
            out.most_sliding_blocks =
                std::max(out.most_sliding_blocks, static_cast<int64_t>(v.blocks.size()) - v.released_blocks);
          }
        }
      }
      out.peak_blocks = std::max(out.peak_blocks, cache->Stats().blocks_used);
    };
    // Prefill both prompts in interleaved chunks (one step may hold both).
    std::vector<size_t> at(2, 0);
    size_t c = 0;
    while (at[0] < prompts[0].size() || at[1] < prompts[1].size()) {
      std::vector<ForwardItem> items;
      for (size_t i = 0; i < 2; ++i) {
        if (at[i] >= prompts[i].size()) continue;
        const auto n = std::min<size_t>(static_cast<size_t>(chunks[c++ % chunks.size()]), prompts[i].size() - at[i]);
        items.push_back({seqs[i], std::span<const int32_t>(prompts[i]).subspan(at[i], n), logits[i].data(), false});
        at[i] += n;
      }
      step(items);
    }
    for (int k = 0; k < 80; ++k) {
      if (k == 30) {
        seqs.push_back(*cache->Fork(seqs[0]));
        logits[2] = logits[0];
      }
      std::vector<ForwardItem> items;
      for (size_t i = 0; i < seqs.size(); ++i) {
        next[i] = static_cast<int32_t>(std::max_element(logits[i].begin(), logits[i].end()) - logits[i].begin());
        if (i == 2) next[i] = (next[i] + 7) % vocab;  // the fork takes another way
        items.push_back({seqs[i], std::span<const int32_t>(&next[i], 1), logits[i].data(), false});
      }
      step(items);
    }
    out.copies = cache->CopyOnWriteCount();
    for (SeqId s : seqs) EXPECT_TRUE(cache->Free(s).ok());
    EXPECT_EQ(cache->FreeBlockCount(), 400);
    return out;
  };
  const Run uniform = run(false), hybrid = run(true);
  ASSERT_EQ(uniform.logits.size(), hybrid.logits.size());
  for (size_t i = 0; i < uniform.logits.size(); ++i) {
    ASSERT_EQ(std::memcmp(uniform.logits[i].data(), hybrid.logits[i].data(), static_cast<size_t>(vocab) * sizeof(float)), 0)
        << "step item " << i;
  }
  // Between steps a sliding group holds the window's blocks and the one
  // being filled; a prompt chunk of n tokens reserves up to ceil(n / 8) more
  // during its step only, and the check runs after the release.
  EXPECT_LE(hybrid.most_sliding_blocks, CeilDiv(int64_t{window}, int64_t{bl}) + 1);
  EXPECT_GT(hybrid.copies, 0);
  // The uniform cache holds 6 layers of every token; the hybrid one 2 layers
  // of every token (its full group: as many blocks as the uniform cache,
  // each a third of the size) plus, per sequence, 2 sliding groups of at
  // most 5 blocks after a decode step.
  EXPECT_EQ(hybrid.peak_blocks, uniform.peak_blocks + 3 * 2 * 5);
  EXPECT_LT(hybrid.peak_blocks, uniform.peak_blocks * 3);
}

// Through the engine: three requests in a pool too small for all, so the
// scheduler preempts (recomputation) and resumes; the hybrid cache gives
// every request the tokens the uniform cache gives, and each request's
// tokens alone.
TEST_F(HybridCacheModelTest, EngineWithPreemptionGivesTheUniformCachesTokens) {
  EngineOptions o;
  o.model_path = *path_;
  o.block_len = 8;
  o.max_step_tokens = 24;
  o.watermark_blocks = 0;
  o.prefix_cache = false;
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : {50, 75, 96}) {
    std::vector<int32_t> p{1};
    for (int64_t i = 1; i < n; ++i) p.push_back(static_cast<int32_t>(3 + rng() % 500));
    prompts.push_back(std::move(p));
  }
  struct Out {
    std::vector<std::vector<int32_t>> tokens;
    EngineMetrics metrics;
  };
  auto run = [&](KvGroups groups, int64_t blocks, const std::vector<size_t>& which) {
    o.kv_groups = groups;
    o.num_blocks = blocks;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    std::vector<RequestId> ids;
    for (size_t i : which) {
      EngineRequest r;
      r.prompt = prompts[i];
      r.max_tokens = 70;
      r.ignore_eos = true;
      ids.push_back(*(*e)->Submit(r));
    }
    EXPECT_TRUE((*e)->RunUntilIdle().ok());
    Out out;
    for (RequestId id : ids) out.tokens.push_back((*e)->Wait(id).tokens);
    out.metrics = (*e)->Metrics();
    return out;
  };
  // Uniform: requests end at 120, 145 and 166 tokens (15 + 19 + 21 blocks),
  // more than 40. Hybrid blocks are a third of the size: a request ends
  // holding its full group's blocks and 2 x 5 sliding ones (25 + 29 + 31),
  // more than 45 (three eighths of the uniform run's bytes).
  const Out uniform = run(KvGroups::kUniform, 40, {0, 1, 2});
  const Out hybrid = run(KvGroups::kHybrid, 45, {0, 1, 2});
  EXPECT_GT(uniform.metrics.preemptions, 0);
  EXPECT_EQ(uniform.metrics.kv_groups, 1);
  EXPECT_EQ(hybrid.metrics.kv_groups, 3);
  EXPECT_GT(hybrid.metrics.preemptions, 0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(hybrid.tokens[i].size(), 70u);
    EXPECT_EQ(hybrid.tokens[i], uniform.tokens[i]) << "request " << i;
    EXPECT_EQ(hybrid.tokens[i], run(KvGroups::kHybrid, 200, {i}).tokens[0]) << "request " << i << " alone";
  }
  // With the prefix cache and a RAM tier under the small pool: a preempted
  // request's published blocks wait in the pool or go down to RAM, and its
  // readmission takes them back (every group's, loaded into new blocks)
  // instead of recomputing; the tokens stay the same.
  o.prefix_cache = true;
  o.tiers.host_bytes = 64 << 20;
  for (bool background : {true, false}) {
    o.background_tier_moves = background;
    const Out tiered = run(KvGroups::kAuto, 45, {0, 1, 2});
    EXPECT_EQ(tiered.metrics.kv_groups, 3) << "auto is hybrid with tiers too";
    EXPECT_GT(tiered.metrics.preemptions, 0);
    EXPECT_GT(tiered.metrics.prefix.hit_tokens, 0);
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(tiered.tokens[i], uniform.tokens[i]) << "request " << i;
  }
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// Prefix caching over a hybrid cache. A multi-turn conversation (each turn's
// prompt is the last one, its answer and a new message) and, after one long
// prompt, requests cutting it at every point (block edges and between): the
// hybrid cache hits exactly as many tokens as the uniform cache (full groups
// hold the whole prefix, sliding groups the window before the cut: their
// blocks were published before the window released them, and wait on the
// evictable list), and every request's tokens are the uniform cache's.
TEST_F(HybridCacheModelTest, PrefixHitsAtEveryCutPointMatchTheUniformCache) {
  EngineOptions o;
  o.model_path = *path_;
  o.block_len = 8;
  o.num_blocks = 2000;
  o.max_step_tokens = 64;
  std::mt19937 rng(17);
  auto tokens = [&](int64_t n) {
    std::vector<int32_t> t;
    for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(3 + rng() % 500));
    return t;
  };
  // The requests: a conversation of 6 turns, then cuts of a 200-token prompt.
  struct Turn {
    std::vector<int32_t> prompt;
    bool conversation = false;
  };
  std::vector<int32_t> first{1};
  for (int32_t t : tokens(30)) first.push_back(t);
  std::vector<std::vector<int32_t>> messages;
  for (int k = 0; k < 6; ++k) messages.push_back(tokens(9 + 7 * k));
  const std::vector<int32_t> long_prompt = [&] {
    std::vector<int32_t> p{1};
    for (int32_t t : tokens(199)) p.push_back(t);
    return p;
  }();
  std::vector<int64_t> cuts;
  for (int64_t c = 1; c <= 200; c += (c < 48 ? 1 : 13)) cuts.push_back(c);
  const std::vector<std::vector<int32_t>> tails = [&] {
    std::vector<std::vector<int32_t>> t;
    for (size_t i = 0; i < cuts.size(); ++i) t.push_back(tokens(5));
    return t;
  }();
  struct Out {
    std::vector<std::vector<int32_t>> tokens;
    std::vector<int64_t> hits;
    EngineMetrics metrics;
  };
  auto run = [&](KvGroups groups) {
    o.kv_groups = groups;
    auto e = std::move(*Engine::Create(o));
    Out out;
    auto ask = [&](const std::vector<int32_t>& prompt, int32_t max_tokens) {
      EngineRequest r;
      r.prompt = prompt;
      r.max_tokens = max_tokens;
      r.ignore_eos = true;
      const RequestId id = *e->Submit(r);
      EXPECT_TRUE(e->RunUntilIdle().ok());
      const RequestResult res = e->Wait(id);
      out.tokens.push_back(res.tokens);
      out.hits.push_back(res.cached_prompt_tokens);
      return res.tokens;
    };
    std::vector<int32_t> conversation = first;
    for (const std::vector<int32_t>& m : messages) {
      conversation.insert(conversation.end(), m.begin(), m.end());
      const std::vector<int32_t> answer = ask(conversation, 20);
      conversation.insert(conversation.end(), answer.begin(), answer.end());
    }
    ask(long_prompt, 4);
    for (size_t i = 0; i < cuts.size(); ++i) {
      std::vector<int32_t> p(long_prompt.begin(), long_prompt.begin() + cuts[i]);
      p.insert(p.end(), tails[i].begin(), tails[i].end());
      ask(p, 4);
    }
    out.metrics = e->Metrics();
    return out;
  };
  const Out uniform = run(KvGroups::kUniform), hybrid = run(KvGroups::kHybrid);
  // The hybrid cache over a pool of 150 blocks (the conversation's last
  // turn alone holds about 110) with a RAM tier under it: evicted blocks of
  // every group go down and come back, in the background or on the
  // stepping thread, and the hits stay the large pool's.
  o.num_blocks = 150;
  o.tiers.host_bytes = 64 << 20;
  std::vector<Out> tiered;
  for (bool background : {true, false}) {
    o.background_tier_moves = background;
    tiered.push_back(run(KvGroups::kHybrid));
  }
  for (const Out& t : tiered) {
    EXPECT_GT(t.metrics.prefix.tier_hit_blocks[static_cast<size_t>(Tier::kHost)], 0);
    ASSERT_EQ(t.hits.size(), uniform.hits.size());
    for (size_t i = 0; i < uniform.hits.size(); ++i) {
      EXPECT_EQ(t.hits[i], uniform.hits[i]) << "request " << i;
      EXPECT_EQ(t.tokens[i], uniform.tokens[i]) << "request " << i;
    }
  }
  EXPECT_EQ(hybrid.metrics.kv_groups, 3);
  ASSERT_EQ(uniform.hits.size(), hybrid.hits.size());
  int64_t hit_tokens = 0;
  for (size_t i = 0; i < uniform.hits.size(); ++i) {
    EXPECT_EQ(hybrid.hits[i], uniform.hits[i]) << "request " << i;
    EXPECT_EQ(hybrid.tokens[i], uniform.tokens[i]) << "request " << i;
    hit_tokens += hybrid.hits[i];
  }
  // Turns 2.. hit the whole conversation so far (to a block edge); cuts hit
  // floor(cut / 8) * 8 (at least one token is computed).
  EXPECT_GT(hybrid.hits[5], 150);
  EXPECT_GT(hit_tokens, 2000);
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// pagekv::Generate sizes its pool over every cache group (the hybrid
// cache's short prompts hold a block per group each), gives the uniform
// cache's tokens with prompts forked from their common prefix or found in
// the prefix cache, and a pool too small ends in an error, not a crash.
TEST_F(HybridCacheModelTest, GenerateSizesThePoolForEveryGroupAndMatchesTheUniformCache) {
  GenerateOptions o;
  o.model_path = *path_;
  o.prompts = {"a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f g h i j k l",
               "a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f g h i j k l m n o"};
  o.max_new_tokens = 48;
  o.block_len = 8;
  for (bool prefix : {false, true}) {
    o.prefix_cache = prefix;
    o.kv_groups = KvGroups::kUniform;
    const Result<GenerateReport> uniform = Generate(o);
    ASSERT_TRUE(uniform.ok()) << uniform.status().ToString();
    o.kv_groups = KvGroups::kAuto;
    const Result<GenerateReport> hybrid = Generate(o);
    ASSERT_TRUE(hybrid.ok()) << hybrid.status().ToString();
    for (size_t i = 0; i < o.prompts.size(); ++i) {
      ASSERT_EQ(hybrid->outputs[i].generated_ids.size(), 48u);
      EXPECT_EQ(hybrid->outputs[i].generated_ids, uniform->outputs[i].generated_ids) << "prompt " << i;
    }
  }
  o.num_blocks = 3;  // fewer than one prompt needs
  const Result<GenerateReport> small = Generate(o);
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), StatusCode::kResourceExhausted) << small.status().ToString();
}

}  // namespace
}  // namespace pagekv
