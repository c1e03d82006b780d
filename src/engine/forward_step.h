// One forward step of the model over the paged cache: the only place the
// model's Forward runs (the engine's step loop, and through it Generate and
// the benchmarks, call this).
//
// The block manager's part comes first: every item's slots are reserved
// (allocation and copy-on-write happen here, never inside the model), all
// or nothing; then the model computes and stores K / V through the cache;
// a failure at any point puts every item back exactly as it was
// (KvCache::Unreserve: block tables, the shared blocks copies replaced,
// lengths, KIVI tails; no cut event). A cached prefix block a reservation
// took stays evicted.
//
// A hybrid cache (KvLayout::hybrid): each layer stores into and attends over
// its group's table, and after the step every sliding group releases the
// blocks its next query's window no longer reaches
// (KvCache::ReleaseOutOfWindow).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "model/model.h"
#include "pagekv/ids.h"
#include "pagekv/kv_cache.h"
#include "pagekv/status.h"

namespace pagekv {

// One sequence's part of a step.
struct ForwardItem {
  SeqId seq{};
  std::span<const int32_t> tokens;  // >= 1 token, at the sequence's next positions
  // Logits out: [tokens][vocab] when all_logits, else [vocab] for the last
  // token only (what sampling needs); null = none.
  float* logits = nullptr;
  bool all_logits = false;
  // Token eviction: when set, every layer's attention weights are added to
  // scores[layer][num_kv_heads][cached tokens after the step] (see
  // DecodeSeq::scores), from the last score_queries tokens of the item (0 =
  // all of them).
  float* scores = nullptr;
  int64_t score_queries = 0;
};

// A test hook: called before each item's K / V of each layer are stored; an
// error fails the step there (and rolls it back).
using StepFault = std::function<Status(size_t item, int32_t layer)>;

// Runs `items` at positions [len, len + n) of their sequences (len = the
// current length plus the tokens eviction dropped). Returns false (nothing
// changed) when the pool lacks the blocks for any item. Errors (the cache
// left as before the step): an unknown sequence, a sequence twice in one
// step, anything Forward refuses (token ids, positions past the context, a
// cache of another geometry).
// release_windows: whether a hybrid cache's sliding groups release after
// the step; false for a caller that publishes the step's blocks to a prefix
// cache first (so that they wait, evictable, for a later hit) and then
// calls KvCache::ReleaseOutOfWindow itself.
Result<bool> ForwardStep(const Model& model, KvCache& cache, std::span<const ForwardItem> items,
                         const ForwardOptions& options = {}, const StepFault* fault = nullptr,
                         bool release_windows = true);

// What a CUDA device runs beside the defaults (EngineOptions::tensor_cores,
// EngineOptions::cuda_graphs).
struct DeviceChoices {
  bool tensor_cores = false;
  bool cuda_graphs = false;
};

// The backend a device name asks for (EngineOptions::device): null for
// "cpu" (or empty), a CudaBackend for "cuda" / "cuda:N", with `choices`.
// Errors: another name, or a choice on the CPU (InvalidArgument); no
// GPU, or a build without the CUDA toolkit (Unavailable, naming the fix).
Result<std::unique_ptr<Backend>> MakeDeviceBackend(const std::string& device, DeviceChoices choices = {});

// One sequence's tokens (all their logits into logits[n][vocab]).
Result<bool> ForwardSequence(const Model& model, KvCache& cache, SeqId seq, std::span<const int32_t> tokens,
                             float* logits, const ForwardOptions& options = {});

}  // namespace pagekv
