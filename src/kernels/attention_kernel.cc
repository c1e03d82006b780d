// The SIMD inner kernel of paged attention, compiled for every Highway target
// and chosen at run time. See attention_kernel.h for the task it runs.
//
// Per block of keys: scores for all R rows (each K row is loaded and
// converted once per group of kRowsPerPass rows), the online-softmax update
// per row (vector max and exp), then the V accumulation (each V vector loaded
// and converted once per group of rows). While one block is processed the
// next block's K and V rows are prefetched into L2, spread over the token
// loops: hardware prefetchers stop at page boundaries and blocks are
// scattered. docs/PERFORMANCE.md has the measurements behind each choice.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention_kernel.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if HWY_ARCH_X86 && defined(__GNUC__)
#include <cpuid.h>
#endif

#include "kernels/amx_attention.h"
#include "kernels/attention_kernel.h"
#include "kernels/bf16_dot-inl.h"
#include "kernels/kv_rows-inl.h"
#include "kernels/rows_in_lanes-inl.h"
#include "kernels/simd-inl.h"
#include "layout/float16.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Register tiles. Each FMA chain has a latency of several cycles, so the
// inner loops keep up to kChains independent accumulators in flight: score
// tiles of (rows x tokens), accumulation tiles of (rows x vectors of head_dim).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kChains = 16;  // 32 vector registers
#else
constexpr int kChains = 8;   // 16 vector registers (AVX2, SSE4) or fewer lanes
#endif
// Prefetch distance in blocks. 2 and 3 measured the same as 1
// (docs/PERFORMANCE.md), so the nearest is kept.
constexpr int64_t kPrefetchBlocks = 1;
// Rows per pass over a block's K (scores) and V (accumulation). Score tiles
// of four rows balance the loads of q against the FMAs better than eight
// (G = 8: 221 -> 186 cycles per token on the hot-loop measurement).
constexpr int32_t kRowsPerPass = 4;
// Vectors of scores exponentiated together in the softmax.
constexpr int kExpBatch = 4;

// scores[g][t0 + i] = q[g] . k[t0 + i] for kG rows and kT tokens.
template <int kG, int kT, class DF, typename T>
HWY_INLINE void ScoreTile(DF df, const std::byte* HWY_RESTRICT k, int64_t row_bytes, int64_t t0, int32_t d,
                          const float* HWY_RESTRICT q, float* HWY_RESTRICT scores, int32_t stride) {
  const int32_t lanes = static_cast<int32_t>(hn::Lanes(df));
  hn::Vec<DF> a[kG][kT];
  for (int g = 0; g < kG; ++g)
    for (int i = 0; i < kT; ++i) a[g][i] = hn::Zero(df);
  for (int32_t j = 0; j < d; j += lanes) {
    hn::Vec<DF> kv[kT];
    for (int i = 0; i < kT; ++i) kv[i] = LoadRow(df, RowAt<T>(k, t0 + i, row_bytes) + j);
    for (int g = 0; g < kG; ++g) {
      const auto qv = hn::LoadU(df, q + g * d + j);
      for (int i = 0; i < kT; ++i) a[g][i] = hn::MulAdd(qv, kv[i], a[g][i]);
    }
  }
#if HWY_TARGET != HWY_SCALAR
  if constexpr ((kG * kT) % 4 == 0 && hn::MaxLanes(DF()) >= 4) {
    if (hn::Lanes(df) >= 4) {
      hn::Vec<DF>* flat = &a[0][0];  // index g * kT + i
      for (int x = 0; x < kG * kT; x += 4) {
        float sums[4];
        Sum4(df, flat[x], flat[x + 1], flat[x + 2], flat[x + 3], sums);
        for (int y = 0; y < 4; ++y) scores[((x + y) / kT) * stride + t0 + (x + y) % kT] = sums[y];
      }
      return;
    }
  }
#endif
  for (int g = 0; g < kG; ++g)
    for (int i = 0; i < kT; ++i) scores[g * stride + t0 + i] = Sum(df, a[g][i]);
}

// Scores of kG rows over tokens [0, n), prefetching the next block as it goes.
template <int kG, class DF, typename T>
HWY_INLINE void ScoreRows(DF df, const std::byte* HWY_RESTRICT k, int64_t row_bytes, int64_t n, int32_t d,
                          const float* HWY_RESTRICT q, float* HWY_RESTRICT scores, int32_t stride,
                          const Prefetcher& next) {
  constexpr int kT = kG >= kChains ? 1 : kChains / kG;
  int64_t t = 0;
  for (; t + kT <= n; t += kT) {
    for (int i = 0; i < kT; ++i) next.Row(t + i);
    ScoreTile<kG, kT, DF, T>(df, k, row_bytes, t, d, q, scores, stride);
  }
  for (; t < n; ++t) {
    next.Row(t);
    ScoreTile<kG, 1, DF, T>(df, k, row_bytes, t, d, q, scores, stride);
  }
}

