// The normative weight decoders against values the `gguf` Python package
// computed from the same random blocks (tests/data/weight_formats.json,
// written by tools/make_weight_goldens.py): an independent implementation.
#include "kernels/weight_formats.h"

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace pagekv {
namespace {

std::vector<std::byte> FromHex(const std::string& hex) {
  std::vector<std::byte> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return out;
}

WeightType TypeNamed(const std::string& name) {
  for (int t = 0; t < kNumWeightTypes; ++t) {
    if (FormatOf(static_cast<WeightType>(t)).name == name) return static_cast<WeightType>(t);
  }
  ADD_FAILURE() << "unknown type " << name;
  return WeightType::kF32;
}

TEST(WeightFormatsTest, EveryBlockTypeDecodesExactlyAsTheIndependentDecoder) {
  std::ifstream in("tests/data/weight_formats.json");
  ASSERT_TRUE(in) << "tests/data/weight_formats.json is missing (run from the repository root)";
  const nlohmann::json goldens = nlohmann::json::parse(in);
  int types = 0;
  for (const auto& c : goldens["cases"]) {
    const WeightType t = TypeNamed(c["type"]);
    const std::vector<std::byte> bytes = FromHex(c["bytes"]);
    const std::vector<float> want = c["values"].get<std::vector<float>>();
    const WeightFormat& f = FormatOf(t);
    ASSERT_EQ(bytes.size() / static_cast<size_t>(f.block_bytes) * static_cast<size_t>(f.block_elems), want.size()) << f.name;
    std::vector<float> got(want.size());
    DecodeWeights(t, bytes.data(), static_cast<int64_t>(got.size()), got.data());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << f.name << " element " << i;
    EXPECT_EQ(WeightRowBytes(t, static_cast<int64_t>(want.size())), static_cast<int64_t>(bytes.size()));
    ++types;
  }
  EXPECT_EQ(types, 10);
}

TEST(WeightFormatsTest, TheTableMatchesGgml) {
  EXPECT_EQ(FormatOf(WeightType::kQ4_K).block_bytes, 144);
  EXPECT_EQ(FormatOf(WeightType::kQ6_K).block_elems, 256);
  EXPECT_FALSE(IsBlockQuantized(WeightType::kBF16));
  EXPECT_TRUE(IsBlockQuantized(WeightType::kQ4_1));
  EXPECT_EQ(WeightRowBytes(WeightType::kF16, 576), 1152);
  EXPECT_EQ(WeightRowBytes(WeightType::kQ4_1, 576), 18 * 20);
}

}  // namespace
}  // namespace pagekv
