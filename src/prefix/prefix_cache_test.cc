// PrefixCache against the rules in include/pagekv/prefix_cache.h, on a real
// KvCache: isolation by salt, the one-token-short hit, all-or-nothing
// admission, eviction order, collisions caught by the token comparison,
// events, statistics.
#include "pagekv/prefix_cache.h"

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

constexpr int32_t kBlockLen = 8;
constexpr int32_t B = kBlockLen;

// One layer, or one per entry of `windows` (a hybrid cache's layer_windows).
std::unique_ptr<KvCache> MakeCache(int64_t blocks, std::vector<int32_t> windows = {}) {
  CacheConfig c;
  c.num_layers = windows.empty() ? 1 : static_cast<int32_t>(windows.size());
  c.layer_windows = std::move(windows);
  c.num_q_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.block_len = kBlockLen;
  c.format = KvFormat::Plain(DType::kF16);
  c.num_blocks = blocks;
  return std::move(*KvCache::Create({.config = c, .prefault = false}));
}

std::vector<int32_t> Tokens(int32_t first, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

// Runs a request to completion: admit, compute (reserve) the rest, publish
// every full block, free. Returns the hit tokens, or -1 when it did not fit.
int64_t Serve(KvCache& cache, PrefixCache& pc, const std::vector<int32_t>& tokens, const ExtraKeys& extra = {}) {
  auto admitted = pc.AddSequence(tokens, extra);
  EXPECT_TRUE(admitted.ok()) << admitted.status().ToString();
  const int64_t hit = admitted->match.num_tokens;
  auto fit = cache.Reserve(admitted->seq, static_cast<int64_t>(tokens.size()) - hit);
  EXPECT_TRUE(fit.ok());
  if (!*fit) {
    EXPECT_TRUE(pc.Free(admitted->seq).ok());
    return -1;
  }
  EXPECT_TRUE(pc.Publish(admitted->seq, tokens).ok());
  EXPECT_TRUE(pc.Free(admitted->seq).ok());
  return hit;
}

class PrefixCacheTest : public ::testing::TestWithParam<BlockHashKind> {
 protected:
  void SetUp() override {
    cache_ = MakeCache(16);
    PrefixCacheOptions o;
    o.hasher.kind = GetParam();
    o.record_events = true;
    pc_ = std::move(*PrefixCache::Create(*cache_, o));
  }
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<PrefixCache> pc_;
};

TEST_P(PrefixCacheTest, SaltedAndUnsaltedRequestsNeverShareTheSameSaltDoes) {
  const std::vector<int32_t> prompt = Tokens(100, 3 * B + 1);  // 3 full blocks + 1 token
  ExtraKeys alice, bob;
  alice.cache_salt = "tenant-alice";
  bob.cache_salt = "tenant-bob";
  EXPECT_EQ(Serve(*cache_, *pc_, prompt), 0);
  EXPECT_EQ(Serve(*cache_, *pc_, prompt, alice), 0);
  EXPECT_EQ(Serve(*cache_, *pc_, prompt, bob), 0);
  EXPECT_EQ(Serve(*cache_, *pc_, prompt, alice), 3 * B);
  EXPECT_EQ(Serve(*cache_, *pc_, prompt), 3 * B);
  EXPECT_EQ(Serve(*cache_, *pc_, prompt, bob), 3 * B);
  // Three separate chains of 3 blocks.
  EXPECT_EQ(pc_->Stats().cached_blocks, 9);
  // Keys differ from the first block on.
  EXPECT_FALSE((*pc_->Keys(prompt, alice))[0] == (*pc_->Keys(prompt, {}))[0]);
  EXPECT_FALSE((*pc_->Keys(prompt, alice))[2] == (*pc_->Keys(prompt, bob))[2]);
  ExtraKeys adapter;
  adapter.adapter_id = 7;
  EXPECT_EQ(Serve(*cache_, *pc_, prompt, adapter), 0) << "another adapter computes other KV";
  pc_->CheckInvariants();
  cache_->CheckInvariants();
}

TEST_P(PrefixCacheTest, AFullyCachedPromptLeavesItsLastTokenToCompute) {
  const std::vector<int32_t> prompt = Tokens(1, 3 * B);  // exactly 3 blocks
  EXPECT_EQ(Serve(*cache_, *pc_, prompt), 0);
  auto m = pc_->Lookup(prompt, {});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_tokens, 2 * B) << "one token short of the prompt, rounded down to a block";
  EXPECT_EQ((*pc_->Lookup(prompt, {}, 3 * B)).num_tokens, 3 * B) << "an explicit limit may take all";
  EXPECT_EQ((*pc_->Lookup(Tokens(1, 3 * B + 1), {})).num_tokens, 3 * B);
  EXPECT_EQ((*pc_->Lookup(Tokens(1, 1), {})).num_tokens, 0);
  EXPECT_EQ((*pc_->Lookup({}, {})).num_tokens, 0);
}

