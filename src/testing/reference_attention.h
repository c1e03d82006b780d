// Test-only oracle: plain double-precision attention over contiguous K and V,
//   out = softmax(q k^T * scale (soft-capped) + causal mask) v
// computed the obvious way, with nothing shared with the paged kernels.
#pragma once

#include <cstdint>
#include <vector>

namespace pagekv::testing {

struct ReferenceShape {
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  double scale = 0;    // 0 means 1 / sqrt(head_dim)
  double softcap = 0;  // 0 means off
  int64_t window = 0;  // > 0: query at position p sees only [p - window + 1, p]
};

// k, v: [num_tokens][num_kv_heads][head_dim] as double.
// q:    [num_queries][num_q_heads][head_dim]; query j attends to tokens
//       [0, num_tokens - num_queries + j] (decode: num_queries = 1, all tokens),
//       or the last `window` of those.
// Returns [num_queries][num_q_heads][head_dim].
// weights (optional): [num_kv_heads][num_tokens], the softmax weights each
// token got, summed over the group's query heads and the last score_queries
// queries (0 = all).
std::vector<double> ReferenceAttention(const ReferenceShape& shape, const std::vector<double>& q,
                                       int64_t num_queries, const std::vector<double>& k,
                                       const std::vector<double>& v, int64_t num_tokens,
                                       std::vector<double>* weights = nullptr, int64_t score_queries = 0);

// How far a kernel's output is from the reference: over `rows` rows of d
// elements, the largest max |out - ref| / max |ref| of a row; infinity when
// out holds a NaN (an element never written).
double MaxRowRelError(const float* out, const std::vector<double>& ref, int64_t rows, int32_t d);

}  // namespace pagekv::testing
