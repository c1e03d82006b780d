// Scalar quantized-row codecs (quantize.h).
#include "layout/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "layout/float16.h"

namespace pagekv::quant {
namespace {

// The smallest f16 >= want (0 for 0): a row scale that never needs clamping
// (rounding to nearest could land below it, by up to 3% where f16 is subnormal).
uint16_t ScaleAtLeast(float want) {
  uint16_t s16 = F32ToF16(want);
  if (F16ToF32(s16) < want) ++s16;  // the next f16 up (positive, finite)
  return s16;
}

}  // namespace

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

}  // namespace pagekv::quant
