#include "pagekv/kv_cache.h"

#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "layout/float16.h"
#include "layout/quantize.h"
#include "kvcache/kv_cache_test_util.h"

namespace pagekv {
namespace {

// Random bytes for n tokens in the Append input shape [layer][n][head][row].
struct Tokens {
  std::vector<uint8_t> k, v;
  int64_t n = 0;
  KvTokens In() const { return {n, k.data(), v.empty() ? nullptr : v.data()}; }
};

Tokens RandomTokens(const KvLayout& l, int64_t n, std::mt19937& rng) {
  Tokens t;
  t.n = n;
  const size_t bytes = static_cast<size_t>(l.num_layers() * n * l.num_heads() * l.row_bytes());
  t.k.resize(bytes);
  for (auto& b : t.k) b = static_cast<uint8_t>(rng());
  if (l.num_planes() == 2) {
    t.v.resize(bytes);
    for (auto& b : t.v) b = static_cast<uint8_t>(rng());
  }
  return t;
}

// Tokens [begin, begin + n) of a [layer][total][head][row] buffer.
std::vector<uint8_t> Slice(const KvLayout& l, const std::vector<uint8_t>& all, int64_t total,
                           int64_t begin, int64_t n) {
  const int64_t tok = l.num_heads() * l.row_bytes();
  std::vector<uint8_t> out;
  for (int32_t layer = 0; layer < l.num_layers(); ++layer) {
    const auto* p = all.data() + (layer * total + begin) * tok;
    out.insert(out.end(), p, p + n * tok);
  }
  return out;
}

Tokens ReadAll(const KvCache& cache, SeqId id) {
  const KvLayout& l = cache.layout();
  Tokens t;
  t.n = cache.View(id)->num_tokens;
  const size_t bytes = static_cast<size_t>(l.num_layers() * t.n * l.num_heads() * l.row_bytes());
  t.k.assign(bytes, 0xAA);
  if (l.num_planes() == 2) t.v.assign(bytes, 0xAA);
  EXPECT_TRUE(cache.Read(id, 0, {t.n, t.k.data(), t.v.empty() ? nullptr : t.v.data()}).ok());
  return t;
}

// Joins per-append token buffers into one [layer][total][head][row] buffer.
std::vector<uint8_t> Concat(const KvLayout& l, const std::vector<Tokens>& parts,
                            bool v_plane) {
  int64_t total = 0;
  for (const Tokens& t : parts) total += t.n;
  const int64_t tok = l.num_heads() * l.row_bytes();
  std::vector<uint8_t> out(static_cast<size_t>(l.num_layers() * total * tok));
  int64_t at = 0;
  for (const Tokens& t : parts) {
    const auto& src = v_plane ? t.v : t.k;
    for (int32_t layer = 0; layer < l.num_layers(); ++layer) {
      std::memcpy(out.data() + (layer * total + at) * tok, src.data() + layer * t.n * tok,
                  static_cast<size_t>(t.n * tok));
    }
    at += t.n;
  }
  return out;
}

struct ReadbackCase {
  int32_t block_len;
  DType dtype;
};

class KvCacheReadbackTest : public ::testing::TestWithParam<ReadbackCase> {};

TEST_P(KvCacheReadbackTest, TokenByTokenAppendsReadBackBitExactAcrossBlockBoundaries) {
  const auto [block_len, dtype] = GetParam();
  auto cache = MakeCache(Config(block_len, dtype, 16, /*layers=*/3, /*kv_heads=*/2, /*head_dim=*/24));
  const KvLayout& l = cache->layout();
  std::mt19937 rng(block_len * 31 + static_cast<int>(dtype));
  const SeqId a = cache->AddSequence("a");
  const SeqId b = cache->AddSequence("b");
  std::vector<Tokens> parts_a, parts_b;
  const int64_t total = 3 * block_len + 1;  // crosses three boundaries, ends one past
  for (int64_t i = 0; i < total; ++i) {
    parts_a.push_back(RandomTokens(l, 1, rng));
    ASSERT_TRUE(*cache->Append(a, parts_a.back().In()));
    if (i % 3 == 0) {  // interleave a second sequence so block ids are not contiguous
      parts_b.push_back(RandomTokens(l, 1, rng));
      ASSERT_TRUE(*cache->Append(b, parts_b.back().In()));
    }
    cache->CheckInvariants();
  }
  for (auto [id, parts] : {std::pair{a, &parts_a}, std::pair{b, &parts_b}}) {
    Tokens got = ReadAll(*cache, id);
    EXPECT_EQ(got.k, Concat(l, *parts, false));
    EXPECT_EQ(got.v, Concat(l, *parts, true));
  }
  // The rows also sit exactly where the layout says: check token `total - 1`
  // of layer 2, V plane, head 1 straight in the arena.
  const SequenceView view = *cache->View(a);
  const int64_t pos = total - 1;
  const BlockId blk = view.blocks[static_cast<size_t>(pos / block_len)];
  const std::byte* row = cache->arena() + l.RowOffset(2, 1, 1, ToInt(blk), static_cast<int32_t>(pos % block_len));
  const Tokens& last = parts_a.back();
  EXPECT_EQ(std::memcmp(row, last.v.data() + (2 * 2 + 1) * l.row_bytes(), static_cast<size_t>(l.row_bytes())), 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(cache->arena() + l.SlabOffset(2, 1, 1, ToInt(blk))) % 64, 0u);
}

TEST_P(KvCacheReadbackTest, MultiTokenAppendsMatchTokenByToken) {
  const auto [block_len, dtype] = GetParam();
  auto cache = MakeCache(Config(block_len, dtype, 12));
  const KvLayout& l = cache->layout();
  std::mt19937 rng(5);
  const SeqId s = cache->AddSequence();
  std::vector<Tokens> parts;
  for (int64_t n : {int64_t{1}, int64_t{block_len} - 1, int64_t{block_len}, int64_t{2} * block_len + 3, int64_t{5}}) {
    parts.push_back(RandomTokens(l, n, rng));
    ASSERT_TRUE(*cache->Append(s, parts.back().In()));
  }
  Tokens got = ReadAll(*cache, s);
  EXPECT_EQ(got.k, Concat(l, parts, false));
  EXPECT_EQ(got.v, Concat(l, parts, true));
  // A read of a middle range.
  const int64_t begin = block_len - 2, n = block_len + 3;
  Tokens mid;
  mid.k.resize(static_cast<size_t>(l.num_layers() * n * l.num_heads() * l.row_bytes()));
  mid.v.resize(mid.k.size());
  ASSERT_TRUE(cache->Read(s, begin, {n, mid.k.data(), mid.v.data()}).ok());
  EXPECT_EQ(mid.k, Slice(l, got.k, got.n, begin, n));
}

INSTANTIATE_TEST_SUITE_P(
    BlockLensAndDtypes, KvCacheReadbackTest,
    ::testing::Values(ReadbackCase{8, DType::kF32}, ReadbackCase{8, DType::kF16}, ReadbackCase{8, DType::kBF16},
                      ReadbackCase{16, DType::kF32}, ReadbackCase{16, DType::kF16}, ReadbackCase{16, DType::kBF16},
                      ReadbackCase{128, DType::kF32}, ReadbackCase{128, DType::kF16}, ReadbackCase{128, DType::kBF16}),
    [](const ::testing::TestParamInfo<ReadbackCase>& info) {
      return "BlockLen" + std::to_string(info.param.block_len) + "_" + std::string(DTypeName(info.param.dtype));
    });

class KvCacheTest : public ::testing::Test {
 protected:
  void SetUp() override { cache_ = MakeCache(Config(8, DType::kF16, 6)); }
  Tokens Random(int64_t n) { return RandomTokens(cache_->layout(), n, rng_); }
  bool Append(SeqId s, const Tokens& t) { return *cache_->Append(s, t.In()); }

