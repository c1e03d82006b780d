// Prefix-cache correctness on a real KvCache, with KV rows that depend on
// their whole prefix (tiers/test_kv_model.h), so a wrong hit shows up as a
// content mismatch:
//   - a sequence truncated below its published blocks and grown again with
//     other tokens publishes under its own prefix, never as a child of the
//     blocks it dropped (also at a mid-block cut, after a compaction, and for
//     a fork);
//   - a prefetched block is checked against the request that loads it, not
//     the one that asked for the prefetch;
//   - an event consumer that follows every medium from the events alone ends
//     up with exactly what the pool and every tier hold, after a long
//     randomized run in both write modes;
//   - the Redis tier's counters after re-puts, removes, corrupt reads and
//     keys that went missing.
// Each scenario is run with SHA-256 and with an injected hasher that
// collides on purpose.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/tiers.h"
#include "testing/redis_server.h"
#include "tiers/block_payload.h"
#include "tiers/test_kv_model.h"

namespace pagekv {
namespace {

using test_kv::Compute;
using test_kv::ExpectExactKv;
using test_kv::FirstWrongToken;
using test_kv::Tokens;

constexpr int32_t B = 8;

// Hashers that collide on purpose. The bytes a hasher digests are laid out
// (prefix/block_hasher.cc) as a 15-byte domain, a has-parent flag, the 32
// parent key bytes, then the token count, the tokens and the extra keys.
constexpr size_t kParentEnd = 15 + 1 + 32;

BlockKey Fnv(std::span<const uint8_t> in) {
  BlockKey key;
  uint64_t h = 1469598103934665603ull;
  for (uint8_t b : in) h = (h ^ b) * 1099511628211ull;
  for (size_t i = 0; i < 32; ++i) key.bytes[i] = static_cast<uint8_t>(h >> (8 * (i % 8)) ^ i);
  return key;
}

enum class Hasher { kSha256, kParentBlind, kTokenBlind };

// kParentBlind: a block's key depends on its tokens only, so equal blocks
// after different prefixes collide (only the stored parent tells them apart).
// kTokenBlind: a key depends on its parent only, so every request's n-th
// block has the same key (only the stored tokens tell them apart).
PrefixCacheOptions Options(Hasher h, LowerTiers* tiers = nullptr) {
  PrefixCacheOptions o;
  o.tiers = tiers;
  o.record_events = true;
  if (h == Hasher::kParentBlind) o.hasher.custom = [](std::span<const uint8_t> in) { return Fnv(in.subspan(kParentEnd)); };
  if (h == Hasher::kTokenBlind) o.hasher.custom = [](std::span<const uint8_t> in) { return Fnv(in.first(kParentEnd)); };
  return o;
}

std::string HasherName(Hasher h) {
  switch (h) {
    case Hasher::kSha256: return "Sha256";
    case Hasher::kParentBlind: return "ParentBlind";
    case Hasher::kTokenBlind: return "TokenBlind";
  }
  return "";
}

std::vector<int32_t> Concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// Admits tokens, checks the hit's KV against the model, computes the rest,
// publishes and frees; returns the hit length.
int64_t Serve(KvCache& cache, PrefixCache& pc, const std::vector<int32_t>& tokens) {
  auto a = pc.AddSequence(tokens, {});
  EXPECT_TRUE(a.ok()) << a.status().ToString();
  if (!a.ok()) return -1;
  ExpectExactKv(cache, a->seq, tokens, 0);
  Compute(cache, a->seq, tokens, a->match.num_tokens, 0);
  EXPECT_TRUE(pc.Publish(a->seq, tokens).ok());
  EXPECT_TRUE(pc.Free(a->seq).ok());
  pc.CheckInvariants();
  cache.CheckInvariants();
  return a->match.num_tokens;
}

// ---------------------------------------------------------------------------
// Rollback: the chain is cut with the sequence.

class RollbackTest : public ::testing::TestWithParam<Hasher> {
 protected:
  void SetUp() override {
    cache_ = test_kv::MakeCache(64, B);
    pc_ = std::move(*PrefixCache::Create(*cache_, Options(GetParam())));
  }
  // A sequence admitted through the prefix cache holding `tokens`, every full
  // block published.
  SeqId Grow(const std::vector<int32_t>& tokens) {
    auto a = pc_->AddSequence(tokens, {});
    EXPECT_TRUE(a.ok());
    Compute(*cache_, a->seq, tokens, a->match.num_tokens, 0);
    EXPECT_TRUE(pc_->Publish(a->seq, tokens).ok());
    return a->seq;
  }
  // Appends tokens[from, end) to seq and publishes.
  void Regrow(SeqId seq, const std::vector<int32_t>& tokens, int64_t from) {
    Compute(*cache_, seq, tokens, from, 0);
    ASSERT_TRUE(pc_->Publish(seq, tokens).ok());
    ExpectExactKv(*cache_, seq, tokens, 0);
    pc_->CheckInvariants();
    cache_->CheckInvariants();
  }
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<PrefixCache> pc_;
};

const std::vector<int32_t> kA = Tokens(100, B), kB = Tokens(200, B), kC = Tokens(300, B), kD = Tokens(400, B),
                           kE = Tokens(500, B), kF = Tokens(600, B), kTail = {7};

TEST_P(RollbackTest, TruncatedBelowPublishedBlocksThenRegrownPublishesUnderItsOwnPrefix) {
  const SeqId s = Grow(Concat({kA, kB, kC}));
  ASSERT_TRUE(cache_->Truncate(s, B).ok());  // speculative rollback: keep A
  Regrow(s, Concat({kA, kD, kE, kF}), B);
  ASSERT_TRUE(pc_->Free(s).ok());
  // A B C F: only A B C were computed after this prefix; F's block was
  // computed after A D E and must not hit.
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, kB, kC, kF, kTail})), 3 * B);
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, kD, kE, kF, kTail})), 4 * B);
}

