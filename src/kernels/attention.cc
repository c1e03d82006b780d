// Entry points of paged attention: validation, the split into row tasks,
// threads, and the log-sum-exp merge of flash-decoding chunks. The SIMD work
// is in attention_kernel.cc.
#include "pagekv/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "base/checked_math.h"
#include "base/thread_pool.h"
#include "kernels/amx_attention.h"
#include "kernels/attention_kernel.h"
#include "layout/quantize.h"

namespace pagekv {
namespace {

using kernels::RowTask;

// Shape facts every task shares.
struct Geometry {
  int32_t q_heads = 0, kv_heads = 0, group = 0, head_dim = 0, block_len = 0;
  int64_t slab_stride = 0, v_slab_stride = 0;
  int64_t row_bytes = 0;  // this layer's
  DType dtype = DType::kF32;
  int32_t kivi_group = 0;  // INT4 KIVI layers: tokens per key group
  bool hadamard = false;   // rows stored Hadamard-rotated: rotate q, rotate the output back
  int32_t v_plane = 1;     // MLA: 0, the latent row is both key and value
  float default_scale = 0; // 1 / sqrt(the q.k length the model computes)
  float scale = 0;
};

Status ValidateCommon(const PagedKv& kv, const float* q, const float* out, Geometry& g) {
  if (kv.layout == nullptr || kv.arena == nullptr) {
    return InvalidArgumentError("attention: null layout or arena: pass the cache's layout() and arena()");
  }
  if (q == nullptr || out == nullptr) return InvalidArgumentError("attention: null q or out");
  const KvLayout& l = *kv.layout;
  const CacheConfig& c = l.config();
  if (kv.layer < 0 || kv.layer >= l.num_layers()) {
    return OutOfRangeError("attention: layer " + std::to_string(kv.layer) + " outside [0, " +
                           std::to_string(l.num_layers()) + ")");
  }
  const bool mla = c.kind == CacheKind::kMla;
  const int32_t row_elems = l.row_elems();
  const KvFormat& f = l.format(kv.layer);
  if (mla && f.IsKivi()) {
    return UnimplementedError("attention: int4 KIVI on an MLA latent cache is not read (KIVI quantizes keys and values "
                              "differently; the latent row is both): use f16, bf16, int8 or fp8");
  }
  if (!f.IsPlainFloat() && !f.IsStoredQuantized(row_elems) && !f.IsKivi()) {
    return UnimplementedError("attention: KV format " + f.ToString() +
                              " is not read yet; use f32, f16, bf16, int8 / fp8 with one f16 scale per row, or int4 KIVI");
  }
  if (mla) {
    // Every query head attends to the one latent row per token: a group of
    // all the query heads (the absorbed form; MlaDecodeAttention).
    g.q_heads = c.num_q_heads;
    g.kv_heads = 1;
    g.group = c.num_q_heads;
    g.v_plane = 0;
  } else {
    if (c.num_kv_heads <= 0 || c.num_q_heads % c.num_kv_heads != 0) {
      return InvalidArgumentError("attention: num_q_heads " + std::to_string(c.num_q_heads) +
                                  " is not a multiple of num_kv_heads " + std::to_string(c.num_kv_heads));
    }
    g.q_heads = c.num_q_heads;
    g.kv_heads = c.num_kv_heads;
    g.group = c.num_q_heads / c.num_kv_heads;
  }
  if (g.group > kernels::kMaxRows) {
    return UnimplementedError("attention: more than " + std::to_string(kernels::kMaxRows) +
                              " query heads per " + (mla ? "latent row" : "KV head"));
  }
  g.head_dim = row_elems;
  // MLA: the unabsorbed q.k runs over the per-head dim and the rope dim.
  const int32_t qk_len = mla && c.head_dim > 0 ? c.head_dim + c.rope_dim : row_elems;
  g.default_scale = 1.0f / std::sqrt(static_cast<float>(qk_len));
  g.block_len = c.block_len;
  g.slab_stride = l.slab_stride(kv.layer, 0);
  g.v_slab_stride = l.slab_stride(kv.layer, l.num_planes() - 1);
  g.row_bytes = l.row_bytes(kv.layer);
  g.dtype = f.dtype;
  g.kivi_group = l.kivi_group(kv.layer);
  g.hadamard = f.hadamard;
  return Status::Ok();
}

// Entries [first_token / block_len, ceil(num_tokens / block_len)) must name
// blocks of the pool (the ones before a sliding window's first may not).
Status ValidateTable(const KvLayout& l, std::span<const BlockId> blocks, int64_t num_tokens, size_t index,
                     int64_t first_token, bool partial) {
  const int64_t need = CeilDiv(num_tokens, l.block_len());
  if (static_cast<int64_t>(blocks.size()) < need) {
    return InvalidArgumentError("attention: sequence " + std::to_string(index) + " has " +
                                std::to_string(num_tokens) + " tokens but a block table of " +
                                std::to_string(blocks.size()) + " blocks (needs " + std::to_string(need) + ")");
  }
  for (int64_t i = first_token / l.block_len(); i < need; ++i) {
    const int64_t b = ToInt(blocks[static_cast<size_t>(i)]);
    if (partial && b == ToInt(kNoBlock)) continue;  // held by another process
    if (b < 0 || b >= l.num_blocks()) {
      return InvalidArgumentError("attention: sequence " + std::to_string(index) + " block table entry " +
                                  std::to_string(i) + " = " + std::to_string(b) + " is outside the pool [0, " +
                                  std::to_string(l.num_blocks()) + ")");
    }
  }
  return Status::Ok();
}

// An INT4 KIVI layer needs the sequence's tail when its last group is not
// full, and gives no attention weights (token eviction cannot move its rows).
Status ValidateKivi(const Geometry& g, int64_t num_tokens, const std::byte* tail, bool scores, size_t index) {
  if (g.kivi_group == 0) return Status::Ok();
  if (tail == nullptr && num_tokens % g.kivi_group != 0) {
    return InvalidArgumentError("attention: sequence " + std::to_string(index) + " has " + std::to_string(num_tokens) +
                                " tokens on an int4 KIVI layer but no tail: pass SequenceView::tail");
  }
  if (scores) {
    return UnimplementedError("attention: weights for token eviction are not produced on int4 KIVI layers");
  }
  return Status::Ok();
}

// A sliding window: non-negative, and no attention weights (token eviction
// moves positions, which a window counts in).
Status ValidateWindow(int64_t window, bool scores, size_t index) {
  if (window < 0) {
    return InvalidArgumentError("attention: sequence " + std::to_string(index) + " has window " +
                                std::to_string(window) + ": must be >= 0 (0 = no sliding window)");
  }
  if (window > 0 && scores) {
    return UnimplementedError("attention: sequence " + std::to_string(index) +
                              " asks for attention weights (token eviction) on a sliding-window layer: not supported");
  }
  return Status::Ok();
}

// Partial attention reads no int4 KIVI layer and gives no attention weights.
Status ValidatePartial(const Geometry& g, bool scores, size_t index) {
  if (g.kivi_group > 0) {
    return UnimplementedError("attention: partial attention (context parallel) does not read int4 KIVI layers");
  }
  if (scores) {
    return UnimplementedError("attention: sequence " + std::to_string(index) +
                              " asks for attention weights (token eviction) of a partial attention: not supported");
  }
  return Status::Ok();
}

// The first position a query at `pos` sees under `window` (0 = none).
int64_t WindowBegin(int64_t pos, int64_t window) { return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0; }

int Threads(const AttentionOptions& o) {
  return o.num_threads > 0 ? o.num_threads : ThreadPool::Shared().num_threads();
}

// Calls smaller than these run on the calling thread: handing them to the
// pool costs more than the second core gives back. Decode: K and V bytes
// read; measured with `pagekv bench attention --threads 1` vs 2 (batch 1-4,
// 8/8 and 8/2 heads, f16, block_len 16, docs/PERFORMANCE.md "Threads"):
// 2 threads lost below 16 KiB (a 2.7 us call took 5.7 us), were mixed at
// 64 KiB and won from 128 KiB on. Prefill: multiply-adds, the weight
// products' threshold (kernels/matmul.cc), the same few microseconds of work.
constexpr int64_t kDecodeInlineBytes = int64_t{64} << 10;
constexpr double kPrefillInlineMacs = double{1 << 18};

// One unit of parallel work: some rows of one (sequence, KV head) over one
// chunk of key positions.
struct WorkItem {
  int64_t seq = 0;
  int32_t kv_head = 0;
  int64_t first_query = 0;  // prefill: index of the tile's first query within its sequence
  int32_t num_queries = 0;  // decode: 1
  int64_t tok_begin = 0, tok_end = 0;
  int64_t partial = -1;  // index of this chunk's partial state, or -1 when it writes out directly
};

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<float> q, scores, m, l, acc, weights, block_max;
  std::vector<int64_t> limit, begin;
};

// Where one sequence's attention weights go (token eviction).
struct ScoreOut {
  // Decode: the kernel's unnormalised weights [q_heads][num_tokens], block
  // maxima [q_heads][blocks] and each row's log-sum-exp [q_heads] (rows of
  // a split sequence get theirs from the merge); the weights are added to
  // `scores` after every item and the merge.
  float* raw = nullptr;
  float* block_max = nullptr;
  int64_t blocks = 0;
  float* lse = nullptr;
  // Prefill: weights of queries >= first_scored added straight to `scores`
  // [kv_heads][num_tokens] under locks[kv_head] (tiles of one head share rows).
  float* scores = nullptr;
  int64_t first_scored = 0;
  std::mutex* locks = nullptr;
};

// dst[t] += weights[t] * exp(block_max[t / block_len] - lse) for t < n: the
// kernel's exp(logit - running max) rescaled to the row's final softmax.
void AddWeights(const float* weights, const float* block_max, int64_t n, int32_t block_len, float lse, float* dst) {
  for (int64_t b0 = 0, b = 0; b0 < n; b0 += block_len, ++b) {
    const float f = std::exp(block_max[b] - lse);
    const int64_t end = std::min<int64_t>(n, b0 + block_len);
    for (int64_t t = b0; t < end; ++t) dst[t] += weights[t] * f;
  }
}

// Runs one item: gathers and scales the rows' queries, runs the kernel, and
// either writes normalised rows to `out` or leaves the partial state in
// `partials` for the merge.
void RunItem(const WorkItem& w, const PagedKv& kv, const Geometry& g, std::span<const BlockId> blocks,
             int64_t num_tokens, int64_t num_queries_total, const float* q_seq, float* out_seq, float* lse_seq,
             float* partial_state, float softcap, const ScoreOut* so, const std::byte* tail, int64_t window,
             bool partial) {
  thread_local Scratch s;
  const int32_t rows = w.num_queries * g.group;
  const int32_t d = g.head_dim;
  const int32_t stride = static_cast<int32_t>(RoundUp(g.block_len, kernels::kScoreAlign));
  s.q.resize(static_cast<size_t>(rows) * d);
  s.scores.resize(static_cast<size_t>(rows) * stride);
  s.limit.resize(static_cast<size_t>(rows));
  s.begin.resize(static_cast<size_t>(rows));
  float* m;
  float* l;
  float* acc;
  if (partial_state != nullptr) {
    m = partial_state;
    l = m + rows;
    acc = l + rows;
  } else {
    s.m.resize(static_cast<size_t>(rows));
    s.l.resize(static_cast<size_t>(rows));
    s.acc.resize(static_cast<size_t>(rows) * d);
    m = s.m.data();
    l = s.l.data();
    acc = s.acc.data();
  }
  // Row (query j, group member i) = query head kv_head * group + i.
  for (int32_t j = 0; j < w.num_queries; ++j) {
    const int64_t query = w.first_query + j;
    const int64_t pos = num_tokens - num_queries_total + query;
    for (int32_t i = 0; i < g.group; ++i) {
      const int32_t r = j * g.group + i;
      const float* src = q_seq + (query * g.q_heads + w.kv_head * g.group + i) * d;
      for (int32_t x = 0; x < d; ++x) s.q[static_cast<size_t>(r) * d + x] = src[x] * g.scale;
      s.limit[static_cast<size_t>(r)] = pos + 1;
      s.begin[static_cast<size_t>(r)] = WindowBegin(pos, window);
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.0f;
      // (H q) . (H k) = q . k for the orthonormal H the rows were stored with.
      if (g.hadamard) quant::HadamardInPlace(s.q.data() + static_cast<size_t>(r) * d, d);
    }
  }
  std::fill(acc, acc + static_cast<int64_t>(rows) * d, 0.0f);

  const KvLayout& layout = *kv.layout;
  RowTask t;
  t.dtype = g.dtype;
  t.row_bytes = g.row_bytes;
  t.rows = rows;
  t.head_dim = d;
  t.q = s.q.data();
  t.limit = s.limit.data();
  t.begin = window > 0 ? s.begin.data() : nullptr;
  t.k_region = kv.arena + layout.SlabOffset(kv.layer, 0, w.kv_head, 0);
  t.v_region = kv.arena + layout.SlabOffset(kv.layer, g.v_plane, w.kv_head, 0);
  t.slab_stride = g.slab_stride;
  t.v_slab_stride = g.v_slab_stride;
  t.block_len = g.block_len;
  if (g.kivi_group > 0) {
    t.kivi_group = g.kivi_group;
    t.tail_begin = num_tokens / g.kivi_group * g.kivi_group;
    if (tail != nullptr) {
      t.tail_k = tail + layout.TailOffset(kv.layer, 0, w.kv_head);
      t.tail_v = tail + layout.TailOffset(kv.layer, 1, w.kv_head);
    }
  }
  t.blocks = blocks.data();
  t.tok_begin = w.tok_begin;
  t.tok_end = w.tok_end;
  t.softcap = softcap;
  t.m = m;
  t.l = l;
  t.acc = acc;
  t.scores = s.scores.data();
  t.score_stride = stride;
  const bool prefill_scores =
      so != nullptr && so->scores != nullptr && w.first_query + w.num_queries > so->first_scored;
  const int64_t span = w.tok_end - w.tok_begin;
  const int64_t span_blocks = CeilDiv(span, g.block_len);
  if (so != nullptr && so->raw != nullptr) {  // decode: rows are the group's heads
    const int64_t row0 = static_cast<int64_t>(w.kv_head) * g.group;
    t.weights_out = so->raw + row0 * num_tokens + w.tok_begin;
    t.weights_stride = num_tokens;
    t.block_max_out = so->block_max + row0 * so->blocks + w.tok_begin / g.block_len;
    t.block_max_stride = so->blocks;
  } else if (prefill_scores) {
    s.weights.resize(static_cast<size_t>(rows * span));
    s.block_max.resize(static_cast<size_t>(rows * span_blocks));
    t.weights_out = s.weights.data();
    t.weights_stride = span;
    t.block_max_out = s.block_max.data();
    t.block_max_stride = span_blocks;
  }
  if (!partial) {
    kernels::AttendRows(t);
  } else {
    // Runs of held blocks, each through the kernel with the rows' running
    // state carried over; the blocks of other processes are skipped.
    const int64_t bl = g.block_len;
    for (int64_t start = w.tok_begin; start < w.tok_end;) {
      if (blocks[static_cast<size_t>(start / bl)] == kNoBlock) {
        start += bl;
        continue;
      }
      int64_t end = start;
      while (end < w.tok_end && blocks[static_cast<size_t>(end / bl)] != kNoBlock) end = std::min(w.tok_end, end + bl);
      t.tok_begin = start;
      t.tok_end = end;
      kernels::AttendRows(t);
      start = end;
    }
  }

  if (so != nullptr && so->raw != nullptr && partial_state == nullptr) {
    for (int32_t i = 0; i < g.group; ++i) so->lse[w.kv_head * g.group + i] = m[i] + std::log(l[i]);
  }
  if (prefill_scores) {
    // Weights of the scored rows, summed per position.
    std::vector<float>& sum = s.scores;  // reused: the kernel is done with it
    sum.assign(static_cast<size_t>(span), 0.0f);
    for (int32_t j = 0; j < w.num_queries; ++j) {
      if (w.first_query + j < so->first_scored) continue;
      for (int32_t i = 0; i < g.group; ++i) {
        const int32_t r = j * g.group + i;
        const int64_t valid = std::min(s.limit[static_cast<size_t>(r)], w.tok_end) - w.tok_begin;
        AddWeights(s.weights.data() + r * span, s.block_max.data() + r * span_blocks, valid, g.block_len,
                   m[r] + std::log(l[r]), sum.data());
      }
    }
    std::lock_guard<std::mutex> lock(so->locks[w.kv_head]);
    float* dst = so->scores + static_cast<int64_t>(w.kv_head) * num_tokens + w.tok_begin;
    for (int64_t p = 0; p < span; ++p) dst[p] += sum[static_cast<size_t>(p)];
  }

  if (partial_state != nullptr) return;
  for (int32_t j = 0; j < w.num_queries; ++j) {
    for (int32_t i = 0; i < g.group; ++i) {
      const int32_t r = j * g.group + i;
      const int64_t row = (w.first_query + j) * g.q_heads + w.kv_head * g.group + i;
      float* dst = out_seq + row * d;
      if (l[r] == 0.0f) {  // no position read here (partial attention)
        std::fill(dst, dst + d, 0.0f);
        if (lse_seq != nullptr) lse_seq[row] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = 1.0f / l[r];
      for (int32_t x = 0; x < d; ++x) dst[x] = acc[static_cast<size_t>(r) * d + x] * inv;
      if (g.hadamard) quant::HadamardInPlace(dst, d);  // sum p (H v) = H (sum p v); H is its own inverse
      if (lse_seq != nullptr) lse_seq[row] = m[r] + std::log(l[r]);
    }
  }
}

}  // namespace

Status PagedDecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, float* out,
                            const AttentionOptions& options) {
  Geometry g;
  PAGEKV_RETURN_IF_ERROR(ValidateCommon(kv, q, out, g));
  int64_t total_tokens = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i].num_tokens <= 0) {
      return InvalidArgumentError("attention: decode sequence " + std::to_string(i) +
                                  " has no tokens: append the new token's K and V first");
    }
    PAGEKV_RETURN_IF_ERROR(ValidateWindow(seqs[i].window, seqs[i].scores != nullptr, i));
    if (options.partial) PAGEKV_RETURN_IF_ERROR(ValidatePartial(g, seqs[i].scores != nullptr, i));
    const int64_t first = WindowBegin(seqs[i].num_tokens - 1, seqs[i].window);
    PAGEKV_RETURN_IF_ERROR(ValidateTable(*kv.layout, seqs[i].blocks, seqs[i].num_tokens, i, first, options.partial));
    PAGEKV_RETURN_IF_ERROR(ValidateKivi(g, seqs[i].num_tokens, seqs[i].tail, seqs[i].scores != nullptr, i));
    total_tokens += seqs[i].num_tokens - first;
  }
  g.scale = options.scale != 0 ? options.scale : g.default_scale;
  const int64_t kv_bytes = total_tokens * g.kv_heads * (g.v_plane + 1) * g.row_bytes;
  const int wanted = Threads(options);
  const int threads = wanted == 1 || kv_bytes < kDecodeInlineBytes || ThreadPool::Shared().RunningAlone() ? 1 : wanted;

  // Chunk length: enough chunks that every thread has several items, never
  // below 256 tokens (the merge would cost more than it balances).
  int64_t chunk = options.split_tokens;
  if (chunk <= 0) {
    const int64_t target_items = 4LL * threads;
    chunk = std::max<int64_t>(256, CeilDiv(total_tokens * g.kv_heads, target_items));
  }
  chunk = RoundUp(chunk, g.block_len);

  std::vector<WorkItem> items;
  std::vector<int64_t> first_partial(seqs.size(), -1);
  int64_t num_partials = 0;
  // A sequence's chunks start at the block of its window's first position
  // (position 0 without a window).
  auto chunk_base = [&](const DecodeSeq& sq) {
    return WindowBegin(sq.num_tokens - 1, sq.window) / g.block_len * g.block_len;
  };
  auto chunks_of = [&](const DecodeSeq& sq) { return CeilDiv(sq.num_tokens - chunk_base(sq), chunk); };
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t n = seqs[i].num_tokens;
    const int64_t base = chunk_base(seqs[i]);
    const int64_t chunks = chunks_of(seqs[i]);
    if (chunks > 1) first_partial[i] = num_partials;
    for (int32_t h = 0; h < g.kv_heads; ++h) {
      for (int64_t c = 0; c < chunks; ++c) {
        WorkItem w;
        w.seq = static_cast<int64_t>(i);
        w.kv_head = h;
        w.num_queries = 1;
        w.tok_begin = base + c * chunk;
        w.tok_end = std::min(n, base + (c + 1) * chunk);
        if (chunks > 1) w.partial = num_partials++;
        items.push_back(w);
      }
    }
  }
  const int64_t state_floats = static_cast<int64_t>(g.group) * (g.head_dim + 2);
  std::vector<float> partials(static_cast<size_t>(num_partials * state_floats));
  const int64_t per_seq = static_cast<int64_t>(g.q_heads) * g.head_dim;

  // Attention weights: raw logits and log-sum-exps of the scored sequences.
  std::vector<ScoreOut> score_out(seqs.size());
  std::vector<float> raw, block_max, lse;
  {
    int64_t raw_floats = 0, max_floats = 0, scored = 0;
    for (const DecodeSeq& sq : seqs) {
      if (sq.scores == nullptr) continue;
      raw_floats += g.q_heads * sq.num_tokens;
      max_floats += g.q_heads * CeilDiv(sq.num_tokens, g.block_len);
      ++scored;
    }
    raw.resize(static_cast<size_t>(raw_floats));
    block_max.resize(static_cast<size_t>(max_floats));
    lse.resize(static_cast<size_t>(scored * g.q_heads));
    int64_t r = 0, bm = 0, e = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (seqs[i].scores == nullptr) continue;
      score_out[i].raw = raw.data() + r;
      score_out[i].blocks = CeilDiv(seqs[i].num_tokens, g.block_len);
      score_out[i].block_max = block_max.data() + bm;
      score_out[i].lse = lse.data() + e;
      r += g.q_heads * seqs[i].num_tokens;
      bm += g.q_heads * score_out[i].blocks;
      e += g.q_heads;
    }
  }

  ThreadPool::Shared().ParallelFor(static_cast<int64_t>(items.size()), threads, [&](int64_t it) {
    const WorkItem& w = items[static_cast<size_t>(it)];
    const DecodeSeq& sq = seqs[static_cast<size_t>(w.seq)];
    RunItem(w, kv, g, sq.blocks, sq.num_tokens, 1, q + w.seq * per_seq, out + w.seq * per_seq,
            options.lse != nullptr ? options.lse + w.seq * g.q_heads : nullptr,
            w.partial >= 0 ? partials.data() + w.partial * state_floats : nullptr, options.softcap,
            sq.scores != nullptr ? &score_out[static_cast<size_t>(w.seq)] : nullptr, sq.tail, sq.window,
            options.partial);
  });

  // Merge chunk partials: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
  if (num_partials > 0) {
    ThreadPool::Shared().ParallelFor(static_cast<int64_t>(seqs.size()), threads, [&](int64_t si) {
      const auto i = static_cast<size_t>(si);
      if (first_partial[i] < 0) return;
      const int64_t chunks = chunks_of(seqs[i]);
      for (int32_t h = 0; h < g.kv_heads; ++h) {
        const float* base = partials.data() + (first_partial[i] + h * chunks) * state_floats;
        for (int32_t r = 0; r < g.group; ++r) {
          float big_m = -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < chunks; ++c) big_m = std::max(big_m, base[c * state_floats + r]);
          float* dst = out + static_cast<int64_t>(i) * per_seq + (h * g.group + r) * g.head_dim;
          std::fill(dst, dst + g.head_dim, 0.0f);
          float* lse_row = options.lse != nullptr ? options.lse + static_cast<int64_t>(i) * g.q_heads + h * g.group + r : nullptr;
          if (big_m == -std::numeric_limits<float>::infinity()) {  // no chunk read a position (partial attention)
            if (lse_row != nullptr) *lse_row = big_m;
            continue;
          }
          float denom = 0;
          for (int64_t c = 0; c < chunks; ++c) {
            const float* st = base + c * state_floats;
            const float w = std::exp(st[r] - big_m);
            denom += w * st[g.group + r];
            const float* acc = st + 2 * g.group + static_cast<int64_t>(r) * g.head_dim;
            for (int32_t x = 0; x < g.head_dim; ++x) dst[x] += w * acc[x];
          }
          const float inv = 1.0f / denom;
          for (int32_t x = 0; x < g.head_dim; ++x) dst[x] *= inv;
          if (g.hadamard) quant::HadamardInPlace(dst, g.head_dim);
          if (score_out[i].lse != nullptr) score_out[i].lse[h * g.group + r] = big_m + std::log(denom);
          if (lse_row != nullptr) *lse_row = big_m + std::log(denom);
        }
      }
    });
  }
  // Weights of the scored sequences: scores[h][t] += sum over the group of
  // exp(logit - lse).
  if (lse.empty()) return Status::Ok();
  ThreadPool::Shared().ParallelFor(static_cast<int64_t>(seqs.size()) * g.kv_heads, threads, [&](int64_t job) {
    const auto i = static_cast<size_t>(job / g.kv_heads);
    const auto h = static_cast<int32_t>(job % g.kv_heads);
    const ScoreOut& so = score_out[i];
    if (so.raw == nullptr) return;
    const int64_t n = seqs[i].num_tokens;
    for (int32_t r = h * g.group; r < (h + 1) * g.group; ++r) {
      AddWeights(so.raw + r * n, so.block_max + r * so.blocks, n, g.block_len, so.lse[r], seqs[i].scores + h * n);
    }
  });
  return Status::Ok();
}

