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
const std::vector<SynthModelSpec>& SynthModelPresets();
Result<SynthModelSpec> FindSynthModelPreset(const std::string& name);

// Weight storage for the matrices (norms stay f32): "f32", "f16", "bf16", "q8_0".
// Writes `path` atomically. The same spec, seed and type give the same bytes.
Status WriteSynthModel(const SynthModelSpec& spec, uint64_t seed, const std::string& weight_type,
                       const std::string& path);

}  // namespace pagekv
