// Hybrid caches (CacheConfig::layer_windows): the layout's groups, one table
// per group in one pool, sliding groups releasing what their window passed,
// and every KvCache operation (append, read, fork with copy-on-write,
// reserve / unreserve, truncate, sharing, statistics) per group, checked
// against what a uniform cache of the same layers stores.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "base/checked_math.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

// Gemma 3 270M's pattern at a small size: 18 layers, every sixth full.
std::vector<int32_t> GemmaWindows(int32_t layers, int32_t window) {
  std::vector<int32_t> w(static_cast<size_t>(layers), window);
  for (int32_t l = 5; l < layers; l += 6) w[static_cast<size_t>(l)] = 0;
  return w;
}

CacheConfig Config(std::vector<int32_t> windows, int64_t blocks, int32_t block_len = 8) {
  CacheConfig c;
  c.num_layers = static_cast<int32_t>(windows.size());
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.block_len = block_len;
  c.format = KvFormat::Plain(DType::kF32);
  c.num_blocks = blocks;
  c.layer_windows = std::move(windows);
  return c;
}

TEST(KvLayoutGroupsTest, GemmaPatternFormsGroupsOfTheGcdOfTheLayerCounts) {
  const KvLayout l = *KvLayout::Create(Config(GemmaWindows(18, 32), 10));
  // 15 sliding + 3 full: gcd 3, so 1 full group and 5 sliding groups of 3.
  ASSERT_EQ(l.num_groups(), 6);
  EXPECT_EQ(l.layers_per_block(), 3);
  EXPECT_TRUE(l.hybrid());
  EXPECT_EQ(l.group_window(0), 0);
  EXPECT_EQ(std::vector<int32_t>(l.group_layers(0).begin(), l.group_layers(0).end()), (std::vector<int32_t>{5, 11, 17}));
  for (int32_t g = 1; g < 6; ++g) EXPECT_EQ(l.group_window(g), 32);
  EXPECT_EQ(std::vector<int32_t>(l.group_layers(1).begin(), l.group_layers(1).end()), (std::vector<int32_t>{0, 1, 2}));
  for (int32_t layer = 0; layer < 18; ++layer) {
    const int32_t g = l.group_of(layer);
    const auto layers = l.group_layers(g);
    EXPECT_NE(std::find(layers.begin(), layers.end(), layer), layers.end());
  }
  // A block holds 3 layers' slabs; a token of every layer costs 6 blocks' worth.
  const KvLayout flat = *KvLayout::Create([] { auto c = Config({}, 10); c.num_layers = 18; return c; }());
  EXPECT_EQ(l.bytes_per_block() * 6, flat.bytes_per_block());
  EXPECT_EQ(l.bytes_per_token(), flat.bytes_per_token());
  EXPECT_EQ(l.bytes_per_block_token() * 6, l.bytes_per_token());
  EXPECT_EQ(l.total_bytes() * 6, flat.total_bytes());
  // Layers of one slot share offsets: layer 0 (group 1, slot 0) and layer 5 (group 0, slot 0).
  EXPECT_EQ(l.SlabOffset(0, 1, 1, 7), l.SlabOffset(5, 1, 1, 7));
  EXPECT_EQ(l.SlabOffset(2, 0, 0, 3), l.SlabOffset(17, 0, 0, 3));
  EXPECT_NE(l.SlabOffset(0, 0, 0, 3), l.SlabOffset(1, 0, 0, 3));
  // Blocks held at 1,000 tokens and steps of one: 125 for the full group,
  // ceil(31 / 8) + 1 = 5 for each sliding one.
  EXPECT_EQ(l.BlocksHeld(1000, 1), 125 + 5 * 5);
  EXPECT_EQ(l.BlocksHeld(16, 1), 6 * 2);  // short: every group holds all
  EXPECT_EQ(flat.BlocksHeld(1000, 1), 125);
}

