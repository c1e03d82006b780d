// The attention kernel's rows-in-lanes path (prefill tasks with at least a
// vector of query rows), compiled once per target. Include from a file that
// includes <hwy/foreach_target.h>, after <hwy/highway.h>.
#if defined(PAGEKV_KERNELS_ROWS_IN_LANES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_ROWS_IN_LANES_INL_H_
#undef PAGEKV_KERNELS_ROWS_IN_LANES_INL_H_
#else
#define PAGEKV_KERNELS_ROWS_IN_LANES_INL_H_
#endif

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/attention_kernel.h"
#include "kernels/kv_rows-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// --- Rows in lanes (many rows: prefill) -----------------------------------
// With as many rows as a vector has lanes, the task runs transposed: one
// vector holds one token's score for N rows, so the scores are N-row
// outer-product updates (a broadcast K element times a vector of q^T), the
// softmax state (max, sum, rescale) is element-wise across rows, and P.V is
// a broadcast V element times a vector of probabilities. No horizontal sum
// anywhere, and each block's K and V rows are converted to f32 once for all
// of the task's rows. Rows past R in the last tile are zero queries with
// limit 0 (masked out, never written back).

// Largest head_dim the lanes path takes (its transposed state lives in a
// per-thread scratch sized for it); larger ones use AttendRowsT.
constexpr int32_t kLanesMaxHeadDim = 512;
// Tokens converted to f32 at a time: 16 rows of K and V at head_dim 128 are
// 16 KiB, in L1 beside q^T; a whole 128-token block (128 KiB) would not be.
constexpr int32_t kLanesSub = 16;

struct LanesScratch {
  std::vector<float> qt, at, kf, vf, st;  // q^T and acc^T per row tile; the block's K, V in f32; scores
};