// acc[g][j0 .. j0 + kJ vectors) = acc * corr[g] + sum_t p[g][t] v[t] for kG rows.
// `pk` holds the probabilities token-major, pk[t * kG + g], so one pointer
// with constant offsets reaches every row's value (row-major rows would need
// kG live pointers, more than the registers the tile leaves free).
template <int kG, int kJ, class DF, typename T>
HWY_INLINE void AccumulateTile(DF df, const std::byte* HWY_RESTRICT v, int64_t row_bytes, int64_t n, int32_t d, int32_t j0,
                               const float* HWY_RESTRICT pk, const float* corr,
                               float* HWY_RESTRICT acc, const Prefetcher& next) {
  const int32_t lanes = static_cast<int32_t>(hn::Lanes(df));
  hn::Vec<DF> a[kG][kJ];
  for (int g = 0; g < kG; ++g) {
    const auto c = hn::Set(df, corr[g]);
    for (int j = 0; j < kJ; ++j) a[g][j] = hn::Mul(hn::LoadU(df, acc + g * d + j0 + j * lanes), c);
  }
  for (int64_t t = 0; t < n; ++t) {
    next.Row(t);
    hn::Vec<DF> vv[kJ];
    for (int j = 0; j < kJ; ++j) vv[j] = LoadRow(df, RowAt<T>(v, t, row_bytes) + j0 + j * lanes);
    for (int g = 0; g < kG; ++g) {
      const auto pg = hn::Set(df, pk[t * kG + g]);
      for (int j = 0; j < kJ; ++j) a[g][j] = hn::MulAdd(pg, vv[j], a[g][j]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kJ; ++j) hn::StoreU(a[g][j], df, acc + g * d + j0 + j * lanes);
}

// acc[g] = acc[g] * corr[g] + sum_t p[g][t] v[t] for kG rows, tokens [0, n).
// The first pass over the tokens prefetches `next`.
// `vscale` (int8 rows: each token's V scale, folded into its probability)
// is null for plain types.
template <int kG, class DF, typename T>
HWY_INLINE void AccumulateRows(DF df, const std::byte* HWY_RESTRICT v, int64_t row_bytes, int64_t n, int32_t d,
                               const float* HWY_RESTRICT p, int32_t stride, const float* vscale, const float* corr,
                               float* HWY_RESTRICT acc, const Prefetcher& next) {
  // Tiles of kJ vectors of head_dim, the widest that fits the remaining
  // vectors: 8, then 4, 2, 1 (head_dim 128 in f32x16 is 8 vectors).
  constexpr int kJ = kG >= kChains ? 1 : std::min(8, kChains / kG);
  const int32_t lanes = static_cast<int32_t>(hn::Lanes(df));
  const Prefetcher none;
  HWY_ALIGN float pk[kMaxBlockLen * kG];
  if (vscale != nullptr) {
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < kG; ++g) pk[t * kG + g] = p[g * stride + t] * vscale[t];
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < kG; ++g) pk[t * kG + g] = p[g * stride + t];
  }
  int32_t j0 = 0;
  for (; j0 + kJ * lanes <= d; j0 += kJ * lanes) {
    AccumulateTile<kG, kJ, DF, T>(df, v, row_bytes, n, d, j0, pk, corr, acc, j0 == 0 ? next : none);
  }
  if constexpr (kJ > 4) {
    for (; j0 + 4 * lanes <= d; j0 += 4 * lanes) AccumulateTile<kG, 4, DF, T>(df, v, row_bytes, n, d, j0, pk, corr, acc, j0 == 0 ? next : none);
  }
  if constexpr (kJ > 2) {
    for (; j0 + 2 * lanes <= d; j0 += 2 * lanes) AccumulateTile<kG, 2, DF, T>(df, v, row_bytes, n, d, j0, pk, corr, acc, j0 == 0 ? next : none);
  }
  for (; j0 < d; j0 += lanes) AccumulateTile<kG, 1, DF, T>(df, v, row_bytes, n, d, j0, pk, corr, acc, j0 == 0 ? next : none);
}

