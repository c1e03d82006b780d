// Prometheus text exposition (format 0.0.4) for the server's /metrics:
// families written once with their HELP and TYPE, label values escaped,
// histograms with cumulative buckets, the process collector's series.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pagekv::server {

using Labels = std::vector<std::pair<std::string, std::string>>;

// The shortest decimal that reads back as v; +Inf, -Inf, NaN.
std::string Number(double v);

// Backslash, double quote and newline escaped, as the format requires.
std::string EscapeLabelValue(std::string_view v);

class MetricsText {
 public:
  // One family with its samples (name + labels, value). For a counter the
  // family's name ends in _total, as Prometheus's own clients write it.
  void Add(std::string_view name, std::string_view help, std::string_view type,
           const std::vector<std::pair<Labels, double>>& samples);
  void Gauge(std::string_view name, std::string_view help, const Labels& labels, double value) {
    Add(name, help, "gauge", {{labels, value}});
  }
  void Counter(std::string_view name, std::string_view help, const Labels& labels, double value) {
    Add(name, help, "counter", {{labels, value}});
  }
  void Raw(std::string_view text) { out_ += text; }
  const std::string& str() const { return out_; }

  static std::string Sample(std::string_view name, const Labels& labels, double value);

 private:
  std::string out_;
};

// A histogram with fixed bounds; thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  void Render(MetricsText& out, std::string_view name, std::string_view help, const Labels& labels) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket, not cumulative; the last past every bound
  double sum_ = 0;
  int64_t count_ = 0;
};

// Counters keyed by a label tuple (e.g. route and status); thread-safe.
class CounterSet {
 public:
  void Add(const Labels& key, int64_t n = 1);
  std::vector<std::pair<Labels, double>> Samples() const;

 private:
  mutable std::mutex mu_;
  std::map<Labels, int64_t> counts_;
};

// The process collector's series (process_cpu_seconds_total,
// process_resident_memory_bytes, process_virtual_memory_bytes,
// process_start_time_seconds, process_open_fds, process_max_fds), read
// from /proc/self; nothing where /proc cannot be read.
void AddProcessMetrics(MetricsText& out);

}  // namespace pagekv::server
