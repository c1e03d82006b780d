// Token eviction against what the policies promise, on a real KvCache whose
// rows carry their own (layer, head, plane, position) tag: after every step
// each kept slot must still hold the row of the position the evictor says it
// holds (compaction moved whole rows, K and V together), the kept set must be
// the policy's, the cache must hold exactly the budget, and emptied blocks
// must be back in the pool.
#include "pagekv/eviction.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

constexpr int32_t kLayers = 2, kHeads = 2, kDim = 8, kBlockLen = 8;

CacheConfig Config(int64_t blocks) {
  CacheConfig c;
  c.num_layers = kLayers;
  c.num_q_heads = kHeads * 2;
  c.num_kv_heads = kHeads;
  c.head_dim = kDim;
  c.block_len = kBlockLen;
  c.format = KvFormat::Plain(DType::kF32);
  c.num_blocks = blocks;
  return c;
}

std::unique_ptr<KvCache> MakeCache(int64_t blocks = 64) {
  auto c = KvCache::Create({.config = Config(blocks), .huge_pages = false, .prefault = false});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return std::move(*c);
}

// A row's tag: every element encodes (layer, head, plane, position).
float Tag(int32_t layer, int32_t head, int32_t plane, int64_t pos) {
  return static_cast<float>(((layer * kHeads + head) * 2 + plane) * 100000 + pos);
}

// Appends n tagged tokens at positions [first_pos, first_pos + n).
void AppendTagged(KvCache& cache, SeqId seq, int64_t first_pos, int64_t n) {
  std::vector<float> k(static_cast<size_t>(kLayers * n * kHeads * kDim)), v(k.size());
  for (int32_t l = 0; l < kLayers; ++l) {
    for (int64_t t = 0; t < n; ++t) {
      for (int32_t h = 0; h < kHeads; ++h) {
        const size_t at = static_cast<size_t>(((l * n + t) * kHeads + h) * kDim);
        std::fill_n(k.begin() + static_cast<std::ptrdiff_t>(at), kDim, Tag(l, h, 0, first_pos + t));
        std::fill_n(v.begin() + static_cast<std::ptrdiff_t>(at), kDim, Tag(l, h, 1, first_pos + t));
      }
    }
  }
  auto ok = cache.Append(seq, {n, k.data(), v.data()});
  ASSERT_TRUE(ok.ok() && *ok);
}

// Every slot holds the tagged row of the position the evictor names.
void ExpectRowsMatchPositions(const KvCache& cache, SeqId seq, const TokenEvictor& ev) {
  const int64_t n = cache.View(seq)->num_tokens;
  ASSERT_EQ(n, ev.cached());
  std::vector<float> k(static_cast<size_t>(kLayers * n * kHeads * kDim)), v(k.size());
  ASSERT_TRUE(cache.Read(seq, 0, {n, k.data(), v.data()}).ok());
  for (int32_t l = 0; l < kLayers; ++l) {
    for (int32_t h = 0; h < kHeads; ++h) {
      const auto pos = ev.Positions(l, h);
      ASSERT_EQ(static_cast<int64_t>(pos.size()), n);
      for (int64_t t = 0; t < n; ++t) {
        const size_t at = static_cast<size_t>(((l * n + t) * kHeads + h) * kDim);
        for (int32_t x = 0; x < kDim; ++x) {
          ASSERT_EQ(k[at + static_cast<size_t>(x)], Tag(l, h, 0, pos[static_cast<size_t>(t)])) << "layer " << l << " head " << h << " slot " << t;
          ASSERT_EQ(v[at + static_cast<size_t>(x)], Tag(l, h, 1, pos[static_cast<size_t>(t)]));
        }
      }
    }
  }
}

std::set<int64_t> Kept(const TokenEvictor& ev, int32_t l, int32_t h) {
  const auto p = ev.Positions(l, h);
  return {p.begin(), p.end()};
}

// One step through the evictor: append n tokens, let `weights` fill the
// scores the step asks for, end the step.
template <typename W>
void Step(KvCache& cache, SeqId seq, TokenEvictor& ev, int64_t n, bool prompt_ends, W weights) {
  const int64_t cached = cache.View(seq)->num_tokens;
  const StepScores s = ev.BeginStep(cached, n, prompt_ends);
  AppendTagged(cache, seq, ev.seen(), n);
  if (s.scores != nullptr) weights(s.scores, cached + n, s.score_queries);
  ASSERT_TRUE(ev.EndStep(cache, seq).ok());
  ev.CheckInvariants();
  cache.CheckInvariants();
}

