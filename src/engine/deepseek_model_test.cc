// The deepseek2 runner (multi-head latent attention in the absorbed form
// over the latent cache, experts) against the independent float64
// reference, which computes attention unabsorbed
// (tools/make_deepseek_goldens.py -> tests/data/deepseek2_goldens.json), on
// small random-weight GGUFs the synthetic writer makes byte for byte as it
// did for the goldens; then what the rest of PageKV does with a latent
// cache: chunked prefill at every position of a block, batched steps, every
// latent row format, the engine with prefix caching and tiers, and the
// errors a wrong file or cache gets.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/forward_step.h"
#include "model/gguf_file.h"
#include "model/model.h"
#include "model/model_loader.h"
#include "pagekv/engine.h"
#include "pagekv/eviction.h"
#include "pagekv/synth_model.h"
#include "testing/file_digest.h"

namespace pagekv {
namespace {

class DeepseekModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ifstream in("tests/data/deepseek2_goldens.json");
    ASSERT_TRUE(in) << "tests/data/deepseek2_goldens.json is missing";
    goldens_ = nlohmann::json::parse(in);
    dir_ = std::filesystem::temp_directory_path() / ("pagekv-deepseek-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    ids_ = goldens_["ids"].get<std::vector<int32_t>>();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The synthetic file of a preset at the goldens' seed.
  std::string Write(const std::string& preset, const std::string& weight_type = "f32") {
    Result<SynthModelSpec> spec = FindSynthModelPreset(preset);
    EXPECT_TRUE(spec.ok());
    const std::string path = (dir_ / (preset + "-" + weight_type + ".gguf")).string();
    EXPECT_TRUE(WriteSynthModel(*spec, goldens_["seed"].get<uint64_t>(), weight_type, path).ok());
    return path;
  }

  static Result<std::unique_ptr<KvCache>> Cache(const Model& m, DType dtype = DType::kF32, int32_t block_len = 16,
                                                int64_t blocks = 64) {
    return KvCache::Create({.config = m.CacheGeometry(block_len, dtype, blocks), .prefault = false});
  }

  // Every position's logits of `ids` in one step (exact products).
  static std::vector<float> AllLogits(const Model& m, const std::vector<int32_t>& ids, DType dtype = DType::kF32,
                                      ForwardOptions::MlaPrefill form = ForwardOptions::MlaPrefill::kAuto) {
    const int32_t vocab = m.config().vocab_size;
    auto cache = Cache(m, dtype);
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    const SeqId seq = (*cache)->AddSequence();
    std::vector<float> logits(ids.size() * static_cast<size_t>(vocab));
    ForwardItem item{seq, ids, logits.data(), true};
    const Result<bool> r = ForwardStep(m, **cache, {&item, 1}, {.activations = Activations::kF32, .mla_prefill = form});
    EXPECT_TRUE(r.ok() && *r) << r.status().ToString();
    return logits;
  }

  // The last token's logits of one sequence's next tokens (exact products).
  static bool Last(const Model& m, KvCache& cache, SeqId seq, std::span<const int32_t> tokens, float* logits,
                   ForwardOptions::MlaPrefill form = ForwardOptions::MlaPrefill::kAuto) {
    const ForwardItem item{seq, tokens, logits, false};
    const Result<bool> r = ForwardStep(m, cache, {&item, 1}, {.activations = Activations::kF32, .mla_prefill = form});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() && *r;
  }

  // max |a - b| / max(1, max |b|) over a row.
  static double RowError(const float* a, const std::vector<double>& b) {
    double scale = 1.0, worst = 0;
    for (double x : b) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < b.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]) / scale);
    return worst;
  }

  nlohmann::json goldens_;
  std::filesystem::path dir_;
  std::vector<int32_t> ids_;
};

