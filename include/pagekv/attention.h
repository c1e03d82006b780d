// Paged attention: kernels that read K and V straight from the block layout
// (docs/KV_LAYOUT.md) through a sequence's block table, with no gather copy.
//
// Both entry points are flash-style: one pass over the keys with an online
// softmax (running max and sum per query row, f32 accumulation). Each K/V
// block is loaded once per KV head and used by all G = num_q_heads /
// num_kv_heads query heads of its group (MHA: G = 1; MQA: one KV head).
// Long sequences are split into chunks of blocks processed in parallel whose
// partial results are merged by their log-sum-exp (flash-decoding), so one
// long sequence still uses every core. SIMD through Highway with run-time
// dispatch (AVX-512, AVX2, SSE4 or scalar: whatever the CPU has); threads
// from one process-wide pool (one thread per hardware thread).
//
// Storage formats: f32, f16, bf16; int8 and fp8 (E4M3, E5M2) rows with an f16
// scale, dequantized in registers; INT4 KIVI (keys per channel over token
// groups, values per token, the not-yet-full group in the sequence's f16
// tail), unpacked with SIMD 16 tokens at a time into an L1 tile and read
// there. Any head_dim works (KIVI: even, at most 512); multiples of the
// vector width (16 floats on AVX-512, 8 on AVX2) take the fastest path.
// Per-layer formats: each call reads its layer's.
//
// Thread safety: the functions may be called from several threads at once
// and may read the same arena; calls share the process-wide pool, so
// concurrent calls run one after another. REQUIRES: not called from inside
// another attention call's worker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "pagekv/ids.h"
#include "pagekv/kv_layout.h"
#include "pagekv/status.h"

namespace pagekv {

struct AttentionOptions {
  float scale = 0;           // logits = q.k * scale; 0 means 1 / sqrt(head_dim)
  float softcap = 0;         // > 0: logits = softcap * tanh(logits / softcap)
  int num_threads = 0;       // 0 means every hardware thread
  int64_t split_tokens = 0;  // flash-decoding chunk length in tokens (rounded up
                             // to whole blocks); 0 means chosen per call
  // Partial attention (context parallel: this process holds some of each
  // sequence's blocks, KvCache::ArenaTable): kNoBlock entries of a block
  // table are blocks held elsewhere; they are skipped, and each output row
  // is the attention over the positions read here. No attention weights
  // (DecodeSeq::scores) and no int4 KIVI layers with it.
  bool partial = false;
  // Optional: each output row's log-sum-exp over the positions it read,
  // [rows][num_q_heads] with rows as in `out` (what MergeAttentionParts
  // needs). A row that read no position (possible with `partial`) gets
  // out 0 and lse -inf.
  float* lse = nullptr;
};

// Context parallel: attention rows computed over disjoint sets of key
// positions (each part a call with AttentionOptions::partial and lse, e.g.
// in different processes), merged into the attention over their union:
//   out = sum_p e^(lse_p - M) out_p / sum_p e^(lse_p - M),  M = max_p lse_p
//   outs[p]: [rows][head_dim], lses[p]: [rows]; out: [rows][head_dim];
//   lse (optional): [rows], the union's log-sum-exp.
// The parts are added in their order: every process that merges the same
// parts gets the same bits. A row no part read gets 0 (and lse -inf). out
// may be one of the parts. REQUIRES: outs.size() == lses.size() >= 1.
void MergeAttentionParts(std::span<const float* const> outs, std::span<const float* const> lses, int64_t rows,
                         int32_t head_dim, float* out, float* lse = nullptr);

// Where one layer's K and V live: the arena and its layout.
struct PagedKv {
  const KvLayout* layout = nullptr;
  const std::byte* arena = nullptr;  // [layout->total_bytes()]
  int32_t layer = 0;
};

// One sequence of a decode batch: its block table and its length. The query
// attends to all num_tokens cached tokens (the new token's K and V must
// already be appended).
//
// Attention weights for token eviction (H2O, SnapKV): when `scores` is set,
// the call adds to scores[kv_head][t] the softmax weight every query head of
// that KV head's group gave cached token t (summed over the group), computed
// from the logits the kernel already has and each row's final log-sum-exp,
// with no second pass over K.
struct DecodeSeq {
  std::span<const BlockId> blocks;  // at least ceil(num_tokens / block_len) ids
  int64_t num_tokens = 0;           // >= 1
  float* scores = nullptr;          // optional [num_kv_heads][num_tokens], accumulated into
  const std::byte* tail = nullptr;  // INT4 KIVI layers: SequenceView::tail (needed when
                                    // num_tokens is not a multiple of the group)
  // Sliding-window layers: the query sees only the last `window` positions
  // (itself included): [num_tokens - window, num_tokens). 0 = all of them.
  // Blocks wholly before the window are never read (their table entries
  // may be kNoBlock: a hybrid cache frees them).
  int64_t window = 0;
};

// Decode attention for a batch of sequences, one query token each.
//   q:   [num_seqs][num_q_heads][head_dim] f32
//   out: [num_seqs][num_q_heads][head_dim] f32 (fully written)
// Errors (nothing written): null pointers, a layer out of range, a
// sequence with no tokens, a block table shorter than its length
// or holding an id outside the pool (in the window, for a windowed
// sequence), a negative window, attention weights asked of a windowed
// sequence (token eviction and sliding windows do not combine).
Status PagedDecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q,
                            float* out, const AttentionOptions& options = {});