void NoWeights(float*, int64_t, int64_t) {}

TEST(CompactionMovesTest, KeptSlotsBelowStayAndTheRestFillHolesInOrder) {
  using M = std::vector<std::pair<int32_t, int32_t>>;
  EXPECT_EQ(CompactionMoves(std::vector<int32_t>{0, 1, 2}), M{});
  EXPECT_EQ(CompactionMoves(std::vector<int32_t>{9, 0, 5}), (M{{5, 1}, {9, 2}}));
  EXPECT_EQ(CompactionMoves(std::vector<int32_t>{7, 6}), (M{{6, 0}, {7, 1}}));
  EXPECT_EQ(CompactionMoves(std::vector<int32_t>{}), M{});
}

TEST(KvCacheCompactTest, KeepsRowsFreesBlocksAndCountsEvictedTokens) {
  auto cache = MakeCache(16);
  const SeqId seq = cache->AddSequence();
  AppendTagged(*cache, seq, 0, 5 * kBlockLen + 3);  // 6 blocks
  const int64_t free_before = cache->FreeBlockCount();
  // Each (layer, head) keeps a different set of 9 tokens.
  std::mt19937 rng(3);
  std::vector<int32_t> keep;
  std::vector<std::vector<int32_t>> lists;
  for (int32_t i = 0; i < kLayers * kHeads; ++i) {
    std::vector<int32_t> all(5 * kBlockLen + 3);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(9);
    lists.push_back(all);
    keep.insert(keep.end(), all.begin(), all.end());
  }
  ASSERT_TRUE(cache->Compact(seq, keep, 9).ok());
  const SequenceView view = *cache->View(seq);
  EXPECT_EQ(view.num_tokens, 9);
  EXPECT_EQ(view.evicted, 5 * kBlockLen + 3 - 9);
  EXPECT_EQ(cache->FreeBlockCount(), free_before + 4);  // 6 blocks -> 2
  cache->CheckInvariants();
  std::vector<float> k(static_cast<size_t>(kLayers * 9 * kHeads * kDim)), v(k.size());
  ASSERT_TRUE(cache->Read(seq, 0, {9, k.data(), v.data()}).ok());
  for (int32_t l = 0; l < kLayers; ++l) {
    for (int32_t h = 0; h < kHeads; ++h) {
      const std::vector<int32_t>& list = lists[static_cast<size_t>(l * kHeads + h)];
      std::vector<int32_t> slot_pos(9, -1);
      for (int32_t s : list) if (s < 9) slot_pos[static_cast<size_t>(s)] = s;
      for (const auto& [from, to] : CompactionMoves(list)) slot_pos[static_cast<size_t>(to)] = from;
      for (int64_t t = 0; t < 9; ++t) {
        EXPECT_EQ(k[static_cast<size_t>(((l * 9 + t) * kHeads + h) * kDim)], Tag(l, h, 0, slot_pos[static_cast<size_t>(t)]));
        EXPECT_EQ(v[static_cast<size_t>(((l * 9 + t) * kHeads + h) * kDim)], Tag(l, h, 1, slot_pos[static_cast<size_t>(t)]));
      }
    }
  }
}

