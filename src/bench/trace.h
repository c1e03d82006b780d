// Serving traces: Mooncake JSON lines (timestamp in ms, input_length,
// output_length, hash_ids of 512-token prefix blocks) and Azure CSVs
// (TIMESTAMP as a date-time, ContextTokens, GeneratedTokens), read into one
// shape, with the line and field named in every error; and the synthetic
// token ids that stand in for their prompts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "pagekv/replay.h"
#include "pagekv/status.h"

namespace pagekv::bench {

constexpr int64_t kTraceBlock = 512;  // Mooncake hash ids name 512-token chunks

struct TraceRequest {
  double arrival_s = 0;           // from the first request
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<int64_t> hash_ids;  // Mooncake; empty for Azure
};

// kAuto: a .csv is Azure, anything else Mooncake. `limit` > 0 reads at most
// that many requests.
Result<std::vector<TraceRequest>> ReadTrace(const std::string& path, TraceFormat format, int64_t limit = 0,
                                            TraceFormat* resolved = nullptr);

// The same from a stream in a resolved format (kMooncake or kAzure).
Result<std::vector<TraceRequest>> ParseTrace(std::istream& in, TraceFormat format, int64_t limit = 0);

// Prompt token ids: 512-token chunk i from hash_ids[i] (equal ids, equal
// tokens), or unique to the request `index` when there are no hash ids.
// Ids fall in [3, vocab). chunk_tokens (1..512) scales the prompt down:
// chunk i becomes chunk_tokens tokens (its first ones), so the prefix
// structure stays while the prompts shrink by 512 / chunk_tokens.
void TraceTokens(const TraceRequest& r, int64_t index, int32_t vocab, std::vector<int32_t>& out,
                 int64_t chunk_tokens = kTraceBlock);

// The p-quantile (0..1) of v by the nearest-rank rule; 0 for none. For
// the serving benchmarks' TTFT and inter-token latencies.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(p * static_cast<double>(v.size()))) - (p > 0 ? 1 : 0));
  return v[i];
}

}  // namespace pagekv::bench
