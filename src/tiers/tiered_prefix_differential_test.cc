// Seeded differential test: the prefix cache over a real KvCache and real
// tiers (RAM, disk, a real redis-server) against a deliberately naive model,
// over random admit / append / truncate / fork / free / evict / tier-drop /
// prefetch sequences, with CheckInvariants() after every step.
//
// The naive model is a dictionary from full-block token prefixes (with the
// tenant) to the KV contents their last block must hold, filled whenever the
// test computes a block, plus each live sequence's tokens. It knows nothing
// of keys, chains, the pool or the tiers. Every admission is compared with
// it: each hit block's contents must equal the dictionary's for exactly that
// prefix, and the hit may reach no further than the dictionary's chain. In
// the configurations whose tiers never drop a block on their own, the hit
// length must also be exactly the longest prefix held first by the pool's
// index and then, from the pool's first miss on, by the tiers and not the
// pool, asked block by block. (A pool block past such a miss ends the
// match: two requests that computed the same block publish one copy, the
// other's next block chains to it, and evicting the older copy first leaves
// that hole; a load cannot publish a second block under the pool block's
// key. The block is recomputed, never read wrong.)
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <random>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/tiers.h"
#include "testing/redis_server.h"
#include "tiers/test_kv_model.h"

namespace pagekv {
namespace {

using test_kv::Compute;
using test_kv::Value;

constexpr int32_t B = 8;

enum class Hash { kSha256, kXxh3, kParentBlind };

struct DiffCase {
  const char* name;
  bool host, disk, redis, write_through;
  int64_t host_blocks, disk_blocks;  // capacities in blocks
  Hash hash;
  bool exact;  // tiers never drop on their own and keys never collide: hit lengths are exact
  uint32_t seed;
  int steps;
};

void PrintTo(const DiffCase& c, std::ostream* os) { *os << c.name; }

BlockKey Fnv(std::span<const uint8_t> in) {
  BlockKey key;
  uint64_t h = 1469598103934665603ull;
  for (uint8_t b : in) h = (h ^ b) * 1099511628211ull;
  for (size_t i = 0; i < 32; ++i) key.bytes[i] = static_cast<uint8_t>(h >> (8 * (i % 8)) ^ i);
  return key;
}

// The model's contents of block i of `tokens` under tenant `salt`: K then V
// rows, [layer][token][head][elem].
std::vector<float> BlockContents(const KvLayout& l, const std::vector<int32_t>& tokens, int64_t i, int salt) {
  std::vector<float> out;
  for (int plane = 0; plane < 2; ++plane) {
    for (int layer = 0; layer < l.num_layers(); ++layer) {
      for (int64_t t = i * B; t < (i + 1) * B; ++t) {
        for (int h = 0; h < l.num_heads(); ++h) {
          for (int e = 0; e < l.row_elems(); ++e) out.push_back(Value(tokens, t, layer, plane, h, e, salt));
        }
      }
    }
  }
  return out;
}

// The cache's contents of block i of seq, in BlockContents' order.
std::vector<float> CachedContents(const KvCache& cache, SeqId seq, int64_t i) {
  const KvLayout& l = cache.layout();
  const size_t row = static_cast<size_t>(l.num_heads() * l.row_elems());
  std::vector<float> k(static_cast<size_t>(l.num_layers() * B) * row), v(k.size());
  EXPECT_TRUE(cache.Read(seq, i * B, {B, k.data(), v.data()}).ok());
  std::vector<float> out = k;
  out.insert(out.end(), v.begin(), v.end());
  return out;
}

struct Live {
  SeqId seq;
  std::vector<int32_t> tokens;
  int salt;
};

class TieredPrefixDifferentialTest : public ::testing::TestWithParam<DiffCase> {
 protected:
  void SetUp() override {
    const DiffCase& p = GetParam();
    cache_ = test_kv::MakeCache(24, B);
    const int64_t payload = TierPayloadBytes(B, cache_->block_payload_bytes());
    TierOptions o;
    if (p.host) o.host_bytes = p.host_blocks * payload;
    if (p.disk) {
      o.disk_path = disk_;
      o.disk_bytes = p.disk_blocks * 4096;
      o.disk_direct_io = false;
    }
    if (p.redis) {
      ASSERT_TRUE(redis_.Start().ok());
      o.redis_url = redis_.url();
    }
    o.write_through = p.write_through;
    o.queue_blocks = 1 << 16;  // never drops a copy: presence stays what the test can ask
    PrefixCacheOptions po;
    if (TiersConfigured(o)) {
      tiers_ = std::move(*BlockTiers::Create(o, B, cache_->block_payload_bytes()));
      po.tiers = tiers_.get();
    }
    if (p.hash == Hash::kXxh3) {
      po.hasher.kind = BlockHashKind::kXxh3_128;
      po.hasher.seed = 1234;
    }
    if (p.hash == Hash::kParentBlind) {
      // A key from the block's own bytes after the parent key (the layout
      // in prefix/block_hasher.h): equal blocks after different prefixes
      // collide, so only the stored parent and digest tell them apart.
      po.hasher.custom = [](std::span<const uint8_t> in) { return Fnv(in.subspan(15 + 1 + 32)); };
    }
    pc_ = std::move(*PrefixCache::Create(*cache_, po));
    rng_.seed(p.seed);
  }
  void TearDown() override {
    pc_.reset();
    tiers_.reset();
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }

  static ExtraKeys Extra(int salt) {
    ExtraKeys e;
    if (salt != 0) e.cache_salt = "tenant-" + std::to_string(salt);
    return e;
  }

  // A prompt from a few families: a family's first block, then blocks drawn
  // from three patterns, then a few loose tokens; so prompts share prefixes
  // of many lengths and equal blocks recur after different prefixes.
  std::vector<int32_t> Prompt() {
    std::vector<int32_t> p = test_kv::Tokens(static_cast<int32_t>(100 * (1 + rng_() % 3)), B);
    for (int64_t i = 0, n = rng_() % 5; i < n; ++i) {
      const std::vector<int32_t> pattern = test_kv::Tokens(static_cast<int32_t>(1000 + 10 * (rng_() % 3)), B);
      p.insert(p.end(), pattern.begin(), pattern.end());
    }
    for (int64_t i = 0, n = 1 + rng_() % (B + 1); i < n; ++i) p.push_back(static_cast<int32_t>(rng_() % 6));
    return p;
  }

  // The naive model learns the blocks of `tokens` [0, n) computed for salt.
  void Learn(const std::vector<int32_t>& tokens, int64_t n, int salt) {
    const KvLayout& l = cache_->layout();
    for (int64_t i = 0; i < n / B; ++i) {
      auto key = std::make_pair(salt, std::vector<int32_t>(tokens.begin(), tokens.begin() + (i + 1) * B));
      if (dict_.count(key) == 0) dict_.emplace(std::move(key), BlockContents(l, tokens, i, salt));
    }
  }

  // How many leading blocks of the prompt the dictionary knows.
  int64_t DictChain(const std::vector<int32_t>& tokens, int salt, int64_t max_blocks) const {
    int64_t n = 0;
    while (n < max_blocks &&
           dict_.count({salt, std::vector<int32_t>(tokens.begin(), tokens.begin() + (n + 1) * B)}) > 0) {
      ++n;
    }
    return n;
  }

  // The longest prefix of known blocks held by the pool, then by a tier and
  // not by the pool (a pool block past the pool's first miss ends the match:
  // a load cannot publish a second block under its key).
  int64_t HeldChain(const std::vector<int32_t>& tokens, int salt, int64_t max_blocks) {
    if (tiers_ != nullptr) tiers_->Drain();  // queued write-throughs land first
    const std::vector<BlockKey> keys = *pc_->Keys(tokens, Extra(salt), max_blocks);
    const int64_t known = DictChain(tokens, salt, max_blocks);
    int64_t n = 0;
    while (n < known && pc_->Find(keys[static_cast<size_t>(n)]).has_value()) ++n;
    while (n < known && tiers_ != nullptr && !pc_->Find(keys[static_cast<size_t>(n)]).has_value() &&
           !tiers_->LocatePrefix({&keys[static_cast<size_t>(n)], 1}).empty()) {
      ++n;
    }
    return n;
  }

  // The tiers' counters (a failure's context).
  std::string Counters() {
    std::string out = " load failures " + std::to_string(pc_->Stats().tier_load_failures);
    if (tiers_ == nullptr) return out;
    const TiersStats t = tiers_->Stats();
    out += ", staged mismatches " + std::to_string(t.staged_mismatches) + ", dropped " + std::to_string(t.dropped);
    for (const TierStats& s : t.tiers) {
      out += "; " + s.name + ": corrupt " + std::to_string(s.corrupt) + " errors " + std::to_string(s.errors) +
             " misses " + std::to_string(s.misses) + " hits " + std::to_string(s.hits);
    }
    return out;
  }

