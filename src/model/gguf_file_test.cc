#include "model/gguf_file.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

constexpr const char* kStories = "../shared/models/stories260K/stories260K.gguf";

TEST(GgufFileTest, ReadsTheRealStories260KModel) {
  auto file = GgufFile::Open(kStories);
  ASSERT_TRUE(file.ok()) << file.status().ToString() << " (tests read the model from ../shared, see README)";
  const GgufFile& f = **file;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(*f.GetString("general.architecture"), "llama");
  EXPECT_EQ(*f.GetInt("llama.block_count"), 5);
  EXPECT_EQ(*f.GetInt("llama.embedding_length"), 64);
  EXPECT_EQ(*f.GetInt("llama.attention.head_count"), 8);
  EXPECT_EQ(*f.GetInt("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(*f.GetInt("llama.feed_forward_length"), 172);
  EXPECT_NEAR(*f.GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);
  const GgufValue* tokens = f.Find("tokenizer.ggml.tokens");
  ASSERT_NE(tokens, nullptr);
  ASSERT_EQ(tokens->elements.size(), 512u);
  EXPECT_EQ(std::get<std::string>(tokens->elements[1]), "<s>");
  EXPECT_EQ(f.tensors().size(), 48u);
  const GgufTensor* emb = f.FindTensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->dims, (std::vector<int64_t>{64, 512}));
  EXPECT_EQ(emb->type, GgmlType::kF32);
  EXPECT_EQ(emb->num_bytes, 64 * 512 * 4);
  EXPECT_EQ(f.GetInt("no.such.key").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(f.GetInt("general.architecture").status().code(), StatusCode::kDataLoss);
}

std::string SmallFile() {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddInt("llama.block_count", GgufType::kU32, 2);
  w.AddFloat("llama.rope.freq_base", 10000.0);
  w.AddStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a"});
  w.AddFloatArray("tokenizer.ggml.scores", {0, 0, 0, -1.5f});
  std::vector<float> weights(32 * 2, 0.5f);
  w.AddTensor("token_embd.weight", GgmlType::kF32, {32, 2}, weights.data(), weights.size() * 4);
  std::vector<uint16_t> half(32, 0x3c00);
  w.AddTensor("output_norm.weight", GgmlType::kF16, {32}, half.data(), half.size() * 2);
  return w.Finish();
}

TEST(GgufFileTest, WriterOutputRoundTrips) {
  auto file = GgufFile::FromBytes(SmallFile());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(*(*file)->GetInt("llama.block_count"), 2);
  EXPECT_DOUBLE_EQ(*(*file)->GetFloat("llama.rope.freq_base"), 10000.0);
  const GgufTensor* t = (*file)->FindTensor("output_norm.weight");
  ASSERT_NE(t, nullptr);
  uint16_t first;
  std::memcpy(&first, t->data, 2);
  EXPECT_EQ(first, 0x3c00);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 32, reinterpret_cast<uintptr_t>((*file)->FindTensor("token_embd.weight")->data) % 32);
}

TEST(GgufFileTest, EveryTruncationIsAnErrorNeverACrash) {
  const std::string full = SmallFile();
  for (size_t n = 0; n < full.size(); ++n) {
    auto file = GgufFile::FromBytes(std::string_view(full).substr(0, n));
    ASSERT_FALSE(file.ok()) << "a " << n << "-byte prefix of " << full.size() << " bytes was accepted";
    EXPECT_EQ(file.status().code(), StatusCode::kDataLoss) << file.status().ToString();
  }
}

TEST(GgufFileTest, BadMagicAndVersionAreNamed) {
  std::string bad = SmallFile();
  bad[0] = 'X';
  auto r = GgufFile::FromBytes(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not a GGUF file"), std::string::npos);
  std::string v1 = SmallFile();
  v1[4] = 1;
  r = GgufFile::FromBytes(v1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(r.status().message().find("version 1"), std::string::npos);
}

// Offsets in the small file, found by searching for known bytes.
size_t Find(const std::string& hay, const std::string& needle) {
  const size_t at = hay.find(needle);
  EXPECT_NE(at, std::string::npos) << needle;
  return at;
}

TEST(GgufFileTest, AbsurdCountsAreRejectedBeforeAllocating) {
  std::string f = SmallFile();
  const uint64_t huge = uint64_t{1} << 60;
  std::string tensors = f, meta = f;
  std::memcpy(tensors.data() + 8, &huge, 8);
  std::memcpy(meta.data() + 16, &huge, 8);
  for (const std::string& bad : {tensors, meta}) {
    auto r = GgufFile::FromBytes(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("cannot fit"), std::string::npos) << r.status().message();
  }
  // A huge array count inside the metadata.
  std::string arr = f;
  const size_t tokens = Find(arr, "tokenizer.ggml.tokens") + std::strlen("tokenizer.ggml.tokens");
  std::memcpy(arr.data() + tokens + 4 + 4, &huge, 8);  // after value type and element type
  auto r = GgufFile::FromBytes(arr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("more than the file can hold"), std::string::npos) << r.status().message();
  // A huge string length.
  std::string str = f;
  const size_t arch = Find(str, "llama") - 8;  // the value's u64 length precedes it
  std::memcpy(str.data() + arch, &huge, 8);
  r = GgufFile::FromBytes(str);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("beyond the end"), std::string::npos) << r.status().message();
}

TEST(GgufFileTest, TensorProblemsAreNamed) {
  const std::string f = SmallFile();
  const size_t name = Find(f, "output_norm.weight") + std::strlen("output_norm.weight");
  // Layout after the name: u32 n_dims, u64 dim, u32 type, u64 offset.
  {
    std::string bad = f;
    const uint32_t dims = 7;
    std::memcpy(bad.data() + name, &dims, 4);
    auto r = GgufFile::FromBytes(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("7 dimensions"), std::string::npos) << r.status().message();
  }
  {
    std::string bad = f;
    const uint32_t iq2 = 16;  // iq2_xxs: not read
    std::memcpy(bad.data() + name + 4 + 8, &iq2, 4);
    auto r = GgufFile::FromBytes(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(r.status().message().find("output_norm.weight"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("iq2_xxs"), std::string::npos) << r.status().message();
  }
  {
    std::string bad = f;
    const uint32_t q4k = 12;  // read, but its 256-element blocks do not fit a row of 32
    std::memcpy(bad.data() + name + 4 + 8, &q4k, 4);
    auto r = GgufFile::FromBytes(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(r.status().message().find("not a multiple of 256"), std::string::npos) << r.status().message();
  }
  {
    std::string bad = f;
    const uint64_t past = uint64_t{1} << 20;
    std::memcpy(bad.data() + name + 4 + 8 + 4, &past, 8);
    auto r = GgufFile::FromBytes(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("runs past the end"), std::string::npos) << r.status().message();
  }
  {
    std::string bad = f;
    const uint64_t odd = 4;  // not aligned to 32
    std::memcpy(bad.data() + name + 4 + 8 + 4, &odd, 8);
    auto r = GgufFile::FromBytes(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("not aligned"), std::string::npos) << r.status().message();
  }
  {
    std::string bad = f;
    const uint64_t zero = 0;
    std::memcpy(bad.data() + name + 4, &zero, 8);
    auto r = GgufFile::FromBytes(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("impossible dimension"), std::string::npos) << r.status().message();
  }
}

TEST(GgufFileTest, ElementCountsWhoseBytesOverflowAreRejected) {
  // 2^32 x 2^30 f32 elements fit an int64; their 2^64 bytes do not (found by the fuzzer).
  std::string bad = SmallFile();
  const size_t name = Find(bad, "token_embd.weight") + std::strlen("token_embd.weight");
  const uint64_t d0 = uint64_t{1} << 32, d1 = uint64_t{1} << 30;
  std::memcpy(bad.data() + name + 4, &d0, 8);
  std::memcpy(bad.data() + name + 4 + 8, &d1, 8);
  auto r = GgufFile::FromBytes(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("more bytes than any file can hold"), std::string::npos) << r.status().message();
}

TEST(GgufFileTest, MissingFileIsNotFound) {
  auto r = GgufFile::Open("../shared/models/no-such-model.gguf");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("no-such-model.gguf"), std::string::npos);
}

}  // namespace
}  // namespace pagekv