  std::unique_ptr<KvCache> cache_;
  std::mt19937 rng_{123};
};

TEST_F(KvCacheTest, FailedMultiBlockAppendChangesNothing) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(20)));  // 3 blocks of 6
  const Tokens before = ReadAll(*cache_, a);
  const CacheStats st = cache_->Stats();
  const std::vector<BlockId> table(cache_->View(a)->blocks.begin(), cache_->View(a)->blocks.end());
  // 20 + 30 = 50 tokens would need 7 blocks; only 6 exist.
  Result<bool> r = cache_->Append(a, Random(30).In());
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
  EXPECT_EQ(cache_->Stats().blocks_free, st.blocks_free);
  EXPECT_EQ(cache_->View(a)->num_tokens, 20);
  EXPECT_EQ(std::vector<BlockId>(cache_->View(a)->blocks.begin(), cache_->View(a)->blocks.end()), table);
  EXPECT_EQ(ReadAll(*cache_, a).k, before.k);
  cache_->CheckInvariants();
  // Exactly what fits still succeeds.
  EXPECT_TRUE(Append(a, Random(28)));
  EXPECT_EQ(cache_->Stats().blocks_free, 0);
}

TEST_F(KvCacheTest, BlocksNeededAsksWithoutChangingAnything) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(5)));
  AppendNeed need = *cache_->BlocksNeeded(a, 4);  // 9 tokens: one more block
  EXPECT_EQ(need.new_blocks, 1);
  EXPECT_FALSE(need.copy_on_write);
  EXPECT_EQ(cache_->Stats().blocks_used, 1);
  EXPECT_EQ(cache_->BlocksNeeded(a, 3)->total(), 0);
  EXPECT_EQ(cache_->BlocksNeeded(SeqId{77}, 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cache_->BlocksNeeded(a, -1).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(KvCacheTest, ForkSharesEveryBlockAndCopiesNothing) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(12)));
  const SeqId b = *cache_->Fork(a, "child");
  EXPECT_EQ(cache_->Stats().blocks_used, 2);
  EXPECT_EQ(cache_->Stats().blocks_shared, 2);
  const SequenceView va = *cache_->View(a), vb = *cache_->View(b);
  EXPECT_TRUE(std::equal(va.blocks.begin(), va.blocks.end(), vb.blocks.begin(), vb.blocks.end()));
  EXPECT_EQ(ReadAll(*cache_, b).k, ReadAll(*cache_, a).k);
  EXPECT_EQ(cache_->Stats().tokens_physical, 12);
  EXPECT_EQ(cache_->Stats().tokens_logical, 24);
  cache_->CheckInvariants();
}