  // Where each block of the prompt's chain is now (a failure's context).
  std::string Where(const std::vector<int32_t>& tokens, int salt, int64_t max_blocks) {
    const std::vector<BlockKey> keys = *pc_->Keys(tokens, Extra(salt), max_blocks);
    std::string out;
    for (size_t i = 0; i < keys.size(); ++i) {
      const bool known = dict_.count({salt, std::vector<int32_t>(tokens.begin(), tokens.begin() + (i + 1) * B)}) > 0;
      const bool pool = pc_->Find(keys[i]).has_value();
      const bool tier = tiers_ != nullptr && !tiers_->LocatePrefix({&keys[i], 1}).empty();
      out.append("[").append(std::to_string(i));
      if (known) out.append(" known");
      if (pool) out.append(" pool");
      if (tier) out.append(" tier");
      out.append("]");
    }
    return out;
  }

  // Frees live sequences (oldest first, never `keep`) until `blocks` are free.
  void MakeRoom(int64_t blocks, std::optional<SeqId> keep = std::nullopt) {
    for (size_t i = 0; cache_->FreeBlockCount() < blocks && i < live_.size();) {
      if (keep && live_[i].seq == *keep) {
        ++i;
      } else {
        Free(i);
      }
    }
  }

  void Free(size_t i) {
    ASSERT_TRUE(pc_->Free(live_[i].seq).ok());
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  Live* Find(SeqId id) {
    for (Live& s : live_) {
      if (s.seq == id) return &s;
    }
    return nullptr;
  }

  // Computes and publishes s's tokens past what it holds.
  void Finish(Live& s, const std::vector<int32_t>& tokens) {
    const int64_t from = cache_->View(s.seq)->num_tokens;
    if (static_cast<int64_t>(tokens.size()) > from) Compute(*cache_, s.seq, tokens, from, s.salt);
    s.tokens = tokens;
    ASSERT_TRUE(pc_->Publish(s.seq, s.tokens).ok());
    Learn(s.tokens, static_cast<int64_t>(s.tokens.size()), s.salt);
  }

  // Grows live sequence `id` to `tokens` (its tokens are a prefix of them)
  // if the pool can make room.
  void Grow(SeqId id, const std::vector<int32_t>& tokens) {
    const int64_t n = static_cast<int64_t>(tokens.size()) - cache_->View(id)->num_tokens;
    const int64_t need = cache_->BlocksNeeded(id, n)->total();
    MakeRoom(need, id);
    if (cache_->FreeBlockCount() < need) return;
    Finish(*Find(id), tokens);
  }

  void Admit() {
    const DiffCase& p = GetParam();
    const std::vector<int32_t> tokens = Prompt();
    const int salt = static_cast<int>(rng_() % 3);
    const auto len = static_cast<int64_t>(tokens.size());
    MakeRoom((len + B - 1) / B);  // every block of it: loads are never cut short by the pool
    const int64_t max_blocks = (len - 1) / B;
    const int64_t expected = p.exact ? HeldChain(tokens, salt, max_blocks) : -1;
    const int64_t bound = DictChain(tokens, salt, max_blocks);
    const std::string before = p.exact ? Where(tokens, salt, max_blocks) : "";
    // Every other admission with tiers loads in the background.
    const bool background = tiers_ != nullptr && admissions_ % 2 == 1;
    auto a = pc_->AddSequence(tokens, Extra(salt), {}, -1, background);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    int64_t num_tokens = a->match.num_tokens;
    if (a->loading_blocks > 0 && admissions_ % 4 == 3 && cache_->FreeBlockCount() >= (len + B - 1) / B) {
      // The same prompt again while the first still loads: both load, the
      // first to finish publishes, and both hold the same verified KV.
      auto twin = pc_->AddSequence(tokens, Extra(salt), {}, -1, true);
      ASSERT_TRUE(twin.ok()) << twin.status().ToString();
      std::vector<PrefixCache::Loaded> done;
      while (done.size() < (twin->loading_blocks > 0 ? 2u : 1u)) {
        for (const PrefixCache::Loaded& l : pc_->TakeLoaded()) done.push_back(l);
        pc_->WaitForBackground(std::chrono::milliseconds(10));
      }
      int64_t twin_tokens = twin->match.num_tokens;
      for (const PrefixCache::Loaded& l : done) {
        if (l.seq == a->seq) num_tokens = l.num_tokens;
        if (l.seq == twin->seq) twin_tokens = l.num_tokens;
      }
      if (p.exact) {
        ASSERT_EQ(twin_tokens, num_tokens) << "the twin found another prefix";
      }
      ASSERT_LE(twin_tokens / B, bound);
      for (int64_t i = 0; i < twin_tokens / B; ++i) {
        const auto& want = dict_.at({salt, std::vector<int32_t>(tokens.begin(), tokens.begin() + (i + 1) * B)});
        ASSERT_EQ(CachedContents(*cache_, twin->seq, i), want) << "block " << i << " of the twin";
      }
      ++twin_admissions_;
      ASSERT_TRUE(pc_->Free(twin->seq).ok());
      a->loading_blocks = 0;  // done above
    }
    if (a->loading_blocks > 0) {
      // While the tiers' threads fill its blocks, the owner works on the
      // pool: cached blocks copied down ahead, then every free block taken
      // (evictions, some waiting for those copies) and given back.
      pc_->OffloadAhead(0, 4);
      const SeqId other = cache_->AddSequence();
      ASSERT_TRUE(*cache_->Reserve(other, cache_->FreeBlockCount() * B));
      ASSERT_TRUE(cache_->Free(other).ok());
      std::vector<PrefixCache::Loaded> done;
      while ((done = pc_->TakeLoaded()).empty()) pc_->WaitForBackground(std::chrono::milliseconds(10));
      ASSERT_EQ(done.size(), 1u);
      ASSERT_EQ(done[0].seq, a->seq);
      ASSERT_EQ(pc_->loading(), 0);
      num_tokens = done[0].num_tokens;
      ++background_admissions_;
    }
    const int64_t hit = num_tokens / B;
    ++admissions_;
    hit_blocks_ += hit;
    ASSERT_LE(hit, bound) << "a hit beyond every block ever computed after this prefix";
    if (p.exact) {
      ASSERT_EQ(hit, expected) << "admission " << admissions_ << (background ? " (background)" : "") << ": "
                               << "before " << before << " after " << Where(tokens, salt, max_blocks) << Counters();
    }
    for (int64_t i = 0; i < hit; ++i) {
      const auto& want = dict_.at({salt, std::vector<int32_t>(tokens.begin(), tokens.begin() + (i + 1) * B)});
      ASSERT_EQ(CachedContents(*cache_, a->seq, i), want) << "block " << i << " of a hit holds another prefix's KV";
    }
    Live s{a->seq, std::vector<int32_t>(tokens.begin(), tokens.begin() + num_tokens), salt};
    Finish(s, tokens);
    live_.push_back(s);
  }

  void Step() {
    const uint32_t op = rng_() % 100;
    if (op < 30 || live_.empty()) {
      Admit();
    } else if (op < 45) {  // append
      const Live& s = live_[rng_() % live_.size()];
      std::vector<int32_t> t = s.tokens;
      for (int64_t i = 0, n = 1 + rng_() % (2 * B); i < n; ++i) t.push_back(static_cast<int32_t>(1000 + rng_() % 3));
      Grow(s.seq, t);
    } else if (op < 60) {  // truncate (a rollback), then grow again with other tokens
      Live& s = live_[rng_() % live_.size()];
      const auto keep = static_cast<int64_t>(rng_() % (s.tokens.size() + 1));
      ASSERT_TRUE(cache_->Truncate(s.seq, keep).ok());
      s.tokens.resize(static_cast<size_t>(keep));
      std::vector<int32_t> t = s.tokens;
      for (int64_t i = 0, n = rng_() % (3 * B); i < n; ++i) t.push_back(static_cast<int32_t>(1000 + rng_() % 4));
      Grow(s.seq, t);
    } else if (op < 68) {  // fork, and the child goes its own way
      const Live parent = live_[rng_() % live_.size()];
      auto child = pc_->Fork(parent.seq);
      ASSERT_TRUE(child.ok()) << child.status().ToString();
      live_.push_back({*child, parent.tokens, parent.salt});
      std::vector<int32_t> t = parent.tokens;
      for (int64_t i = 0, n = 1 + rng_() % (2 * B); i < n; ++i) t.push_back(static_cast<int32_t>(1000 + rng_() % 3));
      Grow(*child, t);
    } else if (op < 80) {
      Free(rng_() % live_.size());
    } else if (op < 87) {  // evict: a sequence outside the prefix cache takes every free block
      if (tiers_ != nullptr) pc_->OffloadAhead(static_cast<int64_t>(op % 3), 8);  // some copies made ahead
      const SeqId s = cache_->AddSequence();
      ASSERT_TRUE(*cache_->Reserve(s, cache_->FreeBlockCount() * B));
      ASSERT_TRUE(cache_->Free(s).ok());
    } else if (op < 94) {  // a tier drops a block (an operator, a restart, another process)
      if (tiers_ == nullptr || dict_.empty()) return;
      auto it = dict_.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng_() % dict_.size()));
      const auto keys = *pc_->Keys(it->first.second, Extra(it->first.first));
      for (Tier t : {Tier::kHost, Tier::kDisk, Tier::kRedis}) {
        if (BlockStore* store = tiers_->store(t); store != nullptr && rng_() % 2 == 0) {
          ASSERT_TRUE(store->Remove(keys.back()).ok());
        }
      }
    } else {
      pc_->Prefetch(Prompt(), Extra(static_cast<int>(rng_() % 3)));
    }
  }