TEST_F(DeepseekModelTest, EveryCaseMatchesTheUnabsorbedReferenceForSixtyFourGreedySteps) {
  const auto rows = goldens_["rows"].get<std::vector<int64_t>>();
  int cases = 0;
  for (const auto& c : goldens_["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const std::string weight_type = c["weight_type"];
    const std::string path = Write(c["preset"], weight_type);
    ASSERT_EQ(testing::FileSha256Hex(path), c["sha256"].get<std::string>())
        << "the synthetic writer no longer makes the file the goldens came from: rerun tools/make_deepseek_goldens.py";
    Result<LoadedModel> m = LoadModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const Model& model = *m->model;
    ASSERT_TRUE(model.config().mla());
    const int32_t vocab = model.config().vocab_size;
    // Prompt logits, every row asked, in one pass.
    const std::vector<float> logits = AllLogits(model, ids_);
    double prompt_worst = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      prompt_worst = std::max(prompt_worst, RowError(&logits[static_cast<size_t>(rows[r] * vocab)],
                                                     c["logits"][r].get<std::vector<double>>()));
    }
    EXPECT_LE(prompt_worst, 1e-4) << "relative to the largest logit of each row";
    // Greedy decoding: every chosen id the reference's, the top-5 logits
    // of each step within 1e-4 of the largest.
    auto cache = Cache(model);
    ASSERT_TRUE(cache.ok());
    const SeqId seq = (*cache)->AddSequence();
    std::vector<float> last(static_cast<size_t>(vocab));
    ASSERT_TRUE(Last(model, **cache, seq, ids_, last.data()));
    const auto greedy = c["greedy"].get<std::vector<int32_t>>();
    double step_worst = 0;
    for (size_t s = 0; s < greedy.size(); ++s) {
      const auto& top = c["top5"][s];
      const int32_t best = static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
      ASSERT_EQ(best, greedy[s]) << "step " << s << " (the reference's margin " << top["margin"].get<double>() << ")";
      double scale = 1.0;
      for (double x : top["logits"].get<std::vector<double>>()) scale = std::max(scale, std::fabs(x));
      for (size_t k = 0; k < 5; ++k) {
        const auto id = top["ids"][k].get<size_t>();
        step_worst = std::max(step_worst, std::fabs(last[id] - top["logits"][k].get<double>()) / scale);
      }
      const int32_t next = greedy[s];
      ASSERT_TRUE(Last(model, **cache, seq, {&next, 1}, last.data()));
    }
    EXPECT_LE(step_worst, 1e-4);
    std::printf("%-22s prompt logits %.2e, %zu greedy steps identical, their top-5 logits %.2e\n", name.c_str(),
                prompt_worst, greedy.size(), step_worst);
    ++cases;
  }
  EXPECT_GE(cases, 3);
}

// A prompt split into two chunks at every position of the first two blocks
// (and the decode path) gives the one-pass logits: the latent rows of the
// first chunk are read back from the cache by the second.
TEST_F(DeepseekModelTest, ChunkedPrefillAtEveryPositionMatchesOnePass) {
  Result<LoadedModel> m = LoadModel(Write("tiny-deepseek2"));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const Model& model = *m->model;
  const int32_t vocab = model.config().vocab_size;
  const std::vector<float> one_pass = AllLogits(model, ids_);
  const float* want = &one_pass[(ids_.size() - 1) * static_cast<size_t>(vocab)];
  for (size_t split = 1; split <= 33; ++split) {
    SCOPED_TRACE(split);
    auto cache = Cache(model, DType::kF32, 16);
    ASSERT_TRUE(cache.ok());
    const SeqId seq = (*cache)->AddSequence();
    std::vector<float> last(static_cast<size_t>(vocab));
    const std::span<const int32_t> all(ids_);
    ASSERT_TRUE(Last(model, **cache, seq, all.first(split), last.data()));
    ASSERT_TRUE(Last(model, **cache, seq, all.subspan(split), last.data()));
    double worst = 0;
    for (int32_t t = 0; t < vocab; ++t) worst = std::max(worst, static_cast<double>(std::fabs(last[static_cast<size_t>(t)] - want[t])));
    EXPECT_LE(worst, 2e-5);
  }
}

