// Synthetic checkpoints: they load as llama models of the promised shape,
// their tokenizer round-trips text, and a failed write leaves nothing behind.
#include "pagekv/synth_model.h"

#include <unistd.h>

#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "model/gguf_file.h"
#include "model/llama_model.h"
#include "model/model.h"
#include "model/tokenizer.h"

namespace pagekv {
namespace {

std::string Temp(const std::string& name) {
  return "/tmp/pagekv-synth-test-" + std::to_string(::getpid()) + "-" + name;
}

TEST(SynthModelTest, EveryWeightTypeLoadsWithThePresetShape) {
  const SynthModelSpec spec = *FindSynthModelPreset("tiny");
  for (const char* type : {"f32", "f16", "bf16", "q8_0"}) {
    const std::string path = Temp(type);
    ASSERT_TRUE(WriteSynthModel(spec, 5, type, path).ok()) << type;
    auto file = GgufFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    auto tok = Tokenizer::FromGguf(**file);
    ASSERT_TRUE(tok.ok());
    EXPECT_EQ(tok->Decode(tok->Encode("Hello, world! 42", true, false)), "Hello, world! 42");
    auto model = LlamaModel::FromGguf(std::move(*file));
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    const ModelConfig& c = (*model)->config();
    EXPECT_EQ(c.dim, spec.dim);
    EXPECT_EQ(c.num_layers, spec.num_layers);
    EXPECT_EQ(c.num_kv_heads, spec.num_kv_heads);
    EXPECT_EQ(c.vocab_size, spec.vocab_size);
    EXPECT_EQ((*model)->ParameterCount(), spec.ParameterCount());
    std::remove(path.c_str());
  }
}

TEST(SynthModelTest, TheBenchmarkPresetIsAbout110MParametersWithGqa) {
  const SynthModelSpec spec = *FindSynthModelPreset("llama-110m");
  EXPECT_GT(spec.ParameterCount(), 100'000'000);
  EXPECT_LT(spec.ParameterCount(), 125'000'000);
  EXPECT_GT(spec.num_heads, spec.num_kv_heads);
}

// gemma3: the sliding pattern, the windows, the rope bases and the
// tokenizer without a dummy prefix come back from the file; a window larger
// than the context is refused at load, naming the key.
TEST(SynthModelTest, TheGemma3PresetLoadsWithItsSlidingLayers) {
  SynthModelSpec spec = *FindSynthModelPreset("tiny-gemma3");
  const std::string path = Temp("gemma3");
  ASSERT_TRUE(WriteSynthModel(spec, 3, "q8_0", path).ok());
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto tok = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(tok->Encode("hi", false, false).size(), tok->Encode(" hi", false, false).size() - 1)
      << "no dummy prefix: ' hi' is one more piece than 'hi'";
  EXPECT_EQ(tok->Decode(tok->Encode("Hello, world! 42", true, false)), "Hello, world! 42");
  auto model = LoadGgufModel(std::move(*file));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  EXPECT_EQ(c.arch, "gemma3");
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.layer_windows, (std::vector<int32_t>{32, 32, 0, 32, 32, 0}));
  EXPECT_TRUE(c.hybrid());
  EXPECT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.rope_theta_local, 1e4f);
  EXPECT_FLOAT_EQ(c.embed_scale, 8.0f);
  EXPECT_EQ((*model)->ParameterCount(), spec.ParameterCount());
  std::remove(path.c_str());

  spec.sliding_window = spec.context_len + 1;
  ASSERT_TRUE(WriteSynthModel(spec, 3, "f32", path).ok());
  auto wide = LoadGgufModel(*GgufFile::Open(path));
  ASSERT_FALSE(wide.ok());
  EXPECT_NE(wide.status().message().find("attention.sliding_window"), std::string::npos) << wide.status().message();
  std::remove(path.c_str());
}

TEST(SynthModelTest, BadRequestsAreErrorsAndLeaveNoFile) {
  const SynthModelSpec spec = *FindSynthModelPreset("tiny");
  EXPECT_EQ(FindSynthModelPreset("gpt-9").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSynthModel(spec, 0, "q4_k", Temp("x")).code(), StatusCode::kInvalidArgument);
  SynthModelSpec odd = spec;
  odd.num_kv_heads = 3;
  EXPECT_EQ(WriteSynthModel(odd, 0, "f32", Temp("x")).code(), StatusCode::kInvalidArgument);
  const Status s = WriteSynthModel(spec, 0, "f32", "/nonexistent-dir/model.gguf");
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("/nonexistent-dir"), std::string::npos);
  EXPECT_NE(::access(Temp("x").c_str(), F_OK), 0);
}

}  // namespace
}  // namespace pagekv
