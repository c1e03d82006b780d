// Batched generation on the paged cache against a test-only reference
// forward pass: the llama computation written out plainly in double
// precision, one sequence at a time, with K and V kept in contiguous arrays
// per layer (no pool, no blocks, no SIMD, nothing shared with the runner).
// Greedy tokens of eight different prompts generated as one batch must be
// exactly the reference's.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/gguf_file.h"
#include "model/tokenizer.h"
#include "pagekv/generate.h"

namespace pagekv {
namespace {

constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";

class ReferenceLlama {
 public:
  explicit ReferenceLlama(const GgufFile& f) : f_(f) {
    dim_ = *f.GetInt("llama.embedding_length");
    hidden_ = *f.GetInt("llama.feed_forward_length");
    layers_ = *f.GetInt("llama.block_count");
    heads_ = *f.GetInt("llama.attention.head_count");
    kv_heads_ = *f.GetInt("llama.attention.head_count_kv");
    eps_ = *f.GetFloat("llama.attention.layer_norm_rms_epsilon");
    theta_ = f.GetFloat("llama.rope.freq_base").ok() ? *f.GetFloat("llama.rope.freq_base") : 10000.0;
    head_dim_ = dim_ / heads_;
    vocab_ = f.FindTensor("token_embd.weight")->dims[1];
    k_.assign(static_cast<size_t>(layers_), {});
    v_.assign(static_cast<size_t>(layers_), {});
  }

  // Appends one token at the next position; returns its logits.
  std::vector<double> Step(int32_t token) {
    const int64_t pos = static_cast<int64_t>(k_[0].size()) / (kv_heads_ * head_dim_);
    std::vector<double> x = Row("token_embd.weight", token, dim_);
    for (int64_t l = 0; l < layers_; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      std::vector<double> xb = Norm(x, p + "attn_norm.weight");
      std::vector<double> q = Mul(p + "attn_q.weight", xb), k = Mul(p + "attn_k.weight", xb),
                          v = Mul(p + "attn_v.weight", xb);
      Rotate(q, pos);
      Rotate(k, pos);
      auto& K = k_[static_cast<size_t>(l)];
      auto& V = v_[static_cast<size_t>(l)];
      K.insert(K.end(), k.begin(), k.end());
      V.insert(V.end(), v.begin(), v.end());
      std::vector<double> att(static_cast<size_t>(dim_), 0.0);
      const int64_t group = heads_ / kv_heads_, kvd = kv_heads_ * head_dim_;
      for (int64_t h = 0; h < heads_; ++h) {
        const int64_t kh = h / group;
        std::vector<double> s(static_cast<size_t>(pos + 1));
        double mx = -1e300;
        for (int64_t t = 0; t <= pos; ++t) {
          double dot = 0;
          for (int64_t i = 0; i < head_dim_; ++i) dot += q[h * head_dim_ + i] * K[t * kvd + kh * head_dim_ + i];
          s[t] = dot / std::sqrt(static_cast<double>(head_dim_));
          mx = std::max(mx, s[t]);
        }
        double sum = 0;
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int64_t t = 0; t <= pos; ++t) {
          for (int64_t i = 0; i < head_dim_; ++i) att[h * head_dim_ + i] += s[t] / sum * V[t * kvd + kh * head_dim_ + i];
        }
      }
      Add(x, Mul(p + "attn_output.weight", att));
      xb = Norm(x, p + "ffn_norm.weight");
      std::vector<double> g = Mul(p + "ffn_gate.weight", xb), u = Mul(p + "ffn_up.weight", xb);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
      Add(x, Mul(p + "ffn_down.weight", g));
    }
    const char* out = f_.FindTensor("output.weight") != nullptr ? "output.weight" : "token_embd.weight";
    return Mul(out, Norm(x, "output_norm.weight"));
  }

 private:
  const float* Data(const std::string& name) const {
    const GgufTensor* t = f_.FindTensor(name);
    EXPECT_TRUE(t != nullptr && t->type == GgmlType::kF32) << name;
    return reinterpret_cast<const float*>(t->data);
  }
  std::vector<double> Row(const std::string& name, int64_t r, int64_t n) const {
    const float* w = Data(name) + r * n;
    return std::vector<double>(w, w + n);
  }
  std::vector<double> Mul(const std::string& name, const std::vector<double>& x) const {
    const GgufTensor* t = f_.FindTensor(name);
    const int64_t cols = t->dims[0], rows = t->dims[1];
    const float* w = Data(name);
    std::vector<double> y(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) y[r] += double{w[r * cols + c]} * x[c];
    }
    return y;
  }
  std::vector<double> Norm(const std::vector<double>& x, const std::string& weight) const {
    double ss = 0;
    for (double e : x) ss += e * e;
    const double s = 1 / std::sqrt(ss / static_cast<double>(x.size()) + eps_);
    const float* w = Data(weight);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = w[i] * s * x[i];
    return y;
  }
  void Rotate(std::vector<double>& v, int64_t pos) const {
    for (size_t i = 0; i < v.size(); i += 2) {
      const double freq = std::pow(theta_, -static_cast<double>(i % static_cast<size_t>(head_dim_)) / static_cast<double>(head_dim_));
      const double c = std::cos(static_cast<double>(pos) * freq), s = std::sin(static_cast<double>(pos) * freq);
      const double a = v[i], b = v[i + 1];
      v[i] = a * c - b * s;
      v[i + 1] = a * s + b * c;
    }
  }
  static void Add(std::vector<double>& x, const std::vector<double>& y) {
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  }

  const GgufFile& f_;
  int64_t dim_, hidden_, layers_, heads_, kv_heads_, head_dim_, vocab_;
  double eps_, theta_;
  std::vector<std::vector<double>> k_, v_;  // per layer: [tokens][kv_heads][head_dim]
};

TEST(ReferenceForwardTest, ABatchOfEightMatchesTheContiguousReference) {
  const std::vector<std::string> prompts = {
      "Once upon a time", "Once upon a time there was a dog", "The little cat", "Lily and Ben went to the park",
      "One day, a boy", "Once upon a time, in a big forest", "Tom had a red ball", ""};
  constexpr int32_t kNew = 24;
  GenerateOptions o;
  o.model_path = kGguf;
  o.prompts = prompts;
  o.max_new_tokens = kNew;
  o.block_len = 16;
  Result<GenerateReport> batch = Generate(o);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();

  auto file = GgufFile::Open(kGguf);
  ASSERT_TRUE(file.ok());
  auto tok = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tok.ok());
  for (size_t i = 0; i < prompts.size(); ++i) {
    ReferenceLlama ref(**file);
    const std::vector<int32_t> ids = tok->Encode(prompts[i], true, false);
    ASSERT_EQ(ids, batch->outputs[i].prompt_ids);
    std::vector<double> logits;
    for (int32_t t : ids) logits = ref.Step(t);
    std::vector<int32_t> generated;
    for (int32_t k = 0; k < kNew; ++k) {
      const auto next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      generated.push_back(next);
      if (k + 1 < kNew) logits = ref.Step(next);
    }
    EXPECT_EQ(batch->outputs[i].generated_ids, generated) << "prompt " << i << " '" << prompts[i] << "'";
  }
}

}  // namespace
}  // namespace pagekv
