#include "server/metrics.h"

#include <dirent.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <sstream>

namespace pagekv::server {

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// The shortest text that reads back as the same double; +Inf, -Inf, NaN.
std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

std::string MetricsText::Sample(std::string_view name, const Labels& labels, double value) {
  std::string out(name);
  if (!labels.empty()) {
    out.push_back('{');
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) out.push_back(',');
      out.append(labels[i].first).append("=\"").append(EscapeLabelValue(labels[i].second)).append("\"");
    }
    out.push_back('}');
  }
  return out.append(" ").append(Number(value)).append("\n");
}

void MetricsText::Add(std::string_view name, std::string_view help, std::string_view type,
                      const std::vector<std::pair<Labels, double>>& samples) {
  out_.append("# HELP ").append(name).append(" ").append(help).append("\n");
  out_.append("# TYPE ").append(name).append(" ").append(type).append("\n");
  for (const auto& [labels, v] : samples) out_ += Sample(name, labels, v);
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  std::lock_guard lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::Render(MetricsText& out, std::string_view name, std::string_view help, const Labels& labels) const {
  std::lock_guard lock(mu_);
  out.Raw(std::string("# HELP ").append(name).append(" ").append(help).append("\n# TYPE ").append(name).append(
      " histogram\n"));
  const std::string bucket = std::string(name) + "_bucket";
  int64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    Labels with = labels;
    with.emplace_back("le", i < bounds_.size() ? Number(bounds_[i]) : "+Inf");
    out.Raw(MetricsText::Sample(bucket, with, static_cast<double>(cumulative)));
  }
  out.Raw(MetricsText::Sample(std::string(name) + "_sum", labels, sum_));
  out.Raw(MetricsText::Sample(std::string(name) + "_count", labels, static_cast<double>(count_)));
}

void CounterSet::Add(const Labels& key, int64_t n) {
  std::lock_guard lock(mu_);
  counts_[key] += n;
}

std::vector<std::pair<Labels, double>> CounterSet::Samples() const {
  std::lock_guard lock(mu_);
  std::vector<std::pair<Labels, double>> out;
  for (const auto& [k, v] : counts_) out.emplace_back(k, static_cast<double>(v));
  return out;
}

void AddProcessMetrics(MetricsText& out) {
  std::ifstream in("/proc/self/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The fields after the command's closing parenthesis (which may hold spaces).
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return;
  std::istringstream fields(stat.substr(close + 2));
  std::vector<std::string> f((std::istream_iterator<std::string>(fields)), std::istream_iterator<std::string>());
  // From field 3 (state): utime 14, stime 15, starttime 22, vsize 23, rss 24.
  if (f.size() < 22) return;
  auto field = [&](int n) { return std::stod(f[static_cast<size_t>(n - 3)]); };
  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  double boot = 0;
  {
    std::ifstream s("/proc/stat");
    for (std::string line; std::getline(s, line);) {
      if (line.rfind("btime ", 0) == 0) boot = std::stod(line.substr(6));
    }
  }
  out.Counter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", {},
              (field(14) + field(15)) / ticks);
  out.Gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", {}, field(23));
  out.Gauge("process_resident_memory_bytes", "Resident memory size in bytes.", {}, field(24) * page);
  out.Gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", {},
            boot + field(22) / ticks);
  int fds = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (const dirent* e = ::readdir(d)) fds += e->d_name[0] != '.';
    ::closedir(d);
    --fds;  // the directory's own descriptor
  }
  out.Gauge("process_open_fds", "Number of open file descriptors.", {}, static_cast<double>(fds));
  std::ifstream limits("/proc/self/limits");
  for (std::string line; std::getline(limits, line);) {
    if (line.rfind("Max open files", 0) != 0) continue;
    std::istringstream l(line.substr(14));
    double soft = 0;
    if (l >> soft) out.Gauge("process_max_fds", "Maximum number of open file descriptors.", {}, soft);
  }
}

}  // namespace pagekv::server