TEST_F(KvCacheTest, CopyOnWriteHappensExactlyWhenASharedPartialBlockIsAppendedTo) {
  const SeqId a = cache_->AddSequence();
  const Tokens first = Random(12);  // blocks: [full 8][partial 4]
  ASSERT_TRUE(Append(a, first));
  const SeqId b = *cache_->Fork(a);
  const BlockId shared_full = cache_->View(a)->blocks[0];
  const BlockId shared_partial = cache_->View(a)->blocks[1];
  EXPECT_TRUE(cache_->BlocksNeeded(b, 1)->copy_on_write);

  const Tokens tail_b = Random(1);
  ASSERT_TRUE(Append(b, tail_b));
  // b copied the partial block; the full block is still shared.
  EXPECT_EQ(cache_->View(b)->blocks[0], shared_full);
  EXPECT_NE(cache_->View(b)->blocks[1], shared_partial);
  EXPECT_EQ(cache_->View(a)->blocks[1], shared_partial);
  EXPECT_EQ(cache_->Stats().blocks_used, 3);
  // a's partial block is now private again: no second copy.
  EXPECT_FALSE(cache_->BlocksNeeded(a, 1)->copy_on_write);
  const Tokens tail_a = Random(1);
  ASSERT_TRUE(Append(a, tail_a));
  EXPECT_EQ(cache_->View(a)->blocks[1], shared_partial);
  EXPECT_EQ(cache_->Stats().blocks_used, 3);
  EXPECT_EQ(cache_->CopyOnWriteCount(), 1);  // b's copy only
  // Contents: both prefixes intact, each tail its own.
  const KvLayout& l = cache_->layout();
  EXPECT_EQ(ReadAll(*cache_, a).k, Concat(l, {first, tail_a}, false));
  EXPECT_EQ(ReadAll(*cache_, b).k, Concat(l, {first, tail_b}, false));
  EXPECT_EQ(ReadAll(*cache_, b).v, Concat(l, {first, tail_b}, true));
  cache_->CheckInvariants();
}

