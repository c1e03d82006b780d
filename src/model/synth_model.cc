// Synthetic llama checkpoints (include/pagekv/synth_model.h).
#include "pagekv/synth_model.h"

#include <cmath>
#include <cstring>
#include <set>

#include "layout/float16.h"
#include "model/gguf_file.h"

namespace pagekv {
namespace {

// splitmix64: a tiny generator whose output is fixed by its definition, so
// the same seed gives the same model on every platform and standard library.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float Symmetric() { return static_cast<float>(static_cast<double>(Next() >> 40) / 8388608.0 - 1.0); }

 private:
  uint64_t state_;
};

struct Vocab {
  std::vector<std::string> pieces;
  std::vector<float> scores;
  std::vector<int32_t> types;  // SentencePiece: 1 normal, 2 unknown, 3 control, 6 byte
};

Vocab MakeVocab(int32_t size, SplitMix64& rng) {
  Vocab v;
  auto add = [&](std::string piece, float score, int32_t type) {
    v.pieces.push_back(std::move(piece));
    v.scores.push_back(score);
    v.types.push_back(type);
  };
  add("<unk>", 0, 2);
  add("<s>", 0, 3);
  add("</s>", 0, 3);
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
    add(hex, 0, 6);
  }
  std::set<std::string> seen;
  for (char c = 32; c < 127; ++c) {
    const std::string piece = c == ' ' ? "\u2581" : std::string(1, c);
    seen.insert(piece);
    add(piece, -1000.0f, 1);
  }
  while (static_cast<int32_t>(v.pieces.size()) < size) {
    const int len = 2 + static_cast<int>(rng.Next() % 7);
    std::string piece = rng.Next() % 2 == 0 ? "\u2581" : "";
    for (int i = 0; i < len; ++i) piece.push_back(static_cast<char>('a' + rng.Next() % 26));
    if (seen.insert(piece).second) add(piece, static_cast<float>(len) - static_cast<float>(v.pieces.size()) * 1e-4f, 1);
  }
  return v;
}

}  // namespace

int64_t SynthModelSpec::ParameterCount() const {
  const int64_t d = dim, kv = int64_t{num_kv_heads} * (dim / num_heads);
  if (arch == "deepseek2") {
    const int64_t H = num_heads, qk = qk_nope_dim + qk_rope_dim, rank = kv_lora_rank;
    int64_t attn = (q_lora_rank > 0 ? q_lora_rank * d + q_lora_rank + H * qk * q_lora_rank : H * qk * d) +
                   (rank + qk_rope_dim) * d + rank + H * rank * (qk_nope_dim + v_head_dim) + d * H * v_head_dim;
    const int64_t dense = 3 * d * hidden_dim;
    const int64_t moe = num_experts * d + (expert_probs_bias ? num_experts : 0) +
                        3 * d * expert_hidden_dim * (num_experts + shared_experts);
    return int64_t{vocab_size} * d * (tied_embeddings ? 1 : 2) + d +
           num_layers * (attn + 2 * d) + leading_dense_layers * dense + (num_layers - leading_dense_layers) * moe;
  }
  if (arch == "gemma3") {
    const int64_t q = int64_t{num_heads} * head_dim, kvg = int64_t{num_kv_heads} * head_dim;
    const int64_t layer = 4 * d + 2 * head_dim + 2 * q * d + 2 * kvg * d + 3 * d * hidden_dim;
    return int64_t{vocab_size} * d * (tied_embeddings ? 1 : 2) + num_layers * layer + d;
  }
  const int64_t layer = 2 * d + d * d * 2 + 2 * kv * d + 3 * d * hidden_dim;
  return int64_t{vocab_size} * d * (tied_embeddings ? 1 : 2) + num_layers * layer + d;
}

