#include "model/llama_model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>

#include <cstring>

#include "layout/float16.h"
#include "pagekv/attention.h"

namespace pagekv {
namespace {

// out[m] = W[m][:] . x  (W row-major [rows][cols]).
void MatVec(const float* w, const float* x, int32_t rows, int32_t cols, float* out) {
  for (int32_t r = 0; r < rows; ++r) {
    const float* row = w + static_cast<int64_t>(r) * cols;
    float sum = 0.0f;
    for (int32_t c = 0; c < cols; ++c) sum += row[c] * x[c];
    out[r] = sum;
  }
}

void RmsNorm(const float* x, const float* weight, int32_t n, float eps, float* out) {
  float ss = 0.0f;
  for (int32_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int32_t i = 0; i < n; ++i) out[i] = weight[i] * (scale * x[i]);
}

// Rotary embedding on adjacent pairs within each head (llama2.c).
void Rope(float* v, int32_t size, int32_t head_dim, int64_t pos, float theta) {
  for (int32_t i = 0; i < size; i += 2) {
    const int32_t j = i % head_dim;
    const float freq = 1.0f / std::pow(theta, static_cast<float>(j) / static_cast<float>(head_dim));
    const float angle = static_cast<float>(pos) * freq;
    const float c = std::cos(angle), s = std::sin(angle);
    const float a = v[i], b = v[i + 1];
    v[i] = a * c - b * s;
    v[i + 1] = a * s + b * c;
  }
}

std::string ShapeString(const std::vector<int64_t>& dims) {
  std::string out;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) out.push_back('x');
    out.append(std::to_string(dims[i]));
  }
  return out;
}

Result<const float*> Weight(const GgufFile& f, const std::string& name, std::vector<int64_t> dims) {
  const GgufTensor* t = f.FindTensor(name);
  if (t == nullptr) return DataLossError("model tensor '" + name + "' is missing");
  if (t->dims != dims) {
    return DataLossError("model tensor '" + name + "' has shape " + ShapeString(t->dims) + ", expected " +
                         ShapeString(dims));
  }
  if (t->type != GgmlType::kF32) {
    return UnimplementedError("model tensor '" + name + "' is " +
                              std::string(GgmlTypeName(static_cast<uint32_t>(t->type))) +
                              ": this runner reads f32 weights so far");
  }
  return reinterpret_cast<const float*>(t->data);
}

}  // namespace