TEST_P(PrefixCacheTest, AFailedAdmissionChangesNothing) {
  // Fill the cache: 4 prompts of 3 full blocks, all cached and free.
  for (int32_t r = 0; r < 4; ++r) Serve(*cache_, *pc_, Tokens(1000 * (r + 1), 3 * B));
  ASSERT_EQ(pc_->Stats().cached_blocks, 12);
  (void)pc_->DrainEvents();
  const auto free_before = cache_->Stats();
  const std::vector<BlockId> order_before = cache_->FreeBlocks();
  const auto stats_before = pc_->Stats();
  // Hits the first prompt's 2 blocks, then needs 15 more: cannot fit in 16.
  std::vector<int32_t> big = Tokens(1000, 2 * B);
  const std::vector<int32_t> tail = Tokens(50000, 15 * B);
  big.insert(big.end(), tail.begin(), tail.end());
  auto match = pc_->Lookup(big, {});
  ASSERT_TRUE(match.ok());
  EXPECT_EQ(match->num_tokens, 2 * B);
  EXPECT_FALSE(pc_->CanAdmit(*match, static_cast<int64_t>(big.size()) - match->num_tokens));
  const auto stats_after = pc_->Stats();
  EXPECT_EQ(stats_after.lookups, stats_before.lookups) << "an ask is not a lookup";
  EXPECT_EQ(cache_->FreeBlocks(), order_before) << "an ask moves no block";
  // A request with no hit that does not fit: its failed Reserve moves nothing.
  const SeqId plain = cache_->AddSequence();
  EXPECT_FALSE(*cache_->Reserve(plain, 17 * B));
  EXPECT_EQ(cache_->FreeBlocks(), order_before);
  EXPECT_TRUE(pc_->DrainEvents().empty());
  ASSERT_TRUE(cache_->Free(plain).ok());
  // The act, attempted anyway, fails on Reserve and leaves everything as it was.
  auto admitted = pc_->AddSequence(big, {});
  ASSERT_TRUE(admitted.ok());
  EXPECT_FALSE(*cache_->Reserve(admitted->seq, static_cast<int64_t>(big.size()) - 2 * B));
  EXPECT_EQ(cache_->Stats().blocks_free + 2, free_before.blocks_free) << "only the claimed hits are out";
  EXPECT_TRUE(pc_->DrainEvents().empty()) << "nothing evicted";
  EXPECT_EQ(pc_->Stats().cached_blocks, 12);
  ASSERT_TRUE(pc_->Free(admitted->seq).ok());
  EXPECT_EQ(cache_->Stats().blocks_free, free_before.blocks_free);
  pc_->CheckInvariants();
  cache_->CheckInvariants();
}

