// Internal interface between the attention entry points (attention.cc:
// validation, work split, threads, merge) and the SIMD inner kernel
// (attention_kernel.cc, compiled once per Highway target).
//
// A RowTask is one unit of work: R query rows that share one KV head, run
// over the key positions [tok_begin, tok_end) of one sequence, updating each
// row's online-softmax state (m, l, acc). Rows may stop at different
// positions (the causal limit of prefill queries) and, under a sliding
// window, start at different positions (begin).
//
//   positions   tok_begin (block-aligned)                     tok_end
//               |---- block ----|---- block ----|-- partial --|
//   row r sees  [max(tok_begin, begin[r]), min(limit[r], tok_end))
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pagekv/dtype.h"
#include "pagekv/ids.h"

namespace pagekv::kernels {

struct RowTask {
  DType dtype = DType::kF32;  // storage of K and V: f32, f16, bf16, or int8 / fp8 (then an f16 scale ends each row)
  int64_t row_bytes = 0;      // bytes of one K/V row: head_dim * element size (+ 2 for int8 and fp8)
  int32_t rows = 0;           // R
  int32_t head_dim = 0;       // D
  const float* q = nullptr;   // [R][D], already multiplied by the scale
  const int64_t* limit = nullptr;  // [R] exclusive end position of each row
  // [R] first position each row sees (a sliding window), or null: every
  // row starts at tok_begin. Masked positions weigh exactly 0.
  const int64_t* begin = nullptr;
  const std::byte* k_region = nullptr;  // slab of block 0 in this (layer, K, head)
  const std::byte* v_region = nullptr;  // slab of block 0 in this (layer, V, head)
  int64_t slab_stride = 0;     // between blocks' K slabs
  int64_t v_slab_stride = 0;   // between blocks' V slabs (0: the same as K's)
  int32_t block_len = 0;
  const BlockId* blocks = nullptr;  // the sequence's block table
  int64_t tok_begin = 0;            // a multiple of block_len
  int64_t tok_end = 0;              // >= every limit[r] that matters
  float softcap = 0;
  float* m = nullptr;       // [R] running max, -inf initially
  float* l = nullptr;       // [R] running sum of exp, 0 initially
  float* acc = nullptr;     // [R][D] running weighted sum of V, 0 initially
  float* scores = nullptr;  // scratch [R][score_stride]
  int32_t score_stride = 0;  // block_len rounded up to kScoreAlign
  // Optional, for attention weights: each row's exp(logit - m_b) where m_b
  // is the row's running max after block b (row r's position p at
  // weights_out[r * weights_stride + p - tok_begin], written for p <
  // limit[r]), and m_b itself at block_max_out[r * block_max_stride + b]
  // (b counted from tok_begin's block). The weight of p is then
  // weights_out * exp(m_b - lse) with the row's final log-sum-exp: one exp
  // per block, not per token, and no second pass over K.
  // INT4 KIVI (dtype kInt4): keys per channel over groups of kivi_group
  // tokens, values per token (layout/quantize.h); positions at or past
  // tail_begin come from the sequence's f16 tail rows of this head instead
  // (tail_k, tail_v: [kivi_group][head_dim] f16). No weights_out.
  int32_t kivi_group = 0;
  int64_t tail_begin = 0;
  const std::byte* tail_k = nullptr;
  const std::byte* tail_v = nullptr;
  float* weights_out = nullptr;
  int64_t weights_stride = 0;
  float* block_max_out = nullptr;
  int64_t block_max_stride = 0;
};

inline constexpr int32_t kScoreAlign = 16;
// Largest block_len the kernel supports (CacheConfig's upper bound).
inline constexpr int32_t kMaxBlockLen = 1024;
// Most rows one task may carry (REQUIRES: rows <= kMaxRows).
inline constexpr int32_t kMaxRows = 128;
// Largest head_dim the INT4 KIVI path supports (its dequantized tiles live
// on the stack); KvLayout refuses larger ones for KIVI.
inline constexpr int32_t kMaxKiviHeadDim = 512;

// Runs the task on the best SIMD target of this CPU (or the one forced by
// SetTargetForTest).
void AttendRows(const RowTask& task);

// Name of the target AttendRows dispatches to ("AVX3", "AVX2", ...).
std::string DispatchedTargetName();

// Test hooks: the targets compiled into this binary that the CPU supports,
// and forcing dispatch to one of them (0 restores normal dispatch).
std::vector<int64_t> SupportedTargets();
void SetTargetForTest(int64_t target);
// A target's name ("AVX2", ...), e.g. for naming per-target test cases.
std::string TargetName(int64_t target);

// Whether bf16 K/V run through AVX-512 BF16 `vdpbf16ps` (kernels/bf16_dot-inl.h)
// rather than widened to f32 for FMAs: on AVX-512 targets of a CPU that has
// the instructions and runs them faster than the widening (AMD Zen 4 / 5:
// yes; Intel Sapphire Rapids and later, told apart by AVX512-FP16: no, the
// hi / lo dot products measured 1.25-1.8x slower there), unless a test chose.
// SetBf16DotForTest forces the choice and returns whether the CPU has the
// instructions; ClearBf16DotForTest goes back to the CPU's default.
bool Bf16DotEnabled();
bool SetBf16DotForTest(bool allowed);
void ClearBf16DotForTest();

}  // namespace pagekv::kernels
