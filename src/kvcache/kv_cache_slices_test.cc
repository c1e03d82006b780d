// Context slices (KvCacheOptions::slices): caches that each hold one slice
// of every block must, run through the same operations as one whole cache,
// allocate exactly as it does (same tables, same counts) and hold exactly
// its bytes for their tokens: every token read back from the slice that
// holds it, every block payload the matching part of the whole block's.
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kvcache/kv_cache_test_util.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

std::unique_ptr<KvCache> Slice(const CacheConfig& c, int32_t slices, int32_t slice) {
  auto cache = KvCache::Create({.config = c, .huge_pages = false, .prefault = true, .slices = slices, .slice = slice});
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return cache.ok() ? std::move(*cache) : nullptr;
}

// Rows of n tokens: [layer][token][head][row] random f32 values.
struct Rows {
  std::vector<float> k, v;
};
Rows RandomRows(const KvLayout& l, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  Rows r;
  const size_t count = static_cast<size_t>(int64_t{l.num_layers()} * n * l.num_heads() * l.row_elems());
  for (size_t i = 0; i < count; ++i) r.k.push_back(u(rng)), r.v.push_back(u(rng));
  return r;
}

TEST(ArenaTable, SlicesNameTheirBlocksAndHolesForTheOthers) {
  const std::vector<BlockId> table = {BlockId{7}, BlockId{3}, BlockId{9}};
  std::vector<BlockId> out;
  // 40 tokens of blocks of 16 over 2 slices of 8: arena blocks of 8 tokens,
  // ceil(40 / 8) = 5 entries; slice 1 holds tokens 8-15 and 24-31.
  ArenaTable(table, 40, 16, 2, 1, out);
  EXPECT_EQ(out, (std::vector<BlockId>{kNoBlock, BlockId{7}, kNoBlock, BlockId{3}, kNoBlock}));
  ArenaTable(table, 40, 16, 2, 0, out);
  EXPECT_EQ(out, (std::vector<BlockId>{BlockId{7}, kNoBlock, BlockId{3}, kNoBlock, BlockId{9}}));
  ArenaTable(table, 40, 16, 1, 0, out);
  EXPECT_EQ(out, table);
}

TEST(KvCacheSlicesTest, SlicesAllocateAsTheWholeCacheAndHoldItsBytes) {
  for (int32_t slices : {2, 4}) {
    SCOPED_TRACE("slices " + std::to_string(slices));
    const int32_t bl = 32;
    const CacheConfig c = Config(bl, DType::kF32, 24, 2, 2, 8);
    std::unique_ptr<KvCache> whole = MakeCache(c);
    std::vector<std::unique_ptr<KvCache>> parts;
    for (int32_t s = 0; s < slices; ++s) parts.push_back(Slice(c, slices, s));
    std::vector<KvCache*> all = {whole.get()};
    for (auto& p : parts) all.push_back(p.get());
    std::mt19937 rng(5);
    auto append = [&](SeqId id, int64_t n) {
      const Rows r = RandomRows(whole->layout(), n, rng);
      for (KvCache* cache : all) ASSERT_TRUE(*cache->Append(id, {n, r.k.data(), r.v.data()}));
    };
    // The same operations on every cache, which all return the same ids.
    std::vector<SeqId> a, b;
    for (KvCache* cache : all) a.push_back(cache->AddSequence("a"));
    append(a[0], 37);
    for (KvCache* cache : all) b.push_back(*cache->Fork(a[0], "b"));
    append(b[0], 5);   // copy-on-write of a's shared, partly filled block
    append(a[0], 70);  // whole new blocks
    for (KvCache* cache : all) ASSERT_TRUE(cache->Truncate(a[0], 41).ok());
    append(a[0], 9);
    // Reserve + WriteLayer, the model's path.
    {
      const Rows r = RandomRows(whole->layout(), 12, rng);
      const int64_t per_layer = 12 * 2 * 8;
      for (KvCache* cache : all) {
        const int64_t at = cache->View(b[0])->num_tokens;
        ASSERT_TRUE(*cache->Reserve(b[0], 12));
        for (int32_t l = 0; l < 2; ++l) {
          ASSERT_TRUE(cache->WriteLayer(b[0], l, at, {12, r.k.data() + l * per_layer, r.v.data() + l * per_layer}).ok());
        }
      }
    }
    for (SeqId id : {a[0], b[0]}) {
      const SequenceView want = *whole->View(id);
      for (auto& p : parts) {
        const SequenceView got = *p->View(id);
        EXPECT_EQ(std::vector<BlockId>(got.blocks.begin(), got.blocks.end()),
                  std::vector<BlockId>(want.blocks.begin(), want.blocks.end()));
        EXPECT_EQ(got.num_tokens, want.num_tokens);
      }
      // Every token from the slice that holds it; the others refuse it.
      const int64_t token_floats = 2 * 2 * 8;  // layers x heads x row
      std::vector<float> wk(token_floats), wv(token_floats), gk(token_floats), gv(token_floats);
      for (int64_t pos = 0; pos < want.num_tokens; ++pos) {
        ASSERT_TRUE(whole->Read(id, pos, {1, wk.data(), wv.data()}).ok());
        const int32_t owner = static_cast<int32_t>((pos % bl) / (bl / slices));
        for (int32_t s = 0; s < slices; ++s) {
          const Status st = parts[static_cast<size_t>(s)]->Read(id, pos, {1, gk.data(), gv.data()});
          if (s != owner) {
            EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << "position " << pos;
            continue;
          }
          ASSERT_TRUE(st.ok()) << st.ToString();
          EXPECT_EQ(gk, wk) << "position " << pos;
          EXPECT_EQ(gv, wv) << "position " << pos;
        }
      }
    }
    // Counts and bytes: the whole pool's counts, 1 / slices of its bytes.
    EXPECT_EQ(parts[0]->FreeBlockCount(), whole->FreeBlockCount());
    EXPECT_EQ(parts[0]->CopyOnWriteCount(), whole->CopyOnWriteCount());
    EXPECT_EQ(parts[0]->block_payload_bytes() * slices, whole->block_payload_bytes());
    EXPECT_EQ(parts[0]->Stats().tokens_logical, whole->Stats().tokens_logical);
    int64_t physical = 0;
    for (auto& p : parts) physical += p->Stats().tokens_physical;
    EXPECT_EQ(physical, whole->Stats().tokens_physical) << "each token in exactly one slice";
    EXPECT_EQ(parts[0]->arena_layout().block_len(), bl / slices);
    EXPECT_EQ(parts[0]->layout().block_len(), bl);
    EXPECT_NE(parts[0]->GeometryTag(), whole->GeometryTag());
    EXPECT_NE(parts[0]->GeometryTag(), parts[1]->GeometryTag()) << "one slice's payload never loads as another's";
    // A block's payload: the slice's rows of every slab of the whole block.
    const BlockId block = whole->View(a[0])->blocks[1];
    std::vector<std::byte> wp(static_cast<size_t>(whole->block_payload_bytes()));
    ASSERT_TRUE(whole->ReadBlock(block, wp).ok());
    const int64_t slab = int64_t{bl} * 8 * 4, part_slab = slab / slices;
    for (int32_t s = 0; s < slices; ++s) {
      std::vector<std::byte> sp(static_cast<size_t>(parts[static_cast<size_t>(s)]->block_payload_bytes()));
      ASSERT_TRUE(parts[static_cast<size_t>(s)]->ReadBlock(block, sp).ok());
      for (int64_t i = 0; i < whole->arena_layout().slabs_per_block(); ++i) {
        EXPECT_EQ(std::memcmp(sp.data() + i * part_slab, wp.data() + i * slab + s * part_slab, static_cast<size_t>(part_slab)), 0)
            << "slice " << s << " slab " << i;
      }
    }
    for (KvCache* cache : all) cache->CheckInvariants();
    for (KvCache* cache : all) {
      ASSERT_TRUE(cache->Free(a[0]).ok());
      ASSERT_TRUE(cache->Free(b[0]).ok());
    }
  }
}

