#include "layout/float16.h"

#include <cpuid.h>
#include <immintrin.h>

#include <cmath>
#include <random>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

bool IsNanF16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

TEST(Float16Test, EveryF16RoundTripsThroughF32) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = F16ToF32(bits);
    if (IsNanF16(bits)) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(IsNanF16(F32ToF16(f)));
      continue;
    }
    EXPECT_EQ(F32ToF16(f), bits) << "h=" << h;
  }
}

__attribute__((target("f16c"))) uint16_t HardwareF32ToF16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float HardwareF16ToF32(uint16_t h) { return _cvtsh_ss(h); }

bool HasF16c() {  // CPUID leaf 1, ECX bit 29 (clang 14 has no "f16c" in __builtin_cpu_supports)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}

TEST(Float16Test, MatchesF16cHardwareOnRandomAndEdgeValues) {
  if (!HasF16c()) GTEST_SKIP() << "no F16C on this CPU";
  std::mt19937 rng(42);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 1'000'000; ++i) {
    const float f = F32FromBits(bits(rng));
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToF16(f), HardwareF32ToF16(f)) << f;
  }
  // Around the subnormal, rounding and overflow thresholds.
  for (float f : {65504.0f, 65519.99f, 65520.0f, 6.1035156e-05f, 5.9604645e-08f, 2.9802322e-08f,
                  2.9802326e-08f, -0.0f, 1e-10f, 3.0e-05f}) {
    EXPECT_EQ(F32ToF16(f), HardwareF32ToF16(f)) << f;
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    if (IsNanF16(static_cast<uint16_t>(h))) continue;
    ASSERT_EQ(F32Bits(F16ToF32(static_cast<uint16_t>(h))),
              F32Bits(HardwareF16ToF32(static_cast<uint16_t>(h))));
  }
}

// Reference: the nearest bf16 by comparing both neighbours in double.
uint16_t ReferenceBF16(float f) {
  const uint32_t u = F32Bits(f);
  const auto lo = static_cast<uint16_t>(u >> 16);
  const auto hi = static_cast<uint16_t>(lo + 1);
  const double dlo = std::fabs(static_cast<double>(BF16ToF32(lo)) - f);
  const double dhi = std::fabs(static_cast<double>(BF16ToF32(hi)) - f);
  if ((u & 0xffffu) == 0) return lo;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) ? hi : lo;
}

TEST(BFloat16Test, RoundsToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 1'000'000; ++i) {
    const float f = F32FromBits(bits(rng));
    if (std::isnan(f) || std::isinf(f) || std::fabs(f) > 3.3e38f) continue;
    ASSERT_EQ(F32ToBF16(f), ReferenceBF16(f)) << f;
  }
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(std::nanf("")))));
  EXPECT_EQ(BF16ToF32(F32ToBF16(1.0f)), 1.0f);
}

}  // namespace
}  // namespace pagekv