  std::string disk_ =
      (std::filesystem::temp_directory_path() / ("pagekv-tiered-diff-" + std::to_string(::getpid()))).string();
  testing::RedisServer redis_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<BlockTiers> tiers_;
  std::unique_ptr<PrefixCache> pc_;
  std::mt19937 rng_;
  std::map<std::pair<int, std::vector<int32_t>>, std::vector<float>> dict_;
  std::vector<Live> live_;
  int64_t admissions_ = 0, hit_blocks_ = 0, background_admissions_ = 0, twin_admissions_ = 0;
};

TEST_P(TieredPrefixDifferentialTest, EveryHitMatchesTheNaiveModel) {
  for (int step = 0; step < GetParam().steps; ++step) {
    Step();
    if (HasFatalFailure()) {
      ADD_FAILURE() << "at step " << step;
      return;
    }
    pc_->CheckInvariants();
    cache_->CheckInvariants();
    if (tiers_ != nullptr) tiers_->CheckInvariants();  // under each store's lock, beside its workers
  }
  while (!live_.empty()) Free(0);
  const PrefixCacheStats st = pc_->Stats();
  std::printf("%s: %lld admissions, %lld blocks hit (pool %lld, host %lld, disk %lld, redis %lld), %lld collisions, "
              "%lld load failures, %zu prefixes in the model\n",
              GetParam().name, static_cast<long long>(admissions_), static_cast<long long>(hit_blocks_),
              static_cast<long long>(st.tier_hit_blocks[0]), static_cast<long long>(st.tier_hit_blocks[1]),
              static_cast<long long>(st.tier_hit_blocks[2]), static_cast<long long>(st.tier_hit_blocks[3]),
              static_cast<long long>(st.collisions), static_cast<long long>(st.tier_load_failures), dict_.size());
  EXPECT_EQ(cache_->Stats().blocks_used, 0) << cache_->LeakReport();
  // The run exercised what it is meant to.
  EXPECT_GT(hit_blocks_, admissions_ / 2) << "too few hits to mean anything";
  if (tiers_ != nullptr) {
    EXPECT_GT(st.tier_hit_blocks[1] + st.tier_hit_blocks[2] + st.tier_hit_blocks[3], 0) << "nothing came back from a tier";
    EXPECT_GT(background_admissions_, 0) << "no load ran in the background";
    EXPECT_GT(twin_admissions_, 0) << "no prompt loaded twice at once";
    EXPECT_GT(st.offloads_ahead, 0);
    EXPECT_GT(st.evictions_precopied, 0) << "no eviction found its copy made ahead";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, TieredPrefixDifferentialTest,
    ::testing::Values(
        DiffCase{"PoolOnly", false, false, false, true, 0, 0, Hash::kSha256, true, 11, 3000},
        DiffCase{"HostWriteBack", true, false, false, false, 4096, 0, Hash::kSha256, true, 12, 3000},
        DiffCase{"HostDiskWriteThrough", true, true, false, true, 4096, 4096, Hash::kSha256, true, 13, 3000},
        DiffCase{"AllTiersXxh3", true, true, true, true, 4096, 4096, Hash::kXxh3, true, 14, 3000},
        DiffCase{"SmallTiersWriteBack", true, true, true, false, 6, 8, Hash::kSha256, false, 15, 3000},
        DiffCase{"SmallTiersWriteThrough", true, true, true, true, 6, 8, Hash::kSha256, false, 16, 3000},
        DiffCase{"ParentBlindHash", true, true, false, true, 12, 4096, Hash::kParentBlind, false, 17, 3000}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace pagekv