TEST(KvCacheSlicesTest, ABudgetIsEachSlicesBytes) {
  CacheConfig c = Config(32, DType::kF16, 0);
  c.budget_bytes = int64_t{1} << 20;
  std::unique_ptr<KvCache> whole = MakeCache(c);
  std::unique_ptr<KvCache> half = Slice(c, 2, 1);
  EXPECT_EQ(half->layout().num_blocks(), 2 * whole->layout().num_blocks()) << "half the bytes per block";
  EXPECT_LE(half->arena_layout().total_bytes(), c.budget_bytes);
  EXPECT_EQ(half->Stats().bytes_pool, half->arena_layout().total_bytes());
}

TEST(KvCacheSlicesTest, RefusesWhatDoesNotSplit) {
  auto refused = [](const CacheConfig& c, int32_t slices, int32_t slice) {
    return KvCache::Create({.config = c, .prefault = false, .slices = slices, .slice = slice}).status();
  };
  const CacheConfig c = Config(16, DType::kF32, 8);
  EXPECT_EQ(refused(c, 3, 0).code(), StatusCode::kInvalidArgument) << "16 tokens do not split in 3";
  EXPECT_EQ(refused(c, 4, 0).code(), StatusCode::kInvalidArgument) << "slices under 8 tokens";
  const Status bad = refused(c, 2, 2);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("slice"), std::string::npos) << bad.message();
  CacheConfig kivi = Config(64, DType::kF16, 8);
  kivi.format = KvFormat::Int4Kivi(32);
  EXPECT_EQ(refused(kivi, 2, 0).code(), StatusCode::kUnimplemented);
  std::unique_ptr<KvCache> s = Slice(c, 2, 0);
  const SeqId id = s->AddSequence();
  std::vector<float> rows(3 * 4 * 2 * 16, 0.25f);
  ASSERT_TRUE(*s->Append(id, {4, rows.data(), rows.data()}));
  std::vector<int32_t> keep2;
  for (int i = 0; i < 6; ++i) keep2.insert(keep2.end(), {0, 1});
  EXPECT_EQ(s->Compact(id, keep2, 2).code(), StatusCode::kUnimplemented) << "token eviction moves rows across slices";
}

}  // namespace
}  // namespace pagekv