TEST_P(PrefixCacheTest, EvictionIsLeastRecentlyUsedDeeperFirstAndRecycledBlocksLoseTheirKeys) {
  // 16 blocks. Request A (4 blocks), then B (4 blocks), then A's first two
  // blocks hit again by C (C: 2 hit + 2 new).
  const std::vector<int32_t> a = Tokens(10, 4 * B), b = Tokens(500, 4 * B);
  std::vector<int32_t> c = Tokens(10, 2 * B);
  const std::vector<int32_t> c_tail = Tokens(900, 2 * B);
  c.insert(c.end(), c_tail.begin(), c_tail.end());
  Serve(*cache_, *pc_, a);
  Serve(*cache_, *pc_, b);
  EXPECT_EQ(Serve(*cache_, *pc_, c), 2 * B);
  const std::vector<BlockKey> ka = *pc_->Keys(a, {}), kb = *pc_->Keys(b, {}), kc = *pc_->Keys(c, {});
  ASSERT_EQ(pc_->Stats().cached_blocks, 10);
  (void)pc_->DrainEvents();
  // 6 plain free blocks go first. Then least recently used first: A's
  // blocks 3 and 2 (deeper first), B's 3, 2, 1, 0, then what C released,
  // deepest first: its own 3 and 2, then the hit blocks A1, A0.
  const std::vector<BlockKey> want = {ka[3], ka[2], kb[3], kb[2], kb[1], kb[0], kc[3], kc[2], ka[1], ka[0]};
  for (size_t i = 0; i < 6 + want.size(); ++i) {
    const SeqId s = cache_->AddSequence();
    ASSERT_TRUE(*cache_->Reserve(s, kBlockLen));
    if (i >= 6) {
      const std::vector<KvEvent> ev = pc_->DrainEvents();
      ASSERT_EQ(ev.size(), 1u) << i;
      EXPECT_EQ(ev[0].type, KvEvent::Type::kBlockRemoved);
      ASSERT_EQ(ev[0].keys.size(), 1u);
      EXPECT_EQ(ev[0].keys[0].Hex(), want[i - 6].Hex()) << "eviction " << i - 6;
      EXPECT_FALSE(pc_->Find(want[i - 6]).has_value()) << "a recycled block has no key";
      const BlockId got = (*cache_->View(s)).blocks[0];
      EXPECT_FALSE(cache_->IsBlockCached(got));
    } else {
      EXPECT_TRUE(pc_->DrainEvents().empty()) << "plain free blocks go before any cached one";
    }
  }
  EXPECT_EQ(pc_->Stats().cached_blocks, 0);
  EXPECT_EQ(pc_->Stats().evicted, 10);
  pc_->CheckInvariants();
}

TEST_P(PrefixCacheTest, EventsComeInOrderAndDescribeWhatWasStored) {
  ExtraKeys e;
  e.cache_salt = "s1";
  e.adapter_id = 3;
  e.model_fingerprint = "fp";
  const std::vector<int32_t> p = Tokens(7, 2 * B + 2);  // 2 full blocks
  Serve(*cache_, *pc_, p, e);
  std::vector<int32_t> q = Tokens(7, 2 * B);
  const std::vector<int32_t> q_tail = Tokens(2000, B);  // a new 3rd block
  q.insert(q.end(), q_tail.begin(), q_tail.end());
  Serve(*cache_, *pc_, q, e);
  pc_->Clear();
  const std::vector<KvEvent> ev = pc_->DrainEvents();
  ASSERT_EQ(ev.size(), 3u);
  for (size_t i = 0; i < ev.size(); ++i) EXPECT_EQ(ev[i].sequence, i + 1);
  const std::vector<BlockKey> kp = *pc_->Keys(p, e), kq = *pc_->Keys(q, e);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kBlockStored);
  ASSERT_EQ(ev[0].keys.size(), 2u);
  EXPECT_EQ(ev[0].keys[1].Hex(), kp[1].Hex());
  EXPECT_FALSE(ev[0].parent.has_value());
  EXPECT_EQ(ev[0].token_ids, Tokens(7, 2 * B));
  EXPECT_EQ(ev[0].block_len, kBlockLen);
  EXPECT_EQ(ev[0].adapter_id, 3);
  EXPECT_EQ(ev[0].extra_keys, (std::vector<std::string>{"salt:s1", "model:fp"}));
  EXPECT_EQ(ev[1].type, KvEvent::Type::kBlockStored);
  ASSERT_EQ(ev[1].keys.size(), 1u);
  EXPECT_EQ(ev[1].keys[0].Hex(), kq[2].Hex());
  ASSERT_TRUE(ev[1].parent.has_value());
  EXPECT_EQ(ev[1].parent->Hex(), kp[1].Hex());
  EXPECT_EQ(ev[2].type, KvEvent::Type::kAllBlocksCleared);
  EXPECT_EQ(pc_->Stats().cached_blocks, 0);
  EXPECT_EQ(cache_->Stats().blocks_cached_free, 0);
  pc_->CheckInvariants();
}