template <class DF, typename T>
void AttendRowsT(DF df, const RowTask& task) {
  const int32_t d = task.head_dim;
  const int32_t rows = task.rows;
  const int32_t bl = task.block_len;
  const int32_t stride = task.score_stride;
  const int64_t row_bytes = task.row_bytes > 0 ? task.row_bytes : static_cast<int64_t>(d) * sizeof(T);
  constexpr bool kScaled = kScaledRows<T>;
  HWY_ALIGN float kscale[kMaxBlockLen], vscale[kMaxBlockLen];
  const int32_t lanes = static_cast<int32_t>(hn::Lanes(df));
  float corr[8];
  float* HWY_RESTRICT scores = task.scores;
  int64_t max_limit = 0;
  for (int32_t r = 0; r < rows; ++r) max_limit = std::max(max_limit, task.limit[r]);
  const int64_t end = std::min(task.tok_end, max_limit);
  // bf16 rows on a CPU with AVX-512 BF16: q split once into bf16 hi + lo
  // for `vdpbf16ps` (kernels/bf16_dot-inl.h).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  constexpr bool kMayDot = std::is_same_v<T, hwy::bfloat16_t> && hn::MaxLanes(DF()) == 16;
#else
  [[maybe_unused]] constexpr bool kMayDot = false;
#endif
  [[maybe_unused]] const uint16_t* qhi = nullptr;
  [[maybe_unused]] const uint16_t* qlo = nullptr;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (kMayDot) {
    if (d % 32 == 0 && Bf16DotEnabled()) {
      thread_local std::vector<uint16_t> split;
      split.resize(2 * static_cast<size_t>(rows) * d);
      bf16dot::SplitRows(task.q, rows, d, split.data(), split.data() + static_cast<size_t>(rows) * d);
      qhi = split.data();
      qlo = split.data() + static_cast<size_t>(rows) * d;
    }
  }
#endif
  [[maybe_unused]] const bool dot = qhi != nullptr;

  for (int64_t start = task.tok_begin; start < end; start += bl) {
    const int64_t n = std::min<int64_t>(bl, end - start);
    const int64_t block = ToInt(task.blocks[start / bl]);
    const int64_t v_stride = task.v_slab_stride > 0 ? task.v_slab_stride : task.slab_stride;
    const std::byte* k = task.k_region + block * task.slab_stride;
    const std::byte* v = task.v_region + block * v_stride;
    // Distance: kPrefetchBlocks blocks ahead. The scores of block b prefetch
    // K(b + distance); the accumulation of block b prefetches V(b + distance).
    Prefetcher score_pf, acc_pf;
    const int64_t ahead = start + kPrefetchBlocks * bl;
    if (ahead < end) {
      const int64_t nb = ToInt(task.blocks[ahead / bl]);
      const int64_t rows_ahead = std::min<int64_t>(bl, end - ahead);
      score_pf = {task.k_region + nb * task.slab_stride, rows_ahead, row_bytes};
      acc_pf = {task.v_region + nb * v_stride, rows_ahead, row_bytes};
    }

    // 1. Scores for every row (rows beyond their limit are masked below).
    int32_t r = 0, pass = 0;
    const int32_t k_passes = rows / 4 + rows % 4 / 2 + rows % 2;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    if constexpr (kMayDot) {
      if (dot) {
        auto rows_of = [&](auto g_tag, int32_t at) {
          constexpr int kG = decltype(g_tag)::value;
          bf16dot::ScoreRows<kG>(k, row_bytes, n, d, qhi + at * d, qlo + at * d, scores + at * stride, stride,
                                 score_pf.Part(pass++, k_passes));
        };
        for (; r + 4 <= rows; r += 4) rows_of(std::integral_constant<int, 4>(), r);
        for (; r + 2 <= rows; r += 2) rows_of(std::integral_constant<int, 2>(), r);
        for (; r < rows; ++r) rows_of(std::integral_constant<int, 1>(), r);
      }
    }
#endif
    for (; r + 4 <= rows; r += 4) ScoreRows<4, DF, T>(df, k, row_bytes, n, d, task.q + r * d, scores + r * stride, stride, score_pf.Part(pass++, k_passes));
    for (; r + 2 <= rows; r += 2) ScoreRows<2, DF, T>(df, k, row_bytes, n, d, task.q + r * d, scores + r * stride, stride, score_pf.Part(pass++, k_passes));
    for (; r < rows; ++r) ScoreRows<1, DF, T>(df, k, row_bytes, n, d, task.q + r * d, scores + r * stride, stride, score_pf.Part(pass++, k_passes));
    if constexpr (kScaled) {
      // int8 / fp8: each token's K scale multiplies its dot products (the
      // values were summed unscaled); its V scale is folded into the probabilities.
      constexpr float kFactor = std::is_same_v<T, E4M3> ? 256.0f : 1.0f;  // see LoadRow
      for (int64_t t = 0; t < n; ++t) {
        kscale[t] = Int8Scale(k + t * row_bytes + d) * kFactor;
        vscale[t] = Int8Scale(v + t * row_bytes + d) * kFactor;
      }
      for (r = 0; r < rows; ++r) {
        float* HWY_RESTRICT s = scores + r * stride;
        for (int64_t t = 0; t < n; ++t) s[t] *= kscale[t];
      }
    }

    // 2. Online softmax per row: new max, rescale factor, p = exp(s - max).
    // First every row's max, then every row's exps: a row's exps wait on
    // its max (a chain of maxes and a reduction), so the rows' chains are
    // left to overlap instead of running one row after another.
    // A row sees [lo, valid) of this block: lo > 0 only in the block where
    // its sliding window starts.
    int64_t group_n = 0;  // the longest valid prefix among the rows
    float corr_all[kMaxRows], m_new_all[kMaxRows];
    int64_t valid_all[kMaxRows], lo_all[kMaxRows];
    const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
    for (r = 0; r < rows; ++r) {
      float* HWY_RESTRICT s = scores + r * stride;
      int64_t valid = std::clamp<int64_t>(task.limit[r] - start, 0, n);
      const int64_t lo = task.begin == nullptr ? 0 : std::clamp<int64_t>(task.begin[r] - start, 0, n);
      if (lo >= valid) valid = 0;
      valid_all[r] = valid;
      lo_all[r] = lo;
      if (valid == 0) continue;
      group_n = std::max(group_n, valid);
      if (task.softcap > 0) {
        for (int64_t t = lo; t < valid; ++t) s[t] = task.softcap * std::tanh(s[t] / task.softcap);
      }
      auto vmax_acc = neg_inf;
      int64_t t = 0;
      if (lo > 0) {
        // The window's first block: whole vectors from slot 0 (so no load
        // passes the row's end), positions before lo masked out.
        for (; t < valid; t += lanes) {
          const auto mask = hn::AndNot(hn::FirstN(df, static_cast<size_t>(std::max<int64_t>(0, lo - t))),
                                       hn::FirstN(df, static_cast<size_t>(valid - t)));
          vmax_acc = hn::Max(vmax_acc, hn::IfThenElse(mask, hn::LoadU(df, s + t), neg_inf));
        }
      }
      for (; t + lanes <= valid; t += lanes) vmax_acc = hn::Max(vmax_acc, hn::LoadU(df, s + t));
      if (t < valid) {
        vmax_acc = hn::Max(vmax_acc, hn::IfThenElse(hn::FirstN(df, static_cast<size_t>(valid - t)), hn::LoadU(df, s + t), neg_inf));
      }
      const float m_old = task.m[r];
      const float m_new = std::max(m_old, hn::GetLane(hn::MaxOfLanes(df, vmax_acc)));
      m_new_all[r] = m_new;
      corr_all[r] = m_old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m_old - m_new);
    }
    for (r = 0; r < rows; ++r) {
      float* HWY_RESTRICT s = scores + r * stride;
      const int64_t valid = valid_all[r];
      if (valid == 0) {
        for (int64_t t = 0; t < n; ++t) s[t] = 0.0f;
        corr_all[r] = 1.0f;
        continue;
      }
      const float m_new = m_new_all[r];
      const auto vmax = hn::Set(df, m_new);
      auto vsum = hn::Zero(df);
      int64_t t = 0;
      if (const int64_t lo = lo_all[r]; lo > 0) {
        // The window's first block: positions before lo weigh exactly 0.
        for (; t < n; t += lanes) {
          const auto mask = hn::AndNot(hn::FirstN(df, static_cast<size_t>(std::max<int64_t>(0, lo - t))),
                                       hn::FirstN(df, static_cast<size_t>(std::max<int64_t>(0, valid - t))));
          const auto e = hn::IfThenElseZero(mask, hn::CallExp(df, hn::IfThenElseZero(mask, hn::Sub(hn::LoadU(df, s + t), vmax))));
          hn::StoreU(e, df, s + t);
          vsum = hn::Add(vsum, e);
        }
      }
      // Four independent exps per step: one alone is a chain of dependent
      // polynomial steps and leaves the pipes idle (docs/PERFORMANCE.md).
      for (; t + kExpBatch * lanes <= valid; t += kExpBatch * lanes) {
        hn::Vec<DF> e[kExpBatch];
        for (int i = 0; i < kExpBatch; ++i) e[i] = hn::Exp(df, hn::Sub(hn::LoadU(df, s + t + i * lanes), vmax));
        for (int i = 0; i < kExpBatch; ++i) {
          hn::StoreU(e[i], df, s + t + i * lanes);
          vsum = hn::Add(vsum, e[i]);
        }
      }
      for (; t < n; t += lanes) {
        const auto mask = hn::FirstN(df, static_cast<size_t>(std::max<int64_t>(0, valid - t)));
        // Lanes past `valid` hold anything (NaN too): kept out of Exp.
        const auto e = hn::IfThenElseZero(mask, hn::CallExp(df, hn::IfThenElseZero(mask, hn::Sub(hn::LoadU(df, s + t), vmax))));
        hn::StoreU(e, df, s + t);
        vsum = hn::Add(vsum, e);
      }
      task.l[r] = task.l[r] * corr_all[r] + Sum(df, vsum);
      task.m[r] = m_new;
      if (task.weights_out != nullptr) {
        std::memcpy(task.weights_out + r * task.weights_stride + (start - task.tok_begin), s,
                    static_cast<size_t>(valid) * sizeof(float));
        task.block_max_out[r * task.block_max_stride + (start - task.tok_begin) / bl] = m_new;
      }
    }
    if (group_n == 0) continue;

    // 3. acc = acc * corr + p v, kRowsPerPass rows per pass over V.
    for (r = 0; r < rows;) {
      const int32_t g = std::min(rows - r, kRowsPerPass);
      for (int i = 0; i < g; ++i) corr[i] = corr_all[r + i];
      float* a = task.acc + static_cast<int64_t>(r) * d;
      const float* p = scores + r * stride;
      const Prefetcher pf = acc_pf.Part(r / kRowsPerPass, (rows + kRowsPerPass - 1) / kRowsPerPass);
      static_assert(kRowsPerPass == 4, "the dispatch below covers groups of 4, 2 and 1 rows");
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
      if constexpr (kMayDot) {
        if (dot) {
          const int32_t taken = g == 4 ? 4 : g >= 2 ? 2 : 1;
          if (taken == 4) bf16dot::AccumulateRows<4>(v, row_bytes, group_n, d, p, stride, corr, a, pf);
          if (taken == 2) bf16dot::AccumulateRows<2>(v, row_bytes, group_n, d, p, stride, corr, a, pf);
          if (taken == 1) bf16dot::AccumulateRows<1>(v, row_bytes, group_n, d, p, stride, corr, a, pf);
          r += taken;
          continue;
        }
      }
#endif
      if (g == 4) {
        AccumulateRows<4, DF, T>(df, v, row_bytes, group_n, d, p, stride, kScaled ? vscale : nullptr, corr, a, pf);
        r += 4;
      } else if (g >= 2) {
        AccumulateRows<2, DF, T>(df, v, row_bytes, group_n, d, p, stride, kScaled ? vscale : nullptr, corr, a, pf);
        r += 2;
      } else {
        AccumulateRows<1, DF, T>(df, v, row_bytes, group_n, d, p, stride, kScaled ? vscale : nullptr, corr, a, pf);
        r += 1;
      }
    }
  }
}