TEST_P(RollbackTest, ACutInsideAPublishedBlockDropsThatBlockFromTheChainToo) {
  const SeqId s = Grow(Concat({kA, kB, kC}));
  ASSERT_TRUE(cache_->Truncate(s, B + 3).ok());  // B's block is now partly filled
  std::vector<int32_t> b2 = kB;
  for (size_t i = 3; i < b2.size(); ++i) b2[i] += 1000;  // same first 3 tokens, then others
  Regrow(s, Concat({kA, b2, kE}), B + 3);
  ASSERT_TRUE(pc_->Free(s).ok());
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, kB, kE, kTail})), 2 * B) << "E was computed after A b2";
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, b2, kE, kTail})), 3 * B);
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, kB, kC, kTail})), 3 * B) << "the original chain still hits";
}

TEST_P(RollbackTest, RepeatedRollbacksNeverLeaveAStaleParent) {
  std::mt19937 rng(7);
  std::vector<int32_t> tokens = Concat({kA, kB});
  std::vector<std::vector<int32_t>> history = {tokens};
  const SeqId s = Grow(tokens);
  for (int round = 0; round < 40; ++round) {
    const auto keep = static_cast<int64_t>(rng() % std::min<size_t>(tokens.size() + 1, 5 * B));
    ASSERT_TRUE(cache_->Truncate(s, keep).ok());
    tokens.resize(static_cast<size_t>(keep));
    // Whole blocks from three patterns (and some single tokens), so equal
    // blocks come back after different prefixes.
    for (int64_t i = 0, n = 1 + rng() % 3; i < n; ++i) {
      const uint32_t which = rng() % 3;
      const std::vector<int32_t>& pattern = which == 0 ? kC : which == 1 ? kD : kE;
      tokens.insert(tokens.end(), pattern.begin(), pattern.end());
    }
    for (int64_t i = 0, n = rng() % 3; i < n; ++i) tokens.push_back(static_cast<int32_t>(rng() % 4));
    Regrow(s, tokens, keep);
    history.push_back(tokens);
  }
  ASSERT_TRUE(pc_->Free(s).ok());
  // Prompts spliced from two of the sequence's past states at a block
  // boundary: hits may go only as far as the cached KV was computed after
  // exactly this prefix.
  for (int probe = 0; probe < 200; ++probe) {
    const auto& x = history[rng() % history.size()];
    const auto& y = history[rng() % history.size()];
    const size_t cut = B * (rng() % (x.size() / B + 1));
    std::vector<int32_t> p(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(cut));
    if (y.size() > cut) p.insert(p.end(), y.begin() + static_cast<std::ptrdiff_t>(cut), y.end());
    p.push_back(9);
    auto a = pc_->AddSequence(p, {});
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(FirstWrongToken(*cache_, a->seq, p, 0), -1) << "probe " << probe << ", hit " << a->match.num_tokens;
    ASSERT_TRUE(pc_->Free(a->seq).ok());
  }
}