TEST_P(PrefixCacheTest, StatisticsCountTokensAndBlocks) {
  const std::vector<int32_t> p = Tokens(1, 2 * B + 2);
  Serve(*cache_, *pc_, p);
  Serve(*cache_, *pc_, p);
  const PrefixCacheStats st = pc_->Stats();
  EXPECT_EQ(st.lookups, 2);
  EXPECT_EQ(st.requested_tokens, 2 * (2 * B + 2));
  EXPECT_EQ(st.requested_blocks, 4);
  EXPECT_EQ(st.hit_blocks, 2);
  EXPECT_EQ(st.hit_tokens, 2 * B);
  EXPECT_EQ(st.inserted, 2);
  EXPECT_DOUBLE_EQ(st.token_hit_rate, 2.0 * B / (2 * (2 * B + 2)));
  EXPECT_DOUBLE_EQ(st.block_hit_rate, 0.5);
  EXPECT_DOUBLE_EQ(st.recent_block_hit_rate, 0.5);
}

INSTANTIATE_TEST_SUITE_P(Hashes, PrefixCacheTest, ::testing::Values(BlockHashKind::kSha256, BlockHashKind::kXxh3_128),
                         [](const auto& info) { return info.param == BlockHashKind::kSha256 ? "Sha256" : "Xxh3"; });

TEST(PrefixCacheCollisionTest, AForcedCollisionIsCaughtByTheTokenComparison) {
  auto cache = MakeCache(8);
  PrefixCacheOptions o;
  // Every block of every request hashes to the same key.
  o.hasher.custom = [](std::span<const uint8_t>) { return BlockKey{}; };
  auto pc = std::move(*PrefixCache::Create(*cache, o));
  EXPECT_EQ(Serve(*cache, *pc, Tokens(1, 2 * B + 1)), 0);
  EXPECT_EQ(pc->Stats().cached_blocks, 1) << "the second block collides with the first: not published";
  EXPECT_EQ(Serve(*cache, *pc, Tokens(500, 2 * B + 1)), 0) << "same key, other tokens: a miss";
  EXPECT_GE(pc->Stats().collisions, 1);
  EXPECT_EQ(Serve(*cache, *pc, Tokens(1, 2 * B + 1)), B) << "the genuine block still hits";
  pc->CheckInvariants();
}

// A second prefix cache over the same KvCache would take the first's
// listeners (its cached blocks then reused with their keys still indexed):
// refused, and the first keeps working; once it is gone, another may bind.
TEST(PrefixCacheBadInputTest, ASecondPrefixCacheOverOneKvCacheIsRefused) {
  auto cache = MakeCache(4);
  auto first = PrefixCache::Create(*cache);
  ASSERT_TRUE(first.ok());
  auto second = PrefixCache::Create(*cache);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("one per KvCache"), std::string::npos) << second.status().ToString();
  EXPECT_EQ(Serve(*cache, **first, Tokens(1, 2 * B + 1)), 0);
  EXPECT_EQ(Serve(*cache, **first, Tokens(1, 2 * B + 1)), 2 * B);
  // Evictions still reach the first: other tokens through the small pool
  // recycle its cached blocks, and the old prompt then misses.
  EXPECT_EQ(Serve(*cache, **first, Tokens(700, 4 * B)), 0);
  EXPECT_EQ(Serve(*cache, **first, Tokens(1, 2 * B + 1)), 0);
  (*first)->CheckInvariants();
  first->reset();
  EXPECT_TRUE(PrefixCache::Create(*cache).ok());
}

