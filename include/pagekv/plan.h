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
#include <span>
#include <string>
#include <string_view>
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

  // What to change when something does not fit, each with its numbers.
  std::vector<std::string> advice;
};

Result<Plan> MakePlan(const PlanRequest& request);

}  // namespace pagekv
