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
#include "model/model_internal.h"
#include "pagekv/attention.h"

namespace pagekv {

using model_internal::ForRows;
using model_internal::Scratch;
using model_internal::Stopwatch;

namespace {

// What the runner does with each key under "<arch>.": read (and used), or
// known to change nothing. Every other key is refused by name.
constexpr std::string_view kKnownKeys[] = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
    "attention.value_length", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.attn_factor", "rope.scaling.finetuned",
    "rope.scaling.low_freq_factor", "rope.scaling.high_freq_factor", "vocab_size",
    "expert_count", "expert_used_count", "tensor_data_layout",
};

// A tensor name the runner reads: "blk.<n>.<part>" or a global one.
bool KnownTensor(const std::string& name, int32_t layers) {
  static constexpr std::string_view kGlobal[] = {"token_embd.weight", "output_norm.weight", "output.weight",
                                                 "rope_freqs.weight"};
  if (model_internal::KeyIn(name, kGlobal)) return true;
  static constexpr std::string_view kParts[] = {
      "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_norm.weight",
      "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
      "attn_output.bias"};
  return model_internal::KeyIn(model_internal::LayerPart(name, layers), kParts);
}

}  // namespace

Result<std::unique_ptr<LlamaModel>> LlamaModel::FromGguf(std::unique_ptr<GgufFile> file, ModelParallel parallel) {
  using model_internal::ReadDim;
  PAGEKV_ASSIGN_OR_RETURN(std::string arch, file->GetString("general.architecture"));
  if (arch != "llama" && arch != "qwen2") {
    return UnimplementedError("model metadata general.architecture = '" + arch +
                              "' is not supported: PageKV runs llama (also Mistral-style files), qwen2 and deepseek2");
  }
  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  PAGEKV_RETURN_IF_ERROR(m->ReadCommonMetadata(std::move(file), kKnownKeys));
  const GgufFile& f = *m->file_;
  ModelConfig& c = m->config_;
  const std::string a = arch + ".";
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "feed_forward_length", c.hidden_dim));
  c.num_kv_heads = c.num_heads;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "attention.head_count_kv", c.num_kv_heads, false));
  if (c.dim % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0) {
    return DataLossError("model heads do not divide: dim " + std::to_string(c.dim) + ", heads " +
                         std::to_string(c.num_heads) + ", kv heads " + std::to_string(c.num_kv_heads));
  }
  c.head_dim = c.dim / c.num_heads;
  if (c.head_dim % 2 != 0) return DataLossError("model head size " + std::to_string(c.head_dim) + " is odd");
  for (const char* key : {"attention.key_length", "attention.value_length"}) {
    int32_t v = c.head_dim;
    PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + key, v, false));
    if (v != c.head_dim) {
      return UnimplementedError("model metadata " + a + key + " = " + std::to_string(v) +
                                " differs from embedding_length / head_count = " + std::to_string(c.head_dim) +
                                ": heads of another width than dim / heads are not supported");
    }
  }
  for (const char* key : {"expert_count", "expert_used_count"}) {
    if (Result<int64_t> v = f.GetInt(a + key); v.ok() && *v != 0) {
      return UnimplementedError("model metadata " + a + key + " = " + std::to_string(*v) +
                                ": mixture-of-experts models are not supported by the " + arch + " runner");
    }
  }
  c.rope_dims = c.head_dim;
  PAGEKV_RETURN_IF_ERROR(ReadDim(f, a + "rope.dimension_count", c.rope_dims, false));
  if (c.rope_dims > c.head_dim || c.rope_dims % 2 != 0) {
    return DataLossError("model metadata " + a + "rope.dimension_count = " + std::to_string(c.rope_dims) +
                         " must be even and at most the head size " + std::to_string(c.head_dim));
  }
  c.rope_halves = arch == "qwen2";
  PAGEKV_RETURN_IF_ERROR(m->ReadRopeScaling(a));
  for (const GgufTensor& t : f.tensors()) {
    if (!KnownTensor(t.name, c.num_layers)) {
      return UnimplementedError("model tensor '" + t.name + "' is not used by PageKV's " + arch +
                                " runner (another architecture or variant); refusing rather than ignoring it");
    }
  }
  PAGEKV_RETURN_IF_ERROR(m->LoadEmbeddingAndHead());
  PAGEKV_RETURN_IF_ERROR(m->LoadRopeFreqs());
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer L{};
    PAGEKV_ASSIGN_OR_RETURN(L.bq, m->LoadOptionalVector(p + "attn_q.bias", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.bk, m->LoadOptionalVector(p + "attn_k.bias", kv_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.bv, m->LoadOptionalVector(p + "attn_v.bias", kv_dim));
    PAGEKV_ASSIGN_OR_RETURN(L.bo, m->LoadOptionalVector(p + "attn_output.bias", c.dim));
    if (arch == "qwen2" && (L.bq == nullptr || L.bk == nullptr || L.bv == nullptr)) {
      return DataLossError("model tensor '" + p + "attn_q.bias' (or its k / v sibling) is missing: qwen2 layers have q, k and v biases");
    }
    PAGEKV_ASSIGN_OR_RETURN(L.attn_norm, m->LoadVector(p + "attn_norm.weight", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wq, m->LoadMatrix(p + "attn_q.weight", c.dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wk, m->LoadMatrix(p + "attn_k.weight", kv_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wv, m->LoadMatrix(p + "attn_v.weight", kv_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.wo, m->LoadMatrix(p + "attn_output.weight", c.dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.ffn_norm, m->LoadVector(p + "ffn_norm.weight", c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_gate, m->LoadMatrix(p + "ffn_gate.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_up, m->LoadMatrix(p + "ffn_up.weight", c.hidden_dim, c.dim));
    PAGEKV_ASSIGN_OR_RETURN(L.w_down, m->LoadMatrix(p + "ffn_down.weight", c.dim, c.hidden_dim));
    m->layers_.push_back(L);
  }
  m->BuildRope(c.head_dim);
  PAGEKV_RETURN_IF_ERROR(m->ShardLayers(std::move(parallel)));
  PAGEKV_RETURN_IF_ERROR(m->PackWeights());
  return m;
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::FromLlama2c(const std::string& path, ModelParallel parallel) {
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
  ModelConfig& c = m->config_;
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
  m->BuildRope(c.head_dim);
  PAGEKV_RETURN_IF_ERROR(m->ShardLayers(std::move(parallel)));
  PAGEKV_RETURN_IF_ERROR(m->PackWeights());
  return m;
}

Status LlamaModel::ShardLayers(ModelParallel parallel) {
  const ModelConfig& c = config_;
  shard_ = Model::head_shard();
  hidden_rows_ = c.hidden_dim;
  first_layer_ = 0;
  // Pipeline parallel: this stage's contiguous range of layers (the others
  // are dropped before packing: their weights are never read here).
  if (parallel.pipeline != nullptr && parallel.pipeline->size() > 1) {
    const int stage = parallel.pipeline->rank(), stages = parallel.pipeline->size();
    if (c.num_layers < stages) {
      return InvalidArgumentError("pipeline parallel size " + std::to_string(stages) + " exceeds the model's " +
                                  std::to_string(c.num_layers) + " layers: use at most " + std::to_string(c.num_layers) +
                                  " stages");
    }
    PAGEKV_ASSIGN_OR_RETURN(const auto range, ShardRange(c.num_layers, 1, stage, stages));
    first_layer_ = static_cast<int32_t>(range.first);
    layers_ = std::vector<Layer>(layers_.begin() + range.first, layers_.begin() + range.second);
  }
  if (parallel.tensor != nullptr && parallel.tensor->size() > 1) {
    const int rank = parallel.tensor->rank(), size = parallel.tensor->size();
    PAGEKV_ASSIGN_OR_RETURN(shard_, ShardHeads(c.num_heads, c.num_kv_heads, rank, size));
    const int64_t hd = c.head_dim;
    const int64_t q0 = shard_.q_head0 * hd, q1 = q0 + shard_.q_heads * hd;
    const int64_t k0 = shard_.kv_head0 * hd, k1 = k0 + shard_.kv_heads * hd;
    // The hidden units in whole blocks of every matrix that reads or writes
    // them (w_down's columns are cut there).
    int64_t align = 1, wo_align = 1;
    for (const Layer& L : layers_) {
      align = std::max<int64_t>(align, FormatOf(L.w_down.type).block_elems);
      wo_align = std::max<int64_t>(wo_align, FormatOf(L.wo.type).block_elems);
    }
    // Every rank's cut, checked on every rank, so all of them refuse alike.
    if ((int64_t{c.num_heads} / size * hd) % wo_align != 0) {
      return UnimplementedError("tensor parallel size " + std::to_string(size) + " gives each rank " +
                                std::to_string(c.num_heads / size) + " query heads of " + std::to_string(hd) +
                                " columns, which cuts the attention output projection's weight blocks of " +
                                std::to_string(wo_align) + " columns: use fewer ranks");
    }
    PAGEKV_ASSIGN_OR_RETURN(const auto hidden, ShardRange(c.hidden_dim, align, rank, size));
    hidden_rows_ = hidden.second - hidden.first;
    for (Layer& L : layers_) {
      L.wq = SliceRows(L.wq, q0, q1);
      L.wk = SliceRows(L.wk, k0, k1);
      L.wv = SliceRows(L.wv, k0, k1);
      PAGEKV_ASSIGN_OR_RETURN(L.wo, SliceColumns(L.wo, q0, q1));
      L.w_gate = SliceRows(L.w_gate, hidden.first, hidden.second);
      L.w_up = SliceRows(L.w_up, hidden.first, hidden.second);
      PAGEKV_ASSIGN_OR_RETURN(L.w_down, SliceColumns(L.w_down, hidden.first, hidden.second));
      if (L.bq != nullptr) L.bq += q0;
      if (L.bk != nullptr) L.bk += k0;
      if (L.bv != nullptr) L.bv += k0;
      // bo is added once, after the ranks' partial sums are.
      // The two projections whose outputs are summed, in two halves of
      // their rows (a multiple of the 32-row panels packing pads to).
      const int64_t half = c.dim / 2 / 32 * 32;
      if (half > 0 && half < c.dim) {
        L.wo_halves[0] = SliceRows(L.wo, 0, half);
        L.wo_halves[1] = SliceRows(L.wo, half, c.dim);
        L.w_down_halves[0] = SliceRows(L.w_down, 0, half);
        L.w_down_halves[1] = SliceRows(L.w_down, half, c.dim);
      }
    }
  }
  parallel_ = std::move(parallel);
  return Status::Ok();
}

Status LlamaModel::PackWeights() {
  if (last_stage()) PAGEKV_RETURN_IF_ERROR(PackHead());  // earlier pipeline stages never compute logits
  for (Layer& L : layers_) {
    for (Matrix* m : {&L.wq, &L.wk, &L.wv, &L.w_gate, &L.w_up}) PAGEKV_RETURN_IF_ERROR(Pack(*m));
    if (L.wo_halves[0].rows == 0) {
      PAGEKV_RETURN_IF_ERROR(Pack(L.wo));
      PAGEKV_RETURN_IF_ERROR(Pack(L.w_down));
      continue;
    }
    // Split: the halves are what is multiplied (wo and w_down themselves
    // are never read again; their file pages go with the halves').
    for (Matrix* m : {&L.wo_halves[0], &L.wo_halves[1], &L.w_down_halves[0], &L.w_down_halves[1]}) {
      PAGEKV_RETURN_IF_ERROR(Pack(*m));
    }
  }
  return Status::Ok();
}

int64_t LlamaModel::StepWeightBytes() const {
  int64_t total = Bytes(classifier_);
  for (const Layer& L : layers_) {
    for (const Matrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) total += Bytes(*m);
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
  cc.num_layers = static_cast<int32_t>(layers_.size());
  cc.num_q_heads = shard_.q_heads;
  cc.num_kv_heads = shard_.kv_heads;
  cc.head_dim = config_.head_dim;
  cc.block_len = block_len;
  cc.format = KvFormat::ForDType(dtype, config_.head_dim);
  cc.num_blocks = num_blocks;
  return cc;
}

Status LlamaModel::CheckGeometry(const KvLayout& layout) const {
  const ModelConfig& c = config_;
  const CacheConfig& cc = layout.config();
  if (cc.kind != CacheKind::kPerHead || cc.num_layers != static_cast<int32_t>(layers_.size()) || cc.num_kv_heads != shard_.kv_heads ||
      cc.head_dim != c.head_dim || cc.num_q_heads != shard_.q_heads) {
    return InvalidArgumentError("the cache's geometry does not match the model: build it from CacheGeometry()");
  }
  return CheckLayerFormats(cc, c.head_dim, true, ") not supported");
}

Status LlamaModel::Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                           const ForwardOptions& options) const {
  const ModelConfig& c = config_;
  const KvLayout& layout = kv.layout();
  const CacheConfig& cc = layout.config();
  const Backend& be = options.backend != nullptr ? *options.backend : CpuBackend();
  const int64_t T = batch.rows;
  const auto num_items = static_cast<int64_t>(items.size());
  const auto num_layers = static_cast<int32_t>(layers_.size());  // this pipeline stage's
  // This rank's widths (the whole model's unsharded): query heads, KV
  // heads, hidden units; the residual stream is always dim wide.
  const int32_t d = c.dim, kv_heads = shard_.kv_heads, q_dim = shard_.q_heads * c.head_dim,
                kv_dim = kv_heads * c.head_dim, hd = static_cast<int32_t>(hidden_rows_);
  Communicator* const tp = parallel_.tensor.get();
  Communicator* const pp = parallel_.pipeline.get();
  // Context parallel: this rank holds one slice of every block (kv's
  // tables name only its blocks); each layer's attention is this rank's
  // part, merged with the others' by their log-sum-exps.
  Communicator* const cp = parallel_.context_size() > 1 ? parallel_.context.get() : nullptr;
  const int stage = pp != nullptr ? pp->rank() : 0, stages = pp != nullptr ? pp->size() : 1;
  if (!be.host_memory() && (tp != nullptr || pp != nullptr || cp != nullptr)) {
    return UnimplementedError("a model split over processes (--tp, --pp, --cp) runs on the CPU backend only: drop --device " +
                              be.name());
  }
  double* communication_time = options.timings != nullptr ? &options.timings->communication : nullptr;
  auto all_reduce = [&](float* rows, int64_t n) {
    Stopwatch watch(communication_time);
    return tp->AllReduceSum(rows, n * d);
  };
  double* matmul_time = options.timings != nullptr ? &options.timings->matmul : nullptr;
  double* attention_time = options.timings != nullptr ? &options.timings->attention : nullptr;
  size_t slot = 0;
  auto rows = [&slot, &be](int64_t n, int64_t width) { return Scratch<float>(be, slot++, static_cast<size_t>(n * width)); };
  const std::span<float> x = rows(T, d), xb = rows(T, d), q = rows(T, q_dim), att = rows(T, q_dim), tmp = rows(T, d),
                         k = rows(T, kv_dim), v = rows(T, kv_dim), h1 = rows(T, hd), h2 = rows(T, hd);
  // Bytes of one token's K (or V) rows over all KV heads, as the cache
  // stores them: the buffers fit the widest layer; each layer uses its own.
  int64_t widest_row = 0;
  for (int32_t l = 0; l < num_layers; ++l) widest_row = std::max(widest_row, layout.row_bytes(l));
  const std::span<std::byte> k_rows = Scratch<std::byte>(be, 0, static_cast<size_t>(T * widest_row * kv_heads)),
                             v_rows = Scratch<std::byte>(be, 1, k_rows.size());
  auto matmul = [&](const Matrix& w, const float* in, int64_t n, float* out) {
    Stopwatch watch(matmul_time);
    return be.MatMul(w, in, n, out, options.threads, options.activations);
  };
  auto matmul_shared = [&](std::initializer_list<MatMulOutput> outputs, const float* in, int64_t n) {
    Stopwatch watch(matmul_time);
    return be.MatMulShared({outputs.begin(), outputs.size()}, in, n, options.threads, options.activations);
  };
  // A projection whose output the tensor ranks sum. Split in halves of its
  // output features: the first half's sum (nonblocking) runs while the
  // second half is multiplied, then both are waited for (the time spent
  // waiting is the communication left exposed).
  const std::span<float> halves = tp != nullptr ? rows(T, d) : std::span<float>();
  auto project_sum = [&](const Matrix& whole, const Matrix* parts, const float* in, int64_t n, float* out) -> Status {
    if (tp == nullptr) return matmul(whole, in, n, out);
    if (parts[0].rows == 0) {
      PAGEKV_RETURN_IF_ERROR(matmul(whole, in, n, out));
      return all_reduce(out, n);
    }
    const int64_t h0 = parts[0].rows, h1 = parts[1].rows;
    // One row: the halves are the row's two ends; more: side by side in
    // `halves`, then interleaved back.
    float* lo = n == 1 ? out : halves.data();
    float* hi = n == 1 ? out + h0 : halves.data() + n * h0;
    int handle[2] = {0, 0};
    PAGEKV_RETURN_IF_ERROR(matmul(parts[0], in, n, lo));
    {
      Stopwatch watch(communication_time);
      PAGEKV_ASSIGN_OR_RETURN(handle[0], tp->StartSum(lo, n * h0));
      if (!options.overlap_communication) PAGEKV_RETURN_IF_ERROR(tp->WaitSum(handle[0]));
    }
    PAGEKV_RETURN_IF_ERROR(matmul(parts[1], in, n, hi));
    {
      Stopwatch watch(communication_time);
      PAGEKV_ASSIGN_OR_RETURN(handle[1], tp->StartSum(hi, n * h1));
      if (options.overlap_communication) PAGEKV_RETURN_IF_ERROR(tp->WaitSum(handle[0]));
      PAGEKV_RETURN_IF_ERROR(tp->WaitSum(handle[1]));
    }
    if (n > 1) {
      for (int64_t t = 0; t < n; ++t) {
        std::copy_n(lo + t * h0, h0, out + t * d);
        std::copy_n(hi + t * h1, h1, out + t * d + h0);
      }
    }
    return Status::Ok();
  };
  auto for_rows = [&options](int64_t n, const auto& fn) { ForRows(n, options.threads, fn); };
  // Rotary tables per row, shared by every layer (kernels/ops.h).
  const int32_t rope_dims = c.rope_dims;
  const std::span<float> rope_cos = rows(T, rope_dims), rope_sin = rows(T, rope_dims);
  // A device backend that could not allocate its activations returns empty
  // scratch (and records why).
  for (const std::span<float> buf : {x, xb, q, att, tmp, k, v, h1, h2, rope_cos, rope_sin}) {
    if (buf.data() == nullptr && !buf.empty()) {
      return ResourceExhaustedError("no " + be.name() + " memory for this step's activations: lower --max-step-tokens");
    }
  }
  if (k_rows.data() == nullptr || v_rows.data() == nullptr) {
    return ResourceExhaustedError("no " + be.name() + " memory for this step's K / V rows: lower --max-step-tokens");
  }
  if (stage == 0) Embed(items, batch, be, x.data());
  for_rows(T, [&](int64_t t0, int64_t t1) {
    be.RopeTables(*rope_, std::span<const int64_t>(batch.pos).subspan(static_cast<size_t>(t0), static_cast<size_t>(t1 - t0)),
                  &rope_cos[static_cast<size_t>(t0 * rope_dims)], &rope_sin[static_cast<size_t>(t0 * rope_dims)]);
  });
  auto add_bias = [&](float* rows_out, int64_t n, int64_t width, const float* bias) {
    if (bias != nullptr) be.AddBiasRows(rows_out, bias, n, width);
  };
  std::vector<PrefillSeq> prefill(items.size());
  std::vector<DecodeSeq> decode(items.size());
  AttentionOptions attention_options;
  attention_options.num_threads = options.threads;
  const int32_t q_heads = shard_.q_heads;
  // Context parallel: each row's log-sum-exp beside its output, and every
  // rank's [outputs | log-sum-exps] gathered.
  const std::span<float> lse = cp != nullptr ? rows(T, q_heads) : std::span<float>();
  const int64_t part_floats = T * (q_dim + q_heads);
  const std::span<float> parts = cp != nullptr ? Scratch<float>(be, slot++, static_cast<size_t>(part_floats * (cp->size() + 1)))
                                               : std::span<float>();
  auto merge_attention = [&](float* attr, int64_t r0, int64_t n) -> Status {
    Stopwatch watch(communication_time);
    const int64_t floats = n * (q_dim + q_heads);
    float* mine = parts.data();
    float* all = parts.data() + part_floats;
    std::copy_n(attr, n * q_dim, mine);
    std::copy_n(&lse[static_cast<size_t>(r0 * q_heads)], n * q_heads, mine + n * q_dim);
    PAGEKV_RETURN_IF_ERROR(cp->AllGather(mine, floats * static_cast<int64_t>(sizeof(float)), all));
    std::vector<const float*> outs, lses;
    for (int p = 0; p < cp->size(); ++p) {
      outs.push_back(all + p * floats);
      lses.push_back(all + p * floats + n * q_dim);
    }
    MergeAttentionParts(outs, lses, n * q_heads, c.head_dim, attr);
    return Status::Ok();
  };
  // One layer over items [i0, i1), rows [r0, r1) of the step.
  auto layer = [&](int32_t l, int64_t i0, int64_t i1, int64_t r0, int64_t r1) -> Status {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const int64_t n = r1 - r0;
    float* const xr = &x[static_cast<size_t>(r0 * d)];
    float* const xbr = &xb[static_cast<size_t>(r0 * d)];
    float* const qr = &q[static_cast<size_t>(r0 * q_dim)];
    float* const kr = &k[static_cast<size_t>(r0 * kv_dim)];
    float* const vr = &v[static_cast<size_t>(r0 * kv_dim)];
    float* const attr = &att[static_cast<size_t>(r0 * q_dim)];
    float* const tmpr = &tmp[static_cast<size_t>(r0 * d)];
    float* const h1r = &h1[static_cast<size_t>(r0 * hd)];
    float* const h2r = &h2[static_cast<size_t>(r0 * hd)];
    for_rows(n, [&](int64_t t0, int64_t t1) {
      be.RmsNormRows(xr + t0 * d, L.attn_norm, t1 - t0, d, c.norm_eps, xbr + t0 * d);
    });
    PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.wq, qr}, {L.wk, kr}, {L.wv, vr}}, xbr, n));
    add_bias(qr, n, q_dim, L.bq);
    add_bias(kr, n, kv_dim, L.bk);
    add_bias(vr, n, kv_dim, L.bv);
    const KvFormat& format = cc.FormatOf(l);
    const auto token_bytes = static_cast<size_t>(layout.row_bytes(l) * kv_heads);
    for_rows(n, [&](int64_t t0, int64_t t1) {
      const auto first = static_cast<size_t>(r0 + t0);
      const float* cs = &rope_cos[first * static_cast<size_t>(rope_dims)];
      const float* sn = &rope_sin[first * static_cast<size_t>(rope_dims)];
      be.RopeApply(*rope_, &q[first * static_cast<size_t>(q_dim)], t1 - t0, q_dim, cs, sn);
      be.RopeApply(*rope_, &k[first * static_cast<size_t>(kv_dim)], t1 - t0, kv_dim, cs, sn);
      const int64_t heads = (t1 - t0) * kv_heads;
      be.EncodeKvRows(format, c.head_dim, k.data() + first * kv_dim, heads, k_rows.data() + first * token_bytes);
      be.EncodeKvRows(format, c.head_dim, v.data() + first * kv_dim, heads, v_rows.data() + first * token_bytes);
    });
    for (int64_t i = i0; i < i1; ++i) {
      const auto ii = static_cast<size_t>(i);
      const auto tokens = static_cast<int64_t>(items[ii].tokens.size());
      const size_t offset = static_cast<size_t>(batch.first[ii]) * token_bytes;
      PAGEKV_ASSIGN_OR_RETURN(const KvSpan view, kv.Store(ii, l, k_rows.data() + offset, v_rows.data() + offset));
      float* scores = items[ii].scores == nullptr
                          ? nullptr
                          : items[ii].scores + static_cast<int64_t>(l) * kv_heads * view.num_tokens;
      prefill[ii] = {view.blocks, view.num_tokens, tokens, scores, items[ii].score_queries, view.tail};
      decode[ii] = {view.blocks, view.num_tokens, scores, view.tail};
    }
    {
      Stopwatch watch(attention_time);
      const PagedKv paged{&layout, kv.arena(), l};
      const auto from = static_cast<size_t>(i0), count = static_cast<size_t>(i1 - i0);
      AttentionOptions ao = attention_options;
      if (cp != nullptr) {
        ao.partial = true;
        ao.lse = &lse[static_cast<size_t>(r0 * q_heads)];
      }
      PAGEKV_RETURN_IF_ERROR(i1 - i0 == n ? be.DecodeAttention(paged, std::span(decode).subspan(from, count), qr, attr, ao)
                                          : be.PrefillAttention(paged, std::span(prefill).subspan(from, count), qr, attr, ao));
    }
    if (cp != nullptr) PAGEKV_RETURN_IF_ERROR(merge_attention(attr, r0, n));
    PAGEKV_RETURN_IF_ERROR(project_sum(L.wo, L.wo_halves, attr, n, tmpr));  // every rank's heads' part, summed
    add_bias(tmpr, n, d, L.bo);
    for_rows(n, [&](int64_t t0, int64_t t1) {
      be.AddInPlace(xr + t0 * d, tmpr + t0 * d, (t1 - t0) * d);
      be.RmsNormRows(xr + t0 * d, L.ffn_norm, t1 - t0, d, c.norm_eps, xbr + t0 * d);
    });
    PAGEKV_RETURN_IF_ERROR(matmul_shared({{L.w_gate, h1r}, {L.w_up, h2r}}, xbr, n));
    for_rows(n, [&](int64_t t0, int64_t t1) { be.SwiGluInPlace(h1r + t0 * hd, h2r + t0 * hd, (t1 - t0) * hd); });
    PAGEKV_RETURN_IF_ERROR(project_sum(L.w_down, L.w_down_halves, h1r, n, tmpr));  // every rank's hidden units' part
    for_rows(n, [&](int64_t t0, int64_t t1) { be.AddInPlace(xr + t0 * d, tmpr + t0 * d, (t1 - t0) * d); });
    return Status::Ok();
  };
  // Pipeline parallel: the step's items in micro-batches, each through this
  // stage's layers and on to the next stage, so that stage s works on
  // micro-batch m while stage s + 1 works on m - 1. One stage (or one
  // item): the whole step at once (each weight matrix read once).
  const int64_t micro = stages > 1 ? std::min<int64_t>(num_items, options.micro_batches > 0 ? options.micro_batches : stages) : 1;
  for (int64_t m = 0; m < micro; ++m) {
    const int64_t i0 = num_items * m / micro, i1 = num_items * (m + 1) / micro;
    const int64_t r0 = batch.first[static_cast<size_t>(i0)], r1 = i1 < num_items ? batch.first[static_cast<size_t>(i1)] : T;
    const int64_t bytes = (r1 - r0) * d * static_cast<int64_t>(sizeof(float));
    if (stage > 0) {
      Stopwatch watch(communication_time);
      PAGEKV_RETURN_IF_ERROR(pp->Recv(&x[static_cast<size_t>(r0 * d)], bytes, stage - 1, static_cast<int>(m)));
    }
    for (int32_t l = 0; l < num_layers; ++l) PAGEKV_RETURN_IF_ERROR(layer(l, i0, i1, r0, r1));
    if (stage < stages - 1) {
      Stopwatch watch(communication_time);
      PAGEKV_RETURN_IF_ERROR(pp->Send(&x[static_cast<size_t>(r0 * d)], bytes, stage + 1, static_cast<int>(m)));
    }
  }
  if (stage == stages - 1) PAGEKV_RETURN_IF_ERROR(Logits(items, batch, be, x.data(), xb.data(), options));
  if (stages > 1) {
    // Every stage samples: the last one's logits to all.
    Stopwatch watch(communication_time);
    for (const StepItem& item : items) {
      if (item.logits == nullptr) continue;
      const auto n = static_cast<int64_t>(item.all_logits ? item.tokens.size() : 1);
      PAGEKV_RETURN_IF_ERROR(pp->Broadcast(item.logits, n * c.vocab_size * static_cast<int64_t>(sizeof(float)), stages - 1));
    }
  }
  return Status::Ok();
}

}  // namespace pagekv
