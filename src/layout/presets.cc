// Model geometries for the planner, from the models' published configs.
#include <cctype>
#include <string>

#include "pagekv/plan.h"

namespace pagekv {
namespace {

constexpr CacheConfig PerHead(int32_t layers, int32_t q_heads, int32_t kv_heads, int32_t head_dim) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_q_heads = q_heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  return c;
}

CacheConfig SeedExample() {
  CacheConfig c = PerHead(61, 128, 8, 128);
  c.block_len = 128;
  c.num_blocks = 512;
  return c;
}

// Gemma 3: every sixth layer (5, 11, ...) attends fully, the rest slide over
// `window` tokens (config.json: sliding_window, sliding_window_pattern 6).
CacheConfig Gemma3(int32_t layers, int32_t q_heads, int32_t kv_heads, int32_t head_dim, int32_t window) {
  CacheConfig c = PerHead(layers, q_heads, kv_heads, head_dim);
  c.format = KvFormat::Plain(DType::kBF16);
  c.layer_windows.assign(static_cast<size_t>(layers), window);
  for (int32_t l = 5; l < layers; l += 6) c.layer_windows[static_cast<size_t>(l)] = 0;
  return c;
}

CacheConfig DeepSeekV3() {
  CacheConfig c;
  c.kind = CacheKind::kMla;
  c.num_layers = 61;
  c.num_q_heads = 128;
  c.head_dim = 128;  // qk_nope_head_dim = v_head_dim = 128
  c.kv_lora_rank = 512;
  c.rope_dim = 64;
  c.format = KvFormat::Plain(DType::kBF16);
  return c;
}

const ModelPreset kPresets[] = {
    {"deepseek-v3", "DeepSeek-V3/R1 671B: MLA latent cache, 61 layers, rank 512 + rope 64",
     DeepSeekV3(), 163840},
    {"seed-deepseek-v3",
     "per-head worked example: 61 layers x 8 KV heads x 128 dims, 512 blocks of 128 tokens",
     SeedExample(), 16384},
    {"llama3-8b", "Llama 3 / 3.1 8B: 32 layers, 32 query heads, 8 KV heads (GQA), dim 128",
     PerHead(32, 32, 8, 128), 8192},
    {"llama3-70b", "Llama 3 / 3.1 70B: 80 layers, 64 query heads, 8 KV heads (GQA), dim 128",
     PerHead(80, 64, 8, 128), 8192},
    {"llama2-7b", "Llama 2 7B: 32 layers, 32 heads (MHA), dim 128", PerHead(32, 32, 32, 128), 4096},
    {"qwen2.5-7b", "Qwen2.5 7B: 28 layers, 28 query heads, 4 KV heads (GQA), dim 128",
     PerHead(28, 28, 4, 128), 32768},
    {"mistral-7b", "Mistral 7B: 32 layers, 32 query heads, 8 KV heads (GQA), dim 128",
     PerHead(32, 32, 8, 128), 32768},
    {"tinyllama-1.1b", "TinyLlama 1.1B: 22 layers, 32 query heads, 4 KV heads (GQA), dim 64",
     PerHead(22, 32, 4, 64), 2048},
    {"gemma3-270m", "Gemma 3 270M: 18 layers (15 sliding over 512 tokens, 3 full), 4 query heads, 1 KV head, dim 256",
     Gemma3(18, 4, 1, 256, 512), 32768},
    {"gemma3-1b", "Gemma 3 1B: 26 layers (22 sliding over 512 tokens, 4 full), 4 query heads, 1 KV head, dim 256",
     Gemma3(26, 4, 1, 256, 512), 32768},
    {"gemma3-4b", "Gemma 3 4B: 34 layers (29 sliding over 1024 tokens, 5 full), 8 query heads, 4 KV heads, dim 256",
     Gemma3(34, 8, 4, 256, 1024), 131072},
    {"gemma3-12b", "Gemma 3 12B: 48 layers (40 sliding over 1024 tokens, 8 full), 16 query heads, 8 KV heads, dim 256",
     Gemma3(48, 16, 8, 256, 1024), 131072},
    {"gemma3-27b", "Gemma 3 27B: 62 layers (52 sliding over 1024 tokens, 10 full), 32 query heads, 16 KV heads, dim 128",
     Gemma3(62, 32, 16, 128, 1024), 131072},
    {"stories260k", "stories260K (../shared/models): 5 layers, 8 query heads, 4 KV heads, dim 8",
     PerHead(5, 8, 4, 8), 512},
};

}  // namespace

std::span<const ModelPreset> ModelPresets() { return kPresets; }

Result<ModelPreset> FindPreset(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string names;
  for (const ModelPreset& p : kPresets) {
    if (p.name == lower) return p;
    if (!names.empty()) names += ", ";
    names += p.name;
  }
  return NotFoundError("unknown preset '" + std::string(name) + "': use one of " + names);
}

}  // namespace pagekv
