// DeepseekModel: the deepseek2 architecture (DeepSeek-V2 / V2-Lite / V3 as
// llama.cpp's GGUF describes them) over a latent KV cache.
//
// Per layer: RMSNorm -> multi-head latent attention -> residual -> RMSNorm
// -> feed-forward (SwiGLU for the leading dense layers, then a mixture of
// experts: routed experts chosen per token plus shared experts) -> residual.
//
// Attention (the data flow of docs/ARCHITECTURE.md, "Multi-head latent
// attention"): q = W_q x (or W_qb RMSNorm(W_qa x) with a q LoRA), split per
// head into q_nope and q_pe; [c_kv, k_pe] = W_kva x; c_kv normalised
// (RMSNorm), k_pe rotated: the cache stores the one row [c_kv, k_pe] per
// token and layer (CacheKind::kMla), in any plain float, int8 or fp8
// format. Attention runs in the absorbed form: each head's q_nope taken into
// latent space through W_UK (attn_k_b, or the k half of a legacy
// attn_kv_b), the latent kernels score every head against the shared rows
// (q_lat . c_kv + q_pe . k_pe, scaled by the YaRN-corrected 1 / sqrt(nope +
// rope)), and the weighted latent sum comes back per head through W_UV
// (attn_v_b) before the output projection. The unabsorbed formula (per-head
// keys [W_UK c_kv, k_pe] and values W_UV c_kv) is what tools/reference.py
// computes; the two agree to rounding. Long prompt chunks run that
// unabsorbed form instead when it costs fewer multiply-adds
// (ForwardOptions::mla_prefill): keys and values materialised once per
// cached token and head, then read by the chunk's queries at nope + rope
// (and v) elements per head instead of rank + rope twice.
//
// Routing: softmax or sigmoid gate probabilities (expert_gating_func), an
// optional selection bias (exp_probs_b, DeepSeek-V3) added for the choice
// only, group-limited routing (expert_group_count / expert_group_used_count:
// a group scores the sum of its two best experts), top-k, weights
// normalised (expert_weights_norm) and scaled (expert_weights_scale).
//
// Refused by name at load: metadata or tensors the runner does not
// implement (multi-token-prediction layers, attention temperature scaling,
// fused gate-up experts, other gating functions, rope scaling other than
// none and yarn).
#pragma once

#include <memory>
#include <vector>

#include "model/model.h"

namespace pagekv {

class DeepseekModel final : public Model {
 public:
  static Result<std::unique_ptr<DeepseekModel>> FromGguf(std::unique_ptr<GgufFile> file);

  int64_t StepWeightBytes() const override;
  int64_t MatrixMultiplyAddsPerToken() const override;
  int64_t ParameterCount() const override;
  // A latent cache: CacheKind::kMla, rows of kv_lora_rank + qk_rope_dim.
  CacheConfig CacheGeometry(int32_t block_len, DType dtype, int64_t num_blocks) const override;

 private:
  struct Ffn {  // SwiGLU: down(silu(gate x) * up x)
    Matrix gate, up, down;
  };
  struct Layer {
    const float* attn_norm = nullptr;  // [dim]
    Matrix wq;                         // [heads * (nope + rope)][dim], when there is no q LoRA
    Matrix wq_a;                       // [q_lora][dim]
    const float* q_a_norm = nullptr;   // [q_lora]
    Matrix wq_b;                       // [heads * (nope + rope)][q_lora]
    Matrix wkv_a;                      // [rank + rope][dim]
    const float* kv_a_norm = nullptr;  // [rank]
    std::vector<Matrix> wk_b;          // per head [rank][nope]: q_lat = wk_b[h] q_nope
    std::vector<Matrix> wk_b_t;        // per head [nope][rank]: k_nope = wk_b_t[h] c_kv (unabsorbed prefill)
    std::vector<Matrix> wv_b;          // per head [v][rank]: v = wv_b[h] o_lat
    Matrix wo;                         // [dim][heads * v]
    const float* ffn_norm = nullptr;   // [dim]
    Ffn dense;                         // leading dense layers
    Matrix gate_inp;                   // [experts][dim] (MoE layers)
    const float* probs_bias = nullptr; // [experts] selection bias, or null
    std::vector<Ffn> experts;
    Ffn shared;                        // rows = expert width x shared experts; none when 0 shared
    bool moe = false;
  };

  DeepseekModel() = default;
  Status CheckGeometry(const KvLayout& layout) const override;
  Status Compute(std::span<const StepItem> items, StepKv& kv, const Batch& batch,
                 const ForwardOptions& options) const override;
  Status LoadLayer(int32_t l, Layer& L);
  // Whether a chunk of n queries runs the unabsorbed form.
  bool Unabsorbed(int64_t n, const ForwardOptions& options) const;
  // One sequence's chunk in the unabsorbed form: its cached latent rows
  // (the chunk's included) read back, per-head keys [W_UK c_kv, k_pe] and
  // values W_UV c_kv materialised into a per-head scratch cache, the
  // per-head paged kernel over them. q: [n][heads][nope + rope] (q_pe
  // rotated); o: [n][heads][v].
  Status UnabsorbedAttention(const Layer& L, const PagedKv& kv, const KvSpan& view, const float* q, int64_t n, float* o,
                             const ForwardOptions& options, const Backend& be) const;
  // Per token: the experts chosen and their weights ([T][experts_used]).
  void Route(const Layer& L, const float* logits, int64_t T, int32_t* chosen, float* weights) const;
  Status PackWeights();
  std::vector<Matrix*> Matrices(Layer& L);
  std::vector<const Matrix*> Matrices(const Layer& L) const;

  std::vector<Layer> layers_;
};

}  // namespace pagekv