// One sequence of a prefill (or chunked-prefill) batch. Its last num_queries
// of num_tokens cached tokens are the queries: query j sits at position
// p = num_tokens - num_queries + j and attends to positions [0, p] (causal).
// A prompt can be split into chunks at any position: each chunk appends its
// K and V, then calls this with num_queries = the chunk's length.
struct PrefillSeq {
  std::span<const BlockId> blocks;
  int64_t num_tokens = 0;   // >= num_queries
  int64_t num_queries = 0;  // >= 1
  // Optional attention weights as for decode, summed over the group's query
  // heads and over the last score_queries queries (0 = every query), each
  // query contributing over the positions it sees.
  float* scores = nullptr;  // [num_kv_heads][num_tokens], accumulated into
  int64_t score_queries = 0;
  const std::byte* tail = nullptr;  // INT4 KIVI layers: SequenceView::tail
  // Sliding-window layers: query j at position p sees [p - window + 1, p]
  // (0 = [0, p]); blocks before the first query's window are never read.
  int64_t window = 0;
};

// Prefill attention.
//   q:   [sum of num_queries][num_q_heads][head_dim] f32, sequences in order
//   out: same shape
// Errors as for decode, plus num_queries outside [1, num_tokens] and
// score_queries outside [0, num_queries].
Status PagedPrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q,
                             float* out, const AttentionOptions& options = {});

// MLA latent caches (CacheKind::kMla: one row of kv_lora_rank compressed
// elements c_kv then rope_dim rope-key elements k_pe per token, shared by
// every head). PagedDecodeAttention and PagedPrefillAttention read them as
// one "KV head" shared by all num_q_heads query heads, with q and out in
// latent space: [...][num_q_heads][kv_lora_rank + rope_dim], logits
// q . row, out the weighted sum of rows (its first kv_lora_rank elements
// are the latent output; the trailing rope_dim ones the weighted k_pe,
// which a model ignores). The default scale is 1 / sqrt(head_dim +
// rope_dim), the unabsorbed q.k length (CacheConfig::head_dim is the
// model's per-head dim for MLA). int4 KIVI is not read on latent rows.
//
// Multi-head latent attention (DeepSeek-V2/V3) in the absorbed form, from
// the model's per-head query and weights: each head's q_nope goes into
// latent space through W_UK once per call (q_lat = W_UK^T q_nope), the
// scores are q_lat . c_kv + q_pe . k_pe over the cached rows, and the
// weighted sum of c_kv comes back through W_UV. Equal to the unabsorbed
// attention (per head k = [W_UK c_kv, k_pe], v = W_UV c_kv) up to rounding,
// without materialising per-head keys or values.
struct MlaWeights {
  const float* w_uk = nullptr;  // [num_q_heads][qk_nope_dim][kv_lora_rank]: k_nope = w_uk[h] c_kv
  const float* w_uv = nullptr;  // [num_q_heads][v_head_dim][kv_lora_rank]: v = w_uv[h] c_kv
  int32_t qk_nope_dim = 0;      // > 0
  int32_t v_head_dim = 0;       // > 0
};

// q:   [num_seqs][num_q_heads][qk_nope_dim + rope_dim] f32 (q_nope, then
//      q_pe with the rotary embedding already applied)
// out: [num_seqs][num_q_heads][v_head_dim] f32
// options.scale: 0 means 1 / sqrt(qk_nope_dim + rope_dim) (models with YaRN
// scaling pass theirs). Errors as PagedDecodeAttention's, plus a layout that
// is not MLA and missing or non-positive weights.
Status MlaDecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, const MlaWeights& w,
                          float* out, const AttentionOptions& options = {});
// The same for prefill (chunked at any position): q and out hold the
// sequences' queries in order, as for PagedPrefillAttention.
Status MlaPrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, const MlaWeights& w,
                           float* out, const AttentionOptions& options = {});

// The SIMD target the kernels dispatch to on this CPU, e.g. "AVX3", "AVX2";
// "+BF16" where bf16 K/V run through AVX-512 BF16 dot products (AMD; on Intel
// they are widened to f32, which runs faster there), "+AMX" where
// bf16 K/V tasks of 8 or more query rows (f16 of 16 or more) run through
// AMX-BF16 tiles.
std::string AttentionSimdTarget();

}  // namespace pagekv
