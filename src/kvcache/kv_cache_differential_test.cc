// Seeded differential test: random add / append / fork / truncate / free
// operations run against KvCache and against a deliberately naive model of
// the same behaviour, compared after every step.
//
// The naive model keeps every sequence's tokens in one contiguous vector and
// models blocks as plain integers shared by value between sequences; it finds
// reference counts by scanning every sequence. It knows nothing of the pool,
// the free list or the arena layout.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

struct NaiveSeq {
  int64_t id = 0;
  std::vector<uint8_t> k, v;  // [token][layer][head][row], contiguous
  std::vector<int64_t> blocks;  // logical block uids
  int64_t len = 0;
};

class NaiveCache {
 public:
  NaiveCache(int64_t total_blocks, int64_t block_len, int64_t token_bytes)
      : total_(total_blocks), bl_(block_len), token_bytes_(token_bytes) {}

  int64_t Holders(int64_t uid) const {
    int64_t n = 0;
    for (const auto& s : seqs_) n += std::count(s.blocks.begin(), s.blocks.end(), uid);
    return n;
  }
  int64_t Used() const {
    std::set<int64_t> uids;
    for (const auto& s : seqs_) uids.insert(s.blocks.begin(), s.blocks.end());
    return static_cast<int64_t>(uids.size());
  }
  int64_t Shared() const {
    std::map<int64_t, int> count;
    for (const auto& s : seqs_) for (int64_t u : s.blocks) ++count[u];
    return std::count_if(count.begin(), count.end(), [](auto& p) { return p.second > 1; });
  }
  NaiveSeq* Find(int64_t id) {
    for (auto& s : seqs_) if (s.id == id) return &s;
    return nullptr;
  }

  void Add(int64_t id) { seqs_.push_back(NaiveSeq{id, {}, {}, {}, 0}); }

  // Returns whether the append fits; applies it when it does.
  bool Append(int64_t id, const std::vector<uint8_t>& k, const std::vector<uint8_t>& v, int64_t n) {
    NaiveSeq& s = *Find(id);
    const int64_t want = (s.len + n + bl_ - 1) / bl_;
    const bool cow = s.len % bl_ != 0 && Holders(s.blocks.back()) > 1;
    const int64_t need = want - static_cast<int64_t>(s.blocks.size()) + (cow ? 1 : 0);
    if (Used() + need > total_) return false;
    if (cow) s.blocks.back() = next_uid_++;
    while (static_cast<int64_t>(s.blocks.size()) < want) s.blocks.push_back(next_uid_++);
    s.k.insert(s.k.end(), k.begin(), k.end());
    s.v.insert(s.v.end(), v.begin(), v.end());
    s.len += n;
    return true;
  }

  void Fork(int64_t parent, int64_t child) {
    NaiveSeq copy = *Find(parent);
    copy.id = child;
    seqs_.push_back(copy);
  }

  void Truncate(int64_t id, int64_t new_len) {
    NaiveSeq& s = *Find(id);
    s.len = new_len;
    s.k.resize(static_cast<size_t>(new_len * token_bytes_));
    s.v.resize(static_cast<size_t>(new_len * token_bytes_));
    s.blocks.resize(static_cast<size_t>((new_len + bl_ - 1) / bl_));
  }

  void Free(int64_t id) {
    seqs_.erase(std::find_if(seqs_.begin(), seqs_.end(), [&](auto& s) { return s.id == id; }));
  }

  std::vector<NaiveSeq>& seqs() { return seqs_; }

 private:
  int64_t total_, bl_, token_bytes_;
  int64_t next_uid_ = 0;
  std::vector<NaiveSeq> seqs_;
};

struct DiffCase {
  const char* name;
  CacheKind kind;
  int32_t block_len;
  int64_t num_blocks;
  int64_t ops;
  uint32_t seed;
};

