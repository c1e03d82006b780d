// The planner: how many bytes a model's KV cache needs, before anything is
// allocated, and what to change when it does not fit. `pagekv plan` prints
// it; a serving stack can call it to size its pool.
//
// Every number comes from KvLayout, the same code that places bytes in a real
// cache, so the plan and the cache cannot disagree.
//
// Thread safety: pure functions over immutable tables.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pagekv/kv_layout.h"
#include "pagekv/status.h"

namespace pagekv {

// A named model geometry (public model cards / config.json values).
struct ModelPreset {
  std::string_view name;
  std::string_view description;
  CacheConfig config;        // geometry, block_len and dtype; num_blocks set only by seed examples
  int64_t context_len = 0;   // the model's trained context, the default --seq-len
};

std::span<const ModelPreset> ModelPresets();

// The preset with this name (case-insensitive); the error lists all names.
Result<ModelPreset> FindPreset(std::string_view name);

struct PlanRequest {
  // Geometry, block_len and format. The pool size is taken from, in order:
  // config.num_blocks; else config.budget_bytes (as many blocks as fit); else
  // batch sequences of seq_len tokens (exactly what they need). When both
  // num_blocks and budget_bytes are set the plan says whether the blocks fit.
  CacheConfig config;
  int64_t seq_len = 0;  // tokens per sequence, for max_sequences; 0 = not asked
  int64_t batch = 0;    // sequences wanted at once; 0 = not asked
};

struct Plan {
  CacheConfig config;  // as resolved: num_blocks set
  AttentionKind attention = AttentionKind::kMha;

  int64_t row_bytes = 0;                  // one K, V or latent row
  int64_t slab_bytes = 0;                 // block_len rows of one (layer, plane, head)
  int64_t slab_stride = 0;                // slab_bytes rounded up to 64
  int64_t bytes_per_token_per_layer = 0;  // all planes and heads of one layer
  int64_t bytes_per_token = 0;            // all layers
  int64_t bytes_per_block = 0;            // all slabs of one block, padding included
  int64_t padding_bytes_per_block = 0;
  int64_t num_blocks = 0;
  int64_t total_bytes = 0;
  int64_t tokens_capacity = 0;  // num_blocks * block_len
  // INT4 KIVI: the f16 rows of each sequence's not-yet-full key/value group,
  // kept beside the pool (KvLayout::tail_bytes_per_sequence); 0 otherwise.
  int64_t tail_bytes_per_sequence = 0;

  int64_t budget_bytes = 0;     // 0 when no budget was given
  bool fits_budget = true;      // total_bytes <= budget_bytes

  int64_t seq_len = 0;
  int64_t batch = 0;
  int64_t blocks_per_sequence = 0;     // ceil(seq_len / block_len)
  int64_t bytes_per_sequence = 0;      // blocks_per_sequence * bytes_per_block
  int64_t slack_tokens_per_sequence = 0;  // empty slots in a sequence's last block
  int64_t max_sequences = 0;           // num_blocks / blocks_per_sequence
  bool fits_batch = true;              // batch <= max_sequences

  // MLA only: what per-head K and V for every query head would cost
  // (num_q_heads * ((head_dim + rope_dim) + head_dim) elements per token and
  // layer) and how many times smaller the latent cache is. 0 otherwise.
  int64_t per_head_bytes_per_token = 0;
  double mla_reduction = 0;

  // Hybrid caches (config.layer_windows): the groups (each a window, 0 for
  // full attention, and its layers), the layers one block holds, and what
  // one sequence needs against a uniform cache of the same layers (every
  // layer keeping every token) at 8K, 32K and 128K tokens and at seq_len.
  // Per sequence, a sliding group holds at most ceil((W - 1) / block_len) + 1
  // blocks while decoding (a prompt chunk of C tokens: ceil((W - 1 + C) /
  // block_len) + 1 during its step). Empty for a uniform cache.
  struct Group {
    int32_t window = 0;
    std::vector<int32_t> layers;
    int64_t bytes_per_token = 0;  // its layers' rows of one token
  };
  std::vector<Group> groups;
  int32_t layers_per_block = 0;
  struct Saving {
    int64_t tokens = 0;
    int64_t uniform_bytes = 0;  // ceil(tokens / block_len) uniform blocks
    int64_t hybrid_bytes = 0;   // KvLayout::BlocksHeld(tokens, 1) hybrid blocks
  };
  std::vector<Saving> savings;