const std::vector<SynthModelSpec>& SynthModelPresets() {
  static const std::vector<SynthModelSpec> presets = {
      {"tiny", 64, 160, 2, 4, 2, 512, 512, true},
      {"llama-110m", 768, 2560, 12, 12, 4, 32000, 2048, true},
      {"tiny-16k", 64, 160, 2, 4, 2, 512, 16384, true},
      {"small-16k", 256, 768, 2, 4, 2, 32000, 16384, true},
      {"micro-16k", 32, 64, 1, 2, 1, 512, 16384, true},
  };
  static const std::vector<SynthModelSpec> all = [] {
    std::vector<SynthModelSpec> out = presets;
    SynthModelSpec ds{"tiny-deepseek2", 64, 160, 3, 4, 1, 512, 512, false};
    ds.arch = "deepseek2";
    ds.q_lora_rank = 32;
    ds.kv_lora_rank = 64;
    ds.qk_nope_dim = 32;
    ds.qk_rope_dim = 16;
    ds.v_head_dim = 32;
    ds.leading_dense_layers = 1;
    ds.num_experts = 4;
    ds.experts_used = 2;
    ds.expert_hidden_dim = 32;
    ds.shared_experts = 1;
    ds.expert_groups = 2;
    ds.expert_groups_used = 1;
    ds.expert_sigmoid = true;
    ds.expert_probs_bias = true;
    ds.expert_weights_norm = true;
    ds.expert_weights_scale = 2.5;
    ds.rope_scaling = "yarn";
    ds.rope_factor = 4.0;
    ds.rope_orig_context = 128;
    ds.yarn_log_multiplier = 0.0707;
    out.push_back(ds);
    SynthModelSpec lite = ds;
    lite.name = "tiny-deepseek2-lite";
    lite.q_lora_rank = 0;
    lite.legacy_kv_b = true;
    lite.expert_groups = lite.expert_groups_used = 0;
    lite.expert_sigmoid = lite.expert_probs_bias = lite.expert_weights_norm = false;
    lite.expert_weights_scale = 1.0;
    lite.rope_scaling.clear();
    lite.rope_factor = 1.0;
    lite.rope_orig_context = 0;
    lite.yarn_log_multiplier = 0.0;
    lite.tied_embeddings = true;
    out.push_back(lite);
    // small-16k's hidden size and depth with DeepSeek-V2-Lite's attention
    // ratios (latent rank = 2 x the per-head size, rope = half of it): the
    // serving comparison of a latent cache with a GQA one.
    SynthModelSpec gemma{"tiny-gemma3", 64, 160, 6, 4, 1, 512, 2048, true};
    gemma.arch = "gemma3";
    gemma.head_dim = 32;
    gemma.sliding_window = 32;
    gemma.sliding_pattern = 3;
    out.push_back(gemma);
    // Gemma 3's pattern at small-16k's width for serving traces: 6 layers,
    // 5 sliding over 1024 tokens, 1 full.
    SynthModelSpec gemma16k{"small-gemma3-16k", 256, 768, 6, 4, 1, 32000, 16384, true};
    gemma16k.arch = "gemma3";
    gemma16k.head_dim = 64;
    gemma16k.sliding_window = 1024;
    gemma16k.sliding_pattern = 6;
    out.push_back(gemma16k);
    SynthModelSpec small{"small-deepseek2-16k", 256, 768, 2, 4, 1, 32000, 16384, true};
    small.arch = "deepseek2";
    small.kv_lora_rank = 128;
    small.qk_nope_dim = 64;
    small.qk_rope_dim = 32;
    small.v_head_dim = 64;
    small.legacy_kv_b = false;
    small.leading_dense_layers = 1;
    small.num_experts = 4;
    small.experts_used = 2;
    small.expert_hidden_dim = 256;
    small.shared_experts = 1;
    out.push_back(small);
    return out;
  }();
  return all;
}

Result<SynthModelSpec> FindSynthModelPreset(const std::string& name) {
  std::string names;
  for (const SynthModelSpec& s : SynthModelPresets()) {
    if (s.name == name) return s;
    names += (names.empty() ? "" : ", ") + s.name;
  }
  return InvalidArgumentError("unknown model preset '" + name + "': choose one of " + names);
}

namespace {

// Writes random tensors of one weight type (norms and vectors in f32).
class TensorWriter {
 public:
  TensorWriter(GgufWriter& w, SplitMix64& rng, GgmlType type) : w_(w), rng_(rng), type_(type) {}