TEST_P(RollbackTest, ACompactedSequencePublishesNothingMore) {
  Serve(*cache_, *pc_, Concat({kA, kB, kTail}));
  const int64_t cached = pc_->Stats().cached_blocks;
  // Token eviction on a sequence admitted through the prefix cache, before
  // it published (compaction refuses published blocks): afterwards its
  // slots no longer follow its tokens, so nothing of it may be published.
  auto b = pc_->AddSequence(Concat({kE, kF}), {});
  ASSERT_TRUE(b.ok());
  Compute(*cache_, b->seq, Concat({kE, kF}), 0, 0);
  const KvLayout& l = cache_->layout();
  std::vector<int32_t> keep;
  for (int li = 0; li < l.num_layers() * l.num_heads(); ++li) {
    for (int32_t slot = 0; slot < 2 * B; ++slot) {
      if (slot != 2) keep.push_back(slot);
    }
  }
  ASSERT_TRUE(cache_->Compact(b->seq, keep, 2 * B - 1).ok());
  const std::vector<int32_t> more = Concat({kE, kF, kTail, kTail});  // grows back to two full blocks
  Compute(*cache_, b->seq, std::vector<int32_t>(more.begin(), more.begin() + 2 * B), 2 * B - 1, 0);
  ASSERT_TRUE(pc_->Publish(b->seq, more).ok());
  EXPECT_EQ(pc_->Stats().cached_blocks, cached) << "no block of a compacted sequence is published";
  ASSERT_TRUE(pc_->Free(b->seq).ok());
  pc_->CheckInvariants();
}

TEST_P(RollbackTest, AForkPublishesItsOwnBlocksUnderTheSharedPrefix) {
  const SeqId parent = Grow(Concat({kA, kB, kTail}));
  auto child = pc_->Fork(parent);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  Regrow(*child, Concat({kA, kB, kTail, Tokens(700, B - 1), kE}), 2 * B + 1);
  ASSERT_TRUE(cache_->Truncate(parent, B).ok());
  Regrow(parent, Concat({kA, kC, kD}), B);
  ASSERT_TRUE(pc_->Free(parent).ok());
  ASSERT_TRUE(pc_->Free(*child).ok());
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, kB, kTail, Tokens(700, B - 1), kE, kTail})), 4 * B);
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, kC, kD, kTail})), 3 * B);
  EXPECT_EQ(Serve(*cache_, *pc_, Concat({kA, kB, kD, kTail})), 2 * B) << "D was computed after A C";
  EXPECT_EQ(pc_->Fork(SeqId{9999}).status().code(), StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Hashers, RollbackTest, ::testing::Values(Hasher::kSha256, Hasher::kParentBlind),
                         [](const auto& info) { return HasherName(info.param); });

// ---------------------------------------------------------------------------
// Prefetch: a staged block is verified for the request that loads it.