TEST(KvLayoutGroupsTest, UnevenCountsGiveSmallerGroupsAndAllSlidingIsOneGroup) {
  std::vector<int32_t> w(26, 64);
  for (int32_t l = 5; l < 26; l += 6) w[static_cast<size_t>(l)] = 0;  // Gemma 3 1B: 22 + 4
  const KvLayout l = *KvLayout::Create(Config(w, 4));
  EXPECT_EQ(l.layers_per_block(), 2);
  EXPECT_EQ(l.num_groups(), 13);
  const KvLayout all = *KvLayout::Create(Config(std::vector<int32_t>(6, 64), 4));
  EXPECT_EQ(all.num_groups(), 1);
  EXPECT_TRUE(all.hybrid());
  EXPECT_EQ(all.group_window(0), 64);
  // Two window sizes and full layers: 2 x 16, 2 x 64, 4 x 0 -> gcd 2.
  const KvLayout mixed = *KvLayout::Create(Config({16, 64, 0, 16, 64, 0, 0, 0}, 4));
  EXPECT_EQ(mixed.num_groups(), 4);
  EXPECT_EQ(mixed.group_window(0), 0);
  EXPECT_EQ(mixed.group_window(2), 16);
  EXPECT_EQ(mixed.group_window(3), 64);
}

TEST(KvLayoutGroupsTest, BadWindowsAreRefusedNamingTheField) {
  auto error = [](CacheConfig c) { return KvLayout::Create(c).status().message(); };
  EXPECT_NE(error(Config({32, 32, 0}, 4, 64)).find("block_len 64 does not suit the sliding window of 32"), std::string::npos);
  EXPECT_NE(error(Config({32, -1, 0}, 4)).find("layer_windows[1]"), std::string::npos);
  CacheConfig short_list = Config({32, 0}, 4);
  short_list.num_layers = 3;
  EXPECT_NE(error(short_list).find("layer_windows has 2 entries for 3 layers"), std::string::npos);
  CacheConfig formats = Config({32, 32, 0, 0}, 4);  // groups {2, 3} full and {0, 1} sliding
  formats.layer_formats = {KvFormat::Plain(DType::kF32), KvFormat::Plain(DType::kF16), KvFormat::Plain(DType::kF16),
                           KvFormat::Plain(DType::kF16)};
  EXPECT_NE(error(formats).find("share a slot"), std::string::npos);
  formats.layer_formats = {KvFormat::Plain(DType::kF32), KvFormat::Plain(DType::kF16), KvFormat::Plain(DType::kF32),
                           KvFormat::Plain(DType::kF16)};
  EXPECT_TRUE(KvLayout::Create(formats).ok());  // the formats repeat per group
}

// One token's rows for every layer, distinct per (sequence tag, position).
struct Rows {
  std::vector<float> k, v;
};
Rows MakeRows(const KvLayout& l, int64_t n, int64_t first_pos, int tag) {
  const int64_t per = int64_t{l.num_heads()} * l.row_elems();
  Rows r;
  r.k.resize(static_cast<size_t>(l.num_layers() * n * per));
  r.v.resize(r.k.size());
  for (int32_t layer = 0; layer < l.num_layers(); ++layer) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < per; ++e) {
        const size_t i = static_cast<size_t>((layer * n + t) * per + e);
        r.k[i] = static_cast<float>(tag * 100000 + layer * 1000 + (first_pos + t)) + 0.001f * static_cast<float>(e);
        r.v[i] = -r.k[i];
      }
    }
  }
  return r;
}

class HybridCacheTest : public ::testing::Test {
 protected:
  static constexpr int32_t kWindow = 20, kBl = 8;
  void SetUp() override {
    // 4 sliding (20) + 2 full layers: groups of 2 -> 1 full, 2 sliding.
    cache_ = std::move(*KvCache::Create({.config = Config({20, 20, 0, 20, 20, 0}, 200, kBl), .prefault = false}));
    ASSERT_EQ(cache_->layout().num_groups(), 3);
  }
  // Appends n tokens and releases out-of-window blocks, as a step does.
  void Grow(SeqId s, int64_t n, int tag) {
    const int64_t len = cache_->View(s)->num_tokens;
    const Rows r = MakeRows(cache_->layout(), n, len, tag);
    ASSERT_TRUE(*cache_->Append(s, {n, r.k.data(), r.v.data()}));
    ASSERT_TRUE(cache_->ReleaseOutOfWindow(s).ok());
    cache_->CheckInvariants();
  }
  // The rows of positions [begin, end) of layer `layer` read back.
  void ExpectRows(SeqId s, int64_t begin, int64_t end, int tag) {
    const KvLayout& l = cache_->layout();
    const int64_t n = end - begin;
    std::vector<float> k(static_cast<size_t>(l.num_layers() * n * l.num_heads() * l.row_elems())), v(k.size());
    ASSERT_TRUE(cache_->Read(s, begin, {n, k.data(), v.data()}).ok());
    const Rows want = MakeRows(l, n, begin, tag);
    EXPECT_EQ(k, want.k);
    EXPECT_EQ(v, want.v);
  }
  int64_t Held(SeqId s, int32_t g) {
    const SequenceView v = *cache_->View(s, g);
    return static_cast<int64_t>(v.blocks.size()) - v.released_blocks;
  }
  std::unique_ptr<KvCache> cache_;
};

TEST_F(HybridCacheTest, SlidingGroupsHoldOnlyTheirWindowAndFullGroupsEverything) {
  const SeqId s = cache_->AddSequence();
  const int64_t bound = CeilDiv(int64_t{kWindow}, int64_t{kBl}) + 1;
  int64_t len = 0;
  std::mt19937 rng(7);
  while (len < 300) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 12);
    Grow(s, n, 1);
    len += n;
    EXPECT_EQ(Held(s, 0), CeilDiv(len, int64_t{kBl})) << len;
    for (int32_t g = 1; g < 3; ++g) {
      const SequenceView v = *cache_->View(s, g);
      EXPECT_EQ(v.window, kWindow);
      EXPECT_LE(Held(s, g), bound) << "group " << g << " at " << len << " tokens";
      // Exactly the blocks the next query's window reaches.
      EXPECT_EQ(v.released_blocks, std::max<int64_t>(0, len - kWindow + 1) / kBl);
    }
  }
  // The rows in every group's window read back; earlier ones are refused.
  ExpectRows(s, len - kWindow + 1, len, 1);
  EXPECT_EQ(cache_->Read(s, 0, {1, std::vector<float>(1 << 12).data(), std::vector<float>(1 << 12).data()}).code(),
            StatusCode::kFailedPrecondition);
  const SequenceStats st = *cache_->StatsFor(s);
  EXPECT_EQ(st.num_blocks, Held(s, 0) + Held(s, 1) + Held(s, 2));
  EXPECT_EQ(cache_->Stats().blocks_used, st.num_blocks);
  ASSERT_TRUE(cache_->Free(s).ok());
  EXPECT_EQ(cache_->FreeBlockCount(), 200);
  cache_->CheckInvariants();
}

TEST_F(HybridCacheTest, ForkSharesEveryGroupAndCopiesEachPartialLastBlockOnWrite) {
  const SeqId a = cache_->AddSequence();
  Grow(a, 45, 1);  // 45 tokens: a partial last block in every group
  const int64_t used = cache_->Stats().blocks_used;
  const SeqId b = *cache_->Fork(a);
  EXPECT_EQ(cache_->Stats().blocks_used, used);  // nothing copied at the fork
  const AppendNeed need = *cache_->BlocksNeeded(b, 1);
  EXPECT_EQ(need.copies, 3);  // one copy per group
  EXPECT_EQ(need.new_blocks, 0);
  const int64_t copies = cache_->CopyOnWriteCount();
  Grow(b, 1, 2);
  EXPECT_EQ(cache_->CopyOnWriteCount(), copies + 3);
  Grow(a, 1, 3);
  EXPECT_EQ(cache_->CopyOnWriteCount(), copies + 3);  // a's blocks are its own again
  // Each side reads its own 46th token and the shared 45 before it.
  ExpectRows(a, 45 - kWindow + 2, 45, 1);
  ExpectRows(b, 45 - kWindow + 2, 45, 1);
  ExpectRows(a, 45, 46, 3);
  ExpectRows(b, 45, 46, 2);
  for (int i = 0; i < 40; ++i) {
    Grow(a, 1, 3);
    Grow(b, 1, 2);
  }
  ASSERT_TRUE(cache_->Free(a).ok());
  ASSERT_TRUE(cache_->Free(b).ok());
  EXPECT_EQ(cache_->FreeBlockCount(), 200);
  cache_->CheckInvariants();
}

TEST_F(HybridCacheTest, UnreservePutsEveryGroupBackIncludingCopies) {
  const SeqId a = cache_->AddSequence();
  Grow(a, 37, 1);
  const SeqId b = *cache_->Fork(a);
  const int64_t free_before = cache_->FreeBlockCount();
  ReserveUndo undo;
  ASSERT_TRUE(*cache_->Reserve(b, 20, &undo));
  EXPECT_TRUE(undo.copied);
  ASSERT_EQ(undo.groups.size(), 3u);
  ASSERT_TRUE(cache_->Unreserve(undo).ok());
  EXPECT_EQ(cache_->FreeBlockCount(), free_before);
  for (int32_t g = 0; g < 3; ++g) {
    EXPECT_TRUE(std::equal(cache_->View(a, g)->blocks.begin(), cache_->View(a, g)->blocks.end(),
                           cache_->View(b, g)->blocks.begin()));
  }
  cache_->CheckInvariants();
  ASSERT_TRUE(cache_->Free(a).ok());
  ASSERT_TRUE(cache_->Free(b).ok());
  EXPECT_EQ(cache_->FreeBlockCount(), 200);
}

