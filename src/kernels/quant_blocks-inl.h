// The ggml block formats of kernels/weight_formats.h decoded in registers,
// for the weight products (matmul.cc, int8_dot-inl.h): per sub-block a
// scale and a bias such that each element's value is u * scale + bias with
// u its small unsigned integer, and u of consecutive elements as f32
// vectors. The scalar DecodeWeights of weight_formats.cc is the reference
// every use is tested against.
//
// Include from a file that includes <hwy/foreach_target.h>.
#if defined(PAGEKV_KERNELS_QUANT_BLOCKS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_QUANT_BLOCKS_INL_H_
#undef PAGEKV_KERNELS_QUANT_BLOCKS_INL_H_
#else
#define PAGEKV_KERNELS_QUANT_BLOCKS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/weight_formats.h"
#include "layout/float16.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Elements per block and per sub-block (the span of one scale).
template <WeightType kType>
struct QuantTraits {
  static constexpr int kElems = kType == WeightType::kQ2_K || kType == WeightType::kQ3_K || kType == WeightType::kQ4_K ||
                                        kType == WeightType::kQ5_K || kType == WeightType::kQ6_K
                                    ? 256
                                    : 32;
  static constexpr int kSub = kType == WeightType::kQ4_K || kType == WeightType::kQ5_K || kElems == 32 ? 32 : 16;
};

// An f16 scale as f32: one vcvtph2ps where the target has F16C (a software
// conversion costs ~10 instructions, as much as decoding the block).
HWY_INLINE float HalfAt(const std::byte* p) {
#if HWY_TARGET != HWY_SCALAR
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::GetLane(hn::PromoteTo(d1, hn::LoadU(dh1, reinterpret_cast<const hwy::float16_t*>(p))));
#else
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
#endif
}

// Per sub-block scale and bias, so that element value = u * scale + bias
// with u the element's small unsigned integer (weight_formats.h has the
// layouts; its scalar DecodeWeights is the reference).
template <WeightType kType>
HWY_INLINE void Scales(const std::byte* b, float* HWY_RESTRICT scale, float* HWY_RESTRICT bias) {
  const auto* u = reinterpret_cast<const uint8_t*>(b);
  if constexpr (kType == WeightType::kQ8_0) {
    scale[0] = HalfAt(b);
    bias[0] = 0;
  } else if constexpr (kType == WeightType::kQ4_0 || kType == WeightType::kQ5_0) {
    scale[0] = HalfAt(b);
    bias[0] = -(kType == WeightType::kQ4_0 ? 8.0f : 16.0f) * scale[0];
  } else if constexpr (kType == WeightType::kQ4_1 || kType == WeightType::kQ5_1) {
    scale[0] = HalfAt(b);
    bias[0] = HalfAt(b + 2);
  } else if constexpr (kType == WeightType::kQ2_K) {
    const float d = HalfAt(b + 80), dmin = HalfAt(b + 82);
    for (int i = 0; i < 16; ++i) {
      scale[i] = d * static_cast<float>(u[i] & 0xF);
      bias[i] = -dmin * static_cast<float>(u[i] >> 4);
    }
  } else if constexpr (kType == WeightType::kQ3_K) {
    const uint8_t* s = u + 96;
    const float d = HalfAt(b + 108);
    for (int i = 0; i < 16; ++i) {
      const int low = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
      const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      scale[i] = d * static_cast<float>((low | (high << 4)) - 32);
      bias[i] = -4.0f * scale[i];  // u carries the high bit as +4: value = (u - 4) * scale
    }
  } else if constexpr (kType == WeightType::kQ4_K || kType == WeightType::kQ5_K) {
    const float d = HalfAt(b), dmin = HalfAt(b + 2);
    const uint8_t* sc = u + 4;
    for (int j = 0; j < 8; ++j) {
      int sv, mv;
      if (j < 4) {
        sv = sc[j] & 63;
        mv = sc[j + 4] & 63;
      } else {
        sv = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        mv = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
      }
      scale[j] = d * static_cast<float>(sv);
      bias[j] = -dmin * static_cast<float>(mv);
    }
  } else if constexpr (kType == WeightType::kQ6_K) {
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = HalfAt(b + 208);
    for (int i = 0; i < 16; ++i) {
      scale[i] = d * static_cast<float>(sc[i]);
      bias[i] = -32.0f * scale[i];
    }
  }
}