  // What to change when something does not fit, each with its numbers.
  std::vector<std::string> advice;
};

Result<Plan> MakePlan(const PlanRequest& request);

// Tensor parallel by head: what rank `rank` of `size` holds of a layer with
// num_q_heads query heads over num_kv_heads KV heads. The query heads are
// split evenly (num_q_heads must be a multiple of size); the KV heads too
// when size divides them, else, when num_kv_heads divides size, each KV
// head is replicated on size / num_kv_heads ranks (each rank holds the one
// its query heads read: kv_heads = 1). Other counts are refused, naming
// the sizes that work.
struct HeadShard {
  int32_t q_head0 = 0, q_heads = 0;    // query heads [q_head0, q_head0 + q_heads)
  int32_t kv_head0 = 0, kv_heads = 0;  // KV heads [kv_head0, kv_head0 + kv_heads), in this rank's pool
  int32_t kv_replicas = 1;             // ranks holding each KV head (> 1: replicated)
};
Result<HeadShard> ShardHeads(int32_t num_q_heads, int32_t num_kv_heads, int rank, int size);

// Tensor parallel over a row range of `total` rows (the feed-forward's
// hidden units): rank's contiguous [begin, end), split as evenly as
// `align` (the weights' block, so slices keep whole blocks) allows. Errors:
// total not a multiple of align, fewer align-sized units than ranks.
Result<std::pair<int64_t, int64_t>> ShardRange(int64_t total, int64_t align, int rank, int size);

// A cache as a caller describes it: a named preset, then every field given
// overriding it (unset fields keep the preset's, or the defaults; without
// a preset, num_layers is required and num_q_heads defaults to num_kv_heads,
// or 1 for an MLA cache). kv_lora_rank makes an MLA cache. The rules
// `pagekv plan` and the Python module share.
struct GeometrySpec {
  std::optional<std::string> preset;
  std::optional<int64_t> num_layers, num_q_heads, num_kv_heads, head_dim;
  std::optional<int64_t> kv_lora_rank, rope_dim, block_len;
  std::optional<std::string> dtype;         // ParseDType's names
  std::optional<std::string> layer_dtypes;  // ParseLayerFormats' syntax ("0=f16,-1=f16")
  std::optional<int64_t> num_blocks;
  std::optional<int64_t> budget_bytes;      // a budget without num_blocks sizes the pool (not the preset)
  std::optional<int64_t> seq_len, batch;    // a batch without seq_len: full-context sequences
  // Sliding-window layers: every layer slides over `sliding_window` tokens
  // except every sliding_pattern-th (layers P-1, 2P-1, ...: Gemma 3's 6),
  // which attends fully; a preset with windows keeps them unless
  // `uniform` (a uniform cache of the same layers, for comparison).
  std::optional<int64_t> sliding_window, sliding_pattern;
  bool uniform = false;
};

// How the caller's interface names each field, for error messages ("--layers"
// on a command line, "num_layers" in Python).
struct GeometryNames {
  const char* preset = "preset";
  const char* num_layers = "num_layers";
  const char* num_kv_heads = "num_kv_heads";
  const char* head_dim = "head_dim";
  const char* kv_lora_rank = "kv_lora_rank";
  const char* num_blocks = "num_blocks";
  const char* budget = "budget";
  const char* seq_len = "seq_len";
  const char* batch = "batch";
};

struct ResolvedPlanRequest {
  PlanRequest request;
  int64_t context_len = 0;      // the preset's trained context; 0 without a preset
  std::string title;            // "<preset>: <description>", or "custom geometry"
  // No pool size was given (no num_blocks, budget or batch): the request
  // plans one sequence of the preset's whole context.
  bool one_full_context = false;
};

// Errors (kInvalidArgument, naming the field as `names` does): no preset
// and no layer count, a non-positive num_blocks / budget / seq_len / batch,
// an unknown dtype or malformed layer_dtypes; kNotFound: an unknown preset.
// The geometry itself is checked by MakePlan / KvCache::Create.
Result<ResolvedPlanRequest> ResolvePlanRequest(const GeometrySpec& spec, const GeometryNames& names = {});

}  // namespace pagekv