TEST_F(HybridCacheTest, TruncateRefusesToReachBackIntoReleasedBlocks) {
  const SeqId s = cache_->AddSequence();
  Grow(s, 64, 1);  // the next query (64) reads 45.. : blocks 0..4 released
  EXPECT_EQ(cache_->View(s, 1)->released_blocks, 5);
  // Rolling back to 60 keeps the window (41..) out of block 5? 41 / 8 = 5: fine.
  EXPECT_TRUE(cache_->Truncate(s, 60).ok());
  // To 50 the window would start at 31 (block 3), released: refused, unchanged.
  const Status st = cache_->Truncate(s, 50);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("roll back at most to"), std::string::npos) << st.message();
  EXPECT_EQ(cache_->View(s)->num_tokens, 60);
  cache_->CheckInvariants();
  // To 0 there is nothing left to read: every block goes, and the sequence
  // grows again from scratch.
  ASSERT_TRUE(cache_->Truncate(s, 0).ok());
  EXPECT_EQ(cache_->View(s, 1)->released_blocks, 0);
  EXPECT_TRUE(cache_->View(s, 1)->blocks.empty());
  Grow(s, 20, 2);
  EXPECT_EQ(cache_->View(s)->num_tokens, 20);
  cache_->CheckInvariants();
  ASSERT_TRUE(cache_->Free(s).ok());
}

TEST_F(HybridCacheTest, SharingGroupsNeedsTheFullPrefixAndTheSlidingWindowOnly) {
  const SeqId s = cache_->AddSequence();
  Grow(s, 48, 1);  // 6 full blocks per group; sliding groups released 0..2 (window of 48 reads 29..)
  std::vector<std::vector<BlockId>> tables;
  for (int32_t g = 0; g < 3; ++g) {
    const SequenceView v = *cache_->View(s, g);
    tables.emplace_back(v.blocks.begin(), v.blocks.end());
  }
  EXPECT_EQ(tables[1][0], kNoBlock);
  EXPECT_EQ(cache_->AddSequenceSharing(tables[0]).status().code(), StatusCode::kFailedPrecondition);
  const SeqId t = *cache_->AddSequenceSharingGroups(tables, "hit");
  EXPECT_EQ(cache_->View(t)->num_tokens, 48);
  ExpectRows(t, 48 - kWindow + 1, 48, 1);
  // A full group may not miss a block, nor a sliding group one its window reads.
  auto bad = tables;
  bad[0][1] = kNoBlock;
  EXPECT_EQ(cache_->AddSequenceSharingGroups(bad).status().code(), StatusCode::kInvalidArgument);
  bad = tables;
  bad[2][3] = kNoBlock;
  EXPECT_EQ(cache_->AddSequenceSharingGroups(bad).status().code(), StatusCode::kInvalidArgument);
  bad = tables;
  bad.pop_back();
  EXPECT_EQ(cache_->AddSequenceSharingGroups(bad).status().code(), StatusCode::kInvalidArgument);
  Grow(t, 5, 2);  // continues privately
  ExpectRows(t, 48, 53, 2);
  ExpectRows(s, 48 - kWindow + 1, 48, 1);
  cache_->CheckInvariants();
  ASSERT_TRUE(cache_->Free(s).ok());
  ASSERT_TRUE(cache_->Free(t).ok());
  EXPECT_EQ(cache_->FreeBlockCount(), 200);
}

TEST_F(HybridCacheTest, CompactionIsRefused) {
  const SeqId s = cache_->AddSequence();
  Grow(s, 10, 1);
  std::vector<int32_t> keep(static_cast<size_t>(6 * 2 * 5));
  for (size_t i = 0; i < keep.size(); ++i) keep[i] = static_cast<int32_t>(i % 5);
  EXPECT_EQ(cache_->Compact(s, keep, 5).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cache_->Free(s).ok());
}

}  // namespace
}  // namespace pagekv
