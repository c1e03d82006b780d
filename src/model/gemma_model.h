// GemmaModel: the gemma3 forward pass over the paged KV cache, llama.cpp's
// GGUF semantics.
//
// token embedding x sqrt(dim) -> n_layers x [RMSNorm -> q, k, v -> per-head
// RMSNorm of q and k (attn_q_norm / attn_k_norm) -> rotary embedding (NEOX
// halves; sliding layers at rope.freq_base_swa, 10000 by default, unscaled;
// full layers at rope.freq_base with the file's scaling) -> K and V to the
// cache -> paged attention, a sliding window of attention.sliding_window
// tokens on the sliding layers, scale 1 / sqrt(head_dim) (1 / sqrt(dim /
// heads) for the 62-layer 27B, as llama.cpp reads query_pre_attn_scalar) ->
// output projection -> RMSNorm (post_attention_norm) -> residual -> RMSNorm
// -> GELU(tanh)-gated feed-forward -> RMSNorm (post_ffw_norm) -> residual]
// -> final RMSNorm -> classifier (tied to the embedding when output.weight
// is absent) -> optional final_logit_softcapping.
//
// Which layers slide: attention.sliding_window_pattern, an int period P
// (layer l slides when l % P < P - 1; 6 when absent: five sliding layers
// then one full one) or a per-layer bool array. The norms' weights are read
// as GGUF stores them (the converter has already added Gemma's 1).
//
// The hyper-parameters are in ModelConfig (layer_windows, rope_theta_local,
// embed_scale, final_softcap); a hybrid cache (kvcache/) frees what a
// sliding layer can no longer see, the attention reads only its window
// either way. Metadata or tensors the runner does not implement are refused
// by name at load.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/model.h"

namespace pagekv {

class GemmaModel final : public Model {
 public:
  static Result<std::unique_ptr<GemmaModel>> FromGguf(std::unique_ptr<GgufFile> file);

  int64_t StepWeightBytes() const override;
  int64_t MatrixMultiplyAddsPerToken() const override;
  int64_t ParameterCount() const override;
  CacheConfig CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const override;

 private:
  struct Layer {
    const float* attn_norm;   // [dim]
    Matrix wq;                // [heads * head_dim][dim]
    Matrix wk;                // [kv_heads * head_dim][dim]
    Matrix wv;                // [kv_heads * head_dim][dim]
    const float* q_norm;      // [head_dim]
    const float* k_norm;      // [head_dim]
    Matrix wo;                // [dim][heads * head_dim]
    const float* post_attn_norm;  // [dim]
    const float* ffn_norm;    // [dim]
    Matrix w_gate;            // [hidden][dim]
    Matrix w_up;              // [hidden][dim]
    Matrix w_down;            // [dim][hidden]
    const float* post_ffn_norm;   // [dim]
  };

  GemmaModel() = default;
  Status CheckGeometry(const KvLayout& layout) const override;
  Status Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                 const ForwardOptions& options) const override;

  std::vector<Layer> layers_;
  std::shared_ptr<const Rope> rope_local_;  // the sliding layers' rotary constants
  float attn_scale_ = 0;
};

}  // namespace pagekv