class KvCacheDifferentialTest : public ::testing::TestWithParam<DiffCase> {
 protected:
  void SetUp() override {
    const DiffCase& p = GetParam();
    CacheConfig c;
    c.kind = p.kind;
    c.num_layers = 2;
    c.num_q_heads = 4;
    if (p.kind == CacheKind::kPerHead) {
      c.num_kv_heads = 2;
      c.head_dim = 4;
    } else {
      c.kv_lora_rank = 6;
      c.rope_dim = 2;
    }
    c.block_len = p.block_len;
    c.format = KvFormat::Plain(DType::kF16);
    c.num_blocks = p.num_blocks;
    auto cache = KvCache::Create({.config = c, .huge_pages = false, .prefault = false});
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    cache_ = std::move(*cache);
    const KvLayout& l = cache_->layout();
    layers_ = l.num_layers();
    token_layer_bytes_ = l.num_heads() * l.row_bytes();
    token_bytes_ = layers_ * token_layer_bytes_;
    two_planes_ = l.num_planes() == 2;
  }

  // Naive per-token bytes -> the cache's [layer][token][head][row] input.
  std::vector<uint8_t> ToCacheOrder(const std::vector<uint8_t>& naive, int64_t n) const {
    std::vector<uint8_t> out(naive.size());
    for (int64_t t = 0; t < n; ++t)
      for (int64_t l = 0; l < layers_; ++l)
        std::memcpy(out.data() + (l * n + t) * token_layer_bytes_,
                    naive.data() + t * token_bytes_ + l * token_layer_bytes_,
                    static_cast<size_t>(token_layer_bytes_));
    return out;
  }

  void ExpectSameContents(const NaiveSeq& s) {
    const SequenceView view = *cache_->View(SeqId{s.id});
    ASSERT_EQ(view.num_tokens, s.len) << "sequence " << s.id;
    std::vector<uint8_t> k(s.k.size(), 0xEE), v(s.v.size(), 0xEE);
    ASSERT_TRUE(cache_->Read(SeqId{s.id}, 0, {s.len, k.data(), two_planes_ ? v.data() : nullptr}).ok());
    ASSERT_EQ(k, ToCacheOrder(s.k, s.len)) << "K of sequence " << s.id;
    if (two_planes_) {
      ASSERT_EQ(v, ToCacheOrder(s.v, s.len)) << "V of sequence " << s.id;
    }
  }

  // Counters, lengths and the sharing structure: naive uids and cache block
  // ids must correspond one to one.
  void ExpectSameBookkeeping(NaiveCache& naive) {
    const CacheStats st = cache_->Stats();
    ASSERT_EQ(st.blocks_used, naive.Used());
    ASSERT_EQ(st.blocks_free, st.blocks_total - naive.Used());
    ASSERT_EQ(st.blocks_shared, naive.Shared());
    ASSERT_EQ(st.num_sequences, static_cast<int64_t>(naive.seqs().size()));
    std::map<int64_t, int32_t> uid_to_block;
    std::map<int32_t, int64_t> block_to_uid;
    for (const NaiveSeq& s : naive.seqs()) {
      const SequenceView view = *cache_->View(SeqId{s.id});
      ASSERT_EQ(view.num_tokens, s.len);
      ASSERT_EQ(view.blocks.size(), s.blocks.size());
      for (size_t i = 0; i < s.blocks.size(); ++i) {
        const int32_t b = ToInt(view.blocks[i]);
        auto [it1, new1] = uid_to_block.emplace(s.blocks[i], b);
        auto [it2, new2] = block_to_uid.emplace(b, s.blocks[i]);
        ASSERT_EQ(it1->second, b) << "naive shares a block the cache does not";
        ASSERT_EQ(it2->second, s.blocks[i]) << "cache shares a block the naive model does not";
      }
    }
  }

  std::unique_ptr<KvCache> cache_;
  int64_t layers_ = 0, token_layer_bytes_ = 0, token_bytes_ = 0;
  bool two_planes_ = true;
};