class PrefetchVerifyTest : public ::testing::TestWithParam<Tier> {
 protected:
  void SetUp() override {
    TierOptions o;
    if (GetParam() == Tier::kDisk) {
      o.disk_path = disk_;
      o.disk_bytes = 1 << 20;
      o.disk_direct_io = false;
    } else {
      ASSERT_TRUE(redis_.Start().ok());
      o.redis_url = redis_.url();
    }
    cache_ = test_kv::MakeCache(6, B);
    tiers_ = std::move(*BlockTiers::Create(o, B, cache_->block_payload_bytes()));
    pc_ = std::move(*PrefixCache::Create(*cache_, Options(Hasher::kTokenBlind, tiers_.get())));
  }
  void TearDown() override {
    pc_.reset();
    tiers_.reset();
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }
  // Pushes every cached block out of the pool: a request whose blocks all
  // collide with cached ones publishes nothing, but takes the whole pool.
  void FlushPool() {
    const SeqId s = cache_->AddSequence();
    ASSERT_TRUE(*cache_->Reserve(s, 6 * B));
    ASSERT_TRUE(cache_->Free(s).ok());
    ASSERT_EQ(pc_->Stats().cached_blocks, 0);
  }
  std::string disk_ = (std::filesystem::temp_directory_path() / ("pagekv-prefetch-" + std::to_string(::getpid()))).string();
  testing::RedisServer redis_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<BlockTiers> tiers_;
  std::unique_ptr<PrefixCache> pc_;
};

TEST_P(PrefetchVerifyTest, AStagedBlockIsRefusedToAnotherRequestWithTheSameKeys) {
  const std::vector<int32_t> a = Tokens(1, 4 * B + 1), b = Tokens(5000, 4 * B + 1);
  ASSERT_EQ(Serve(*cache_, *pc_, a), 0);
  tiers_->Drain();  // written through
  FlushPool();
  // Under this hasher b's four block keys are a's: without a prefetch the
  // load checks b's tokens and refuses a's payload.
  pc_->Prefetch(a, {});
  tiers_->Drain();
  ASSERT_EQ(tiers_->Stats().prefetched, 4);
  auto adm = pc_->AddSequence(b, {});
  ASSERT_TRUE(adm.ok());
  EXPECT_EQ(adm->match.num_tokens, 0) << "b was served a's KV from the staging area";
  ExpectExactKv(*cache_, adm->seq, b, 0);
  EXPECT_GE(tiers_->Stats().staged_mismatches, 1);
  ASSERT_TRUE(pc_->Free(adm->seq).ok());
  pc_->CheckInvariants();
}

TEST_P(PrefetchVerifyTest, AStagedBlockStillLoadsForTheRequestItWasFetchedFor) {
  const std::vector<int32_t> a = Tokens(1, 4 * B + 1);
  ASSERT_EQ(Serve(*cache_, *pc_, a), 0);
  tiers_->Drain();
  FlushPool();
  pc_->Prefetch(a, {});
  tiers_->Drain();
  EXPECT_EQ(Serve(*cache_, *pc_, a), 4 * B);
  const TiersStats st = tiers_->Stats();
  EXPECT_EQ(st.load_hits[static_cast<int>(GetParam())], 4);
  EXPECT_EQ(st.staged_mismatches, 0);
}

INSTANTIATE_TEST_SUITE_P(SlowTiers, PrefetchVerifyTest, ::testing::Values(Tier::kDisk, Tier::kRedis),
                         [](const auto& info) { return std::string(TierName(info.param)); });

// ---------------------------------------------------------------------------
// Events: a consumer following every medium from the events alone.

class EventConsumer {
 public:
  void Apply(const std::vector<KvEvent>& events) {
    for (const KvEvent& e : events) {
      ASSERT_EQ(e.sequence, next_) << "events are numbered consecutively";
      ++next_;
      switch (e.type) {
        case KvEvent::Type::kBlockStored:
          ASSERT_EQ(e.token_ids.size(), e.keys.size() * static_cast<size_t>(e.block_len));
          for (const BlockKey& k : e.keys) held_[e.tier].insert(k.Hex());
          break;
        case KvEvent::Type::kBlockRemoved:
          for (const BlockKey& k : e.keys) held_[e.tier].erase(k.Hex());
          break;
        case KvEvent::Type::kAllBlocksCleared:
          held_["pool"].clear();  // the pool's keys; lower tiers announce their own drops
          break;
      }
    }
  }
  const std::set<std::string>& held(const std::string& medium) { return held_[medium]; }

 private:
  uint64_t next_ = 1;
  std::map<std::string, std::set<std::string>> held_;
};

int64_t DbSize(const testing::RedisServer& redis) {
  auto r = redis.Command("DBSIZE");  // ":<n>\r\n"
  return r.ok() && r->size() > 1 && (*r)[0] == ':' ? std::stoll(r->substr(1)) : -1;
}

BlockKey FromHex(const std::string& hex) {
  BlockKey k;
  k.size = static_cast<uint8_t>(hex.size() / 2);
  for (size_t i = 0; i < k.size; ++i) k.bytes[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return k;
}

struct EventsCase {
  bool write_through;
  Hasher hasher;
  uint32_t seed;
};

void PrintTo(const EventsCase& c, std::ostream* os) {
  *os << (c.write_through ? "write-through, " : "write-back, ") << HasherName(c.hasher) << ", seed " << c.seed;
}

class TierEventsTest : public ::testing::TestWithParam<EventsCase> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(redis_.Start().ok());
    cache_ = test_kv::MakeCache(12, B);
    TierOptions o;
    o.host_bytes = 6 * TierPayloadBytes(B, cache_->block_payload_bytes());  // small: drops for room
    o.disk_path = disk_;
    o.disk_bytes = 10 * 4096;  // 10 slots: drops for room
    o.disk_direct_io = false;
    o.redis_url = redis_.url();
    o.redis_namespace = "ev";
    o.write_through = GetParam().write_through;
    o.workers = 2;
    tiers_ = std::move(*BlockTiers::Create(o, B, cache_->block_payload_bytes()));
    pc_ = std::move(*PrefixCache::Create(*cache_, Options(GetParam().hasher, tiers_.get())));
  }
  void TearDown() override {
    pc_.reset();
    tiers_.reset();
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }

  // The consumer's view against the real contents of every medium.
  void Compare(const std::string& when) {
    tiers_->Drain();  // asynchronous puts done
    consumer_.Apply(pc_->DrainEvents());
    ASSERT_EQ(pc_->dropped_events(), 0);
    ASSERT_EQ(tiers_->Stats().dropped_changes, 0);
    const auto& pool = consumer_.held("pool");
    EXPECT_EQ(static_cast<int64_t>(pool.size()), pc_->Stats().cached_blocks) << when;
    for (const std::string& k : pool) EXPECT_TRUE(pc_->Find(FromHex(k)).has_value()) << when << ": pool " << k;
    for (Tier t : {Tier::kHost, Tier::kDisk, Tier::kRedis}) {
      BlockStore* s = tiers_->store(t);
      const auto& held = consumer_.held(TierName(t));
      EXPECT_EQ(static_cast<int64_t>(held.size()), s->Stats().blocks_now) << when << ": " << TierName(t);
      for (const std::string& k : held) EXPECT_TRUE(*s->Contains(FromHex(k))) << when << ": " << TierName(t) << " " << k;
    }
    EXPECT_EQ(DbSize(redis_), static_cast<int64_t>(consumer_.held("redis").size())) << when << ": what the server holds";
    // Nothing the check itself did (EXISTS finding a key gone) was left out.
    consumer_.Apply(pc_->DrainEvents());
    EXPECT_EQ(static_cast<int64_t>(consumer_.held("redis").size()), tiers_->store(Tier::kRedis)->Stats().blocks_now);
  }

  std::string disk_ = (std::filesystem::temp_directory_path() / ("pagekv-events-" + std::to_string(::getpid()))).string();
  testing::RedisServer redis_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<BlockTiers> tiers_;
  std::unique_ptr<PrefixCache> pc_;
  EventConsumer consumer_;
};

