// Synthetic llama checkpoints: deterministic random weights at realistic
// shapes, written as GGUF, so benchmarks and tests can run a model of real
// size with nothing downloaded. The text such a model writes is noise; its
// cost per token is that of a trained model of the same shape.
//
// The tokenizer is a SentencePiece-style vocabulary: <unk>, <s>, </s>, the
// 256 byte-fallback pieces, the printable ASCII characters, then generated
// lowercase pieces (half of them starting with a space) up to the
// vocabulary size, scored so longer pieces merge first.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagekv/status.h"

namespace pagekv {

struct SynthModelSpec {
  std::string name;
  int32_t dim = 0;
  int32_t hidden_dim = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t vocab_size = 0;  // >= 512 (room for the special, byte and ASCII pieces)
  int32_t context_len = 0;
  bool tied_embeddings = true;
  // Architecture variants (tests of the runner against tools/reference.py):
  std::string arch = "llama";  // or "qwen2": q/k/v biases, rotary on halves
  int32_t rope_dims = 0;       // rope.dimension_count; 0 = the head size
  std::string rope_scaling;    // rope.scaling.type: "" (none), "linear", "yarn", "llama3"
  double rope_factor = 1.0;    // rope.scaling.factor
  int32_t rope_orig_context = 0;  // rope.scaling.original_context_length; 0 = not written
  bool rope_freqs = false;     // a rope_freqs.weight tensor of per-frequency divisors in [1, 8)
  // deepseek2 (arch = "deepseek2"): multi-head latent attention and a
  // mixture of experts after the leading dense layers. num_kv_heads is
  // ignored (the cache holds one latent row); hidden_dim is the dense
  // layers' width.
  int32_t q_lora_rank = 0;   // 0: attn_q straight from the hidden state
  int32_t kv_lora_rank = 0;
  int32_t qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;
  bool legacy_kv_b = false;  // one attn_kv_b per layer instead of attn_k_b / attn_v_b
  int32_t leading_dense_layers = 0;
  int32_t num_experts = 0, experts_used = 0, expert_hidden_dim = 0, shared_experts = 0;
  int32_t expert_groups = 0, expert_groups_used = 0;  // group-limited routing (0: none)
  bool expert_sigmoid = false;      // gating function 2 (sigmoid), else 1 (softmax)
  bool expert_probs_bias = false;   // exp_probs_b selection bias per MoE layer
  bool expert_weights_norm = false;
  double expert_weights_scale = 1.0;
  double yarn_log_multiplier = 0.0;  // rope.scaling.yarn_log_multiplier as stored (0.1 * mscale_all_dim); 0 = not written
  // gemma3 (arch = "gemma3"): heads of head_dim (key_length, may differ
  // from dim / heads), sliding windows of sliding_window tokens on every
  // layer but each sliding_pattern-th, q / k norms, post-norms, GELU.
  int32_t head_dim = 0;
  int32_t sliding_window = 0;
  int32_t sliding_pattern = 0;

  int64_t ParameterCount() const;
};

// The presets, by name:
//   tiny        2 layers, dim 64, FFN 160, 4 heads over 2 KV heads, vocab 512 (tests)
//   llama-110m  12 layers, dim 768, 12 heads over 4 KV heads, FFN 2560,
//               vocab 32000, context 2048, tied embeddings: ~114M parameters
//   tiny-16k    the tiny shape with a 16384-token context (serving
//               benchmarks, whose trace prompts reach 14K tokens)
//   small-16k   2 layers, dim 256, vocab 32000, 16384-token context
//   micro-16k   1 layer, dim 32, 2 heads over 1 KV head (64 bytes of f16
//               KV per token), 16384-token context: the cheapest model
//               that replays a long-prompt trace (tier comparisons)
//   tiny-deepseek2       deepseek2: 3 layers (1 dense, 2 MoE of 4 experts,
//               2 used, 1 shared, sigmoid gating with a selection bias,
//               2 groups of which 1 is used, weights normalised and scaled),
//               dim 64, 4 heads, q LoRA 32, latent rank 64 + rope 16, nope
//               32, v 32, YaRN x4 with DeepSeek's mscale, vocab 512
//   tiny-deepseek2-lite  DeepSeek-V2-Lite's variant: no q LoRA, a legacy
//               attn_kv_b, softmax gating without groups or bias, no rope
//               scaling
//   tiny-gemma3  gemma3: 6 layers (sliding windows of 32 tokens, every
//               third layer full), dim 64, 4 heads of 32 over 1 KV head,
//               FFN 160, vocab 512, context 2048
//   small-gemma3-16k  gemma3 at small-16k's width: 6 layers (5 sliding
//               over 1024 tokens, 1 full), dim 256, 4 heads of 64 over 1 KV
//               head, FFN 768, vocab 32000, context 16384: serving traces
//               through a hybrid cache
//   small-deepseek2-16k  small-16k's hidden size (256) and depth with a
//               latent cache: 4 heads, rank 128 + rope 32, nope 64, v 64 (320
//               bytes of f16 KV per token and layer against small-16k's
//               512), 4 experts of 256 (2 used, 1 shared), 16384-token
//               context: the serving comparison of MLA with GQA
const std::vector<SynthModelSpec>& SynthModelPresets();
Result<SynthModelSpec> FindSynthModelPreset(const std::string& name);

// Weight storage for the matrices (norms stay f32): "f32", "f16", "bf16", "q8_0".
// Writes `path` atomically. The same spec, seed and type give the same bytes.
Status WriteSynthModel(const SynthModelSpec& spec, uint64_t seed, const std::string& weight_type,
                       const std::string& path);

}  // namespace pagekv
