#include "pagekv/kv_layout.h"

#include <gtest/gtest.h>

namespace pagekv {
namespace {

CacheConfig Small() {
  CacheConfig c;
  c.num_layers = 3;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 24;
  c.block_len = 8;
  c.format = KvFormat::Plain(DType::kF16);
  c.num_blocks = 5;
  return c;
}

TEST(KvLayoutTest, WorkedExampleTotalBytes) {
  CacheConfig c;
  c.num_layers = 61;
  c.num_q_heads = 8;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.block_len = 128;
  c.num_blocks = 512;
  c.format = KvFormat::Plain(DType::kF16);
  Result<KvLayout> l = KvLayout::Create(c);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->total_bytes(), 16374562816);
  EXPECT_EQ(l->bytes_per_token(), 61 * 8 * 128 * 2 * 2);
  EXPECT_EQ(l->bytes_per_block(), l->bytes_per_token() * 128);
}

TEST(KvLayoutTest, OffsetsWalkTheFourDimensionsInOrderWithoutOverlap) {
  // Walk [layer][plane][head][block][slot] in nesting order: every row must
  // start exactly where the formula says, rows within a slab are packed, and
  // each slab starts on a 64-byte boundary after the previous slab.
  for (int32_t head_dim : {1, 7, 24, 128}) {
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
      CacheConfig c = Small();
      c.head_dim = head_dim;
      c.format = KvFormat::Plain(d);
      KvLayout l = *KvLayout::Create(c);
      const int64_t row = head_dim * DTypeBits(d) / 8;
      ASSERT_EQ(l.row_bytes(), row);
      int64_t expected_slab_start = 0;
      for (int32_t layer = 0; layer < 3; ++layer)
        for (int32_t plane = 0; plane < 2; ++plane)
          for (int32_t head = 0; head < 2; ++head)
            for (int64_t block = 0; block < 5; ++block) {
              const int64_t slab = l.SlabOffset(layer, plane, head, block);
              ASSERT_EQ(slab, expected_slab_start);
              ASSERT_EQ(slab % kSlabAlignment, 0);
              for (int32_t slot = 0; slot < 8; ++slot) {
                ASSERT_EQ(l.RowOffset(layer, plane, head, block, slot), slab + slot * row);
              }
              expected_slab_start += (8 * row + 63) / 64 * 64;
            }
      EXPECT_EQ(expected_slab_start, l.total_bytes());
      EXPECT_EQ(l.bytes_per_block() * 5, l.total_bytes());
    }
  }
}

TEST(KvLayoutTest, MlaStoresOneLatentRowPerTokenAndLayer) {
  CacheConfig c;
  c.kind = CacheKind::kMla;
  c.num_layers = 61;
  c.num_q_heads = 128;
  c.head_dim = 128;
  c.kv_lora_rank = 512;
  c.rope_dim = 64;
  c.format = KvFormat::Plain(DType::kBF16);
  c.num_blocks = 4;
  KvLayout l = *KvLayout::Create(c);
  EXPECT_EQ(l.num_planes(), 1);
  EXPECT_EQ(l.num_heads(), 1);
  EXPECT_EQ(l.row_elems(), 576);
  EXPECT_EQ(l.bytes_per_token(), 70272);
  EXPECT_EQ(c.attention_kind(), AttentionKind::kMla);
}

TEST(KvLayoutTest, BudgetGivesAsManyBlocksAsFit) {
  CacheConfig c = Small();
  c.num_blocks = 0;
  const int64_t per_block = KvLayout::Create(Small())->bytes_per_block();
  c.budget_bytes = per_block * 7 + per_block / 2;
  KvLayout l = *KvLayout::Create(c);
  EXPECT_EQ(l.num_blocks(), 7);
  c.budget_bytes = per_block - 1;
  Result<KvLayout> small = KvLayout::Create(c);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("smaller than one block"), std::string::npos);
}

