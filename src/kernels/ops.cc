// The layer ops of ops.h, compiled for every Highway target and chosen at
// run time. Each loop runs whole vectors, then a scalar tail of the same
// arithmetic; the K / V encoders produce exactly the bytes of layout/'s
// scalar codecs (the division, rounding and conversions are the same IEEE
// operations lane by lane).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/ops.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>

#include "kernels/ops.h"
#include "kernels/simd-inl.h"
#include "layout/float16.h"
#include "layout/quantize.h"
#include "pagekv/kv_layout.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

void RmsNormImpl(const float* x, const float* weight, int64_t rows, int32_t width, float eps, float* out) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    float* o = out + r * width;
    auto acc0 = hn::Zero(df), acc1 = hn::Zero(df);
    int64_t i = 0;
    for (; i + 2 * N <= width; i += 2 * N) {
      const auto a = hn::LoadU(df, xr + i), b = hn::LoadU(df, xr + i + N);
      acc0 = hn::MulAdd(a, a, acc0);
      acc1 = hn::MulAdd(b, b, acc1);
    }
    for (; i + N <= width; i += N) {
      const auto a = hn::LoadU(df, xr + i);
      acc0 = hn::MulAdd(a, a, acc0);
    }
    float ss = Sum(df, hn::Add(acc0, acc1));
    for (; i < width; ++i) ss += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
    const auto vs = hn::Set(df, scale);
    i = 0;
    for (; i + N <= width; i += N) {
      hn::StoreU(hn::Mul(hn::LoadU(df, weight + i), hn::Mul(vs, hn::LoadU(df, xr + i))), df, o + i);
    }
    for (; i < width; ++i) o[i] = weight[i] * (scale * xr[i]);
  }
}

void AddBiasImpl(float* x, const float* bias, int64_t rows, int64_t width) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * width;
    int64_t j = 0;
    for (; j + N <= width; j += N) hn::StoreU(hn::Add(hn::LoadU(df, xr + j), hn::LoadU(df, bias + j)), df, xr + j);
    for (; j < width; ++j) xr[j] += bias[j];
  }
}

void AddInPlaceImpl(float* x, const float* y, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Add(hn::LoadU(df, x + i), hn::LoadU(df, y + i)), df, x + i);
  for (; i < n; ++i) x[i] += y[i];
}

void SwiGluImpl(float* gate, const float* up, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto one = hn::Set(df, 1.0f);
  // exp(-g) for -g in [-88, 88] (beyond, 1 + exp is 1 or its ratio to g is
  // below f32's resolution); NaN kept out of Exp, the ratio stays NaN.
  const auto lo = hn::Set(df, -88.0f), hi = hn::Set(df, 88.0f);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto g = hn::LoadU(df, gate + i);
    const auto ng = hn::IfThenElseZero(hn::Eq(g, g), hn::Min(hn::Max(hn::Neg(g), lo), hi));
    const auto silu = hn::Div(g, hn::Add(one, hn::CallExp(df, ng)));
    hn::StoreU(hn::Mul(silu, hn::LoadU(df, up + i)), df, gate + i);
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void GeluGluImpl(float* gate, const float* up, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto one = hn::Set(df, 1.0f);
  const auto c1 = hn::Set(df, -2.0f * 0.7978845608028654f), c3 = hn::Set(df, -2.0f * 0.7978845608028654f * 0.044715f);
  const auto lo = hn::Set(df, -88.0f), hi = hn::Set(df, 88.0f);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto g = hn::LoadU(df, gate + i);
    // -2u = g * (c1 + c3 g^2), clamped as SwiGLU's exponent; NaN kept out of Exp.
    const auto m2u = hn::Mul(g, hn::MulAdd(c3, hn::Mul(g, g), c1));
    const auto e = hn::IfThenElseZero(hn::Eq(g, g), hn::Min(hn::Max(m2u, lo), hi));
    const auto gelu = hn::Div(g, hn::Add(one, hn::CallExp(df, e)));
    hn::StoreU(hn::Mul(gelu, hn::LoadU(df, up + i)), df, gate + i);
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    const float m2u = std::min(88.0f, std::max(-88.0f, -2.0f * 0.7978845608028654f * (g + 0.044715f * g * g * g)));
    gate[i] = g / (1.0f + std::exp(m2u)) * up[i];
  }
}

void ScaleImpl(float* x, float s, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto vs = hn::Set(df, s);
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(df, x + i), vs), df, x + i);
  for (; i < n; ++i) x[i] *= s;
}

