// KV tiers under a hybrid cache (sliding-window groups and a full group in
// one pool), with real tiers (RAM, disk, a real redis-server): every group's
// blocks go down when evicted and come back into new pool blocks with
// exactly the KV they had, so a request cut at any point of an earlier
// prompt hits as much as if nothing had been evicted, whether its blocks are
// all in the pool, all in a tier or mixed; a load that fails is a shorter
// hit (recomputed), never wrong KV; groups and salts never share a tier
// block; disk blocks survive a restart.
//
// The reference is the same prompt computed from scratch in a cache of its
// own (no prefix cache): each group's block bytes must equal it.
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/tiers.h"
#include "testing/redis_server.h"
#include "tiers/test_kv_model.h"

namespace pagekv {
namespace {

using test_kv::Compute;
using test_kv::Tokens;

constexpr int32_t B = 8;   // block_len
constexpr int32_t W = 20;  // the sliding layers' window

// Six layers, four sliding and two full: three groups of two layers (group
// 0 the full one).
std::unique_ptr<KvCache> MakeHybrid(int64_t blocks) {
  CacheConfig c;
  c.num_layers = 6;
  c.layer_windows = {W, W, 0, W, W, 0};
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.block_len = B;
  c.format = KvFormat::Plain(DType::kF32);
  c.num_blocks = blocks;
  auto cache = KvCache::Create({.config = c, .prefault = false});
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return cache.ok() ? std::move(*cache) : nullptr;
}

// [group][block]: each group's bytes of each full block of `tokens`,
// computed from scratch.
using GroupBytes = std::vector<std::vector<std::vector<std::byte>>>;
GroupBytes Reference(const std::vector<int32_t>& tokens, int salt) {
  auto ref = MakeHybrid(3 * (static_cast<int64_t>(tokens.size()) / B + 1));
  const SeqId seq = ref->AddSequence();
  Compute(*ref, seq, tokens, 0, salt);
  GroupBytes out(3);
  for (int32_t g = 0; g < 3; ++g) {
    const SequenceView v = *ref->View(seq, g);
    for (size_t j = 0; j < tokens.size() / B; ++j) {
      std::vector<std::byte> bytes(static_cast<size_t>(ref->block_payload_bytes()));
      EXPECT_TRUE(ref->ReadBlock(v.blocks[j], bytes).ok());
      out[static_cast<size_t>(g)].push_back(std::move(bytes));
    }
  }
  return out;
}

// Every block seq holds among its first `blocks` equals the reference's;
// returns how many were compared.
int64_t ExpectExact(const KvCache& cache, SeqId seq, int64_t blocks, const GroupBytes& ref) {
  int64_t compared = 0;
  std::vector<std::byte> bytes(static_cast<size_t>(cache.block_payload_bytes()));
  for (int32_t g = 0; g < 3; ++g) {
    const SequenceView v = *cache.View(seq, g);
    for (int64_t j = 0; j < blocks; ++j) {
      const BlockId b = v.blocks[static_cast<size_t>(j)];
      if (b == kNoBlock) continue;
      EXPECT_TRUE(cache.ReadBlock(b, bytes).ok());
      EXPECT_TRUE(bytes == ref[static_cast<size_t>(g)][static_cast<size_t>(j)]) << "group " << g << " block " << j;
      ++compared;
    }
  }
  return compared;
}

struct Served {
  int64_t hit_tokens = 0;
  int64_t loaded = 0;  // group blocks loaded from a tier (synchronous admission)
};

class TieredHybridTest : public ::testing::Test {
 protected:
  void TearDown() override {
    Close();
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }
  void Open(int64_t blocks, TierOptions o) {
    Close();
    cache_ = MakeHybrid(blocks);
    auto t = BlockTiers::Create(o, B, cache_->block_payload_bytes());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tiers_ = std::move(*t);
    PrefixCacheOptions po;
    po.tiers = tiers_.get();
    po.record_events = true;
    auto pc = PrefixCache::Create(*cache_, po);
    ASSERT_TRUE(pc.ok()) << pc.status().ToString();
    pc_ = std::move(*pc);
  }
  void Close() {
    pc_.reset();
    tiers_.reset();
    cache_.reset();
  }
  // Admits (loading from the tiers, in the background if asked), checks the
  // hit against the reference, computes the rest, publishes, lets the
  // sliding groups release, frees.
  Served Serve(const std::vector<int32_t>& tokens, bool background = false, const ExtraKeys& extra = {},
               int salt = 0) {
    Served s;
    auto a = pc_->AddSequence(tokens, extra, {}, -1, background);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    if (!a.ok()) return s;
    s.hit_tokens = a->match.num_tokens;
    s.loaded = static_cast<int64_t>(a->match.group_loads.size());
    if (a->loading_blocks > 0) {
      s.loaded = a->loading_blocks;
      bool done = false;
      while (!done) {
        for (const PrefixCache::Loaded& l : pc_->TakeLoaded()) {
          if (l.seq == a->seq) {
            done = true;
            s.hit_tokens = l.num_tokens;
          }
        }
        if (!done) pc_->WaitForBackground(std::chrono::milliseconds(50));
      }
    }
    EXPECT_EQ(cache_->View(a->seq)->num_tokens, s.hit_tokens);
    const GroupBytes ref = Reference(tokens, salt);
    ExpectExact(*cache_, a->seq, s.hit_tokens / B, ref);
    Compute(*cache_, a->seq, tokens, s.hit_tokens, salt);
    ExpectExact(*cache_, a->seq, static_cast<int64_t>(tokens.size()) / B, ref);
    EXPECT_TRUE(pc_->Publish(a->seq, tokens).ok());
    EXPECT_TRUE(cache_->ReleaseOutOfWindow(a->seq).ok());
    EXPECT_TRUE(pc_->Free(a->seq).ok());
    pc_->CheckInvariants();
    cache_->CheckInvariants();
    return s;
  }
  // Takes every free block (evicting every cached one into the tiers), then
  // gives them back plain.
  void EvictAll() {
    const SeqId hog = cache_->AddSequence();
    while (cache_->FreeBlockCount() >= 3) ASSERT_TRUE(*cache_->Reserve(hog, B));
    EXPECT_EQ(cache_->CachedFreeBlockCount(), 0);
    ASSERT_TRUE(cache_->Free(hog).ok());
    tiers_->Drain();
  }
  std::string disk_ = (std::filesystem::temp_directory_path() / ("pagekv-tiered-hybrid-" + std::to_string(::getpid()))).string();
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<BlockTiers> tiers_;
  std::unique_ptr<PrefixCache> pc_;
};

// One long prompt, then requests cutting it at every token (each with its
// own tail), with the pool emptied into the tier every few requests: every
// cut hits floor(cut / B) blocks (the full group's whole prefix and the
// sliding groups' window before the cut, from the pool, the tier or both),
// with exact KV, in each tier and with loads in the background or not.
struct CutCase {
  const char* name;
  Tier tier;
  bool background;
};
void PrintTo(const CutCase& c, std::ostream* os) { *os << c.name; }

class TieredHybridCutTest : public TieredHybridTest, public ::testing::WithParamInterface<CutCase> {};

TEST_P(TieredHybridCutTest, EveryCutHitsAsIfNothingWasEvicted) {
  const CutCase& c = GetParam();
  testing::RedisServer redis;
  TierOptions o;
  if (c.tier == Tier::kHost) o.host_bytes = 4 << 20;
  if (c.tier == Tier::kDisk) {
    o.disk_path = disk_;
    o.disk_bytes = 8 << 20;
  }
  if (c.tier == Tier::kRedis) {
    ASSERT_TRUE(redis.Start().ok());
    o.redis_url = redis.url();
  }
  Open(48, o);
  const std::vector<int32_t> prompt = Tokens(100, 12 * B + 3);
  EXPECT_EQ(Serve(prompt, c.background).hit_tokens, 0);
  EvictAll();
  int64_t loaded = 0;
  for (int32_t k = 1; k <= 12 * B; ++k) {
    std::vector<int32_t> p(prompt.begin(), prompt.begin() + k);
    for (int32_t t : Tokens(5000 + 10 * k, 4)) p.push_back(t);
    const PrefixMatch m = *pc_->Lookup(p, {});
    EXPECT_EQ(m.num_tokens, k / B * B) << "cut " << k;
    EXPECT_EQ(m.lower.size(), m.group_loads.size());
    const Served s = Serve(p, c.background);
    EXPECT_EQ(s.hit_tokens, k / B * B) << "cut " << k;
    loaded += s.loaded;
    if (k % 13 == 0) EvictAll();
  }
  const PrefixCacheStats st = pc_->Stats();
  EXPECT_GT(loaded, 0);
  EXPECT_GT(st.tier_hit_blocks[static_cast<size_t>(c.tier)], 0);
  EXPECT_GT(st.tier_hit_blocks[0], 0);
  EXPECT_EQ(st.tier_load_failures, 0);
  if (c.background) {
    EXPECT_GT(st.background_loads, 0);
  }
  Close();
}

INSTANTIATE_TEST_SUITE_P(Tiers, TieredHybridCutTest,
                         ::testing::Values(CutCase{"Host", Tier::kHost, false}, CutCase{"HostBackground", Tier::kHost, true},
                                           CutCase{"Disk", Tier::kDisk, false}, CutCase{"DiskBackground", Tier::kDisk, true},
                                           CutCase{"Redis", Tier::kRedis, false}),
                         [](const ::testing::TestParamInfo<CutCase>& i) { return std::string(i.param.name); });

// The real tiers, with the loads of chosen group blocks failing (as a block
// a tier lost or found corrupt does).
class FailingLoads : public LowerTiers {
 public:
  explicit FailingLoads(LowerTiers* tiers) : t_(tiers) {}
  void Fail(int32_t group, std::vector<int32_t> tokens) { fail_.emplace_back(group, std::move(tokens)); }
  int failures() const { return failures_; }
  std::vector<Tier> LocatePrefix(std::span<const BlockKey> keys) override { return t_->LocatePrefix(keys); }
  std::optional<Tier> Load(const BlockMeta& meta, std::span<std::byte> kv) override {
    if (Fails(meta)) return std::nullopt;
    return t_->Load(meta, kv);
  }
  bool write_through() const override { return t_->write_through(); }
  void Published(const BlockMeta& meta, std::span<const std::byte> kv) override { t_->Published(meta, kv); }
  std::optional<Tier> Evicted(const BlockMeta& meta, std::span<const std::byte> kv) override {
    return t_->Evicted(meta, kv);
  }
  void Prefetch(std::vector<BlockMeta> metas) override { t_->Prefetch(std::move(metas)); }
  void StartLoads(std::vector<TierLoadJob> jobs) override {
    std::vector<TierLoadJob> pass;
    for (TierLoadJob& j : jobs) {
      if (Fails(j.meta)) {
        j.done(std::nullopt);
      } else {
        pass.push_back(std::move(j));
      }
    }
    t_->StartLoads(std::move(pass));
  }
  void StartOffloads(std::vector<TierOffloadJob> jobs) override { t_->StartOffloads(std::move(jobs)); }
  bool StillHolds(const BlockKey& key, Tier tier) override { return t_->StillHolds(key, tier); }
  void RecordChanges(bool on) override { t_->RecordChanges(on); }
  std::vector<TierChange> TakeChanges() override { return t_->TakeChanges(); }

