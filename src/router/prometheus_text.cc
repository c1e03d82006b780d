#include "router/prometheus_text.h"

#include <cmath>
#include <cstdlib>

namespace pagekv::router {
namespace {

bool NameChar(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' || (!first && c >= '0' && c <= '9');
}

template <typename F>
void ForEachSample(std::string_view text, F&& f) {
  size_t at = 0;
  while (at < text.size()) {
    size_t eol = text.find('\n', at);
    if (eol == std::string_view::npos) eol = text.size();
    if (std::optional<PromSample> s = ParsePromLine(text.substr(at, eol - at))) {
      if (f(*s)) return;
    }
    at = eol + 1;
  }
}

}  // namespace

std::optional<PromSample> ParsePromLine(std::string_view line) {
  size_t i = 0;
  auto skip_space = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  };
  skip_space();
  if (i >= line.size() || line[i] == '#') return std::nullopt;
  PromSample s;
  const size_t start = i;
  while (i < line.size() && NameChar(line[i], i == start)) ++i;
  if (i == start) return std::nullopt;
  s.name = std::string(line.substr(start, i - start));
  skip_space();
  if (i < line.size() && line[i] == '{') {
    ++i;
    for (;;) {
      skip_space();
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      const size_t ls = i;
      while (i < line.size() && NameChar(line[i], i == ls)) ++i;
      if (i == ls) return std::nullopt;
      std::string key(line.substr(ls, i - ls));
      skip_space();
      if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') return std::nullopt;
      i += 2;
      std::string value;
      bool closed = false;
      while (i < line.size()) {
        const char c = line[i++];
        if (c == '"') {
          closed = true;
          break;
        }
        if (c == '\\') {
          if (i >= line.size()) return std::nullopt;
          const char e = line[i++];
          value += e == 'n' ? '\n' : e;
        } else {
          value += c;
        }
      }
      if (!closed) return std::nullopt;
      s.labels.emplace_back(std::move(key), std::move(value));
      skip_space();
      if (i < line.size() && line[i] == ',') {
        ++i;
        continue;
      }
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      return std::nullopt;
    }
  }
  skip_space();
  const size_t vs = i;
  while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
  if (i == vs) return std::nullopt;
  const std::string v(line.substr(vs, i - vs));
  if (v == "+Inf" || v == "-Inf" || v == "NaN") {
    s.value = v == "NaN" ? std::nan("") : (v[0] == '-' ? -HUGE_VAL : HUGE_VAL);
  } else {
    char* end = nullptr;
    s.value = std::strtod(v.c_str(), &end);
    if (end != v.c_str() + v.size()) return std::nullopt;
  }
  return s;
}

std::optional<double> SeriesValue(std::string_view text, std::string_view name) {
  std::optional<double> out;
  ForEachSample(text, [&](const PromSample& s) {
    if (s.name != name) return false;
    out = s.value;
    return true;
  });
  return out;
}

std::optional<std::string> LabelValue(std::string_view text, std::string_view name, std::string_view label) {
  std::optional<std::string> out;
  ForEachSample(text, [&](const PromSample& s) {
    if (s.name != name) return false;
    for (const auto& [k, v] : s.labels) {
      if (k == label) out = v;
    }
    return true;
  });
  return out;
}

}  // namespace pagekv::router