void RopeApplyImpl(float* x, int64_t rows, int32_t width, int32_t head_dim, int32_t rope_dims, bool halves,
                   const float* cos, const float* sin) {
  const DF df;
  const int32_t N = static_cast<int32_t>(hn::Lanes(df));
  const int32_t half = rope_dims / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* cs = cos + r * rope_dims;
    const float* sn = sin + r * rope_dims;
    for (int32_t h0 = 0; h0 < width; h0 += head_dim) {
      float* head = x + r * width + h0;
      int32_t i = 0;
      if (halves) {
        for (; i + N <= half; i += N) {
          const auto a = hn::LoadU(df, head + i), b = hn::LoadU(df, head + half + i);
          hn::StoreU(hn::MulAdd(a, hn::LoadU(df, cs + i), hn::Mul(b, hn::LoadU(df, sn + i))), df, head + i);
          hn::StoreU(hn::MulAdd(b, hn::LoadU(df, cs + half + i), hn::Mul(a, hn::LoadU(df, sn + half + i))), df,
                     head + half + i);
        }
        for (; i < half; ++i) {
          const float a = head[i], b = head[half + i];
          head[i] = a * cs[i] + b * sn[i];
          head[half + i] = b * cs[half + i] + a * sn[half + i];
        }
      } else {
#if HWY_TARGET != HWY_SCALAR
        for (; i + N <= rope_dims; i += N) {  // N even: whole pairs
          const auto v = hn::LoadU(df, head + i);
          hn::StoreU(hn::MulAdd(v, hn::LoadU(df, cs + i), hn::Mul(hn::Reverse2(df, v), hn::LoadU(df, sn + i))), df,
                     head + i);
        }
#endif
        for (; i < rope_dims; i += 2) {
          const float a = head[i], b = head[i + 1];
          head[i] = a * cs[i] + b * sn[i];
          head[i + 1] = b * cs[i + 1] + a * sn[i + 1];
        }
      }
    }
  }
}

// The orthonormal Hadamard transform (quant::HadamardInPlace's operations in
// its order: butterflies of span 1, 2, 4, ..., then the 1/sqrt(n) scale).
void Hadamard(float* x, int32_t n) {
  const DF df;
  const int32_t N = static_cast<int32_t>(hn::Lanes(df));
  for (int32_t len = 1; len < n; len <<= 1) {
    for (int32_t i = 0; i < n; i += 2 * len) {
      int32_t j = i;
      if (len >= N) {
        for (; j + N <= i + len; j += N) {
          const auto a = hn::LoadU(df, x + j), b = hn::LoadU(df, x + j + len);
          hn::StoreU(hn::Add(a, b), df, x + j);
          hn::StoreU(hn::Sub(a, b), df, x + j + len);
        }
      }
      for (; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  const auto vn = hn::Set(df, norm);
  int32_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(df, x + i), vn), df, x + i);
  for (; i < n; ++i) x[i] *= norm;
}

float AbsMax(const float* x, int32_t n) {
  const DF df;
  const int32_t N = static_cast<int32_t>(hn::Lanes(df));
  auto m = hn::Zero(df);
  int32_t i = 0;
  for (; i + N <= n; i += N) m = hn::Max(m, hn::Abs(hn::LoadU(df, x + i)));
  float amax = hn::GetLane(hn::MaxOfLanes(df, m));
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

void EncodeInt8(const float* x, int32_t n, std::byte* row) {
  const DF df;
  const int32_t N = static_cast<int32_t>(hn::Lanes(df));
  const uint16_t s16 = quant::ScaleAtLeast(AbsMax(x, n) / 127.0f);
  const float s = F16ToF32(s16);
  if (s > 0.0f) {
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<int8_t, DF> d8;
    const auto vs = hn::Set(df, s);
    const auto lo = hn::Set(di, -127), hi = hn::Set(di, 127);
    int32_t i = 0;
    for (; i + N <= n; i += N) {
      const auto q = hn::Min(hn::Max(hn::NearestInt(hn::Div(hn::LoadU(df, x + i), vs)), lo), hi);
      hn::StoreU(hn::DemoteTo(d8, q), d8, reinterpret_cast<int8_t*>(row + i));
    }
    for (; i < n; ++i) {
      const float q = std::nearbyint(x[i] / s);
      row[i] = static_cast<std::byte>(static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
    }
  } else {
    std::memset(row, 0, static_cast<size_t>(n));
  }
  std::memcpy(row + n, &s16, 2);
}

void EncodeFp8(const float* x, int32_t n, bool e4m3, std::byte* row) {
  const uint16_t s16 = quant::ScaleAtLeast(AbsMax(x, n) / (e4m3 ? 448.0f : 57344.0f));
  const float s = F16ToF32(s16);
  // The code conversion is a rounding of the f32's bits (quant::F32ToFp8),
  // one element at a time.
  for (int32_t i = 0; i < n; ++i) row[i] = static_cast<std::byte>(s > 0.0f ? quant::F32ToFp8(x[i] / s, e4m3) : 0);
  std::memcpy(row + n, &s16, 2);
}

void EncodeF16(const float* x, int64_t n, std::byte* dst) {
  int64_t i = 0;
#if (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)) || HWY_TARGET == HWY_NEON
  // Hardware conversion, round to nearest even (what F32ToF16 computes).
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const hn::Rebind<hwy::float16_t, DF> dh;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, x + i)), dh, reinterpret_cast<hwy::float16_t*>(dst + 2 * i));
  }