// Sliding windows: ReleaseBefore gives back the blocks wholly before a
// position (their entries become kNoBlock, the length stays), keeps the
// rest readable bit for bit, lets forks and appends go on, sends a
// published block to the evictable list, and refuses what would need the
// released rows (reading, writing, compacting, truncating into them).
TEST_F(KvCacheTest, ReleaseBeforeFreesWholeBlocksOutsideAWindowAndKeepsTheRest) {
  const KvLayout& l = cache_->layout();
  const SeqId a = cache_->AddSequence();
  const Tokens first = Random(20);  // [0, 8) [8, 16) [16, 20)
  ASSERT_TRUE(Append(a, first));
  const BlockId b0 = cache_->View(a)->blocks[0], b1 = cache_->View(a)->blocks[1];
  EXPECT_EQ(*cache_->ReleaseBefore(a, 7), 0);  // no block wholly before position 7
  ASSERT_TRUE(cache_->SetBlockCached(b0, true).ok());  // as if published
  EXPECT_EQ(*cache_->ReleaseBefore(a, 8), 1);
  EXPECT_EQ(*cache_->ReleaseBefore(a, 8), 0);  // idempotent
  SequenceView v = *cache_->View(a);
  EXPECT_EQ(v.num_tokens, 20);
  EXPECT_EQ(v.released_blocks, 1);
  EXPECT_EQ(v.blocks[0], kNoBlock);
  EXPECT_EQ(cache_->Stats().blocks_used, 2);
  EXPECT_EQ(cache_->CachedFreeBlockCount(), 1);  // b0 waits on the evictable list
  EXPECT_EQ(cache_->StatsFor(a)->num_blocks, 2);
  cache_->CheckInvariants();
  // What is left reads back bit for bit; the released rows are refused.
  Tokens rest;
  rest.n = 12;
  rest.k.assign(static_cast<size_t>(l.num_layers() * 12 * l.num_heads() * l.row_bytes()), 0);
  rest.v = rest.k;
  ASSERT_TRUE(cache_->Read(a, 8, {12, rest.k.data(), rest.v.data()}).ok());
  EXPECT_EQ(rest.k, Slice(l, first.k, 20, 8, 12));
  EXPECT_EQ(rest.v, Slice(l, first.v, 20, 8, 12));
  EXPECT_EQ(cache_->Read(a, 0, {12, rest.k.data(), rest.v.data()}).code(), StatusCode::kFailedPrecondition);
  const Tokens one = Random(1);
  EXPECT_EQ(cache_->WriteLayer(a, 0, 3, {1, one.k.data(), one.v.data()}).code(), StatusCode::kFailedPrecondition);
  std::vector<std::byte> payload(static_cast<size_t>(cache_->block_payload_bytes()));
  EXPECT_EQ(cache_->WriteBlock(a, 0, payload).code(), StatusCode::kFailedPrecondition);
  const std::vector<int32_t> keep(static_cast<size_t>(l.num_layers() * l.num_heads() * 10), 0);
  EXPECT_EQ(cache_->Compact(a, keep, 10).code(), StatusCode::kFailedPrecondition);
  // A fork shares what is left; both go on appending (copy-on-write of the
  // shared partial block), and the parent passes its window on.
  const SeqId b = *cache_->Fork(a);
  EXPECT_EQ(cache_->View(b)->released_blocks, 1);
  EXPECT_EQ(cache_->Stats().blocks_used, 2);
  ASSERT_TRUE(Append(b, Random(1)));
  const Tokens more = Random(12);  // a: 32 tokens, [kNoBlock] [8, 16) [16, 24) [24, 32)
  ASSERT_TRUE(Append(a, more));
  cache_->CheckInvariants();
  EXPECT_EQ(*cache_->ReleaseBefore(a, 17), 1);  // b1: b still holds it
  EXPECT_EQ(cache_->BlockRefCount(b1), 1);
  ASSERT_TRUE(cache_->Read(a, 16, {12, rest.k.data(), rest.v.data()}).ok());
  EXPECT_EQ(rest.k, Slice(l, Concat(l, {first, more}, false), 32, 16, 12));
  // Truncating into the released blocks is refused; above them it works,
  // and to zero it frees everything.
  EXPECT_EQ(cache_->Truncate(a, 16).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(cache_->Truncate(a, 17).ok());
  EXPECT_EQ(cache_->View(a)->blocks.size(), 3u);
  cache_->CheckInvariants();
  EXPECT_EQ(cache_->ReleaseBefore(a, 18).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache_->ReleaseBefore(SeqId{77}, 0).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(cache_->Truncate(a, 0).ok());
  EXPECT_EQ(cache_->View(a)->released_blocks, 0);
  ASSERT_TRUE(cache_->Free(a).ok());
  ASSERT_TRUE(cache_->Free(b).ok());
  EXPECT_EQ(cache_->Stats().blocks_used, 0);
  cache_->CheckInvariants();
}

TEST_F(KvCacheTest, UnreservePutsBackTheBlockTableTheSharedBlockAndTheLength) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(12)));  // [full 8][partial 4]
  const SeqId b = *cache_->Fork(a);
  const Tokens before = ReadAll(*cache_, b);
  const std::vector<BlockId> table(cache_->View(b)->blocks.begin(), cache_->View(b)->blocks.end());
  const std::vector<BlockId> free_order = cache_->FreeBlocks();
  const int32_t shared_refs = cache_->BlockRefCount(table[1]);
  int cuts = 0;
  cache_->SetCutListener([&](const KvCache::SequenceCut&) { ++cuts; });
  // 10 more tokens: a copy of the shared partial block and one new block,
  // then every layer written.
  ReserveUndo undo;
  ASSERT_TRUE(*cache_->Reserve(b, 10, &undo));
  EXPECT_TRUE(undo.copied);
  EXPECT_NE(cache_->View(b)->blocks[1], table[1]);
  const KvLayout& l = cache_->layout();
  const Tokens t = Random(10);
  const int64_t layer_bytes = 10 * l.num_heads() * l.row_bytes();
  for (int32_t layer = 0; layer < l.num_layers(); ++layer) {
    ASSERT_TRUE(cache_->WriteLayer(b, layer, 12, {10, t.k.data() + layer * layer_bytes, t.v.data() + layer * layer_bytes}).ok());
  }
  ASSERT_TRUE(cache_->Unreserve(undo).ok());
  EXPECT_EQ(std::vector<BlockId>(cache_->View(b)->blocks.begin(), cache_->View(b)->blocks.end()), table);
  EXPECT_EQ(cache_->View(b)->num_tokens, 12);
  EXPECT_EQ(cache_->BlockRefCount(table[1]), shared_refs);
  EXPECT_EQ(ReadAll(*cache_, b).k, before.k);
  EXPECT_EQ(ReadAll(*cache_, b).v, before.v);
  std::vector<BlockId> now = cache_->FreeBlocks(), was = free_order;
  std::sort(now.begin(), now.end());
  std::sort(was.begin(), was.end());
  EXPECT_EQ(now, was);  // the same free blocks (their order may differ)
  EXPECT_EQ(cuts, 0);   // nothing the sequence had was cut
  cache_->CheckInvariants();
  // Truncate, by contrast, would keep the private copy in b's table.
  ASSERT_TRUE(*cache_->Reserve(b, 1));
  ASSERT_TRUE(cache_->Truncate(b, 12).ok());
  EXPECT_NE(cache_->View(b)->blocks[1], table[1]);
}

TEST_F(KvCacheTest, NoCopyWhenTheSharedLastBlockIsFull) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(16)));  // two full blocks
  const SeqId b = *cache_->Fork(a);
  EXPECT_FALSE(cache_->BlocksNeeded(b, 1)->copy_on_write);
  ASSERT_TRUE(Append(b, Random(1)));
  const SequenceView va = *cache_->View(a), vb = *cache_->View(b);
  EXPECT_EQ(vb.blocks[0], va.blocks[0]);
  EXPECT_EQ(vb.blocks[1], va.blocks[1]);
  EXPECT_EQ(cache_->Stats().blocks_used, 3);
  EXPECT_EQ(cache_->Stats().blocks_shared, 2);
}

TEST_F(KvCacheTest, CopyOnWriteNeedsAFreeBlockAndFailsCleanlyWithoutOne) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(44)));  // 6 blocks, last one partial (4 of 8)
  const SeqId b = *cache_->Fork(a);
  const Tokens before = ReadAll(*cache_, b);
  EXPECT_FALSE(*cache_->Append(b, Random(1).In()));
  EXPECT_EQ(ReadAll(*cache_, b).k, before.k);
  EXPECT_EQ(cache_->View(b)->num_tokens, 44);
  cache_->CheckInvariants();
}

