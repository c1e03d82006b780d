#include "model/tokenizer.h"

#include <fstream>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace pagekv {
namespace {

constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";
constexpr const char* kTok = "../shared/models/stories260K/tok512.bin";
constexpr const char* kGoldens = "../shared/goldens/stories260K.json";

nlohmann::json Goldens() {
  std::ifstream in(kGoldens);
  EXPECT_TRUE(in.good()) << "missing " << kGoldens << " (tests read ../shared, see README)";
  return nlohmann::json::parse(in);
}

std::vector<Tokenizer> BothTokenizers() {
  std::vector<Tokenizer> out;
  auto file = GgufFile::Open(kGguf);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  if (file.ok()) {
    auto t = Tokenizer::FromGguf(**file);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (t.ok()) out.push_back(std::move(*t));
  }
  auto t = Tokenizer::FromLlama2c(kTok, 512);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (t.ok()) out.push_back(std::move(*t));
  return out;
}

TEST(TokenizerTest, EncodesEveryGoldenPromptExactlyFromBothFormats) {
  const nlohmann::json g = Goldens();
  const std::vector<Tokenizer> toks = BothTokenizers();
  ASSERT_EQ(toks.size(), 2u);
  for (const Tokenizer& t : toks) {
    EXPECT_EQ(t.vocab_size(), 512);
    for (const auto& p : g["prompts"]) {
      const std::vector<int32_t> want = p["prompt_ids"].get<std::vector<int32_t>>();
      EXPECT_EQ(t.Encode(p["prompt"].get<std::string>(), /*bos=*/true, /*eos=*/false), want) << p["prompt"];
    }
    const std::vector<int32_t> nll_ids = g["nll"]["token_ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = t.Encode(g["nll"]["text"].get<std::string>(), true, false);
    ASSERT_GE(got.size(), nll_ids.size());
    EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(nll_ids.size())), nll_ids);
  }
}

TEST(TokenizerTest, DecodesGoldenGenerationsToTheGoldenText) {
  const nlohmann::json g = Goldens();
  for (const Tokenizer& t : BothTokenizers()) {
    for (const auto& p : g["prompts"]) {
      std::vector<int32_t> ids = p["prompt_ids"].get<std::vector<int32_t>>();
      for (int32_t id : p["generated_ids"].get<std::vector<int32_t>>()) ids.push_back(id);
      EXPECT_EQ(t.Decode(ids), p["text"].get<std::string>());
    }
  }
}

// The merge rule written the obvious way (rescan every adjacent pair per
// merge, highest score wins, leftmost among equals), on a synthetic
// vocabulary full of tied scores: the heap-based Encode must agree with it.
TEST(TokenizerTest, MergesAgreeWithTheQuadraticRuleOnRandomText) {
  std::mt19937 rng(11);
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>", " ", "a", "b", "c"};
  std::vector<float> scores = {0, 0, 0, -1, -1, -1, -1};
  std::set<std::string> seen(pieces.begin(), pieces.end());
  std::uniform_int_distribution<int> letter(0, 3), len(2, 4), score(1, 3);
  while (pieces.size() < 60) {
    std::string p;
    for (int i = len(rng); i > 0; --i) p += " abc"[letter(rng)];
    if (seen.insert(p).second) {
      pieces.push_back(p);
      scores.push_back(static_cast<float>(score(rng)));  // many ties on purpose
    }
  }
  auto tok = Tokenizer::FromPieces(pieces, scores, 1, 2);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  std::map<std::string, int32_t> id;
  for (size_t i = 0; i < pieces.size(); ++i) id[pieces[i]] = static_cast<int32_t>(i);
  std::uniform_int_distribution<int> text_len(0, 80);
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    for (int i = text_len(rng); i > 0; --i) text += " abc"[letter(rng)];
    std::vector<int32_t> want = {1};
    if (!text.empty()) want.push_back(id[" "]);
    for (char ch : text) want.push_back(id[std::string(1, ch)]);
    for (;;) {
      float best = -1e10f;
      size_t at = 0;
      int32_t merged = -1;
      for (size_t i = 0; i + 1 < want.size(); ++i) {
        const auto it = id.find(pieces[static_cast<size_t>(want[i])] + pieces[static_cast<size_t>(want[i + 1])]);
        if (it != id.end() && scores[static_cast<size_t>(it->second)] > best) {
          best = scores[static_cast<size_t>(it->second)];
          at = i;
          merged = it->second;
        }
      }
      if (merged < 0) break;
      want[at] = merged;
      want.erase(want.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    EXPECT_EQ(tok->Encode(text, true, false), want) << "'" << text << "'";
  }
}

TEST(TokenizerTest, EdgeCases) {
  for (const Tokenizer& t : BothTokenizers()) {
    EXPECT_EQ(t.Encode("", true, false), (std::vector<int32_t>{1}));
    EXPECT_EQ(t.Encode("", false, true), (std::vector<int32_t>{2}));
    EXPECT_TRUE(t.Encode("", false, false).empty());
    // A character with no piece (an emoji here) falls back to its four UTF-8
    // bytes (byte pieces are ids byte + 3 in this vocabulary); byte pieces
    // never merge, and decoding gives the bytes back.
    const std::string emoji = "\xF0\x9F\x98\x80";
    const std::vector<int32_t> e = t.Encode(emoji, false, false);
    ASSERT_EQ(e.size(), 5u);
    EXPECT_EQ(t.piece(e[0]), " ");
    EXPECT_EQ(std::vector<int32_t>(e.begin() + 1, e.end()),
              (std::vector<int32_t>{0xF0 + 3, 0x9F + 3, 0x98 + 3, 0x80 + 3}));
    EXPECT_EQ(t.Decode(e), " " + emoji);
    EXPECT_EQ(t.DecodePiece(0, 9999), "");
  }
}

TEST(TokenizerTest, CorruptLlama2cTokenizerIsAnError) {
  EXPECT_EQ(Tokenizer::FromLlama2c("../shared/models/nope.bin", 512).status().code(), StatusCode::kNotFound);
  // The GGUF file is not a llama2.c tokenizer: its piece lengths run past the end.
  auto r = Tokenizer::FromLlama2c(kGguf, 512);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  // Asking for more pieces than the file holds.
  EXPECT_FALSE(Tokenizer::FromLlama2c(kTok, 100000).ok());
}

}  // namespace
}  // namespace pagekv
