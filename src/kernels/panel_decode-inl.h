// The block formats' panels (PackedWeights, matmul_internal.h's layouts)
// decoded to the 16 rows' f32 panel [cols][16], per target: what the
// decoded-panel path of matmul.cc multiplies for many tokens.
//
// Include from a file that includes <hwy/foreach_target.h>.
#if defined(PAGEKV_KERNELS_PANEL_DECODE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEKV_KERNELS_PANEL_DECODE_INL_H_
#undef PAGEKV_KERNELS_PANEL_DECODE_INL_H_
#else
#define PAGEKV_KERNELS_PANEL_DECODE_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/matmul_internal.h"
#include "layout/float16.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---- q8_0 in panels (PackedWeights; the layout in kQ8PanelBlockBytes'
// comment). out = the 16 rows' f32 panel [cols][16]: per k-pair, each
// row's two bytes split (the even byte is the low one, sign-extended by a
// shift pair) and scaled.
void DecodeQ8Panel(const std::byte* panel, int64_t cols, float* HWY_RESTRICT out) {
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<int16_t, decltype(df)> d16;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / kQ8Block; ++b) {
    const std::byte* blk = panel + b * kQ8PanelBlockBytes;
    const auto* scales = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* pairs = reinterpret_cast<const int16_t*>(blk + 2 * kPanelRows);
    for (int j = 0; j < kQ8Block / 2; ++j) {
      float* even = out + (b * kQ8Block + 2 * j) * kPanelRows;
      for (int r = 0; r < kPanelRows; r += n) {
        const auto v = hn::LoadU(d16, pairs + j * kPanelRows + r);
        const auto s = hn::PromoteTo(df, hn::LoadU(dh, scales + r));
        const auto lo = hn::ShiftRight<8>(hn::ShiftLeft<8>(v)), hi = hn::ShiftRight<8>(v);
        hn::StoreU(hn::Mul(hn::ConvertTo(df, hn::PromoteTo(d32, lo)), s), df, even + r);
        hn::StoreU(hn::Mul(hn::ConvertTo(df, hn::PromoteTo(d32, hi)), s), df, even + kPanelRows + r);
      }
    }
  }
}

// ---- q4_k and q5_k in panels (the layouts in kQ4KPanelBlockBytes' and
// kQ5KPanelBlockBytes' comments; kFifth: q5_k's fifth bits). out =
// the 16 rows' f32 panel [cols][16]: per sub-block the rows' d * sc and
// dmin * m, per pair of columns each row's two nibbles.
template <bool kFifth>
void DecodeKPanel(const std::byte* panel, int64_t cols, float* out) {
  constexpr int64_t kBlockBytes = kFifth ? kQ5KPanelBlockBytes : kQ4KPanelBlockBytes;
#if HWY_TARGET == HWY_SCALAR
  if constexpr (kFifth) {  // element by element on the scalar target, as DecodeQ6KPanel
    for (int64_t b = 0; b < cols / 256; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kBlockBytes);
      for (int n = 0; n < kPanelRows; ++n) {
        uint16_t h;
        std::memcpy(&h, blk + 2 * n, 2);
        const float d = F16ToF32(h);
        std::memcpy(&h, blk + 32 + 2 * n, 2);
        const float dmin = F16ToF32(h);
        for (int e = 0; e < 256; ++e) {
          const int q = ((blk[KNibbleByte(true, e, n)] >> Q4KNibbleShift(e)) & 0x0F) |
                        ((blk[Q5KFifthByte(e, n)] >> FifthShift(e)) & 1) << 4;
          out[(b * 256 + e) * kPanelRows + n] = d * static_cast<float>(blk[64 + 16 * (e / 32) + n]) * static_cast<float>(q) -
                                                dmin * static_cast<float>(blk[192 + 16 * (e / 32) + n]);
        }
      }
    }
    return;
  }