TEST_P(TierEventsTest, AConsumerOfTheEventsAloneKnowsWhatEveryTierHolds) {
  std::mt19937 rng(GetParam().seed);
  // Prompts from a few families sharing prefixes, so blocks are hit,
  // evicted, pushed down, dropped for room and loaded back.
  std::vector<std::vector<int32_t>> seen;
  std::vector<BlockKey> keys_seen;
  auto prompt = [&] {
    std::vector<int32_t> p = Tokens(static_cast<int32_t>(100 * (1 + rng() % 3)), B);
    const int64_t blocks = rng() % 5;
    for (int64_t i = 0; i < blocks; ++i) {
      const std::vector<int32_t> pattern = Tokens(static_cast<int32_t>(1000 + 10 * (rng() % 3)), B);
      p.insert(p.end(), pattern.begin(), pattern.end());
    }
    for (int64_t i = 0; i < 1 + static_cast<int64_t>(rng() % B); ++i) p.push_back(static_cast<int32_t>(rng() % 50));
    return p;
  };
  for (int step = 0; step < 400; ++step) {
    const uint32_t op = rng() % 20;
    if (op < 11) {
      const std::vector<int32_t> p = prompt();
      if (Serve(*cache_, *pc_, p) < 0) return;
      seen.push_back(p);
      if (auto k = pc_->Keys(p, {}); k.ok()) keys_seen.insert(keys_seen.end(), k->begin(), k->end());
    } else if (op < 13 && !seen.empty()) {
      // A sequence rolled back and grown again with other tokens.
      std::vector<int32_t> p = seen[rng() % seen.size()];
      auto a = pc_->AddSequence(p, {});
      ASSERT_TRUE(a.ok());
      Compute(*cache_, a->seq, p, a->match.num_tokens, 0);
      ASSERT_TRUE(pc_->Publish(a->seq, p).ok());
      const auto keep = static_cast<int64_t>(rng() % p.size());
      ASSERT_TRUE(cache_->Truncate(a->seq, keep).ok());
      p.resize(static_cast<size_t>(keep));
      for (int i = 0; i < 2 * B; ++i) p.push_back(static_cast<int32_t>(2000 + rng() % 3));
      Compute(*cache_, a->seq, p, keep, 0);
      ASSERT_TRUE(pc_->Publish(a->seq, p).ok());
      ExpectExactKv(*cache_, a->seq, p, 0);
      ASSERT_TRUE(pc_->Free(a->seq).ok());
    } else if (op < 15 && !seen.empty()) {
      pc_->Prefetch(seen[rng() % seen.size()], {});
    } else if (op < 17 && !keys_seen.empty()) {
      // An operator (or another process) removes a block from one tier.
      const Tier t = static_cast<Tier>(1 + rng() % 3);
      ASSERT_TRUE(tiers_->store(t)->Remove(keys_seen[rng() % keys_seen.size()]).ok());
    } else if (op < 18 && !keys_seen.empty()) {
      // A value corrupted in Redis: found on its next read, and deleted.
      const BlockKey& k = keys_seen[rng() % keys_seen.size()];
      if (*tiers_->store(Tier::kRedis)->Contains(k)) {
        ASSERT_TRUE(redis_.Command("SET ev:" + k.Hex() + " garbage").ok());
      }
    } else if (op < 19) {
      // A key gone from the server behind this process's back (maxmemory
      // eviction, expiry): noticed when next looked up.
      if (!keys_seen.empty()) {
        ASSERT_TRUE(redis_.Command("DEL ev:" + keys_seen[rng() % keys_seen.size()].Hex()).ok());
      }
    } else if (rng() % 8 == 0) {
      pc_->Clear();
    }
    if (step % 50 == 49) {
      // Reads every redis block this process holds (the reads find corrupt
      // and vanished ones) before comparing.
      for (const BlockKey& k : keys_seen) (void)tiers_->store(Tier::kRedis)->Contains(k);
      Compare("step " + std::to_string(step));
      if (HasFailure()) return;
    }
  }
  Compare("the end");
}

INSTANTIATE_TEST_SUITE_P(Modes, TierEventsTest,
                         ::testing::Values(EventsCase{true, Hasher::kSha256, 1}, EventsCase{false, Hasher::kSha256, 2},
                                           EventsCase{true, Hasher::kParentBlind, 3},
                                           EventsCase{false, Hasher::kTokenBlind, 4}),
                         [](const auto& info) {
                           return std::string(info.param.write_through ? "WriteThrough" : "WriteBack") +
                                  HasherName(info.param.hasher);
                         });

// ---------------------------------------------------------------------------
// Redis counters.

class RedisCountersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(redis_.Start().ok());
    RedisStoreOptions o;
    o.url = redis_.url();
    o.key_namespace = "ctr";
    o.on_change = [this](const TierChange& c) { changes_.push_back(c); };
    store_ = std::move(*CreateRedisStore(o));
  }
  static BlockMeta Meta(int i) {
    BlockMeta m;
    m.key.bytes[0] = static_cast<uint8_t>(i);
    m.key.bytes[1] = 0xab;
    m.tokens = Tokens(i * 10, B);
    m.geometry = 9;
    return m;
  }
  int Count(TierChange::Kind kind) const {
    return static_cast<int>(std::count_if(changes_.begin(), changes_.end(), [&](const TierChange& c) { return c.kind == kind; }));
  }
  testing::RedisServer redis_;
  std::unique_ptr<BlockStore> store_;
  std::vector<TierChange> changes_;
  std::vector<std::byte> kv_ = std::vector<std::byte>(256, std::byte{3});
  int64_t payload_ = static_cast<int64_t>(tiers::PayloadBytes(B, 256));
};

TEST_F(RedisCountersTest, RePutsCountOnceAndRemovesSubtract) {
  ASSERT_TRUE(store_->Put(Meta(1), kv_).ok());
  ASSERT_TRUE(store_->Put(Meta(1), kv_).ok());
  EXPECT_EQ(store_->Stats().blocks_now, 1);
  EXPECT_EQ(store_->Stats().bytes_now, payload_);
  ASSERT_TRUE(store_->Remove(Meta(1).key).ok());
  EXPECT_EQ(store_->Stats().blocks_now, 0);
  EXPECT_EQ(store_->Stats().bytes_now, 0);
  // The same through the pipelined path.
  const std::vector<BlockMeta> metas = {Meta(2), Meta(3), Meta(2)};
  const std::vector<std::span<const std::byte>> kvs(3, kv_);
  ASSERT_TRUE(store_->PutMany(metas, kvs).ok());
  ASSERT_TRUE(store_->PutMany(metas, kvs).ok());
  EXPECT_EQ(store_->Stats().blocks_now, 2);
  EXPECT_EQ(store_->Stats().bytes_now, 2 * payload_);
  EXPECT_EQ(store_->Stats().puts, 8);
  ASSERT_TRUE(store_->Remove(Meta(2).key).ok());
  ASSERT_TRUE(store_->Remove(Meta(2).key).ok());
  EXPECT_EQ(store_->Stats().blocks_now, 1);
  EXPECT_EQ(Count(TierChange::Kind::kStored), 3);
  EXPECT_EQ(Count(TierChange::Kind::kRemoved), 2);
  EXPECT_EQ(DbSize(redis_), 1);
}

TEST_F(RedisCountersTest, CorruptReadsAndVanishedKeysAreSubtracted) {
  for (int i : {1, 2, 3}) ASSERT_TRUE(store_->Put(Meta(i), kv_).ok());
  ASSERT_TRUE(redis_.Command("SET ctr:" + Meta(2).key.Hex() + " garbage").ok());
  std::vector<std::byte> out(256);
  EXPECT_FALSE(*store_->Get(Meta(2), out));
  EXPECT_EQ(store_->Stats().corrupt, 1);
  EXPECT_EQ(store_->Stats().blocks_now, 2);
  EXPECT_EQ(store_->Stats().bytes_now, 2 * payload_);
  EXPECT_EQ(DbSize(redis_), 2) << "the corrupt value was deleted";
  // Gone behind the store's back (evicted, expired, another process):
  // counted out when a lookup finds it missing.
  ASSERT_TRUE(redis_.Command("DEL ctr:" + Meta(3).key.Hex()).ok());
  EXPECT_FALSE(*store_->Contains(Meta(3).key));
  EXPECT_EQ(store_->Stats().blocks_now, 1);
  ASSERT_TRUE(redis_.Command("FLUSHALL").ok());
  EXPECT_FALSE(*store_->Get(Meta(1), out));
  EXPECT_EQ(store_->Stats().blocks_now, 0);
  EXPECT_EQ(store_->Stats().bytes_now, 0);
  EXPECT_EQ(Count(TierChange::Kind::kStored), 3);
  EXPECT_EQ(Count(TierChange::Kind::kRemoved), 3);
}

}  // namespace
}  // namespace pagekv
