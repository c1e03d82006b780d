#include "base/json_nesting.h"

#include <algorithm>
#include <functional>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace pagekv {
namespace {

TEST(JsonNestingTest, CountsArraysAndObjectsNotStrings) {
  EXPECT_EQ(JsonNesting(""), 0u);
  EXPECT_EQ(JsonNesting("42"), 0u);
  EXPECT_EQ(JsonNesting("[]"), 1u);
  EXPECT_EQ(JsonNesting(R"({"a":[1,{"b":[]}],"c":{}})"), 4u);
  EXPECT_EQ(JsonNesting(R"(["[[[[{{{", "\"[[[", "\\", [1]])"), 2u);
  EXPECT_EQ(JsonNesting(R"({"k\"[": "]]]]", "x": [[]]})"), 3u);
}

TEST(JsonNestingTest, AgreesWithTheParserOnSeededRandomDocuments) {
  // Independent reference: the depth of the parsed value, walked.
  std::function<size_t(const nlohmann::json&)> depth = [&](const nlohmann::json& j) -> size_t {
    if (!j.is_structured()) return 0;
    size_t d = 0;
    for (const auto& x : j) d = std::max(d, depth(x));
    return d + 1;
  };
  uint64_t s = 12345;
  auto next = [&] { return (s = s * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  std::function<nlohmann::json(int)> gen = [&](int budget) -> nlohmann::json {
    switch (next() % (budget > 0 ? 5 : 2)) {
      case 0: {
        std::string str(1, "[]{}\"\\x"[next() % 7]);
        str.append("\"]");
        return str;
      }
      case 1: return static_cast<int64_t>(next() % 100);
      case 2: {
        nlohmann::json a = nlohmann::json::array();
        for (uint64_t i = next() % 4; i > 0; --i) a.push_back(gen(budget - 1));
        return a;
      }
      default: {
        nlohmann::json o = nlohmann::json::object();
        for (uint64_t i = next() % 4; i > 0; --i) {
          std::string key = std::to_string(i);
          key.append("{[\"");
          o[key] = gen(budget - 1);
        }
        return o;
      }
    }
  };
  for (int i = 0; i < 500; ++i) {
    const nlohmann::json j = gen(static_cast<int>(next() % 12));
    EXPECT_EQ(JsonNesting(j.dump(), 1000), depth(j)) << j.dump();
    EXPECT_EQ(JsonNesting(j.dump(2), 1000), depth(j)) << j.dump(2);
  }
}

TEST(JsonNestingTest, DeepTextIsRefusedNamingTheLimit) {
  const size_t d = 500000;
  const std::string deep = std::string(d, '[') + std::string(d, ']');
  EXPECT_EQ(JsonNesting(deep), kMaxJsonNesting + 1);  // stops once past the limit
  const Status s = CheckJsonNesting(deep, "the request body");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("the request body nests arrays and objects more than 128 levels"), std::string::npos)
      << s.message();
  const std::string ok = std::string(kMaxJsonNesting, '{') + std::string(kMaxJsonNesting, '}');
  EXPECT_TRUE(CheckJsonNesting(ok, "x").ok());
  EXPECT_FALSE(CheckJsonNesting("[" + ok + "]", "x").ok());
}

}  // namespace
}  // namespace pagekv