TEST_P(KvCacheDifferentialTest, RandomOperationsMatchTheNaiveModel) {
  const DiffCase& p = GetParam();
  NaiveCache naive(p.num_blocks, p.block_len, token_bytes_);
  std::mt19937 rng(p.seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int64_t appended = 0, refused = 0, cows = 0;
  for (int64_t step = 0; step < p.ops; ++step) {
    auto& seqs = naive.seqs();
    // Under pressure (few free blocks) shrink more often, so the run keeps
    // cycling between full and roomy pools instead of stalling when full.
    const bool tight = cache_->Stats().blocks_free < p.num_blocks / 8;
    const int64_t op = tight && uniform(0, 1) == 0 ? uniform(80, 99) : uniform(0, 99);
    std::set<int64_t> touched;  // sequences whose contents this step may change
    if (seqs.empty() || (op < 8 && seqs.size() < 14)) {
      const SeqId id = cache_->AddSequence();
      naive.Add(ToInt(id));
      touched.insert(ToInt(id));
    } else {
      NaiveSeq& s = seqs[static_cast<size_t>(uniform(0, static_cast<int64_t>(seqs.size()) - 1))];
      const int64_t id = s.id;
      touched.insert(id);
      if (op < 70) {
        const int64_t n = uniform(0, 3) == 0 ? uniform(1, 2 * p.block_len + 1) : 1;
        std::vector<uint8_t> k(static_cast<size_t>(n * token_bytes_)), v(k.size());
        for (auto& b : k) b = static_cast<uint8_t>(rng());
        for (auto& b : v) b = static_cast<uint8_t>(rng());
        const bool cow = cache_->BlocksNeeded(SeqId{id}, n)->copy_on_write;
        // Sharers of the last block must keep their contents through a copy-on-write.
        for (const NaiveSeq& o : seqs)
          if (!s.blocks.empty() && std::count(o.blocks.begin(), o.blocks.end(), s.blocks.back())) touched.insert(o.id);
        const std::vector<uint8_t> kc = ToCacheOrder(k, n), vc = ToCacheOrder(v, n);
        Result<bool> got = cache_->Append(SeqId{id}, {n, kc.data(), two_planes_ ? vc.data() : nullptr});
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        const bool want = naive.Append(id, k, two_planes_ ? v : std::vector<uint8_t>(k.size()), n);
        ASSERT_EQ(*got, want) << "step " << step;
        if (*got) { ++appended; cows += cow; } else { ++refused; }
      } else if (op < 80) {
        const SeqId child = *cache_->Fork(SeqId{id});
        naive.Fork(id, ToInt(child));
        touched.insert(ToInt(child));
      } else if (op < 92) {
        const int64_t new_len = uniform(0, s.len);
        ASSERT_TRUE(cache_->Truncate(SeqId{id}, new_len).ok());
        naive.Truncate(id, new_len);
      } else {
        ASSERT_TRUE(cache_->Free(SeqId{id}).ok());
        naive.Free(id);
        touched.clear();
      }
    }
    cache_->CheckInvariants();
    ExpectSameBookkeeping(naive);
    if (step % 64 == 0) {
      for (const NaiveSeq& s : naive.seqs()) ExpectSameContents(s);
    } else {
      for (const NaiveSeq& s : naive.seqs()) if (touched.count(s.id)) ExpectSameContents(s);
    }
    if (HasFatalFailure()) FAIL() << "diverged at step " << step;
  }
  // The run must actually have exercised the interesting paths.
  EXPECT_GT(appended, p.ops / 3);
  EXPECT_GT(refused, 0) << "the pool never ran out: raise the pressure";
  EXPECT_GT(cows, 0) << "copy-on-write never happened";
}

INSTANTIATE_TEST_SUITE_P(
    Seeded, KvCacheDifferentialTest,
    ::testing::Values(DiffCase{"PerHeadBlock8", CacheKind::kPerHead, 8, 40, 100000, 20261130},
                      DiffCase{"PerHeadBlock16", CacheKind::kPerHead, 16, 24, 30000, 7},
                      DiffCase{"MlaBlock8", CacheKind::kMla, 8, 32, 30000, 99}),
    [](const ::testing::TestParamInfo<DiffCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace pagekv
