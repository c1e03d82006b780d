// Scalar quantized-row codecs (quantize.h).
#include "layout/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "layout/float16.h"

namespace pagekv::quant {
uint16_t ScaleAtLeast(float want) {
  uint16_t s16 = F32ToF16(want);
  if (F16ToF32(s16) < want) ++s16;  // the next f16 up (positive, finite)
  return s16;
}

void HadamardInPlace(float* x, int32_t n) {
  for (int32_t len = 1; len < n; len <<= 1) {
    for (int32_t i = 0; i < n; i += 2 * len) {
      for (int32_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for (int32_t i = 0; i < n; ++i) x[i] *= norm;
}

void EncodeInt8Row(const float* x, int32_t n, std::byte* row) {
  float amax = 0.0f;
  for (int32_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  // The smallest f16 >= amax / 127, so no value needs clamping (rounding to
  // nearest could land below it: by up to 3% where f16 is subnormal).
  const uint16_t s16 = ScaleAtLeast(amax / 127.0f);
  const float s = F16ToF32(s16);
  for (int32_t i = 0; i < n; ++i) {
    const float q = s > 0.0f ? std::nearbyint(x[i] / s) : 0.0f;  // round half to even (the default mode)
    row[i] = static_cast<std::byte>(static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
  }
  std::memcpy(row + n, &s16, 2);
}

float Int8RowScale(const std::byte* row, int32_t n) {
  uint16_t s16;
  std::memcpy(&s16, row + n, 2);
  return F16ToF32(s16);
}

void DecodeInt8Row(const std::byte* row, int32_t n, float* x) {
  const float s = Int8RowScale(row, n);
  for (int32_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int8_t>(row[i])) * s;
}

uint8_t F32ToFp8(float x, bool e4m3) {
  const int mant_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const float max = e4m3 ? 448.0f : 57344.0f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  float a = std::fabs(x);
  if (!(a == a)) a = 0.0f;  // NaN: not produced by the encoder's inputs; map to 0
  a = std::min(a, max);
  const int min_exp = 1 - bias;  // the smallest normal exponent
  int e;
  std::frexp(a, &e);             // a = f * 2^e, f in [0.5, 1)
  e -= 1;                        // a = g * 2^e, g in [1, 2)
  if (a == 0.0f || e < min_exp) e = min_exp;  // subnormal range: fixed exponent
  // Round a / 2^(e - mant_bits) to an integer: the code's significand.
  const float step = std::ldexp(1.0f, e - mant_bits);
  auto q = static_cast<int>(std::nearbyint(a / step));
  const int one = 1 << mant_bits;
  if (q >= 2 * one) {  // rounded up into the next binade
    q >>= 1;
    ++e;
  }
  int exp_field, mant_field;
  if (q < one) {  // subnormal (or zero)
    exp_field = 0;
    mant_field = q;
  } else {
    exp_field = e + bias;
    mant_field = q - one;
  }
  uint8_t code = static_cast<uint8_t>(sign | (exp_field << mant_bits) | mant_field);
  // Saturate: E4M3's 0x7F is NaN and E5M2's exponent 31 is Inf/NaN.
  const uint8_t top = e4m3 ? 0x7E : 0x7B;
  if ((code & 0x7F) > top) code = static_cast<uint8_t>(sign | top);
  return code;
}

float Fp8ToF32(uint8_t c, bool e4m3) {
  if (e4m3) {
    const auto bits = static_cast<uint16_t>(((c & 0x80) << 8) | ((c & 0x7F) << 7));
    return F16ToF32(bits) * 256.0f;
  }
  return F16ToF32(static_cast<uint16_t>(c << 8));
}

void EncodeFp8Row(const float* x, int32_t n, bool e4m3, std::byte* row) {
  float amax = 0.0f;
  for (int32_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint16_t s16 = ScaleAtLeast(amax / (e4m3 ? 448.0f : 57344.0f));
  const float s = F16ToF32(s16);
  for (int32_t i = 0; i < n; ++i) row[i] = static_cast<std::byte>(s > 0.0f ? F32ToFp8(x[i] / s, e4m3) : 0);
  std::memcpy(row + n, &s16, 2);
}

void DecodeFp8Row(const std::byte* row, int32_t n, bool e4m3, float* x) {
  const float s = Int8RowScale(row, n);  // the same trailing f16 scale
  for (int32_t i = 0; i < n; ++i) x[i] = Fp8ToF32(static_cast<uint8_t>(row[i]), e4m3) * s;
}

namespace {

// The (scale, minimum) of values spanning [lo, hi], as f16 bits.
void Int4Params(float lo, float hi, uint16_t& s16, uint16_t& m16) {
  m16 = F32ToF16(lo);
  const float m = F16ToF32(m16);
  // The range from the stored minimum: the top code must reach hi.
  s16 = ScaleAtLeast(std::max(0.0f, hi - m) / 15.0f);
}

uint8_t Int4Code(float x, float s, float m) {
  const float q = s > 0.0f ? std::nearbyint((x - m) / s) : 0.0f;
  return static_cast<uint8_t>(std::clamp(q, 0.0f, 15.0f));
}

void PutNibble(std::byte* codes, int32_t i, uint8_t c) {
  auto& b = reinterpret_cast<uint8_t&>(codes[i / 2]);
  b = (i % 2 == 0) ? static_cast<uint8_t>((b & 0xF0) | c) : static_cast<uint8_t>((b & 0x0F) | (c << 4));
}

uint8_t GetNibble(const std::byte* codes, int32_t i) {
  const auto b = static_cast<uint8_t>(codes[i / 2]);
  return (i % 2 == 0) ? (b & 0x0F) : (b >> 4);
}

float F16At(const std::byte* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}

}  // namespace

int64_t Int4ValueRowBytes(int32_t d) { return d / 2 + 4; }
int64_t Int4KeyGroupBytes(int32_t g, int32_t d) { return int64_t{g} * d / 2 + 4 * int64_t{d}; }

void EncodeInt4ValueRow(const float* x, int32_t d, std::byte* row) {
  float lo = x[0], hi = x[0];
  for (int32_t i = 1; i < d; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  uint16_t s16, m16;
  Int4Params(lo, hi, s16, m16);
  const float s = F16ToF32(s16), m = F16ToF32(m16);
  for (int32_t i = 0; i < d; ++i) PutNibble(row, i, Int4Code(x[i], s, m));
  std::memcpy(row + d / 2, &s16, 2);
  std::memcpy(row + d / 2 + 2, &m16, 2);
}

void Int4ValueParams(const std::byte* row, int32_t d, float& scale, float& min) {
  scale = F16At(row + d / 2);
  min = F16At(row + d / 2 + 2);
}

void DecodeInt4ValueRow(const std::byte* row, int32_t d, float* x) {
  float s, m;
  Int4ValueParams(row, d, s, m);
  for (int32_t i = 0; i < d; ++i) x[i] = static_cast<float>(GetNibble(row, i)) * s + m;
}

void EncodeInt4KeyGroup(const float* x, int32_t g, int32_t d, std::byte* group) {
  std::byte* params = group + int64_t{g} * d / 2;
  for (int32_t c = 0; c < d; ++c) {
    float lo = x[c], hi = x[c];
    for (int32_t t = 1; t < g; ++t) {
      lo = std::min(lo, x[int64_t{t} * d + c]);
      hi = std::max(hi, x[int64_t{t} * d + c]);
    }
    uint16_t s16, m16;
    Int4Params(lo, hi, s16, m16);
    const float s = F16ToF32(s16), m = F16ToF32(m16);
    for (int32_t t = 0; t < g; ++t) PutNibble(group + int64_t{t} * d / 2, c, Int4Code(x[int64_t{t} * d + c], s, m));
    std::memcpy(params + 2 * c, &s16, 2);          // the d scales
    std::memcpy(params + 2 * (d + c), &m16, 2);    // then the d minimums
  }
}

void Int4KeyParams(const std::byte* group, int32_t g, int32_t d, int32_t c, float& scale, float& min) {
  const std::byte* params = group + int64_t{g} * d / 2;
  scale = F16At(params + 2 * c);
  min = F16At(params + 2 * (d + c));
}

void DecodeInt4KeyGroup(const std::byte* group, int32_t g, int32_t d, float* x) {
  for (int32_t c = 0; c < d; ++c) {
    float s, m;
    Int4KeyParams(group, g, d, c, s, m);
    for (int32_t t = 0; t < g; ++t) {
      x[int64_t{t} * d + c] = static_cast<float>(GetNibble(group + int64_t{t} * d / 2, c)) * s + m;
    }
  }
}

}  // namespace pagekv::quant
