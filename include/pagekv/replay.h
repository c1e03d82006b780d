// `pagekv replay`: a serving trace through the real prefix cache and block
// pool, one request at a time, with fixed semantics so the figures can be
// checked independently:
//   1. requests in file order, each completed before the next starts;
//   2. a Mooncake request of input_length tokens has ceil(input_length / 512)
//      hash ids; the 512 token ids of chunk i are a fixed function of
//      hash_ids[i] (equal id, equal tokens); the cache cuts the tokens into
//      blocks of block_len; a last, partial block is never published or hit;
//   3. a request's hit is the number of its leading full blocks found cached
//      at its arrival (all of them may hit: nothing is left to compute);
//   4. it then needs its remaining blocks; if even evicting every
//      unreferenced cached block cannot provide them it is `rejected` and
//      changes nothing (and counts in no other figure);
//   5. on completion its full blocks (hit or new) are cached, last used by
//      it, deeper blocks older; its partial block is freed.
// Azure traces carry no prefix information: every request's tokens are
// unique, so only occupancy is meaningful.
#pragma once

#include <cstdint>
#include <string>

#include "pagekv/prefix_cache.h"
#include "pagekv/status.h"

namespace pagekv {

enum class TraceFormat : uint8_t { kAuto, kMooncake, kAzure };

// "mooncake", "azure" or "auto"; the error names the accepted values.
Result<TraceFormat> ParseTraceFormat(const std::string& name);

struct ReplayOptions {
  std::string trace_path;
  TraceFormat format = TraceFormat::kAuto;  // auto: .csv is Azure, anything else Mooncake JSON lines
  int32_t block_len = 512;
  int64_t capacity_blocks = 0;              // 0 = unlimited (every request's blocks fit)
  BlockHashKind hash = BlockHashKind::kSha256;
  // A hybrid cache (Gemma 3's shape): 6 layers, every sliding_pattern-th
  // attending fully, the rest sliding over sliding_window tokens; each
  // request's sliding groups publish their blocks, then release what the
  // window passed, before it is freed. 0 = a plain cache. capacity_blocks
  // then counts blocks of all 6 layers (the same bytes as a plain cache's).
  int32_t sliding_window = 0;
  int32_t sliding_pattern = 6;
};

struct ReplayReport {
  std::string format;
  int64_t requests = 0;
  int64_t rejected = 0;
  int64_t total_blocks = 0;  // full blocks of the admitted requests
  int64_t hit_blocks = 0;
  double block_hit_rate = 0;
  int64_t total_tokens = 0;  // input tokens of the admitted requests
  int64_t hit_tokens = 0;
  double token_hit_rate = 0;
  int64_t evicted_blocks = 0;
  int64_t capacity_blocks = 0;  // the pool used (the computed size when unlimited)
  int64_t peak_blocks_cached = 0;
  double seconds = 0;
  double lookups_per_second = 0;  // requests (each one lookup + admission + publish) per second
  int32_t kv_groups = 1;          // the cache's groups (a hybrid cache: more than 1)
};

// Errors: an unreadable trace; a line that is not JSON or CSV, a missing or
// negative field, a hash_ids count that does not match input_length (the
// message names the line and the field); a block_len the cache refuses.
Result<ReplayReport> ReplayTrace(const ReplayOptions& options);

}  // namespace pagekv
