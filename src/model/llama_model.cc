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

const GgufTensor* FindShaped(const GgufFile& f, const std::string& name, const std::vector<int64_t>& dims,
                            Status* error) {
  const GgufTensor* t = f.FindTensor(name);
  if (t == nullptr) {
    *error = DataLossError("model tensor '" + name + "' is missing");
  } else if (t->dims != dims) {
    *error = DataLossError("model tensor '" + name + "' has shape " + ShapeString(t->dims) + ", expected " +
                           ShapeString(dims));
    t = nullptr;
  }
  return t;
}

float ElementToF32(GgmlType type, const std::byte* p, int64_t i) {
  uint16_t h;
  switch (type) {
    case GgmlType::kF32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case GgmlType::kF16: std::memcpy(&h, p + 2 * i, 2); return F16ToF32(h);
    case GgmlType::kBF16: std::memcpy(&h, p + 2 * i, 2); return BF16ToF32(h);
    case GgmlType::kQ8_0: {
      const std::byte* block = p + (i / 32) * 34;
      std::memcpy(&h, block, 2);
      return F16ToF32(h) * static_cast<float>(static_cast<int8_t>(block[2 + i % 32]));
    }
  }
  return 0.0f;
}

}  // namespace

void LlamaModel::Row(const Matrix& m, int64_t r, float* out) {
  const int64_t row_bytes = m.type == GgmlType::kQ8_0 ? m.cols / 32 * 34 : m.cols * (m.type == GgmlType::kF32 ? 4 : 2);
  const std::byte* p = m.data + r * row_bytes;
  for (int64_t c = 0; c < m.cols; ++c) out[c] = ElementToF32(m.type, p, c);
}

// out[r] = W[r][:] . x
void LlamaModel::MatVec(const Matrix& m, const float* x, float* out) {
  if (m.type == GgmlType::kF32) {
    const auto* w = reinterpret_cast<const float*>(m.data);
    for (int64_t r = 0; r < m.rows; ++r) {
      const float* row = w + r * m.cols;
      float sum = 0.0f;
      for (int64_t c = 0; c < m.cols; ++c) sum += row[c] * x[c];
      out[r] = sum;
    }
    return;
  }
  if (m.type == GgmlType::kQ8_0) {
    const int64_t blocks = m.cols / 32;
    for (int64_t r = 0; r < m.rows; ++r) {
      const std::byte* row = m.data + r * blocks * 34;
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        uint16_t h;
        std::memcpy(&h, row + b * 34, 2);
        float dot = 0.0f;
        for (int i = 0; i < 32; ++i) dot += static_cast<float>(static_cast<int8_t>(row[b * 34 + 2 + i])) * x[b * 32 + i];
        sum += F16ToF32(h) * dot;
      }
      out[r] = sum;
    }
    return;
  }
  // f16 / bf16: convert in the loop (no scratch allocation per call).
  const int64_t row_bytes = m.cols * 2;
  for (int64_t r = 0; r < m.rows; ++r) {
    const std::byte* row = m.data + r * row_bytes;
    float sum = 0.0f;
    for (int64_t c = 0; c < m.cols; ++c) sum += ElementToF32(m.type, row, c) * x[c];
    out[r] = sum;
  }
}

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
  LlamaModel* model = m.get();
  // ggml dims are {cols, rows}: dims[0] is the contiguous one.
  auto matrix = [&f](const std::string& name, int64_t rows, int64_t cols) -> Result<Matrix> {
    Status error;
    const GgufTensor* t = FindShaped(f, name, {cols, rows}, &error);
    if (t == nullptr) return error;
    return Matrix{t->data, t->type, rows, cols};
  };
  auto vec = [&f, model](const std::string& name, int64_t n) -> Result<const float*> {
    Status error;
    const GgufTensor* t = FindShaped(f, name, {n}, &error);
    if (t == nullptr) return error;
    if (t->type == GgmlType::kF32) return reinterpret_cast<const float*>(t->data);
    std::vector<float>& out = model->converted_.emplace_back(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = ElementToF32(t->type, t->data, i);
    return out.data();
  };
  PAGEKV_ASSIGN_OR_RETURN(m->embedding_, matrix("token_embd.weight", c.vocab_size, c.dim));
  PAGEKV_ASSIGN_OR_RETURN(m->final_norm_, vec("output_norm.weight", c.dim));
  if (f.FindTensor("output.weight") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(m->classifier_, matrix("output.weight", c.vocab_size, c.dim));
  } else {
    m->classifier_ = m->embedding_;  // tied embeddings
  }
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer L{};
    PAGEKV_ASSIGN_OR_RETURN(L.attn_norm, vec(p + "attn_norm.weight", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wq, matrix(p + "attn_q.weight", c.dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wk, matrix(p + "attn_k.weight", kv_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wv, matrix(p + "attn_v.weight", kv_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wo, matrix(p + "attn_output.weight", c.dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.ffn_norm, vec(p + "ffn_norm.weight", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_gate, matrix(p + "ffn_gate.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_up, matrix(p + "ffn_up.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_down, matrix(p + "ffn_down.weight", c.dim, c.hidden_dim));
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
  auto f32 = [](const float* p, int64_t rows, int64_t cols) {
    return Matrix{reinterpret_cast<const std::byte*>(p), GgmlType::kF32, rows, cols};
  };
  m->embedding_ = f32(take(c.vocab_size * d), c.vocab_size, d);
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
  m->classifier_ = shared ? m->embedding_ : f32(take(c.vocab_size * d), c.vocab_size, d);
  for (int64_t l = 0; l < L; ++l) {
    m->layers_.push_back(Layer{rms_att + l * d, f32(wq + l * d * d, d, d), f32(wk + l * kv * d, kv, d),
                               f32(wv + l * kv * d, kv, d), f32(wo + l * d * d, d, d), rms_ffn + l * d,
                               f32(w1 + l * hd * d, hd, d), f32(w3 + l * hd * d, hd, d), f32(w2 + l * d * hd, d, hd)});
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
    Row(embedding_, tokens[static_cast<size_t>(i)], &x[static_cast<size_t>(i * d)]);
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
      MatVec(L.wq, xb.data(), &q[static_cast<size_t>(i * d)]);
      MatVec(L.wk, xb.data(), k.data());
      MatVec(L.wv, xb.data(), v.data());
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
      MatVec(L.wo, &att[static_cast<size_t>(i * d)], tmp.data());
      for (int32_t j = 0; j < d; ++j) xi[j] += tmp[static_cast<size_t>(j)];
      RmsNorm(xi, L.ffn_norm, d, c.norm_eps, xb.data());
      MatVec(L.w_gate, xb.data(), h1.data());
      MatVec(L.w_up, xb.data(), h2.data());
      for (int32_t j = 0; j < hd; ++j) {
        const float g = h1[static_cast<size_t>(j)];
        h1[static_cast<size_t>(j)] = g / (1.0f + std::exp(-g)) * h2[static_cast<size_t>(j)];
      }
      MatVec(L.w_down, h1.data(), tmp.data());
      for (int32_t j = 0; j < d; ++j) xi[j] += tmp[static_cast<size_t>(j)];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    RmsNorm(&x[static_cast<size_t>(i * d)], final_norm_, d, c.norm_eps, xb.data());
    MatVec(classifier_, xb.data(), logits + i * c.vocab_size);
  }
  return Status::Ok();
}

}  // namespace pagekv
