// LlamaModel: the llama-architecture forward pass over the paged KV cache.
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
// Architectures: llama (also Mistral-style files that say llama) and qwen2.
// Metadata or tensors the runner does not implement (another architecture,
// sliding windows, soft-capping, an unknown rope scaling, experts, extra
// tensors) are refused by name at load, before any weight is read.
// Weights: f32, f16, bf16 and every ggml block format of
// kernels/weight_formats.h (mixed freely, as GGUF files do), read in place;
// vectors (norms, biases) in any of those are converted to f32 at load.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/model.h"

namespace pagekv {

class LlamaModel final : public Model {
 public:
  // Validates the architecture, the hyper-parameters and every tensor's
  // shape; takes ownership of the file (the weights stay memory-mapped).
  // With `tp` over more than one rank: this rank's shard (HeadShard of
  // plan.h over the query and KV heads; the feed-forward's hidden units
  // split in whole weight blocks; the output and down projections' columns
  // to match, their partial sums added across the ranks after each).
  // With pipeline parallel: this stage's range of layers (and their KV).
  static Result<std::unique_ptr<LlamaModel>> FromGguf(std::unique_ptr<GgufFile> file, ModelParallel parallel = {});

  // A llama2.c checkpoint (legacy v0 header: seven int32 dim, hidden_dim,
  // n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size
  // means the classifier is stored separately, else it is the embedding;
  // then the f32 weights). Every size is checked against the file length.
  static Result<std::unique_ptr<LlamaModel>> FromLlama2c(const std::string& path, ModelParallel parallel = {});

  int64_t StepWeightBytes() const override;
  int64_t MatrixMultiplyAddsPerToken() const override;
  int64_t ParameterCount() const override;
  CacheConfig CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const override;
  HeadShard head_shard() const override { return shard_; }

 private:
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
    // Tensor parallel: wo and w_down as two halves of their output rows
    // (packed instead of them), so that the first half's sum over the ranks
    // overlaps the second half's product; empty when not split.
    Matrix wo_halves[2], w_down_halves[2];
  };

  LlamaModel() = default;
  Status CheckGeometry(const KvLayout& layout) const override;
  Status Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                 const ForwardOptions& options) const override;
  // Packs every f32 / f16 / bf16 matrix (Model::Pack); q8_0 and the other
  // block formats stay as stored.
  Status PackWeights();
  // Keeps this rank's slices of every layer (before packing); a no-op
  // without tp (or with one rank).
  Status ShardLayers(ModelParallel parallel);

  std::vector<Layer> layers_;
  HeadShard shard_;         // this rank's heads (all of them unsharded)
  int64_t hidden_rows_ = 0; // this rank's feed-forward hidden units
};

}  // namespace pagekv