// u of elements [e, e + lanes) of block b, as f32, decoded in registers.
// e is a multiple of the vector width, which divides 16.
template <WeightType kType, class DF>
HWY_INLINE hn::Vec<DF> Elements(DF df, const std::byte* b, int e) {
  const hn::Rebind<uint8_t, DF> du8;
  const hn::Rebind<int8_t, DF> di8;
  const hn::Rebind<uint32_t, DF> du32;
  const hn::Rebind<int32_t, DF> di32;
  const auto* u = reinterpret_cast<const uint8_t*>(b);
  auto bytes = [&](const uint8_t* p) { return hn::PromoteTo(du32, hn::LoadU(du8, p)); };
  const auto nib = hn::Set(du32, 0xF);
  hn::Vec<decltype(du32)> v;
  if constexpr (kType == WeightType::kQ8_0) {
    return hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, reinterpret_cast<const int8_t*>(b + 2 + e))));
  } else if constexpr (kType == WeightType::kQ4_0 || kType == WeightType::kQ4_1 || kType == WeightType::kQ5_0 ||
                       kType == WeightType::kQ5_1) {
    constexpr bool kMin = kType == WeightType::kQ4_1 || kType == WeightType::kQ5_1;
    constexpr bool kFive = kType == WeightType::kQ5_0 || kType == WeightType::kQ5_1;
    const uint8_t* qs = u + (kMin ? 4 : 2) + (kFive ? 4 : 0);
    v = bytes(qs + (e & 15));
    v = e < 16 ? hn::And(v, nib) : hn::ShiftRight<4>(v);
    if constexpr (kFive) {
      uint32_t qh;
      std::memcpy(&qh, b + (kMin ? 4 : 2), 4);
      const auto bit = hn::And(hn::Set(du32, qh) >> hn::Iota(du32, static_cast<uint32_t>(e)), hn::Set(du32, 1));
      v = hn::Or(v, hn::ShiftLeft<4>(bit));
    }
  } else if constexpr (kType == WeightType::kQ2_K || kType == WeightType::kQ3_K) {
    const int half = e / 128, s = (e % 128) / 32, l = e % 32;
    const uint8_t* qs = u + (kType == WeightType::kQ2_K ? 16 : 32);
    v = hn::And(hn::ShiftRightSame(bytes(qs + half * 32 + l), 2 * s), hn::Set(du32, 3));
    if constexpr (kType == WeightType::kQ3_K) {
      const auto h = hn::And(hn::ShiftRightSame(bytes(u + l), half * 4 + s), hn::Set(du32, 1));
      v = hn::Or(v, hn::ShiftLeft<2>(h));
    }
  } else if constexpr (kType == WeightType::kQ4_K || kType == WeightType::kQ5_K) {
    constexpr bool kFive = kType == WeightType::kQ5_K;
    const int j = e / 64, upper = (e % 64) / 32, l = e % 32;
    v = hn::And(hn::ShiftRightSame(bytes(u + (kFive ? 48 : 16) + j * 32 + l), 4 * upper), nib);
    if constexpr (kFive) {
      const auto h = hn::And(hn::ShiftRightSame(bytes(u + 16 + l), 2 * j + upper), hn::Set(du32, 1));
      v = hn::Or(v, hn::ShiftLeft<4>(h));
    }
  } else if constexpr (kType == WeightType::kQ6_K) {
    const int half = e / 128, k = (e % 128) / 32, l = e % 32;
    const auto lo = hn::And(hn::ShiftRightSame(bytes(u + half * 64 + (k & 1) * 32 + l), (k >> 1) * 4), nib);
    const auto hi = hn::And(hn::ShiftRightSame(bytes(u + 128 + half * 32 + l), 2 * k), hn::Set(du32, 3));
    v = hn::Or(lo, hn::ShiftLeft<4>(hi));
  }
  return hn::ConvertTo(df, hn::BitCast(di32, v));
}

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
