// DeepseekModel (deepseek_model.h): loading the deepseek2 GGUF and its
// forward pass over the latent cache.
#include "model/deepseek_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "base/thread_pool.h"
#include "model/model_internal.h"
#include "pagekv/attention.h"

namespace pagekv {

using model_internal::ForRows;
using model_internal::ReadDim;
using model_internal::Scratch;
using model_internal::Stopwatch;

namespace {

constexpr std::string_view kKnownKeys[] = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length", "attention.value_length",
    "attention.key_length_mla", "attention.value_length_mla", "attention.q_lora_rank", "attention.kv_lora_rank",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier",
    "rope.scaling.finetuned", "leading_dense_block_count", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_count", "expert_weights_scale", "expert_weights_norm",
    "expert_gating_func", "expert_group_count", "expert_group_used_count", "nextn_predict_layers", "vocab_size",
    "tensor_data_layout",
};

bool KnownTensor(const std::string& name, int32_t layers) {
  static constexpr std::string_view kGlobal[] = {"token_embd.weight", "output_norm.weight", "output.weight"};
  if (model_internal::KeyIn(name, kGlobal)) return true;
  static constexpr std::string_view kParts[] = {
      "attn_norm.weight", "attn_q.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight",
      "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_kv_b.weight", "attn_k_b.weight", "attn_v_b.weight",
      "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
      "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_exps.weight",
      "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"};
  return model_internal::KeyIn(model_internal::LayerPart(name, layers), kParts);
}

// YaRN's magnitude correction as llama.cpp and Hugging Face define it.
double GetMscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

}  // namespace

