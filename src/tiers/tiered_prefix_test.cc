// The prefix cache over a real KvCache with lower tiers: blocks evicted from
// the pool come back from RAM, disk (also after a restart) or Redis with
// exactly their KV; salts stay apart in every tier; a corrupt block is a
// shorter hit, never wrong KV.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/tiers.h"
#include "testing/redis_server.h"
#include "tiers/block_payload.h"
#include "tiers/test_kv_model.h"

namespace pagekv {
namespace {

constexpr int32_t B = 8;  // block_len

std::unique_ptr<KvCache> MakeCache(int64_t blocks) { return test_kv::MakeCache(blocks, B); }
using test_kv::Compute;
using test_kv::ExpectExactKv;
using test_kv::Tokens;

struct Served {
  int64_t hit_tokens = 0;
  std::vector<Tier> loaded;
};

// Admit (loading from tiers), check the hit's KV, compute the rest, publish, free.
Served Serve(KvCache& cache, PrefixCache& pc, const std::vector<int32_t>& tokens, const ExtraKeys& extra = {}, int salt = 0) {
  auto a = pc.AddSequence(tokens, extra);
  EXPECT_TRUE(a.ok()) << a.status().ToString();
  ExpectExactKv(cache, a->seq, tokens, salt);
  Compute(cache, a->seq, tokens, a->match.num_tokens, salt);
  ExpectExactKv(cache, a->seq, tokens, salt);
  EXPECT_TRUE(pc.Publish(a->seq, tokens).ok());
  EXPECT_TRUE(pc.Free(a->seq).ok());
  pc.CheckInvariants();
  cache.CheckInvariants();
  return {a->match.num_tokens, a->match.lower};
}

class TieredPrefixTest : public ::testing::Test {
 protected:
  void TearDown() override {
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }
  // A pool of `blocks` with the given tiers under it.
  void Open(int64_t blocks, TierOptions o) {
    pc_.reset();
    tiers_.reset();
    cache_ = MakeCache(blocks);
    auto t = BlockTiers::Create(o, B, cache_->block_payload_bytes());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tiers_ = std::move(*t);
    PrefixCacheOptions po;
    po.tiers = tiers_.get();
    po.record_events = true;
    pc_ = std::move(*PrefixCache::Create(*cache_, po));
  }
  void Close() {
    pc_.reset();
    tiers_.reset();
    cache_.reset();
  }
  std::string disk_ = (std::filesystem::temp_directory_path() / ("pagekv-tiered-" + std::to_string(::getpid()))).string();
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<BlockTiers> tiers_;
  std::unique_ptr<PrefixCache> pc_;
};

TEST_F(TieredPrefixTest, EvictedBlocksComeBackFromRamWithTheirExactKv) {
  TierOptions o;
  o.host_bytes = 1 << 20;
  Open(6, o);
  const auto a = Tokens(100, 4 * B + 3), b = Tokens(500, 5 * B), c = Tokens(900, 5 * B);
  EXPECT_EQ(Serve(*cache_, *pc_, a).hit_tokens, 0);
  Serve(*cache_, *pc_, b);  // evicts a's blocks into RAM
  Serve(*cache_, *pc_, c);
  const Served again = Serve(*cache_, *pc_, a);
  EXPECT_EQ(again.hit_tokens, 4 * B);
  EXPECT_EQ(again.loaded, std::vector<Tier>(4, Tier::kHost));
  const PrefixCacheStats st = pc_->Stats();
  EXPECT_EQ(st.tier_hit_blocks[1], 4);
  EXPECT_EQ(st.hit_blocks, 4);
  // Events: blocks moved to the host tier say so.
  int to_host = 0;
  for (const KvEvent& e : pc_->DrainEvents()) to_host += e.type == KvEvent::Type::kBlockStored && e.tier == "host";
  EXPECT_GT(to_host, 0);
}

TEST_F(TieredPrefixTest, ASaltNeverHitsAnotherSaltsBlocksInAnyTier) {
  testing::RedisServer redis;
  ASSERT_TRUE(redis.Start().ok());
  TierOptions o;
  o.host_bytes = 1 << 20;
  o.disk_path = disk_;
  o.disk_bytes = 1 << 20;
  o.redis_url = redis.url();
  Open(6, o);
  ExtraKeys alice, bob;
  alice.cache_salt = "alice";
  bob.cache_salt = "bob";
  const auto p = Tokens(100, 4 * B + 1);
  Serve(*cache_, *pc_, p, alice, 1);
  Serve(*cache_, *pc_, Tokens(500, 5 * B));
  Serve(*cache_, *pc_, Tokens(900, 5 * B));
  tiers_->Drain();
  EXPECT_EQ(Serve(*cache_, *pc_, p, bob, 2).hit_tokens, 0);
  EXPECT_EQ(Serve(*cache_, *pc_, p, {}, 0).hit_tokens, 0);
  EXPECT_EQ(Serve(*cache_, *pc_, p, alice, 1).hit_tokens, 4 * B);
  // A fresh pool and RAM over the same disk and Redis: still apart.
  Close();
  std::filesystem::remove(disk_);
  std::filesystem::remove(disk_ + ".index");
  o.host_bytes = 0;
  Open(6, o);
  ExtraKeys carol;
  carol.cache_salt = "carol";
  EXPECT_EQ(Serve(*cache_, *pc_, p, carol, 3).hit_tokens, 0);
  const Served from_redis = Serve(*cache_, *pc_, p, alice, 1);
  EXPECT_EQ(from_redis.hit_tokens, 4 * B);
  EXPECT_EQ(from_redis.loaded, std::vector<Tier>(4, Tier::kRedis));
  Close();
}

TEST_F(TieredPrefixTest, DiskBlocksSurviveARestart) {
  TierOptions o;
  o.disk_path = disk_;
  o.disk_bytes = 1 << 20;
  Open(8, o);
  const auto a = Tokens(7, 3 * B + 2);
  Serve(*cache_, *pc_, a);
  Close();  // the engine stops: the pool is gone
  Open(8, o);
  const Served again = Serve(*cache_, *pc_, a);
  EXPECT_EQ(again.hit_tokens, 3 * B);
  EXPECT_EQ(again.loaded, std::vector<Tier>(3, Tier::kDisk));
}

TEST_F(TieredPrefixTest, ACorruptBlockEndsTheHitThereAndTheRestIsRecomputed) {
  TierOptions o;
  o.disk_path = disk_;
  o.disk_bytes = 1 << 20;
  o.disk_direct_io = false;
  Open(8, o);
  const auto a = Tokens(7, 4 * B + 2);
  Serve(*cache_, *pc_, a);
  Close();
  // Flip a KV byte in every slot: the first block to load fails its checksum.
  {
    const int fd = ::open(disk_.c_str(), O_RDWR);
    const auto size = static_cast<off_t>(std::filesystem::file_size(disk_));
    for (off_t at = static_cast<off_t>(tiers::kHeaderBytes) + 4 * B + 5; at < size; at += 4096 * 2) {
      char c = 0;
      ASSERT_EQ(::pread(fd, &c, 1, at), 1);
      c = static_cast<char>(c ^ 0x40);
      ASSERT_EQ(::pwrite(fd, &c, 1, at), 1);
    }
    ::close(fd);
  }
  Open(8, o);
  const Served again = Serve(*cache_, *pc_, a);  // checks the KV is exact
  EXPECT_LT(again.hit_tokens, 4 * B);
  EXPECT_EQ(pc_->Stats().tier_load_failures, 1);
  EXPECT_GE(tiers_->Stats().tiers[0].corrupt, 1);
}

TEST_F(TieredPrefixTest, RedisSharesBlocksBetweenTwoCachesAndSurvivesItsDeath) {
  testing::RedisServer redis;
  ASSERT_TRUE(redis.Start().ok());
  TierOptions o;
  o.redis_url = redis.url();
  o.redis_namespace = "pagekv:test-model";
  Open(8, o);
  const auto a = Tokens(3, 3 * B + 1);
  Serve(*cache_, *pc_, a);
  tiers_->Drain();
  // A second cache (another process in production) with its own pool.
  auto cache2 = MakeCache(8);
  auto tiers2 = std::move(*BlockTiers::Create(o, B, cache2->block_payload_bytes()));
  PrefixCacheOptions po;
  po.tiers = tiers2.get();
  auto pc2 = std::move(*PrefixCache::Create(*cache2, po));
  const Served shared = Serve(*cache2, *pc2, a);
  EXPECT_EQ(shared.hit_tokens, 3 * B);
  EXPECT_EQ(shared.loaded, std::vector<Tier>(3, Tier::kRedis));
  // Another model's namespace sees nothing.
  TierOptions other = o;
  other.redis_namespace = "pagekv:other-model";
  auto cache3 = MakeCache(8);
  auto tiers3 = std::move(*BlockTiers::Create(other, B, cache3->block_payload_bytes()));
  po.tiers = tiers3.get();
  auto pc3 = std::move(*PrefixCache::Create(*cache3, po));
  EXPECT_EQ(Serve(*cache3, *pc3, a).hit_tokens, 0);
  // Redis dies: everything is computed, nothing hangs or fails.
  redis.Kill();
  const auto b = Tokens(40, 3 * B + 1);
  auto cache4 = MakeCache(8);
  auto tiers4 = std::move(*BlockTiers::Create(o, B, cache4->block_payload_bytes()));
  po.tiers = tiers4.get();
  auto pc4 = std::move(*PrefixCache::Create(*cache4, po));
  EXPECT_EQ(Serve(*cache4, *pc4, a).hit_tokens, 0);
  EXPECT_EQ(Serve(*cache4, *pc4, b).hit_tokens, 0);
  pc2.reset();
  pc3.reset();
  pc4.reset();
}

// BlockMetas names a block as the tiers store it: a store filled by
// write-through answers every meta of the prompt, and a block moved by hand
// (Get -> WriteBlock) into a second pool holds exactly the first pool's
// KV. Another salt's metas miss.
TEST_F(TieredPrefixTest, BlockMetasNameBlocksAsTheTiersStoreThem) {
  TierOptions o;
  o.disk_path = disk_;
  o.disk_bytes = 1 << 20;
  Open(8, o);
  ExtraKeys alice;
  alice.cache_salt = "alice";
  const auto p = Tokens(100, 3 * B + 5);
  Serve(*cache_, *pc_, p, alice, 1);
  tiers_->Drain();
  auto metas = pc_->BlockMetas(p, alice);
  ASSERT_TRUE(metas.ok()) << metas.status().ToString();
  ASSERT_EQ(metas->size(), 3u);
  auto keys = pc_->Keys(p, alice);
  ASSERT_TRUE(keys.ok());
  BlockStore* disk = tiers_->store(Tier::kDisk);
  ASSERT_NE(disk, nullptr);
  std::vector<std::byte> kv(static_cast<size_t>(cache_->block_payload_bytes()));
  for (size_t i = 0; i < metas->size(); ++i) {
    const BlockMeta& m = (*metas)[i];
    EXPECT_EQ(m.key, (*keys)[i]);
    EXPECT_EQ(m.parent.has_value(), i > 0);
    if (i > 0) {
      EXPECT_EQ(*m.parent, (*keys)[i - 1]);
    }
    EXPECT_EQ(m.geometry, cache_->GeometryTag());
    auto got = disk->Get(m, kv);
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE(*got) << "block " << i;
  }
  ExtraKeys bob;
  bob.cache_salt = "bob";
  auto foreign = pc_->BlockMetas(p, bob, 1);
  ASSERT_TRUE(foreign.ok());
  ASSERT_EQ(foreign->size(), 1u);
  EXPECT_FALSE(*disk->Get((*foreign)[0], kv));
  EXPECT_EQ(pc_->BlockMetas(p, alice, 2)->size(), 2u);

  // By hand into a second pool: the blocks' bytes from the store written
  // over a sequence computed with other rows give the first pool's KV.
  std::unique_ptr<KvCache> other = MakeCache(8);
  const std::vector<int32_t> full(p.begin(), p.begin() + 3 * B);
  const SeqId seq2 = other->AddSequence();
  Compute(*other, seq2, full, 0, 7);
  for (size_t i = 0; i < metas->size(); ++i) {
    ASSERT_TRUE(*disk->Get((*metas)[i], kv));
    ASSERT_TRUE(other->WriteBlock(seq2, static_cast<int64_t>(i), kv).ok());
  }
  ExpectExactKv(*other, seq2, full, 1);
  other->CheckInvariants();
}

}  // namespace
}  // namespace pagekv