TEST(KvLayoutTest, AttentionKindFollowsHeadCounts) {
  CacheConfig c = Small();
  c.num_q_heads = 2;
  EXPECT_EQ(c.attention_kind(), AttentionKind::kMha);
  c.num_q_heads = 8;
  EXPECT_EQ(c.attention_kind(), AttentionKind::kGqa);
  c.num_kv_heads = 1;
  EXPECT_EQ(c.attention_kind(), AttentionKind::kMqa);
}

struct BadConfigCase {
  const char* name;
  void (*mutate)(CacheConfig&);
  const char* expected;  // a substring of the error
};

class KvLayoutValidationTest : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(KvLayoutValidationTest, RejectsWithAMessageNamingTheField) {
  CacheConfig c = Small();
  GetParam().mutate(c);
  Result<KvLayout> l = KvLayout::Create(c);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find(GetParam().expected), std::string::npos)
      << l.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    Fields, KvLayoutValidationTest,
    ::testing::Values(
        BadConfigCase{"ZeroLayers", [](CacheConfig& c) { c.num_layers = 0; }, "num_layers = 0"},
        BadConfigCase{"NegativeHeads", [](CacheConfig& c) { c.num_kv_heads = -2; }, "num_kv_heads = -2"},
        BadConfigCase{"ZeroHeadDim", [](CacheConfig& c) { c.head_dim = 0; }, "head_dim = 0"},
        BadConfigCase{"ZeroQHeads", [](CacheConfig& c) { c.num_q_heads = 0; }, "num_q_heads = 0"},
        BadConfigCase{"BlockLenNotPow2", [](CacheConfig& c) { c.block_len = 100; }, "power of two in [8, 1024]"},
        BadConfigCase{"BlockLenTooSmall", [](CacheConfig& c) { c.block_len = 4; }, "block_len = 4"},
        BadConfigCase{"BlockLenTooLarge", [](CacheConfig& c) { c.block_len = 2048; }, "block_len = 2048"},
        BadConfigCase{"QHeadsNotMultiple", [](CacheConfig& c) { c.num_q_heads = 3; }, "not a multiple of num_kv_heads"},
        BadConfigCase{"NoPoolSize", [](CacheConfig& c) { c.num_blocks = 0; }, "pool size missing"},
        BadConfigCase{"BothPoolSizes", [](CacheConfig& c) { c.budget_bytes = 1 << 20; }, "exactly one"},
        BadConfigCase{"NegativeBlocks", [](CacheConfig& c) { c.num_blocks = -1; }, "num_blocks = -1"},
        BadConfigCase{"TooManyBlockIds", [](CacheConfig& c) { c.num_blocks = int64_t{1} << 32; }, "32-bit"},
        BadConfigCase{"ArenaOverflows", [](CacheConfig& c) {
          c.num_layers = 4096; c.num_kv_heads = 65536; c.num_q_heads = 65536; c.head_dim = 1 << 20;
          c.num_blocks = 1 << 30; }, "overflows 63 bits"},
        BadConfigCase{"MlaFieldsOnPerHead", [](CacheConfig& c) { c.kv_lora_rank = 512; }, "set kind = MLA"},
        BadConfigCase{"MlaWithoutRank", [](CacheConfig& c) { c.kind = CacheKind::kMla; }, "kv_lora_rank = 0"},
        BadConfigCase{"QuantizedWithoutScales", [](CacheConfig& c) {
          c.format = KvFormat::Plain(DType::kInt8); }, "needs scales"}),
    [](const ::testing::TestParamInfo<BadConfigCase>& info) { return std::string(info.param.name); });

