// Reading a backend's /metrics (the Prometheus text exposition format,
// version 0.0.4): the router's load inputs.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pagekv::router {

// One sample line: `name{label="value",...} value [timestamp]`.
struct PromSample {
  std::string name;
  std::vector<std::pair<std::string, std::string>> labels;  // values unescaped (\\, \", \n)
  double value = 0;
};

// The sample on one line; nullopt for a comment, a blank line or a line
// that is not a well-formed sample (never reads past the line).
std::optional<PromSample> ParsePromLine(std::string_view line);

// The value of the first sample of `name` in `text`.
std::optional<double> SeriesValue(std::string_view text, std::string_view name);

// The value of `label` on the first sample of `name` in `text`.
std::optional<std::string> LabelValue(std::string_view text, std::string_view name, std::string_view label);

}  // namespace pagekv::router
