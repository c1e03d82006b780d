// GemmaModel (gemma_model.h): loading the gemma3 GGUF and its forward pass.
#include "model/gemma_model.h"

#include <algorithm>
#include <cmath>

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
    "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base", "rope.freq_base_swa",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.attn_factor", "rope.scaling.finetuned", "final_logit_softcapping", "vocab_size",
    "tensor_data_layout",
};

bool KnownTensor(const std::string& name, int32_t layers) {
  static constexpr std::string_view kGlobal[] = {"token_embd.weight", "output_norm.weight", "output.weight"};
  if (model_internal::KeyIn(name, kGlobal)) return true;
  static constexpr std::string_view kParts[] = {
      "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight",
      "attn_k_norm.weight", "attn_output.weight", "post_attention_norm.weight", "ffn_norm.weight",
      "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight"};
  return model_internal::KeyIn(model_internal::LayerPart(name, layers), kParts);
}

}  // namespace

Result<std::unique_ptr<GemmaModel>> GemmaModel::FromGguf(std::unique_ptr<GgufFile> file) {
  PAGEKV_ASSIGN_OR_RETURN(std::string arch, file->GetString("general.architecture"));
  if (arch != "gemma3") {
    return InvalidArgumentError("model metadata general.architecture = '" + arch + "': the gemma runner reads gemma3");
  }
  auto m = std::unique_ptr<GemmaModel>(new GemmaModel());
  PAGEKV_RETURN_IF_ERROR(m->ReadCommonMetadata(std::move(file), kKnownKeys));
  const GgufFile& f = *m->file_;
  ModelConfig& c = m->config_;
  const std::string a = arch + ".";
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "feed_forward_length", c.hidden_dim));
  c.num_kv_heads = c.num_heads;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.head_count_kv", c.num_kv_heads, false));
  if (c.num_heads % c.num_kv_heads != 0) {
    return DataLossError("model metadata " + a + "attention.head_count " + std::to_string(c.num_heads) +
                         " is not a multiple of head_count_kv " + std::to_string(c.num_kv_heads));
  }
  c.head_dim = c.dim / c.num_heads;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.key_length", c.head_dim, false));
  int32_t value_length = c.head_dim;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.value_length", value_length, false));
  if (value_length != c.head_dim || c.head_dim % 2 != 0) {
    return UnimplementedError("model metadata " + a + "attention.value_length = " + std::to_string(value_length) +
                              " with key_length " + std::to_string(c.head_dim) +
                              ": the gemma runner needs equal, even K and V head sizes");
  }
  c.rope_dims = c.head_dim;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "rope.dimension_count", c.rope_dims, false));
  if (c.rope_dims != c.head_dim) {
    return UnimplementedError("model metadata " + a + "rope.dimension_count = " + std::to_string(c.rope_dims) +
                              " differs from the head size " + std::to_string(c.head_dim) +
                              ": partial rotary embedding is not read by the gemma runner");
  }
  c.rope_halves = true;  // NEOX, as llama.cpp rotates every gemma
  PAGEKV_RETURN_IF_ERROR(m->ReadRopeScaling(a));
  if (Result<double> v = f.GetFloat(a + "rope.freq_base_swa"); v.ok()) c.rope_theta_local = static_cast<float>(*v);
  if (Result<double> v = f.GetFloat(a + "final_logit_softcapping"); v.ok() && *v != 0.0) {
    if (!(*v > 0.0) || !std::isfinite(*v)) {
      return DataLossError("model metadata " + a + "final_logit_softcapping = " + std::to_string(*v) + " must be positive");
    }
    c.final_softcap = static_cast<float>(*v);
  }
  // Which layers slide, and over how many tokens.
  int32_t window = 0;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.sliding_window", window, false));
  if (window > c.context_len) {
    return DataLossError("model metadata " + a + "attention.sliding_window = " + std::to_string(window) +
                         " is larger than its context_length " + std::to_string(c.context_len) +
                         ": not a sliding window (a file written wrong)");
  }
  c.layer_windows.assign(static_cast<size_t>(c.num_layers), 0);
  if (window > 0) {
    const std::string key = a + "attention.sliding_window_pattern";
    const GgufValue* pattern = f.Find(key);
    if (pattern != nullptr && pattern->is_array()) {
      if (pattern->elements.size() != static_cast<size_t>(c.num_layers) || pattern->element_type != GgufType::kBool) {
        return DataLossError("model metadata " + key + " is an array of " + std::to_string(pattern->elements.size()) +
                             " elements: a per-layer pattern is " + std::to_string(c.num_layers) + " bools");
      }
      for (int32_t l = 0; l < c.num_layers; ++l) {
        if (std::get<bool>(pattern->elements[static_cast<size_t>(l)])) c.layer_windows[static_cast<size_t>(l)] = window;
      }
    } else {
      int32_t period = 6;
      PAGEKV_RETURN_IF_ERROR(ReadDim(f, key, period, false));
      for (int32_t l = 0; l < c.num_layers; ++l) {
        if (period > 1 && l % period < period - 1) c.layer_windows[static_cast<size_t>(l)] = window;
      }
    }
  }
  // llama.cpp (from gemma_pytorch's config): query_pre_attn_scalar is
  // dim / heads for the 27B (62 layers), the head size otherwise.
  m->attn_scale_ = 1.0f / std::sqrt(static_cast<float>(c.num_layers == 62 ? c.dim / c.num_heads : c.head_dim));
  c.attn_scale = m->attn_scale_;
  c.embed_scale = std::sqrt(static_cast<float>(c.dim));
  for (const GgufTensor& t : f.tensors()) {
    if (!KnownTensor(t.name, c.num_layers)) {
      return UnimplementedError("model tensor '" + t.name + "' is not used by PageKV's gemma3 runner (another variant: "
                                "vision or dense projections); refusing rather than ignoring it");
    }
  }
  PAGEKV_RETURN_IF_ERROR(m->LoadEmbeddingAndHead());
  const int64_t q_dim = int64_t{c.num_heads} * c.head_dim, kv_dim = int64_t{c.num_kv_heads} * c.head_dim;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer L{};
    PAGEKV_ASSIGN_OR_RETURN(L.attn_norm, m->LoadVector(p + "attn_norm.weight", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wq, m->LoadMatrix(p + "attn_q.weight", q_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wk, m->LoadMatrix(p + "attn_k.weight", kv_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wv, m->LoadMatrix(p + "attn_v.weight", kv_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.q_norm, m->LoadVector(p + "attn_q_norm.weight", c.head_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.k_norm, m->LoadVector(p + "attn_k_norm.weight", c.head_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wo, m->LoadMatrix(p + "attn_output.weight", c.dim, q_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.post_attn_norm, m->LoadVector(p + "post_attention_norm.weight", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.ffn_norm, m->LoadVector(p + "ffn_norm.weight", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_gate, m->LoadMatrix(p + "ffn_gate.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_up, m->LoadMatrix(p + "ffn_up.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_down, m->LoadMatrix(p + "ffn_down.weight", c.dim, c.hidden_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.post_ffn_norm, m->LoadVector(p + "post_ffw_norm.weight", c.dim));
    m->layers_.push_back(L);
  }
  m->BuildRope(c.head_dim);
  RopeParams local = m->rope_->params();
  local.theta = c.rope_theta_local;
  local.freq_scale = 1.0f;
  local.yarn = false;
  local.yarn_attn_factor = 1.0f;
  local.freq_divisors.clear();
  m->rope_local_ = std::make_shared<const Rope>(std::move(local));
  PAGEKV_RETURN_IF_ERROR(m->PackHead());
  for (Layer& L : m->layers_) {
    for (Matrix* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) PAGEKV_RETURN_IF_ERROR(m->Pack(*w));
  }
  return m;
}

int64_t GemmaModel::StepWeightBytes() const {
  int64_t total = Bytes(classifier_);
  for (const Layer& L : layers_) {
    for (const Matrix* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) total += Bytes(*w);
  }
  return total;
}

int64_t GemmaModel::MatrixMultiplyAddsPerToken() const {
  int64_t total = classifier_.rows * classifier_.cols;
  for (const Layer& L : layers_) {
    for (const Matrix* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) total += w->rows * w->cols;
  }
  return total;
}

int64_t GemmaModel::ParameterCount() const {
  const int64_t norms = int64_t{config_.num_layers} * (4 * int64_t{config_.dim} + 2 * config_.head_dim) + config_.dim;
  return MatrixMultiplyAddsPerToken() + norms + (tied_embeddings_ ? 0 : embedding_.rows * embedding_.cols);
}

CacheConfig GemmaModel::CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const {
  CacheConfig cc;
  cc.num_layers = config_.num_layers;
  cc.num_q_heads = config_.num_heads;
  cc.num_kv_heads = config_.num_kv_heads;
  cc.head_dim = config_.head_dim;
  cc.block_len = block_len;
  cc.format = KvFormat::ForDType(dtype, config_.head_dim);
  cc.num_blocks = num_blocks;
  return cc;
}

Status GemmaModel::CheckGeometry(const KvLayout& layout) const {
  const ModelConfig& c = config_;
  const CacheConfig& cc = layout.config();
  if (cc.kind != CacheKind::kPerHead || cc.num_layers != c.num_layers || cc.num_kv_heads != c.num_kv_heads ||
      cc.head_dim != c.head_dim || cc.num_q_heads != c.num_heads) {
    return InvalidArgumentError("the cache's geometry does not match the model: build it from CacheGeometry()");
  }
  return CheckLayerFormats(cc, c.head_dim, true, ") not supported");
}

Status GemmaModel::Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                           const ForwardOptions& options) const {
  const ModelConfig& c = config_;
  for (const StepItem& item : items) {
    if (item.scores != nullptr && c.hybrid()) {
      return UnimplementedError("token eviction (attention weights) on a model with sliding-window layers is not "
                                "supported: positions a window counts would move; run without --evict");
    }
  }
  const KvLayout& layout = kv.layout();
  const CacheConfig& cc = layout.config();
  const Backend& be = options.backend != nullptr ? *options.backend : CpuBackend();
  const int64_t T = batch.rows;
  const int32_t d = c.dim, hd = c.hidden_dim, head = c.head_dim;
  const int32_t q_dim = c.num_heads * head, kv_dim = c.num_kv_heads * head;
  double* matmul_time = options.timings != nullptr ? &options.timings->matmul : nullptr;
  double* attention_time = options.timings != nullptr ? &options.timings->attention : nullptr;
  size_t slot = 0;
  auto rows = [&slot, &be](int64_t n, int64_t width) { return Scratch<float>(be, slot++, static_cast<size_t>(n * width)); };
  const std::span<float> x = rows(T, d), xb = rows(T, d), q = rows(T, q_dim), att = rows(T, q_dim), tmp = rows(T, d),
                         k = rows(T, kv_dim), v = rows(T, kv_dim), h1 = rows(T, hd), h2 = rows(T, hd);
  int64_t widest_row = 0;
  for (int32_t l = 0; l < c.num_layers; ++l) widest_row = std::max(widest_row, layout.row_bytes(l));
  const std::span<std::byte> k_rows = Scratch<std::byte>(be, 0, static_cast<size_t>(T * widest_row * c.num_kv_heads)),
                             v_rows = Scratch<std::byte>(be, 1, k_rows.size());
  auto matmul = [&](const Matrix& w, const float* in, int64_t n, float* out) {
    Stopwatch watch(matmul_time);
    return be.MatMul(w, in, n, out, options.threads, options.activations);
  };
  auto matmul_shared = [&](std::initializer_list<MatMulOutput> outputs, const float* in, int64_t n) {
    Stopwatch watch(matmul_time);
    return be.MatMulShared({outputs.begin(), outputs.size()}, in, n, options.threads, options.activations);
  };
  auto for_rows = [&options](int64_t n, const auto& fn) { ForRows(n, options.threads, fn); };
  // Rotary tables per row for both kinds of layer.
  const std::span<float> cos_g = rows(T, head), sin_g = rows(T, head), cos_l = rows(T, head), sin_l = rows(T, head);
  // A device backend that could not allocate its activations returns empty
  // scratch (and records why).
  for (const std::span<float> buf : {x, xb, q, att, tmp, k, v, h1, h2, cos_g, sin_g, cos_l, sin_l}) {
    if (buf.data() == nullptr && !buf.empty()) {
      return ResourceExhaustedError("no " + be.name() + " memory for this step's activations: lower --max-step-tokens");
    }
  }
  if (k_rows.data() == nullptr || v_rows.data() == nullptr) {
    return ResourceExhaustedError("no " + be.name() + " memory for this step's K / V rows: lower --max-step-tokens");
  }
  Embed(items, batch, be, x.data());
  for_rows(T, [&](int64_t t0, int64_t t1) {
    const auto pos = std::span<const int64_t>(batch.pos).subspan(static_cast<size_t>(t0), static_cast<size_t>(t1 - t0));
    be.RopeTables(*rope_, pos, &cos_g[static_cast<size_t>(t0 * head)], &sin_g[static_cast<size_t>(t0 * head)]);
    be.RopeTables(*rope_local_, pos, &cos_l[static_cast<size_t>(t0 * head)], &sin_l[static_cast<size_t>(t0 * head)]);
  });
  const bool decode_only = static_cast<int64_t>(items.size()) == T;
  std::vector<PrefillSeq> prefill(items.size());
  std::vector<DecodeSeq> decode(items.size());
  AttentionOptions attention_options;
  attention_options.num_threads = options.threads;
  attention_options.scale = attn_scale_;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const int32_t window = c.window(l);
    const Rope& rope = window > 0 ? *rope_local_ : *rope_;
    const float* cos_t = window > 0 ? cos_l.data() : cos_g.data();
    const float* sin_t = window > 0 ? sin_l.data() : sin_g.data();
    for_rows(T, [&](int64_t t0, int64_t t1) {
      be.RmsNormRows(&x[static_cast<size_t>(t0 * d)], L.attn_norm, t1 - t0, d, c.norm_eps, &xb[static_cast<size_t>(t0 * d)]);
    });
    PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.wq, q.data()}, {L.wk, k.data()}, {L.wv, v.data()}}, xb.data(), T));
    const KvFormat& format = cc.FormatOf(l);
    const auto token_bytes = static_cast<size_t>(layout.row_bytes(l) * c.num_kv_heads);
    for_rows(T, [&](int64_t t0, int64_t t1) {
      const auto first = static_cast<size_t>(t0);
      float* qr = &q[first * static_cast<size_t>(q_dim)];
      float* kr = &k[first * static_cast<size_t>(kv_dim)];
      be.RmsNormRows(qr, L.q_norm, (t1 - t0) * c.num_heads, head, c.norm_eps, qr);
      be.RmsNormRows(kr, L.k_norm, (t1 - t0) * c.num_kv_heads, head, c.norm_eps, kr);
      be.RopeApply(rope, qr, t1 - t0, q_dim, cos_t + first * head, sin_t + first * head);
      be.RopeApply(rope, kr, t1 - t0, kv_dim, cos_t + first * head, sin_t + first * head);
      const int64_t heads = (t1 - t0) * c.num_kv_heads;
      be.EncodeKvRows(format, head, kr, heads, k_rows.data() + first * token_bytes);
      be.EncodeKvRows(format, head, v.data() + first * kv_dim, heads, v_rows.data() + first * token_bytes);
    });
    for (size_t i = 0; i < items.size(); ++i) {
      const auto n = static_cast<int64_t>(items[i].tokens.size());
      const size_t offset = static_cast<size_t>(batch.first[i]) * token_bytes;
      PAGEKV_ASSIGN_OR_RETURN(const KvSpan view, kv.Store(i, l, k_rows.data() + offset, v_rows.data() + offset));
      float* scores = items[i].scores == nullptr
                          ? nullptr
                          : items[i].scores + static_cast<int64_t>(l) * c.num_kv_heads * view.num_tokens;
      prefill[i] = {view.blocks, view.num_tokens, n, scores, items[i].score_queries, view.tail, window};
      decode[i] = {view.blocks, view.num_tokens, scores, view.tail, window};
    }
    {
      Stopwatch watch(attention_time);
      const PagedKv paged{&layout, kv.arena(), l};
      PAGEKV_RETURN_IF_ERROR(decode_only ? be.DecodeAttention(paged, decode, q.data(), att.data(), attention_options)
                                         : be.PrefillAttention(paged, prefill, q.data(), att.data(), attention_options));
    }
    PAGEKV_RETURN_IF_ERROR(matmul(L.wo, att.data(), T, tmp.data()));
    for_rows(T, [&](int64_t t0, int64_t t1) {
      float* tr = &tmp[static_cast<size_t>(t0 * d)];
      float* xr = &x[static_cast<size_t>(t0 * d)];
      be.RmsNormRows(tr, L.post_attn_norm, t1 - t0, d, c.norm_eps, tr);
      be.AddInPlace(xr, tr, (t1 - t0) * d);
      be.RmsNormRows(xr, L.ffn_norm, t1 - t0, d, c.norm_eps, &xb[static_cast<size_t>(t0 * d)]);
    });
    PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.w_gate, h1.data()}, {L.w_up, h2.data()}}, xb.data(), T));
    for_rows(T, [&](int64_t t0, int64_t t1) {
      be.GeluGluInPlace(&h1[static_cast<size_t>(t0 * hd)], &h2[static_cast<size_t>(t0 * hd)], (t1 - t0) * hd);
    });
    PAGEKV_RETURN_IF_ERROR(matmul(L.w_down, h1.data(), T, tmp.data()));
    for_rows(T, [&](int64_t t0, int64_t t1) {
      float* tr = &tmp[static_cast<size_t>(t0 * d)];
      be.RmsNormRows(tr, L.post_ffn_norm, t1 - t0, d, c.norm_eps, tr);
      be.AddInPlace(&x[static_cast<size_t>(t0 * d)], tr, (t1 - t0) * d);
    });
  }
  return Logits(items, batch, be, x.data(), xb.data(), options);
}

}  // namespace pagekv