  // `count` [rows][cols] matrices (a 3-D tensor {cols, rows, count} when
  // count > 1) of uniform values with variance 1 / cols, so activations
  // keep their scale through the layers.
  void Matrix(const std::string& name, int64_t rows, int64_t cols, int64_t count = 1) {
    values_.resize(static_cast<size_t>(rows * cols * count));
    const float a = std::sqrt(3.0f / static_cast<float>(cols));
    for (float& x : values_) x = a * rng_.Symmetric();
    const auto n = static_cast<int64_t>(values_.size());
    std::vector<int64_t> dims = {cols, rows};
    if (count > 1) dims.push_back(count);
    switch (type_) {
      case GgmlType::kF32:
        w_.AddTensor(name, type_, dims, values_.data(), values_.size() * 4);
        return;
      case GgmlType::kF16:
      case GgmlType::kBF16:
        bytes_.resize(values_.size() * 2);
        for (int64_t i = 0; i < n; ++i) {
          const float v = values_[static_cast<size_t>(i)];
          const uint16_t h = type_ == GgmlType::kF16 ? F32ToF16(v) : F32ToBF16(v);
          std::memcpy(bytes_.data() + 2 * i, &h, 2);
        }
        break;
      case GgmlType::kQ8_0:
        bytes_.resize(static_cast<size_t>(n / 32 * 34));
        EncodeQ8_0(values_.data(), n, bytes_.data());
        break;
      default:
        break;  // the weight type was checked to be one of the four above
    }
    w_.AddTensor(name, type_, dims, bytes_.data(), bytes_.size());
  }
  void Ones(const std::string& name, int64_t n) {
    values_.assign(static_cast<size_t>(n), 1.0f);
    w_.AddTensor(name, GgmlType::kF32, {n}, values_.data(), values_.size() * 4);
  }
  void Vector(const std::string& name, int64_t n, float lo, float hi) {
    values_.resize(static_cast<size_t>(n));
    for (float& x : values_) x = lo + (hi - lo) * 0.5f * (rng_.Symmetric() + 1.0f);
    w_.AddTensor(name, GgmlType::kF32, {n}, values_.data(), values_.size() * 4);
  }

