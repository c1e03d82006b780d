// The queries one prefill CTA serves, for both prefill kernels (grid
// (kv_heads, num_seqs, tiles of queries_per_cta queries)): which of the
// sequence's queries, their positions, the first key any of them sees
// (causal, within the window), where their rows are, and the scale.
#pragma once

#include <cstdint>

#include "cuda/paged_attention.h"

namespace pagekv::cuda {

struct PrefillTile {
  int q0 = 0, nq = 0;                    // the sequence's first query here, and how many (0: none)
  int64_t first_pos = 0, last_pos = 0;  // their positions in the sequence
  int32_t window = 0;                    // 0: every earlier position
  int64_t key_lo = 0;                    // the first position any of them attends to
  int64_t row0 = 0;                      // the first query's row in q and out
  float scale = 0;
};

__device__ inline PrefillTile PrefillTileOf(const PrefillParams& p, int seq, int queries_per_cta) {
  PrefillTile t;
  const int32_t n = p.context_lens[seq], ql = p.query_lens[seq];
  t.q0 = static_cast<int>(blockIdx.z) * queries_per_cta;
  if (t.q0 >= ql) return t;
  t.nq = min(queries_per_cta, ql - t.q0);
  t.first_pos = static_cast<int64_t>(n) - ql + t.q0;
  t.last_pos = t.first_pos + t.nq - 1;
  t.window = p.windows != nullptr ? p.windows[seq] : 0;
  t.key_lo = t.window > 0 ? max(int64_t{0}, t.first_pos - t.window + 1) : 0;
  t.row0 = static_cast<int64_t>(p.query_starts[seq]) + t.q0;
  t.scale = p.scale > 0 ? p.scale : rsqrtf(static_cast<float>(p.head_dim));
  return t;
}

}  // namespace pagekv::cuda
