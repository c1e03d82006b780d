// Scalar quantized-row codecs (quantize.h).
#include "layout/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "layout/float16.h"

namespace pagekv::quant {

void EncodeInt8Row(const float* x, int32_t n, std::byte* row) {
  float amax = 0.0f;
  for (int32_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  // The smallest f16 >= amax / 127, so no value needs clamping (rounding to
  // nearest could land below it: by up to 3% where f16 is subnormal).
  const float want = amax / 127.0f;
  uint16_t s16 = F32ToF16(want);
  if (F16ToF32(s16) < want) ++s16;  // the next f16 up (positive, finite)
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

}  // namespace pagekv::quant