#endif
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<uint32_t, decltype(df)> d32u;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / 256; ++b) {
    const std::byte* blk = panel + b * kBlockBytes;
    const auto* d = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* dmin = d + kPanelRows;
    const auto* u8 = reinterpret_cast<const uint8_t*>(blk);
    for (int sub = 0; sub < 8; ++sub) {
      for (int r = 0; r < kPanelRows; r += n) {
        const auto sc = hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8, u8 + 64 + 16 * sub + r)));
        const auto m = hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8, u8 + 192 + 16 * sub + r)));
        const auto scale = hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, d + r)), sc);
        const auto bias = hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, dmin + r)), m);
        for (int j = 0; j < 8; ++j) {  // the sub-block's four-column groups
          const int quad = 8 * sub + j;
          // Rows r.. : byte 2n (columns 4 quad and + 2), 2n + 1 (+ 1 and + 3).
          hn::Vec<decltype(d8)> e0, e1;  // bytes 2n and 2n + 1 of rows r..
          hn::LoadInterleaved2(d8, u8 + KNibbleByte(kFifth, 4 * quad, r), e0, e1);
          const auto nib = hn::Set(d32u, 0x0F);
          const auto b0 = hn::PromoteTo(d32u, e0), b1 = hn::PromoteTo(d32u, e1);
          float* col = out + (b * 256 + 4 * quad) * kPanelRows + r;
          auto q0 = hn::And(b0, nib), q1 = hn::And(b1, nib), q2 = hn::ShiftRight<4>(b0), q3 = hn::ShiftRight<4>(b1);
          if constexpr (kFifth) {
            hn::Vec<decltype(d8)> h0, h1;
            hn::LoadInterleaved2(d8, u8 + Q5KFifthByte(4 * quad, r), h0, h1);
            const auto ha = hn::PromoteTo(d32u, h0), hc = hn::PromoteTo(d32u, h1);
            const int sh = j % 4;  // the fifth bits' place for this step
            const auto one = hn::Set(d32u, 1);
            auto bit = [&](auto high, int at) { return hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(high, sh + at), one)); };
            q0 = hn::Or(q0, bit(ha, 0));
            q1 = hn::Or(q1, bit(hc, 0));
            q2 = hn::Or(q2, bit(ha, 4));
            q3 = hn::Or(q3, bit(hc, 4));
          }
          const auto u0 = hn::ConvertTo(df, hn::BitCast(d32, q0));
          const auto u1 = hn::ConvertTo(df, hn::BitCast(d32, q1));
          const auto u2 = hn::ConvertTo(df, hn::BitCast(d32, q2));
          const auto u3 = hn::ConvertTo(df, hn::BitCast(d32, q3));
          hn::StoreU(hn::MulSub(scale, u0, bias), df, col);
          hn::StoreU(hn::MulSub(scale, u1, bias), df, col + kPanelRows);
          hn::StoreU(hn::MulSub(scale, u2, bias), df, col + 2 * kPanelRows);
          hn::StoreU(hn::MulSub(scale, u3, bias), df, col + 3 * kPanelRows);
        }
      }
    }
  }
}

// ---- q4_0 / q4_1 / q5_0 / q5_1 in panels (NibbleFormat's comment). out =
// the 16 rows' f32 panel [cols][16]: per block each row's d * (q - offset) + m.
template <WeightType kType>
void DecodeNibblePanel(const std::byte* panel, int64_t cols, float* out) {
  constexpr NibbleFormat f = NibbleFormatOf(kType);
#if HWY_TARGET == HWY_SCALAR
  // Element by element on the scalar target, as DecodeQ6KPanel.
  for (int64_t b = 0; b < cols / 32; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * f.BlockBytes());
    for (int n = 0; n < kPanelRows; ++n) {
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      float m = 0.0f;
      if constexpr (f.min) {
        std::memcpy(&h, blk + 32 + 2 * n, 2);
        m = F16ToF32(h);
      }
      for (int e = 0; e < 32; ++e) {
        out[(b * 32 + e) * kPanelRows + n] = d * static_cast<float>(NibbleValue(f, blk, e, n) - f.offset) + m;
      }
    }
  }
  return;
#endif
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<uint32_t, decltype(df)> d32u;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / 32; ++b) {
    const std::byte* blk = panel + b * f.BlockBytes();
    const auto* d = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* u8 = reinterpret_cast<const uint8_t*>(blk);
    for (int r = 0; r < kPanelRows; r += n) {
      const auto scale = hn::PromoteTo(df, hn::LoadU(dh, d + r));
      // d * q + bias, bias = m or -offset * d.
      const auto bias = f.min ? hn::PromoteTo(df, hn::LoadU(dh, d + kPanelRows + r))
                              : hn::Mul(scale, hn::Set(df, -static_cast<float>(f.offset)));
      for (int quad = 0; quad < 8; ++quad) {
        hn::Vec<decltype(d8)> l0, l1;  // bytes 2n and 2n + 1 of rows r..
        hn::LoadInterleaved2(d8, u8 + f.NibbleByte(4 * quad, r), l0, l1);
        const auto nib = hn::Set(d32u, 0x0F);
        auto a = hn::PromoteTo(d32u, l0), c = hn::PromoteTo(d32u, l1);
        auto q0 = hn::And(a, nib), q1 = hn::And(c, nib), q2 = hn::ShiftRight<4>(a), q3 = hn::ShiftRight<4>(c);
        if constexpr (f.fifth) {
          hn::Vec<decltype(d8)> h0, h1;
          hn::LoadInterleaved2(d8, u8 + f.FifthByte(4 * quad, r), h0, h1);
          const auto ha = hn::PromoteTo(d32u, h0), hc = hn::PromoteTo(d32u, h1);
          const int sh = quad % 4;  // the fifth bits' place for this step
          const auto one = hn::Set(d32u, 1);
          auto bit = [&](auto high, int at) { return hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(high, sh + at), one)); };
          q0 = hn::Or(q0, bit(ha, 0));
          q1 = hn::Or(q1, bit(hc, 0));
          q2 = hn::Or(q2, bit(ha, 4));
          q3 = hn::Or(q3, bit(hc, 4));
        }
        float* col = out + (b * 32 + 4 * quad) * kPanelRows + r;
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q0)), bias), df, col);
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q1)), bias), df, col + kPanelRows);
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q2)), bias), df, col + 2 * kPanelRows);
        hn::StoreU(hn::MulAdd(scale, hn::ConvertTo(df, hn::BitCast(d32, q3)), bias), df, col + 3 * kPanelRows);
      }
    }
  }
}