// Two sequences in one step (one a prompt chunk, one decoding) give what
// each gives alone.
TEST_F(DeepseekModelTest, ABatchedStepMixingAPromptAndADecodeMatchesSeparateSteps) {
  Result<LoadedModel> m = LoadModel(Write("tiny-deepseek2"));
  ASSERT_TRUE(m.ok());
  const Model& model = *m->model;
  const auto vocab = static_cast<size_t>(model.config().vocab_size);
  const std::span<const int32_t> all(ids_);
  auto alone = [&](std::span<const int32_t> a, std::span<const int32_t> b) {
    auto cache = Cache(model);
    const SeqId s = (*cache)->AddSequence();
    std::vector<float> out(vocab);
    EXPECT_TRUE(Last(model, **cache, s, a, out.data()));
    if (!b.empty()) {
      EXPECT_TRUE(Last(model, **cache, s, b, out.data()));
    }
    return out;
  };
  const std::vector<float> a_alone = alone(all.first(20), all.subspan(20, 1));
  const std::vector<float> b_alone = alone(all.subspan(5, 30), {});
  auto cache = Cache(model);
  const SeqId a = (*cache)->AddSequence(), b = (*cache)->AddSequence();
  std::vector<float> a_out(vocab), b_out(vocab);
  ASSERT_TRUE(Last(model, **cache, a, all.first(20), a_out.data()));
  const ForwardItem items[] = {{a, all.subspan(20, 1), a_out.data()}, {b, all.subspan(5, 30), b_out.data()}};
  ASSERT_TRUE(*ForwardStep(model, **cache, items, {.activations = Activations::kF32}));
  for (size_t t = 0; t < vocab; ++t) {
    ASSERT_NEAR(a_out[t], a_alone[t], 2e-5);
    ASSERT_NEAR(b_out[t], b_alone[t], 2e-5);
  }
}

// The latent rows in every format the kernels read: the logits stay close
// to the f32 cache's (rounding of the stored rows only), the bytes per
// token are the latent row's, and int4 KIVI (per-head K and V) is refused
// by name.
TEST_F(DeepseekModelTest, EveryLatentRowFormatRunsAndCostsTheLatentRowsBytes) {
  Result<LoadedModel> m = LoadModel(Write("tiny-deepseek2"));
  ASSERT_TRUE(m.ok());
  const Model& model = *m->model;
  const ModelConfig& c = model.config();
  const auto vocab = static_cast<size_t>(c.vocab_size);
  const std::vector<float> f32 = AllLogits(model, ids_);
  struct Case {
    DType dtype;
    double tolerance;     // of the last row's logits, relative to its largest
    int64_t row_bytes;    // one latent row of one layer
  };
  const int64_t elems = c.kv_lora_rank + c.qk_rope_dim;
  for (const Case& k : {Case{DType::kF16, 2e-3, elems * 2}, Case{DType::kBF16, 2e-2, elems * 2},
                        Case{DType::kInt8, 6e-2, elems + 2}, Case{DType::kFP8E4M3, 3e-1, elems + 2}}) {
    SCOPED_TRACE(DTypeName(k.dtype));
    auto cache = Cache(model, k.dtype);
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    EXPECT_EQ((*cache)->layout().row_bytes(0), k.row_bytes);
    const std::vector<float> got = AllLogits(model, ids_, k.dtype);
    std::vector<double> want(f32.end() - static_cast<std::ptrdiff_t>(vocab), f32.end());
    const double err = RowError(&got[got.size() - vocab], want);
    EXPECT_LE(err, k.tolerance);
    EXPECT_GT(err, 0.0) << "the rows were stored in another format, so the logits move";
    std::printf("latent rows in %-9s %lld bytes per row and layer, last-row logits %.2e from the f32 cache's\n",
                std::string(DTypeName(k.dtype)).c_str(), static_cast<long long>(k.row_bytes), err);
  }
  const Result<std::unique_ptr<KvCache>> kivi = Cache(model, DType::kInt4, 32);
  ASSERT_FALSE(kivi.ok());
  EXPECT_NE(kivi.status().message().find("MLA"), std::string::npos) << kivi.status().message();
}

TEST_F(DeepseekModelTest, APerHeadCacheIsRefusedByTheLatentModelAndTheOtherWayRound) {
  Result<LoadedModel> ds = LoadModel(Write("tiny-deepseek2"));
  ASSERT_TRUE(ds.ok());
  Result<SynthModelSpec> tiny = FindSynthModelPreset("tiny");
  const std::string llama_path = (dir_ / "tiny.gguf").string();
  ASSERT_TRUE(WriteSynthModel(*tiny, 1, "f32", llama_path).ok());
  Result<LoadedModel> llama = LoadModel(llama_path);
  ASSERT_TRUE(llama.ok());
  auto per_head = Cache(*llama->model);
  auto latent = Cache(*ds->model);
  ASSERT_TRUE(per_head.ok() && latent.ok());
  const std::vector<int32_t> ids = {1, 5, 9};
  const SeqId a = (*per_head)->AddSequence(), b = (*latent)->AddSequence();
  const Result<bool> r1 = ForwardSequence(*ds->model, **per_head, a, ids, nullptr);
  const Result<bool> r2 = ForwardSequence(*llama->model, **latent, b, ids, nullptr);
  EXPECT_EQ(r1.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r2.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*per_head)->Stats().blocks_used, 0) << "a refused step reserves nothing";
}

// Files the runner must not run silently wrong are refused by name before
// any weight is read.
TEST_F(DeepseekModelTest, WhatTheRunnerDoesNotImplementIsRefusedByName) {
  const std::string path = Write("tiny-deepseek2");
  auto with = [&](const std::string& key, const std::function<void(GgufWriter&)>& add) {
    // The same file with one more key: rebuilt through the writer.
    Result<std::unique_ptr<GgufFile>> f = GgufFile::Open(path);
    EXPECT_TRUE(f.ok());
    GgufWriter w;
    for (const auto& [k, v] : (*f)->metadata()) {
      if (k == key) continue;
      EXPECT_TRUE(w.AddValue(k, v).ok()) << k;
    }
    add(w);
    for (const GgufTensor& t : (*f)->tensors()) w.AddTensor(t.name, t.type, t.dims, t.data, static_cast<size_t>(t.num_bytes));
    const std::string out = (dir_ / ("with-" + std::to_string(std::hash<std::string>()(key)) + ".gguf")).string();
    EXPECT_TRUE(w.WriteFile(out).ok());
    return LoadModel(out).status();
  };
  Status s = with("deepseek2.nextn_predict_layers",
                  [](GgufWriter& w) { w.AddInt("deepseek2.nextn_predict_layers", GgufType::kU32, 1); });
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("nextn_predict_layers"), std::string::npos) << s.message();
  s = with("deepseek2.expert_gating_func", [](GgufWriter& w) { w.AddInt("deepseek2.expert_gating_func", GgufType::kU32, 4); });
  EXPECT_NE(s.message().find("expert_gating_func = 4"), std::string::npos) << s.message();
  s = with("deepseek2.attention.temperature_scale",
           [](GgufWriter& w) { w.AddFloat("deepseek2.attention.temperature_scale", 0.1); });
  EXPECT_NE(s.message().find("temperature_scale"), std::string::npos) << s.message();
  s = with("deepseek2.rope.scaling.yarn_log_multiplier", [](GgufWriter&) {});
  EXPECT_NE(s.message().find("yarn_log_multiplier"), std::string::npos) << s.message();
}

// The engine on the latent cache: a second request with the same prompt
// finds the first one's published latent blocks and generates the same
// tokens; int8 latent rows run the same requests.
TEST_F(DeepseekModelTest, TheEngineSharesLatentBlocksThroughThePrefixCache) {
  const std::string path = Write("tiny-deepseek2");
  for (DType dtype : {DType::kF32, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(dtype));
    EngineOptions o;
    o.model_path = path;
    o.block_len = 16;
    o.num_blocks = 32;
    o.kv_dtype = dtype;
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    EngineRequest r;
    r.prompt = ids_;
    r.max_tokens = 24;
    r.ignore_eos = true;
    const RequestId first = *(*e)->Submit(r);
    ASSERT_TRUE((*e)->RunUntilIdle().ok());
    const RequestResult a = (*e)->Wait(first);
    const RequestId second = *(*e)->Submit(r);
    ASSERT_TRUE((*e)->RunUntilIdle().ok());
    const RequestResult b = (*e)->Wait(second);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.cached_prompt_tokens, 0);
    EXPECT_GE(b.cached_prompt_tokens, 32) << "the prompt's two full blocks were found";
    if (dtype == DType::kF32) {
      const auto greedy = goldens_["cases"][0]["greedy"].get<std::vector<int32_t>>();
      EXPECT_EQ(a.tokens, std::vector<int32_t>(greedy.begin(), greedy.begin() + 24))
          << "the engine's default products give the reference's greedy tokens";
    }
  }
}

