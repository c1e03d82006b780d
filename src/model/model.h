// Model: a forward pass over the paged KV cache, whatever the architecture.
//
// The engine, the benchmarks and the loaders hold a `Model`; each runner
// (llama_model.h: llama / qwen2 with per-head K and V; deepseek_model.h:
// deepseek2 with multi-head latent attention over a latent cache and
// mixture-of-experts feed-forward layers; gemma_model.h: gemma3 with
// sliding-window layers interleaved with full-attention ones) implements its layers and shares
// the rest here: the hyper-parameters every caller reads (ModelConfig), the
// step's checks, the token embedding and the classifier.
//
// The model knows nothing of allocation: it reads and writes KV through a
// StepKv (layout/step_kv.h) whose slots the block manager reserved before
// the step (engine/forward_step.h runs a step over a KvCache).
// Thread safety: Forward may run concurrently on different caches; a model
// is immutable once loaded.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "layout/step_kv.h"
#include "model/gguf_file.h"
#include "pagekv/dist.h"
#include "pagekv/ids.h"
#include "pagekv/kv_layout.h"
#include "pagekv/plan.h"
#include "pagekv/status.h"

namespace pagekv {

struct ModelConfig {
  std::string arch = "llama";  // general.architecture: "llama", "qwen2", "deepseek2" or "gemma3"
  int32_t dim = 0;
  int32_t hidden_dim = 0;    // dense feed-forward width
  int32_t num_layers = 0;
  int32_t num_heads = 0;     // query heads
  int32_t num_kv_heads = 0;  // K / V heads stored per token (1 for MLA: the latent row)
  int32_t head_dim = 0;      // per-head q.k width (MLA: qk_nope_dim + qk_rope_dim)
  int32_t vocab_size = 0;
  int32_t context_len = 0;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  int32_t rope_dims = 0;       // dimensions of each head that rotate (rope.dimension_count; head_dim when absent)
  bool rope_halves = false;    // rotate (i, i + rope_dims / 2) instead of (2i, 2i + 1): qwen2 (NEOX)
  // Rope scaling (rope.scaling.*): positions' angles times freq_scale
  // (linear: 1 / factor); YaRN blends scaled and unscaled angles per
  // frequency between its correction dimensions and scales cos / sin;
  // llama3 divides each frequency by a factor (1 for short wavelengths,
  // `factor` for long ones, a blend between) that a rope_freqs tensor
  // carries, or that is computed from rope.scaling.* when it is absent.
  enum class RopeScaling : uint8_t { kNone, kLinear, kYarn, kLlama3 };
  RopeScaling rope_scaling = RopeScaling::kNone;
  float rope_freq_scale = 1.0f;
  float rope_attn_factor = 1.0f;  // YaRN's magnitude factor (rope.scaling.attn_factor)
  int32_t rope_orig_context = 0;  // YaRN, llama3: rope.scaling.original_context_length
  float rope_factor = 1.0f;       // llama3: rope.scaling.factor
  float rope_low_freq_factor = 1.0f, rope_high_freq_factor = 4.0f;  // llama3 (Llama 3.1's values by default)
  bool rope_freq_factors = false; // a rope_freqs tensor divides each frequency (Llama 3.1's scaling)
  float rope_yarn_log_mul = 0.0f; // deepseek2: rope.scaling.yarn_log_multiplier / 0.1 (mscale_all_dim)

  // Multi-head latent attention (deepseek2; zero elsewhere).
  int32_t q_lora_rank = 0;   // 0: q straight from the hidden state (DeepSeek-V2-Lite)
  int32_t kv_lora_rank = 0;  // > 0 makes the cache a latent one (CacheKind::kMla)
  int32_t qk_nope_dim = 0;
  int32_t qk_rope_dim = 0;
  int32_t v_head_dim = 0;
  float attn_scale = 0.0f;   // logits scale; 0 = 1 / sqrt(head_dim)