 private:
  GgufWriter& w_;
  SplitMix64& rng_;
  GgmlType type_;
  std::vector<float> values_;
  std::vector<std::byte> bytes_;
};

Status CheckDeepseekShape(const SynthModelSpec& s, GgmlType type) {
  if (s.kv_lora_rank <= 0 || s.qk_nope_dim <= 0 || s.qk_rope_dim <= 0 || s.qk_rope_dim % 2 != 0 ||
      s.v_head_dim <= 0 || s.q_lora_rank < 0 || s.leading_dense_layers < 0 || s.leading_dense_layers > s.num_layers ||
      (s.leading_dense_layers < s.num_layers &&
       (s.num_experts <= 0 || s.experts_used <= 0 || s.experts_used > s.num_experts || s.expert_hidden_dim <= 0))) {
    return InvalidArgumentError("synthetic deepseek2 model '" + s.name + "' has an inconsistent shape");
  }
  if (type == GgmlType::kQ8_0) {
    for (int32_t cols : {s.qk_nope_dim, s.kv_lora_rank, s.q_lora_rank, s.num_heads * s.v_head_dim, s.expert_hidden_dim}) {
      if (cols % 32 != 0) {
        return InvalidArgumentError("q8_0 needs every matrix's row (nope, rank, q LoRA, heads x v, expert width) to be a "
                                    "multiple of 32");
      }
    }
  }
  return Status::Ok();
}

void AddDeepseekMetadata(const SynthModelSpec& s, GgufWriter& w) {
  const std::string a = "deepseek2.";
  const int32_t qk = s.qk_nope_dim + s.qk_rope_dim;
  if (s.legacy_kv_b) {
    w.AddInt(a + "attention.head_count_kv", GgufType::kU32, s.num_heads);
    w.AddInt(a + "attention.key_length", GgufType::kU32, qk);
    w.AddInt(a + "attention.value_length", GgufType::kU32, s.v_head_dim);
  } else {
    w.AddInt(a + "attention.head_count_kv", GgufType::kU32, 1);
    w.AddInt(a + "attention.key_length", GgufType::kU32, s.kv_lora_rank + s.qk_rope_dim);
    w.AddInt(a + "attention.value_length", GgufType::kU32, s.kv_lora_rank);
    w.AddInt(a + "attention.key_length_mla", GgufType::kU32, qk);
    w.AddInt(a + "attention.value_length_mla", GgufType::kU32, s.v_head_dim);
  }
  if (s.q_lora_rank > 0) w.AddInt(a + "attention.q_lora_rank", GgufType::kU32, s.q_lora_rank);
  w.AddInt(a + "attention.kv_lora_rank", GgufType::kU32, s.kv_lora_rank);
  w.AddInt(a + "leading_dense_block_count", GgufType::kU32, s.leading_dense_layers);
  if (s.leading_dense_layers < s.num_layers) {
    w.AddInt(a + "expert_count", GgufType::kU32, s.num_experts);
    w.AddInt(a + "expert_used_count", GgufType::kU32, s.experts_used);
    w.AddInt(a + "expert_feed_forward_length", GgufType::kU32, s.expert_hidden_dim);
    w.AddInt(a + "expert_shared_count", GgufType::kU32, s.shared_experts);
    w.AddFloat(a + "expert_weights_scale", s.expert_weights_scale);
    w.AddInt(a + "expert_weights_norm", GgufType::kBool, s.expert_weights_norm ? 1 : 0);
    w.AddInt(a + "expert_gating_func", GgufType::kU32, s.expert_sigmoid ? 2 : 1);
    if (s.expert_groups > 0) {
      w.AddInt(a + "expert_group_count", GgufType::kU32, s.expert_groups);
      w.AddInt(a + "expert_group_used_count", GgufType::kU32, s.expert_groups_used);
    }
  }
  if (s.yarn_log_multiplier != 0.0) w.AddFloat(a + "rope.scaling.yarn_log_multiplier", s.yarn_log_multiplier);
}

void AddDeepseekLayer(const SynthModelSpec& s, int32_t l, TensorWriter& t) {
  const std::string p = "blk." + std::to_string(l) + ".";
  const int64_t H = s.num_heads, qk = s.qk_nope_dim + s.qk_rope_dim, rank = s.kv_lora_rank;
  t.Ones(p + "attn_norm.weight", s.dim);
  if (s.q_lora_rank > 0) {
    t.Matrix(p + "attn_q_a.weight", s.q_lora_rank, s.dim);
    t.Vector(p + "attn_q_a_norm.weight", s.q_lora_rank, 0.8f, 1.2f);
    t.Matrix(p + "attn_q_b.weight", H * qk, s.q_lora_rank);
  } else {
    t.Matrix(p + "attn_q.weight", H * qk, s.dim);
  }
  t.Matrix(p + "attn_kv_a_mqa.weight", rank + s.qk_rope_dim, s.dim);
  t.Vector(p + "attn_kv_a_norm.weight", rank, 0.8f, 1.2f);
  if (s.legacy_kv_b) {
    t.Matrix(p + "attn_kv_b.weight", H * (s.qk_nope_dim + s.v_head_dim), rank);
  } else {
    t.Matrix(p + "attn_k_b.weight", rank, s.qk_nope_dim, H);
    t.Matrix(p + "attn_v_b.weight", s.v_head_dim, rank, H);
  }
  t.Matrix(p + "attn_output.weight", s.dim, H * s.v_head_dim);
  t.Ones(p + "ffn_norm.weight", s.dim);
  if (l < s.leading_dense_layers) {
    t.Matrix(p + "ffn_gate.weight", s.hidden_dim, s.dim);
    t.Matrix(p + "ffn_up.weight", s.hidden_dim, s.dim);
    t.Matrix(p + "ffn_down.weight", s.dim, s.hidden_dim);
    return;
  }
  t.Matrix(p + "ffn_gate_inp.weight", s.num_experts, s.dim);
  if (s.expert_probs_bias) t.Vector(p + "exp_probs_b.bias", s.num_experts, -0.1f, 0.1f);
  t.Matrix(p + "ffn_gate_exps.weight", s.expert_hidden_dim, s.dim, s.num_experts);
  t.Matrix(p + "ffn_up_exps.weight", s.expert_hidden_dim, s.dim, s.num_experts);
  t.Matrix(p + "ffn_down_exps.weight", s.dim, s.expert_hidden_dim, s.num_experts);
  if (s.shared_experts > 0) {
    const int64_t sff = int64_t{s.expert_hidden_dim} * s.shared_experts;
    t.Matrix(p + "ffn_gate_shexp.weight", sff, s.dim);
    t.Matrix(p + "ffn_up_shexp.weight", sff, s.dim);
    t.Matrix(p + "ffn_down_shexp.weight", s.dim, sff);
  }
}

}  // namespace

