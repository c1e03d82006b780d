// The runner's architecture variants against the independent float64
// reference (tools/make_variant_goldens.py -> tests/data/model_variants.json):
// qwen2 (q/k/v biases, rotary on halves), partial rotary, linear / YaRN /
// llama3 rope scaling, a rope_freqs tensor, each on a small random-weight
// GGUF the synthetic writer makes byte for byte as it did for the goldens.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/forward_step.h"
#include "model/model.h"
#include "model/model_loader.h"
#include "pagekv/synth_model.h"
#include "testing/file_digest.h"

namespace pagekv {
namespace {

// The synth-model flags of a variant applied to the spec.
Status ApplyFlags(const std::vector<std::string>& flags, SynthModelSpec& spec, std::string& weight_type) {
  for (size_t i = 0; i < flags.size(); ++i) {
    const std::string& f = flags[i];
    if (f == "--rope-freqs") {
      spec.rope_freqs = true;
      continue;
    }
    if (i + 1 >= flags.size()) return InvalidArgumentError("flag " + f + " needs a value");
    const std::string& v = flags[++i];
    if (f == "--arch") {
      spec.arch = v;
    } else if (f == "--rope-dims") {
      spec.rope_dims = std::stoi(v);
    } else if (f == "--rope-scaling") {
      spec.rope_scaling = v;
    } else if (f == "--rope-factor") {
      spec.rope_factor = std::stod(v);
    } else if (f == "--rope-orig-context") {
      spec.rope_orig_context = std::stoi(v);
    } else if (f == "--weight-type") {
      weight_type = v;
    } else {
      return InvalidArgumentError("unknown flag " + f);
    }
  }
  return {};
}

class ModelVariantsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ifstream in("tests/data/model_variants.json");
    ASSERT_TRUE(in) << "tests/data/model_variants.json is missing";
    goldens_ = nlohmann::json::parse(in);
    dir_ = std::filesystem::temp_directory_path() / ("pagekv-variants-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Every position's logits of the goldens' ids through the exact path.
  std::vector<float> AllLogits(const LoadedModel& m) const {
    const std::vector<int32_t> ids = goldens_["ids"].get<std::vector<int32_t>>();
    const int32_t vocab = m.model->config().vocab_size;
    auto cache = KvCache::Create({.config = m.model->CacheGeometry(16, DType::kF32, 16), .prefault = false});
    EXPECT_TRUE(cache.ok());
    const SeqId seq = (*cache)->AddSequence();
    std::vector<float> logits(ids.size() * static_cast<size_t>(vocab));
    ForwardItem item{seq, ids, logits.data(), true};
    EXPECT_TRUE(ForwardStep(*m.model, **cache, {&item, 1}, {.activations = Activations::kF32}).ok());
    return logits;
  }

  nlohmann::json goldens_;
  std::filesystem::path dir_;
};

TEST_F(ModelVariantsTest, EveryVariantMatchesTheReferenceAndDiffersFromThePlainModel) {
  Result<SynthModelSpec> base = FindSynthModelPreset(goldens_["preset"].get<std::string>());
  ASSERT_TRUE(base.ok());
  const auto seed = goldens_["seed"].get<uint64_t>();
  const std::string plain_path = (dir_ / "plain.gguf").string();
  ASSERT_TRUE(WriteSynthModel(*base, seed, "f32", plain_path).ok());
  Result<LoadedModel> plain = LoadModel(plain_path);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  const std::vector<float> plain_logits = AllLogits(*plain);
  const std::vector<int64_t> rows = goldens_["rows"].get<std::vector<int64_t>>();
  int variants = 0;
  for (const auto& v : goldens_["variants"]) {
    const std::string name = v["name"];
    SCOPED_TRACE(name);
    SynthModelSpec spec = *base;
    std::string weight_type = "f32";
    ASSERT_TRUE(ApplyFlags(v["flags"].get<std::vector<std::string>>(), spec, weight_type).ok());
    const std::string path = (dir_ / (name + ".gguf")).string();
    ASSERT_TRUE(WriteSynthModel(spec, seed, weight_type, path).ok());
    ASSERT_EQ(testing::FileSha256Hex(path), v["sha256"].get<std::string>())
        << "the synthetic writer no longer makes the file the goldens came from: rerun tools/make_variant_goldens.py";
    Result<LoadedModel> m = LoadModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const int32_t vocab = m->model->config().vocab_size;
    const std::vector<float> logits = AllLogits(*m);
    double worst = 0, from_plain = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::vector<double> want = v["logits"][r].get<std::vector<double>>();
      ASSERT_EQ(want.size(), static_cast<size_t>(vocab));
      double scale = 1.0;
      for (double x : want) scale = std::max(scale, std::fabs(x));
      for (int32_t t = 0; t < vocab; ++t) {
        const size_t at = static_cast<size_t>(rows[r] * vocab + t);
        worst = std::max(worst, std::fabs(logits[at] - want[static_cast<size_t>(t)]) / scale);
        from_plain = std::max(from_plain, std::fabs(plain_logits[at] - want[static_cast<size_t>(t)]) / scale);
      }
    }
    EXPECT_LE(worst, 1e-4) << "relative to the largest logit of each row";
    // The variant changes the logits (rows past the first, where rotary
    // and scaling act), so a runner that ignored it would fail above.
    EXPECT_GT(from_plain, 1e-2);
    std::printf("%-22s worst relative logit error %.2e (the plain model's: %.2e)\n", name.c_str(), worst, from_plain);
    ++variants;
  }
  EXPECT_GE(variants, 8);
}

// A file asking for a scaling the runner does not implement is refused by
// name before any weight is read.
TEST_F(ModelVariantsTest, AnUnknownRopeScalingIsRefusedByName) {
  Result<SynthModelSpec> spec = FindSynthModelPreset("tiny");
  ASSERT_TRUE(spec.ok());
  spec->rope_scaling = "longrope";
  spec->rope_factor = 2;
  const std::string path = (dir_ / "longrope.gguf").string();
  ASSERT_TRUE(WriteSynthModel(*spec, 1, "f32", path).ok());
  Result<LoadedModel> m = LoadModel(path);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("rope.scaling.type = 'longrope'"), std::string::npos) << m.status().message();
}

}  // namespace
}  // namespace pagekv