// Picks the widest vector that divides head_dim, so every head_dim runs
// without a tail (16 floats on AVX-512 down to 1 for odd sizes).
template <typename T>
void AttendRowsDim(const RowTask& task) {
  const hn::ScalableTag<float> full;
  const int32_t d = task.head_dim;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // Many rows of bf16 or f16 on a CPU with AMX: tiles (kernels/amx_attention.cc).
  if constexpr (std::is_same_v<T, hwy::bfloat16_t> || std::is_same_v<T, hwy::float16_t>) {
    if (AmxAttendRows(task)) return;
  }
#endif
  if constexpr (!kScaledRows<T> && hn::MaxLanes(decltype(full)()) >= 4) {
    // Many rows, plain storage, no soft-capping: rows in lanes. (Whether
    // attention weights are wanted must not change the path: the same
    // attention with and without them is bit for bit the same.)
    if (task.rows >= static_cast<int32_t>(hn::Lanes(full)) && task.softcap == 0 && d <= kLanesMaxHeadDim) {
      return AttendRowsLanesT<decltype(full), T>(full, task);
    }

  }
  if (d % static_cast<int32_t>(hn::Lanes(full)) == 0) return AttendRowsT<decltype(full), T>(full, task);
  const hn::CappedTag<float, 8> c8;
  if (d % static_cast<int32_t>(hn::Lanes(c8)) == 0) return AttendRowsT<decltype(c8), T>(c8, task);
  const hn::CappedTag<float, 4> c4;
  if (d % static_cast<int32_t>(hn::Lanes(c4)) == 0) return AttendRowsT<decltype(c4), T>(c4, task);
  const hn::CappedTag<float, 1> c1;
  return AttendRowsT<decltype(c1), T>(c1, task);
}

