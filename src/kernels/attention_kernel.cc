// The SIMD inner kernel of paged attention, compiled for every Highway target
// and chosen at run time. See attention_kernel.h for the task it runs.
//
// Per block of keys: scores for all R rows (each K row is loaded and
// converted once per group of rows), the online-softmax update per row
// (vector exp), then the V accumulation (each V vector loaded and converted
// once per group of up to 8 rows). While one block is processed the next
// block's K and V rows are prefetched, spread over the token loop: hardware
// prefetchers stop at page boundaries and blocks are scattered.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention_kernel.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/attention_kernel.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class DF, typename T>
HWY_INLINE hn::Vec<DF> LoadF32(DF df, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, p);
  } else {
    const hn::Rebind<T, DF> dh;
    return hn::PromoteTo(df, hn::LoadU(dh, p));
  }
}

template <class DF>
HWY_INLINE float Sum(DF df, hn::Vec<DF> v) {
  return hn::GetLane(hn::SumOfLanes(df, v));
}

// scores[r][t] = q[r] . k[t] for kG rows starting at r0, t in [0, n).
template <int kG, class DF, typename T>
HWY_INLINE void ScoreRows(DF df, const T* HWY_RESTRICT k, int64_t n, int32_t d, const float* HWY_RESTRICT q,
                          float* HWY_RESTRICT scores, int32_t stride) {
  const int32_t lanes = static_cast<int32_t>(hn::Lanes(df));
  for (int64_t t = 0; t < n; ++t) {
    const T* HWY_RESTRICT krow = k + t * d;
    hn::Vec<DF> a[kG];
    for (int g = 0; g < kG; ++g) a[g] = hn::Zero(df);
    for (int32_t j = 0; j < d; j += lanes) {
      const auto kv = LoadF32(df, krow + j);
      for (int g = 0; g < kG; ++g) a[g] = hn::MulAdd(hn::LoadU(df, q + g * d + j), kv, a[g]);
    }
    for (int g = 0; g < kG; ++g) scores[g * stride + t] = Sum(df, a[g]);
  }
}

// acc[r] = acc[r] * corr[r] + sum_t p[r][t] v[t] for kG rows.
template <int kG, class DF, typename T>
HWY_INLINE void AccumulateRows(DF df, const T* HWY_RESTRICT v, int64_t n, int32_t d,
                               const float* HWY_RESTRICT p, int32_t stride, const float* corr,
                               float* HWY_RESTRICT acc) {
  const int32_t lanes = static_cast<int32_t>(hn::Lanes(df));
  for (int32_t j = 0; j < d; j += lanes) {
    hn::Vec<DF> a[kG];
    for (int g = 0; g < kG; ++g) a[g] = hn::Mul(hn::LoadU(df, acc + g * d + j), hn::Set(df, corr[g]));
    for (int64_t t = 0; t < n; ++t) {
      const auto vv = LoadF32(df, v + t * d + j);
      for (int g = 0; g < kG; ++g) a[g] = hn::MulAdd(hn::Set(df, p[g * stride + t]), vv, a[g]);
    }
    for (int g = 0; g < kG; ++g) hn::StoreU(a[g], df, acc + g * d + j);
  }
}

