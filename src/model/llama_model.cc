#include "model/llama_model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include "base/regular_file.h"
#include "base/thread_pool.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "layout/float16.h"
#include "pagekv/attention.h"

namespace pagekv {
namespace {

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

WeightType ToWeightType(GgmlType type) { return WeightTypeOf(static_cast<uint32_t>(type)).value_or(WeightType::kF32); }

// Adds the seconds of its lifetime to *sink when there is one.
class Stopwatch {
 public:
  explicit Stopwatch(double* sink) : sink_(sink), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() {
    if (sink_ != nullptr) *sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;

 private:
  double* sink_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

namespace {

// What the runner does with each key under "<arch>.": read (and used), or
// known to change nothing. Every other key is refused by name: a model that
// needs something the runner does not do must not run silently wrong.
bool KnownArchKey(std::string_view key) {
  static constexpr std::string_view kKnown[] = {
      "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
      "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
      "attention.value_length", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
      "rope.scaling.original_context_length", "rope.scaling.attn_factor", "rope.scaling.finetuned",
      "rope.scaling.low_freq_factor", "rope.scaling.high_freq_factor", "vocab_size",
      "expert_count", "expert_used_count", "tensor_data_layout",
  };
  for (std::string_view k : kKnown) {
    if (key == k) return true;
  }
  return false;
}

// A tensor name the runner reads: "blk.<n>.<part>" or a global one.
bool KnownTensor(const std::string& name, int32_t layers) {
  static constexpr std::string_view kGlobal[] = {"token_embd.weight", "output_norm.weight", "output.weight",
                                                 "rope_freqs.weight"};
  for (std::string_view g : kGlobal) {
    if (name == g) return true;
  }
  if (name.rfind("blk.", 0) != 0) return false;
  const size_t dot = name.find('.', 4);
  if (dot == std::string::npos) return false;
  char* end = nullptr;
  const long l = std::strtol(name.c_str() + 4, &end, 10);
  if (end != name.c_str() + dot || l < 0 || l >= layers) return false;
  static constexpr std::string_view kParts[] = {
      "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_norm.weight",
      "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
      "attn_output.bias"};
  const std::string_view part = std::string_view(name).substr(dot + 1);
  for (std::string_view p : kParts) {
    if (part == p) return true;
  }
  return false;
}

}  // namespace

Result<std::unique_ptr<LlamaModel>> LlamaModel::FromGguf(std::unique_ptr<GgufFile> file) {
  PAGEKV_ASSIGN_OR_RETURN(std::string arch, file->GetString("general.architecture"));
  if (arch != "llama" && arch != "qwen2") {
    return UnimplementedError("model metadata general.architecture = '" + arch +
                              "' is not supported: PageKV runs llama (also Mistral-style files) and qwen2");
  }
  const std::string a = arch + ".";
  for (const auto& [key, value] : file->metadata()) {
    if (key.rfind(a, 0) != 0) continue;
    const std::string rest = key.substr(a.size());
    if (!KnownArchKey(rest)) {
      return UnimplementedError("model metadata '" + key + "' is not supported by PageKV's " + arch +
                                " runner (sliding windows, soft-capping and the like change the model; refusing "
                                "rather than running it wrong)");
    }
  }
  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  LlamaConfig& c = m->config_;
  c.arch = arch;
  auto get = [&](const std::string& key, int32_t& out) -> Status {
    PAGEKV_ASSIGN_OR_RETURN(int64_t v, file->GetInt(a + key));
    if (v <= 0 || v > (1 << 24)) return DataLossError("model metadata " + a + key + " = " + std::to_string(v) + " is out of range");
    out = static_cast<int32_t>(v);
    return Status::Ok();
  };
  PAGEKV_RETURN_IF_ERROR(get("embedding_length", c.dim));
  PAGEKV_RETURN_IF_ERROR(get("feed_forward_length", c.hidden_dim));
  PAGEKV_RETURN_IF_ERROR(get("block_count", c.num_layers));
  PAGEKV_RETURN_IF_ERROR(get("attention.head_count", c.num_heads));
  PAGEKV_RETURN_IF_ERROR(get("context_length", c.context_len));
  c.num_kv_heads = c.num_heads;
  if (file->Find(a + "attention.head_count_kv") != nullptr) {
    PAGEKV_RETURN_IF_ERROR(get("attention.head_count_kv", c.num_kv_heads));
  }
  if (c.dim % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0) {
    return DataLossError("model heads do not divide: dim " + std::to_string(c.dim) + ", heads " +
                         std::to_string(c.num_heads) + ", kv heads " + std::to_string(c.num_kv_heads));
  }
  c.head_dim = c.dim / c.num_heads;
  if (c.head_dim % 2 != 0) return DataLossError("model head size " + std::to_string(c.head_dim) + " is odd");
  for (const char* key : {"attention.key_length", "attention.value_length"}) {
    if (file->Find(a + key) == nullptr) continue;
    int32_t v = 0;
    PAGEKV_RETURN_IF_ERROR(get(key, v));
    if (v != c.head_dim) {
      return UnimplementedError("model metadata " + a + key + " = " + std::to_string(v) +
                                " differs from embedding_length / head_count = " + std::to_string(c.head_dim) +
                                ": heads of another width than dim / heads are not supported");
    }
  }
  for (const char* key : {"expert_count", "expert_used_count"}) {
    if (Result<int64_t> v = file->GetInt(a + key); v.ok() && *v != 0) {
      return UnimplementedError("model metadata " + a + key + " = " + std::to_string(*v) +
                                ": mixture-of-experts models are not supported by the " + arch + " runner");
    }
  }
  if (Result<double> eps = file->GetFloat(a + "attention.layer_norm_rms_epsilon"); eps.ok()) c.norm_eps = static_cast<float>(*eps);
  if (Result<double> theta = file->GetFloat(a + "rope.freq_base"); theta.ok()) c.rope_theta = static_cast<float>(*theta);
  c.rope_dims = c.head_dim;
  if (file->Find(a + "rope.dimension_count") != nullptr) {
    PAGEKV_RETURN_IF_ERROR(get("rope.dimension_count", c.rope_dims));
    if (c.rope_dims > c.head_dim || c.rope_dims % 2 != 0) {
      return DataLossError("model metadata " + a + "rope.dimension_count = " + std::to_string(c.rope_dims) +
                           " must be even and at most the head size " + std::to_string(c.head_dim));
    }
  }
  c.rope_halves = arch == "qwen2";
  std::string scaling = "none";
  if (file->Find(a + "rope.scaling.type") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(scaling, file->GetString(a + "rope.scaling.type"));
  }
  double factor = 1.0;
  if (Result<double> f = file->GetFloat(a + "rope.scaling.factor"); f.ok() && *f != 0.0) factor = *f;
  if (scaling == "none") {
    c.rope_scaling = LlamaConfig::RopeScaling::kNone;
  } else if (scaling == "linear" || scaling == "yarn") {
    if (!(factor > 0.0) || !std::isfinite(factor)) {
      return DataLossError("model metadata " + a + "rope.scaling.factor = " + std::to_string(factor) + " must be positive");
    }
    c.rope_scaling = scaling == "linear" ? LlamaConfig::RopeScaling::kLinear : LlamaConfig::RopeScaling::kYarn;
    c.rope_freq_scale = static_cast<float>(1.0 / factor);
    c.rope_orig_context = c.context_len;
    if (file->Find(a + "rope.scaling.original_context_length") != nullptr) {
      PAGEKV_RETURN_IF_ERROR(get("rope.scaling.original_context_length", c.rope_orig_context));
    }
    if (Result<double> af = file->GetFloat(a + "rope.scaling.attn_factor"); af.ok() && *af != 0.0) {
      c.rope_attn_factor = static_cast<float>(*af);
    }
  } else if (scaling == "llama3") {
    if (!(factor >= 1.0) || !std::isfinite(factor)) {
      return DataLossError("model metadata " + a + "rope.scaling.factor = " + std::to_string(factor) + " must be at least 1");
    }
    c.rope_scaling = LlamaConfig::RopeScaling::kLlama3;
    c.rope_factor = static_cast<float>(factor);
    c.rope_orig_context = c.context_len;
    if (file->Find(a + "rope.scaling.original_context_length") != nullptr) {
      PAGEKV_RETURN_IF_ERROR(get("rope.scaling.original_context_length", c.rope_orig_context));
    }
    if (Result<double> lo = file->GetFloat(a + "rope.scaling.low_freq_factor"); lo.ok()) {
      c.rope_low_freq_factor = static_cast<float>(*lo);
    }
    if (Result<double> hi = file->GetFloat(a + "rope.scaling.high_freq_factor"); hi.ok()) {
      c.rope_high_freq_factor = static_cast<float>(*hi);
    }
    if (!(c.rope_low_freq_factor > 0.0f) || !(c.rope_high_freq_factor > c.rope_low_freq_factor) ||
        c.rope_orig_context <= 0) {
      return DataLossError("model metadata " + a + "rope.scaling: llama3 scaling needs 0 < low_freq_factor < "
                           "high_freq_factor and a positive original_context_length");
    }
  } else {
    return UnimplementedError("model metadata " + a + "rope.scaling.type = '" + scaling +
                              "' is not supported: PageKV implements none, linear, yarn and llama3 (and rope_freqs "
                              "factors); override the file or convert the model without it");
  }
  {
    const int32_t layers = c.num_layers;
    for (const GgufTensor& t : file->tensors()) {
      if (!KnownTensor(t.name, layers)) {
        return UnimplementedError("model tensor '" + t.name + "' is not used by PageKV's " + arch +
                                  " runner (another architecture or variant); refusing rather than ignoring it");
      }
    }
  }
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
    return Matrix{t->data, ToWeightType(t->type), rows, cols};
  };
  auto vec = [&f, model](const std::string& name, int64_t n) -> Result<const float*> {
    Status error;
    const GgufTensor* t = FindShaped(f, name, {n}, &error);
    if (t == nullptr) return error;
    if (t->type == GgmlType::kF32) return reinterpret_cast<const float*>(t->data);
    std::vector<float>& out = model->converted_.emplace_back(static_cast<size_t>(n));
    WeightRow({t->data, ToWeightType(t->type), 1, n}, 0, out.data());
    return out.data();
  };
  PAGEKV_ASSIGN_OR_RETURN(m->embedding_, matrix("token_embd.weight", c.vocab_size, c.dim));
  PAGEKV_ASSIGN_OR_RETURN(m->final_norm_, vec("output_norm.weight", c.dim));
  if (f.FindTensor("output.weight") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(m->classifier_, matrix("output.weight", c.vocab_size, c.dim));
  } else {
    m->classifier_ = m->embedding_;  // tied embeddings
  }
  if (f.FindTensor("rope_freqs.weight") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(const float* ff, vec("rope_freqs.weight", c.rope_dims / 2));
    m->rope_freqs_.assign(ff, ff + c.rope_dims / 2);
    for (float x : m->rope_freqs_) {
      if (!(x > 0.0f) || !std::isfinite(x)) return DataLossError("model tensor 'rope_freqs.weight' holds a factor that is not positive");
    }
    c.rope_freq_factors = true;
  } else if (c.rope_scaling == LlamaConfig::RopeScaling::kLlama3) {
    // Llama 3.1's rule (what converters bake into rope_freqs): wavelengths
    // shorter than orig / high_freq_factor keep their frequency, longer than
    // orig / low_freq_factor are divided by `factor`, a smooth blend between.
    const double orig = c.rope_orig_context, lo = c.rope_low_freq_factor, hi = c.rope_high_freq_factor;
    for (int32_t i = 0; i < c.rope_dims / 2; ++i) {
      const double freq = std::pow(static_cast<double>(c.rope_theta), -2.0 * i / c.rope_dims);
      const double wavelen = 2 * M_PI / freq;
      double divide = 1.0;
      if (wavelen > orig / lo) {
        divide = c.rope_factor;
      } else if (wavelen >= orig / hi) {
        const double smooth = (orig / wavelen - lo) / (hi - lo);
        divide = 1.0 / ((1 - smooth) / c.rope_factor + smooth);
      }
      m->rope_freqs_.push_back(static_cast<float>(divide));
    }
    c.rope_freq_factors = true;
  }
  auto bias = [&](const std::string& name, int64_t n) -> Result<const float*> {
    if (f.FindTensor(name) == nullptr) return static_cast<const float*>(nullptr);
    return vec(name, n);
  };
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer L{};
    PAGEKV_ASSIGN_OR_RETURN(L.bq, bias(p + "attn_q.bias", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.bk, bias(p + "attn_k.bias", kv_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.bv, bias(p + "attn_v.bias", kv_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.bo, bias(p + "attn_output.bias", c.dim));
    if (arch == "qwen2" && (L.bq == nullptr || L.bk == nullptr || L.bv == nullptr)) {
      return DataLossError("model tensor '" + p + "attn_q.bias' (or its k / v sibling) is missing: qwen2 layers have q, k and v biases");
    }
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
  m->BuildRope();
  PAGEKV_RETURN_IF_ERROR(m->PackWeights());
  return m;
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::FromLlama2c(const std::string& path) {
  PAGEKV_ASSIGN_OR_RETURN(RegularFile rf, OpenRegularFile(path, "checkpoint"));
  const int fd = rf.fd;
  if (rf.size < 28) {
    ::close(fd);
    return DataLossError("checkpoint '" + path + "' is too small for a llama2.c header");
  }
  const auto size = static_cast<size_t>(rf.size);
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
  c.rope_dims = c.head_dim;
  const int64_t d = c.dim, hd = c.hidden_dim, L = c.num_layers, kv = int64_t{c.num_kv_heads} * c.head_dim;
  const int64_t floats = c.vocab_size * d + L * d + L * d * d + 2 * L * kv * d + L * d * d + L * d +
                         3 * L * hd * d + d + int64_t{c.context_len} * c.head_dim + (shared ? 0 : c.vocab_size * d);
  if (static_cast<uint64_t>(floats) * 4 + 28 > size) {
    return DataLossError("checkpoint '" + path + "' is truncated: the header needs " + std::to_string(floats * 4 + 28) +
                         " bytes, the file has " + std::to_string(size));
  }
  if (static_cast<uint64_t>(floats) * 4 + 28 != size) {
    // The header describes a smaller model than the file holds: its weights
    // would be read at the wrong offsets (garbage, not an error) if loaded.
    return DataLossError("checkpoint '" + path + "': its header describes " + std::to_string(floats * 4 + 28) +
                         " bytes, the file has " + std::to_string(size) +
                         " (a header from another model, or extra data appended)");
  }
  const float* w = reinterpret_cast<const float*>(mapping.get() + 28);
  auto take = [&](int64_t n) {
    const float* out = w;
    w += n;
    return out;
  };
  auto f32 = [](const float* p, int64_t rows, int64_t cols) {
    return Matrix{reinterpret_cast<const std::byte*>(p), WeightType::kF32, rows, cols};
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
  m->BuildRope();
  PAGEKV_RETURN_IF_ERROR(m->PackWeights());
  return m;
}

namespace {

// Drops the pages wholly inside [p, p + n) of a read-only private file
// mapping from this process: a packed copy replaced them, so keeping them
// would count the weights twice in the resident set. Should anything read
// them again they come back from the file: this changes memory, never data.
// Only for file mappings: on anonymous memory MADV_DONTNEED zeroes pages.
void ReleaseFilePages(const std::byte* p, int64_t n) {
  const long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0 || n <= 0) return;
  const auto page = static_cast<uintptr_t>(page_size);
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace

void LlamaModel::BuildRope() {
  const LlamaConfig& c = config_;
  RopeParams p;
  p.head_dim = c.head_dim;
  p.rope_dims = c.rope_dims;
  p.halves = c.rope_halves;
  p.theta = c.rope_theta;
  p.freq_scale = c.rope_freq_scale;
  p.yarn = c.rope_scaling == LlamaConfig::RopeScaling::kYarn;
  p.yarn_attn_factor = c.rope_attn_factor;
  p.yarn_orig_context = c.rope_orig_context;
  p.freq_divisors = rope_freqs_;
  rope_ = std::make_shared<const Rope>(std::move(p));
}

Status LlamaModel::PackWeights() {
  // GGUF opened from a file, or a llama2.c checkpoint (always mapped).
  const bool file_backed = file_ == nullptr || file_->mapped();
  const std::byte* embedding = embedding_.data;
  auto pack = [&](Matrix& m) -> Status {
    if (IsBlockQuantized(m.type) || m.panels) return Status::Ok();
    PAGEKV_ASSIGN_OR_RETURN(PackedWeights p, PackedWeights::Pack(m));
    // The embedding's rows are still looked up from the file.
    if (file_backed && m.data != embedding) ReleaseFilePages(m.data, m.rows * WeightRowBytes(m.type, m.cols));
    m = p.matrix();
    packed_.push_back(std::move(p));
    return Status::Ok();
  };
  // The embedding stays row-major: a lookup reads one row, which panels
  // would scatter over 16x the cache lines. A tied classifier gets its own
  // panel copy.
  tied_embeddings_ = classifier_.data == embedding_.data;
  PAGEKV_RETURN_IF_ERROR(pack(classifier_));
  for (Layer& L : layers_) {
    for (Matrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) PAGEKV_RETURN_IF_ERROR(pack(*m));
  }
  return Status::Ok();
}

int64_t LlamaModel::StepWeightBytes() const {
  auto bytes = [](const Matrix& m) { return m.rows * WeightRowBytes(m.type, m.cols); };
  int64_t total = bytes(classifier_);
  for (const Layer& L : layers_) {
    for (const Matrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) total += bytes(*m);
  }
  return total;
}

int64_t LlamaModel::MatrixMultiplyAddsPerToken() const {
  int64_t total = classifier_.rows * classifier_.cols;
  for (const Layer& L : layers_) {
    for (const Matrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) total += m->rows * m->cols;
  }
  return total;
}

int64_t LlamaModel::ParameterCount() const {
  const int64_t norms = int64_t{config_.dim} * (2 * config_.num_layers + 1);
  return MatrixMultiplyAddsPerToken() + norms + (tied_embeddings_ ? 0 : embedding_.rows * embedding_.cols);
}

CacheConfig LlamaModel::CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const {
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

// The rows of one step: item i owns rows [first[i], first[i] + n_i).
struct LlamaModel::Batch {
  std::vector<int64_t> first;
  std::vector<int64_t> pos;  // per row
  int64_t rows = 0;
};

Status LlamaModel::CheckStep(std::span<const StepItem> items, const KvLayout& layout) const {
  const LlamaConfig& c = config_;
  const CacheConfig& cc = layout.config();
  if (cc.num_layers != c.num_layers || cc.num_kv_heads != c.num_kv_heads || cc.head_dim != c.head_dim ||
      cc.num_q_heads != c.num_heads) {
    return InvalidArgumentError("the cache's geometry does not match the model: build it from CacheGeometry()");
  }
  for (int32_t l = 0; l < cc.num_layers; ++l) {
    const KvFormat& f = cc.FormatOf(l);
    if (!f.IsPlainFloat() && !f.IsStoredQuantized(c.head_dim) && !f.IsKivi()) {
      return UnimplementedError("forward: KV format " + f.ToString() + " (layer " + std::to_string(l) + ") not supported");
    }
  }
  for (const StepItem& item : items) {
    const auto n = static_cast<int64_t>(item.tokens.size());
    if (n == 0) return InvalidArgumentError("a step item has no tokens");
    for (int32_t t : item.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return InvalidArgumentError("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                    std::to_string(c.vocab_size) + ")");
      }
    }
    if (item.position < 0 || item.position + n > c.context_len) {
      return OutOfRangeError("positions up to " + std::to_string(item.position + n) +
                             " exceed the model's context of " + std::to_string(c.context_len) + " tokens");
    }
    if (item.score_queries < 0 || item.score_queries > n) {
      return InvalidArgumentError("a step item's score_queries " + std::to_string(item.score_queries) +
                                  " is outside [0, its " + std::to_string(n) + " tokens]");
    }
  }
  return Status::Ok();
}

Status LlamaModel::Forward(std::span<const StepItem> items, StepKv& kv, const ForwardOptions& options) const {
  Stopwatch total(options.timings != nullptr ? &options.timings->total : nullptr);
  PAGEKV_RETURN_IF_ERROR(CheckStep(items, kv.layout()));
  Batch batch;
  for (const StepItem& item : items) {
    const auto n = static_cast<int64_t>(item.tokens.size());
    batch.first.push_back(batch.rows);
    for (int64_t i = 0; i < n; ++i) batch.pos.push_back(item.position + i);
    batch.rows += n;
  }
  if (items.empty()) return Status::Ok();
  return Compute(items, kv, batch, options);
}

namespace {

// Per-thread scratch for Compute's activations, reused from step to step: a
// long step's buffers are tens of MiB, which allocated fresh every step cost
// page faults and zero-filling. Contents are not cleared; every use writes
// its rows before reading them.
template <typename T>
std::span<T> Scratch(size_t slot, size_t n) {
  thread_local std::vector<std::vector<T>> pool;
  if (pool.size() <= slot) pool.resize(slot + 1);
  if (pool[slot].size() < n) pool[slot].resize(n);
  return {pool[slot].data(), n};
}

}  // namespace

Status LlamaModel::Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                           const ForwardOptions& options) const {
  const LlamaConfig& c = config_;
  const KvLayout& layout = kv.layout();
  const CacheConfig& cc = layout.config();
  const Backend& be = options.backend != nullptr ? *options.backend : CpuBackend();
  const int64_t T = batch.rows;
  const int32_t d = c.dim, kv_dim = c.num_kv_heads * c.head_dim, hd = c.hidden_dim;
  double* matmul_time = options.timings != nullptr ? &options.timings->matmul : nullptr;
  double* attention_time = options.timings != nullptr ? &options.timings->attention : nullptr;
  size_t slot = 0;
  auto rows = [&slot](int64_t n, int64_t width) { return Scratch<float>(slot++, static_cast<size_t>(n * width)); };
  const std::span<float> x = rows(T, d), xb = rows(T, d), q = rows(T, d), att = rows(T, d), tmp = rows(T, d),
                         k = rows(T, kv_dim), v = rows(T, kv_dim), h1 = rows(T, hd), h2 = rows(T, hd);
  // Bytes of one token's K (or V) rows over all KV heads, as the cache
  // stores them: the buffers fit the widest layer; each layer uses its own.
  int64_t widest_row = 0;
  for (int32_t l = 0; l < c.num_layers; ++l) widest_row = std::max(widest_row, layout.row_bytes(l));
  const std::span<std::byte> k_rows = Scratch<std::byte>(0, static_cast<size_t>(T * widest_row * c.num_kv_heads)),
                             v_rows = Scratch<std::byte>(1, k_rows.size());
  auto matmul = [&](const Matrix& w, const float* in, int64_t n, float* out) {
    Stopwatch watch(matmul_time);
    return be.MatMul(w, in, n, out, options.threads, options.activations);
  };
  auto matmul_shared = [&](std::initializer_list<MatMulOutput> outputs, const float* in, int64_t n) {
    Stopwatch watch(matmul_time);
    return be.MatMulShared({outputs.begin(), outputs.size()}, in, n, options.threads, options.activations);
  };
  for (int64_t t = 0; t < T; ++t) {
    const size_t item = static_cast<size_t>(
        std::upper_bound(batch.first.begin(), batch.first.end(), t) - batch.first.begin() - 1);
    be.WeightRow(embedding_, items[item].tokens[static_cast<size_t>(t - batch.first[item])], &x[static_cast<size_t>(t * d)]);
  }
  // Per-row work (norms, rotary, K/V conversion, residuals, SiLU) of a long
  // step is split over the pool in chunks of rows, so the second core does
  // not wait through it; a decode step's few rows stay on this thread.
  auto for_rows = [&options](int64_t n, const auto& fn) {  // fn(first row, end row)
    constexpr int64_t kChunk = 64;
    if (n < 2 * kChunk || options.threads == 1) {
      fn(int64_t{0}, n);
      return;
    }
    ThreadPool::Shared().ParallelFor((n + kChunk - 1) / kChunk, options.threads,
                                     [&](int64_t i) { fn(i * kChunk, std::min(n, (i + 1) * kChunk)); });
  };
  // Rotary tables per row, shared by every layer (kernels/ops.h).
  const int32_t rope_dims = c.rope_dims;
  const std::span<float> rope_cos = rows(T, rope_dims), rope_sin = rows(T, rope_dims);
  for_rows(T, [&](int64_t t0, int64_t t1) {
    be.RopeTables(*rope_, std::span<const int64_t>(batch.pos).subspan(static_cast<size_t>(t0), static_cast<size_t>(t1 - t0)),
                  &rope_cos[static_cast<size_t>(t0 * rope_dims)], &rope_sin[static_cast<size_t>(t0 * rope_dims)]);
  });
  auto add_bias = [&](float* rows_out, int64_t n, int64_t width, const float* bias) {
    if (bias != nullptr) be.AddBiasRows(rows_out, bias, n, width);
  };
  const bool decode_only = static_cast<int64_t>(items.size()) == T;
  std::vector<PrefillSeq> prefill(items.size());
  std::vector<DecodeSeq> decode(items.size());
  AttentionOptions attention_options;
  attention_options.num_threads = options.threads;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    for_rows(T, [&](int64_t t0, int64_t t1) {
      be.RmsNormRows(&x[static_cast<size_t>(t0 * d)], L.attn_norm, t1 - t0, d, c.norm_eps, &xb[static_cast<size_t>(t0 * d)]);
    });
    PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.wq, q.data()}, {L.wk, k.data()}, {L.wv, v.data()}}, xb.data(), T));
    add_bias(q.data(), T, d, L.bq);
    add_bias(k.data(), T, kv_dim, L.bk);
    add_bias(v.data(), T, kv_dim, L.bv);
    const KvFormat& format = cc.FormatOf(l);
    const auto token_bytes = static_cast<size_t>(layout.row_bytes(l) * c.num_kv_heads);
    for_rows(T, [&](int64_t t0, int64_t t1) {
      const auto first = static_cast<size_t>(t0);
      const float* cs = &rope_cos[first * static_cast<size_t>(rope_dims)];
      const float* sn = &rope_sin[first * static_cast<size_t>(rope_dims)];
      be.RopeApply(*rope_, &q[first * static_cast<size_t>(d)], t1 - t0, d, cs, sn);
      be.RopeApply(*rope_, &k[first * static_cast<size_t>(kv_dim)], t1 - t0, kv_dim, cs, sn);
      const int64_t heads = (t1 - t0) * c.num_kv_heads;
      be.EncodeKvRows(format, c.head_dim, k.data() + first * kv_dim, heads, k_rows.data() + first * token_bytes);
      be.EncodeKvRows(format, c.head_dim, v.data() + first * kv_dim, heads, v_rows.data() + first * token_bytes);
    });
    for (size_t i = 0; i < items.size(); ++i) {
      const auto n = static_cast<int64_t>(items[i].tokens.size());
      const size_t offset = static_cast<size_t>(batch.first[i]) * token_bytes;
      PAGEKV_ASSIGN_OR_RETURN(const KvSpan view, kv.Store(i, l, k_rows.data() + offset, v_rows.data() + offset));
      float* scores = items[i].scores == nullptr
                          ? nullptr
                          : items[i].scores + static_cast<int64_t>(l) * c.num_kv_heads * view.num_tokens;
      prefill[i] = {view.blocks, view.num_tokens, n, scores, items[i].score_queries, view.tail};
      decode[i] = {view.blocks, view.num_tokens, scores, view.tail};
    }
    {
      Stopwatch watch(attention_time);
      const PagedKv paged{&layout, kv.arena(), l};
      PAGEKV_RETURN_IF_ERROR(decode_only ? be.DecodeAttention(paged, decode, q.data(), att.data(), attention_options)
                                         : be.PrefillAttention(paged, prefill, q.data(), att.data(), attention_options));
    }
    PAGEKV_RETURN_IF_ERROR(matmul(L.wo, att.data(), T, tmp.data()));
    add_bias(tmp.data(), T, d, L.bo);
    for_rows(T, [&](int64_t t0, int64_t t1) {
      be.AddInPlace(&x[static_cast<size_t>(t0 * d)], &tmp[static_cast<size_t>(t0 * d)], (t1 - t0) * d);
      be.RmsNormRows(&x[static_cast<size_t>(t0 * d)], L.ffn_norm, t1 - t0, d, c.norm_eps, &xb[static_cast<size_t>(t0 * d)]);
    });
    PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.w_gate, h1.data()}, {L.w_up, h2.data()}}, xb.data(), T));
    for_rows(T, [&](int64_t t0, int64_t t1) {
      be.SwiGluInPlace(&h1[static_cast<size_t>(t0 * hd)], &h2[static_cast<size_t>(t0 * hd)], (t1 - t0) * hd);
    });
    PAGEKV_RETURN_IF_ERROR(matmul(L.w_down, h1.data(), T, tmp.data()));
    for_rows(T, [&](int64_t t0, int64_t t1) {
      be.AddInPlace(&x[static_cast<size_t>(t0 * d)], &tmp[static_cast<size_t>(t0 * d)], (t1 - t0) * d);
    });
  }
  // Classifier over the rows whose logits are wanted, in one product.
  std::vector<int64_t> wanted;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].logits == nullptr) continue;
    const auto n = static_cast<int64_t>(items[i].tokens.size());
    for (int64_t j = items[i].all_logits ? 0 : n - 1; j < n; ++j) wanted.push_back(batch.first[i] + j);
  }
  if (wanted.empty()) return Status::Ok();
  const auto W = static_cast<int64_t>(wanted.size());
  for (int64_t r = 0; r < W; ++r) {
    be.RmsNormRows(&x[static_cast<size_t>(wanted[static_cast<size_t>(r)] * d)], final_norm_, 1, d, c.norm_eps, &xb[static_cast<size_t>(r * d)]);
  }
  const std::span<float> logits = rows(W, c.vocab_size);
  PAGEKV_RETURN_IF_ERROR(matmul(classifier_, xb.data(), W, logits.data()));
  size_t r = 0;
  for (const StepItem& item : items) {
    if (item.logits == nullptr) continue;
    const size_t n = item.all_logits ? item.tokens.size() : 1;
    std::memcpy(item.logits, &logits[r * static_cast<size_t>(c.vocab_size)], n * static_cast<size_t>(c.vocab_size) * 4);
    r += n;
  }
  return Status::Ok();
}

}  // namespace pagekv