// Token eviction on the latent cache (one list per layer): every request
// keeps its budget of latent rows, the evicted rows' blocks go back to the
// pool, and keeping every token gives the tokens of no eviction at all.
TEST_F(DeepseekModelTest, TokenEvictionOnTheLatentCacheHoldsEachRequestsBudget) {
  const std::string path = Write("tiny-deepseek2");
  auto run = [&](const std::string& policy, double budget, int64_t* peak_blocks, int64_t* evicted) {
    EngineOptions o;
    o.model_path = path;
    o.block_len = 8;
    o.num_blocks = 128;
    o.prefix_cache = false;
    o.eviction = *ParseEvictionPolicy(policy, budget);
    auto e = std::move(*Engine::Create(o));
    std::vector<RequestId> ids;
    for (int i = 0; i < 3; ++i) {
      EngineRequest r;
      r.prompt = std::vector<int32_t>(ids_.begin() + i, ids_.end());
      r.max_tokens = 120;
      r.ignore_eos = true;
      ids.push_back(*e->Submit(r));
    }
    *peak_blocks = 0;
    while (*e->Step()) {
      e->CheckInvariants();
      *peak_blocks = std::max(*peak_blocks, e->Metrics().blocks_used);
    }
    *evicted = e->Metrics().tokens_evicted;
    std::vector<std::vector<int32_t>> out;
    for (RequestId id : ids) out.push_back(e->Wait(id).tokens);
    return out;
  };
  int64_t peak = 0, evicted = 0, peak_all = 0, evicted_all = 0, peak_none = 0, none_evicted = 0;
  const auto kept = run("h2o", 0.25, &peak, &evicted);
  const auto all = run("h2o", 1.0, &peak_all, &evicted_all);
  const auto none = run("none", 1.0, &peak_none, &none_evicted);
  // ~160 tokens each: a quarter is 40 rows, 5 blocks of 8 and a partial one;
  // without eviction 20 blocks each.
  EXPECT_LE(peak, 3 * 7);
  EXPECT_GE(peak_none, 3 * 19);
  EXPECT_GT(evicted, 3 * 100);
  EXPECT_EQ(evicted_all, 0);
  EXPECT_EQ(all, none) << "a budget of every token changes nothing";
  for (const auto& t : kept) EXPECT_EQ(t.size(), 120u);
}

// Latent blocks through the tiers: an engine writes its published latent
// blocks to disk; a new engine over the same file finds them there and
// generates the same tokens without recomputing the prompt.
TEST_F(DeepseekModelTest, LatentBlocksComeBackFromDiskAfterARestart) {
  const std::string path = Write("tiny-deepseek2");
  EngineOptions o;
  o.model_path = path;
  o.block_len = 8;
  o.num_blocks = 32;
  o.kv_dtype = DType::kBF16;
  o.tiers.disk_path = (dir_ / "tier.bin").string();
  o.tiers.disk_bytes = 4 << 20;
  EngineRequest r;
  r.prompt = ids_;
  r.max_tokens = 16;
  r.ignore_eos = true;
  std::vector<int32_t> first;
  {
    auto e = std::move(*Engine::Create(o));
    const RequestId id = *e->Submit(r);
    ASSERT_TRUE(e->RunUntilIdle().ok());
    first = e->Wait(id).tokens;
  }
  auto e = std::move(*Engine::Create(o));
  const RequestId id = *e->Submit(r);
  ASSERT_TRUE(e->RunUntilIdle().ok());
  const RequestResult again = e->Wait(id);
  EXPECT_EQ(again.tokens, first);
  EXPECT_GE(e->Metrics().prefix.tier_hit_blocks[2], 4) << "the prompt's latent blocks came back from disk";
  EXPECT_GE(again.cached_prompt_tokens, 32);
}

