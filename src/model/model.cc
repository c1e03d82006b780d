// Model (model.h): what every runner shares: the step's checks, the token
// embedding, the classifier, the loading helpers and the dispatch on the
// architecture.
#include "model/model.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/check.h"
#include "model/deepseek_model.h"
#include "model/gemma_model.h"
#include "model/llama_model.h"
#include "model/model_internal.h"

namespace pagekv {
namespace model_internal {

std::string_view LayerPart(std::string_view name, int32_t layers, int32_t* layer) {
  if (name.rfind("blk.", 0) != 0) return {};
  const size_t dot = name.find('.', 4);
  if (dot == std::string_view::npos || dot == 4 || dot > 12) return {};
  int64_t l = 0;
  for (size_t i = 4; i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return {};
    l = l * 10 + (name[i] - '0');
  }
  if (l >= layers) return {};
  if (layer != nullptr) *layer = static_cast<int32_t>(l);
  return name.substr(dot + 1);
}

bool KeyIn(std::string_view key, std::span<const std::string_view> known) {
  return std::find(known.begin(), known.end(), key) != known.end();
}

Status CheckArchKeys(const GgufFile& file, const std::string& arch, std::span<const std::string_view> known) {
  const std::string a = arch + ".";
  for (const auto& [key, value] : file.metadata()) {
    if (key.rfind(a, 0) != 0) continue;
    if (!KeyIn(std::string_view(key).substr(a.size()), known)) {
      return UnimplementedError("model metadata '" + key + "' is not supported by PageKV's " + arch +
                                " runner (sliding windows, soft-capping and the like change the model; refusing "
                                "rather than running it wrong)");
    }
  }
  return Status::Ok();
}

Status ReadDim(const GgufFile& file, const std::string& key, int32_t& out, bool required) {
  if (!required && file.Find(key) == nullptr) return Status::Ok();
  PAGEKV_ASSIGN_OR_RETURN(int64_t v, file.GetInt(key));
  if (v <= 0 || v > (1 << 24)) return DataLossError("model metadata " + key + " = " + std::to_string(v) + " is out of range");
  out = static_cast<int32_t>(v);
  return Status::Ok();
}

}  // namespace model_internal

namespace {

std::string ShapeString(const std::vector<int64_t>& dims) {
  std::string out;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) out.push_back('x');
    out.append(std::to_string(dims[i]));
  }
  return out;
}

// Logits' scratch slot: past every slot a runner's Compute takes.
constexpr size_t kLogitsSlot = 63;

WeightType ToWeightType(GgmlType type) { return WeightTypeOf(static_cast<uint32_t>(type)).value_or(WeightType::kF32); }

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

size_t Model::Batch::ItemOf(int64_t t) const {
  return static_cast<size_t>(std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1);
}

