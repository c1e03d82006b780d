// Reading K and V rows in the attention kernels, compiled once per target:
// the row element types (f32, f16, bf16, int8, fp8 codes), their loads as
// f32 lanes, row addressing and the next block's prefetch. Include from a
// file that includes <hwy/foreach_target.h>, after <hwy/highway.h>.
#if defined(PAGEKV_KERNELS_KV_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_KV_ROWS_INL_H_
#undef PAGEKV_KERNELS_KV_ROWS_INL_H_
#else
#define PAGEKV_KERNELS_KV_ROWS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Prefetch of the next block's rows into L2: the scores of block b fetch
// K(b + 1) (a score tile's rows at its start), the accumulation of block b
// V(b + 1) (one row per token). Hardware prefetchers stop at page boundaries
// and blocks are scattered, so nothing else fetches ahead; half a block of
// distance, spreading a tile's lines over its steps and whole-block bursts
// all measured slower (docs/PERFORMANCE.md). When several passes read one
// slab (groups of rows), each pass prefetches its share (`part` of `parts`)
// of every row, so the requests keep the same rate through all of them.
struct Prefetcher {
  const std::byte* slab = nullptr;  // null: nothing to prefetch
  int64_t rows = 0;
  int64_t row_bytes = 0;
  // The byte range [begin, end) of each row this one fetches, in whole
  // lines; end < 0: the whole row. Set by Part, once per pass, so Row does
  // no division.
  int64_t begin = 0, end = -1;

  Prefetcher Part(int32_t p, int32_t ps) const {
    Prefetcher out = *this;
    const int64_t lines = (row_bytes + 63) / 64;
    out.begin = 64 * (lines * p / ps);
    out.end = 64 * (lines * (p + 1) / ps);
    return out;
  }
  HWY_INLINE void Row(int64_t t) const {
    if (slab == nullptr || t >= rows) return;
    const std::byte* p = slab + t * row_bytes;
    const int64_t stop = end < 0 ? row_bytes : end;
    for (int64_t o = begin; o < stop; o += 64) __builtin_prefetch(p + o, 0, 2);  // to L2
  }
};

// The f16 scale that ends an int8 or fp8 row (layout/quantize.h), and any
// other f16 parameter: one lane through the target's conversion (F16C's
// vcvtph2ps where the CPU has it), not the branchy software one.
HWY_INLINE float Int8Scale(const std::byte* p) {
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::GetLane(hn::PromoteTo(d1, hn::LoadU(dh1, reinterpret_cast<const hwy::float16_t*>(p))));
}

// Element j of row t of a slab whose rows are row_bytes apart.
template <typename T>
HWY_INLINE const T* RowAt(const std::byte* slab, int64_t t, int64_t row_bytes) {
  return reinterpret_cast<const T*>(slab + t * row_bytes);
}

// FP8 codes, one byte each (layout/quantize.h).
struct E4M3 {
  uint8_t code;
};
struct E5M2 {
  uint8_t code;
};
template <typename T>
constexpr bool kScaledRows = std::is_same_v<T, int8_t> || std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;

// Loads lanes of a row as f32: plain types convert, int8 values and fp8
// codes decode without their row scale (the caller applies it once per
// token). fp8: the code's bits are placed in an f16 (E5M2 is an f16's top
// byte; E4M3's exponent sits 8 below: the factor 256 is folded into the
// row scale, once per token, not applied here).
template <class DF, typename T>
HWY_INLINE hn::Vec<DF> LoadRow(DF df, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>) {
    const hn::Rebind<uint8_t, DF> du8;
    const hn::Rebind<uint16_t, DF> du16;
    const hn::Rebind<hwy::float16_t, DF> df16;
    const auto c = hn::PromoteTo(du16, hn::LoadU(du8, reinterpret_cast<const uint8_t*>(p)));
    if constexpr (std::is_same_v<T, E5M2>) {
      return hn::PromoteTo(df, hn::BitCast(df16, hn::ShiftLeft<8>(c)));
    } else {
      const auto bits = hn::Or(hn::ShiftLeft<8>(hn::And(c, hn::Set(du16, 0x80))),
                               hn::ShiftLeft<7>(hn::And(c, hn::Set(du16, 0x7F))));
      return hn::PromoteTo(df, hn::BitCast(df16, bits));  // value / 256
    }
  } else if constexpr (std::is_same_v<T, int8_t>) {
    const hn::Rebind<int32_t, DF> di32;
    const hn::Rebind<int8_t, DF> di8;
    return hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, p)));
  } else {
    return LoadF32(df, p);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // PAGEKV_KERNELS_KV_ROWS_INL_H_ toggle