TEST(KvLayoutTest, PerTokenScalesAreCountedInRowBytes) {
  CacheConfig c = Small();
  c.head_dim = 128;
  c.format = KvFormat{DType::kInt8, ScaleAxis::kPerToken, 128, DType::kF16};
  KvLayout l = *KvLayout::Create(c);
  EXPECT_EQ(l.row_bytes(), 128 + 2);
  c.format = KvFormat{DType::kInt4, ScaleAxis::kPerToken, 32, DType::kF16};
  EXPECT_EQ(KvLayout::Create(c)->row_bytes(), 64 + 4 * 2);
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// Per-layer formats: the first and last layers f16, the middle one int8.
TEST(KvLayoutPerLayerTest, EachLayerHasItsOwnRowsSlabsAndStridesWithoutOverlap) {
  CacheConfig c = Small();
  c.format = KvFormat::Int8(24);
  Result<std::vector<KvFormat>> formats = ParseLayerFormats("0=f16,-1=f16", 3, 24, c.format);
  ASSERT_TRUE(formats.ok()) << formats.status().ToString();
  c.layer_formats = *formats;
  Result<KvLayout> l = KvLayout::Create(c);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_FALSE(l->uniform());
  EXPECT_EQ(l->row_bytes(0), 48);
  EXPECT_EQ(l->row_bytes(1), 26);  // 24 int8 + an f16 scale
  EXPECT_EQ(l->row_bytes(2), 48);
  EXPECT_EQ(l->slab_stride(1, 0), 256);  // 8 x 26 = 208, rounded up to 64
  EXPECT_EQ(l->bytes_per_token(), 2 * 2 * (48 + 26 + 48));
  EXPECT_EQ(l->bytes_per_block(), 2 * 2 * (384 + 256 + 384));
  EXPECT_EQ(l->padding_bytes_per_block(), 2 * 2 * (256 - 208));
  // Walk every row in nesting order: each starts after the previous one
  // ends, and the last ends inside the arena.
  int64_t end = 0;
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int32_t plane = 0; plane < 2; ++plane) {
      for (int32_t head = 0; head < 2; ++head) {
        for (int64_t block = 0; block < 5; ++block) {
          EXPECT_EQ(l->SlabOffset(layer, plane, head, block) % kSlabAlignment, 0);
          for (int32_t slot = 0; slot < 8; ++slot) {
            const int64_t at = l->RowOffset(layer, plane, head, block, slot);
            ASSERT_GE(at, end) << layer << " " << plane << " " << head << " " << block << " " << slot;
            end = at + l->row_bytes(layer);
          }
        }
      }
    }
  }
  EXPECT_LE(end, l->total_bytes());
  EXPECT_EQ(l->total_bytes(), 5 * l->bytes_per_block());
  // Every layer the same: uniform, and the uniform accessors answer.
  c.layer_formats = *ParseLayerFormats("0:2=int8", 3, 24, KvFormat::Plain(DType::kF16));
  Result<KvLayout> same = KvLayout::Create(c);
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE(same->uniform());
  EXPECT_EQ(same->row_bytes(), 26);
}

TEST(KvLayoutPerLayerTest, UniformAccessorsRefuseAMixedLayout) {
  CacheConfig c = Small();
  c.layer_formats = *ParseLayerFormats("1=int8", 3, 24, c.format);
  const KvLayout l = *KvLayout::Create(c);
  EXPECT_DEATH((void)l.row_bytes(), "per-layer overload");
}

TEST(KvLayoutPerLayerTest, SpecsAndTheirErrors) {
  const KvFormat base = KvFormat::Int8(8);
  Result<std::vector<KvFormat>> r = ParseLayerFormats("1:3=f16,-1=bf16", 5, 8, base);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 5u);
  EXPECT_EQ((*r)[0].dtype, DType::kInt8);
  EXPECT_EQ((*r)[2].dtype, DType::kF16);
  EXPECT_EQ((*r)[4].dtype, DType::kBF16);
  EXPECT_TRUE(ParseLayerFormats("", 5, 8, base)->empty());
  for (const char* bad : {"1", "7=f16", "-6=f16", "x=f16", "1=f17", "3:1=f16", "1=f16,1:2=int8", "1=f16,"}) {
    const Status st = ParseLayerFormats(bad, 5, 8, base).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_FALSE(st.message().empty());
  }
  CacheConfig c = Small();
  c.layer_formats = {KvFormat::Plain(DType::kF16)};  // one entry for three layers
  const Status st = KvLayout::Create(c).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("layer_formats has 1 entries for 3 layers"), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