  // Mixture of experts (deepseek2; zero elsewhere).
  int32_t num_experts = 0;
  int32_t experts_used = 0;
  int32_t expert_hidden_dim = 0;
  int32_t shared_experts = 0;
  int32_t leading_dense_layers = 0;
  int32_t expert_groups = 0;       // group-limited routing: groups of num_experts / expert_groups
  int32_t expert_groups_used = 0;  // groups a token may route to
  float expert_weights_scale = 1.0f;
  bool expert_weights_norm = false;
  bool expert_sigmoid = false;     // sigmoid gating (DeepSeek-V3) instead of softmax

  // Sliding-window attention (gemma3; empty elsewhere): layer_windows[l] is
  // the window of layer l in tokens (a query sees its last W positions,
  // itself included), 0 for a full-attention layer. Sliding layers rotate
  // with rope_theta_local and no scaling; full ones with rope_theta and the
  // file's scaling.
  std::vector<int32_t> layer_windows;
  float rope_theta_local = 10000.0f;
  float embed_scale = 0.0f;    // > 0: the token embedding times this (gemma: sqrt(dim))
  float final_softcap = 0.0f;  // > 0: logits = c * tanh(logits / c)

  bool mla() const { return kv_lora_rank > 0; }
  // The sliding window of layer l (0: full attention).
  int32_t window(int32_t l) const {
    return static_cast<size_t>(l) < layer_windows.size() ? layer_windows[static_cast<size_t>(l)] : 0;
  }
  bool hybrid() const {
    return std::any_of(layer_windows.begin(), layer_windows.end(), [](int32_t w) { return w > 0; });
  }
  // Elements of one cached row: a K or V head row, or the latent row
  // (kv_lora_rank + qk_rope_dim) of an MLA cache.
  int32_t kv_row_elems() const { return mla() ? kv_lora_rank + qk_rope_dim : head_dim; }
  // Multiply-adds of attention per query head and cached position: q . k
  // and p . v (MLA, absorbed: q_lat . row and p . row, rows of
  // kv_row_elems()).
  int64_t AttentionMultiplyAdds() const { return 2 * int64_t{kv_row_elems()}; }
};

// Where the time of Forward calls went (accumulated, seconds).
struct ForwardTimings {
  double total = 0;
  double attention = 0;  // paged attention kernels (MLA: the latent kernels and the absorption)
  double matmul = 0;     // weight products, classifier included
  double communication = 0;  // tensor parallel: in the collectives (waiting for the other ranks included)
};

struct ForwardOptions {
  int threads = 0;                    // 0 = every hardware thread
  ForwardTimings* timings = nullptr;  // optional
  // Weight products: kFast (the default) rounds the activations of steps of
  // a few tokens to int16 for integer dot products with block-quantized
  // weights, and runs steps of 16 tokens and more through AMX tiles with
  // bf16 hi + lo parts where the CPU has them; kF32 keeps every product in
  // f32 (the exact path). kernels/matmul.h.
  Activations activations = Activations::kFast;
  // Runs the math (kernels/backend.h); null = the CPU backend.
  const Backend* backend = nullptr;
  // Multi-head latent attention over a prompt chunk (deepseek_model.h):
  // kAuto takes, per chunk, the form with fewer multiply-adds (absorbed for
  // short chunks and decode, unabsorbed from about rank x (nope + v) / (2 x
  // (rank + rope - nope - rope)) queries up); the others force one
  // (tests, benchmarks). Decode steps are always absorbed.
  // (EngineOptions::MlaPrefill has the same values in the same order.)
  enum class MlaPrefill : uint8_t { kAuto, kAbsorbed, kUnabsorbed };
  MlaPrefill mla_prefill = MlaPrefill::kAuto;
  // Pipeline parallel: micro-batches a step's items are split into, so the
  // stages work at once (0: as many as stages; at most one per item).
  int micro_batches = 0;
  // Tensor parallel: the attention output and feed-forward down projections
  // are computed in two halves of their output features; the first half's
  // sum over the ranks runs (nonblocking) while the second half is
  // multiplied. false: each half's sum is waited for at once (the same
  // arithmetic, nothing hidden: what the overlap is measured against).
  bool overlap_communication = true;
};

class Model {
 public:
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }

  // Bytes of the weight matrices one step reads (each once per step whatever
  // the batch; for experts, every expert), and the multiply-adds one token
  // costs in them (for experts, the ones a token routes to).
  virtual int64_t StepWeightBytes() const = 0;
  virtual int64_t MatrixMultiplyAddsPerToken() const = 0;
  // Every parameter, the embedding included (counted once when tied).
  virtual int64_t ParameterCount() const = 0;

  // The cache geometry this model needs (format and block_len as given).
  virtual CacheConfig CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const = 0;

  // One step: every item's tokens go through the weights together (each
  // weight matrix is read once per step, not once per sequence), their KV
  // rows are stored through `kv`, and each sequence attends to its own
  // cached prefix. Items may mix prompt chunks and single decode tokens. The
  // slots are reserved before (the block manager's part:
  // engine/forward_step.h); the model computes only. Errors: a cache of
  // another geometry, token ids outside the vocabulary, positions past the
  // context length; on an error the stored rows of this step are garbage
  // and the caller rolls the step back.
  Status Forward(std::span<const StepItem> items, StepKv& kv, const ForwardOptions& options = {}) const;
  // Forward's checks of a step alone (what the caller runs before it
  // reserves anything).
  Status CheckStep(std::span<const StepItem> items, const KvLayout& layout) const;

  // Tensor parallel: the ranks this model is a shard of (null: the whole
  // model in this process). A shard's CacheGeometry is its rank's heads;
  // every rank must run the same steps in the same order.
  Communicator* tensor_parallel() const { return parallel_.tensor.get(); }
  // Every rank this model is split over (tensor and pipeline), null when
  // it is whole here: what a step is agreed over.
  Communicator* ranks() const { return parallel_.active() ? parallel_.all.get() : nullptr; }
  // Pipeline parallel: this stage's first layer (0 when not split by layer;
  // the cache's layer l is the model's first_layer() + l).
  int32_t first_layer() const { return first_layer_; }
  bool last_stage() const {
    return parallel_.pipeline == nullptr || parallel_.pipeline->rank() == parallel_.pipeline->size() - 1;
  }
  // What this rank holds of the attention heads (the whole when not sharded).
  virtual HeadShard head_shard() const;

 protected:
  using Matrix = WeightMatrix;  // [rows][cols] row-major (row = output)
  // The rows of one step: item i owns rows [first[i], first[i] + n_i).
  struct Batch {
    std::vector<int64_t> first;
    std::vector<int64_t> pos;  // per row
    int64_t rows = 0;
    // The item row t belongs to.
    size_t ItemOf(int64_t t) const;
  };

  Model() = default;