// ---- q6_k in panels (the layout in kQ6KPanelBlockBytes' comment). out =
// the 16 rows' f32 panel [cols][16]: per four columns each row's low
// nibbles and high bits, times d x the group's scale, less 32 of them.
void DecodeQ6KPanel(const std::byte* panel, int64_t cols, float* out) {
#if HWY_TARGET == HWY_SCALAR
  // The vector form below left the panel unwritten on the scalar target
  // (GCC 12, the first matrix of a test, and not when instrumented; not
  // understood); the scalar target reads the layout element by element.
  for (int64_t b = 0; b < cols / 256; ++b) {
    const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kQ6KPanelBlockBytes);
    for (int n = 0; n < kPanelRows; ++n) {
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      for (int e = 0; e < 256; ++e) {
        const int low = (blk[Q6KLowByte(e, n)] >> (4 * ((e % 4) / 2))) & 0x0F;
        const int high = (blk[Q6KHighByte(e, n)] >> Q6KHighShift(e)) & 3;
        const float scale = d * static_cast<float>(static_cast<int8_t>(blk[Q6KScaleByte(e / 16, n)]));
        out[(b * 256 + e) * kPanelRows + n] = scale * static_cast<float>(low | high << 4) - scale * 32.0f;
      }
    }
  }
  return;
#endif
  const hn::CappedTag<float, kPanelRows> df;
  const int n = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<int8_t, decltype(df)> d8s;
  const hn::Rebind<uint32_t, decltype(df)> d32u;
  const hn::Rebind<int32_t, decltype(df)> d32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  for (int64_t b = 0; b < cols / 256; ++b) {
    const std::byte* blk = panel + b * kQ6KPanelBlockBytes;
    const auto* d = reinterpret_cast<const hwy::float16_t*>(blk);
    const auto* u8 = reinterpret_cast<const uint8_t*>(blk);
    const auto* s8 = reinterpret_cast<const int8_t*>(blk);
    for (int g = 0; g < 16; ++g) {  // 16-element groups: four four-column steps
      for (int r = 0; r < kPanelRows; r += n) {
        const auto scale = hn::Mul(hn::PromoteTo(df, hn::LoadU(dh, d + r)),
                                   hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8s, s8 + Q6KScaleByte(g, r)))));
        const auto offset = hn::Mul(scale, hn::Set(df, 32.0f));
        for (int j = 0; j < 4; ++j) {
          const int quad = 4 * g + j;
          hn::Vec<decltype(d8)> l0, l1, h0, h1;  // bytes 2n and 2n + 1 of rows r..
          hn::LoadInterleaved2(d8, u8 + Q6KLowByte(4 * quad, r), l0, l1);
          hn::LoadInterleaved2(d8, u8 + Q6KHighByte(4 * quad, r), h0, h1);
          const auto a = hn::PromoteTo(d32u, l0), c = hn::PromoteTo(d32u, l1);
          const auto ha = hn::PromoteTo(d32u, h0), hc = hn::PromoteTo(d32u, h1);
          const int sh = 2 * (quad % 2);  // the high bits' place for this group
          const auto three = hn::Set(d32u, 3), nib = hn::Set(d32u, 0x0F);
          auto q6 = [&](auto low, auto high, int at) {
            const auto hi2 = hn::And(hn::ShiftRightSame(high, sh + at), three);
            return hn::ConvertTo(df, hn::BitCast(d32, hn::Or(low, hn::ShiftLeft<4>(hi2))));
          };
          float* col = out + (b * 256 + 4 * quad) * kPanelRows + r;
          hn::StoreU(hn::MulSub(scale, q6(hn::And(a, nib), ha, 0), offset), df, col);
          hn::StoreU(hn::MulSub(scale, q6(hn::And(c, nib), hc, 0), offset), df, col + kPanelRows);
          hn::StoreU(hn::MulSub(scale, q6(hn::ShiftRight<4>(a), ha, 4), offset), df, col + 2 * kPanelRows);
          hn::StoreU(hn::MulSub(scale, q6(hn::ShiftRight<4>(c), hc, 4), offset), df, col + 3 * kPanelRows);
        }
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
