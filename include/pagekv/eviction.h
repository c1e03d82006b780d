// Token eviction: keep a budgeted fraction of a sequence's tokens in the
// paged cache and drop the rest, so that memory really shrinks.
//
// Policies (chosen per sequence; the kept set is chosen per layer and KV head
// group, every (layer, head) keeping the same number of tokens):
//   none       every token stays.
//   streaming  StreamingLLM: the first `sink_tokens` tokens (attention sinks)
//              plus the most recent ones.
//   h2o        Heavy-Hitter Oracle: a recent window (recent_fraction of the
//              budget) plus the tokens with the largest attention weight
//              accumulated over every query so far (prompt and decode).
//   snapkv     SnapKV: once, when the prompt ends, the last `window` prompt
//              queries' attention weights, max-pooled over `pool_kernel`
//              neighbouring positions, pick the prompt tokens to keep beside
//              the window itself; generated tokens are then all kept.
//
// Budget: after every step a streaming or h2o sequence holds at most
// ceil(budget * tokens seen) tokens (tokens seen = cached + evicted); snapkv
// holds ceil(budget * prompt length) prompt tokens after the prompt. Budget 1
// never evicts, so its outputs equal the no-policy ones bit for bit.
//
// The weights come from the attention kernels themselves (ForwardItem::scores
// -> DecodeSeq / PrefillSeq::scores): logits they already computed,
// normalised by each row's final log-sum-exp, with no second pass over K.
// Dropping tokens compacts the survivors into the lowest slots
// (KvCache::Compact: at most one row moves per dropped token) and returns
// emptied blocks to the pool. Rotary positions are baked into cached keys,
// so order in the cache does not matter; later tokens keep their true
// positions (SequenceView::evicted).
//
// Eviction rewrites blocks, so it needs sequences that own theirs: no fork
// and no prefix caching of the evicted sequence (Compact refuses otherwise).
// Formats: any whose rows are self-contained (f32, f16, bf16, int8, fp8).
//
// Thread safety: a TokenEvictor belongs to one sequence and one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagekv/ids.h"
#include "pagekv/kv_cache.h"
#include "pagekv/kv_layout.h"
#include "pagekv/status.h"

namespace pagekv {

enum class EvictionPolicy : uint8_t { kNone, kStreaming, kH2O, kSnapKV };

std::string_view EvictionPolicyName(EvictionPolicy p);  // "none", "streaming", "h2o", "snapkv"

struct EvictionOptions {
  EvictionPolicy policy = EvictionPolicy::kNone;
  double budget = 1.0;           // fraction of tokens kept, (0, 1]
  int32_t sink_tokens = 4;       // streaming: first tokens always kept, >= 0
  double recent_fraction = 0.5;  // h2o: share of the kept tokens that is the recent window, [0, 1]
  int32_t window = 32;           // snapkv: observation window, the last prompt tokens, >= 1
  int32_t pool_kernel = 7;       // snapkv: max-pool width over positions, odd, >= 1

  // Every field checked; the error names the field, its value and the range.
  Status Validate() const;
};

// Parses "none" | "streaming" | "h2o" | "snapkv" with a budget in (0, 1]
// (other fields at their defaults). Errors name the accepted values.
Result<EvictionOptions> ParseEvictionPolicy(std::string_view name, double budget);

// The scores a step needs from the model (ForwardItem::scores and
// score_queries); scores is null when the step needs none.
struct StepScores {
  float* scores = nullptr;  // [num_layers][num_kv_heads][cached tokens after the step], zeroed
  int64_t score_queries = 0;
};

struct EvictionStats {
  int64_t tokens_evicted = 0;
  int64_t compactions = 0;
  int64_t rows_moved = 0;  // per (layer, head), K and V counted once
};

// One sequence's eviction state: every cached slot's position and, for h2o,
// its accumulated attention weight, per (layer, KV head).
class TokenEvictor {
 public:
  // Errors: invalid options; an MLA layout (no per-head rows); a format
  // whose rows are not self-contained.
  static Result<std::unique_ptr<TokenEvictor>> Create(const EvictionOptions& options, const KvLayout& layout);

  const EvictionOptions& options() const { return options_; }

  // Before a step that appends n tokens to a sequence now holding `cached`
  // tokens; prompt_ends marks the step that appends the prompt's last token.
  StepScores BeginStep(int64_t cached, int64_t n, bool prompt_ends);

  // After that step succeeded: folds its scores in, records the new tokens'
  // positions, and evicts down to the budget (KvCache::Compact). Errors:
  // the sequence's length is not what BeginStep was told plus n, or
  // Compact's errors (nothing changed then).
  Status EndStep(KvCache& cache, SeqId seq);

  // Original positions of the cached slots of one (layer, head), slot order.
  std::span<const int64_t> Positions(int32_t layer, int32_t head) const;
  int64_t cached() const { return cached_; }
  int64_t seen() const { return seen_; }
  const EvictionStats& stats() const { return stats_; }
  // Aborts with a message when its index disagrees: one position list (and,
  // for h2o, one score list) per (layer, head) of exactly cached() slots,
  // distinct positions below seen().
  void CheckInvariants() const;

 private:
  TokenEvictor(const EvictionOptions& options, const KvLayout& layout);
  // Chooses the kept slots of every (layer, head) into keep_ ([lists][k]).
  void ChooseStreaming(int64_t k);
  // Keeps the `recent` latest positions and the k - recent best scores of the rest.
  void ChooseByScore(int64_t k, int64_t recent, const std::vector<std::vector<float>>& score);
  Status Apply(KvCache& cache, SeqId seq, int64_t k);

  EvictionOptions options_;
  int32_t layers_ = 0, heads_ = 0;
  int64_t cached_ = 0;  // slots in the cache
  int64_t seen_ = 0;    // tokens ever appended
  int64_t step_n_ = 0;  // the open step's token count (0: none open)
  bool step_prompt_ends_ = false;
  bool prompt_done_ = false;
  std::vector<std::vector<int64_t>> positions_;  // [lists][cached_]
  std::vector<std::vector<float>> acc_;          // h2o: [lists][cached_]
  std::vector<float> step_;  // the open step's scores [lists][cached_ + n]
  std::vector<int32_t> keep_;
  EvictionStats stats_;
};

}  // namespace pagekv