#endif
  for (; i < n; ++i) {
    const uint16_t h = F32ToF16(x[i]);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

void EncodeBf16(const float* x, int64_t n, std::byte* dst) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto u = hn::BitCast(du, hn::LoadU(df, x + i));
    const auto nan = hn::Gt(hn::BitCast(di, hn::And(u, hn::Set(du, 0x7fffffffu))), hn::Set(di, 0x7f800000));
    const auto rounded = hn::ShiftRight<16>(
        hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u)))));
    const auto quiet = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
    const auto bits = hn::BitCast(di, hn::IfThenElse(hn::RebindMask(du, nan), quiet, rounded));
    hn::StoreU(hn::DemoteTo(d16, bits), d16, reinterpret_cast<uint16_t*>(dst + 2 * i));
  }
  for (; i < n; ++i) {
    const uint16_t h = F32ToBF16(x[i]);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

void EncodeKvRowsImpl(const KvFormat& format, int32_t elems, const float* src, int64_t rows, std::byte* dst) {
  const int64_t n = rows * elems;
  if (format.IsKivi()) {
    EncodeF16(src, n, dst);
    return;
  }
  if (!format.IsPlainFloat()) {  // one scaled row per (token, head): int8 or fp8
    const int64_t row = FormatRowBytes(format, elems);
    std::vector<float> rotated(format.hadamard ? static_cast<size_t>(elems) : 0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = src + r * elems;
      if (format.hadamard) {  // the row is stored as H x (layout/quantize.h)
        std::copy(x, x + elems, rotated.begin());
        Hadamard(rotated.data(), elems);
        x = rotated.data();
      }
      if (format.dtype == DType::kInt8) {
        EncodeInt8(x, elems, dst + r * row);
      } else {
        EncodeFp8(x, elems, format.dtype == DType::kFP8E4M3, dst + r * row);
      }
    }
    return;
  }
  switch (format.dtype) {
    case DType::kF32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); break;
    case DType::kF16: EncodeF16(src, n, dst); break;
    default: EncodeBf16(src, n, dst); break;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagekv {
namespace kernels {
HWY_EXPORT(RmsNormImpl);
HWY_EXPORT(AddBiasImpl);
HWY_EXPORT(AddInPlaceImpl);
HWY_EXPORT(SwiGluImpl);
HWY_EXPORT(GeluGluImpl);
HWY_EXPORT(ScaleImpl);
HWY_EXPORT(RopeApplyImpl);
HWY_EXPORT(EncodeKvRowsImpl);
// The dispatches name the exported functions unqualified, from their own
// namespace: a build that compiles only the static target turns
// HWY_DYNAMIC_DISPATCH(F) into N_<target>::F.
void RmsNorm(const float* x, const float* weight, int64_t rows, int32_t width, float eps, float* out) {
  HWY_DYNAMIC_DISPATCH(RmsNormImpl)(x, weight, rows, width, eps, out);
}
void AddBias(float* x, const float* bias, int64_t rows, int64_t width) {
  HWY_DYNAMIC_DISPATCH(AddBiasImpl)(x, bias, rows, width);
}
void Add(float* x, const float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(AddInPlaceImpl)(x, y, n); }
void SwiGlu(float* gate, const float* up, int64_t n) { HWY_DYNAMIC_DISPATCH(SwiGluImpl)(gate, up, n); }
void GeluGlu(float* gate, const float* up, int64_t n) { HWY_DYNAMIC_DISPATCH(GeluGluImpl)(gate, up, n); }
void Scale(float* x, float s, int64_t n) { HWY_DYNAMIC_DISPATCH(ScaleImpl)(x, s, n); }
void RopeApply(float* x, int64_t rows, int32_t width, int32_t head_dim, int32_t rope_dims, bool halves,
               const float* cos, const float* sin) {
  HWY_DYNAMIC_DISPATCH(RopeApplyImpl)(x, rows, width, head_dim, rope_dims, halves, cos, sin);
}
void EncodeKv(const KvFormat& format, int32_t elems, const float* src, int64_t rows, std::byte* dst) {
  HWY_DYNAMIC_DISPATCH(EncodeKvRowsImpl)(format, elems, src, rows, dst);
}
}  // namespace kernels

void RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps, float* out) {
  kernels::RmsNorm(x, weight, rows, width, eps, out);
}

void AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width) {
  kernels::AddBias(x, bias, rows, width);
}

void AddInPlace(float* x, const float* y, int64_t n) { kernels::Add(x, y, n); }

void SwiGluInPlace(float* gate, const float* up, int64_t n) { kernels::SwiGlu(gate, up, n); }

void GeluGluInPlace(float* gate, const float* up, int64_t n) { kernels::GeluGlu(gate, up, n); }

void ScaleInPlace(float* x, float s, int64_t n) { kernels::Scale(x, s, n); }

Rope::Rope(RopeParams params) : p_(std::move(params)) {
  const int32_t half = p_.rope_dims / 2;
  freq_.assign(static_cast<size_t>(half), 0.0);
  mix_.assign(static_cast<size_t>(half), 0.0);
  for (int32_t i = 0; i < half; ++i) {
    double f = std::pow(static_cast<double>(p_.theta), -2.0 * i / p_.rope_dims);
    if (!p_.freq_divisors.empty()) f /= p_.freq_divisors[static_cast<size_t>(i)];
    freq_[static_cast<size_t>(i)] = f;
  }
  if (p_.yarn) {
    auto corr = [&](double rotations) {
      return p_.rope_dims * std::log(p_.yarn_orig_context / (rotations * 2 * std::numbers::pi)) /
             (2 * std::log(static_cast<double>(p_.theta)));
    };
    const double lo = std::max(0.0, std::floor(corr(32.0))), hi = std::min(p_.rope_dims - 1.0, std::ceil(corr(1.0)));
    for (int32_t i = 0; i < half; ++i) {
      mix_[static_cast<size_t>(i)] = 1.0 - std::clamp((i - lo) / std::max(0.001, hi - lo), 0.0, 1.0);
    }
    mscale_ = p_.yarn_attn_factor * (1.0 + 0.1 * std::log(1.0 / p_.freq_scale));
  }
}

void Rope::Tables(std::span<const int64_t> positions, float* cos, float* sin) const {
  const int32_t dims = p_.rope_dims, half = dims / 2;
  for (size_t r = 0; r < positions.size(); ++r) {
    const auto p = static_cast<double>(positions[r]);
    float* c = cos + r * static_cast<size_t>(dims);
    float* s = sin + r * static_cast<size_t>(dims);
    for (int32_t i = 0; i < half; ++i) {
      const double extrap = p * freq_[static_cast<size_t>(i)];
      const double interp = extrap * p_.freq_scale;
      const double angle =
          p_.yarn ? interp * (1 - mix_[static_cast<size_t>(i)]) + extrap * mix_[static_cast<size_t>(i)] : interp;
      const auto ci = static_cast<float>(std::cos(angle) * mscale_);
      const auto si = static_cast<float>(std::sin(angle) * mscale_);
      // Pair (a, b) -> (a cos - b sin, b cos + a sin): a's partner b comes
      // with -sin, b's partner a with +sin.
      const int32_t a = p_.halves ? i : 2 * i, b = p_.halves ? i + half : 2 * i + 1;
      c[a] = ci;
      c[b] = ci;
      s[a] = -si;
      s[b] = si;
    }
  }
}

void Rope::Apply(float* x, int64_t rows, int32_t width, const float* cos, const float* sin) const {
  kernels::RopeApply(x, rows, width, p_.head_dim, p_.rope_dims, p_.halves, cos, sin);
}

int64_t EncodedRowBytes(const KvFormat& format, int32_t elems) {
  return format.IsKivi() ? int64_t{2} * elems : FormatRowBytes(format, elems);
}

void EncodeKvRows(const KvFormat& format, int32_t elems, const float* src, int64_t rows, std::byte* dst) {
  kernels::EncodeKv(format, elems, src, rows, dst);
}

}  // namespace pagekv
#endif  // HWY_ONCE