Result<std::unique_ptr<DeepseekModel>> DeepseekModel::FromGguf(std::unique_ptr<GgufFile> file) {
  PAGEKV_ASSIGN_OR_RETURN(std::string arch, file->GetString("general.architecture"));
  if (arch != "deepseek2") {
    return InvalidArgumentError("model metadata general.architecture = '" + arch + "': the deepseek2 runner reads deepseek2");
  }
  auto m = std::unique_ptr<DeepseekModel>(new DeepseekModel());
  PAGEKV_RETURN_IF_ERROR(m->ReadCommonMetadata(std::move(file), kKnownKeys));
  const GgufFile& f = *m->file_;
  ModelConfig& c = m->config_;
  const std::string a = arch + ".";
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.kv_lora_rank", c.kv_lora_rank));
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.q_lora_rank", c.q_lora_rank, false));
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "rope.dimension_count", c.qk_rope_dim));
  if (c.qk_rope_dim % 2 != 0) {
    return DataLossError("model metadata " + a + "rope.dimension_count = " + std::to_string(c.qk_rope_dim) + " is odd");
  }
  int32_t key_length = 0, value_length = 0, kv_heads = 0;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.key_length", key_length));
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.value_length", value_length));
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.head_count_kv", kv_heads, false));
  const bool split_kv_b = f.Find(a + "attention.key_length_mla") != nullptr;
  int32_t head_k = key_length;
  c.v_head_dim = value_length;
  if (split_kv_b) {
    // llama.cpp's MLA conversion: key / value lengths describe the latent
    // row, the *_mla ones the per-head sizes.
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.key_length_mla", head_k));
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.value_length_mla", c.v_head_dim));
    if (key_length != c.kv_lora_rank + c.qk_rope_dim || value_length != c.kv_lora_rank || (kv_heads != 0 && kv_heads != 1)) {
      return DataLossError("model metadata " + a + "attention.key_length / value_length / head_count_kv = " +
                           std::to_string(key_length) + " / " + std::to_string(value_length) + " / " +
                           std::to_string(kv_heads) + " do not describe the latent row (expected kv_lora_rank + rope = " +
                           std::to_string(c.kv_lora_rank + c.qk_rope_dim) + ", kv_lora_rank, 1)");
    }
  } else if (kv_heads != 0 && kv_heads != c.num_heads) {
    return DataLossError("model metadata " + a + "attention.head_count_kv = " + std::to_string(kv_heads) +
                         " differs from head_count in a file with attn_kv_b (per-head keys and values)");
  }
  c.qk_nope_dim = head_k - c.qk_rope_dim;
  if (c.qk_nope_dim < 1) {
    return DataLossError("model metadata: key length " + std::to_string(head_k) + " leaves no non-rotary part beside " +
                         std::to_string(c.qk_rope_dim) + " rotary dimensions");
  }
  c.head_dim = head_k;
  c.num_kv_heads = 1;
  c.rope_dims = c.qk_rope_dim;
  // Feed-forward: leading dense layers, then experts.
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "leading_dense_block_count", c.leading_dense_layers, false));
  c.leading_dense_layers = std::min(c.leading_dense_layers, c.num_layers);
  if (c.leading_dense_layers > 0) PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "feed_forward_length", c.hidden_dim));
  if (c.leading_dense_layers < c.num_layers) {
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "expert_count", c.num_experts));
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "expert_used_count", c.experts_used));
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "expert_feed_forward_length", c.expert_hidden_dim));
    if (Result<int64_t> v = f.GetInt(a + "expert_shared_count"); v.ok()) {
      if (*v < 0 || *v > 64) return DataLossError("model metadata " + a + "expert_shared_count = " + std::to_string(*v) + " is out of range");
      c.shared_experts = static_cast<int32_t>(*v);
    }
    if (c.experts_used > c.num_experts) {
      return DataLossError("model metadata " + a + "expert_used_count = " + std::to_string(c.experts_used) +
                           " exceeds expert_count = " + std::to_string(c.num_experts));
    }
    if (Result<double> s = f.GetFloat(a + "expert_weights_scale"); s.ok() && *s != 0.0) c.expert_weights_scale = static_cast<float>(*s);
    if (const GgufValue* v = f.Find(a + "expert_weights_norm"); v != nullptr) {
      PAGEKV_ASSIGN_OR_RETURN(c.expert_weights_norm, f.GetBool(a + "expert_weights_norm"));
    }
    if (Result<int64_t> g = f.GetInt(a + "expert_gating_func"); g.ok()) {
      if (*g != 1 && *g != 2) {
        return UnimplementedError("model metadata " + a + "expert_gating_func = " + std::to_string(*g) +
                                  " is not supported: PageKV implements 1 (softmax) and 2 (sigmoid)");
      }
      c.expert_sigmoid = *g == 2;
    }
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "expert_group_count", c.expert_groups, false));
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "expert_group_used_count", c.expert_groups_used, false));
    if (c.expert_groups > 1) {
      if (c.num_experts % c.expert_groups != 0 || c.num_experts / c.expert_groups < 2 || c.expert_groups_used < 1 ||
          c.expert_groups_used > c.expert_groups ||
          c.experts_used > c.expert_groups_used * (c.num_experts / c.expert_groups)) {
        return DataLossError("model metadata " + a + "expert_group_count = " + std::to_string(c.expert_groups) +
                             " / expert_group_used_count = " + std::to_string(c.expert_groups_used) +
                             " do not fit " + std::to_string(c.num_experts) + " experts of which " +
                             std::to_string(c.experts_used) + " are used (groups of two or more experts that divide "
                             "the count, enough groups used to hold the chosen experts)");
      }
    }
  }
  if (Result<int64_t> n = f.GetInt(a + "nextn_predict_layers"); n.ok() && *n != 0) {
    return UnimplementedError("model metadata " + a + "nextn_predict_layers = " + std::to_string(*n) +
                              ": multi-token-prediction layers are not supported; convert the model without them");
  }
  // Rope and the attention scale (llama.cpp's deepseek2 graph: YaRN's
  // magnitude goes into the logits' scale squared, the rope tables keep
  // mscale / mscale_all_dim).
  PAGEKV_RETURN_IF_ERROR(m->ReadRopeScaling(a));
  if (c.rope_scaling != ModelConfig::RopeScaling::kNone && c.rope_scaling != ModelConfig::RopeScaling::kYarn) {
    return UnimplementedError("model metadata " + a + "rope.scaling.type: the deepseek2 runner implements none and yarn");
  }
  if (Result<double> lm = f.GetFloat(a + "rope.scaling.yarn_log_multiplier"); lm.ok()) {
    c.rope_yarn_log_mul = static_cast<float>(*lm / 0.1);  // the converter stores 0.1 * mscale_all_dim
  }
  double attn_factor = 1.0;  // what multiplies the rope tables
  double mscale = 1.0;       // what the logits' scale is multiplied by, squared
  if (c.rope_scaling == ModelConfig::RopeScaling::kYarn) {
    if (f.Find(a + "rope.scaling.yarn_log_multiplier") == nullptr) {
      // Without mscale_all_dim, llama.cpp squares YaRN's magnitude into the
      // logits' scale on top of the rope tables' and Hugging Face's
      // DeepSeek code leaves the scale alone: no file of the real models
      // lacks the key, so neither reading is guessed.
      return UnimplementedError("model metadata " + a + "rope.scaling.type = yarn without " + a +
                                "rope.scaling.yarn_log_multiplier: DeepSeek's attention scale needs mscale_all_dim; "
                                "convert the model with it");
    }
    const double s = 1.0 / c.rope_freq_scale, log_mul = c.rope_yarn_log_mul;
    const double ratio = log_mul != 0.0 ? GetMscale(s, log_mul != 1.0 ? log_mul : 1.0) / GetMscale(s, log_mul)
                                        : GetMscale(s, 1.0);
    attn_factor = ratio * c.rope_attn_factor;
    mscale = attn_factor * (1.0 + 0.1 * log_mul * std::log(s));
    // Rope (kernels/ops.h) multiplies its yarn_attn_factor by 1 + 0.1 ln(s).
    c.rope_attn_factor = static_cast<float>(attn_factor / (1.0 + 0.1 * std::log(s)));
  }
  c.attn_scale = static_cast<float>(mscale * mscale / std::sqrt(static_cast<double>(c.head_dim)));
  for (const GgufTensor& t : f.tensors()) {
    if (!KnownTensor(t.name, c.num_layers)) {
      return UnimplementedError("model tensor '" + t.name + "' is not used by PageKV's deepseek2 runner (another "
                                "variant: fused experts, multi-token prediction); refusing rather than ignoring it");
    }
  }
  PAGEKV_RETURN_IF_ERROR(m->LoadEmbeddingAndHead());
  m->layers_.resize(static_cast<size_t>(c.num_layers));
  for (int32_t l = 0; l < c.num_layers; ++l) PAGEKV_RETURN_IF_ERROR(m->LoadLayer(l, m->layers_[static_cast<size_t>(l)]));
  m->BuildRope(c.qk_rope_dim);
  PAGEKV_RETURN_IF_ERROR(m->PackWeights());
  return m;
}