TEST(PrefixCacheBadInputTest, EmptySaltAndOversizeKeysAreNamed) {
  auto cache = MakeCache(4);
  auto pc = std::move(*PrefixCache::Create(*cache));
  ExtraKeys e;
  e.cache_salt = "";
  Status s = pc->Lookup(Tokens(1, 9), e).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("salt is empty"), std::string::npos);
  e.cache_salt.reset();
  e.extra = {std::string(2000, 'x')};
  s = pc->AddSequence(Tokens(1, 9), e).status();
  EXPECT_NE(s.message().find("1024"), std::string::npos);
  EXPECT_EQ(cache->num_sequences(), 0);
  EXPECT_EQ(pc->Publish(SeqId{42}, Tokens(1, 4)).code(), StatusCode::kNotFound);
}

TEST(PrefixCacheHashTest, KeysAreStableForAFixedSeedAndDifferAcrossSeeds) {
  auto cache = MakeCache(4);
  PrefixCacheOptions a, b, c;
  a.hasher.kind = b.hasher.kind = c.hasher.kind = BlockHashKind::kXxh3_128;
  a.hasher.seed = b.hasher.seed = 1;
  c.hasher.seed = 2;
  auto pa = std::move(*PrefixCache::Create(*cache, a));
  const auto ka = *pa->Keys(Tokens(1, 2 * B), {});
  pa.reset();
  auto pb = std::move(*PrefixCache::Create(*cache, b));
  const auto kb = *pb->Keys(Tokens(1, 2 * B), {});
  pb.reset();
  auto pc = std::move(*PrefixCache::Create(*cache, c));
  const auto kc = *pc->Keys(Tokens(1, 2 * B), {});
  EXPECT_EQ(ka[1].Hex(), kb[1].Hex());
  EXPECT_NE(ka[1].Hex(), kc[1].Hex());
  EXPECT_EQ(ka[1].size, 16);
  // SHA-256 of the documented encoding is fixed: a change to the encoding
  // must be deliberate (it would orphan every key stored in a tier).
  pc.reset();
  auto ps = std::move(*PrefixCache::Create(*cache));
  EXPECT_EQ((*ps->Keys(Tokens(1, B), {}))[0].size, 32);
}