template <class DF, typename T>
void AttendRowsLanesT(DF df, const RowTask& task) {
  using V = hn::Vec<DF>;
  const hn::RebindToSigned<DF> di;
  const int32_t N = static_cast<int32_t>(hn::Lanes(df));
  const int32_t d = task.head_dim, R = task.rows, bl = task.block_len;
  const int32_t tiles = (R + N - 1) / N;
  const int64_t row_bytes = static_cast<int64_t>(d) * sizeof(T);
  const int64_t v_stride = task.v_slab_stride > 0 ? task.v_slab_stride : task.slab_stride;
  thread_local LanesScratch sc;
  sc.qt.resize(static_cast<size_t>(tiles) * d * N);
  sc.at.resize(sc.qt.size());
  sc.kf.resize(static_cast<size_t>(kLanesSub) * d);
  sc.vf.resize(sc.kf.size());
  sc.st.resize(static_cast<size_t>(kLanesSub) * N);
  float* HWY_RESTRICT qt = sc.qt.data();
  float* HWY_RESTRICT at = sc.at.data();
  float* HWY_RESTRICT kf = sc.kf.data();
  float* HWY_RESTRICT vf = sc.vf.data();
  float* HWY_RESTRICT st = sc.st.data();
  // Transposed state: qt/at[tile][j][lane], m/l/limit per tile as vectors.
  HWY_ALIGN float m_in[kMaxRows], l_in[kMaxRows];
  HWY_ALIGN int32_t lim[kMaxRows], beg[kMaxRows];
  int64_t max_limit = 0;
  for (int32_t r = 0; r < tiles * N; ++r) {
    const bool real = r < R;
    for (int32_t j = 0; j < d; ++j) {
      const size_t at_ij = (static_cast<size_t>(r / N) * d + j) * N + r % N;
      qt[at_ij] = real ? task.q[static_cast<int64_t>(r) * d + j] : 0.0f;
      at[at_ij] = real ? task.acc[static_cast<int64_t>(r) * d + j] : 0.0f;
    }
    m_in[r] = real ? task.m[r] : -std::numeric_limits<float>::infinity();
    l_in[r] = real ? task.l[r] : 0.0f;
    const int64_t limit = real ? std::min(task.limit[r], task.tok_end) : 0;
    lim[r] = static_cast<int32_t>(limit);
    beg[r] = real && task.begin != nullptr ? static_cast<int32_t>(task.begin[r]) : 0;
    max_limit = std::max(max_limit, limit);
  }
  const V neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
  // Attention weights: each sub-block's exps are relative to the max after
  // that sub-block; at the block's end they are brought to the block's max.
  HWY_ALIGN float sub_max[kMaxRows * (kMaxBlockLen / kLanesSub)];
  for (int64_t start = task.tok_begin; start < max_limit; start += bl) {
    const int64_t n_block = std::min<int64_t>(bl, max_limit - start);
    const int64_t block = ToInt(task.blocks[start / bl]);
    const std::byte* k_block = task.k_region + block * task.slab_stride;
    const std::byte* v_block = task.v_region + block * v_stride;
    // Sub-blocks of kLanesSub tokens: their K and V rows in f32 stay in L1
    // while every row tile uses them.
    for (int64_t sub = 0; sub < n_block; sub += kLanesSub) {
      const int64_t n = std::min<int64_t>(kLanesSub, n_block - sub);
      const int64_t pos = start + sub;  // position of the sub-block's first token
      const std::byte* k = k_block + sub * row_bytes;
      const std::byte* v = v_block + sub * row_bytes;
      const hn::ScalableTag<float> dw;  // conversion at full width, whatever width the rows take
      const int32_t NW = static_cast<int32_t>(hn::Lanes(dw));
      for (int64_t t = 0; t < n; ++t) {
        const T* kr = RowAt<T>(k, t, row_bytes);
        const T* vr = RowAt<T>(v, t, row_bytes);
        int32_t j = 0;
        for (; j + NW <= d; j += NW) {
          hn::StoreU(LoadRow(dw, kr + j), dw, kf + t * d + j);
          hn::StoreU(LoadRow(dw, vr + j), dw, vf + t * d + j);
        }
        for (; j < d; ++j) {
          kf[t * d + j] = hn::GetLane(LoadRow(hn::CappedTag<float, 1>(), kr + j));
          vf[t * d + j] = hn::GetLane(LoadRow(hn::CappedTag<float, 1>(), vr + j));
        }
      }
      for (int32_t tile = 0; tile < tiles; ++tile) {
        const float* HWY_RESTRICT q_t = qt + static_cast<size_t>(tile) * d * N;
        float* HWY_RESTRICT a_t = at + static_cast<size_t>(tile) * d * N;
        const auto limit = hn::LoadU(di, lim + tile * N);
        const auto first = hn::LoadU(di, beg + tile * N);  // sliding windows: the first position each row sees
        if (hn::AllFalse(di, hn::Gt(limit, hn::Set(di, static_cast<int32_t>(pos)))) ||
            hn::AllFalse(di, hn::Gt(hn::Set(di, static_cast<int32_t>(pos + n)), first))) {
          continue;  // no row sees these tokens
        }
        // 1. Scores, 8 tokens at a time: st[t] = sum_j q^T[j] * k[t][j].
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
          V sc8[8];
          for (int i = 0; i < 8; ++i) sc8[i] = hn::Zero(df);
          for (int32_t j = 0; j < d; ++j) {
            const V qv = hn::LoadU(df, q_t + j * N);
            for (int i = 0; i < 8; ++i) sc8[i] = hn::MulAdd(qv, hn::Set(df, kf[(t + i) * d + j]), sc8[i]);
          }
          for (int i = 0; i < 8; ++i) hn::StoreU(sc8[i], df, st + (t + i) * N);
        }
        for (; t < n; ++t) {
          V s0 = hn::Zero(df);
          for (int32_t j = 0; j < d; ++j) s0 = hn::MulAdd(hn::LoadU(df, q_t + j * N), hn::Set(df, kf[t * d + j]), s0);
          hn::StoreU(s0, df, st + t * N);
        }
        // 2. Online softmax across rows: mask positions at or past each
        // row's limit, new max, rescale factor, probabilities in place.
        V bmax = neg_inf;
        for (t = 0; t < n; ++t) {
          const auto at = hn::Set(di, static_cast<int32_t>(pos + t));
          const auto after = hn::Set(di, static_cast<int32_t>(pos + t + 1));
          const auto seen = hn::RebindMask(df, hn::And(hn::Gt(limit, at), hn::Gt(after, first)));
          const V sv = hn::IfThenElse(seen, hn::LoadU(df, st + t * N), neg_inf);
          hn::StoreU(sv, df, st + t * N);
          bmax = hn::Max(bmax, sv);
        }
        const V m_old = hn::LoadU(df, m_in + tile * N);
        const V m_new = hn::Max(m_old, bmax);
        // Rescale: 0 for a row's first seen tokens (nothing to keep), 1 for
        // a row that has still seen nothing, exp(m_old - m_new) otherwise.
        const auto had = hn::Ne(m_old, neg_inf);
        const auto live = hn::Ne(m_new, neg_inf);
        const V corr = hn::IfThenElse(
            had, hn::CallExp(df, hn::Sub(hn::IfThenElse(had, m_old, hn::Zero(df)), hn::IfThenElse(had, m_new, hn::Zero(df)))),
            hn::IfThenElseZero(hn::Not(live), hn::Set(df, 1.0f)));
        V sum = hn::Zero(df);
        for (t = 0; t < n; ++t) {
          const V sv = hn::LoadU(df, st + t * N);
          // A row that has seen nothing yet has m_new = -inf: its lanes'
          // -inf - -inf is NaN, kept out of Exp (NaN to int is undefined on
          // the emulated target).
          const auto seen = hn::Ne(sv, neg_inf);
          const V e = hn::IfThenElseZero(seen, hn::CallExp(df, hn::IfThenElseZero(seen, hn::Sub(sv, m_new))));
          hn::StoreU(e, df, st + t * N);
          sum = hn::Add(sum, e);
        }
        hn::StoreU(hn::MulAdd(hn::LoadU(df, l_in + tile * N), corr, sum), df, l_in + tile * N);
        hn::StoreU(m_new, df, m_in + tile * N);
        if (task.weights_out != nullptr) {  // exp(s - max after this sub-block); rescaled at the block's end
          for (int32_t i = 0; i < N && tile * N + i < R; ++i) {
            const int32_t r = tile * N + i;
            const int64_t valid = std::clamp<int64_t>(lim[r] - pos, 0, n);
            sub_max[r * (kMaxBlockLen / kLanesSub) + sub / kLanesSub] = m_in[r];
            if (valid == 0) continue;
            float* w = task.weights_out + r * task.weights_stride + (pos - task.tok_begin);
            for (int64_t x = 0; x < valid; ++x) w[x] = st[x * N + i];
          }
        }
        // 3. acc^T[j] = acc^T[j] * corr + sum_t p[t] * v[t][j], 8 columns at a time.
        int32_t j = 0;
        for (; j + 8 <= d; j += 8) {
          V a[8];
          for (int i = 0; i < 8; ++i) a[i] = hn::Mul(hn::LoadU(df, a_t + (j + i) * N), corr);
          for (t = 0; t < n; ++t) {
            const V pv = hn::LoadU(df, st + t * N);
            for (int i = 0; i < 8; ++i) a[i] = hn::MulAdd(pv, hn::Set(df, vf[t * d + j + i]), a[i]);
          }
          for (int i = 0; i < 8; ++i) hn::StoreU(a[i], df, a_t + (j + i) * N);
        }
        for (; j < d; ++j) {
          V a0 = hn::Mul(hn::LoadU(df, a_t + j * N), corr);
          for (t = 0; t < n; ++t) a0 = hn::MulAdd(hn::LoadU(df, st + t * N), hn::Set(df, vf[t * d + j]), a0);
          hn::StoreU(a0, df, a_t + j * N);
        }
      }
    }
    if (task.weights_out != nullptr) {
      // The block's weights relative to its final max m_b, and m_b.
      for (int32_t r = 0; r < R; ++r) {
        const int64_t valid = std::clamp<int64_t>(lim[r] - start, 0, n_block);
        if (valid == 0) continue;
        float* w = task.weights_out + r * task.weights_stride + (start - task.tok_begin);
        for (int64_t sub = 0; sub < valid; sub += kLanesSub) {
          const float m_sub = sub_max[r * (kMaxBlockLen / kLanesSub) + sub / kLanesSub];
          if (m_sub == m_in[r]) continue;
          const float f = std::exp(m_sub - m_in[r]);
          for (int64_t x = sub; x < std::min<int64_t>(valid, sub + kLanesSub); ++x) w[x] *= f;
        }
        task.block_max_out[r * task.block_max_stride + (start - task.tok_begin) / bl] = m_in[r];
      }
    }
  }
  for (int32_t r = 0; r < R; ++r) {
    task.m[r] = m_in[r];
    task.l[r] = l_in[r];
    for (int32_t j = 0; j < d; ++j) task.acc[static_cast<int64_t>(r) * d + j] = at[(static_cast<size_t>(r / N) * d + j) * N + r % N];
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // PAGEKV_KERNELS_ROWS_IN_LANES_INL_H_ toggle