template <class DF, typename T>
void AttendRowsT(DF df, const RowTask& task) {
  const int32_t d = task.head_dim;
  const int32_t rows = task.rows;
  const int32_t bl = task.block_len;
  const int32_t stride = task.score_stride;
  const int64_t row_bytes = static_cast<int64_t>(d) * sizeof(T);
  const int32_t lanes = static_cast<int32_t>(hn::Lanes(df));
  float corr[8];
  float* HWY_RESTRICT scores = task.scores;
  int64_t max_limit = 0;
  for (int32_t r = 0; r < rows; ++r) max_limit = std::max(max_limit, task.limit[r]);
  const int64_t end = std::min(task.tok_end, max_limit);

  for (int64_t start = task.tok_begin; start < end; start += bl) {
    const int64_t n = std::min<int64_t>(bl, end - start);
    const int64_t block = ToInt(task.blocks[start / bl]);
    const auto* k = reinterpret_cast<const T*>(task.k_region + block * task.slab_stride);
    const auto* v = reinterpret_cast<const T*>(task.v_region + block * task.slab_stride);
    if (start + bl < end) {
      // Prefetch the next block's rows now; the block is read right after.
      const int64_t next = ToInt(task.blocks[(start + bl) / bl]);
      const std::byte* nk = task.k_region + next * task.slab_stride;
      const std::byte* nv = task.v_region + next * task.slab_stride;
      const int64_t bytes = std::min<int64_t>(bl, end - start - bl) * row_bytes;
      for (int64_t off = 0; off < bytes; off += 64) {
        hwy::Prefetch(nk + off);
        hwy::Prefetch(nv + off);
      }
    }

    // 1. Scores for every row (rows beyond their limit are masked below).
    int32_t r = 0;
    for (; r + 4 <= rows; r += 4) ScoreRows<4>(df, k, n, d, task.q + r * d, scores + r * stride, stride);
    for (; r + 2 <= rows; r += 2) ScoreRows<2>(df, k, n, d, task.q + r * d, scores + r * stride, stride);
    for (; r < rows; ++r) ScoreRows<1>(df, k, n, d, task.q + r * d, scores + r * stride, stride);

    // 2. Online softmax per row: new max, rescale factor, p = exp(s - max).
    int64_t group_n = 0;  // the longest valid prefix among the rows
    float corr_all[kMaxRows];
    for (r = 0; r < rows; ++r) {
      float* HWY_RESTRICT s = scores + r * stride;
      const int64_t valid = std::clamp<int64_t>(task.limit[r] - start, 0, n);
      if (valid == 0) {
        for (int64_t t = 0; t < n; ++t) s[t] = 0.0f;
        corr_all[r] = 1.0f;
        continue;
      }
      group_n = std::max(group_n, valid);
      if (task.softcap > 0) {
        for (int64_t t = 0; t < valid; ++t) s[t] = task.softcap * std::tanh(s[t] / task.softcap);
      }
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < valid; ++t) block_max = std::max(block_max, s[t]);
      const float m_old = task.m[r];
      const float m_new = std::max(m_old, block_max);
      const float c = m_old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m_old - m_new);
      const auto vmax = hn::Set(df, m_new);
      auto vsum = hn::Zero(df);
      for (int64_t t = 0; t < n; t += lanes) {
        const auto mask = hn::FirstN(df, static_cast<size_t>(std::max<int64_t>(0, valid - t)));
        const auto e = hn::IfThenElseZero(mask, hn::CallExp(df, hn::Sub(hn::LoadU(df, s + t), vmax)));
        hn::StoreU(e, df, s + t);
        vsum = hn::Add(vsum, e);
      }
      task.l[r] = task.l[r] * c + Sum(df, vsum);
      task.m[r] = m_new;
      corr_all[r] = c;
    }
    if (group_n == 0) continue;

    // 3. acc = acc * corr + p v, up to 8 rows per pass over V.
    for (r = 0; r < rows;) {
      const int32_t g = std::min(rows - r, 8);
      for (int i = 0; i < g; ++i) corr[i] = corr_all[r + i];
      float* a = task.acc + static_cast<int64_t>(r) * d;
      const float* p = scores + r * stride;
      if (g == 8) AccumulateRows<8>(df, v, group_n, d, p, stride, corr, a);
      else if (g >= 4) { AccumulateRows<4>(df, v, group_n, d, p, stride, corr, a); r += 4; continue; }
      else if (g >= 2) { AccumulateRows<2>(df, v, group_n, d, p, stride, corr, a); r += 2; continue; }
      else AccumulateRows<1>(df, v, group_n, d, p, stride, corr, a);
      r += g;
    }
  }
}

// Picks the widest vector that divides head_dim, so every head_dim runs
// without a tail (16 floats on AVX-512 down to 1 for odd sizes).
template <typename T>
void AttendRowsDim(const RowTask& task) {
  const hn::ScalableTag<float> full;
  const int32_t d = task.head_dim;
  if (d % static_cast<int32_t>(hn::Lanes(full)) == 0) return AttendRowsT<decltype(full), T>(full, task);
  const hn::CappedTag<float, 8> c8;
  if (d % static_cast<int32_t>(hn::Lanes(c8)) == 0) return AttendRowsT<decltype(c8), T>(c8, task);
  const hn::CappedTag<float, 4> c4;
  if (d % static_cast<int32_t>(hn::Lanes(c4)) == 0) return AttendRowsT<decltype(c4), T>(c4, task);
  const hn::CappedTag<float, 1> c1;
  return AttendRowsT<decltype(c1), T>(c1, task);
}

void AttendRowsImpl(const RowTask& task) {
  switch (task.dtype) {
    case DType::kF32: return AttendRowsDim<float>(task);
    case DType::kF16: return AttendRowsDim<hwy::float16_t>(task);
    case DType::kBF16: return AttendRowsDim<hwy::bfloat16_t>(task);
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

void SetTargetForTest(int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

}  // namespace pagekv::kernels
#endif  // HWY_ONCE