TEST_F(KvCacheTest, TruncateReturnsBlocksThatBecameEmpty) {
  const SeqId a = cache_->AddSequence();
  const Tokens t = Random(20);
  ASSERT_TRUE(Append(a, t));
  EXPECT_EQ(cache_->Stats().blocks_used, 3);
  ASSERT_TRUE(cache_->Truncate(a, 16).ok());  // exactly two blocks
  EXPECT_EQ(cache_->Stats().blocks_used, 2);
  ASSERT_TRUE(cache_->Truncate(a, 9).ok());
  EXPECT_EQ(cache_->Stats().blocks_used, 2);
  EXPECT_EQ(ReadAll(*cache_, a).k, Slice(cache_->layout(), t.k, 20, 0, 9));
  ASSERT_TRUE(cache_->Truncate(a, 0).ok());
  EXPECT_EQ(cache_->Stats().blocks_used, 0);
  EXPECT_EQ(cache_->Truncate(a, 1).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache_->Truncate(SeqId{42}, 0).code(), StatusCode::kNotFound);
  cache_->CheckInvariants();
}

TEST_F(KvCacheTest, TheCutListenerHearsHowManyLeadingTokensKeptTheirRows) {
  std::vector<KvCache::SequenceCut> cuts;
  cache_->SetCutListener([&](const KvCache::SequenceCut& c) { cuts.push_back(c); });
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(20)));
  ASSERT_TRUE(cache_->Truncate(a, 13).ok());
  EXPECT_EQ(cache_->Truncate(a, 14).code(), StatusCode::kOutOfRange);  // refused: nothing heard
  // Compact keeps slots {0, 1, 2, 5, 9, 12} of 13: slot 3 is the first hole.
  const KvLayout& l = cache_->layout();
  std::vector<int32_t> keep;
  for (int li = 0; li < l.num_layers() * l.num_heads(); ++li) keep.insert(keep.end(), {0, 1, 2, 5, 9, 12});
  ASSERT_TRUE(cache_->Compact(a, keep, 6).ok());
  // A compaction that keeps every token moves nothing and drops nothing.
  std::vector<int32_t> all;
  for (int li = 0; li < l.num_layers() * l.num_heads(); ++li) all.insert(all.end(), {0, 1, 2, 3, 4, 5});
  ASSERT_TRUE(cache_->Compact(a, all, 6).ok());
  ASSERT_TRUE(cache_->Free(a).ok());
  ASSERT_EQ(cuts.size(), 3u);
  EXPECT_EQ(cuts[0].kind, KvCache::SequenceCut::Kind::kTruncated);
  EXPECT_EQ(cuts[0].kept_tokens, 13);
  EXPECT_EQ(cuts[1].kind, KvCache::SequenceCut::Kind::kCompacted);
  EXPECT_EQ(cuts[1].kept_tokens, 3);
  EXPECT_EQ(cuts[2].kind, KvCache::SequenceCut::Kind::kFreed);
  for (const auto& c : cuts) EXPECT_EQ(c.id, a);
  cache_->SetCutListener(nullptr);
  const SeqId b = cache_->AddSequence();
  ASSERT_TRUE(cache_->Free(b).ok());
  EXPECT_EQ(cuts.size(), 3u);
}

TEST_F(KvCacheTest, TruncatedSharedBlockIsCopiedBeforeTheNextAppend) {
  const SeqId a = cache_->AddSequence();
  const Tokens t = Random(16);
  ASSERT_TRUE(Append(a, t));
  const SeqId b = *cache_->Fork(a);
  ASSERT_TRUE(cache_->Truncate(b, 12).ok());  // b's view of the shared block is now partial
  EXPECT_TRUE(cache_->BlocksNeeded(b, 1)->copy_on_write);
  ASSERT_TRUE(Append(b, Random(2)));
  // a's tokens 12..15 must be untouched by b's overwrite of slots 4..5.
  EXPECT_EQ(ReadAll(*cache_, a).k, t.k);
  cache_->CheckInvariants();
}

TEST_F(KvCacheTest, FreeReleasesEverythingAndIsRejectedTwice) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(30)));
  const SeqId b = *cache_->Fork(a);
  ASSERT_TRUE(cache_->Free(a).ok());
  EXPECT_EQ(cache_->Stats().blocks_used, 4);  // b still holds them
  Status again = cache_->Free(a);
  EXPECT_EQ(again.code(), StatusCode::kNotFound);
  EXPECT_NE(again.message().find("already freed"), std::string::npos);
  EXPECT_EQ(cache_->Stats().blocks_used, 4);
  ASSERT_TRUE(cache_->Free(b).ok());
  EXPECT_EQ(cache_->Stats().blocks_free, 6);
  cache_->CheckInvariants();
}

