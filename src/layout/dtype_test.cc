#include "pagekv/dtype.h"

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(DTypeTest, BitsAndNames) {
  EXPECT_EQ(DTypeBits(DType::kF32), 32);
  EXPECT_EQ(DTypeBits(DType::kBF16), 16);
  EXPECT_EQ(DTypeBits(DType::kFP8E4M3), 8);
  EXPECT_EQ(DTypeBits(DType::kInt4), 4);
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8E4M3, DType::kFP8E5M2,
                  DType::kInt8, DType::kInt4}) {
    Result<DType> parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
}

TEST(DTypeTest, ParsesAliasesCaseInsensitively) {
  EXPECT_EQ(*ParseDType("FP16"), DType::kF16);
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
}

TEST(DTypeTest, UnknownNameListsTheAcceptedOnes) {
  Result<DType> r = ParseDType("f64");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("f16, bf16"), std::string::npos);
}

TEST(KvFormatTest, DescribesQuantizedFormatsWithScales) {
  KvFormat int4{DType::kInt4, ScaleAxis::kPerChannel, 32, DType::kF16};
  EXPECT_FALSE(int4.IsPlainFloat());
  EXPECT_EQ(int4.ToString(), "int4 (f16 scale per 32 tokens of a channel for keys, per token for values; KIVI)");
  EXPECT_TRUE(int4.IsKivi());
  EXPECT_EQ(KvFormat::ForDType(DType::kInt4, 128).group_size, KvFormat::kDefaultKiviGroup);
  KvFormat int8{DType::kInt8, ScaleAxis::kPerToken, 128, DType::kF32};
  EXPECT_EQ(int8.ToString(), "int8 (f32 scale per 128 elements of a token)");
  EXPECT_TRUE(KvFormat::Plain(DType::kBF16).IsPlainFloat());
}

}  // namespace
}  // namespace pagekv
