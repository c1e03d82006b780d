// Generation with the model and the KV pool on a GPU (--device cuda), against
// the same generation on the CPU: greedy ids identical with f32 products on
// stories260K (f32, f16 and int8 KV; prompts sharing a prefix, so the prefix
// cache and copy-on-write run on the device) and on SmolLM2-135M-Instruct;
// with the fast f16 products, the same first tokens; gemma-3-270m (sliding
// window layers, a hybrid cache, soft-capped logits) likewise; the decode
// steps as CUDA graphs, the same ids again. Without a GPU (or a
// build without the CUDA toolkit) the refusal is checked instead and the GPU
// cases are skipped, saying why.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pagekv/generate.h"
#include "testing/models.h"

namespace pagekv {
namespace {

constexpr const char* kStories = "../shared/models/stories260K/stories260K.gguf";

GenerateOptions Stories(std::string device) {
  GenerateOptions o;
  o.model_path = kStories;
  o.prompts = {"Once upon a time, there was a little girl", "Once upon a time, there was a big dog",
               "The sun was"};
  o.max_new_tokens = 48;
  o.device = std::move(device);
  return o;
}

// Whether this machine runs --device cuda; *why when it does not.
bool GpuHere(std::string* why) {
  GenerateOptions o = Stories("cuda");
  o.prompts = {"Hi"};
  o.max_new_tokens = 1;
  Result<GenerateReport> r = Generate(o);
  if (r.ok()) return true;
  *why = r.status().message();
  return false;
}

TEST(DeviceGenerateTest, WithoutAGpuTheDeviceIsRefusedWithTheFix) {
  Result<GenerateReport> r = Generate(Stories("cuda"));
  if (r.ok()) GTEST_SKIP() << "a GPU runs --device cuda here: the refusal cannot be seen";
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("--device cpu"), std::string::npos) << r.status().message();
}

// What only a CUDA device runs (--tensor-cores, --cuda-graphs) is refused on
// the CPU, naming the fix.
TEST(DeviceGenerateTest, DeviceChoicesOnTheCpuAreRefusedWithTheFix) {
  for (const bool graphs : {false, true}) {
    GenerateOptions o = Stories("cpu");
    o.tensor_cores = !graphs;
    o.cuda_graphs = graphs;
    Result<GenerateReport> r = Generate(o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("--device cuda"), std::string::npos) << r.status().message();
  }
}

TEST(DeviceGenerateTest, UnknownDevicesAreRefused) {
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA", "cpu0"}) {
    Result<GenerateReport> r = Generate(Stories(bad));
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad << ": " << r.status().ToString();
  }
}

class GpuGenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!GpuHere(&why)) GTEST_SKIP() << "no --device cuda here (" << why << "): these run on a machine with an NVIDIA GPU";
  }
};

// The CPU, the GPU, and the GPU with its decode steps as CUDA graphs (48
// steps over block_len 16: the tables grow by a block every 16 steps, within
// one 256-token bucket of the recorded tables), with each KV format.
TEST_F(GpuGenerateTest, GreedyIdsAreTheCpusWithF32Products) {
  for (const DType kv : {DType::kF32, DType::kF16, DType::kInt8}) {
    std::vector<std::vector<int32_t>> ids[3];
    for (const int run : {0, 1, 2}) {
      GenerateOptions o = Stories(run > 0 ? "cuda" : "cpu");
      o.kv_dtype = kv;
      o.exact_products = true;
      o.prefix_cache = true;  // the shared "Once upon a time" blocks, copied on write
      o.cuda_graphs = run == 2;
      Result<GenerateReport> r = Generate(o);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      for (const auto& out : r->outputs) ids[run].push_back(out.generated_ids);
    }
    EXPECT_EQ(ids[1], ids[0]) << DTypeName(kv);
    EXPECT_EQ(ids[2], ids[0]) << DTypeName(kv) << ", decode steps as CUDA graphs";
  }
}

TEST_F(GpuGenerateTest, FastProductsKeepTheFirstTokens) {
  std::vector<std::vector<int32_t>> ids[2];
  for (const bool gpu : {false, true}) {
    GenerateOptions o = Stories(gpu ? "cuda" : "cpu");
    o.exact_products = !gpu;  // the GPU: f16 weights and activations, f32 sums
    Result<GenerateReport> r = Generate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (const auto& out : r->outputs) ids[gpu].push_back(out.generated_ids);
  }
  for (size_t p = 0; p < ids[0].size(); ++p) {
    ASSERT_GE(ids[1][p].size(), 16u);
    EXPECT_EQ(std::vector<int32_t>(ids[1][p].begin(), ids[1][p].begin() + 16),
              std::vector<int32_t>(ids[0][p].begin(), ids[0][p].begin() + 16))
        << "prompt " << p;
  }
}

// A real model's greedy ids with f32 products and f16 KV, on the CPU and the
// GPU (and, with `tensor_cores`, the GPU's tensor-core attention kernels too).
// Run 3: the GPU with its decode steps as CUDA graphs.
void ExpectTheSameGreedyIds(const std::string& path, int32_t max_new_tokens, bool tensor_cores = false) {
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is not fetched: make test fetches it";
  std::vector<int32_t> ids[4];
  for (const int run : {0, 1, 2, 3}) {
    if (run == 2 && !tensor_cores) continue;
    GenerateOptions o;
    o.model_path = path;
    o.prompts = {"The capital of France is"};
    o.max_new_tokens = max_new_tokens;
    o.exact_products = true;
    o.kv_dtype = DType::kF16;
    o.device = run > 0 ? "cuda" : "cpu";
    o.tensor_cores = run == 2;
    o.cuda_graphs = run == 3;
    Result<GenerateReport> r = Generate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ids[run] = r->outputs[0].generated_ids;
  }
  EXPECT_EQ(ids[1], ids[0]);
  EXPECT_EQ(ids[3], ids[0]) << "decode steps as CUDA graphs";
  if (tensor_cores) {
    EXPECT_EQ(ids[2], ids[0]) << "the tensor-core attention kernels";
  }
}

TEST_F(GpuGenerateTest, SmolLM2GreedyIdsAreTheCpusWithF32Products) {
  // head_dim 64, GQA 9 / 3: the tensor-core kernels take its prompt and its steps.
  ExpectTheSameGreedyIds(testing::SmolLM2Path(), 32, /*tensor_cores=*/true);
}

TEST_F(GpuGenerateTest, Gemma3WithSlidingWindowLayersGivesTheCpusGreedyIds) {
  ExpectTheSameGreedyIds(testing::Gemma3Path(), 24);
}

TEST_F(GpuGenerateTest, WhatTheDeviceDoesNotRunIsRefusedWithTheFix) {
  GenerateOptions o = Stories("cuda");
  o.kv_dtype = DType::kInt4;  // KIVI, groups of 32 tokens
  o.block_len = 32;
  Result<GenerateReport> r = Generate(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented) << r.status().ToString();
  o = Stories("cuda");
  o.kv_dtype = DType::kInt8;
  o.kv_hadamard = true;
  r = Generate(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented) << r.status().ToString();
}

}  // namespace
}  // namespace pagekv