Status WriteSynthModel(const SynthModelSpec& s, uint64_t seed, const std::string& weight_type,
                       const std::string& path) {
  GgmlType type;
  if (weight_type == "f32") {
    type = GgmlType::kF32;
  } else if (weight_type == "f16") {
    type = GgmlType::kF16;
  } else if (weight_type == "bf16") {
    type = GgmlType::kBF16;
  } else if (weight_type == "q8_0") {
    type = GgmlType::kQ8_0;
  } else {
    return InvalidArgumentError("weight type '" + weight_type + "': use f32, f16, bf16 or q8_0");
  }
  if (s.arch != "llama" && s.arch != "qwen2" && s.arch != "deepseek2" && s.arch != "gemma3") {
    return InvalidArgumentError("synthetic model architecture '" + s.arch + "': use llama, qwen2, deepseek2 or gemma3");
  }
  const bool deepseek = s.arch == "deepseek2";
  const bool gemma = s.arch == "gemma3";
  if (s.dim <= 0 || s.num_heads <= 0 || s.hidden_dim <= 0 || s.num_layers <= 0 || s.vocab_size < 512 ||
      s.context_len <= 0 ||
      (!deepseek && !gemma && (s.num_kv_heads <= 0 || s.dim % s.num_heads != 0 || s.num_heads % s.num_kv_heads != 0 ||
                               (s.dim / s.num_heads) % 2 != 0)) ||
      (gemma && (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0 || s.head_dim <= 0 || s.head_dim % 2 != 0 ||
                 s.sliding_window < 0 || s.sliding_pattern < 0))) {
    return InvalidArgumentError("synthetic model '" + s.name + "' has an inconsistent shape");
  }
  if (type == GgmlType::kQ8_0 && (s.dim % 32 != 0 || s.hidden_dim % 32 != 0)) {
    return InvalidArgumentError("q8_0 needs dim and hidden_dim to be multiples of 32");
  }
  if (deepseek) PAGEKV_RETURN_IF_ERROR(CheckDeepseekShape(s, type));
  SplitMix64 rng(seed);
  const Vocab vocab = MakeVocab(s.vocab_size, rng);
  GgufWriter w;
  const int32_t head_dim = deepseek ? s.qk_nope_dim + s.qk_rope_dim : gemma ? s.head_dim : s.dim / s.num_heads;
  const int32_t rope_dims = deepseek ? s.qk_rope_dim : s.rope_dims == 0 ? head_dim : s.rope_dims;
  if (rope_dims <= 0 || rope_dims > head_dim || rope_dims % 2 != 0) {
    return InvalidArgumentError("synthetic model rope_dims must be even and at most the head size");
  }
  const std::string a = s.arch + ".";
  w.AddString("general.architecture", s.arch);
  w.AddString("general.name", "pagekv-synthetic-" + s.name);
  w.AddInt("general.file_type", GgufType::kU32, type == GgmlType::kF32 ? 0 : type == GgmlType::kF16 ? 1 : type == GgmlType::kQ8_0 ? 7 : 32);
  w.AddInt(a + "context_length", GgufType::kU32, s.context_len);
  w.AddInt(a + "embedding_length", GgufType::kU32, s.dim);
  w.AddInt(a + "block_count", GgufType::kU32, s.num_layers);
  w.AddInt(a + "feed_forward_length", GgufType::kU32, s.hidden_dim);
  w.AddInt(a + "rope.dimension_count", GgufType::kU32, rope_dims);
  w.AddInt(a + "attention.head_count", GgufType::kU32, s.num_heads);
  if (deepseek) {
    AddDeepseekMetadata(s, w);
  } else {
    w.AddInt(a + "attention.head_count_kv", GgufType::kU32, s.num_kv_heads);
  }
  if (gemma) {
    w.AddInt(a + "attention.key_length", GgufType::kU32, head_dim);
    w.AddInt(a + "attention.value_length", GgufType::kU32, head_dim);
    w.AddInt(a + "attention.sliding_window", GgufType::kU32, s.sliding_window);
    if (s.sliding_pattern > 0) w.AddInt(a + "attention.sliding_window_pattern", GgufType::kU32, s.sliding_pattern);
    w.AddInt("tokenizer.ggml.add_space_prefix", GgufType::kBool, 0);
  }
  w.AddFloat(a + "attention.layer_norm_rms_epsilon", 1e-5);
  w.AddFloat(a + "rope.freq_base", gemma ? 1e6 : 10000.0);
  if (!s.rope_scaling.empty()) {
    w.AddString(a + "rope.scaling.type", s.rope_scaling);
    w.AddFloat(a + "rope.scaling.factor", s.rope_factor);
    if (s.rope_orig_context > 0) w.AddInt(a + "rope.scaling.original_context_length", GgufType::kU32, s.rope_orig_context);
  }
  w.AddString("tokenizer.ggml.model", "llama");
  w.AddStringArray("tokenizer.ggml.tokens", vocab.pieces);
  w.AddFloatArray("tokenizer.ggml.scores", vocab.scores);
  w.AddIntArray("tokenizer.ggml.token_type", vocab.types);
  w.AddInt("tokenizer.ggml.bos_token_id", GgufType::kU32, 1);
  w.AddInt("tokenizer.ggml.eos_token_id", GgufType::kU32, 2);

  TensorWriter t(w, rng, type);
  const int64_t kv = int64_t{s.num_kv_heads} * head_dim;
  t.Matrix("token_embd.weight", s.vocab_size, s.dim);
  if (s.rope_freqs) t.Vector("rope_freqs.weight", rope_dims / 2, 1.0f, 8.0f);
  for (int32_t l = 0; l < s.num_layers; ++l) {
    if (deepseek) {
      AddDeepseekLayer(s, l, t);
      continue;
    }
    const std::string p = "blk." + std::to_string(l) + ".";
    if (gemma) {
      const int64_t q = int64_t{s.num_heads} * head_dim;
      t.Vector(p + "attn_norm.weight", s.dim, 0.5f, 1.5f);
      t.Matrix(p + "attn_q.weight", q, s.dim);
      t.Matrix(p + "attn_k.weight", kv, s.dim);
      t.Matrix(p + "attn_v.weight", kv, s.dim);
      t.Vector(p + "attn_q_norm.weight", head_dim, 0.5f, 1.5f);
      t.Vector(p + "attn_k_norm.weight", head_dim, 0.5f, 1.5f);
      t.Matrix(p + "attn_output.weight", s.dim, q);
      t.Vector(p + "post_attention_norm.weight", s.dim, 0.5f, 1.5f);
      t.Vector(p + "ffn_norm.weight", s.dim, 0.5f, 1.5f);
      t.Matrix(p + "ffn_gate.weight", s.hidden_dim, s.dim);
      t.Matrix(p + "ffn_up.weight", s.hidden_dim, s.dim);
      t.Matrix(p + "ffn_down.weight", s.dim, s.hidden_dim);
      t.Vector(p + "post_ffw_norm.weight", s.dim, 0.5f, 1.5f);
      continue;
    }
    t.Ones(p + "attn_norm.weight", s.dim);
    t.Matrix(p + "attn_q.weight", s.dim, s.dim);
    t.Matrix(p + "attn_k.weight", kv, s.dim);
    t.Matrix(p + "attn_v.weight", kv, s.dim);
    t.Matrix(p + "attn_output.weight", s.dim, s.dim);
    if (s.arch == "qwen2") {
      t.Vector(p + "attn_q.bias", s.dim, -0.5f, 0.5f);
      t.Vector(p + "attn_k.bias", kv, -0.5f, 0.5f);
      t.Vector(p + "attn_v.bias", kv, -0.5f, 0.5f);
    }
    t.Ones(p + "ffn_norm.weight", s.dim);
    t.Matrix(p + "ffn_gate.weight", s.hidden_dim, s.dim);
    t.Matrix(p + "ffn_up.weight", s.hidden_dim, s.dim);
    t.Matrix(p + "ffn_down.weight", s.dim, s.hidden_dim);
  }
  t.Ones("output_norm.weight", s.dim);
  if (!s.tied_embeddings) t.Matrix("output.weight", s.vocab_size, s.dim);
  return w.WriteFile(path);
}

}  // namespace pagekv