Status Model::CheckStep(std::span<const StepItem> items, const KvLayout& layout) const {
  PAGEKV_RETURN_IF_ERROR(CheckGeometry(layout));
  const ModelConfig& c = config_;
  // A hybrid cache's groups follow the model's windows exactly: a sliding
  // group releases what its window has passed, so a layer that reads more
  // would find those blocks gone.
  if (!layout.config().layer_windows.empty()) {
    for (int32_t l = 0; l < c.num_layers; ++l) {
      if (layout.config().WindowOf(l) != c.window(l)) {
        return InvalidArgumentError("the cache's layer_windows differ from the model's sliding windows (layer " +
                                    std::to_string(l) + ": cache " + std::to_string(layout.config().WindowOf(l)) +
                                    ", model " + std::to_string(c.window(l)) +
                                    "): take them from the model's config, or give none for a uniform cache");
      }
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

Status Model::CheckLayerFormats(const CacheConfig& cc, int32_t row_elems, bool kivi, const std::string& refusal) {
  for (int32_t l = 0; l < cc.num_layers; ++l) {
    const KvFormat& f = cc.FormatOf(l);
    if (!f.IsPlainFloat() && !f.IsStoredQuantized(row_elems) && !(kivi && f.IsKivi())) {
      return UnimplementedError("forward: KV format " + f.ToString() + " (layer " + std::to_string(l) + refusal);
    }
  }
  return Status::Ok();
}

Status Model::Forward(std::span<const StepItem> items, StepKv& kv, const ForwardOptions& options) const {
  model_internal::Stopwatch total(options.timings != nullptr ? &options.timings->total : nullptr);
  PAGEKV_RETURN_IF_ERROR(CheckStep(items, kv.layout()));
  Batch batch;
  for (const StepItem& item : items) {
    const auto n = static_cast<int64_t>(item.tokens.size());
    batch.first.push_back(batch.rows);
    for (int64_t i = 0; i < n; ++i) batch.pos.push_back(item.position + i);
    batch.rows += n;
  }
  if (items.empty()) return Status::Ok();
  const Status computed = Compute(items, kv, batch, options);
  // A device backend's void calls record their errors: the step fails on them too.
  const Status finished = (options.backend != nullptr ? *options.backend : CpuBackend()).Finish();
  return computed.ok() ? finished : computed;
}

void Model::Embed(std::span<const StepItem> items, const Batch& batch, const Backend& be, float* x) const {
  const int64_t d = config_.dim;
  for (int64_t t = 0; t < batch.rows; ++t) {
    const size_t item = batch.ItemOf(t);
    be.WeightRow(embedding_, items[item].tokens[static_cast<size_t>(t - batch.first[item])], x + t * d);
    if (config_.embed_scale > 0) be.ScaleInPlace(x + t * d, config_.embed_scale, d);
  }
}

Status Model::Logits(std::span<const StepItem> items, const Batch& batch, const Backend& be, const float* x, float* xb,
                     const ForwardOptions& options) const {
  const ModelConfig& c = config_;
  std::vector<int64_t> wanted;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].logits == nullptr) continue;
    const auto n = static_cast<int64_t>(items[i].tokens.size());
    for (int64_t j = items[i].all_logits ? 0 : n - 1; j < n; ++j) wanted.push_back(batch.first[i] + j);
  }
  if (wanted.empty()) return Status::Ok();
  const auto W = static_cast<int64_t>(wanted.size());
  for (int64_t r = 0; r < W; ++r) {
    be.RmsNormRows(x + wanted[static_cast<size_t>(r)] * c.dim, final_norm_, 1, c.dim, c.norm_eps, xb + r * c.dim);
  }
  // In the backend's memory; each item's rows then cross to its host buffer.
  const std::span<float> logits = model_internal::Scratch<float>(be, kLogitsSlot, static_cast<size_t>(W * c.vocab_size));
  if (logits.data() == nullptr) return ResourceExhaustedError("no " + be.name() + " memory for this step's logits");
  {
    model_internal::Stopwatch watch(options.timings != nullptr ? &options.timings->matmul : nullptr);
    PAGEKV_RETURN_IF_ERROR(be.MatMul(classifier_, xb, W, logits.data(), options.threads, options.activations));
  }
  size_t r = 0;
  for (const StepItem& item : items) {
    if (item.logits == nullptr) continue;
    const size_t n = (item.all_logits ? item.tokens.size() : 1) * static_cast<size_t>(c.vocab_size);
    be.ToHost(&logits[r * static_cast<size_t>(c.vocab_size)], n * 4, item.logits);
    if (c.final_softcap > 0) {
      const float cap = c.final_softcap;
      for (size_t i = 0; i < n; ++i) item.logits[i] = cap * std::tanh(item.logits[i] / cap);
    }
    r += n / static_cast<size_t>(c.vocab_size);
  }
  return Status::Ok();
}

Status Model::ReadCommonMetadata(std::unique_ptr<GgufFile> file, std::span<const std::string_view> known_keys) {
  using model_internal::ReadDim;
  file_ = std::move(file);
  const GgufFile& f = *file_;
  ModelConfig& c = config_;
  PAGEKV_ASSIGN_OR_RETURN(c.arch, f.GetString("general.architecture"));
  PAGEKV_RETURN_IF_ERROR(model_internal::CheckArchKeys(f, c.arch, known_keys));
  const std::string a = c.arch + ".";
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "embedding_length", c.dim));
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "block_count", c.num_layers));
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.head_count", c.num_heads));
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "context_length", c.context_len));
  if (Result<double> eps = f.GetFloat(a + "attention.layer_norm_rms_epsilon"); eps.ok()) c.norm_eps = static_cast<float>(*eps);
  return Status::Ok();
}