Result<std::unique_ptr<LlamaModel>> LlamaModel::FromGguf(std::unique_ptr<GgufFile> file) {
  PAGEKV_ASSIGN_OR_RETURN(std::string arch, file->GetString("general.architecture"));
  if (arch != "llama") {
    return UnimplementedError("model architecture '" + arch + "' is not supported: only llama (also Mistral, Qwen2-style)");
  }
  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  LlamaConfig& c = m->config_;
  auto get = [&](const char* key, int32_t& out) -> Status {
    PAGEKV_ASSIGN_OR_RETURN(int64_t v, file->GetInt(key));
    if (v <= 0 || v > (1 << 24)) return DataLossError(std::string("model metadata ") + key + " = " + std::to_string(v) + " is out of range");
    out = static_cast<int32_t>(v);
    return Status::Ok();
  };
  PAGEKV_RETURN_IF_ERROR(get("llama.embedding_length", c.dim));
  PAGEKV_RETURN_IF_ERROR(get("llama.feed_forward_length", c.hidden_dim));
  PAGEKV_RETURN_IF_ERROR(get("llama.block_count", c.num_layers));
  PAGEKV_RETURN_IF_ERROR(get("llama.attention.head_count", c.num_heads));
  PAGEKV_RETURN_IF_ERROR(get("llama.context_length", c.context_len));
  c.num_kv_heads = c.num_heads;
  if (file->Find("llama.attention.head_count_kv") != nullptr) {
    PAGEKV_RETURN_IF_ERROR(get("llama.attention.head_count_kv", c.num_kv_heads));
  }
  if (c.dim % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0) {
    return DataLossError("model heads do not divide: dim " + std::to_string(c.dim) + ", heads " +
                         std::to_string(c.num_heads) + ", kv heads " + std::to_string(c.num_kv_heads));
  }
  c.head_dim = c.dim / c.num_heads;
  if (c.head_dim % 2 != 0) return DataLossError("model head size " + std::to_string(c.head_dim) + " is odd");
  if (Result<double> eps = file->GetFloat("llama.attention.layer_norm_rms_epsilon"); eps.ok()) c.norm_eps = static_cast<float>(*eps);
  if (Result<double> theta = file->GetFloat("llama.rope.freq_base"); theta.ok()) c.rope_theta = static_cast<float>(*theta);
  const GgufValue* tokens = file->Find("tokenizer.ggml.tokens");
  const GgufTensor* emb = file->FindTensor("token_embd.weight");
  if (emb == nullptr || emb->dims.size() != 2) return DataLossError("model tensor 'token_embd.weight' is missing");
  c.vocab_size = static_cast<int32_t>(emb->dims[1]);
  if (tokens != nullptr && static_cast<int64_t>(tokens->elements.size()) != c.vocab_size) {
    return DataLossError("the tokenizer has " + std::to_string(tokens->elements.size()) +
                         " tokens but the embedding has " + std::to_string(c.vocab_size) + " rows");
  }
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  const GgufFile& f = *file;
  PAGEKV_ASSIGN_OR_RETURN(m->embedding_, Weight(f, "token_embd.weight", {c.dim, c.vocab_size}));
  PAGEKV_ASSIGN_OR_RETURN(m->final_norm_, Weight(f, "output_norm.weight", {c.dim}));
  if (f.FindTensor("output.weight") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(m->classifier_, Weight(f, "output.weight", {c.dim, c.vocab_size}));
  } else {
    m->classifier_ = m->embedding_;  // tied embeddings
  }
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer L{};
    PAGEKV_ASSIGN_OR_RETURN(L.attn_norm, Weight(f, p + "attn_norm.weight", {c.dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.wq, Weight(f, p + "attn_q.weight", {c.dim, c.dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.wk, Weight(f, p + "attn_k.weight", {c.dim, kv_dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.wv, Weight(f, p + "attn_v.weight", {c.dim, kv_dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.wo, Weight(f, p + "attn_output.weight", {c.dim, c.dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.ffn_norm, Weight(f, p + "ffn_norm.weight", {c.dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.w_gate, Weight(f, p + "ffn_gate.weight", {c.dim, c.hidden_dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.w_up, Weight(f, p + "ffn_up.weight", {c.dim, c.hidden_dim}));
    PAGEKV_ASSIGN_OR_RETURN(L.w_down, Weight(f, p + "ffn_down.weight", {c.hidden_dim, c.dim}));
    m->layers_.push_back(L);
  }
  m->file_ = std::move(file);
  return m;
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::FromLlama2c(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = "cannot open checkpoint '" + path + "': " + std::strerror(err);
    return err == ENOENT ? NotFoundError(msg) : IoError(msg);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 28) {
    ::close(fd);
    return DataLossError("checkpoint '" + path + "' is too small for a llama2.c header");
  }
  const auto size = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return IoError("cannot map '" + path + "'");
  std::shared_ptr<const std::byte> mapping(static_cast<const std::byte*>(p),
                                           [size](const std::byte* m) { munmap(const_cast<std::byte*>(m), size); });
  int32_t h[7];
  std::memcpy(h, mapping.get(), sizeof(h));
  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  LlamaConfig& c = m->config_;
  const bool shared = h[5] > 0;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.num_layers = h[2];
  c.num_heads = h[3];
  c.num_kv_heads = h[4];
  c.vocab_size = shared ? h[5] : -h[5];
  c.context_len = h[6];
  for (int32_t v : {c.dim, c.hidden_dim, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size, c.context_len}) {
    if (v <= 0 || v > (1 << 24)) {
      return DataLossError("checkpoint '" + path + "': header value " + std::to_string(v) +
                           " is out of range (not a llama2.c v0 checkpoint?)");
    }
  }
  if (c.dim % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0 || (c.dim / c.num_heads) % 2 != 0) {
    return DataLossError("checkpoint '" + path + "': heads do not divide the model dimension");
  }
  c.head_dim = c.dim / c.num_heads;
  const int64_t d = c.dim, hd = c.hidden_dim, L = c.num_layers, kv = int64_t{c.num_kv_heads} * c.head_dim;
  const int64_t floats = c.vocab_size * d + L * d + L * d * d + 2 * L * kv * d + L * d * d + L * d +
                         3 * L * hd * d + d + int64_t{c.context_len} * c.head_dim + (shared ? 0 : c.vocab_size * d);
  if (static_cast<uint64_t>(floats) * 4 + 28 > size) {
    return DataLossError("checkpoint '" + path + "' is truncated: the header needs " + std::to_string(floats * 4 + 28) +
                         " bytes, the file has " + std::to_string(size));
  }
  const float* w = reinterpret_cast<const float*>(mapping.get() + 28);
  auto take = [&](int64_t n) {
    const float* out = w;
    w += n;
    return out;
  };
  m->embedding_ = take(c.vocab_size * d);
  const float* rms_att = take(L * d);
  const float* wq = take(L * d * d);
  const float* wk = take(L * kv * d);
  const float* wv = take(L * kv * d);
  const float* wo = take(L * d * d);
  const float* rms_ffn = take(L * d);
  const float* w1 = take(L * hd * d);
  const float* w2 = take(L * d * hd);
  const float* w3 = take(L * hd * d);
  m->final_norm_ = take(d);
  take(int64_t{c.context_len} * c.head_dim);  // the legacy rope tables (freq_cis real and imaginary halves)
  m->classifier_ = shared ? m->embedding_ : take(c.vocab_size * d);
  for (int64_t l = 0; l < L; ++l) {
    m->layers_.push_back(Layer{rms_att + l * d, wq + l * d * d, wk + l * kv * d, wv + l * kv * d, wo + l * d * d,
                               rms_ffn + l * d, w1 + l * hd * d, w3 + l * hd * d, w2 + l * d * hd});
  }
  m->mapping_ = std::move(mapping);
  return m;
}

CacheConfig LlamaModel::CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const {
  CacheConfig cc;
  cc.num_layers = config_.num_layers;
  cc.num_q_heads = config_.num_heads;
  cc.num_kv_heads = config_.num_kv_heads;
  cc.head_dim = config_.head_dim;
  cc.block_len = block_len;
  cc.format = KvFormat::Plain(dtype);
  cc.num_blocks = num_blocks;
  return cc;
}

Result<bool> LlamaModel::Forward(KvCache& cache, SeqId seq, std::span<const int32_t> tokens, float* logits) const {
  const LlamaConfig& c = config_;
  const CacheConfig& cc = cache.layout().config();
  if (cc.num_layers != c.num_layers || cc.num_kv_heads != c.num_kv_heads || cc.head_dim != c.head_dim ||
      cc.num_q_heads != c.num_heads) {
    return InvalidArgumentError("the cache's geometry does not match the model: build it from CacheGeometry()");
  }
  if (!cc.format.IsPlainFloat()) return UnimplementedError("forward: KV format not supported");
  PAGEKV_ASSIGN_OR_RETURN(SequenceView before, cache.View(seq));
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0) return true;
  for (int32_t t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return InvalidArgumentError("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                  std::to_string(c.vocab_size) + ")");
    }
  }
  const int64_t start = before.num_tokens;
  if (start + n > c.context_len) {
    return OutOfRangeError("positions up to " + std::to_string(start + n) + " exceed the model's context of " +
                           std::to_string(c.context_len) + " tokens");
  }
  PAGEKV_ASSIGN_OR_RETURN(bool fit, cache.Reserve(seq, n));
  if (!fit) return false;
  Status s = Compute(cache, seq, tokens, start, logits);
  if (!s.ok()) {
    cache.Truncate(seq, start).IgnoreError();  // leave nothing half-written
    return s;
  }
  return true;
}

Status LlamaModel::Compute(KvCache& cache, SeqId seq, std::span<const int32_t> tokens, int64_t start,
                           float* logits) const {
  const LlamaConfig& c = config_;
  const CacheConfig& cc = cache.layout().config();
  const auto n = static_cast<int64_t>(tokens.size());

  const int32_t d = c.dim, kv_dim = c.num_kv_heads * c.head_dim, hd = c.hidden_dim;
  const size_t elem = static_cast<size_t>(DTypeBits(cc.format.dtype) / 8);
  std::vector<float> x(static_cast<size_t>(n * d)), xb(static_cast<size_t>(d)), q(static_cast<size_t>(n * d)),
      att(static_cast<size_t>(n * d)), k(static_cast<size_t>(kv_dim)), v(static_cast<size_t>(kv_dim)),
      h1(static_cast<size_t>(hd)), h2(static_cast<size_t>(hd)), tmp(static_cast<size_t>(d));
  std::vector<std::byte> k_rows(static_cast<size_t>(n * kv_dim) * elem), v_rows(k_rows.size());
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(embedding_ + static_cast<int64_t>(tokens[static_cast<size_t>(i)]) * d, d, x.begin() + i * d);
  }
  auto store = [&](const float* src, std::byte* dst) {
    for (int32_t j = 0; j < kv_dim; ++j) {
      switch (cc.format.dtype) {
        case DType::kF32: std::memcpy(dst + 4 * j, src + j, 4); break;
        case DType::kF16: { const uint16_t h = F32ToF16(src[j]); std::memcpy(dst + 2 * j, &h, 2); break; }
        default: { const uint16_t h = F32ToBF16(src[j]); std::memcpy(dst + 2 * j, &h, 2); break; }
      }
    }
  };
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = start + i;
      RmsNorm(&x[static_cast<size_t>(i * d)], L.attn_norm, d, c.norm_eps, xb.data());
      MatVec(L.wq, xb.data(), d, d, &q[static_cast<size_t>(i * d)]);
      MatVec(L.wk, xb.data(), kv_dim, d, k.data());
      MatVec(L.wv, xb.data(), kv_dim, d, v.data());
      Rope(&q[static_cast<size_t>(i * d)], d, c.head_dim, pos, c.rope_theta);
      Rope(k.data(), kv_dim, c.head_dim, pos, c.rope_theta);
      store(k.data(), k_rows.data() + static_cast<size_t>(i * kv_dim) * elem);
      store(v.data(), v_rows.data() + static_cast<size_t>(i * kv_dim) * elem);
    }
    PAGEKV_RETURN_IF_ERROR(cache.WriteLayer(seq, l, start, {n, k_rows.data(), v_rows.data()}));
    PAGEKV_ASSIGN_OR_RETURN(SequenceView view, cache.View(seq));
    const PrefillSeq ps{view.blocks, view.num_tokens, n};
    PAGEKV_RETURN_IF_ERROR(PagedPrefillAttention({&cache.layout(), cache.arena(), l}, {&ps, 1}, q.data(), att.data()));
    for (int64_t i = 0; i < n; ++i) {
      float* xi = &x[static_cast<size_t>(i * d)];
      MatVec(L.wo, &att[static_cast<size_t>(i * d)], d, d, tmp.data());
      for (int32_t j = 0; j < d; ++j) xi[j] += tmp[static_cast<size_t>(j)];
      RmsNorm(xi, L.ffn_norm, d, c.norm_eps, xb.data());
      MatVec(L.w_gate, xb.data(), hd, d, h1.data());
      MatVec(L.w_up, xb.data(), hd, d, h2.data());
      for (int32_t j = 0; j < hd; ++j) {
        const float g = h1[static_cast<size_t>(j)];
        h1[static_cast<size_t>(j)] = g / (1.0f + std::exp(-g)) * h2[static_cast<size_t>(j)];
      }
      MatVec(L.w_down, h1.data(), d, hd, tmp.data());
      for (int32_t j = 0; j < d; ++j) xi[j] += tmp[static_cast<size_t>(j)];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    RmsNorm(&x[static_cast<size_t>(i * d)], final_norm_, d, c.norm_eps, xb.data());
    MatVec(classifier_, xb.data(), c.vocab_size, d, logits + i * c.vocab_size);
  }
  return Status::Ok();
}

}  // namespace pagekv