Status DeepseekModel::LoadLayer(int32_t l, Layer& L) {
  const ModelConfig& c = config_;
  const GgufFile& f = *file_;
  const std::string p = "blk." + std::to_string(l) + ".";
  const int64_t H = c.num_heads, qk = c.head_dim, nope = c.qk_nope_dim, rank = c.kv_lora_rank, v = c.v_head_dim;
  PAGEKV_ASSIGN_OR_RETURN(L.attn_norm, LoadVector(p + "attn_norm.weight", c.dim));
  if (c.q_lora_rank > 0) {
    PAGEKV_ASSIGN_OR_RETURN(L.wq_a, LoadMatrix(p + "attn_q_a.weight", c.q_lora_rank, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.q_a_norm, LoadVector(p + "attn_q_a_norm.weight", c.q_lora_rank));
    PAGEKV_ASSIGN_OR_RETURN(L.wq_b, LoadMatrix(p + "attn_q_b.weight", H * qk, c.q_lora_rank));
  } else {
    PAGEKV_ASSIGN_OR_RETURN(L.wq, LoadMatrix(p + "attn_q.weight", H * qk, c.dim));
  }
  PAGEKV_ASSIGN_OR_RETURN(L.wkv_a, LoadMatrix(p + "attn_kv_a_mqa.weight", rank + c.qk_rope_dim, c.dim));
  PAGEKV_ASSIGN_OR_RETURN(L.kv_a_norm, LoadVector(p + "attn_kv_a_norm.weight", rank));
  if (f.FindTensor(p + "attn_k_b.weight") != nullptr || f.FindTensor(p + "attn_kv_b.weight") == nullptr) {
    // {nope, rank, heads}: per head rank rows of nope; {rank, v, heads}.
    PAGEKV_ASSIGN_OR_RETURN(L.wk_b, LoadMatrices(p + "attn_k_b.weight", H, rank, nope));
    PAGEKV_ASSIGN_OR_RETURN(L.wv_b, LoadMatrices(p + "attn_v_b.weight", H, v, rank));
    // The unabsorbed prefill needs W_UK itself ([nope][rank] per head):
    // decoded and transposed once, as f32.
    std::vector<float> row(static_cast<size_t>(nope));
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float>& t = converted_.emplace_back(static_cast<size_t>(nope * rank));
      for (int64_t r = 0; r < rank; ++r) {
        WeightRow(L.wk_b[static_cast<size_t>(h)], r, row.data());
        for (int64_t a = 0; a < nope; ++a) t[static_cast<size_t>(a * rank + r)] = row[static_cast<size_t>(a)];
      }
      L.wk_b_t.push_back(Matrix{reinterpret_cast<const std::byte*>(t.data()), WeightType::kF32, nope, rank});
    }
  } else {
    // A legacy attn_kv_b {rank, heads * (nope + v)}: per head nope rows of
    // k_nope = row . c_kv, then v rows. W_UK is needed transposed (q_nope
    // into latent space), so its rows are decoded into an f32 [rank][nope];
    // the v rows are used in place.
    PAGEKV_ASSIGN_OR_RETURN(const Matrix kv_b, LoadMatrix(p + "attn_kv_b.weight", H * (nope + v), rank));
    const int64_t row_bytes = WeightRowBytes(kv_b.type, rank);
    std::vector<float> row(static_cast<size_t>(rank));
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float>& t = converted_.emplace_back(static_cast<size_t>(rank * nope));
      for (int64_t a = 0; a < nope; ++a) {
        WeightRow(kv_b, h * (nope + v) + a, row.data());
        for (int64_t r = 0; r < rank; ++r) t[static_cast<size_t>(r * nope + a)] = row[static_cast<size_t>(r)];
      }
      L.wk_b.push_back(Matrix{reinterpret_cast<const std::byte*>(t.data()), WeightType::kF32, rank, nope});
      L.wk_b_t.push_back(Matrix{kv_b.data + h * (nope + v) * row_bytes, kv_b.type, nope, rank});
      L.wv_b.push_back(Matrix{kv_b.data + (h * (nope + v) + nope) * row_bytes, kv_b.type, v, rank});
    }
  }
  PAGEKV_ASSIGN_OR_RETURN(L.wo, LoadMatrix(p + "attn_output.weight", c.dim, H * v));
  PAGEKV_ASSIGN_OR_RETURN(L.ffn_norm, LoadVector(p + "ffn_norm.weight", c.dim));
  if (l < c.leading_dense_layers) {
    PAGEKV_ASSIGN_OR_RETURN(L.dense.gate, LoadMatrix(p + "ffn_gate.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.dense.up, LoadMatrix(p + "ffn_up.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.dense.down, LoadMatrix(p + "ffn_down.weight", c.dim, c.hidden_dim));
    return Status::Ok();
  }
  L.moe = true;
  const int64_t E = c.num_experts, ff = c.expert_hidden_dim;
  PAGEKV_ASSIGN_OR_RETURN(L.gate_inp, LoadMatrix(p + "ffn_gate_inp.weight", E, c.dim));
  PAGEKV_ASSIGN_OR_RETURN(L.probs_bias, LoadOptionalVector(p + "exp_probs_b.bias", E));
  PAGEKV_ASSIGN_OR_RETURN(std::vector<Matrix> gate, LoadMatrices(p + "ffn_gate_exps.weight", E, ff, c.dim));
  PAGEKV_ASSIGN_OR_RETURN(std::vector<Matrix> up, LoadMatrices(p + "ffn_up_exps.weight", E, ff, c.dim));
  PAGEKV_ASSIGN_OR_RETURN(std::vector<Matrix> down, LoadMatrices(p + "ffn_down_exps.weight", E, c.dim, ff));
  for (int64_t e = 0; e < E; ++e) L.experts.push_back({gate[static_cast<size_t>(e)], up[static_cast<size_t>(e)], down[static_cast<size_t>(e)]});
  if (c.shared_experts > 0) {
    const int64_t sff = ff * c.shared_experts;
    PAGEKV_ASSIGN_OR_RETURN(L.shared.gate, LoadMatrix(p + "ffn_gate_shexp.weight", sff, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.shared.up, LoadMatrix(p + "ffn_up_shexp.weight", sff, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.shared.down, LoadMatrix(p + "ffn_down_shexp.weight", c.dim, sff));
  }
  return Status::Ok();
}

std::vector<const Model::Matrix*> DeepseekModel::Matrices(const Layer& L) const {
  std::vector<const Matrix*> out;
  for (const Matrix* m : {&L.wq, &L.wq_a, &L.wq_b, &L.wkv_a, &L.wo, &L.dense.gate, &L.dense.up, &L.dense.down,
                          &L.gate_inp, &L.shared.gate, &L.shared.up, &L.shared.down}) {
    if (m->data != nullptr) out.push_back(m);
  }
  for (const Matrix& m : L.wk_b) out.push_back(&m);
  for (const Matrix& m : L.wv_b) out.push_back(&m);
  for (const Ffn& e : L.experts) {
    for (const Matrix* m : {&e.gate, &e.up, &e.down}) out.push_back(m);
  }
  return out;
}

std::vector<Model::Matrix*> DeepseekModel::Matrices(Layer& L) {
  std::vector<Matrix*> out;
  for (const Matrix* m : std::as_const(*this).Matrices(std::as_const(L))) out.push_back(const_cast<Matrix*>(m));
  return out;
}

Status DeepseekModel::PackWeights() {
  PAGEKV_RETURN_IF_ERROR(PackHead());
  for (Layer& L : layers_) {
    for (Matrix* m : Matrices(L)) PAGEKV_RETURN_IF_ERROR(Pack(*m));
    for (Matrix& m : L.wk_b_t) PAGEKV_RETURN_IF_ERROR(Pack(m));
  }
  return Status::Ok();
}

int64_t DeepseekModel::StepWeightBytes() const {
  // What a one-token step reads: every matrix but the experts, and the
  // experts_used routed ones of each MoE layer (experts are the same size).
  const ModelConfig& c = config_;
  int64_t total = Bytes(classifier_);
  for (const Layer& L : layers_) {
    for (const Matrix* m : Matrices(L)) total += Bytes(*m);
    for (const Ffn& e : L.experts) total -= Bytes(e.gate) + Bytes(e.up) + Bytes(e.down);
    if (!L.experts.empty()) {
      const Ffn& e = L.experts.front();
      total += c.experts_used * (Bytes(e.gate) + Bytes(e.up) + Bytes(e.down));
    }
  }
  return total;
}

int64_t DeepseekModel::MatrixMultiplyAddsPerToken() const {
  const ModelConfig& c = config_;
  int64_t total = classifier_.rows * classifier_.cols;
  for (const Layer& L : layers_) {
    for (const Matrix* m : Matrices(L)) total += m->rows * m->cols;
    for (const Ffn& e : L.experts) total -= e.gate.rows * e.gate.cols * 3;
    if (!L.experts.empty()) total += c.experts_used * L.experts.front().gate.rows * L.experts.front().gate.cols * 3;
  }
  return total;
}

int64_t DeepseekModel::ParameterCount() const {
  const ModelConfig& c = config_;
  int64_t total = classifier_.rows * classifier_.cols + (tied_embeddings_ ? 0 : embedding_.rows * embedding_.cols);
  for (const Layer& L : layers_) {
    for (const Matrix* m : Matrices(L)) total += m->rows * m->cols;
    total += 2 * c.dim + c.kv_lora_rank + (c.q_lora_rank > 0 ? c.q_lora_rank : 0) +
             (L.probs_bias != nullptr ? c.num_experts : 0);
  }
  return total + c.dim;
}

CacheConfig DeepseekModel::CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const {
  const ModelConfig& c = config_;
  CacheConfig cc;
  cc.kind = CacheKind::kMla;
  cc.num_layers = c.num_layers;
  cc.num_q_heads = c.num_heads;
  cc.num_kv_heads = 1;
  cc.head_dim = c.qk_nope_dim;  // the kernels' default scale: 1 / sqrt(head_dim + rope_dim)
  cc.kv_lora_rank = c.kv_lora_rank;
  cc.rope_dim = c.qk_rope_dim;
  cc.block_len = block_len;
  cc.format = KvFormat::ForDType(dtype, c.kv_row_elems());
  cc.num_blocks = num_blocks;
  return cc;
}

Status DeepseekModel::CheckGeometry(const KvLayout& layout) const {
  const ModelConfig& c = config_;
  const CacheConfig& cc = layout.config();
  if (cc.kind != CacheKind::kMla || cc.num_layers != c.num_layers || cc.num_q_heads != c.num_heads ||
      cc.kv_lora_rank != c.kv_lora_rank || cc.rope_dim != c.qk_rope_dim) {
    return InvalidArgumentError("the cache's geometry does not match the model (an MLA latent cache of rank " +
                                std::to_string(c.kv_lora_rank) + " + rope " + std::to_string(c.qk_rope_dim) +
                                "): build it from CacheGeometry()");
  }
  return CheckLayerFormats(cc, c.kv_row_elems(), false, ") is not read on latent rows: use f32, f16, bf16, int8 or fp8");
}

void DeepseekModel::Route(const Layer& L, const float* logits, int64_t T, int32_t* chosen, float* weights) const {
  const ModelConfig& c = config_;
  const int32_t E = c.num_experts, K = c.experts_used;
  std::vector<float> probs(static_cast<size_t>(E)), select(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* z = logits + t * E;
    if (c.expert_sigmoid) {
      for (int32_t e = 0; e < E; ++e) probs[static_cast<size_t>(e)] = 1.0f / (1.0f + std::exp(-z[e]));
    } else {
      const float top = *std::max_element(z, z + E);
      float sum = 0;
      for (int32_t e = 0; e < E; ++e) sum += probs[static_cast<size_t>(e)] = std::exp(z[e] - top);
      for (float& p : probs) p /= sum;
    }
    for (int32_t e = 0; e < E; ++e) {
      select[static_cast<size_t>(e)] = probs[static_cast<size_t>(e)] + (L.probs_bias != nullptr ? L.probs_bias[e] : 0.0f);
    }
    if (c.expert_groups > 1) {
      // A group scores the sum of its two best selection values; experts of
      // groups outside the best expert_groups_used are not chosen.
      const int32_t per = E / c.expert_groups;
      std::vector<float> score(static_cast<size_t>(c.expert_groups));
      for (int32_t g = 0; g < c.expert_groups; ++g) {
        float best = -std::numeric_limits<float>::infinity(), second = best;
        for (int32_t e = g * per; e < (g + 1) * per; ++e) {
          const float s = select[static_cast<size_t>(e)];
          if (s > best) {
            second = best;
            best = s;
          } else if (s > second) {
            second = s;
          }
        }
        score[static_cast<size_t>(g)] = best + second;
      }
      std::vector<int32_t> groups(static_cast<size_t>(c.expert_groups));
      std::iota(groups.begin(), groups.end(), 0);
      std::stable_sort(groups.begin(), groups.end(),
                       [&](int32_t x, int32_t y) { return score[static_cast<size_t>(x)] > score[static_cast<size_t>(y)]; });
      for (size_t i = static_cast<size_t>(c.expert_groups_used); i < groups.size(); ++i) {
        for (int32_t e = groups[i] * per; e < (groups[i] + 1) * per; ++e) {
          select[static_cast<size_t>(e)] = -std::numeric_limits<float>::infinity();
        }
      }
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t x, int32_t y) {
      const float sx = select[static_cast<size_t>(x)], sy = select[static_cast<size_t>(y)];
      return sx > sy || (sx == sy && x < y);
    });
    float sum = 0;
    for (int32_t k = 0; k < K; ++k) {
      chosen[t * K + k] = order[static_cast<size_t>(k)];
      sum += weights[t * K + k] = probs[static_cast<size_t>(order[static_cast<size_t>(k)])];
    }
    const float norm = c.expert_weights_norm ? 1.0f / std::max(sum, 6.103515625e-5f) : 1.0f;
    for (int32_t k = 0; k < K; ++k) weights[t * K + k] *= norm * c.expert_weights_scale;
  }
}

Status DeepseekModel::Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                              const ForwardOptions& options) const {
  const ModelConfig& c = config_;
  const KvLayout& layout = kv.layout();
  const CacheConfig& cc = layout.config();
  const Backend& be = options.backend != nullptr ? *options.backend : CpuBackend();
  if (!be.host_memory()) {
    return UnimplementedError("the deepseek2 runner runs on the CPU backend only (its device forward pass is not built yet): drop --device " +
                              be.name());
  }
  const int64_t T = batch.rows;
  const int64_t d = c.dim, H = c.num_heads, nope = c.qk_nope_dim, rope = c.qk_rope_dim, rank = c.kv_lora_rank;
  const int64_t vdim = c.v_head_dim, qk = c.head_dim, lat = rank + rope;
  const int64_t ff = std::max<int64_t>({c.hidden_dim, int64_t{c.expert_hidden_dim} * std::max(1, c.shared_experts)});
  double* matmul_time = options.timings != nullptr ? &options.timings->matmul : nullptr;
  double* attention_time = options.timings != nullptr ? &options.timings->attention : nullptr;
  size_t slot = 0;
  auto rows = [&slot](int64_t n, int64_t width) { return Scratch<float>(slot++, static_cast<size_t>(n * width)).data(); };
  float* x = rows(T, d);
  float* xb = rows(T, std::max(d, int64_t{c.q_lora_rank}));
  float* q = rows(T, H * qk);
  float* qa = rows(T, std::max(1, c.q_lora_rank));
  float* kva = rows(T, lat);
  float* latent = rows(T, lat);
  float* k_pe = rows(T, rope);
  float* q_pe = rows(T, H * rope);
  float* by_head = rows(T, H * std::max(nope, rank));  // [H][rows][...]: a head's rows together for its product
  float* by_head_out = rows(T, H * std::max(rank, vdim));
  float* q_lat = rows(T, H * lat);  // the absorbed rows' ([absorbed rows][H][lat], compact)
  float* o_lat = rows(T, H * lat);
  float* o = rows(T, H * vdim);
  float* tmp = rows(T, d);
  float* acc = rows(T, d);
  float* h1 = rows(T, ff);
  float* h2 = rows(T, ff);
  float* gate_logits = rows(T, std::max(1, c.num_experts));
  float* xs = rows(T, d);
  float* cos = rows(T, rope);
  float* sin = rows(T, rope);
  int64_t widest_row = 0;  // the latent row's bytes in the widest layer's format
  for (int32_t l = 0; l < c.num_layers; ++l) widest_row = std::max(widest_row, layout.row_bytes(l));
  const std::span<std::byte> latent_rows = Scratch<std::byte>(0, static_cast<size_t>(T * widest_row));
  std::vector<int32_t> chosen(static_cast<size_t>(T * std::max(1, c.experts_used)));
  std::vector<float> route_w(chosen.size());
  auto matmul = [&](const Matrix& w, const float* in, int64_t n, float* out) {
    Stopwatch watch(matmul_time);
    return be.MatMul(w, in, n, out, options.threads, options.activations);
  };
  auto matmul_shared = [&](std::initializer_list<MatMulOutput> outputs, const float* in, int64_t n) {
    Stopwatch watch(matmul_time);
    return be.MatMulShared({outputs.begin(), outputs.size()}, in, n, options.threads, options.activations);
  };
  auto swiglu_ffn = [&](const Ffn& f, const float* in, int64_t n, float* out) -> Status {
    PAGEKV_RETURN_IF_ERROR(matmul_shared({{f.gate, h1}, {f.up, h2}}, in, n));
    const int64_t width = f.gate.rows;
    ForRows(n, options.threads, [&](int64_t t0, int64_t t1) { be.SwiGluInPlace(h1 + t0 * width, h2 + t0 * width, (t1 - t0) * width); });
    return matmul(f.down, h1, n, out);
  };
  // Which items run the unabsorbed form (prompt chunks long enough, without
  // eviction weights to report), and the absorbed rest's rows in order.
  const bool decode_only = static_cast<int64_t>(items.size()) == T;
  std::vector<char> unabsorbed(items.size(), 0);
  std::vector<int64_t> absorbed_rows;  // step row of each absorbed row
  std::vector<size_t> absorbed_items;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto n = static_cast<int64_t>(items[i].tokens.size());
    unabsorbed[i] = !decode_only && items[i].scores == nullptr && Unabsorbed(n, options);
    if (unabsorbed[i]) continue;
    absorbed_items.push_back(i);
    for (int64_t j = 0; j < n; ++j) absorbed_rows.push_back(batch.first[i] + j);
  }
  const auto A = static_cast<int64_t>(absorbed_rows.size());
  // One product per head over the absorbed rows (W_UK in, W_UV out), the
  // heads over the pool and each product on its worker: in = [H][A][cols],
  // out = [H][A][rows].
  auto per_head = [&](const std::vector<Matrix>& w, const float* in, float* out) -> Status {
    Stopwatch watch(attention_time);
    std::vector<Status> errors(static_cast<size_t>(H));
    const int64_t cols = w.front().cols, out_rows = w.front().rows;
    ThreadPool::Shared().ParallelFor(H, options.threads, [&](int64_t h) {
      errors[static_cast<size_t>(h)] = be.MatMul(w[static_cast<size_t>(h)], in + h * A * cols, A, out + h * A * out_rows, 1,
                                                 options.activations);
    });
    for (const Status& s : errors) PAGEKV_RETURN_IF_ERROR(s);
    return Status::Ok();
  };
  // fn(j, t, h) for every absorbed row j (step row t) and head h.
  auto each_absorbed = [&](const auto& fn) {
    ForRows(A, options.threads, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t h = 0; h < H; ++h) fn(j, absorbed_rows[static_cast<size_t>(j)], h);
      }
    });
  };
  Embed(items, batch, be, x);
  ForRows(T, options.threads, [&](int64_t t0, int64_t t1) {
    be.RopeTables(*rope_, std::span<const int64_t>(batch.pos).subspan(static_cast<size_t>(t0), static_cast<size_t>(t1 - t0)),
                  cos + t0 * rope, sin + t0 * rope);
  });
  std::vector<PrefillSeq> prefill;
  std::vector<DecodeSeq> decode;
  std::vector<KvSpan> views(items.size());
  AttentionOptions attention_options;
  attention_options.num_threads = options.threads;
  attention_options.scale = c.attn_scale;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    ForRows(T, options.threads, [&](int64_t t0, int64_t t1) { be.RmsNormRows(x + t0 * d, L.attn_norm, t1 - t0, d, c.norm_eps, xb + t0 * d); });
    // q and the latent row.
    if (c.q_lora_rank > 0) {
      PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.wq_a, qa}, {L.wkv_a, kva}}, xb, T));
      ForRows(T, options.threads, [&](int64_t t0, int64_t t1) {
        be.RmsNormRows(qa + t0 * c.q_lora_rank, L.q_a_norm, t1 - t0, c.q_lora_rank, c.norm_eps, xb + t0 * c.q_lora_rank);
      });
      PAGEKV_RETURN_IF_ERROR(matmul(L.wq_b, xb, T, q));
    } else {
      PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.wq, q}, {L.wkv_a, kva}}, xb, T));
    }
    const KvFormat& format = cc.FormatOf(l);
    const int64_t row_bytes = layout.row_bytes(l);
    ForRows(T, options.threads, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        be.RmsNormRows(kva + t * lat, L.kv_a_norm, 1, static_cast<int32_t>(rank), c.norm_eps, latent + t * lat);
        std::memcpy(k_pe + t * rope, kva + t * lat + rank, static_cast<size_t>(rope) * 4);
      }
      be.RopeApply(*rope_, k_pe + t0 * rope, t1 - t0, static_cast<int32_t>(rope), cos + t0 * rope, sin + t0 * rope);
      for (int64_t t = t0; t < t1; ++t) std::memcpy(latent + t * lat + rank, k_pe + t * rope, static_cast<size_t>(rope) * 4);
      be.EncodeKvRows(format, static_cast<int32_t>(lat), latent + t0 * lat, t1 - t0, latent_rows.data() + t0 * row_bytes);
      // q_pe rotated, back into q (q is then each head's [q_nope, q_pe]).
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(q_pe + (t * H + h) * rope, q + (t * H + h) * qk + nope, static_cast<size_t>(rope) * 4);
        }
      }
      be.RopeApply(*rope_, q_pe + t0 * H * rope, t1 - t0, static_cast<int32_t>(H * rope), cos + t0 * rope, sin + t0 * rope);
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(q + (t * H + h) * qk + nope, q_pe + (t * H + h) * rope, static_cast<size_t>(rope) * 4);
        }
      }
    });
    prefill.clear();
    decode.clear();
    for (size_t i = 0; i < items.size(); ++i) {
      PAGEKV_ASSIGN_OR_RETURN(views[i], kv.Store(i, l, latent_rows.data() + batch.first[i] * row_bytes, nullptr));
    }
    for (size_t i : absorbed_items) {
      const KvSpan& view = views[i];
      float* scores = items[i].scores == nullptr ? nullptr : items[i].scores + static_cast<int64_t>(l) * view.num_tokens;
      prefill.push_back({view.blocks, view.num_tokens, static_cast<int64_t>(items[i].tokens.size()), scores,
                         items[i].score_queries, view.tail});
      decode.push_back({view.blocks, view.num_tokens, scores, view.tail});
    }
    const PagedKv paged{&layout, kv.arena(), l};
    if (A > 0) {
      // Absorbed: q_nope into latent space, the latent kernels, the latent
      // output back out per head.
      each_absorbed([&](int64_t j, int64_t t, int64_t h) {
        std::memcpy(by_head + (h * A + j) * nope, q + (t * H + h) * qk, static_cast<size_t>(nope) * 4);
      });
      PAGEKV_RETURN_IF_ERROR(per_head(L.wk_b, by_head, by_head_out));
      each_absorbed([&](int64_t j, int64_t t, int64_t h) {
        std::memcpy(q_lat + (j * H + h) * lat, by_head_out + (h * A + j) * rank, static_cast<size_t>(rank) * 4);
        std::memcpy(q_lat + (j * H + h) * lat + rank, q + (t * H + h) * qk + nope, static_cast<size_t>(rope) * 4);
      });
      {
        Stopwatch watch(attention_time);
        PAGEKV_RETURN_IF_ERROR(decode_only ? be.DecodeAttention(paged, decode, q_lat, o_lat, attention_options)
                                           : be.PrefillAttention(paged, prefill, q_lat, o_lat, attention_options));
      }
      each_absorbed([&](int64_t j, int64_t, int64_t h) {
        std::memcpy(by_head + (h * A + j) * rank, o_lat + (j * H + h) * lat, static_cast<size_t>(rank) * 4);
      });
      PAGEKV_RETURN_IF_ERROR(per_head(L.wv_b, by_head, by_head_out));
      each_absorbed([&](int64_t j, int64_t t, int64_t h) {
        std::memcpy(o + (t * H + h) * vdim, by_head_out + (h * A + j) * vdim, static_cast<size_t>(vdim) * 4);
      });
    }
    for (size_t i = 0; i < items.size(); ++i) {
      if (!unabsorbed[i]) continue;
      Stopwatch watch(attention_time);
      const int64_t first = batch.first[i];
      PAGEKV_RETURN_IF_ERROR(UnabsorbedAttention(L, paged, views[i], q + first * H * qk,
                                                 static_cast<int64_t>(items[i].tokens.size()), o + first * H * vdim,
                                                 options, be));
    }
    PAGEKV_RETURN_IF_ERROR(matmul(L.wo, o, T, tmp));
    ForRows(T, options.threads, [&](int64_t t0, int64_t t1) {
      be.AddInPlace(x + t0 * d, tmp + t0 * d, (t1 - t0) * d);
      be.RmsNormRows(x + t0 * d, L.ffn_norm, t1 - t0, static_cast<int32_t>(d), c.norm_eps, xb + t0 * d);
    });
    // Feed-forward.
    if (!L.moe) {
      PAGEKV_RETURN_IF_ERROR(swiglu_ffn(L.dense, xb, T, tmp));
      ForRows(T, options.threads, [&](int64_t t0, int64_t t1) { be.AddInPlace(x + t0 * d, tmp + t0 * d, (t1 - t0) * d); });
      continue;
    }
    PAGEKV_RETURN_IF_ERROR(matmul(L.gate_inp, xb, T, gate_logits));
    Route(L, gate_logits, T, chosen.data(), route_w.data());
    std::fill(acc, acc + T * d, 0.0f);
    // The (token, slot) pairs bucketed by expert in one pass, each bucket in
    // token order: pairs [start[e], start[e + 1]) of `pair` go to expert e.
    const int64_t pairs = T * c.experts_used;
    std::vector<int64_t> start(static_cast<size_t>(c.num_experts) + 1, 0), pair(static_cast<size_t>(pairs));
    for (int64_t p = 0; p < pairs; ++p) ++start[static_cast<size_t>(chosen[static_cast<size_t>(p)]) + 1];
    for (size_t e = 1; e < start.size(); ++e) start[e] += start[e - 1];
    {
      std::vector<int64_t> next(start.begin(), start.end() - 1);
      for (int64_t p = 0; p < pairs; ++p) pair[static_cast<size_t>(next[static_cast<size_t>(chosen[static_cast<size_t>(p)])]++)] = p;
    }
    for (int32_t e = 0; e < c.num_experts; ++e) {
      const int64_t first = start[static_cast<size_t>(e)], n = start[static_cast<size_t>(e) + 1] - first;
      if (n == 0) continue;
      auto token = [&](int64_t j) { return pair[static_cast<size_t>(first + j)] / c.experts_used; };
      for (int64_t j = 0; j < n; ++j) std::memcpy(xs + j * d, xb + token(j) * d, static_cast<size_t>(d) * 4);
      PAGEKV_RETURN_IF_ERROR(swiglu_ffn(L.experts[static_cast<size_t>(e)], xs, n, tmp));
      for (int64_t j = 0; j < n; ++j) {
        float* dst = acc + token(j) * d;
        const float w = route_w[static_cast<size_t>(pair[static_cast<size_t>(first + j)])];
        const float* src = tmp + j * d;
        for (int64_t i = 0; i < d; ++i) dst[i] += w * src[i];
      }
    }
    if (c.shared_experts > 0) {
      PAGEKV_RETURN_IF_ERROR(swiglu_ffn(L.shared, xb, T, tmp));
      ForRows(T, options.threads, [&](int64_t t0, int64_t t1) { be.AddInPlace(acc + t0 * d, tmp + t0 * d, (t1 - t0) * d); });
    }
    ForRows(T, options.threads, [&](int64_t t0, int64_t t1) { be.AddInPlace(x + t0 * d, acc + t0 * d, (t1 - t0) * d); });
  }
  return Logits(items, batch, be, x, xb, options);
}

}  // namespace pagekv