// --- INT4 KIVI -------------------------------------------------------------

// Codes j .. j + N of a row of packed nibbles (element 2i in the low nibble
// of byte i) as f32: N / 2 bytes loaded, split, interleaved and widened.
#if HWY_TARGET != HWY_SCALAR  // one lane: the scalar loop below does it
template <class DF>
HWY_INLINE hn::Vec<DF> Nibbles(DF df, const uint8_t* HWY_RESTRICT bytes) {
  const hn::Rebind<uint8_t, DF> du8;
  const hn::Half<decltype(du8)> dh;
  const hn::Rebind<uint32_t, DF> du32;
  const hn::Rebind<int32_t, DF> di32;
  const auto b = hn::ZeroExtendVector(du8, hn::LoadU(dh, bytes));
  const auto lo = hn::And(b, hn::Set(du8, 0x0F));
  const auto hi = hn::ShiftRight<4>(b);
  return hn::ConvertTo(df, hn::BitCast(di32, hn::PromoteTo(du32, hn::InterleaveLower(lo, hi))));
}
#endif

HWY_INLINE float Nibble(const uint8_t* bytes, int32_t i) {
  return static_cast<float>(i % 2 == 0 ? (bytes[i / 2] & 0x0F) : (bytes[i / 2] >> 4));
}