  // Every layer's KV format is one the runner reads: plain float, int8 /
  // fp8 rows of row_elems, and INT4 KIVI when `kivi`; else an error ending
  // in "(layer N<refusal>".
  static Status CheckLayerFormats(const CacheConfig& cc, int32_t row_elems, bool kivi, const std::string& refusal);
  // The architecture's part of CheckStep: the cache's geometry and formats.
  virtual Status CheckGeometry(const KvLayout& layout) const = 0;
  // The forward pass proper, after Forward's checks.
  virtual Status Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                         const ForwardOptions& options) const = 0;

  // Shared by the runners' Compute:
  // x[t] = the embedding row of row t's token.
  void Embed(std::span<const StepItem> items, const Batch& batch, const Backend& be, float* x) const;
  // The final RMSNorm and the classifier over the rows whose logits the
  // items want, in one product, copied to the items' logits. xb: scratch
  // of at least (wanted rows) x dim floats.
  Status Logits(std::span<const StepItem> items, const Batch& batch, const Backend& be, const float* x, float* xb,
                const ForwardOptions& options) const;

  // The start of every runner's FromGguf: takes the file, refuses any
  // "<arch>.*" key outside known_keys by name, and reads the architecture,
  // embedding_length, block_count, attention.head_count, context_length
  // and the RMSNorm epsilon into config_.
  Status ReadCommonMetadata(std::unique_ptr<GgufFile> file, std::span<const std::string_view> known_keys);
  // Loading helpers over file_ (valid while loading):
  // A matrix of the file (ggml dims {cols, rows}), checked.
  Result<Matrix> LoadMatrix(const std::string& name, int64_t rows, int64_t cols) const;
  // A 3-D tensor {cols, rows, count} as `count` matrices (experts, heads).
  Result<std::vector<Matrix>> LoadMatrices(const std::string& name, int64_t count, int64_t rows, int64_t cols) const;
  // A vector as f32 (converted once when stored in another type).
  Result<const float*> LoadVector(const std::string& name, int64_t n);
  // Null when the file has no such tensor.
  Result<const float*> LoadOptionalVector(const std::string& name, int64_t n);
  // The token embedding, output norm and classifier (tied when the file has
  // no output.weight).
  Status LoadEmbeddingAndHead();
  // Regroups an f32 / f16 / bf16 matrix into panels (PackedWeights), the
  // layout the products run fastest on from a few tokens up; block formats
  // stay as stored. The mapped file's pages of a packed matrix are released.
  Status Pack(Matrix& m);
  // Packs the classifier (a tied one gets its own panel copy; the embedding
  // stays row-major: a lookup reads one row, which panels would scatter).
  Status PackHead();
  // The rotary constants of config_ for heads of rope_head_dim elements,
  // their first rope_dims rotating (kernels/ops.h).
  void BuildRope(int32_t rope_head_dim);
  // Reads the rope keys under `prefix` ("<arch>.") into config_:
  // rope.freq_base, rope.scaling.* (none, linear, yarn, llama3).
  Status ReadRopeScaling(const std::string& prefix);
  // The rope_freqs tensor, or llama3's computed divisors.
  Status LoadRopeFreqs();

  static int64_t Bytes(const Matrix& m);
  // Rows [r0, r1) of a row-major matrix (in place: no copy).
  static Matrix SliceRows(const Matrix& m, int64_t r0, int64_t r1);
  // Columns [c0, c1) of a row-major matrix, copied (kept in converted_);
  // block formats need c0 and c1 on block boundaries.
  Result<Matrix> SliceColumns(const Matrix& m, int64_t c0, int64_t c1);

  std::unique_ptr<GgufFile> file_;            // GGUF weights, or
  std::shared_ptr<const std::byte> mapping_;  // a mapped llama2.c checkpoint
  ModelConfig config_;
  Matrix embedding_;                   // [vocab][dim]
  const float* final_norm_ = nullptr;  // [dim]
  Matrix classifier_;                  // [vocab][dim]
  std::vector<float> rope_freqs_;      // [rope_dims / 2] frequency divisors, when the file has them
  std::shared_ptr<const Rope> rope_;   // built from config_ and rope_freqs_ at load
  std::vector<std::vector<float>> converted_;  // vectors stored in another type, as f32 (and derived matrices)
  std::vector<PackedWeights> packed_;  // what the matrices point at after packing
  bool tied_embeddings_ = false;       // the classifier is the embedding (a panel copy of it)
  ModelParallel parallel_;             // the ranks this model is split over (none: whole here)
  int32_t first_layer_ = 0;            // pipeline parallel: this stage's first layer
};

// Loads a GGUF of any architecture a runner implements (dispatching on
// general.architecture); others are refused by name. Split over ranks
// (`parallel`): this rank's shard (llama / qwen2 only; others refused).
Result<std::unique_ptr<Model>> LoadGgufModel(std::unique_ptr<GgufFile> file, ModelParallel parallel = {});

}  // namespace pagekv