Result<Model::Matrix> Model::LoadMatrix(const std::string& name, int64_t rows, int64_t cols) const {
  const GgufTensor* t = file_->FindTensor(name);
  if (t == nullptr) return DataLossError("model tensor '" + name + "' is missing");
  // ggml dims are {cols, rows}: dims[0] is the contiguous one.
  if (t->dims != std::vector<int64_t>{cols, rows}) {
    return DataLossError("model tensor '" + name + "' has shape " + ShapeString(t->dims) + ", expected " +
                         ShapeString({cols, rows}));
  }
  return Matrix{t->data, ToWeightType(t->type), rows, cols};
}

Result<std::vector<Model::Matrix>> Model::LoadMatrices(const std::string& name, int64_t count, int64_t rows,
                                                       int64_t cols) const {
  const GgufTensor* t = file_->FindTensor(name);
  if (t == nullptr) return DataLossError("model tensor '" + name + "' is missing");
  if (t->dims != std::vector<int64_t>{cols, rows, count}) {
    return DataLossError("model tensor '" + name + "' has shape " + ShapeString(t->dims) + ", expected " +
                         ShapeString({cols, rows, count}));
  }
  const WeightType type = ToWeightType(t->type);
  const int64_t stride = rows * WeightRowBytes(type, cols);
  std::vector<Matrix> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(Matrix{t->data + i * stride, type, rows, cols});
  return out;
}

Result<const float*> Model::LoadVector(const std::string& name, int64_t n) {
  const GgufTensor* t = file_->FindTensor(name);
  if (t == nullptr) return DataLossError("model tensor '" + name + "' is missing");
  if (t->dims != std::vector<int64_t>{n}) {
    return DataLossError("model tensor '" + name + "' has shape " + ShapeString(t->dims) + ", expected " +
                         ShapeString({n}));
  }
  if (t->type == GgmlType::kF32) return reinterpret_cast<const float*>(t->data);
  std::vector<float>& out = converted_.emplace_back(static_cast<size_t>(n));
  WeightRow({t->data, ToWeightType(t->type), 1, n}, 0, out.data());
  return out.data();
}

Result<const float*> Model::LoadOptionalVector(const std::string& name, int64_t n) {
  if (file_->FindTensor(name) == nullptr) return static_cast<const float*>(nullptr);
  return LoadVector(name, n);
}

Status Model::LoadEmbeddingAndHead() {
  ModelConfig& c = config_;
  const GgufValue* tokens = file_->Find("tokenizer.ggml.tokens");
  const GgufTensor* emb = file_->FindTensor("token_embd.weight");
  if (emb == nullptr || emb->dims.size() != 2) return DataLossError("model tensor 'token_embd.weight' is missing");
  c.vocab_size = static_cast<int32_t>(emb->dims[1]);
  if (tokens != nullptr && static_cast<int64_t>(tokens->elements.size()) != c.vocab_size) {
    return DataLossError("the tokenizer has " + std::to_string(tokens->elements.size()) +
                         " tokens but the embedding has " + std::to_string(c.vocab_size) + " rows");
  }
  PAGEKV_ASSIGN_OR_RETURN(embedding_, LoadMatrix("token_embd.weight", c.vocab_size, c.dim));
  PAGEKV_ASSIGN_OR_RETURN(final_norm_, LoadVector("output_norm.weight", c.dim));
  if (file_->FindTensor("output.weight") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(classifier_, LoadMatrix("output.weight", c.vocab_size, c.dim));
  } else {
    classifier_ = embedding_;  // tied embeddings
  }
  return Status::Ok();
}

