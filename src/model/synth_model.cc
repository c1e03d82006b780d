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
  return presets;
}

Result<SynthModelSpec> FindSynthModelPreset(const std::string& name) {
  std::string names;
  for (const SynthModelSpec& s : SynthModelPresets()) {
    if (s.name == name) return s;
    names += (names.empty() ? "" : ", ") + s.name;
  }
  return InvalidArgumentError("unknown model preset '" + name + "': choose one of " + names);
}

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
  if (s.dim <= 0 || s.num_heads <= 0 || s.num_kv_heads <= 0 || s.dim % s.num_heads != 0 ||
      s.num_heads % s.num_kv_heads != 0 || (s.dim / s.num_heads) % 2 != 0 || s.hidden_dim <= 0 ||
      s.num_layers <= 0 || s.vocab_size < 512 || s.context_len <= 0) {
    return InvalidArgumentError("synthetic model '" + s.name + "' has an inconsistent shape");
  }
  if (type == GgmlType::kQ8_0 && (s.dim % 32 != 0 || s.hidden_dim % 32 != 0)) {
    return InvalidArgumentError("q8_0 needs dim and hidden_dim to be multiples of 32");
  }
  SplitMix64 rng(seed);
  const Vocab vocab = MakeVocab(s.vocab_size, rng);
  GgufWriter w;
  if (s.arch != "llama" && s.arch != "qwen2") {
    return InvalidArgumentError("synthetic model architecture '" + s.arch + "': use llama or qwen2");
  }
  const int32_t head_dim = s.dim / s.num_heads;
  const int32_t rope_dims = s.rope_dims == 0 ? head_dim : s.rope_dims;
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
  w.AddInt(a + "attention.head_count_kv", GgufType::kU32, s.num_kv_heads);
  w.AddFloat(a + "attention.layer_norm_rms_epsilon", 1e-5);
  w.AddFloat(a + "rope.freq_base", 10000.0);
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

  std::vector<float> values;
  std::vector<std::byte> bytes;
  // A [rows][cols] matrix of uniform values with variance 1 / cols, so
  // activations keep their scale through the layers.
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols) {
    values.resize(static_cast<size_t>(rows * cols));
    const float a = std::sqrt(3.0f / static_cast<float>(cols));
    for (float& x : values) x = a * rng.Symmetric();
    const auto n = static_cast<int64_t>(values.size());
    switch (type) {
      case GgmlType::kF32:
        w.AddTensor(name, type, {cols, rows}, values.data(), values.size() * 4);
        return;
      case GgmlType::kF16:
      case GgmlType::kBF16:
        bytes.resize(values.size() * 2);
        for (int64_t i = 0; i < n; ++i) {
          const uint16_t h = type == GgmlType::kF16 ? F32ToF16(values[static_cast<size_t>(i)]) : F32ToBF16(values[static_cast<size_t>(i)]);
          std::memcpy(bytes.data() + 2 * i, &h, 2);
        }
        break;
      case GgmlType::kQ8_0:
        bytes.resize(static_cast<size_t>(n / 32 * 34));
        EncodeQ8_0(values.data(), n, bytes.data());
        break;
      default:
        break;  // the weight type was checked to be one of the four above
    }
    w.AddTensor(name, type, {cols, rows}, bytes.data(), bytes.size());
  };
  auto norm = [&](const std::string& name) {
    values.assign(static_cast<size_t>(s.dim), 1.0f);
    w.AddTensor(name, GgmlType::kF32, {s.dim}, values.data(), values.size() * 4);
  };
  auto vector = [&](const std::string& name, int64_t n, float lo, float hi) {
    values.resize(static_cast<size_t>(n));
    for (float& x : values) x = lo + (hi - lo) * 0.5f * (rng.Symmetric() + 1.0f);
    w.AddTensor(name, GgmlType::kF32, {n}, values.data(), values.size() * 4);
  };
  const int64_t kv = int64_t{s.num_kv_heads} * head_dim;
  matrix("token_embd.weight", s.vocab_size, s.dim);
  if (s.rope_freqs) vector("rope_freqs.weight", rope_dims / 2, 1.0f, 8.0f);
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    norm(p + "attn_norm.weight");
    matrix(p + "attn_q.weight", s.dim, s.dim);
    matrix(p + "attn_k.weight", kv, s.dim);
    matrix(p + "attn_v.weight", kv, s.dim);
    matrix(p + "attn_output.weight", s.dim, s.dim);
    if (s.arch == "qwen2") {
      vector(p + "attn_q.bias", s.dim, -0.5f, 0.5f);
      vector(p + "attn_k.bias", kv, -0.5f, 0.5f);
      vector(p + "attn_v.bias", kv, -0.5f, 0.5f);
    }
    norm(p + "ffn_norm.weight");
    matrix(p + "ffn_gate.weight", s.hidden_dim, s.dim);
    matrix(p + "ffn_up.weight", s.hidden_dim, s.dim);
    matrix(p + "ffn_down.weight", s.dim, s.hidden_dim);
  }
  norm("output_norm.weight");
  if (!s.tied_embeddings) matrix("output.weight", s.vocab_size, s.dim);
  return w.WriteFile(path);
}

}  // namespace pagekv
