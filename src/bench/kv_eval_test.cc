// EvalKv on the real stories260K model: f32 against itself agrees, every
// format and eviction policy is measured within regression bounds, a full
// budget changes nothing, and bad configurations are named before any work.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "pagekv/eval.h"
#include "pagekv/synth_model.h"

namespace pagekv {
namespace {

KvEvalOptions Options(DType d) {
  KvEvalOptions o;
  o.model_path = "../shared/models/stories260K/stories260K.gguf";
  o.goldens_path = "../shared/goldens/stories260K.json";
  o.kv_dtype = d;
  o.continuations = 2;
  o.measure_speed = false;
  return o;
}

// The decoded half runs the decode kernel, the reference the prefill kernel:
// f32 against itself agrees to rounding, not bit for bit.
TEST(KvEvalTest, TheF32CacheAgainstItselfAgreesToRounding) {
  Result<KvEvalReport> r = EvalKv(Options(DType::kF32));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->positions, 2 * 256);  // the decoded halves of two 512-token continuations
  EXPECT_LT(r->kl_mean, 1e-9);
  EXPECT_EQ(r->top1_agreement, 1.0);
  EXPECT_LT(std::abs(r->nll_change_rel), 1e-6);
  EXPECT_EQ(r->bytes_ratio_vs_f16, 2.0);
  EXPECT_EQ(r->kept_fraction, 1.0);
}

// Budget 1 keeps every token: every policy's numbers equal no policy's
// exactly (the weights are computed, nothing is evicted).
TEST(KvEvalTest, EveryPolicyAtFullBudgetEqualsNoPolicy) {
  Result<KvEvalReport> none = EvalKv(Options(DType::kF16));
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  for (const char* policy : {"streaming", "h2o", "snapkv"}) {
    KvEvalOptions o = Options(DType::kF16);
    o.policy = policy;
    Result<KvEvalReport> r = EvalKv(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->kl_mean, none->kl_mean) << policy;
    EXPECT_EQ(r->nll, none->nll) << policy;
    EXPECT_EQ(r->top1_agreement, none->top1_agreement) << policy;
    EXPECT_EQ(r->kept_fraction, 1.0) << policy;
  }
}

// At a 20% budget (measured over 4 continuations: streaming top-1 91.6%,
// NLL +11.7%; h2o 90.6%, +10.0%; snapkv, which compresses only the prompt,
// 97.4%, -0.04% while keeping 45% of the tokens). The bounds: the budget is
// held, and the loss is real but not a collapse (a wrong position or a
// scrambled row costs far more).
TEST(KvEvalTest, EvictionPoliciesAtTwentyPercentAreMeasured) {
  for (const char* policy : {"streaming", "h2o", "snapkv"}) {
    KvEvalOptions o = Options(DType::kF16);
    o.policy = policy;
    o.budget = 0.2;
    Result<KvEvalReport> r = EvalKv(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const bool snap = std::string(policy) == "snapkv";
    if (snap) {
      EXPECT_LT(r->kept_fraction, 0.6);
    } else {
      EXPECT_NEAR(r->kept_fraction, 0.2, 0.01) << policy;
    }
    EXPECT_GT(r->kl_mean, 0.0) << policy;
    EXPECT_LT(r->kl_mean, 0.2) << policy;
    EXPECT_GE(r->top1_agreement, 0.8) << policy;
    EXPECT_LT(r->nll_change_rel, 0.3) << policy;
    EXPECT_NEAR(r->effective_bytes_ratio_vs_f16, r->kept_fraction, 1e-12);
  }
}

// Measured: top-1 agreement 97.7%, NLL +0.53% over 8 continuations (the
// issue's targets are 99% and 0.5%; docs/PERFORMANCE.md). The bounds below
// catch a regression (a misapplied scale costs far more) without claiming
// the targets.
TEST(KvEvalTest, Int8StaysCloseToTheF32Cache) {
  Result<KvEvalReport> r = EvalKv(Options(DType::kInt8));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GE(r->top1_agreement, 0.96);
  EXPECT_LE(std::abs(r->nll_change_rel), 0.01);
  EXPECT_LT(r->kl_mean, 0.005);
  EXPECT_GT(r->kl_mean, 0.0);  // it does change something
  // stories260K's head_dim is 8: one f16 scale per 8 int8 values.
  EXPECT_EQ(r->bytes_per_token, 5 * 4 * 2 * (8 + 2));
  EXPECT_EQ(r->bytes_per_token_f16, 5 * 4 * 2 * 16);
}

// Measured over 8 continuations: E4M3 KL 0.015, top-1 93.8%, NLL +2.9%;
// E5M2 KL 0.066, top-1 86.9%, NLL +2.7% (3 and 2 mantissa bits). The bounds
// catch a broken decode or a misapplied scale, which cost far more.
TEST(KvEvalTest, Fp8FormatsAreMeasured) {
  for (DType d : {DType::kFP8E4M3, DType::kFP8E5M2}) {
    Result<KvEvalReport> r = EvalKv(Options(d));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const bool e4m3 = d == DType::kFP8E4M3;
    EXPECT_GT(r->kl_mean, 0.0);
    EXPECT_LT(r->kl_mean, e4m3 ? 0.03 : 0.1) << DTypeName(d);
    EXPECT_GE(r->top1_agreement, e4m3 ? 0.85 : 0.75) << DTypeName(d);
    EXPECT_LT(std::abs(r->nll_change_rel), 0.05) << DTypeName(d);
    EXPECT_EQ(r->bytes_per_token, 5 * 4 * 2 * (8 + 2));
  }
}

// Per-layer formats on the real model: naming every layer int8 is the
// uniform int8 cache exactly; the first and last layers in f16 cost their
// bytes (2 of 5 layers at 16 bytes per row instead of 10) and do not lose
// fidelity against all-int8 (measured: top-1 98.2% against 97.75%).
TEST(KvEvalTest, PerLayerFormats) {
  Result<KvEvalReport> uniform = EvalKv(Options(DType::kInt8));
  ASSERT_TRUE(uniform.ok()) << uniform.status().ToString();
  KvEvalOptions o = Options(DType::kF16);
  o.layer_dtypes = "0:4=int8";
  Result<KvEvalReport> all = EvalKv(o);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(all->kl_mean, uniform->kl_mean);
  EXPECT_EQ(all->nll, uniform->nll);
  EXPECT_EQ(all->bytes_per_token, uniform->bytes_per_token);
  o = Options(DType::kInt8);
  o.layer_dtypes = "0=f16,-1=f16";
  Result<KvEvalReport> ends = EvalKv(o);
  ASSERT_TRUE(ends.ok()) << ends.status().ToString();
  EXPECT_EQ(ends->kv_dtype, "int8,0=f16,-1=f16");
  EXPECT_EQ(ends->bytes_per_token, 4 * 2 * (3 * 10 + 2 * 16));
  EXPECT_LE(ends->kl_mean, uniform->kl_mean);
  o.layer_dtypes = "5=f16";
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kInvalidArgument);
}

// INT4 KIVI on the real model (measured over 8 continuations: KL 0.0056,
// top-1 96.7%, NLL +0.39%; the target is an NLL change of at most
// 3%). Bytes: head_dim 8 makes the per-row value parameters weigh: (4 + 1)
// + (4 + 4) bytes per token and head against f16's 32.
TEST(KvEvalTest, Int4KiviMeetsTheNllTarget) {
  KvEvalOptions o = Options(DType::kInt4);
  o.block_len = 32;
  Result<KvEvalReport> r = EvalKv(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_LE(std::abs(r->nll_change_rel), 0.03);
  EXPECT_GT(r->kl_mean, 0.0);
  EXPECT_LT(r->kl_mean, 0.02);
  EXPECT_GE(r->top1_agreement, 0.93);
  EXPECT_EQ(r->bytes_per_token, 5 * 4 * ((4 + 1) + (4 + 4)));
}

// Hadamard-rotated INT8 rows on the real model: the same bytes, 43% less KL
// (0.00101 against 0.00176 over 8 continuations), top-1 98.4% against
// 97.75%, and the golden NLL change within the 0.5% (+0.43%).
TEST(KvEvalTest, HadamardRotatedInt8MeetsTheNllTarget) {
  Result<KvEvalReport> plain = EvalKv(Options(DType::kInt8));
  KvEvalOptions o = Options(DType::kInt8);
  o.hadamard = true;
  Result<KvEvalReport> r = EvalKv(o);
  ASSERT_TRUE(plain.ok() && r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kv_dtype, "int8+hadamard");
  EXPECT_EQ(r->bytes_per_token, plain->bytes_per_token);
  EXPECT_LE(std::abs(r->nll_change_rel), 0.005);
  EXPECT_LT(r->kl_mean, plain->kl_mean * 0.8);
  EXPECT_GE(r->top1_agreement, plain->top1_agreement);
  o.kv_dtype = DType::kF16;  // nothing to rotate: named before any work
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kInvalidArgument);
}

// A deepseek2 model's latent cache through the same evaluation: f32
// against itself agrees, int8 latent rows cost 82 bytes per row and layer
// and stay close, and eviction keeps its budget of latent rows.
TEST(KvEvalTest, ALatentCacheModelIsEvaluatedLikeAnyOther) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("pagekv-eval-deepseek-" + std::to_string(::getpid()) + ".gguf")).string();
  ASSERT_TRUE(WriteSynthModel(*FindSynthModelPreset("tiny-deepseek2"), 3, "f32", path).ok());
  auto options = [&](DType d) {
    KvEvalOptions o = Options(d);
    o.model_path = path;
    o.continuations = 1;
    o.max_len = 128;
    return o;
  };
  Result<KvEvalReport> f32 = EvalKv(options(DType::kF32));
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  EXPECT_LT(f32->kl_mean, 1e-9);
  EXPECT_EQ(f32->bytes_per_token, 3 * 80 * 4);
  Result<KvEvalReport> int8 = EvalKv(options(DType::kInt8));
  ASSERT_TRUE(int8.ok()) << int8.status().ToString();
  EXPECT_EQ(int8->bytes_per_token, 3 * 82);
  EXPECT_LT(int8->kl_mean, 0.05);
  EXPECT_GT(int8->kl_mean, 0.0);
  KvEvalOptions h2o = options(DType::kF16);
  h2o.policy = "h2o";
  h2o.budget = 0.5;
  Result<KvEvalReport> evicted = EvalKv(h2o);
  ASSERT_TRUE(evicted.ok()) << evicted.status().ToString();
  EXPECT_LT(evicted->kept_fraction, 0.6);
  EXPECT_GT(evicted->kept_fraction, 0.4);
  std::remove(path.c_str());
}

TEST(KvEvalTest, BadConfigurationsAreNamedUpFront) {
  KvEvalOptions o = Options(DType::kInt8);
  o.policy = "lru";
  const Status lru = EvalKv(o).status();
  EXPECT_EQ(lru.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(lru.message().find("streaming, h2o or snapkv"), std::string::npos) << lru.ToString();
  o = Options(DType::kInt8);
  o.budget = 0.5;  // policy none keeps everything
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kInvalidArgument);
  o.policy = "h2o";
  o.prompt_fraction = 1.0;
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(DType::kInt8);
  o.budget = 0;
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kInvalidArgument);
  o.budget = 1.5;
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(DType::kInt4);  // groups of 32 tokens do not fit blocks of 16: refused before any work
  o.block_len = 16;
  const Status int4 = EvalKv(o).status();
  EXPECT_EQ(int4.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(int4.message().find("does not divide block_len 16"), std::string::npos) << int4.ToString();
  o = Options(DType::kInt4);  // KIVI rows cannot be evicted: refused before any work
  o.policy = "streaming";
  o.budget = 0.5;
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kUnimplemented);
  o = Options(DType::kInt8);
  o.goldens_path = "/nonexistent.json";
  EXPECT_EQ(EvalKv(o).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace pagekv
