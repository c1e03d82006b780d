// The Prometheus text writer: escaping, number forms, histogram buckets
// (cumulative, +Inf, sum, count) and the process collector's series.
#include "server/metrics.h"

#include <gtest/gtest.h>

namespace pagekv::server {
namespace {

TEST(MetricsTextTest, LabelValuesAreEscapedAndNumbersReadBack) {
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(Number(0.1), "0.1");
  EXPECT_EQ(Number(3), "3");
  EXPECT_EQ(Number(1e-7), "1e-07");
  EXPECT_EQ(Number(1.0 / 0.0), "+Inf");
  EXPECT_EQ(MetricsText::Sample("x", {{"model_name", "m\"1"}, {"k", "v"}}, 2.5), "x{model_name=\"m\\\"1\",k=\"v\"} 2.5\n");
  MetricsText t;
  t.Counter("a_total", "help text", {}, 4);
  EXPECT_EQ(t.str(), "# HELP a_total help text\n# TYPE a_total counter\na_total 4\n");
}

TEST(MetricsTextTest, HistogramBucketsAreCumulative) {
  Histogram h({0.1, 1});
  for (double v : {0.05, 0.1, 0.5, 7.0}) h.Observe(v);
  MetricsText t;
  h.Render(t, "h", "x", {{"model_name", "m"}});
  EXPECT_EQ(t.str(),
            "# HELP h x\n# TYPE h histogram\n"
            "h_bucket{model_name=\"m\",le=\"0.1\"} 2\n"
            "h_bucket{model_name=\"m\",le=\"1\"} 3\n"
            "h_bucket{model_name=\"m\",le=\"+Inf\"} 4\n"
            "h_sum{model_name=\"m\"} 7.65\n"
            "h_count{model_name=\"m\"} 4\n");
}

TEST(MetricsTextTest, CounterSetsKeepEachLabelTuple) {
  CounterSet c;
  c.Add({{"route", "/a"}, {"status", "200"}});
  c.Add({{"route", "/a"}, {"status", "200"}}, 2);
  c.Add({{"route", "/a"}, {"status", "404"}});
  const auto s = c.Samples();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].second, 3);
  EXPECT_EQ(s[1].first[1].second, "404");
}

TEST(MetricsTextTest, TheProcessSeriesComeFromProc) {
  MetricsText t;
  AddProcessMetrics(t);
  for (const char* name : {"process_cpu_seconds_total ", "process_resident_memory_bytes ", "process_virtual_memory_bytes ",
                           "process_start_time_seconds ", "process_open_fds ", "process_max_fds "}) {
    EXPECT_NE(t.str().find(std::string("\n") + name), std::string::npos) << name << "\n" << t.str();
  }
  const size_t at = t.str().find("\nprocess_start_time_seconds ");
  const double start = std::stod(t.str().substr(at + 28));
  EXPECT_GT(start, 1.7e9);  // a Unix time, not seconds since boot
}

}  // namespace
}  // namespace pagekv::server