TEST_F(KvCacheTest, BadInputIsAnErrorAndChangesNothing) {
  const SeqId a = cache_->AddSequence();
  const Tokens t = Random(3);
  EXPECT_EQ(cache_->Append(SeqId{9}, t.In()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cache_->Append(a, {3, t.k.data(), nullptr}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Append(a, {3, nullptr, t.v.data()}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Append(a, {-1, t.k.data(), t.v.data()}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Fork(SeqId{9}).status().code(), StatusCode::kNotFound);
  std::vector<uint8_t> out(t.k.size());
  EXPECT_EQ(cache_->Read(a, 0, {1, out.data(), out.data()}).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache_->Stats().blocks_used, 0);
  EXPECT_TRUE(*cache_->Append(a, {0, nullptr, nullptr}));  // empty append is a no-op
  EXPECT_EQ(cache_->View(a)->num_tokens, 0);
  cache_->CheckInvariants();
}

TEST_F(KvCacheTest, StatsCountFragmentationOfPartlyFilledBlocks) {
  const SeqId a = cache_->AddSequence();
  ASSERT_TRUE(Append(a, Random(10)));  // 2 blocks, 10 of 16 slots
  const CacheStats st = cache_->Stats();
  EXPECT_EQ(st.blocks_used, 2);
  EXPECT_EQ(st.tokens_physical, 10);
  EXPECT_EQ(st.bytes_allocated, 2 * cache_->layout().bytes_per_block());
  EXPECT_EQ(st.bytes_holding_tokens, 10 * cache_->layout().bytes_per_token());
  EXPECT_DOUBLE_EQ(st.internal_fragmentation, 1.0 - 10.0 / 16.0);
  const SequenceStats ss = *cache_->StatsFor(a);
  EXPECT_EQ(ss.num_blocks, 2);
  EXPECT_EQ(ss.num_tokens, 10);
  const MemoryReport m = cache_->Memory();
  EXPECT_EQ(m.need_bytes, 10 * m.bytes_per_token);
  EXPECT_EQ(m.allocated_bytes + m.free_bytes, m.pool_bytes);
  EXPECT_NE(m.ToString().find("pool (arena)"), std::string::npos);
}

TEST_F(KvCacheTest, LeakReportNamesBlocksAndHolders) {
  EXPECT_EQ(cache_->LeakReport(), "no blocks referenced\n");
  const SeqId a = cache_->AddSequence("request-7");
  ASSERT_TRUE(Append(a, Random(9)));
  const SeqId b = *cache_->Fork(a, "beam-2");
  const std::string report = cache_->LeakReport();
  EXPECT_NE(report.find("2 of 6 blocks"), std::string::npos) << report;
  EXPECT_NE(report.find("'request-7': 9 tokens in 2 blocks (2 shared)"), std::string::npos) << report;
  EXPECT_NE(report.find("'beam-2'"), std::string::npos) << report;
  const std::vector<BlockHolders> held = cache_->ReferencedBlocks();
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].ref_count, 2);
  EXPECT_EQ(held[0].holders, (std::vector<SeqId>{a, b}));
}

TEST(KvCacheLeakSinkTest, DestructorReportsLeakedBlocks) {
  std::string seen;
  {
    auto cache = KvCache::Create({.config = Config(8, DType::kF32, 4), .huge_pages = false,
                                  .prefault = false,
                                  .leak_sink = [&](const std::string& r) { seen = r; }});
    ASSERT_TRUE(cache.ok());
    std::mt19937 rng(1);
    const SeqId s = (*cache)->AddSequence("leaky");
    ASSERT_TRUE(*(*cache)->Append(s, RandomTokens((*cache)->layout(), 3, rng).In()));
  }
  EXPECT_NE(seen.find("'leaky'"), std::string::npos) << seen;
}

TEST(KvCacheMlaTest, StoresOneLatentRowPerTokenAndRejectsAV) {
  CacheConfig c;
  c.kind = CacheKind::kMla;
  c.num_layers = 2;
  c.num_q_heads = 4;
  c.kv_lora_rank = 32;
  c.rope_dim = 8;
  c.block_len = 8;
  c.format = KvFormat::Plain(DType::kBF16);
  c.num_blocks = 4;
  auto cache = MakeCache(c);
  const KvLayout& l = cache->layout();
  EXPECT_EQ(l.row_bytes(), 80);
  std::mt19937 rng(3);
  const SeqId s = cache->AddSequence();
  const Tokens t = RandomTokens(l, 11, rng);
  ASSERT_TRUE(t.v.empty());
  ASSERT_TRUE(*cache->Append(s, t.In()));
  EXPECT_EQ(ReadAll(*cache, s).k, t.k);
  EXPECT_EQ(cache->Append(s, {1, t.k.data(), t.k.data()}).status().code(), StatusCode::kInvalidArgument);
  cache->CheckInvariants();
}

TEST(KvCacheCreateTest, RejectsQuantizedFormatsUntilTheyAreStored) {
  CacheConfig c = Config(8, DType::kF16, 4);  // head_dim 16
  c.format = KvFormat{DType::kInt8, ScaleAxis::kPerToken, 8, DType::kF16};  // two scales per row: not stored
  auto cache = KvCache::Create({.config = c});
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), StatusCode::kUnimplemented);
  c.format = KvFormat{DType::kInt4, ScaleAxis::kPerToken, 16, DType::kF16};
  EXPECT_EQ(KvCache::Create({.config = c}).status().code(), StatusCode::kUnimplemented);
  c.format = KvFormat::Fp8(DType::kFP8E5M2, 16);
  EXPECT_TRUE(KvCache::Create({.config = c}).ok());
  c.format = KvFormat::Int8(16);  // one f16 scale per row: stored
  EXPECT_TRUE(KvCache::Create({.config = c}).ok());
}

TEST(KvCacheCreateTest, Int8RowsAreStoredAndReadBackAsBytes) {
  CacheConfig c = Config(8, DType::kF16, 4);
  c.format = KvFormat::Int8(16);
  auto cache = MakeCache(c);
  EXPECT_EQ(cache->layout().row_bytes(), 16 + 2);
  std::mt19937 rng(3);
  const SeqId s = cache->AddSequence();
  const Tokens t = RandomTokens(cache->layout(), 11, rng);
  ASSERT_TRUE(*cache->Append(s, t.In()));
  EXPECT_EQ(ReadAll(*cache, s).k, t.k);
  EXPECT_EQ(ReadAll(*cache, s).v, t.v);
}