 private:
  bool Fails(const BlockMeta& meta) {
    for (const auto& [g, tokens] : fail_) {
      if (meta.group == g && meta.tokens == tokens) {
        ++failures_;
        return true;
      }
    }
    return false;
  }
  LowerTiers* t_;
  std::vector<std::pair<int32_t, std::vector<int32_t>>> fail_;
  int failures_ = 0;
};

// A sliding group's block under the last window fails to load: the
// admission looks again without it and hits the longest cut whose window
// needs it not (the blocks it loaded meanwhile are in the pool by then); in
// the background the sequence is cut back instead. The full group's first
// block failing leaves no hit. The KV is exact every time.
TEST_F(TieredHybridTest, AFailedLoadIsAShorterHitNeverWrongKv) {
  for (bool background : {false, true}) {
    TierOptions o;
    o.host_bytes = 4 << 20;
    Open(48, o);
    FailingLoads failing(tiers_.get());
    {  // a prefix cache over the failing view of the same tiers
      pc_.reset();
      PrefixCacheOptions po;
      po.tiers = &failing;
      pc_ = std::move(*PrefixCache::Create(*cache_, po));
    }
    const std::vector<int32_t> prompt = Tokens(300, 12 * B + 3);
    Serve(prompt);
    EvictAll();
    // Cut at 12 blocks: the sliding window reads blocks 9..11. Block 10 of
    // group 1 fails.
    failing.Fail(1, std::vector<int32_t>(prompt.begin() + 10 * B, prompt.begin() + 11 * B));
    std::vector<int32_t> p(prompt.begin(), prompt.begin() + 12 * B);
    p.push_back(7);
    const Served s = Serve(p, background);
    EXPECT_GE(failing.failures(), 1);
    EXPECT_GE(pc_->Stats().tier_load_failures, 1);
    if (background) {
      EXPECT_LT(s.hit_tokens, 12 * B);
    } else {
      // Windows at cuts of 10 blocks or fewer do not reach block 10.
      EXPECT_EQ(s.hit_tokens, 10 * B);
    }
    // The full group's first block fails: nothing can be hit.
    EvictAll();
    failing.Fail(0, std::vector<int32_t>(prompt.begin(), prompt.begin() + B));
    EXPECT_EQ(Serve(p, background).hit_tokens, 0);
    pc_.reset();
  }
}

// Each group's block goes down under a key of its own (derived from the
// chain's key and the group), announced with its group; another salt
// shares none of them; and blocks on disk come back after a restart.
TEST_F(TieredHybridTest, GroupsAndSaltsKeepApartAndDiskSurvivesARestart) {
  TierOptions o;
  o.disk_path = disk_;
  o.disk_bytes = 8 << 20;
  Open(48, o);
  ExtraKeys alice, bob;
  alice.cache_salt = "alice";
  bob.cache_salt = "bob";
  const std::vector<int32_t> prompt = Tokens(40, 6 * B + 2);
  Serve(prompt, false, alice, 1);
  EvictAll();
  // The events of the blocks going down to disk (written through at
  // publication, or at eviction): six of the full group and of each
  // sliding group (every published block goes down), each group's keys
  // distinct from every other group's.
  std::vector<std::vector<std::string>> keys(3);  // hex, sorted
  for (const KvEvent& e : pc_->DrainEvents()) {
    if (e.type != KvEvent::Type::kBlockStored || e.tier != "disk") continue;
    EXPECT_EQ(e.window, e.group == 0 ? 0 : W);
    for (const BlockKey& k : e.keys) keys[static_cast<size_t>(e.group)].push_back(k.Hex());
  }
  std::vector<std::string> chain;
  const std::vector<BlockKey> chain_keys = *pc_->Keys(prompt, alice);
  for (const BlockKey& k : chain_keys) chain.push_back(k.Hex());
  for (auto& k : keys) std::sort(k.begin(), k.end());
  std::sort(chain.begin(), chain.end());
  EXPECT_EQ(keys[0], chain);  // group 0 goes down under the chain's keys
  for (int32_t g = 1; g < 3; ++g) {
    EXPECT_EQ(keys[static_cast<size_t>(g)].size(), 6u);
    for (const std::string& k : keys[static_cast<size_t>(g)]) {
      for (int32_t h = 0; h < 3; ++h) {
        if (h == g) continue;
        EXPECT_EQ(std::count(keys[static_cast<size_t>(h)].begin(), keys[static_cast<size_t>(h)].end(), k), 0);
      }
    }
  }
  EXPECT_EQ(Serve(prompt, false, bob, 2).hit_tokens, 0);
  EXPECT_EQ(Serve(prompt, false, {}, 0).hit_tokens, 0);
  Close();
  Open(48, o);  // a restart: the pool is empty, the disk is not
  const Served again = Serve(prompt, false, alice, 1);
  EXPECT_EQ(again.hit_tokens, 6 * B);
  // The full group's six blocks and the two sliding groups' window (blocks 3..5).
  EXPECT_EQ(again.loaded, 6 + 2 * 3);
  EXPECT_EQ(pc_->Stats().tier_hit_blocks[static_cast<size_t>(Tier::kDisk)], 12);
}

// A pool too short for the blocks a hit would load admits the pool's part
// of the hit and loads nothing (no error, no wrong KV).
TEST_F(TieredHybridTest, APoolShortOfBlocksForTheLoadsAdmitsThePoolsPart) {
  TierOptions o;
  o.host_bytes = 4 << 20;
  Open(24, o);
  const std::vector<int32_t> prompt = Tokens(900, 6 * B + 1);
  Serve(prompt);
  EvictAll();
  const SeqId hog = cache_->AddSequence();
  ASSERT_TRUE(*cache_->Reserve(hog, 7 * B));  // 21 of 24 blocks
  const PrefixMatch m = *pc_->Lookup(prompt, {});
  EXPECT_EQ(m.num_tokens, 6 * B);
  EXPECT_EQ(m.group_loads.size(), 12u);
  auto a = pc_->AddSequence(prompt, {});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->match.num_tokens, 0);
  EXPECT_TRUE(a->match.group_loads.empty());
  ASSERT_TRUE(pc_->Free(a->seq).ok());
  ASSERT_TRUE(cache_->Free(hog).ok());
  pc_->CheckInvariants();
  cache_->CheckInvariants();
}

}  // namespace
}  // namespace pagekv
