// The GPU kernels' 8-bit KV arithmetic (kv_codec.h), run on the host: every
// function the store and attention kernels call is __host__ __device__, so
// this test checks the kernels' own code against the host's normative
// encoders (layout/quantize.cc) and an independent decoder without needing a
// GPU (it runs wherever nvcc builds it, CI included). On the device the same
// code runs with IEEE f32 division and rintf (nvcc's defaults: no fast-math
// flags in this project), so what holds here holds there; kv_store_test.cu
// checks the stored bytes on a GPU when one is lent.
//
// Cases:
// - the f16 scale for every positive finite f16 value, its neighbours and
//   the midpoints between consecutive f16 values, and 200,000 log-uniform
//   values from 1e-12 to 1e6;
// - F32ToFp8 (both formats) at every code's value, each midpoint between
//   neighbouring codes (the ties), one f32 step either side of it, signed
//   zeros, NaN, infinities, values past the top code, and 400,000 random
//   values over 2^-40 .. 2^20 of both signs;
// - every code decoded, against the host decoder and a decoder written from
//   the format's fields;
// - whole rows (int8, E4M3, E5M2; lengths 1 .. 256) encoded the kernel's way
//   and by the host's row encoders, byte for byte: random rows, rows with an
//   outlier, all-zero rows, rows small enough for a subnormal f16 scale,
//   rows of exact ties (k + 1/2 times the scale).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/kv_codec.h"
#include "layout/float16.h"
#include "layout/quantize.h"

namespace {

namespace codec = pagekv::cuda::codec;
namespace quant = pagekv::quant;

long failures = 0;
long checks = 0;

void Fail(const char* what, float x, unsigned got, unsigned want) {
  ++failures;
  if (failures <= 20) std::fprintf(stderr, "FAIL %s: x = %a: got 0x%x, want 0x%x\n", what, x, got, want);
}

void CheckScale(float want) {
  ++checks;
  const unsigned got = codec::ScaleAtLeast(want);
  const unsigned ref = quant::ScaleAtLeast(want);
  if (got != ref) Fail("ScaleAtLeast", want, got, ref);
}

void CheckFp8(float x) {
  for (const bool e4m3 : {true, false}) {
    ++checks;
    const unsigned got = codec::F32ToFp8(x, e4m3);
    const unsigned ref = quant::F32ToFp8(x, e4m3);
    if (got != ref) Fail(e4m3 ? "F32ToFp8 e4m3" : "F32ToFp8 e5m2", x, got, ref);
  }
}

// A code's value from its sign, exponent and mantissa fields.
double FieldValue(uint8_t c, bool e4m3) {
  const int mant_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int e = (c & 0x7F) >> mant_bits, m = c & ((1 << mant_bits) - 1);
  const double frac = static_cast<double>(m) / (1 << mant_bits);
  const double mag = e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, e - bias);
  return (c & 0x80) ? -mag : mag;
}

bool Finite(uint8_t c, bool e4m3) { return (c & 0x7F) <= (e4m3 ? 0x7E : 0x7B); }