TEST(KvLayoutKiviTest, KeyGroupsAndValueRowsHaveTheirOwnSlabsAndTheTailIsCounted) {
  CacheConfig c = Small();  // 3 layers, 2 KV heads, head_dim 24, block_len 8
  c.block_len = 64;
  c.format = KvFormat::Int4Kivi(32);
  Result<KvLayout> l = KvLayout::Create(c);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_FALSE(l->uniform());
  EXPECT_TRUE(l->kivi(0));
  EXPECT_EQ(l->row_bytes(0), 48);  // rows travel as f16
  EXPECT_EQ(l->slab_bytes(0, 0), 2 * (32 * 12 + 24 * 4));  // two key groups
  EXPECT_EQ(l->slab_bytes(0, 1), 64 * (12 + 4));          // 64 value rows
  EXPECT_EQ(l->bytes_per_token(), 3 * 2 * ((960 + 1024 + 63) / 64));
  EXPECT_EQ(l->tail_bytes_per_sequence(), 3 * 2 * 2 * 32 * 48);
  EXPECT_EQ(l->TailOffset(1, 1, 1), l->TailOffset(1, 0, 0) + 3 * 32 * 48);
  // Slabs tile the arena without overlap, each plane at its own stride.
  int64_t end = 0;
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int32_t plane = 0; plane < 2; ++plane) {
      for (int32_t head = 0; head < 2; ++head) {
        for (int64_t block = 0; block < 5; ++block) {
          const int64_t at = l->SlabOffset(layer, plane, head, block);
          ASSERT_GE(at, end);
          EXPECT_EQ(at % kSlabAlignment, 0);
          end = at + l->slab_bytes(layer, plane);
        }
      }
    }
  }
  EXPECT_LE(end, l->total_bytes());
}

TEST(KvLayoutKiviTest, BadGroupsAndShapesAreConfigurationErrors) {
  CacheConfig c = Small();
  c.format = KvFormat::Int4Kivi(32);  // block_len 8
  Status st = KvLayout::Create(c).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("does not divide block_len 8"), std::string::npos) << st.ToString();
  c.block_len = 64;
  c.format = KvFormat::Int4Kivi(48);
  EXPECT_EQ(KvLayout::Create(c).status().code(), StatusCode::kInvalidArgument);
  c.format = KvFormat::Int4Kivi(32);
  c.head_dim = 25;
  st = KvLayout::Create(c).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("even"), std::string::npos) << st.ToString();
  c.head_dim = 24;
  c.layer_formats = *ParseLayerFormats("0=f16", 3, 24, c.format);  // KIVI in layers 1 and 2 only
  Result<KvLayout> mixed = KvLayout::Create(c);
  ASSERT_TRUE(mixed.ok()) << mixed.status().ToString();
  EXPECT_FALSE(mixed->kivi(0));
  EXPECT_TRUE(mixed->kivi(2));
  EXPECT_EQ(mixed->tail_bytes_per_sequence(), 2 * 2 * 2 * 32 * 48);
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

TEST(KvLayoutHadamardTest, RotationIsForInt8AndFp8RowsOfPowerOfTwoLength) {
  CacheConfig c = Small();  // head_dim 24
  c.format = KvFormat::Int8(24).WithHadamard();
  Status st = KvLayout::Create(c).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("power-of-two"), std::string::npos) << st.ToString();
  c.head_dim = 32;
  c.format = KvFormat::Int8(32);
  ASSERT_TRUE(RotateQuantizedRows(c).ok());
  EXPECT_TRUE(c.format.hadamard);
  Result<KvLayout> l = KvLayout::Create(c);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->row_bytes(), 34);  // the same bytes as unrotated int8
  c.format = KvFormat::Plain(DType::kF16);
  EXPECT_EQ(RotateQuantizedRows(c).code(), StatusCode::kInvalidArgument);
  c.format = KvFormat::Plain(DType::kF16).WithHadamard();
  EXPECT_EQ(KvLayout::Create(c).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagekv
