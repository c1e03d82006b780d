// The Redis tier over a real Redis Cluster (3 primaries + 3 replicas on
// loopback ports, testing::RedisCluster): blocks round-trip across every
// node from one seed; the hash slots are the server's own; a resharding
// (MOVED), a slot half-migrated (ASK), a new primary and a killed one
// (misses, then hits once its replica is promoted) are all followed;
// salts, model fingerprints and the tier key isolate exactly as on one
// server.
#include <chrono>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/tiers.h"
#include "testing/redis_cluster.h"
#include "tiers/block_payload.h"
#include "tiers/redis_transport.h"
#include "tiers/test_kv_model.h"

namespace pagekv {
namespace {

constexpr int32_t kBlockLen = 8;
constexpr int64_t kKvBytes = 2000;

BlockKey KeyOf(uint64_t i) {
  BlockKey k;
  std::mt19937_64 rng(i * 104729 + 3);
  for (auto& b : k.bytes) b = static_cast<uint8_t>(rng());
  return k;
}

BlockMeta Meta(uint64_t i) {
  BlockMeta m;
  m.key = KeyOf(i);
  for (int t = 0; t < kBlockLen; ++t) m.tokens.push_back(static_cast<int32_t>(i * 10 + t));
  m.geometry = 0xc1u;
  m.digest = m.key;
  return m;
}

std::vector<std::byte> Kv(uint64_t i) {
  std::vector<std::byte> kv(kKvBytes);
  std::mt19937 rng(static_cast<uint32_t>(i) + 77);
  for (auto& b : kv) b = static_cast<std::byte>(rng());
  return kv;
}

TEST(RedisClusterRoutingTest, KeySlotsAreTheServersAndRedirectsParse) {
  // CRC16/XMODEM's check value, and the hash tag rule.
  EXPECT_EQ(tiers::KeySlot("123456789"), 0x31C3 % 16384);
  EXPECT_EQ(tiers::KeySlot("{user1000}.following"), tiers::KeySlot("{user1000}.followers"));
  EXPECT_EQ(tiers::KeySlot("foo{}{bar}"), tiers::KeySlot("foo{}{bar}"));
  EXPECT_NE(tiers::KeySlot("foo{}{bar}"), tiers::KeySlot("bar"));  // an empty tag is no tag: the whole key
  EXPECT_EQ(tiers::KeySlot("foo{{bar}}zap"), tiers::KeySlot("{bar"));
  auto m = tiers::ParseRedirect("MOVED 3999 127.0.0.1:6381");
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->ask);
  EXPECT_EQ(m->slot, 3999);
  EXPECT_EQ(m->to.port, 6381);
  auto a = tiers::ParseRedirect("ASK 12 :7000");
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ask);
  EXPECT_TRUE(a->to.host.empty());
  for (const char* bad : {"ERR x", "MOVED", "MOVED 99999 h:1", "MOVED 1 h:0", "ASK x h:1", "MOVED 1 h"}) {
    EXPECT_FALSE(tiers::ParseRedirect(bad).has_value()) << bad;
  }
  EXPECT_FALSE(tiers::ParseClusterNodes("").ok());
  EXPECT_FALSE(tiers::ParseClusterNodes("redis://h:1").ok());
  EXPECT_FALSE(tiers::ParseClusterNodes("h").ok());
  EXPECT_FALSE(tiers::ParseClusterNodes("u:p@h:1").ok());
  EXPECT_EQ(tiers::ParseClusterNodes("a:1,b:2")->size(), 2u);
}

class RedisClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status s = cluster_.Start(3, 1);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  // A store given one seed only: the rest of the cluster is found from it.
  std::unique_ptr<BlockStore> Open(const std::string& ns = "pagekv:test", const std::string& payload_key = "") {
    RedisStoreOptions o;
    o.cluster_nodes = "127.0.0.1:" + std::to_string(cluster_.port(0));
    o.key_namespace = ns;
    o.payload_key = payload_key;
    o.timeout_ms = 300;
    o.backoff_initial_ms = 50;
    o.backoff_max_ms = 200;
    auto s = CreateRedisStore(o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return std::move(*s);
  }
  // Puts blocks [0, n) in one pipelined call.
  void PutAll(BlockStore& s, uint64_t n) {
    std::vector<BlockMeta> metas;
    std::vector<std::vector<std::byte>> data;
    for (uint64_t i = 0; i < n; ++i) {
      metas.push_back(Meta(i));
      data.push_back(Kv(i));
    }
    std::vector<std::span<const std::byte>> in(data.begin(), data.end());
    ASSERT_TRUE(s.PutMany(metas, in).ok());
  }
  // Which of blocks [0, n) come back, exact, in one pipelined call.
  std::vector<bool> GetAll(BlockStore& s, uint64_t n) {
    std::vector<BlockMeta> metas;
    for (uint64_t i = 0; i < n; ++i) metas.push_back(Meta(i));
    std::vector<std::vector<std::byte>> out(n, std::vector<std::byte>(kKvBytes));
    std::vector<std::span<std::byte>> spans(out.begin(), out.end());
    Result<std::vector<bool>> got = s.GetMany(metas, spans);
    EXPECT_TRUE(got.ok()) << got.status().ToString();
    if (!got.ok()) return std::vector<bool>(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      if ((*got)[i]) {
        EXPECT_EQ(out[i], Kv(i)) << "block " << i;
      }
    }
    return *got;
  }
  int64_t Count(const std::vector<bool>& v) { return std::count(v.begin(), v.end(), true); }
  std::string RedisKey(uint64_t i, const std::string& ns = "pagekv:test") { return ns + ":" + KeyOf(i).Hex(); }
  int NodeOf(uint64_t i) { return *cluster_.PrimaryOf(tiers::KeySlot(RedisKey(i))); }

  testing::RedisCluster cluster_;
};

TEST_F(RedisClusterTest, BlocksRoundTripAcrossEveryPrimaryFromOneSeed) {
  auto s = Open();
  PutAll(*s, 120);
  EXPECT_EQ(Count(GetAll(*s, 120)), 120);
  // Spread over the three primaries, on the slot the server itself computes.
  std::set<int> primaries;
  for (uint64_t i = 0; i < 120; ++i) {
    const std::string key = RedisKey(i);
    EXPECT_EQ(*cluster_.Command(0, {"CLUSTER", "KEYSLOT", key}), std::to_string(tiers::KeySlot(key)));
    primaries.insert(NodeOf(i));
    EXPECT_EQ(*cluster_.Command(NodeOf(i), {"EXISTS", key}), "1") << "block " << i << " on its slot's primary";
  }
  EXPECT_EQ(primaries.size(), 3u);
  std::vector<BlockKey> keys = {KeyOf(3), KeyOf(500), KeyOf(7)};
  EXPECT_EQ(*s->ContainsMany(keys), (std::vector<bool>{true, false, true}));
  ASSERT_TRUE(s->Remove(KeyOf(3)).ok());
  EXPECT_FALSE(*s->Contains(KeyOf(3)));
  const TierStats st = s->Stats();
  EXPECT_TRUE(st.healthy);
  EXPECT_EQ(st.puts, 120);
  EXPECT_GE(st.nodes, 3);
  EXPECT_EQ(st.moved, 0);
}

// redis-cli moves a thousand slots (and their keys) from one primary to
// another: the store's map is stale, the old owner answers MOVED, the store
// follows and reloads its map; every block still comes back.
TEST_F(RedisClusterTest, AReshardingIsFollowedThroughMoved) {
  auto s = Open();
  PutAll(*s, 150);
  EXPECT_EQ(Count(GetAll(*s, 150)), 150);
  const int from = NodeOf(0);
  const int to = NodeOf(0) == NodeOf(1) ? NodeOf(2) : NodeOf(1);
  ASSERT_NE(from, to);
  ASSERT_TRUE(cluster_.Reshard(from, to, 3000).ok());
  EXPECT_EQ(Count(GetAll(*s, 150)), 150);
  EXPECT_GT(s->Stats().moved, 0);
  // New blocks go to the new owners (the map reloaded first).
  std::vector<BlockMeta> more = {Meta(1000), Meta(1001)};
  std::vector<std::vector<std::byte>> kv = {Kv(1000), Kv(1001)};
  std::vector<std::span<const std::byte>> in(kv.begin(), kv.end());
  ASSERT_TRUE(s->PutMany(more, in).ok());
  std::vector<std::byte> out(kKvBytes);
  EXPECT_TRUE(*s->Get(Meta(1000), out));
  EXPECT_GE(s->Stats().slot_map_loads, 2);
  const int64_t moved = s->Stats().moved;
  EXPECT_EQ(Count(GetAll(*s, 150)), 150);
  EXPECT_EQ(s->Stats().moved, moved) << "the reloaded map routes straight to the new owners";
}

// One slot half-migrated: the blocks already moved are answered with ASK
// by the old owner, and the store asks the new one (ASKING) once; blocks
// not moved yet come from the old owner; the map does not change. Once the
// migration ends, MOVED takes over.
TEST_F(RedisClusterTest, AMigratingSlotIsFollowedThroughAsk) {
  // Blocks sharing one slot: keys put under a {tag} namespace.
  const std::string ns = "pagekv:{ask}";
  auto tagged = Open(ns);
  PutAll(*tagged, 10);
  const int slot = tiers::KeySlot(RedisKey(0, ns));
  const int from = *cluster_.PrimaryOf(slot);
  int to = -1;
  for (int other : {0, 5500, 11000, 16383}) {
    if (*cluster_.PrimaryOf(other) != from) to = *cluster_.PrimaryOf(other);
  }
  ASSERT_GE(to, 0);
  std::vector<std::string> moved;
  for (uint64_t i = 0; i < 5; ++i) moved.push_back(RedisKey(i, ns));
  ASSERT_TRUE(cluster_.BeginMigration(slot, from, to, moved).ok());
  EXPECT_EQ(Count(GetAll(*tagged, 10)), 10);
  EXPECT_GE(tagged->Stats().asked, 5);
  EXPECT_EQ(tagged->Stats().moved, 0);
  // A new key of the slot is stored where the migration sends it.
  std::vector<std::byte> out(kKvBytes);
  ASSERT_TRUE(tagged->Put(Meta(77), Kv(77)).ok());
  EXPECT_TRUE(*tagged->Get(Meta(77), out));
  EXPECT_EQ(out, Kv(77));
  // The rest moves and the slot is handed over.
  std::vector<std::string> rest;
  for (uint64_t i = 5; i < 10; ++i) rest.push_back(RedisKey(i, ns));
  if (*cluster_.Command(from, {"EXISTS", RedisKey(77, ns)}) == "1") rest.push_back(RedisKey(77, ns));
  std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", std::to_string(cluster_.port(to)), "", "0", "5000", "KEYS"};
  migrate.insert(migrate.end(), rest.begin(), rest.end());
  ASSERT_EQ(*cluster_.Command(from, migrate), "OK");
  ASSERT_TRUE(cluster_.FinishMigration(slot, to).ok());
  EXPECT_EQ(Count(GetAll(*tagged, 10)), 10);
  EXPECT_GT(tagged->Stats().moved, 0);
}

// A primary is killed: its blocks are misses at once (no error for the
// call, the other primaries' blocks still hit, nothing hangs); once the
// cluster promotes its replica, they hit again, and the store writes there.
// A node added later and given slots serves them.
TEST_F(RedisClusterTest, AKilledPrimaryIsMissesUntilItsReplicaTakesOver) {
  auto s = Open();
  PutAll(*s, 90);
  ASSERT_TRUE(cluster_.WaitForReplicas().ok());
  const int victim = NodeOf(0) == 0 ? NodeOf(1) == 0 ? NodeOf(2) : NodeOf(1) : NodeOf(0);  // not the seed
  ASSERT_NE(victim, 0);
  std::vector<bool> on_victim(90);
  for (uint64_t i = 0; i < 90; ++i) on_victim[i] = NodeOf(i) == victim;
  ASSERT_GT(Count(on_victim), 10);
  {
    // Killed, and looked at before any promotion can happen (node timeout
    // 1 s): the store finds out by itself.
    testing::RedisCluster* c = &cluster_;
    std::thread kill([c, victim] { (void)c->KillAndWaitForFailover(victim); });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<bool> during = GetAll(*s, 90);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
    for (uint64_t i = 0; i < 90; ++i) {
      if (!on_victim[i]) {
        EXPECT_TRUE(during[i]) << "block " << i << " on a live primary";
      }
    }
    EXPECT_LT(Count(during), 90);
    EXPECT_FALSE(s->Stats().healthy);
    kill.join();
  }
  ASSERT_FALSE(cluster_.running(victim));
  // Promoted: every block hits again (the replica had them all: WAIT above).
  std::vector<bool> after;
  for (int tries = 0; tries < 50; ++tries) {
    after = GetAll(*s, 90);
    if (Count(after) == 90) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(Count(after), 90);
  EXPECT_TRUE(s->Stats().healthy);
  ASSERT_TRUE(s->Put(Meta(500), Kv(500)).ok());
  // A new primary given slots (and their keys) serves them.
  Result<int> added = cluster_.AddPrimary();
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  ASSERT_TRUE(cluster_.Reshard(NodeOf(1), *added, 2000).ok());
  EXPECT_EQ(Count(GetAll(*s, 90)), 90);
  std::set<int> serving;
  for (uint64_t i = 0; i < 90; ++i) serving.insert(NodeOf(i));
  EXPECT_EQ(serving.count(*added), 1u) << "some blocks now live on the added node";
}

// Salts and model fingerprints isolate through the prefix cache over a
// cluster as over one server; a payload forged or sealed with another key
// is refused wherever it sits.
TEST_F(RedisClusterTest, SaltsFingerprintsAndTheTierKeyIsolateAcrossNodes) {
  const std::string tier_key = "cluster-tier-key-0123456789abcdef";
  auto run = [&](const std::string& ns, const std::vector<int32_t>& prompt, const ExtraKeys& extra, int salt,
                 bool serve) {
    TierOptions o;
    o.redis_cluster = cluster_.nodes();
    o.redis_namespace = ns;
    o.payload_key = tier_key;
    auto cache = test_kv::MakeCache(16, 8);
    auto tiers = std::move(*BlockTiers::Create(o, 8, cache->block_payload_bytes()));
    PrefixCacheOptions po;
    po.tiers = tiers.get();
    auto pc = std::move(*PrefixCache::Create(*cache, po));
    auto a = *pc->AddSequence(prompt, extra);
    const int64_t hit = a.match.num_tokens;
    test_kv::ExpectExactKv(*cache, a.seq, prompt, salt);
    if (serve) {
      test_kv::Compute(*cache, a.seq, prompt, hit, salt);
      EXPECT_TRUE(pc->Publish(a.seq, prompt).ok());
    }
    EXPECT_TRUE(pc->Free(a.seq).ok());
    tiers->Drain();
    return hit;
  };
  ExtraKeys alice, bob;
  alice.cache_salt = "alice";
  bob.cache_salt = "bob";
  const std::vector<int32_t> prompt = test_kv::Tokens(40, 10 * 8 + 1);
  EXPECT_EQ(run("pagekv:model-a", prompt, alice, 1, true), 0);
  EXPECT_EQ(run("pagekv:model-a", prompt, alice, 1, false), 10 * 8);  // another process: all from the cluster
  EXPECT_EQ(run("pagekv:model-a", prompt, bob, 2, false), 0);
  EXPECT_EQ(run("pagekv:model-a", prompt, {}, 0, false), 0);
  EXPECT_EQ(run("pagekv:model-b", prompt, alice, 1, false), 0);  // another model's namespace
  // Forged: a payload for block 0's key written by someone without the
  // tier key (a checksum-only seal), and one sealed with another key.
  auto stranger = Open("pagekv:test", "");
  auto other = Open("pagekv:test", tier_key + "-other");
  auto keyed = Open("pagekv:test", tier_key);
  ASSERT_TRUE(stranger->Put(Meta(1), Kv(1)).ok());
  ASSERT_TRUE(other->Put(Meta(2), Kv(2)).ok());
  std::vector<std::byte> out(kKvBytes);
  EXPECT_FALSE(*keyed->Get(Meta(1), out));
  EXPECT_FALSE(*keyed->Get(Meta(2), out));
  EXPECT_EQ(keyed->Stats().unauthenticated, 2);
  ASSERT_TRUE(keyed->Put(Meta(3), Kv(3)).ok());
  EXPECT_TRUE(*keyed->Get(Meta(3), out));
  EXPECT_EQ(out, Kv(3));
}

}  // namespace
}  // namespace pagekv