// out[t][c] = code(t, c) * scale[c] + min[c] for n rows of d packed codes
// rows_bytes apart (per-channel parameters: keys), or with one scale and
// minimum per row read from the row's end (kPerToken: values). The main loop
// takes 2N codes from N bytes: split into low and high nibbles, interleaved
// back into element order, widened and converted.
template <bool kPerToken, class DF>
void DequantInt4(DF df, const std::byte* rows, int64_t row_bytes, int64_t n, int32_t d, const float* scale,
                 const float* min, float* HWY_RESTRICT out) {
  const auto lanes = static_cast<int32_t>(hn::Lanes(df));
  for (int64_t t = 0; t < n; ++t) {
    const auto* codes = reinterpret_cast<const uint8_t*>(rows + t * row_bytes);
    float* o = out + t * d;
    float s = 0, m = 0;
    if constexpr (kPerToken) {
      s = Int8Scale(rows + t * row_bytes + d / 2);
      m = Int8Scale(rows + t * row_bytes + d / 2 + 2);
    }
    int32_t j = 0;
#if HWY_TARGET != HWY_SCALAR
    if constexpr (hn::MaxLanes(df) >= 2) {
      const hn::Rebind<uint8_t, DF> du8;
      const hn::Rebind<uint32_t, DF> du32;
      const hn::Rebind<int32_t, DF> di32;
      const auto vs = hn::Set(df, s), vm = hn::Set(df, m);
      auto put = [&](hn::Vec<decltype(du8)> c8, int32_t at) {
        const auto c = hn::ConvertTo(df, hn::BitCast(di32, hn::PromoteTo(du32, c8)));
        if constexpr (kPerToken) {
          hn::StoreU(hn::MulAdd(c, vs, vm), df, o + at);
        } else {
          hn::StoreU(hn::MulAdd(c, hn::LoadU(df, scale + at), hn::LoadU(df, min + at)), df, o + at);
        }
      };
      for (; j + 2 * lanes <= d; j += 2 * lanes) {
        const auto b = hn::LoadU(du8, codes + j / 2);
        const auto lo = hn::And(b, hn::Set(du8, 0x0F));
        const auto hi = hn::ShiftRight<4>(b);
        put(hn::InterleaveLower(du8, lo, hi), j);
        put(hn::InterleaveUpper(du8, lo, hi), j + lanes);
      }
      for (; j + lanes <= d; j += lanes) {
        const auto c = Nibbles(df, codes + j / 2);
        if constexpr (kPerToken) {
          hn::StoreU(hn::MulAdd(c, vs, vm), df, o + j);
        } else {
          hn::StoreU(hn::MulAdd(c, hn::LoadU(df, scale + j), hn::LoadU(df, min + j)), df, o + j);
        }
      }
    }
#else
    (void)lanes;
#endif
    for (; j < d; ++j) o[j] = Nibble(codes, j) * (kPerToken ? s : scale[j]) + (kPerToken ? m : min[j]);
  }
}

constexpr int32_t kKiviChunk = 64;
constexpr int32_t kKiviPrefetchChunks = 4;  // how far ahead the KIVI path prefetches

