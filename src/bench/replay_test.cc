// ReplayTrace on the real Mooncake conversation trace (its first 1500
// requests, to keep the suite fast) against an independent count: with
// unlimited capacity a full block hits exactly when its hash-id prefix was
// seen before. Plus the named errors for malformed traces.
#include "pagekv/replay.h"

#include <unistd.h>

#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace pagekv {
namespace {

constexpr const char* kTrace = "../shared/traces/mooncake/conversation_trace.jsonl";

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = "/tmp/pagekv-replay-test-" + std::to_string(::getpid()) + "-" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ReplayTest, UnlimitedHitRateIsTheShareOfFullBlocksWhosePrefixWasSeen) {
  std::ifstream in(kTrace);
  ASSERT_TRUE(in.good()) << "missing " << kTrace;
  std::string head, line;
  std::set<std::vector<int64_t>> seen;
  int64_t total = 0, hits = 0;
  for (int i = 0; i < 1500 && std::getline(in, line); ++i) {
    head += line + "\n";
    const auto j = nlohmann::json::parse(line);
    const auto ids = j["hash_ids"].get<std::vector<int64_t>>();
    const int64_t full = j["input_length"].get<int64_t>() / 512;
    std::vector<int64_t> prefix;
    bool still = true;  // hits are leading blocks only
    for (int64_t b = 0; b < full; ++b) {
      prefix.push_back(ids[static_cast<size_t>(b)]);
      still = still && seen.count(prefix) > 0;
      hits += still ? 1 : 0;
      ++total;
    }
    prefix.clear();
    for (int64_t b = 0; b < full; ++b) {
      prefix.push_back(ids[static_cast<size_t>(b)]);
      seen.insert(prefix);
    }
  }
  const std::string path = WriteTemp("head.jsonl", head);
  ReplayOptions o;
  o.trace_path = path;
  Result<ReplayReport> r = ReplayTrace(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->requests, 1500);
  EXPECT_EQ(r->rejected, 0);
  EXPECT_EQ(r->total_blocks, total);
  EXPECT_EQ(r->hit_blocks, hits);
  EXPECT_EQ(r->hit_tokens, hits * 512);
  EXPECT_EQ(r->evicted_blocks, 0);
  EXPECT_GT(r->block_hit_rate, 0.1);
  // A small pool evicts and hits less; xxh3 keys give the same figures.
  o.capacity_blocks = 500;
  Result<ReplayReport> small = ReplayTrace(o);
  ASSERT_TRUE(small.ok());
  EXPECT_LT(small->hit_blocks, hits);
  EXPECT_GT(small->evicted_blocks, 0);
  o.hash = BlockHashKind::kXxh3_128;
  Result<ReplayReport> xx = ReplayTrace(o);
  ASSERT_TRUE(xx.ok());
  EXPECT_EQ(xx->hit_blocks, small->hit_blocks);
  EXPECT_EQ(xx->evicted_blocks, small->evicted_blocks);
  std::remove(path.c_str());
}

TEST(ReplayTest, ARequestLargerThanThePoolIsRejectedAndChangesNothing) {
  const std::string path = WriteTemp("reject.jsonl",
                                     "{\"input_length\": 1024, \"hash_ids\": [1, 2]}\n"
                                     "{\"input_length\": 3000, \"hash_ids\": [7, 8, 9, 10, 11, 12]}\n"
                                     "{\"input_length\": 1024, \"hash_ids\": [1, 2]}\n");
  ReplayOptions o;
  o.trace_path = path;
  o.capacity_blocks = 4;
  Result<ReplayReport> r = ReplayTrace(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rejected, 1);
  EXPECT_EQ(r->total_blocks, 4);
  EXPECT_EQ(r->hit_blocks, 2) << "the rejected request evicted nothing";
  std::remove(path.c_str());
}

TEST(ReplayTest, MalformedTracesNameTheLineAndTheField) {
  struct Case {
    std::string text, message;
  };
  for (const Case& c : std::vector<Case>{
           {"{\"input_length\": 10, \"hash_ids\": [1]}\nnot json\n", "line 2: not a JSON object"},
           {"{\"hash_ids\": [1]}\n", "line 1: field 'input_length' is missing"},
           {"{\"input_length\": -5, \"hash_ids\": []}\n", "'input_length' is negative"},
           {"{\"input_length\": 600, \"hash_ids\": [1]}\n", "has 1 ids but input_length 600 needs 2"},
           {"{\"input_length\": 10}\n", "field 'hash_ids' is missing"},
           // Counts bounded before anything is sized from them; timestamps checked.
           {"{\"input_length\": 99999999999, \"hash_ids\": []}\n", "'input_length' is 99999999999, above the limit"},
           {"{\"input_length\": 18446744073709551615, \"hash_ids\": []}\n", "'input_length' is 18446744073709551615"},
           {"{\"input_length\": 10, \"output_length\": -1, \"hash_ids\": [1]}\n", "'output_length' is negative"},
           {"{\"input_length\": 10, \"output_length\": \"x\", \"hash_ids\": [1]}\n", "'output_length' is not an integer"},
           {"{\"input_length\": 10, \"timestamp\": -5, \"hash_ids\": [1]}\n", "line 1: field 'timestamp'"},
           // A line without end is refused at its limit, never held whole.
           {"{\"input_length\": 10, \"hash_ids\": [1]}\n{\"x\": \"" + std::string(5 << 20, 'a') + "\"}\n",
            "line 2: longer than 4 MiB"},
       }) {
    const std::string path = WriteTemp("bad.jsonl", c.text);
    ReplayOptions o;
    o.trace_path = path;
    const Status s = ReplayTrace(o).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s.message();
    std::remove(path.c_str());
  }
  ReplayOptions o;
  for (const Case& c : std::vector<Case>{
           {"TIMESTAMP,ContextTokens,GeneratedTokens\n1,abc,3\n", "line 2: field 'ContextTokens' is not an integer"},
           {"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,99999999999,3\n",
            "line 2: field 'ContextTokens' is 99999999999, above the limit"},
           {"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,99999999999999999999,3\n",
            "line 2: field 'ContextTokens' is not an integer"},
           {"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,-3\n", "'GeneratedTokens' is negative"},
           {"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,3\n2023-11-16 99:99:99.9,10,3\n",
            "line 3: field 'TIMESTAMP' is '2023-11-16 99:99:99.9'"},
           {"TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,3\n", "line 2: field 'TIMESTAMP'"},
       }) {
    const std::string csv = WriteTemp("bad.csv", c.text);
    o.trace_path = csv;
    const Status s = ReplayTrace(o).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s.message();
    std::remove(csv.c_str());
  }
  o.trace_path = "/nonexistent/trace.jsonl";
  EXPECT_EQ(ReplayTrace(o).status().code(), StatusCode::kNotFound);
  o.trace_path = "/dev/zero";  // used to be read without end
  const Status dev = ReplayTrace(o).status();
  EXPECT_NE(dev.message().find("is a device; give a regular file"), std::string::npos) << dev.ToString();
}

TEST(ReplayTest, AzureTracesReplayWithNoHits) {
  ReplayOptions o;
  o.trace_path = "../shared/traces/azure/AzureLLMInferenceTrace_code.csv";
  o.capacity_blocks = 2000;
  Result<ReplayReport> r = ReplayTrace(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->format, "azure");
  EXPECT_GT(r->requests, 8000);
  EXPECT_EQ(r->hit_blocks, 0);
  EXPECT_GT(r->peak_blocks_cached, 0);
}

}  // namespace
}  // namespace pagekv
