// The router's KV index fed by real backends' events: a real PrefixCache
// (over a real KvCache, with real tiers) records its events, the real
// publisher encodes them in the wire format, the router decodes and
// indexes them; its predicted hit for a prompt must equal what that
// backend's own prefix cache would hit (Lookup), through publication,
// eviction, tiers, salts, another hash kind and a hybrid cache; malformed
// bytes are an error, never a crash.
#include "router/kv_events.h"

#include <random>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/tiers.h"
#include "prefix/kv_event_publisher.h"

namespace pagekv::router {
namespace {

constexpr int32_t B = 8;

std::vector<int32_t> Tokens(int32_t first, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + i;
  return t;
}

// One backend: a pool, optionally a RAM tier under it, and its prefix cache
// recording events; its events reach the index through the wire format.
struct Backend {
  Backend(int64_t blocks, BlockHasherOptions hasher, int64_t host_bytes = 0, std::vector<int32_t> windows = {}) {
    CacheConfig c;
    c.num_layers = windows.empty() ? 2 : static_cast<int32_t>(windows.size());
    c.layer_windows = std::move(windows);
    c.num_q_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.block_len = B;
    c.format = KvFormat::Plain(DType::kF16);
    c.num_blocks = blocks;
    cache = std::move(*KvCache::Create({.config = c, .prefault = false}));
    PrefixCacheOptions o;
    o.hasher = hasher;
    o.record_events = true;
    if (host_bytes > 0) {
      TierOptions t;
      t.host_bytes = host_bytes;
      tiers = std::move(*BlockTiers::Create(t, B, cache->block_payload_bytes()));
      o.tiers = tiers.get();
    }
    pc = std::move(*PrefixCache::Create(*cache, o));
  }
  // Admit, compute the rest, publish, free.
  void Serve(const std::vector<int32_t>& tokens, const ExtraKeys& extra = {}) {
    auto a = *pc->AddSequence(tokens, extra);
    ASSERT_TRUE(*cache->Reserve(a.seq, static_cast<int64_t>(tokens.size()) - a.match.num_tokens));
    ASSERT_TRUE(pc->Publish(a.seq, tokens).ok());
    if (cache->layout().hybrid()) {
      ASSERT_TRUE(cache->ReleaseOutOfWindow(a.seq).ok());
    }
    ASSERT_TRUE(pc->Free(a.seq).ok());
  }
  // Its events since the last call, through the wire.
  void Send(KvIndex& index, int id, bool hash_bytes = false) {
    if (tiers) tiers->Drain();
    const std::vector<KvEvent> events = pc->DrainEvents();
    if (events.empty()) return;
    KvEventWire wire;
    wire.hash_bytes = hash_bytes;
    const std::string payload = KvEventPublisher::EncodeBatch(events, 1.0, wire);
    Result<DecodedBatch> batch = DecodeKvEventBatch(payload);
    ASSERT_TRUE(batch.ok()) << batch.status().ToString();
    index.Apply(id, *batch);
  }
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<BlockTiers> tiers;
  std::unique_ptr<PrefixCache> pc;
};

int64_t Lookup(Backend& b, const std::vector<int32_t>& tokens, const ExtraKeys& extra = {}) {
  return b.pc->Lookup(tokens, extra)->num_tokens / B;
}

TEST(KvIndexTest, PredictedHitsEqualEachBackendsOwnLookup) {
  BlockHasherOptions sha;
  BlockHasherOptions xxh;
  xxh.kind = BlockHashKind::kXxh3_128;  // a random seed: the router cannot know the keys, only the content
  Backend a(40, sha), b(40, xxh);
  KvIndex index(B);
  const std::vector<int32_t> system = Tokens(1000, 3 * B);
  std::vector<int32_t> p1 = system, p2 = system, p3 = Tokens(5000, 4 * B + 1);
  for (int32_t t : Tokens(200, 2 * B + 3)) p1.push_back(t);
  for (int32_t t : Tokens(300, 5 * B)) p2.push_back(t);
  a.Serve(p1);
  b.Serve(p2);
  b.Serve(p3);
  a.Send(index, 0);
  b.Send(index, 1, /*hash_bytes=*/true);
  std::mt19937 rng(3);
  for (const std::vector<int32_t>* p : std::vector<const std::vector<int32_t>*>{&p1, &p2, &p3, &system}) {
    for (int cut = 1; cut <= static_cast<int>(p->size()); cut += 1 + static_cast<int>(rng() % 5)) {
      std::vector<int32_t> q(p->begin(), p->begin() + cut);
      q.push_back(99999);
      const std::vector<KvIndex::Hit> hits = index.Match(q, std::nullopt, 0, 2);
      EXPECT_EQ(hits[0].blocks, Lookup(a, q)) << "backend a, cut " << cut;
      EXPECT_EQ(hits[1].blocks, Lookup(b, q)) << "backend b, cut " << cut;
      EXPECT_EQ(hits[0].pool_blocks, hits[0].blocks);
    }
  }
  // Evictions reach the index: a hog takes b's whole pool.
  const SeqId hog = b.cache->AddSequence();
  ASSERT_TRUE(*b.cache->Reserve(hog, 40 * B));
  b.Send(index, 1, true);
  EXPECT_EQ(index.Match(p2, std::nullopt, 0, 2)[1].blocks, 0);
  EXPECT_EQ(index.BackendBlocks(1), 0);
  EXPECT_EQ(index.Match(p2, std::nullopt, 0, 2)[0].blocks, 3);  // a still holds the system prompt
  EXPECT_EQ(index.Stats().unknown_removals, 0);
  EXPECT_EQ(index.Stats().unknown_parent, 0);
}

TEST(KvIndexTest, SaltsSeparateAndTiersKeepAHitAfterThePoolLetsGo) {
  BlockHasherOptions sha;
  Backend a(12, sha, 1 << 20);
  KvIndex index(B);
  ExtraKeys alice;
  alice.cache_salt = "alice";
  const std::vector<int32_t> p = Tokens(10, 4 * B + 2);
  a.Serve(p, alice);
  a.Send(index, 0);
  EXPECT_EQ(index.Match(p, std::string("alice"), 0, 1)[0].blocks, 4);
  EXPECT_EQ(index.Match(p, std::string("bob"), 0, 1)[0].blocks, 0);
  EXPECT_EQ(index.Match(p, std::nullopt, 0, 1)[0].blocks, 0);
  // Evicted from the pool into RAM: still a hit (loaded), no longer in the pool.
  a.Serve(Tokens(700, 11 * B));
  a.Send(index, 0);
  EXPECT_EQ(Lookup(a, p, alice), 4);
  const KvIndex::Hit h = index.Match(p, std::string("alice"), 0, 1)[0];
  EXPECT_EQ(h.blocks, 4);
  EXPECT_LT(h.pool_blocks, 4);
  // The prefix cache reset (AllBlocksCleared) drops the pool's copies only:
  // what is left is what the backend still finds in RAM.
  a.pc->Clear();
  a.Send(index, 0);
  EXPECT_EQ(index.Match(p, std::string("alice"), 0, 1)[0].blocks, Lookup(a, p, alice));
  EXPECT_EQ(index.Match(Tokens(700, 11 * B), std::nullopt, 0, 1)[0].pool_blocks, 0);
  index.Forget(0);
  EXPECT_EQ(index.Match(p, std::string("alice"), 0, 1)[0].blocks, 0);
  EXPECT_EQ(index.Stats().blocks, 0);
}

TEST(KvIndexTest, AHybridBackendIsIndexedByItsFullGroupAndEventsMissedAreCounted) {
  BlockHasherOptions sha;
  Backend h(60, sha, 0, {20, 20, 0, 20, 20, 0});
  KvIndex index(B);
  const std::vector<int32_t> p = Tokens(40, 6 * B + 1);
  h.Serve(p);
  h.Send(index, 0);
  EXPECT_EQ(index.Match(p, std::nullopt, 0, 1)[0].blocks, 6);
  EXPECT_EQ(index.Stats().stored, 6);  // the sliding groups' events are not indexed
  // A router that starts late misses a chain's start: its continuation is
  // counted, not guessed at.
  KvIndex late(B);
  std::vector<int32_t> longer = p;
  for (int32_t t : Tokens(900, 3 * B)) longer.push_back(t);
  h.Serve(longer);
  h.Send(late, 0);
  EXPECT_EQ(late.Match(longer, std::nullopt, 0, 1)[0].blocks, 0);
  EXPECT_GT(late.Stats().unknown_parent, 0);
  // Another block length than the router's is not indexed.
  KvIndex other(16);
  h.Serve(Tokens(5000, 3 * B));
  h.Send(other, 0);
  EXPECT_GT(other.Stats().other_block_size, 0);
}

TEST(KvEventDecoderTest, MalformedBatchesAreErrorsNeverCrashes) {
  EXPECT_FALSE(DecodeKvEventBatch("").ok());
  EXPECT_FALSE(DecodeKvEventBatch("\xc1").ok());
  std::vector<KvEvent> events(1);
  events[0].keys.resize(2);
  events[0].token_ids = Tokens(0, 2 * B);
  events[0].block_len = B;
  const std::string good = KvEventPublisher::EncodeBatch(events, 2.0);
  ASSERT_TRUE(DecodeKvEventBatch(good).ok());
  events[0].token_ids.pop_back();  // token ids that do not fill the blocks
  EXPECT_FALSE(DecodeKvEventBatch(KvEventPublisher::EncodeBatch(events, 2.0)).ok());
  // Every truncation and random byte flips: an error or a batch, never a crash.
  std::mt19937 rng(11);
  for (size_t n = 0; n < good.size(); ++n) (void)DecodeKvEventBatch(std::string_view(good).substr(0, n));
  for (int i = 0; i < 2000; ++i) {
    std::string bad = good;
    for (int k = 0; k < 3; ++k) bad[rng() % bad.size()] = static_cast<char>(rng());
    (void)DecodeKvEventBatch(bad);
  }
}

}  // namespace
}  // namespace pagekv::router