template <class DF>
void AttendRowsKiviT(DF df, const RowTask& task) {
  const int32_t d = task.head_dim, g = task.kivi_group, bl = task.block_len;
  // Tokens dequantized at a time: up to 64 of one block (whole groups, or
  // part of one), so the f32 tiles stay in L1/L2 and each sub-task is long
  // enough to amortise its set-up.
  const int32_t chunk = std::min<int32_t>(bl, std::max<int32_t>(g, kKiviChunk));
  const int64_t group_bytes = int64_t{g} * d / 2 + 4 * int64_t{d};
  const int64_t value_row = d / 2 + 4;
  thread_local std::vector<float> ktile_buf, vtile_buf;
  ktile_buf.resize(static_cast<size_t>(chunk) * static_cast<size_t>(d));
  vtile_buf.resize(ktile_buf.size());
  float* HWY_RESTRICT ktile = ktile_buf.data();
  float* HWY_RESTRICT vtile = vtile_buf.data();
  float kscale[kMaxKiviHeadDim], kmin[kMaxKiviHeadDim];
  int64_t limit[kMaxRows], begin[kMaxRows];
  int64_t max_limit = 0;
  for (int32_t r = 0; r < task.rows; ++r) max_limit = std::max(max_limit, task.limit[r]);
  const int64_t end = std::min(task.tok_end, max_limit);
  const BlockId zero{0};
  // The online-softmax state (m, l, acc) carries across the sub-tasks: each
  // is one chunk of dequantized f32 rows (or the f16 tail) as one block.
  RowTask sub = task;
  sub.blocks = &zero;
  sub.slab_stride = 0;
  sub.v_slab_stride = 0;
  sub.tok_begin = 0;
  sub.limit = limit;
  sub.begin = task.begin != nullptr ? begin : nullptr;
  sub.weights_out = nullptr;
  auto run = [&](int64_t first, int64_t n) {
    for (int32_t r = 0; r < task.rows; ++r) limit[r] = std::clamp<int64_t>(task.limit[r] - first, 0, n);
    if (task.begin != nullptr) {
      for (int32_t r = 0; r < task.rows; ++r) begin[r] = std::clamp<int64_t>(task.begin[r] - first, 0, n);
    }
    sub.tok_end = n;
    sub.block_len = static_cast<int32_t>(std::max<int64_t>(n, 1));
  };
  const int64_t sealed_end = std::min(end, task.tail_begin);
  int64_t params_group = -1;  // the key group whose parameters are loaded
  // The bytes of chunk `start`: its key codes (and their group's parameters)
  // and its value rows, prefetched kKiviPrefetchChunks chunks ahead into L2
  // (blocks are scattered, so the hardware prefetchers do not follow).
  auto prefetch = [&](int64_t at) {
    if (at >= sealed_end) return;
    const int64_t n = std::min<int64_t>(chunk, sealed_end - at);
    const int64_t block = ToInt(task.blocks[at / bl]);
    const int64_t in_block = at % bl;
    const std::byte* k = task.k_region + block * task.slab_stride + (in_block / g) * group_bytes + (in_block % g) * (d / 2);
    const int64_t k_bytes = (n + g - 1) / g * group_bytes;  // codes and parameters of the groups it touches
    for (int64_t o = 0; o < k_bytes; o += 64) __builtin_prefetch(k + o, 0, 2);
    const std::byte* v = task.v_region + block * task.v_slab_stride + in_block * value_row;
    for (int64_t o = 0; o < n * value_row; o += 64) __builtin_prefetch(v + o, 0, 2);
  };
  for (int32_t a = 0; a < kKiviPrefetchChunks; ++a) prefetch(task.tok_begin + a * chunk);
  for (int64_t start = task.tok_begin; start < sealed_end; start += chunk) {
    const int64_t n = std::min<int64_t>(chunk, sealed_end - start);
    const int64_t block = ToInt(task.blocks[start / bl]);
    const int64_t in_block = start % bl;
    prefetch(start + kKiviPrefetchChunks * chunk);
    // Keys group by group (each with its own per-channel parameters).
    for (int64_t t = 0; t < n;) {
      const int64_t at = in_block + t;
      const std::byte* group = task.k_region + block * task.slab_stride + (at / g) * group_bytes;
      const int64_t group_id = (start + t) / g;
      if (group_id != params_group) {  // d f16 scales then d f16 minimums, to f32
        const auto* params = reinterpret_cast<const hwy::float16_t*>(group + int64_t{g} * d / 2);
        int32_t c = 0;
        const hn::Rebind<hwy::float16_t, DF> df16;
        const auto lanes = static_cast<int32_t>(hn::Lanes(df));
        for (; c + lanes <= d; c += lanes) {
          hn::StoreU(hn::PromoteTo(df, hn::LoadU(df16, params + c)), df, kscale + c);
          hn::StoreU(hn::PromoteTo(df, hn::LoadU(df16, params + d + c)), df, kmin + c);
        }
        for (; c < d; ++c) {
          kscale[c] = Int8Scale(reinterpret_cast<const std::byte*>(params + c));
          kmin[c] = Int8Scale(reinterpret_cast<const std::byte*>(params + d + c));
        }
        params_group = group_id;
      }
      const int64_t rows = std::min<int64_t>(n - t, g - at % g);
      DequantInt4<false>(df, group + (at % g) * (d / 2), d / 2, rows, d, kscale, kmin, ktile + t * d);
      t += rows;
    }
    DequantInt4<true>(df, task.v_region + block * task.v_slab_stride + in_block * value_row, value_row, n, d, nullptr,
                      nullptr, vtile);
    run(start, n);
    sub.dtype = DType::kF32;
    sub.row_bytes = int64_t{d} * 4;
    sub.k_region = reinterpret_cast<const std::byte*>(ktile);
    sub.v_region = reinterpret_cast<const std::byte*>(vtile);
    AttendRowsDim<float>(sub);
  }
  if (end > task.tail_begin) {  // the not-yet-full group, in f16
    run(task.tail_begin, end - task.tail_begin);
    sub.dtype = DType::kF16;
    sub.row_bytes = int64_t{d} * 2;
    sub.k_region = task.tail_k;
    sub.v_region = task.tail_v;
    AttendRowsDim<hwy::float16_t>(sub);
  }
}