Status PagedPrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, float* out,
                             const AttentionOptions& options) {
  Geometry g;
  PAGEKV_RETURN_IF_ERROR(ValidateCommon(kv, q, out, g));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const PrefillSeq& s = seqs[i];
    if (s.num_queries < 1 || s.num_queries > s.num_tokens) {
      return InvalidArgumentError("attention: prefill sequence " + std::to_string(i) + " has num_queries " +
                                  std::to_string(s.num_queries) + ": must be in [1, num_tokens = " +
                                  std::to_string(s.num_tokens) + "] (append the chunk's K and V first)");
    }
    if (s.score_queries < 0 || s.score_queries > s.num_queries) {
      return InvalidArgumentError("attention: prefill sequence " + std::to_string(i) + " has score_queries " +
                                  std::to_string(s.score_queries) + ": must be in [0, num_queries = " +
                                  std::to_string(s.num_queries) + "] (0 scores every query)");
    }
    PAGEKV_RETURN_IF_ERROR(ValidateWindow(s.window, s.scores != nullptr, i));
    if (options.partial) PAGEKV_RETURN_IF_ERROR(ValidatePartial(g, s.scores != nullptr, i));
    PAGEKV_RETURN_IF_ERROR(ValidateTable(*kv.layout, s.blocks, s.num_tokens, i,
                                         WindowBegin(s.num_tokens - s.num_queries, s.window), options.partial));
    PAGEKV_RETURN_IF_ERROR(ValidateKivi(g, s.num_tokens, s.tail, s.scores != nullptr, i));
  }
  g.scale = options.scale != 0 ? options.scale : g.default_scale;
  double macs = 0;  // q.k and p.v of every query over the positions it sees
  for (const PrefillSeq& s : seqs) {
    double seen = static_cast<double>(s.num_tokens) - 0.5 * static_cast<double>(s.num_queries - 1);
    if (s.window > 0) seen = std::min(seen, static_cast<double>(s.window));
    macs += 2.0 * static_cast<double>(s.num_queries) * seen * g.q_heads * g.head_dim;
  }
  const int wanted = Threads(options);
  const int threads = wanted == 1 || macs < kPrefillInlineMacs || ThreadPool::Shared().RunningAlone() ? 1 : wanted;
  std::vector<ScoreOut> score_out(seqs.size());
  std::vector<std::mutex> locks(seqs.size() * static_cast<size_t>(g.kv_heads));
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i].scores == nullptr) continue;
    score_out[i].scores = seqs[i].scores;
    score_out[i].first_scored = seqs[i].score_queries == 0 ? 0 : seqs[i].num_queries - seqs[i].score_queries;
    score_out[i].locks = locks.data() + i * static_cast<size_t>(g.kv_heads);
  }

  // Query tiles: as many queries as keep rows <= 64 (K/V of a block is then
  // read once per tile of queries, not once per query).
  const int32_t tile = std::max<int32_t>(1, 64 / g.group);
  std::vector<WorkItem> items;
  std::vector<int64_t> q_offset(seqs.size());
  int64_t offset = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    q_offset[i] = offset;
    offset += seqs[i].num_queries;
    for (int32_t h = 0; h < g.kv_heads; ++h) {
      for (int64_t first = 0; first < seqs[i].num_queries; first += tile) {
        WorkItem w;
        w.seq = static_cast<int64_t>(i);
        w.kv_head = h;
        w.first_query = first;
        w.num_queries = static_cast<int32_t>(std::min<int64_t>(tile, seqs[i].num_queries - first));
        // The tile's first query's window starts earliest; its last query
        // sees up to its own position.
        const int64_t first_pos = seqs[i].num_tokens - seqs[i].num_queries + first;
        w.tok_begin = WindowBegin(first_pos, seqs[i].window) / g.block_len * g.block_len;
        w.tok_end = first_pos + w.num_queries;
        items.push_back(w);
      }
    }
  }
  const int64_t per_query = static_cast<int64_t>(g.q_heads) * g.head_dim;
  // Longest tiles first, so the tail of the parallel loop is short ones.
  std::sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.tok_end - a.tok_begin > b.tok_end - b.tok_begin;
  });
  ThreadPool::Shared().ParallelFor(static_cast<int64_t>(items.size()), threads, [&](int64_t it) {
    const WorkItem& w = items[static_cast<size_t>(it)];
    const PrefillSeq& sq = seqs[static_cast<size_t>(w.seq)];
    const int64_t base = q_offset[static_cast<size_t>(w.seq)] * per_query;
    RunItem(w, kv, g, sq.blocks, sq.num_tokens, sq.num_queries, q + base, out + base,
            options.lse != nullptr ? options.lse + q_offset[static_cast<size_t>(w.seq)] * g.q_heads : nullptr, nullptr,
            options.softcap, sq.scores != nullptr ? &score_out[static_cast<size_t>(w.seq)] : nullptr, sq.tail,
            sq.window, options.partial);
  });
  return Status::Ok();
}