// A row encoded the way kv_store.cu's EncodeRow does it (the warp's max is
// exact, so its order does not matter), beside the host's row encoder.
void CheckRow(const std::vector<float>& x, int kind) {  // kind: 0 int8, 1 e4m3, 2 e5m2
  const int n = static_cast<int>(x.size());
  std::vector<std::byte> ref(static_cast<size_t>(n) + 2), got(static_cast<size_t>(n) + 2);
  float amax = 0.0f;
  for (float v : x) amax = fmaxf(amax, fabsf(v));
  const unsigned short s16 = codec::ScaleAtLeast(amax / codec::CodeTop(kind == 0, kind == 1));
  const float s = codec::ScaleValue(s16);
  for (int j = 0; j < n; ++j) {
    const uint8_t c = kind == 0 ? codec::Int8Code(x[static_cast<size_t>(j)], s)
                      : s > 0.0f ? codec::F32ToFp8(x[static_cast<size_t>(j)] / s, kind == 1)
                                 : 0;
    got[static_cast<size_t>(j)] = static_cast<std::byte>(c);
  }
  std::memcpy(got.data() + n, &s16, 2);
  if (kind == 0) {
    quant::EncodeInt8Row(x.data(), n, ref.data());
  } else {
    quant::EncodeFp8Row(x.data(), n, kind == 1, ref.data());
  }
  ++checks;
  for (int j = 0; j < n + 2; ++j) {
    if (got[static_cast<size_t>(j)] != ref[static_cast<size_t>(j)]) {
      const char* names[] = {"int8 row", "e4m3 row", "e5m2 row"};
      Fail(names[kind], j < n ? x[static_cast<size_t>(j)] : amax, static_cast<unsigned>(got[static_cast<size_t>(j)]),
           static_cast<unsigned>(ref[static_cast<size_t>(j)]));
      return;
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(20261205);

  // The f16 scale.
  CheckScale(0.0f);
  for (uint32_t b = 1; b < 0x7C00; ++b) {
    const float v = pagekv::F16ToF32(static_cast<uint16_t>(b));
    CheckScale(v);
    CheckScale(std::nextafter(v, 0.0f));
    CheckScale(std::nextafter(v, 1e30f));
    const float next = pagekv::F16ToF32(static_cast<uint16_t>(b + 1));
    if (std::isfinite(next)) CheckScale(v + (next - v) / 2);
  }
  std::uniform_real_distribution<double> log_scale(std::log(1e-12), std::log(1e6));
  for (int i = 0; i < 200000; ++i) CheckScale(static_cast<float>(std::exp(log_scale(rng))));

  // F32ToFp8 at the codes, the ties between them and around them.
  for (const bool e4m3 : {true, false}) {
    std::vector<double> values;
    for (int c = 0; c < 0x80; ++c) {
      if (Finite(static_cast<uint8_t>(c), e4m3)) values.push_back(FieldValue(static_cast<uint8_t>(c), e4m3));
    }
    for (size_t i = 0; i < values.size(); ++i) {
      for (const float sign : {1.0f, -1.0f}) {
        const auto v = static_cast<float>(values[i]);
        CheckFp8(sign * v);
        if (i + 1 < values.size()) {
          const auto mid = static_cast<float>((values[i] + values[i + 1]) / 2);
          CheckFp8(sign * mid);
          CheckFp8(sign * std::nextafter(mid, 0.0f));
          CheckFp8(sign * std::nextafter(mid, 1e30f));
        }
      }
    }
  }
  for (const float x : {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity(), 448.0f, 464.0f, 480.0f, 1e6f, 57344.0f, 61440.0f,
                        65536.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()}) {
    CheckFp8(x);
    CheckFp8(-x);
  }
  std::uniform_real_distribution<double> log_fp8(-40.0 * std::log(2.0), 20.0 * std::log(2.0));
  for (int i = 0; i < 400000; ++i) {
    const auto v = static_cast<float>(std::exp(log_fp8(rng)));
    CheckFp8((i & 1) ? -v : v);
  }

  // Every code decoded.
  for (uint32_t c = 0; c < 256; ++c) {
    ++checks;
    if (codec::DecodeInt8(c) != static_cast<float>(static_cast<int8_t>(c))) Fail("DecodeInt8", 0, c, c);
    for (const bool e4m3 : {true, false}) {
      if (!Finite(static_cast<uint8_t>(c), e4m3)) continue;
      const float got = e4m3 ? codec::DecodeE4M3Shifted(c) * codec::kE4M3Unshift : codec::DecodeE5M2(c);
      const float host = quant::Fp8ToF32(static_cast<uint8_t>(c), e4m3);
      const double fields = FieldValue(static_cast<uint8_t>(c), e4m3);
      ++checks;
      if (got != host || static_cast<double>(got) != fields) {
        ++failures;
        std::fprintf(stderr, "FAIL decode %s code 0x%02x: %a, host %a, fields %a\n", e4m3 ? "e4m3" : "e5m2", c, got, host,
                     fields);
      }
    }
  }

  // Whole rows.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> len(1, 256);
  for (int kind = 0; kind < 3; ++kind) {
    for (int r = 0; r < 3000; ++r) {
      const int n = r < 256 ? r + 1 : len(rng);
      std::vector<float> x(static_cast<size_t>(n));
      const int shape = r % 5;
      const float mag = shape == 3 ? 1e-6f : std::exp(normal(rng) * 3.0f);
      for (float& v : x) v = shape == 2 ? 0.0f : normal(rng) * mag;
      if (shape == 1) x[static_cast<size_t>(r) % x.size()] *= 300.0f;  // an outlier
      if (shape == 4 && kind == 0) {                                  // exact ties k + 1/2 under the row's scale
        const float s = codec::ScaleValue(codec::ScaleAtLeast(127.0f / 127.0f));
        for (size_t j = 0; j < x.size(); ++j) x[j] = (static_cast<float>(static_cast<int>(j % 250) - 125) + 0.5f) * s;
        x[0] = 127.0f * s;
      }
      CheckRow(x, kind);
    }
  }

  if (failures != 0) {
    std::fprintf(stderr, "%ld of %ld checks failed\n", failures, checks);
    return 1;
  }
  std::printf("kv codec (host run of the kernels' arithmetic): %ld checks, all equal to the host encoders\n", checks);
  return 0;
}