TEST(KvCacheCreateTest, InvalidConfigIsRejected) {
  auto cache = KvCache::Create({.config = Config(100, DType::kF16, 4)});
  ASSERT_FALSE(cache.ok());
  EXPECT_NE(cache.status().message().find("block_len = 100"), std::string::npos);
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

TEST(KvCacheLayerWriteTest, ReserveThenWriteLayerEqualsAppend) {
  const CacheConfig c = Config(8, DType::kF16, 16, /*layers=*/3, /*kv_heads=*/2, /*head_dim=*/8);
  auto a = MakeCache(c);
  auto b = MakeCache(c);
  const KvLayout& l = a->layout();
  std::mt19937 rng(9);
  const SeqId sa = a->AddSequence(), sb = b->AddSequence();
  for (int64_t n : {5, 3, 9, 1}) {
    const Tokens t = RandomTokens(l, n, rng);
    ASSERT_TRUE(*a->Append(sa, t.In()));
    const int64_t pos = b->View(sb)->num_tokens;
    ASSERT_TRUE(*b->Reserve(sb, n));
    const int64_t layer_bytes = n * l.num_heads() * l.row_bytes();
    for (int32_t layer = 0; layer < l.num_layers(); ++layer) {
      ASSERT_TRUE(b->WriteLayer(sb, layer, pos, {n, t.k.data() + layer * layer_bytes, t.v.data() + layer * layer_bytes}).ok());
    }
  }
  EXPECT_EQ(ReadAll(*a, sa).k, ReadAll(*b, sb).k);
  EXPECT_EQ(ReadAll(*a, sa).v, ReadAll(*b, sb).v);
  b->CheckInvariants();
}

TEST(KvCacheLayerWriteTest, WritesToSharedBlocksOrOutsideTheSequenceAreRejected) {
  auto cache = MakeCache(Config(8, DType::kF32, 8));
  std::mt19937 rng(2);
  const SeqId s = cache->AddSequence();
  const Tokens t = RandomTokens(cache->layout(), 10, rng);
  ASSERT_TRUE(*cache->Append(s, t.In()));
  const SeqId child = *cache->Fork(s);
  std::vector<uint8_t> row(static_cast<size_t>(cache->layout().num_heads() * cache->layout().row_bytes()));
  Status shared = cache->WriteLayer(child, 0, 9, {1, row.data(), row.data()});
  EXPECT_EQ(shared.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->WriteLayer(child, 0, 10, {1, row.data(), row.data()}).code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(*cache->Reserve(child, 1));  // copies the shared partial block
  EXPECT_TRUE(cache->WriteLayer(child, 0, 10, {1, row.data(), row.data()}).ok());
  EXPECT_EQ(cache->WriteLayer(child, 7, 10, {1, row.data(), row.data()}).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ReadAll(*cache, s).k, t.k);  // the parent is untouched
  cache->CheckInvariants();
}


TEST(KvCacheBlockBytesTest, ReadBlockThenWriteBlockMovesAWholeBlockBitExact) {
  const CacheConfig c = Config(8, DType::kBF16, 16, /*layers=*/3, /*kv_heads=*/2, /*head_dim=*/8);
  auto a = MakeCache(c);
  auto b = MakeCache(c);
  const KvLayout& l = a->layout();
  std::mt19937 rng(21);
  const SeqId sa = a->AddSequence();
  ASSERT_TRUE(*a->Append(sa, RandomTokens(l, 20, rng).In()));  // blocks 0, 1 full, 2 partial
  const SeqId sb = b->AddSequence();
  ASSERT_TRUE(*b->Reserve(sb, 20));
  std::vector<std::byte> bytes(static_cast<size_t>(a->block_payload_bytes()));
  EXPECT_EQ(a->block_payload_bytes(), l.slabs_per_block() * 8 * l.row_bytes());
  for (int64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(a->ReadBlock(a->View(sa)->blocks[static_cast<size_t>(i)], bytes).ok());
    ASSERT_TRUE(b->WriteBlock(sb, i, bytes).ok());
  }
  EXPECT_EQ(ReadAll(*a, sa).k, ReadAll(*b, sb).k);
  EXPECT_EQ(ReadAll(*a, sa).v, ReadAll(*b, sb).v);
  // Bad input: named errors, nothing written.
  EXPECT_EQ(a->ReadBlock(BlockId{99}, bytes).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(a->ReadBlock(BlockId{0}, std::span(bytes).subspan(1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b->WriteBlock(sb, 3, bytes).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(b->WriteBlock(SeqId{77}, 0, bytes).code(), StatusCode::kNotFound);
  const SeqId fork = *b->Fork(sb);
  EXPECT_EQ(b->WriteBlock(sb, 0, bytes).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(b->Free(fork).ok());
  b->CheckInvariants();
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// Per-layer formats through the whole write path: Append, copy-on-write
// after a fork, Read, ReadBlock / WriteBlock and Compact all move each
// layer's rows at that layer's size. Row bytes are random: the cache never
// looks inside a row.
TEST(KvCachePerLayerTest, EveryPathMovesEachLayerAtItsOwnRowSize) {
  CacheConfig c = Config(8, DType::kF16, 16, /*layers=*/3, /*kv_heads=*/2, /*head_dim=*/16);
  c.layer_formats = *ParseLayerFormats("1=int8,2=f32", 3, 16, c.format);
  auto cache = MakeCache(c);
  const KvLayout& l = cache->layout();
  ASSERT_FALSE(l.uniform());
  // Token bytes per layer: heads x row_bytes(layer), layers one after another.
  auto token_bytes = [&](int32_t layer) { return l.num_heads() * l.row_bytes(layer); };
  const int64_t n = 13;
  int64_t total = 0;
  for (int32_t layer = 0; layer < 3; ++layer) total += n * token_bytes(layer);
  std::mt19937 rng(5);
  std::vector<uint8_t> k(static_cast<size_t>(total)), v(k.size());
  for (auto& b : k) b = static_cast<uint8_t>(rng());
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  const SeqId seq = cache->AddSequence();
  ASSERT_TRUE(*cache->Append(seq, {n, k.data(), v.data()}));
  std::vector<uint8_t> rk(k.size()), rv(v.size());
  ASSERT_TRUE(cache->Read(seq, 0, {n, rk.data(), rv.data()}).ok());
  EXPECT_EQ(rk, k);
  EXPECT_EQ(rv, v);

  // Fork, then append to the child: the shared partial block is copied
  // layer by layer; the parent's rows stay as they were.
  const SeqId child = *cache->Fork(seq);
  std::vector<uint8_t> one_k(static_cast<size_t>(total / n)), one_v(one_k.size());
  for (auto& b : one_k) b = static_cast<uint8_t>(rng());
  for (auto& b : one_v) b = static_cast<uint8_t>(rng());
  ASSERT_TRUE(*cache->Append(child, {1, one_k.data(), one_v.data()}));
  std::vector<uint8_t> ck(static_cast<size_t>(total + total / n)), cv(ck.size());
  ASSERT_TRUE(cache->Read(child, 0, {n + 1, ck.data(), cv.data()}).ok());
  int64_t at = 0, at_child = 0, at_one = 0;
  for (int32_t layer = 0; layer < 3; ++layer) {
    const int64_t tb = token_bytes(layer);
    EXPECT_TRUE(std::equal(k.begin() + at, k.begin() + at + n * tb, ck.begin() + at_child)) << "layer " << layer;
    EXPECT_TRUE(std::equal(one_k.begin() + at_one, one_k.begin() + at_one + tb, ck.begin() + at_child + n * tb));
    at += n * tb;
    at_child += (n + 1) * tb;
    at_one += tb;
  }
  ASSERT_TRUE(cache->Read(seq, 0, {n, rk.data(), rv.data()}).ok());
  EXPECT_EQ(rk, k);

  // Whole blocks: the payload is every slab without padding.
  EXPECT_EQ(cache->block_payload_bytes(), 2 * 2 * 8 * (32 + 18 + 64));
  const BlockId b0 = cache->View(seq)->blocks[0];
  std::vector<std::byte> payload(static_cast<size_t>(cache->block_payload_bytes()));
  ASSERT_TRUE(cache->ReadBlock(b0, payload).ok());
  const SeqId copy = cache->AddSequence();
  ASSERT_TRUE(*cache->Reserve(copy, 8));
  ASSERT_TRUE(cache->WriteBlock(copy, 0, payload).ok());
  std::vector<uint8_t> pk(static_cast<size_t>(total / n * 8)), pv(pk.size());
  ASSERT_TRUE(cache->Read(copy, 0, {8, pk.data(), pv.data()}).ok());
  at = 0;
  int64_t at_copy = 0;
  for (int32_t layer = 0; layer < 3; ++layer) {
    const int64_t tb = token_bytes(layer);
    EXPECT_TRUE(std::equal(k.begin() + at, k.begin() + at + 8 * tb, pk.begin() + at_copy)) << "layer " << layer;
    EXPECT_TRUE(std::equal(v.begin() + at, v.begin() + at + 8 * tb, pv.begin() + at_copy)) << "layer " << layer;
    at += n * tb;
    at_copy += 8 * tb;
  }
  EXPECT_NE(cache->GeometryTag(), MakeCache(Config(8, DType::kF16, 16, 3, 2, 16))->GeometryTag());

  // Compact: keep tokens 12 and 3 of every (layer, head); both move down,
  // in ascending order (3 to slot 0, 12 to slot 1).
  ASSERT_TRUE(cache->Free(child).ok());
  ASSERT_TRUE(cache->Free(copy).ok());
  std::vector<int32_t> keep;
  for (int i = 0; i < 3 * 2; ++i) keep.insert(keep.end(), {12, 3});
  ASSERT_TRUE(cache->Compact(seq, keep, 2).ok());
  std::vector<uint8_t> kk(static_cast<size_t>(total / n * 2)), kv(kk.size());
  ASSERT_TRUE(cache->Read(seq, 0, {2, kk.data(), kv.data()}).ok());
  at = 0;
  int64_t at_kept = 0;
  for (int32_t layer = 0; layer < 3; ++layer) {
    const int64_t tb = token_bytes(layer);
    EXPECT_TRUE(std::equal(k.begin() + at + 3 * tb, k.begin() + at + 4 * tb, kk.begin() + at_kept)) << layer;
    EXPECT_TRUE(std::equal(v.begin() + at + 12 * tb, v.begin() + at + 13 * tb, kv.begin() + at_kept + tb)) << layer;
    at += n * tb;
    at_kept += 2 * tb;
  }
  cache->CheckInvariants();
}

}  // namespace
}  // namespace pagekv