void AttendRowsKivi(const RowTask& task) {
  const hn::ScalableTag<float> full;
  const int32_t d = task.head_dim;
  if (d % static_cast<int32_t>(hn::Lanes(full)) == 0) return AttendRowsKiviT(full, task);
  const hn::CappedTag<float, 4> c4;
  if (d % static_cast<int32_t>(hn::Lanes(c4)) == 0) return AttendRowsKiviT(c4, task);
  const hn::CappedTag<float, 1> c1;
  return AttendRowsKiviT(c1, task);
}

void AttendRowsImpl(const RowTask& task) {
  switch (task.dtype) {
    case DType::kF32: return AttendRowsDim<float>(task);
    case DType::kF16: return AttendRowsDim<hwy::float16_t>(task);
    case DType::kBF16: return AttendRowsDim<hwy::bfloat16_t>(task);
    case DType::kInt8: return AttendRowsDim<int8_t>(task);
    case DType::kFP8E4M3: return AttendRowsDim<E4M3>(task);
    case DType::kFP8E5M2: return AttendRowsDim<E5M2>(task);
    case DType::kInt4: return AttendRowsKivi(task);
    default: return;  // rejected by the entry points
  }
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagekv::kernels {

HWY_EXPORT(AttendRowsImpl);
HWY_EXPORT(TargetNameImpl);

void AttendRows(const RowTask& task) { HWY_DYNAMIC_DISPATCH(AttendRowsImpl)(task); }

std::string DispatchedTargetName() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

std::vector<int64_t> SupportedTargets() { return hwy::SupportedAndGeneratedTargets(); }

std::string TargetName(int64_t target) { return hwy::TargetName(target); }

namespace {
// -1: the CPU's default; 0 / 1: a test's choice.
std::atomic<int> bf16_dot_choice{-1};
bool CpuHasBf16Dot() {
#if HWY_ARCH_X86 && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}
// Intel's AVX-512 BF16 parts with AVX512-FP16 (Sapphire Rapids and later)
// run the widening faster (BM_DecodeHot against BM_DecodeHotBf16Dot: 13.0
// against 16.2 ns per token at G = 1, 27.3 against 49.8 at G = 4);
// AMD's run the dot products faster (docs/PERFORMANCE.md).
bool CpuPrefersBf16Dot() {
#if HWY_ARCH_X86 && defined(__GNUC__)
  static const bool prefers = [] {
    if (!CpuHasBf16Dot()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d) == 0) return true;
    const bool intel = b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;  // "GenuineIntel"
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return true;
    const bool fp16 = (d >> 23) & 1;  // AVX512-FP16
    return !(intel && fp16);
  }();
  return prefers;
#else
  return false;
#endif
}
}  // namespace

bool Bf16DotEnabled() {
  const int choice = bf16_dot_choice.load(std::memory_order_relaxed);
  return CpuHasBf16Dot() && (choice < 0 ? CpuPrefersBf16Dot() : choice == 1);
}

bool SetBf16DotForTest(bool allowed) {
  bf16_dot_choice.store(allowed ? 1 : 0, std::memory_order_relaxed);
  return CpuHasBf16Dot();
}

void ClearBf16DotForTest() { bf16_dot_choice.store(-1, std::memory_order_relaxed); }

void SetTargetForTest(int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

}  // namespace pagekv::kernels
#endif  // HWY_ONCE