// An MLA latent cache (one latent row per token and layer, no per-head K
// and V) is cached, shared and reported like any other: the prefix cache
// keys blocks by tokens, never by what their rows hold.
TEST(PrefixCacheLatentTest, ALatentCacheIsSharedAndItsEventsAreThePerHeadOnes) {
  CacheConfig c;
  c.kind = CacheKind::kMla;
  c.num_layers = 2;
  c.num_q_heads = 4;
  c.head_dim = 16;
  c.kv_lora_rank = 32;
  c.rope_dim = 8;
  c.block_len = kBlockLen;
  c.format = KvFormat::ForDType(DType::kInt8, 40);
  c.num_blocks = 8;
  auto cache = std::move(*KvCache::Create({.config = c, .prefault = false}));
  PrefixCacheOptions o;
  o.record_events = true;
  auto pc = std::move(*PrefixCache::Create(*cache, o));
  const std::vector<int32_t> prompt = Tokens(5, 2 * B + 3);
  EXPECT_EQ(Serve(*cache, *pc, prompt), 0);
  EXPECT_EQ(Serve(*cache, *pc, prompt), 2 * B) << "the second request finds both full latent blocks";
  const std::vector<KvEvent> ev = pc->DrainEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kBlockStored);
  ASSERT_EQ(ev[0].keys.size(), 2u);
  EXPECT_EQ(ev[0].keys[1].Hex(), (*pc->Keys(prompt, {}))[1].Hex());
  EXPECT_EQ(ev[0].token_ids, Tokens(5, 2 * B));
  pc->CheckInvariants();
  cache->CheckInvariants();
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// A hybrid cache (4 sliding layers of window 20 and 2 full: 3 groups of 2
// layers): each group publishes its blocks under the token block's key and
// announces them with its group_idx and window; a hit needs the full group's
// whole prefix and the sliding groups' window before the cut, the longest
// such cut; evicting a sliding group's block near the cut shortens the hit
// to the next cut whose window is whole; its removal names the group.
TEST(HybridPrefixCacheTest, HitsNeedTheFullPrefixAndTheWindowBeforeTheCut) {
  auto cache = MakeCache(60, {20, 20, 0, 20, 20, 0});
  ASSERT_EQ(cache->layout().num_groups(), 3);
  PrefixCacheOptions o;
  o.record_events = true;
  auto pc = std::move(*PrefixCache::Create(*cache, o));
  const std::vector<int32_t> prompt = Tokens(100, 6 * B + 3);  // 6 full blocks
  auto a = *pc->AddSequence(prompt, {});
  ASSERT_TRUE(*cache->Reserve(a.seq, static_cast<int64_t>(prompt.size())));
  ASSERT_TRUE(pc->Publish(a.seq, prompt).ok());
  ASSERT_TRUE(cache->ReleaseOutOfWindow(a.seq).ok());  // published first: released blocks stay cached
  ASSERT_TRUE(pc->Free(a.seq).ok());
  pc->CheckInvariants();
  cache->CheckInvariants();
  std::vector<KvEvent> events = pc->DrainEvents();
  ASSERT_EQ(events.size(), 3u);  // one batch of 6 blocks per group
  for (int32_t g = 0; g < 3; ++g) {
    EXPECT_EQ(events[static_cast<size_t>(g)].group, g);
    EXPECT_EQ(events[static_cast<size_t>(g)].window, g == 0 ? 0 : 20);
    EXPECT_EQ(events[static_cast<size_t>(g)].keys.size(), 6u);
    EXPECT_EQ(events[static_cast<size_t>(g)].keys, events[0].keys);  // the same token blocks
  }
  // Every cut point: a prompt sharing the first k tokens hits floor(k / 8) blocks.
  for (int32_t k = 1; k <= 6 * B; ++k) {
    std::vector<int32_t> p(prompt.begin(), prompt.begin() + k);
    for (int32_t t : Tokens(9000, 4)) p.push_back(t);
    const PrefixMatch m = *pc->Lookup(p, {});
    EXPECT_EQ(m.num_tokens, (k / B) * B) << "cut " << k;
    ASSERT_EQ(m.group_blocks.size(), 3u);
    // The sliding groups' tables start with kNoBlock before the window of
    // the first query after the hit.
    const int64_t n = k / B, first = std::max<int64_t>(0, n * B - 20 + 1) / B;
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_NE(m.group_blocks[0][static_cast<size_t>(j)], kNoBlock);
      EXPECT_EQ(m.group_blocks[1][static_cast<size_t>(j)] == kNoBlock, j < first) << "cut " << k << " block " << j;
    }
  }
  // A hit admits a sequence over every group's blocks and computes on.
  std::vector<int32_t> longer(prompt.begin(), prompt.begin() + 6 * B);
  for (int32_t t : Tokens(7000, 10)) longer.push_back(t);
  auto b = *pc->AddSequence(longer, {});
  EXPECT_EQ(b.match.num_tokens, 6 * B);
  EXPECT_EQ(cache->View(b.seq, 1)->released_blocks, (6 * B - 20 + 1) / B);
  ASSERT_TRUE(*cache->Reserve(b.seq, 10));
  ASSERT_TRUE(pc->Free(b.seq).ok());
  cache->CheckInvariants();
  pc->CheckInvariants();
  (void)pc->DrainEvents();
  // Evict the whole pool's cached blocks: each removal names its group.
  const SeqId hog = cache->AddSequence();
  ASSERT_TRUE(*cache->Reserve(hog, 60 / 3 * B));
  events = pc->DrainEvents();
  std::vector<int> removed(3, 0);
  for (const KvEvent& e : events) {
    ASSERT_EQ(e.type, KvEvent::Type::kBlockRemoved);
    ++removed[static_cast<size_t>(e.group)];
  }
  EXPECT_EQ(removed[0], 6);
  EXPECT_GT(removed[1], 0);
  const PrefixMatch none = *pc->Lookup(longer, {});
  EXPECT_EQ(none.num_tokens, 0);
  ASSERT_TRUE(cache->Free(hog).ok());
  pc->CheckInvariants();
}

}  // namespace
}  // namespace pagekv