Status Model::Pack(Matrix& m) {
  // f32 / f16 / bf16 / q8_0 / q4_0 / q4_1 / q5_0 / q5_1 / q4_k / q5_k / q6_k into panels (kernels/matmul.h
  // PackedWeights); the other block formats stay row-major.
  if (!HasPanelLayout(m.type) || m.panels) return Status::Ok();
  // GGUF opened from a file, or a llama2.c checkpoint (always mapped).
  const bool file_backed = file_ == nullptr || file_->mapped();
  PAGEKV_ASSIGN_OR_RETURN(PackedWeights p, PackedWeights::Pack(m));
  // The embedding's rows are still looked up from the file; matrices made
  // at load (converted_) are not file pages.
  bool derived = false;
  for (const std::vector<float>& v : converted_) {
    derived |= m.data >= reinterpret_cast<const std::byte*>(v.data()) &&
               m.data < reinterpret_cast<const std::byte*>(v.data() + v.size());
  }
  if (file_backed && !derived && m.data != embedding_.data) ReleaseFilePages(m.data, Bytes(m));
  m = p.matrix();
  packed_.push_back(std::move(p));
  return Status::Ok();
}

Status Model::PackHead() {
  tied_embeddings_ = classifier_.data == embedding_.data;
  return Pack(classifier_);
}

int64_t Model::Bytes(const Matrix& m) { return m.rows * WeightRowBytes(m.type, m.cols); }

HeadShard Model::head_shard() const {
  HeadShard s;
  s.q_heads = config_.num_heads;
  s.kv_heads = config_.num_kv_heads;
  return s;
}

Model::Matrix Model::SliceRows(const Matrix& m, int64_t r0, int64_t r1) {
  PAGEKV_CHECK(!m.panels && 0 <= r0 && r0 <= r1 && r1 <= m.rows);
  Matrix out = m;
  out.data = m.data + r0 * WeightRowBytes(m.type, m.cols);
  out.rows = r1 - r0;
  return out;
}

Result<Model::Matrix> Model::SliceColumns(const Matrix& m, int64_t c0, int64_t c1) {
  PAGEKV_CHECK(!m.panels && 0 <= c0 && c0 < c1 && c1 <= m.cols);
  const int64_t block = FormatOf(m.type).block_elems;
  if (c0 % block != 0 || c1 % block != 0) {
    return UnimplementedError("tensor parallel: columns [" + std::to_string(c0) + ", " + std::to_string(c1) +
                              ") of a " + std::string(FormatOf(m.type).name) + " matrix cut its blocks of " +
                              std::to_string(block) + ": use fewer ranks or another weight type");
  }
  const int64_t row_bytes = WeightRowBytes(m.type, m.cols), start = WeightRowBytes(m.type, c0),
                bytes = WeightRowBytes(m.type, c1) - start;
  std::vector<float>& v = converted_.emplace_back(static_cast<size_t>((m.rows * bytes + 3) / 4));
  auto* out = reinterpret_cast<std::byte*>(v.data());
  for (int64_t r = 0; r < m.rows; ++r) std::memcpy(out + r * bytes, m.data + r * row_bytes + start, static_cast<size_t>(bytes));
  Matrix sliced = m;
  sliced.data = out;
  sliced.cols = c1 - c0;
  return sliced;
}

void Model::BuildRope(int32_t rope_head_dim) {
  const ModelConfig& c = config_;
  RopeParams p;
  p.head_dim = rope_head_dim;
  p.rope_dims = c.rope_dims;
  p.halves = c.rope_halves;
  p.theta = c.rope_theta;
  p.freq_scale = c.rope_freq_scale;
  p.yarn = c.rope_scaling == ModelConfig::RopeScaling::kYarn;
  p.yarn_attn_factor = c.rope_attn_factor;
  p.yarn_orig_context = c.rope_orig_context;
  p.freq_divisors = rope_freqs_;
  rope_ = std::make_shared<const Rope>(std::move(p));
}

