#include "router/prometheus_text.h"

#include <cmath>

#include <gtest/gtest.h>

namespace pagekv::router {
namespace {

// What a `pagekv serve` /metrics page looks like, with the edge cases of the
// format around it.
constexpr const char* kPage =
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting{model_name=\"m\"} 3\n"
    "vllm:num_requests_waiting_extra 99\n"
    "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"
    "vllm:cache_config_info{block_size=\"16\",model_name=\"a \\\"quoted\\\" name, with } and ,\",num_gpu_blocks=\"4096\"} 1\n"
    "up 1 1700000000000\n"
    "inf_gauge +Inf\n"
    "broken{label=\"unterminated} 5\n"
    "broken 7\n";

TEST(PrometheusTextTest, ReadsValuesAndLabelsOfTheFirstMatchingSample) {
  EXPECT_EQ(SeriesValue(kPage, "vllm:num_requests_waiting"), 3.0) << "a longer name with the same start is another series";
  EXPECT_EQ(SeriesValue(kPage, "vllm:num_requests_waiting_extra"), 99.0);
  EXPECT_EQ(SeriesValue(kPage, "vllm:kv_cache_usage_perc"), 0.25);
  EXPECT_EQ(SeriesValue(kPage, "up"), 1.0) << "a timestamp after the value";
  EXPECT_TRUE(std::isinf(*SeriesValue(kPage, "inf_gauge")));
  EXPECT_EQ(SeriesValue(kPage, "broken"), 7.0) << "a malformed line is skipped, the next sample read";
  EXPECT_FALSE(SeriesValue(kPage, "absent"));
  EXPECT_FALSE(SeriesValue(kPage, "HELP")) << "comments are not samples";
  EXPECT_EQ(LabelValue(kPage, "vllm:cache_config_info", "num_gpu_blocks"), "4096")
      << "quotes, commas and braces inside an earlier label's value";
  EXPECT_EQ(LabelValue(kPage, "vllm:cache_config_info", "block_size"), "16");
  EXPECT_EQ(LabelValue(kPage, "vllm:cache_config_info", "model_name"), "a \"quoted\" name, with } and ,");
  EXPECT_FALSE(LabelValue(kPage, "vllm:cache_config_info", "size")) << "a label's name is matched whole";
  EXPECT_FALSE(LabelValue(kPage, "absent", "block_size"));
}

TEST(PrometheusTextTest, RefusesMalformedLinesWithoutReadingPastThem) {
  for (const char* bad : {"", "# comment", "{a=\"b\"} 1", "name", "name{", "name{a=\"b\"", "name{a=b} 1", "name{a=\"b\" c=\"d\"} 1",
                          "name 1x", "name{a=\"b\\", "9name 1"}) {
    EXPECT_FALSE(ParsePromLine(bad)) << bad;
  }
  const std::optional<PromSample> s = ParsePromLine("  name{a=\"x\\ny\",} -2.5e3");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->name, "name");
  ASSERT_EQ(s->labels.size(), 1u) << "a trailing comma is allowed";
  EXPECT_EQ(s->labels[0].second, "x\ny");
  EXPECT_EQ(s->value, -2500.0);
}

}  // namespace
}  // namespace pagekv::router
