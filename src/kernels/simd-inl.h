// SIMD helpers shared by the Highway kernels (attention, matmul), compiled
// once per target: include this from a file that includes
// <hwy/foreach_target.h>, after <hwy/highway.h>.
#if defined(PAGEKV_KERNELS_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_SIMD_INL_H_
#undef PAGEKV_KERNELS_SIMD_INL_H_
#else
#define PAGEKV_KERNELS_SIMD_INL_H_
#endif

#include <hwy/highway.h>

#include <type_traits>

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Loads a vector of T (float, float16_t, bfloat16_t) as f32 lanes.
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

// Sums of four vectors at once, out[i] = sum of the lanes of v[i]. A
// horizontal sum per vector costs ~log2(lanes) shuffle+add pairs each; here
// two interleave levels leave [sum a, sum b, sum c, sum d] per 128-bit block
// for all four vectors together, and halving adds the blocks: ~13 ops for
// four sums on AVX-512 instead of ~36. REQUIRES: at least 4 lanes.
#if HWY_TARGET != HWY_SCALAR
template <class D>
HWY_INLINE void AddBlocksAndStore(D d, hn::Vec<D> v, float* HWY_RESTRICT out) {
  if constexpr (hn::MaxLanes(D()) <= 4) {
    hn::StoreU(v, d, out);
  } else {
    const hn::Half<D> dh;
    AddBlocksAndStore(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)), out);
  }
}

template <class DF>
HWY_INLINE void Sum4(DF df, hn::Vec<DF> a, hn::Vec<DF> b, hn::Vec<DF> c, hn::Vec<DF> e, float* HWY_RESTRICT out) {
  // Per block: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, e.
  const auto ab = hn::Add(hn::InterleaveLower(df, a, b), hn::InterleaveUpper(df, a, b));
  const auto ce = hn::Add(hn::InterleaveLower(df, c, e), hn::InterleaveUpper(df, c, e));
  // 64-bit interleave: [ab0, ab1, ce0, ce1] + [ab2, ab3, ce2, ce3] = per block [a, b, c, e].
  const hn::Repartition<double, DF> d64;
  const auto lo = hn::BitCast(df, hn::InterleaveLower(d64, hn::BitCast(d64, ab), hn::BitCast(d64, ce)));
  const auto hi = hn::BitCast(df, hn::InterleaveUpper(d64, hn::BitCast(d64, ab), hn::BitCast(d64, ce)));
  AddBlocksAndStore(df, hn::Add(lo, hi), out);
}
#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // PAGEKV_KERNELS_SIMD_INL_H_ toggle
