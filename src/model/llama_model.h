// LlamaModel: a llama-architecture forward pass over the paged KV cache.
//
// token embedding -> n_layers x [RMSNorm -> q, k, v (+ biases, qwen2) ->
// rotary embedding on the first rope_dims dimensions of each head (adjacent
// pairs for llama, the llama2.c and GGUF convention; halves for qwen2;
// linear or YaRN scaling and per-frequency factors as the file says) -> K
// and V written to the cache one
// layer at a time -> paged attention over the cache (GQA) -> output
// projection -> residual -> RMSNorm -> SwiGLU feed-forward -> residual]
// -> final RMSNorm -> classifier.
//
// The model knows nothing of allocation: it reads and writes KV through a
// StepKv (layout/step_kv.h) whose slots the block manager reserved before
// the step (engine/forward_step.h runs a step over a KvCache).
//
// Architectures: llama (also Mistral-style files that say llama) and qwen2.
// Metadata or tensors the runner does not implement (another architecture,
// sliding windows, soft-capping, an unknown rope scaling, experts, extra
// tensors) are refused by name at load, before any weight is read.
// Weights: f32, f16, bf16 and every ggml block format of
// kernels/weight_formats.h (mixed freely, as GGUF files do), read in place;
// vectors (norms, biases) in any of those are converted to f32 at load.
// Thread safety: Forward may run concurrently on different caches; the model
// itself is immutable.
#pragma once

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
#include "pagekv/ids.h"
#include "pagekv/kv_layout.h"
#include "pagekv/status.h"

namespace pagekv {

struct LlamaConfig {
  int32_t dim = 0;
  int32_t hidden_dim = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t vocab_size = 0;
  int32_t context_len = 0;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  std::string arch = "llama";  // "llama" or "qwen2"
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
};

// Where the time of Forward calls went (accumulated, seconds).
struct ForwardTimings {
  double total = 0;
  double attention = 0;  // paged attention kernels
  double matmul = 0;     // weight products, classifier included
};

struct ForwardOptions {
  int threads = 0;                    // 0 = every hardware thread
  ForwardTimings* timings = nullptr;  // optional
  // Block-quantized weights: kInt16 (the default, the fast path) rounds the
  // activations of steps of a few tokens to int16 for integer dot products;
  // kF32 keeps every product in f32 (the exact path). kernels/matmul.h.
  Activations activations = Activations::kInt16;
  // Runs the math (kernels/backend.h); null = the CPU backend.
  const Backend* backend = nullptr;
};

class LlamaModel {
 public:
  // Validates the architecture, the hyper-parameters and every tensor's
  // shape; takes ownership of the file (the weights stay memory-mapped).
  static Result<std::unique_ptr<LlamaModel>> FromGguf(std::unique_ptr<GgufFile> file);

  // A llama2.c checkpoint (legacy v0 header: seven int32 dim, hidden_dim,
  // n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size
  // means the classifier is stored separately, else it is the embedding;
  // then the f32 weights). Every size is checked against the file length.
  static Result<std::unique_ptr<LlamaModel>> FromLlama2c(const std::string& path);

  const LlamaConfig& config() const { return config_; }

  // Bytes of the weight matrices one step reads (every layer's and the
  // classifier; each once per step whatever the batch), and the
  // multiply-adds one token costs in them.
  int64_t StepWeightBytes() const;
  int64_t MatrixMultiplyAddsPerToken() const;
  // Every parameter, the embedding included (counted once when tied).
  int64_t ParameterCount() const;

  // The cache geometry this model needs (format and block_len as given).
  CacheConfig CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const;

  // One step: every item's tokens go through the weights together (each
  // weight matrix is read once per step, not once per sequence), their K and
  // V are stored through `kv`, and each sequence attends to its own cached
  // prefix. Items may mix prompt chunks and single decode tokens. The slots
  // are reserved before (the block manager's part: engine/forward_step.h);
  // the model computes only. Errors: a cache of another geometry, token ids
  // outside the vocabulary, positions past the context length; on an error
  // the stored rows of this step are garbage and the caller rolls the step
  // back.
  Status Forward(std::span<const StepItem> items, StepKv& kv, const ForwardOptions& options = {}) const;
  // Forward's checks of a step alone (what the caller runs before it
  // reserves anything).
  Status CheckStep(std::span<const StepItem> items, const KvLayout& layout) const;

 private:
  using Matrix = WeightMatrix;  // [rows][cols] row-major (row = output)
  struct Layer {
    const float* attn_norm;  // [dim]
    Matrix wq;               // [dim][dim]
    Matrix wk;               // [kv_dim][dim]
    Matrix wv;               // [kv_dim][dim]
    Matrix wo;               // [dim][dim]
    const float* ffn_norm;   // [dim]
    Matrix w_gate;           // [hidden][dim]
    Matrix w_up;             // [hidden][dim]
    Matrix w_down;           // [dim][hidden]
    const float* bq = nullptr;  // biases (qwen2; optional for llama), or null
    const float* bk = nullptr;
    const float* bv = nullptr;
    const float* bo = nullptr;
  };
  struct Batch;  // the rows of one step (llama_model.cc)

  LlamaModel() = default;
  // The forward pass proper, after Forward's checks.
  Status Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch, const ForwardOptions& options) const;
  // Regroups every f32 / f16 / bf16 matrix into panels (PackedWeights), the
  // layout the products run fastest on from a few tokens up; q8_0 stays as
  // stored. The mapped file's pages are then only read for the norms.
  Status PackWeights();
  // The rotary constants of config_ and rope_freqs_ (kernels/ops.h).
  void BuildRope();

  std::unique_ptr<GgufFile> file_;          // GGUF weights, or
  std::shared_ptr<const std::byte> mapping_;  // a mapped llama2.c checkpoint
  LlamaConfig config_;
  Matrix embedding_;                   // [vocab][dim]
  const float* final_norm_ = nullptr;  // [dim]
  std::vector<float> rope_freqs_;      // [rope_dims / 2] frequency divisors, when the file has them
  std::shared_ptr<const Rope> rope_;   // built from config_ and rope_freqs_ at load
  Matrix classifier_;                  // [vocab][dim]
  std::vector<std::vector<float>> converted_;  // norm vectors stored in another type, as f32
  std::vector<Layer> layers_;
  std::vector<PackedWeights> packed_;  // what the matrices point at after PackWeights
  bool tied_embeddings_ = false;       // the classifier is the embedding (a panel copy of it)
};

}  // namespace pagekv