TEST(KvCacheCompactTest, BadListsAndSharedBlocksChangeNothing) {
  auto cache = MakeCache(16);
  const SeqId seq = cache->AddSequence();
  AppendTagged(*cache, seq, 0, 20);
  const int64_t lists = kLayers * kHeads;
  std::vector<int32_t> keep;
  for (int64_t i = 0; i < lists; ++i) keep.insert(keep.end(), {19, 3});
  EXPECT_EQ(cache->Compact(seq, std::span(keep).subspan(1), 2).code(), StatusCode::kInvalidArgument);  // wrong size
  EXPECT_EQ(cache->Compact(seq, keep, 21).code(), StatusCode::kOutOfRange);
  std::vector<int32_t> dup = keep;
  dup[1] = 19;
  EXPECT_EQ(cache->Compact(seq, dup, 2).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> outside = keep;
  outside[0] = 20;
  EXPECT_EQ(cache->Compact(seq, outside, 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Compact(SeqId{99}, keep, 2).code(), StatusCode::kNotFound);
  // A fork shares block 0: slot 0 must not be rewritten.
  const SeqId child = *cache->Fork(seq);
  const Status st = cache->Compact(seq, keep, 2);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("shared"), std::string::npos) << st.message();
  EXPECT_EQ(cache->View(seq)->num_tokens, 20);
  EXPECT_EQ(cache->View(seq)->evicted, 0);
  ASSERT_TRUE(cache->Free(child).ok());
  ASSERT_TRUE(cache->Compact(seq, keep, 2).ok());
  EXPECT_EQ(cache->View(seq)->num_tokens, 2);
  cache->CheckInvariants();
}

TEST(TokenEvictorTest, BudgetOfOneNeverEvicts) {
  for (const char* name : {"streaming", "h2o", "snapkv"}) {
    auto cache = MakeCache();
    const SeqId seq = cache->AddSequence();
    auto ev = *TokenEvictor::Create(*ParseEvictionPolicy(name, 1.0), cache->layout());
    Step(*cache, seq, *ev, 30, true, [](float* s, int64_t n, int64_t) { std::fill_n(s, kLayers * kHeads * n, 1.0f); });
    for (int i = 0; i < 40; ++i) Step(*cache, seq, *ev, 1, false, [](float* s, int64_t n, int64_t) { s[0] = n; });
    EXPECT_EQ(cache->View(seq)->num_tokens, 70) << name;
    EXPECT_EQ(ev->stats().tokens_evicted, 0) << name;
  }
}

TEST(TokenEvictorTest, StreamingKeepsSinksAndTheRecentWindowAtTheBudget) {
  auto cache = MakeCache();
  const SeqId seq = cache->AddSequence();
  EvictionOptions o = *ParseEvictionPolicy("streaming", 0.25);
  o.sink_tokens = 3;
  auto ev = *TokenEvictor::Create(o, cache->layout());
  Step(*cache, seq, *ev, 40, true, NoWeights);  // prompt: 40 -> 10 kept
  EXPECT_EQ(ev->cached(), 10);
  ExpectRowsMatchPositions(*cache, seq, *ev);
  for (int64_t i = 0; i < 100; ++i) {
    Step(*cache, seq, *ev, 1, false, NoWeights);
    const int64_t seen = 41 + i;
    const auto k = static_cast<int64_t>(std::ceil(0.25 * static_cast<double>(seen) - 1e-9));
    ASSERT_EQ(ev->cached(), k);
    ExpectRowsMatchPositions(*cache, seq, *ev);
    std::set<int64_t> want = {0, 1, 2};
    for (int64_t p = seen - (k - 3); p < seen; ++p) want.insert(p);
    for (int32_t l = 0; l < kLayers; ++l) {
      for (int32_t h = 0; h < kHeads; ++h) ASSERT_EQ(Kept(*ev, l, h), want) << "seen " << seen;
    }
  }
  // 140 tokens seen, 35 kept: 5 blocks, not 18; the next position is 140.
  EXPECT_EQ(cache->View(seq)->blocks.size(), 5u);
  EXPECT_EQ(cache->View(seq)->num_tokens + cache->View(seq)->evicted, 140);
  EXPECT_EQ(cache->Stats().blocks_used, 5);
}

TEST(TokenEvictorTest, H2OKeepsTheHeaviestAccumulatedTokensPerHeadPlusTheRecentWindow) {
  auto cache = MakeCache();
  const SeqId seq = cache->AddSequence();
  auto ev = *TokenEvictor::Create(*ParseEvictionPolicy("h2o", 0.3), cache->layout());
  // Each (layer, head) favours a residue of the position mod 3.
  auto weights = [&](float* s, int64_t n, int64_t) {
    for (int32_t li = 0; li < kLayers * kHeads; ++li) {
      const auto pos = ev->Positions(li / kHeads, li % kHeads);
      for (int64_t t = 0; t < n; ++t) {
        // Slots past the cached ones are this step's new tokens, at seen + (t - cached).
        const int64_t p = t < static_cast<int64_t>(pos.size()) ? pos[static_cast<size_t>(t)]
                                                               : ev->seen() + (t - static_cast<int64_t>(pos.size()));
        s[li * n + t] = p % 3 == li % 3 ? 1.0f : 0.01f;
      }
    }
  };
  Step(*cache, seq, *ev, 50, true, weights);
  for (int i = 0; i < 60; ++i) Step(*cache, seq, *ev, 1, false, weights);
  const int64_t seen = 110, k = 33, recent = 17;
  ASSERT_EQ(ev->cached(), k);
  ExpectRowsMatchPositions(*cache, seq, *ev);
  for (int32_t li = 0; li < kLayers * kHeads; ++li) {
    const std::set<int64_t> kept = Kept(*ev, li / kHeads, li % kHeads);
    for (int64_t p = seen - recent; p < seen; ++p) EXPECT_TRUE(kept.count(p)) << "recent " << p;
    int heavy = 0;
    for (int64_t p : kept) {
      if (p >= seen - recent) continue;
      EXPECT_EQ(p % 3, li % 3) << "head " << li << " kept a light token " << p;
      ++heavy;
    }
    EXPECT_EQ(heavy, k - recent);
  }
}

TEST(TokenEvictorTest, SnapKVChoosesOnceFromTheWindowAndThenKeepsEveryGeneratedToken) {
  auto cache = MakeCache();
  const SeqId seq = cache->AddSequence();
  EvictionOptions o = *ParseEvictionPolicy("snapkv", 0.25);
  o.window = 8;
  o.pool_kernel = 3;
  auto ev = *TokenEvictor::Create(o, cache->layout());
  int64_t asked_queries = -1;
  // The window's weights peak at position 10 (head-dependent: 10 + 20 * head).
  Step(*cache, seq, *ev, 80, true, [&](float* s, int64_t n, int64_t q) {
    asked_queries = q;
    for (int32_t li = 0; li < kLayers * kHeads; ++li) {
      for (int64_t t = 0; t < n; ++t) s[li * n + t] = t == 10 + 20 * (li % kHeads) ? 5.0f : 0.001f * static_cast<float>(t % 3);
    }
  });
  EXPECT_EQ(asked_queries, 8);
  ASSERT_EQ(ev->cached(), 20);
  ExpectRowsMatchPositions(*cache, seq, *ev);
  for (int32_t li = 0; li < kLayers * kHeads; ++li) {
    const std::set<int64_t> kept = Kept(*ev, li / kHeads, li % kHeads);
    for (int64_t p = 72; p < 80; ++p) EXPECT_TRUE(kept.count(p)) << "window " << p;
    const int64_t peak = 10 + 20 * (li % kHeads);
    for (int64_t p = peak - 1; p <= peak + 1; ++p) EXPECT_TRUE(kept.count(p)) << "pooled neighbour " << p;
  }
  for (int i = 0; i < 30; ++i) Step(*cache, seq, *ev, 1, false, NoWeights);
  EXPECT_EQ(ev->cached(), 50);
  EXPECT_EQ(cache->View(seq)->evicted, 60);
}

TEST(TokenEvictorTest, BadOptionsAreErrorsAtConfigurationAndALatentCacheIsOneListPerLayer) {
  EXPECT_EQ(ParseEvictionPolicy("lru", 0.5).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEvictionPolicy("h2o", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEvictionPolicy("h2o", 1.5).status().code(), StatusCode::kInvalidArgument);
  EvictionOptions o = *ParseEvictionPolicy("snapkv", 0.5);
  o.pool_kernel = 4;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  CacheConfig mla;
  mla.kind = CacheKind::kMla;
  mla.num_layers = 1;
  mla.num_q_heads = 4;
  mla.kv_lora_rank = 16;
  mla.block_len = 8;
  mla.num_blocks = 2;
  // A latent cache is one (layer, latent row) list per layer: eviction
  // works on it (src/engine/deepseek_model_test.cc runs it in the engine).
  EXPECT_TRUE(TokenEvictor::Create(*ParseEvictionPolicy("h2o", 0.5), *KvLayout::Create(mla)).ok());
}

}  // namespace
}  // namespace pagekv