// The unabsorbed prefill (keys and values materialised per head, the
// per-head kernel) against the reference and against the absorbed form:
// every case, every latent format, chunks at every position of a block,
// and a step mixing an unabsorbed chunk with absorbed ones.
TEST_F(DeepseekModelTest, TheUnabsorbedPrefillMatchesTheReferenceAndTheAbsorbedForm) {
  using Form = ForwardOptions::MlaPrefill;
  const auto rows = goldens_["rows"].get<std::vector<int64_t>>();
  for (const auto& c : goldens_["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    Result<LoadedModel> m = LoadModel(Write(c["preset"], c["weight_type"]));
    ASSERT_TRUE(m.ok());
    const int32_t vocab = m->model->config().vocab_size;
    const std::vector<float> logits = AllLogits(*m->model, ids_, DType::kF32, Form::kUnabsorbed);
    double worst = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      worst = std::max(worst, RowError(&logits[static_cast<size_t>(rows[r] * vocab)], c["logits"][r].get<std::vector<double>>()));
    }
    EXPECT_LE(worst, 1e-4);
    std::printf("%-22s unabsorbed prefill: prompt logits %.2e from the reference\n", c["name"].get<std::string>().c_str(), worst);
  }
  Result<LoadedModel> m = LoadModel(Write("tiny-deepseek2"));
  ASSERT_TRUE(m.ok());
  const Model& model = *m->model;
  const auto vocab = static_cast<size_t>(model.config().vocab_size);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kInt8, DType::kFP8E5M2}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::vector<float> a = AllLogits(model, ids_, dtype, Form::kAbsorbed);
    const std::vector<float> u = AllLogits(model, ids_, dtype, Form::kUnabsorbed);
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(a[i] - u[i])));
    EXPECT_LE(worst, 5e-5) << "both forms read the same stored rows";
  }
  const std::span<const int32_t> all(ids_);
  const std::vector<float> one_pass = AllLogits(model, ids_, DType::kF32, Form::kAbsorbed);
  const float* want = &one_pass[(ids_.size() - 1) * vocab];
  for (size_t split = 1; split <= 17; ++split) {
    auto cache = Cache(model, DType::kF32, 16);
    const SeqId seq = (*cache)->AddSequence();
    std::vector<float> last(vocab);
    ASSERT_TRUE(Last(model, **cache, seq, all.first(split), last.data(), Form::kUnabsorbed));
    ASSERT_TRUE(Last(model, **cache, seq, all.subspan(split), last.data(), Form::kUnabsorbed));
    double worst = 0;
    for (size_t t = 0; t < vocab; ++t) worst = std::max(worst, static_cast<double>(std::fabs(last[t] - want[t])));
    EXPECT_LE(worst, 5e-5) << "split at " << split;
  }
  // kAuto on tiny-deepseek2 (rank 64, nope 32, v 32: unabsorbed from 65
  // queries): a 70-token chunk beside a decode and a short chunk.
  std::vector<int32_t> long_prompt;
  for (int i = 0; i < 70; ++i) long_prompt.push_back(ids_[static_cast<size_t>(i) % ids_.size()]);
  auto cache = Cache(model);
  const SeqId a = (*cache)->AddSequence(), b = (*cache)->AddSequence(), d = (*cache)->AddSequence();
  std::vector<float> a_out(vocab), b_out(vocab), d_out(vocab);
  ASSERT_TRUE(Last(model, **cache, d, all.first(10), d_out.data()));
  const ForwardItem items[] = {{a, long_prompt, a_out.data()}, {b, all.first(12), b_out.data()}, {d, all.subspan(10, 1), d_out.data()}};
  ASSERT_TRUE(*ForwardStep(model, **cache, items, {.activations = Activations::kF32}));
  auto alone = [&](std::span<const int32_t> first, std::span<const int32_t> then) {
    auto c2 = Cache(model);
    const SeqId s = (*c2)->AddSequence();
    std::vector<float> out(vocab);
    EXPECT_TRUE(Last(model, **c2, s, first, out.data(), Form::kAbsorbed));
    if (!then.empty()) {
      EXPECT_TRUE(Last(model, **c2, s, then, out.data(), Form::kAbsorbed));
    }
    return out;
  };
  const std::vector<float> a_alone = alone(long_prompt, {}), b_alone = alone(all.first(12), {}),
                           d_alone = alone(all.first(10), all.subspan(10, 1));
  for (size_t t = 0; t < vocab; ++t) {
    ASSERT_NEAR(a_out[t], a_alone[t], 5e-5);
    ASSERT_NEAR(b_out[t], b_alone[t], 2e-5);
    ASSERT_NEAR(d_out[t], d_alone[t], 2e-5);
  }
}

}  // namespace
}  // namespace pagekv