Status Model::ReadRopeScaling(const std::string& a) {
  ModelConfig& c = config_;
  const GgufFile& f = *file_;
  if (Result<double> theta = f.GetFloat(a + "rope.freq_base"); theta.ok()) c.rope_theta = static_cast<float>(*theta);
  std::string scaling = "none";
  if (f.Find(a + "rope.scaling.type") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(scaling, f.GetString(a + "rope.scaling.type"));
  }
  double factor = 1.0;
  if (Result<double> v = f.GetFloat(a + "rope.scaling.factor"); v.ok() && *v != 0.0) factor = *v;
  if (scaling == "none") {
    c.rope_scaling = ModelConfig::RopeScaling::kNone;
  } else if (scaling == "linear" || scaling == "yarn") {
    if (!(factor > 0.0) || !std::isfinite(factor)) {
      return DataLossError("model metadata " + a + "rope.scaling.factor = " + std::to_string(factor) + " must be positive");
    }
    c.rope_scaling = scaling == "linear" ? ModelConfig::RopeScaling::kLinear : ModelConfig::RopeScaling::kYarn;
    c.rope_freq_scale = static_cast<float>(1.0 / factor);
    c.rope_orig_context = c.context_len;
    PAGEKV_RETURN_IF_ERROR(model_internal::ReadDim(f, a + "rope.scaling.original_context_length", c.rope_orig_context, false));
    if (Result<double> af = f.GetFloat(a + "rope.scaling.attn_factor"); af.ok() && *af != 0.0) {
      c.rope_attn_factor = static_cast<float>(*af);
    }
  } else if (scaling == "llama3") {
    if (!(factor >= 1.0) || !std::isfinite(factor)) {
      return DataLossError("model metadata " + a + "rope.scaling.factor = " + std::to_string(factor) + " must be at least 1");
    }
    c.rope_scaling = ModelConfig::RopeScaling::kLlama3;
    c.rope_factor = static_cast<float>(factor);
    c.rope_orig_context = c.context_len;
    PAGEKV_RETURN_IF_ERROR(model_internal::ReadDim(f, a + "rope.scaling.original_context_length", c.rope_orig_context, false));
    if (Result<double> lo = f.GetFloat(a + "rope.scaling.low_freq_factor"); lo.ok()) {
      c.rope_low_freq_factor = static_cast<float>(*lo);
    }
    if (Result<double> hi = f.GetFloat(a + "rope.scaling.high_freq_factor"); hi.ok()) {
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
  return Status::Ok();
}

Status Model::LoadRopeFreqs() {
  ModelConfig& c = config_;
  if (file_->FindTensor("rope_freqs.weight") != nullptr) {
    PAGEKV_ASSIGN_OR_RETURN(const float* ff, LoadVector("rope_freqs.weight", c.rope_dims / 2));
    rope_freqs_.assign(ff, ff + c.rope_dims / 2);
    for (float x : rope_freqs_) {
      if (!(x > 0.0f) || !std::isfinite(x)) return DataLossError("model tensor 'rope_freqs.weight' holds a factor that is not positive");
    }
    c.rope_freq_factors = true;
  } else if (c.rope_scaling == ModelConfig::RopeScaling::kLlama3) {
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
      rope_freqs_.push_back(static_cast<float>(divide));
    }
    c.rope_freq_factors = true;
  }
  return Status::Ok();
}

Result<std::unique_ptr<Model>> LoadGgufModel(std::unique_ptr<GgufFile> file, ModelParallel parallel) {
  PAGEKV_ASSIGN_OR_RETURN(std::string arch, file->GetString("general.architecture"));
  if (parallel.active() && (arch == "deepseek2" || arch == "gemma3")) {
    return UnimplementedError("tensor and pipeline parallel (--tp, --pp) are implemented for the llama and qwen2 runners; " +
                              arch + " runs in one process");
  }
  if (arch == "deepseek2") {
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<DeepseekModel> m, DeepseekModel::FromGguf(std::move(file)));
    return std::unique_ptr<Model>(std::move(m));
  }
  if (arch == "gemma3") {
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<GemmaModel> m, GemmaModel::FromGguf(std::move(file)));
    return std::unique_ptr<Model>(std::move(m));
  }
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> m, LlamaModel::FromGguf(std::move(file), std::move(parallel)));
  return std::unique_ptr<Model>(std::move(m));
}

}  // namespace pagekv
