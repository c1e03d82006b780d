// The weight formats' table and their normative scalar decoders
// (weight_formats.h). Written from the block layouts; checked against an
// independent decoder (the `gguf` Python package) by weight_formats_test.
#include "kernels/weight_formats.h"

#include <cstring>

#include "layout/float16.h"

namespace pagekv {
namespace {

constexpr WeightFormat kFormats[kNumWeightTypes] = {
    {"f32", 1, 4},      {"f16", 1, 2},      {"bf16", 1, 2},     {"q8_0", 32, 34},   {"q4_0", 32, 18},
    {"q4_1", 32, 20},   {"q5_0", 32, 22},   {"q5_1", 32, 24},   {"q2_k", 256, 84},  {"q3_k", 256, 110},
    {"q4_k", 256, 144}, {"q5_k", 256, 176}, {"q6_k", 256, 210},
};

float Half(const std::byte* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}

const uint8_t* U8(const std::byte* p) { return reinterpret_cast<const uint8_t*>(p); }

// q4_k / q5_k: the 6-bit scale and min of sub-block j (0..7) from 12 bytes.
void ScaleMinK4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void DecodeBlock(WeightType type, const std::byte* b, float* y) {
  switch (type) {
    case WeightType::kQ8_0: {
      const float d = Half(b);
      const auto* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j]);
      return;
    }
    case WeightType::kQ4_0:
    case WeightType::kQ4_1: {
      const bool has_min = type == WeightType::kQ4_1;
      const float d = Half(b);
      const float m = has_min ? Half(b + 2) : 0.0f;
      const uint8_t* qs = U8(b + (has_min ? 4 : 2));
      const int offset = has_min ? 0 : 8;
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>((qs[j] & 0xF) - offset) + m;
        y[j + 16] = d * static_cast<float>((qs[j] >> 4) - offset) + m;
      }
      return;
    }
    case WeightType::kQ5_0:
    case WeightType::kQ5_1: {
      const bool has_min = type == WeightType::kQ5_1;
      const float d = Half(b);
      const float m = has_min ? Half(b + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
      const uint8_t* qs = U8(b + (has_min ? 8 : 6));
      const int offset = has_min ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
        y[j] = d * static_cast<float>(lo - offset) + m;
        y[j + 16] = d * static_cast<float>(hi - offset) + m;
      }
      return;
    }
    case WeightType::kQ2_K: {
      const uint8_t* scales = U8(b);
      const uint8_t* q = U8(b + 16);
      const float d = Half(b + 80), dmin = Half(b + 82);
      int is = 0;
      for (int half = 0; half < 2; ++half, q += 32) {
        for (int shift = 0; shift < 8; shift += 2) {
          for (int part = 0; part < 2; ++part, ++is) {
            const float dl = d * static_cast<float>(scales[is] & 0xF), ml = dmin * static_cast<float>(scales[is] >> 4);
            for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[part * 16 + l] >> shift) & 3) - ml;
          }
        }
      }
      return;
    }
    case WeightType::kQ3_K: {
      const uint8_t* hmask = U8(b);
      const uint8_t* q = U8(b + 32);
      const uint8_t* s = U8(b + 96);
      const float d = Half(b + 108);
      // 16 6-bit scales: low 4 bits from bytes 0..7 (low nibbles, then high
      // nibbles), high 2 bits from bytes 8..11 (2 bits each, in order).
      int scales[16];
      for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
        const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        scales[i] = (low | (high << 4)) - 32;
      }
      int is = 0;
      uint8_t bit = 1;
      for (int half = 0; half < 2; ++half, q += 32) {
        for (int shift = 0; shift < 8; shift += 2, bit = static_cast<uint8_t>(bit << 1)) {
          for (int part = 0; part < 2; ++part, ++is) {
            const float dl = d * static_cast<float>(scales[is]);
            for (int l = 0; l < 16; ++l) {
              const int k = part * 16 + l;
              const int v = ((q[k] >> shift) & 3) - ((hmask[k] & bit) != 0 ? 0 : 4);
              *y++ = dl * static_cast<float>(v);
            }
          }
        }
      }
      return;
    }
    case WeightType::kQ4_K:
    case WeightType::kQ5_K: {
      const bool five = type == WeightType::kQ5_K;
      const float d = Half(b), dmin = Half(b + 2);
      const uint8_t* scales = U8(b + 4);
      const uint8_t* qh = U8(b + 16);
      const uint8_t* ql = U8(b + (five ? 48 : 16));
      for (int j = 0; j < 4; ++j, ql += 32) {  // 64 elements: two sub-blocks of 32
        uint8_t sc1, m1, sc2, m2;
        ScaleMinK4(2 * j, scales, sc1, m1);
        ScaleMinK4(2 * j + 1, scales, sc2, m2);
        const float d1 = d * sc1, min1 = dmin * m1, d2 = d * sc2, min2 = dmin * m2;
        for (int l = 0; l < 32; ++l) {
          const int h = five ? ((qh[l] >> (2 * j)) & 1) << 4 : 0;
          y[l] = d1 * static_cast<float>((ql[l] & 0xF) | h) - min1;
        }
        for (int l = 0; l < 32; ++l) {
          const int h = five ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0;
          y[32 + l] = d2 * static_cast<float>((ql[l] >> 4) | h) - min2;
        }
        y += 64;
      }
      return;
    }
    case WeightType::kQ6_K: {
      const uint8_t* ql = U8(b);
      const uint8_t* qh = U8(b + 128);
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = Half(b + 208);
      for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
          y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
          y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
          y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
        }
      }
      return;
    }
    case WeightType::kF32:
    case WeightType::kF16:
    case WeightType::kBF16:
      return;  // not block types; DecodeWeights handles them
  }
}

}  // namespace

const WeightFormat& FormatOf(WeightType type) { return kFormats[static_cast<int>(type)]; }

int64_t WeightRowBytes(WeightType type, int64_t cols) {
  const WeightFormat& f = FormatOf(type);
  return cols / f.block_elems * f.block_bytes;
}

void DecodeWeights(WeightType type, const std::byte* data, int64_t n, float* out) {
  switch (type) {
    case WeightType::kF32:
      std::memcpy(out, data, static_cast<size_t>(n) * 4);
      return;
    case WeightType::kF16:
    case WeightType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        out[i] = type == WeightType::kF16 ? F16ToF32(h) : BF16ToF32(h);
      }
      return;
    default: {
      const WeightFormat& f = FormatOf(type);
      for (int64_t b = 0; b < n / f.block_elems; ++b) DecodeBlock(type, data + b * f.block_bytes, out + b * f.block_elems);
    }
  }
}

void Q4KScaleMin(const std::byte* block, int j, uint8_t& sc, uint8_t& m) { ScaleMinK4(j, U8(block + 4), sc, m); }

}  // namespace pagekv
