// Overflow-checked integer arithmetic for size computations.
//
// Every byte count PageKV derives from user-supplied geometry goes through
// these helpers, so a huge num_blocks or head_dim gives a clear error instead
// of a wrapped-around allocation size.
#pragma once

#include <cstdint>
#include <optional>

namespace pagekv {

// a * b, or nullopt when the product does not fit in int64_t.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// a + b, or nullopt when the sum does not fit in int64_t.
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// Product of all factors, or nullopt on overflow.
inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  }
  return out;
}

// Smallest multiple of `align` that is >= value. REQUIRES: align > 0, value >= 0.
inline constexpr int64_t RoundUp(int64_t value, int64_t align) {
  return (value + align - 1) / align * align;
}

// ceil(a / b) for a >= 0, b > 0.
inline constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline constexpr bool IsPowerOfTwo(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace pagekv
