#include "pagekv/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

namespace pagekv {
namespace {

constexpr std::string_view kAccepted =
    "use a whole number of bytes or a number with a unit: B, KiB, MiB, GiB, TiB "
    "(x1024) or KB, MB, GB, TB (x1000), e.g. 24GiB or 512MiB";

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

Result<int64_t> ParseByteSize(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError("byte size '" + std::string(text) + "': " + std::string(why) +
                                "; " + std::string(kAccepted));
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty()) return bad("empty");

  size_t i = 0;
  bool seen_digit = false;
  bool seen_dot = false;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) {
    if (s[i] == '.') {
      if (seen_dot) return bad("more than one decimal point");
      seen_dot = true;
    } else {
      seen_digit = true;
    }
    ++i;
  }
  if (!seen_digit) {
    return bad(!s.empty() && s[0] == '-' ? "negative sizes are not allowed" : "no number");
  }
  std::string_view number = s.substr(0, i);
  std::string_view unit_text = s.substr(i);
  while (!unit_text.empty() && std::isspace(static_cast<unsigned char>(unit_text.front()))) {
    unit_text.remove_prefix(1);
  }
  const std::string unit = Lower(unit_text);

  long double multiplier = 0;
  if (unit.empty() || unit == "b") multiplier = 1;
  else if (unit == "kib" || unit == "k" || unit == "ki") multiplier = 1024.0L;
  else if (unit == "mib" || unit == "m" || unit == "mi") multiplier = 1024.0L * 1024;
  else if (unit == "gib" || unit == "g" || unit == "gi") multiplier = 1024.0L * 1024 * 1024;
  else if (unit == "tib" || unit == "t" || unit == "ti") multiplier = 1024.0L * 1024 * 1024 * 1024;
  else if (unit == "kb") multiplier = 1e3L;
  else if (unit == "mb") multiplier = 1e6L;
  else if (unit == "gb") multiplier = 1e9L;
  else if (unit == "tb") multiplier = 1e12L;
  else return bad("unknown unit '" + std::string(unit_text) + "'");

  if (seen_dot && multiplier == 1) return bad("a fractional number of bytes");

  if (!seen_dot) {
    // Exact integer path: digits times an integer multiplier, overflow-checked.
    int64_t value = 0;
    for (char c : number) {
      if (__builtin_mul_overflow(value, int64_t{10}, &value) ||
          __builtin_add_overflow(value, int64_t{c - '0'}, &value)) {
        return bad("larger than 2^63 - 1 bytes");
      }
    }
    int64_t result = 0;
    if (__builtin_mul_overflow(value, static_cast<int64_t>(multiplier), &result)) {
      return bad("larger than 2^63 - 1 bytes");
    }
    return result;
  }
  const long double value = std::strtold(std::string(number).c_str(), nullptr) * multiplier;
  if (!(value < 9.2e18L)) return bad("larger than 2^63 - 1 bytes");
  return static_cast<int64_t>(std::floor(value));
}

std::string FormatBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024 && bytes > -1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  int unit = 0;
  while ((value >= 1024.0 || value <= -1024.0) && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  return buf;
}

}  // namespace pagekv