void MergeAttentionParts(std::span<const float* const> outs, std::span<const float* const> lses, int64_t rows,
                         int32_t head_dim, float* out, float* lse) {
  const size_t parts = outs.size();
  std::vector<float> row(static_cast<size_t>(head_dim));
  for (int64_t r = 0; r < rows; ++r) {
    float big_m = -std::numeric_limits<float>::infinity();
    for (size_t p = 0; p < parts; ++p) big_m = std::max(big_m, lses[p][r]);
    float* dst = out + r * head_dim;
    if (big_m == -std::numeric_limits<float>::infinity()) {  // no part read a position
      std::fill(dst, dst + head_dim, 0.0f);
      if (lse != nullptr) lse[r] = big_m;
      continue;
    }
    std::fill(row.begin(), row.end(), 0.0f);
    float denom = 0;
    for (size_t p = 0; p < parts; ++p) {
      const float w = std::exp(lses[p][r] - big_m);  // 0 for a part that read nothing
      denom += w;
      const float* src = outs[p] + r * head_dim;
      for (int32_t x = 0; x < head_dim; ++x) row[static_cast<size_t>(x)] += w * src[x];
    }
    const float inv = 1.0f / denom;
    for (int32_t x = 0; x < head_dim; ++x) dst[x] = row[static_cast<size_t>(x)] * inv;
    if (lse != nullptr) lse[r] = big_m + std::log(denom);
  }
}

std::string AttentionSimdTarget() {
  const std::string target = kernels::DispatchedTargetName();
  const bool avx512 = target.rfind("AVX3", 0) == 0;  // the targets bf16_dot-inl.h is compiled into
  return target + (avx512 && kernels::Bf16DotEnabled() ? "+BF16" : "") + (avx512 && kernels::AmxEnabled() ? "+AMX" : "");
}

}  // namespace pagekv
