// BlockTiers: locate across tiers, load order, write-through and write-back
// movement, prefetch, and faults treated as misses.
#include "pagekv/tiers.h"

#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "testing/redis_server.h"

namespace pagekv {
namespace {

constexpr int32_t kBlockLen = 4;
constexpr int64_t kKvBytes = 512;

BlockMeta Meta(uint64_t i) {
  BlockMeta m;
  std::mt19937_64 rng(i + 17);
  for (auto& b : m.key.bytes) b = static_cast<uint8_t>(rng());
  for (int t = 0; t < kBlockLen; ++t) m.tokens.push_back(static_cast<int32_t>(i * 10 + t));
  m.geometry = 42;
  return m;
}

std::vector<std::byte> Kv(uint64_t i) {
  std::vector<std::byte> kv(kKvBytes);
  for (size_t j = 0; j < kv.size(); ++j) kv[j] = static_cast<std::byte>(i * 31 + j);
  return kv;
}

std::vector<BlockKey> Keys(std::initializer_list<uint64_t> ids) {
  std::vector<BlockKey> k;
  for (uint64_t i : ids) k.push_back(Meta(i).key);
  return k;
}

class BlockTiersTest : public ::testing::Test {
 protected:
  void TearDown() override {
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }
  std::unique_ptr<BlockTiers> Make(TierOptions o) {
    o.log = [this](const std::string& line) { log_.push_back(line); };
    auto t = BlockTiers::Create(o, kBlockLen, kKvBytes);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return std::move(*t);
  }
  int64_t HostSlots(int n) { return n * TierPayloadBytes(kBlockLen, kKvBytes); }
  std::string disk_ = (std::filesystem::temp_directory_path() / ("pagekv-tiers-" + std::to_string(::getpid()))).string();
  std::vector<std::string> log_;
};

TEST_F(BlockTiersTest, EvictedBlocksGoToRamAndLoadBackExactly) {
  TierOptions o;
  o.host_bytes = HostSlots(8);
  auto t = Make(o);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_EQ(t->Evicted(Meta(i), Kv(i)), Tier::kHost);
  EXPECT_EQ(t->LocatePrefix(Keys({0, 1, 2, 3, 1})), (std::vector<Tier>{Tier::kHost, Tier::kHost, Tier::kHost}));
  EXPECT_TRUE(t->LocatePrefix(Keys({5, 0})).empty());  // stops at the first miss
  std::vector<std::byte> out(kKvBytes);
  EXPECT_EQ(t->Load(Meta(1), out), Tier::kHost);
  EXPECT_EQ(out, Kv(1));
  EXPECT_EQ(t->Load(Meta(7), out), std::nullopt);
  const TiersStats st = t->Stats();
  EXPECT_EQ(st.load_hits[1], 1);
  EXPECT_EQ(st.load_failures, 1);
}

TEST_F(BlockTiersTest, WriteBackPushesRamEvictionsToDisk) {
  TierOptions o;
  o.host_bytes = HostSlots(2);
  o.disk_path = disk_;
  o.disk_bytes = 16 * 4096;
  o.write_through = false;
  auto t = Make(o);
  t->Published(Meta(0), Kv(0));  // write-back: nothing happens
  for (uint64_t i = 0; i < 5; ++i) t->Evicted(Meta(i), Kv(i));
  t->Drain();
  // 0, 1, 2 left RAM for disk; 3, 4 are in RAM.
  EXPECT_EQ(t->LocatePrefix(Keys({0, 1, 2, 3, 4})),
            (std::vector<Tier>{Tier::kDisk, Tier::kDisk, Tier::kDisk, Tier::kHost, Tier::kHost}));
  std::vector<std::byte> out(kKvBytes);
  EXPECT_EQ(t->Load(Meta(0), out), Tier::kDisk);
  EXPECT_EQ(out, Kv(0));
}

TEST_F(BlockTiersTest, WriteThroughReachesDiskAtPublishAndSurvivesARestart) {
  TierOptions o;
  o.disk_path = disk_;
  o.disk_bytes = 16 * 4096;
  {
    auto t = Make(o);
    for (uint64_t i = 0; i < 3; ++i) t->Published(Meta(i), Kv(i));
  }  // destructor drains and writes the index
  auto t = Make(o);
  EXPECT_EQ(t->LocatePrefix(Keys({0, 1, 2})).size(), 3u);
  std::vector<std::byte> out(kKvBytes);
  EXPECT_EQ(t->Load(Meta(2), out), Tier::kDisk);
  EXPECT_EQ(out, Kv(2));
}

TEST_F(BlockTiersTest, UnderATierKeyBlocksSurviveARestartOnlyUnderTheSameKey) {
  TierOptions o;
  o.disk_path = disk_;
  o.disk_bytes = 16 * 4096;
  o.payload_key = "a tier key of 32 bytes, or more.";
  {
    auto t = Make(o);
    EXPECT_TRUE(log_.empty()) << log_[0];  // keyed: no warning
    for (uint64_t i = 0; i < 3; ++i) t->Published(Meta(i), Kv(i));
  }
  {
    auto t = Make(o);
    std::vector<std::byte> out(kKvBytes);
    EXPECT_EQ(t->Load(Meta(2), out), Tier::kDisk);
    EXPECT_EQ(out, Kv(2));
  }
  o.payload_key += "-rotated";
  auto t = Make(o);
  std::vector<std::byte> out(kKvBytes);
  EXPECT_EQ(t->Load(Meta(1), out), std::nullopt);  // a miss, recomputed by the caller
  EXPECT_EQ(t->Stats().tiers[0].unauthenticated, 1);
  EXPECT_EQ(t->Stats().load_failures, 1);
}

TEST_F(BlockTiersTest, PrefetchStagesSlowBlocksAndCreditsTheirTier) {
  TierOptions o;
  o.host_bytes = HostSlots(4);
  o.disk_path = disk_;
  o.disk_bytes = 16 * 4096;
  auto t = Make(o);
  for (uint64_t i = 0; i < 3; ++i) t->Published(Meta(i), Kv(i));
  t->Drain();
  t->Prefetch({Meta(0), Meta(1), Meta(9)});
  t->Drain();
  EXPECT_EQ(t->Stats().prefetched, 2);
  const int64_t disk_gets = t->store(Tier::kDisk)->Stats().gets;
  std::vector<std::byte> out(kKvBytes);
  EXPECT_EQ(t->Load(Meta(1), out), Tier::kDisk);  // from the staging area: no disk read now
  EXPECT_EQ(out, Kv(1));
  EXPECT_EQ(t->store(Tier::kDisk)->Stats().gets, disk_gets);
}

TEST_F(BlockTiersTest, AFullQueueDropsCopiesInsteadOfBlocking) {
  TierOptions o;
  o.disk_path = disk_;
  o.disk_bytes = 64 * 4096;
  o.queue_blocks = 1;
  auto t = Make(o);
  for (uint64_t i = 0; i < 50; ++i) t->Published(Meta(i), Kv(i));
  t->Drain();
  const TiersStats st = t->Stats();
  EXPECT_GT(st.dropped, 0);
  EXPECT_EQ(st.dropped + st.tiers[0].puts, 50);
}

TEST_F(BlockTiersTest, BadOptionsAreNamed) {
  TierOptions o;
  EXPECT_EQ(BlockTiers::Create(o, kBlockLen, kKvBytes).status().code(), StatusCode::kInvalidArgument);
  o.disk_path = disk_;
  EXPECT_EQ(BlockTiers::Create(o, kBlockLen, kKvBytes).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.redis_url = "localhost:6379";
  EXPECT_EQ(BlockTiers::Create(o, kBlockLen, kKvBytes).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.host_bytes = HostSlots(2);
  o.payload_key = "too short";
  auto short_key = BlockTiers::Create(o, kBlockLen, kKvBytes);
  ASSERT_FALSE(short_key.ok());
  EXPECT_NE(short_key.status().message().find("at least 16"), std::string::npos) << short_key.status().ToString();
}

TEST_F(BlockTiersTest, RedisDownIsAMissLoggedAndCountedAndHealsAfterRestart) {
  testing::RedisServer redis;
  ASSERT_TRUE(redis.Start().ok());
  TierOptions o;
  o.host_bytes = HostSlots(2);
  o.redis_url = redis.url();
  o.redis_timeout_ms = 300;
  auto t = Make(o);
  for (uint64_t i = 0; i < 3; ++i) t->Published(Meta(i), Kv(i));
  t->Drain();
  EXPECT_EQ(t->LocatePrefix(Keys({0, 1, 2})).size(), 3u);
  ASSERT_EQ(log_.size(), 1u);  // no tier key: warned once at creation
  EXPECT_NE(log_[0].find("no tier key"), std::string::npos) << log_[0];
  log_.clear();
  redis.Kill();
  EXPECT_TRUE(t->LocatePrefix(Keys({0, 1, 2})).empty());  // down: not found, no hang
  std::vector<std::byte> out(kKvBytes);
  EXPECT_EQ(t->Load(Meta(0), out), std::nullopt);
  EXPECT_FALSE(log_.empty());
  EXPECT_NE(log_[0].find("redis"), std::string::npos);
  const TiersStats st = t->Stats();
  EXPECT_FALSE(st.tiers[1].healthy);
  EXPECT_GT(st.tiers[1].errors, 0);
  ASSERT_TRUE(redis.Start().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  t->Published(Meta(4), Kv(4));
  t->Drain();
  // The backoff may still refuse the first put; a later one lands.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  t->Published(Meta(5), Kv(5));
  t->Drain();
  EXPECT_EQ(t->Load(Meta(5), out), Tier::kRedis);
  EXPECT_EQ(out, Kv(5));
  EXPECT_TRUE(t->Stats().tiers[1].healthy);
}

}  // namespace
}  // namespace pagekv
