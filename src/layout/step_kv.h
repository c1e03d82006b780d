// The forward pass's view of one step, as integers and pointers: which
// tokens each sequence runs at which positions, and the KV side it writes
// and reads through. The block manager (kvcache) reserves every slot before
// the step and implements StepKv over its pool; the model (model/) computes
// and never allocates. A device backend implements StepKv over its own
// arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "pagekv/ids.h"
#include "pagekv/kv_layout.h"
#include "pagekv/status.h"

namespace pagekv {

// One sequence's part of a step (item i of the step is StepKv's item i).
struct StepItem {
  std::span<const int32_t> tokens;  // >= 1
  int64_t position = 0;             // rotary position of tokens[0] (cached tokens + evicted ones)
  // Logits out: [tokens][vocab] when all_logits, else [vocab] for the last
  // token only; null = none.
  float* logits = nullptr;
  bool all_logits = false;
  // Token eviction: every layer's attention weights are added to
  // scores[layer][num_kv_heads][cached tokens after the step], from the last
  // score_queries tokens (0 = all of them).
  float* scores = nullptr;
  int64_t score_queries = 0;
};

// What attention reads of one sequence at one layer: its block table, its
// cached tokens (the step's included) and its INT4 KIVI tail (or null).
struct KvSpan {
  std::span<const BlockId> blocks;
  int64_t num_tokens = 0;
  const std::byte* tail = nullptr;
};

// The KV side of a step: the pool's layout and arena, and, per item and
// layer, where the step's new K / V rows go.
class StepKv {
 public:
  virtual ~StepKv() = default;
  virtual const KvLayout& layout() const = 0;
  virtual const std::byte* arena() const = 0;
  // Stores item's new rows of `layer` ([tokens][kv heads] rows, each
  // EncodedRowBytes of the layer's format: kernels/ops.h) and returns what
  // attention then reads for it.
  virtual Result<KvSpan> Store(size_t item, int32_t layer, const std::byte* k, const std::byte* v) = 0;
};

}  // namespace pagekv
