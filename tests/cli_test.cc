// End-to-end tests of the `pagekv` binary: exact planner numbers, exit codes
// and messages for bad input, and the demo running clean.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout and stderr together
};

RunResult RunCli(const std::string& args) {
  const std::string cmd = std::string(PAGEKV_CLI_PATH) + " " + args + " 2>&1";
  RunResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(CliPlanTest, SeedWorkedExamplePrintsTheExactTotal) {
  RunResult r = RunCli("plan --layers 61 --kv-heads 8 --head-dim 128 --block-len 128 --max-blocks 512 --dtype f16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("\"total_bytes\": 16374562816"), std::string::npos) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["bytes_per_token"], 61 * 8 * 128 * 2 * 2);
  EXPECT_EQ(j["bytes_per_block"], 31981568);
  EXPECT_EQ(j["num_blocks"], 512);
  EXPECT_EQ(j["attention"], "MHA");
}

TEST(CliPlanTest, DeepSeekV3MlaPrintsTheExactBytesPerToken) {
  RunResult r = RunCli("plan --preset deepseek-v3 --dtype bf16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("\"bytes_per_token\": 70272"), std::string::npos) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["attention"], "MLA");
  EXPECT_EQ(j["per_head_bytes_per_token"], 4997120);
}

TEST(CliPlanTest, Int8CountsItsScalesInEveryByte) {
  RunResult r = RunCli("plan --preset llama3-8b --dtype int8 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["bytes_per_token"], 32 * 2 * 8 * (128 + 2));  // 0.508x f16's 131,072
  EXPECT_EQ(j["dtype"], "int8");
  // int4 KIVI: 4-bit keys and values, f16 scale and minimum per channel over
  // 32 tokens (keys) and per row (values): (64 + 16) + (64 + 4) bytes per
  // token and head, 0.289x f16.
  RunResult int4 = RunCli("plan --preset llama3-8b --dtype int4 --json");
  ASSERT_EQ(int4.exit_code, 0) << int4.out;
  nlohmann::json k = nlohmann::json::parse(int4.out);
  EXPECT_EQ(k["bytes_per_token"], 32 * 8 * ((64 + 16) + (64 + 4)));
  EXPECT_EQ(k["tail_bytes_per_sequence"], 32 * 2 * 8 * 32 * 128 * 2);
  EXPECT_EQ(RunCli("plan --preset llama3-8b --dtype int4 --block-len 16").exit_code, 2);  // group 32 > block 16
}

TEST(CliPlanTest, TableSaysHowMuchSmallerMlaIs) {
  RunResult r = RunCli("plan --preset deepseek-v3 --dtype bf16 --budget 24GiB --seq-len 32768");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("71.1x smaller"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("70,272 B"), std::string::npos) << r.out;
}

TEST(CliPlanTest, BudgetGivesCapacityAndMaxSequences) {
  RunResult r = RunCli("plan --preset llama3-8b --budget 24GiB --seq-len 8192 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  const int64_t blocks = (int64_t{24} << 30) / (131072 * 128);
  EXPECT_EQ(j["num_blocks"], blocks);
  EXPECT_EQ(j["tokens_capacity"], blocks * 128);
  EXPECT_EQ(j["max_sequences"], blocks / 64);
}

TEST(CliPlanTest, ExplainDerivesEveryNumberAndSaysWhatToChange) {
  RunResult r = RunCli("plan --preset seed-deepseek-v3 --budget 8GiB --batch 8 --explain");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("How each number is derived"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("floor(budget"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("What to change when it does not fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fewer sequences"), std::string::npos) << r.out;
}

struct BadCase {
  const char* args;
  const char* message;  // must appear in the output
};

class CliBadInputTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(CliBadInputTest, ExitsTwoWithAMessageNamingTheProblem) {
  RunResult r = RunCli(GetParam().args);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find(GetParam().message), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << "one-line error expected: " << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Plan, CliBadInputTest,
    ::testing::Values(
        BadCase{"plan --preset llama3-8b --budget 12XB", "unknown unit 'XB'"},
        BadCase{"plan --preset llama3-8b --budget lots", "byte size 'lots'"},
        BadCase{"plan --preset gpt-9", "unknown preset 'gpt-9': use one of deepseek-v3"},
        BadCase{"plan --layers 4 --kv-heads 8 --head-dim 64 --block-len 100 --max-blocks 4", "block_len = 100"},
        BadCase{"plan --layers 0 --kv-heads 8 --head-dim 64 --max-blocks 4", "num_layers = 0"},
        BadCase{"plan --layers 4 --kv-heads 8 --q-heads 12 --head-dim 64 --max-blocks 4", "not a multiple"},
        BadCase{"plan --layers 4 --kv-heads 8 --head-dim 64", "pool size missing"},
        BadCase{"plan --kv-heads 8", "no model geometry"},
        BadCase{"plan --preset llama3-8b --dtype f64 --max-blocks 4", "unknown dtype 'f64'"},
        BadCase{"plan --preset llama3-8b --dtype int4 --block-len 16", "does not divide block_len 16"},
        BadCase{"plan --preset llama3-8b --budget 1KiB", "smaller than one block"},
        BadCase{"plan --preset llama3-8b --max-blocks 4 --frobnicate", "frobnicate"},
        BadCase{"plan --preset llama3-8b --max-blocks many", "many"},
        BadCase{"nosuchcommand", "nosuchcommand"},
        BadCase{"bench attention --quick --device tpu", "is not one of cpu, cuda, cuda:N"},
        BadCase{"generate --model ../shared/models/stories260K/stories260K.gguf --prompt Hi --device cuda:x",
                "is not one of cpu, cuda, cuda:N"},
        BadCase{"generate --model ../shared/models/stories260K/stories260K.gguf --prompt Hi --tensor-cores",
                "use it with --device cuda"},
        BadCase{"bench attention --quick --tensor-cores", "use it with --device cuda"},
        BadCase{"bench generate --quick --tensor-cores", "use it with --device cuda"},
        BadCase{"generate --model ../shared/models/stories260K/stories260K.gguf --prompt Hi --cuda-graphs",
                "runs decode steps as CUDA graphs: use it with --device cuda"},
        BadCase{"bench generate --quick --cuda-graphs", "use it with --device cuda"}));

// A device that is not there (no GPU, or a build without CUDA): exit 2 and
// one line naming the fix; where a GPU runs it, there is nothing to refuse.
TEST(CliDeviceTest, AMissingGpuIsOneLineNamingTheFix) {
  RunResult r = RunCli("bench attention --quick --device cuda --batch 1 --ctx 64 --heads 8/2 --dtype f16");
  if (r.exit_code == 0) GTEST_SKIP() << "a GPU runs --device cuda here";
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--device cpu"), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << "one-line error expected: " << r.out;
  r = RunCli("bench generate --quick --device cuda");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--device cpu"), std::string::npos) << r.out;
}

TEST(CliDemoTest, RunsCleanAndReportsNoLeaks) {
  RunResult r = RunCli("demo --sequences 40 --blocks 512 --max-len 512");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("sequences finished"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("contiguous max-length reserve"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Leak check: no blocks referenced"), std::string::npos) << r.out;
}

TEST(CliDemoTest, PreemptsInsteadOfDeadlockingOnATinyPool) {
  RunResult r = RunCli("demo --sequences 30 --blocks 80 --max-len 256");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("Leak check: no blocks referenced"), std::string::npos) << r.out;
}

TEST(CliBenchTest, QuickAttentionBenchPrintsTheRooflineObject) {
  RunResult r = RunCli("bench attention --quick --json --no-scalar");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["stream_read_gbps"].get<double>(), 0.0);
  EXPECT_GT(j["fma_gflops"].get<double>(), 0.0);
  ASSERT_FALSE(j["results"].empty());
  for (const auto& row : j["results"]) {
    for (const char* key : {"batch", "ctx", "q_heads", "kv_heads", "block_len", "dtype", "threads",
                            "seconds_per_call", "kv_bytes", "gbps", "ratio_to_stream", "ratio_to_roofline"}) {
      EXPECT_TRUE(row.contains(key)) << key;
    }
    EXPECT_GT(row["seconds_per_call"].get<double>(), 0.0);
    // floor / measured: positive, and a kernel cannot beat its floor by much
    // (a little slack for the ceilings' own measurement noise).
    EXPECT_GT(row["ratio_to_roofline"].get<double>(), 0.0);
    EXPECT_LT(row["ratio_to_roofline"].get<double>(), 2.0);
    // K and V rows of 128 elements: 2 bytes each in f16/bf16, 1 byte plus a 2-byte scale per row in int8 and fp8.
    const std::string dtype = row["dtype"];
    const int64_t row_bytes = dtype == "int8" || dtype.rfind("fp8", 0) == 0 ? 128 + 2 : 128 * 2;
    EXPECT_EQ(row["kv_bytes"].get<int64_t>(),
              row["batch"].get<int64_t>() * row["ctx"].get<int64_t>() * row["kv_heads"].get<int64_t>() * row_bytes * 2);
  }
}

TEST(CliBenchTest, QuickMlaBenchReadsOneLatentRowPerToken) {
  RunResult r = RunCli("bench attention --mla --quick --json --dtype bf16 --block-len 64 --heads 8/1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["results"].size(), 1u) << r.out;
  const auto& row = j["results"][0];
  EXPECT_TRUE(row["mla"].get<bool>());
  EXPECT_EQ(row["q_heads"].get<int>(), 8);
  EXPECT_EQ(row["kv_heads"].get<int>(), 1);
  // One bf16 latent row of 512 + 64 per token, read once for every head.
  EXPECT_EQ(row["kv_bytes"].get<int64_t>(), row["batch"].get<int64_t>() * row["ctx"].get<int64_t>() * 576 * 2);
  EXPECT_GT(row["seconds_per_call"].get<double>(), 0.0);
  EXPECT_GT(row["mla_total_seconds"].get<double>(), 0.0);
  EXPECT_GT(row["ratio_to_roofline"].get<double>(), 0.0);
  EXPECT_LT(row["ratio_to_roofline"].get<double>(), 2.0);
}

TEST(CliBenchTest, BadBenchFlagsExitTwo) {
  EXPECT_EQ(RunCli("bench attention --mla --heads 8/2").exit_code, 2);
  EXPECT_EQ(RunCli("bench attention --quick --full").exit_code, 2);
  EXPECT_EQ(RunCli("bench attention --heads 30/8").exit_code, 2);
  EXPECT_EQ(RunCli("bench attention --block-len 100").exit_code, 2);
  EXPECT_EQ(RunCli("bench attention --dtype int5").exit_code, 2);
  EXPECT_EQ(RunCli("bench").exit_code, 2);
}

TEST(CliTest, HelpExitsZero) {
  RunResult r = RunCli("plan --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--budget"), std::string::npos);
}

}  // namespace

namespace {

constexpr const char* kModelFlag = "--model ../shared/models/stories260K/stories260K.gguf";

TEST(CliGenerateTest, JsonHasOneObjectPerPromptThenTheStatistics) {
  RunResult r = RunCli(std::string("generate ") + kModelFlag +
                       " --prompt 'Once upon a time' --prompt 'The cat' -n 8 --json --dump-logits 3");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::vector<nlohmann::json> lines;
  size_t start = 0;
  while (start < r.out.size()) {
    const size_t end = r.out.find('\n', start);
    lines.push_back(nlohmann::json::parse(r.out.substr(start, end - start)));
    start = end + 1;
  }
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["prompt"], "Once upon a time");
  EXPECT_EQ(lines[0]["prompt_ids"], (std::vector<int>{1, 403, 407, 261, 378}));
  EXPECT_EQ(lines[0]["generated_ids"].size(), 8u);
  EXPECT_EQ(lines[0]["generated_ids"][0], 432);  // the golden's first token
  EXPECT_EQ(lines[0]["top_logits"].size(), 8u);
  EXPECT_EQ(lines[0]["top_logits"][0]["ids"][0], 432);
  EXPECT_GT(lines[2]["stats"]["peak_blocks_used"].get<int>(), 0);
}

TEST(CliGenerateTest, TextAndCacheStatisticsArePrinted) {
  RunResult r = RunCli(std::string("generate ") + kModelFlag + " --prompt 'Once upon a time' -n 16");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("Once upon a time, there was a little girl named Lily"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("peak blocks used"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("contiguous reservation"), std::string::npos) << r.out;
}

TEST(CliGenerateTest, BadInputExitsTwoWithTheReason) {
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {std::string(kModelFlag) + " --prompt hi -n 0", "-n 0"},
           {"--model ../shared/models/none.gguf --prompt hi", "none.gguf"},
           {"--model ../shared/models/stories260K/stories260K.bin --prompt hi", "--tokenizer"},
           {std::string(kModelFlag) + " --prompt hi --top-p 3", "top_p"},
           {std::string(kModelFlag) + " --prompt hi --kv-dtype int4", "int4"},
           {std::string(kModelFlag) + " --prompt hi -n 5000", "context"},
           {std::string(kModelFlag), "no prompts"},
       }) {
    RunResult r = RunCli("generate " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << ": " << r.out;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << c.args << ": " << r.out;
  }
}

TEST(CliPoolSizeTest, ANegativeOrZeroBlockCountIsAnErrorInEveryCommand) {
  // Before, a pool size <= 0 was silently replaced by the default.
  for (const std::string& args : {std::string("generate ") + kModelFlag + " --prompt hi --blocks -3",
                                  std::string("generate ") + kModelFlag + " --prompt hi --blocks 0",
                                  std::string("serve ") + kModelFlag + " --blocks -3",
                                  std::string("chat ") + kModelFlag + " --blocks 0", std::string("demo --blocks -1")}) {
    RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.out;
    EXPECT_NE(r.out.find("--blocks"), std::string::npos) << args << ": " << r.out;
  }
}

}  // namespace

namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/pagekv-cli-test-" + std::to_string(getpid()) +
         "-" + name;
}

TEST(CliSynthModelTest, WritesADeterministicModelThatGenerates) {
  const std::string a = TempPath("a.gguf"), b = TempPath("b.gguf"), c = TempPath("c.gguf");
  ASSERT_EQ(RunCli("synth-model --preset tiny --seed 3 --out " + a).exit_code, 0);
  ASSERT_EQ(RunCli("synth-model --preset tiny --seed 3 --out " + b).exit_code, 0);
  ASSERT_EQ(RunCli("synth-model --preset tiny --seed 4 --out " + c).exit_code, 0);
  auto slurp = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(slurp(a), slurp(b)) << "same seed, same bytes";
  EXPECT_NE(slurp(a), slurp(c)) << "another seed, other weights";
  RunResult r = RunCli("generate --model " + a + " --prompt 'hello world' --prompt 'hello there' -n 6 --json");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("\"generated_ids\""), std::string::npos) << r.out;
  for (const auto& p : {a, b, c}) std::remove(p.c_str());
}

// A deepseek2 preset writes a model that generates on the latent cache, and
// generate reports the latent rows' bytes against a per-head cache's.
TEST(CliSynthModelTest, ADeepseek2PresetGeneratesOnTheLatentCache) {
  const std::string m = TempPath("ds.gguf");
  ASSERT_EQ(RunCli("synth-model --preset tiny-deepseek2 --out " + m).exit_code, 0);
  RunResult r = RunCli("generate --model " + m + " --prompt 'hello world' -n 6 --kv-dtype bf16");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("latent (MLA) rows       480 B per token; per-head K and V of every query head would be "
                       "1.88 KiB (4.0x)"),
            std::string::npos)
      << r.out;
  r = RunCli("generate --model " + m + " --prompt 'hello' -n 2 --kv-dtype int4 --block-len 32");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("MLA"), std::string::npos) << r.out;
  EXPECT_EQ(RunCli("synth-model --preset tiny-deepseek2 --arch qwen2 --out " + TempPath("x.gguf")).exit_code, 2);
  std::remove(m.c_str());
}

TEST(CliSynthModelTest, BadInputExitsTwo) {
  EXPECT_EQ(RunCli("synth-model --preset gpt-9 --out " + TempPath("x.gguf")).exit_code, 2);
  EXPECT_EQ(RunCli("synth-model --preset tiny --weight-type q4_k --out " + TempPath("x.gguf")).exit_code, 2);
  EXPECT_EQ(RunCli("synth-model --preset tiny").exit_code, 2);
  const RunResult r = RunCli("synth-model --preset tiny --out /nonexistent-dir/x.gguf");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent-dir/x.gguf"), std::string::npos) << r.out;
}

TEST(CliBenchTest, QuickGenerateBenchPrintsThroughputAndRoofline) {
  RunResult r = RunCli("bench generate --quick --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["parameters"].get<int64_t>(), 0);
  ASSERT_EQ(j["results"].size(), 2u);
  for (const auto& row : j["results"]) {
    EXPECT_GT(row["prefill_tokens_per_second"].get<double>(), 0.0);
    EXPECT_GT(row["decode_tokens_per_second"].get<double>(), 0.0);
    EXPECT_GE(row["decode_attention_share"].get<double>(), 0.0);
    EXPECT_LE(row["decode_attention_share"].get<double>() + row["decode_matmul_share"].get<double>(), 1.0);
    EXPECT_GT(row["step_weight_bytes"].get<int64_t>(), 0);
    EXPECT_GT(row["ratio_to_roofline"].get<double>(), 0.0);
  }
  EXPECT_EQ(RunCli("bench generate --batch 0").exit_code, 2);
  EXPECT_EQ(RunCli("bench generate --model ../shared/models/none.gguf").exit_code, 2);
  // What it ran on, for every figure.
  ASSERT_TRUE(j.contains("machine")) << r.out;
  EXPECT_FALSE(j["machine"]["cpu"].get<std::string>().empty());
  EXPECT_GE(j["machine"]["logical_cpus"].get<int>(), 1);
  EXPECT_FALSE(j["machine"]["simd_target"].get<std::string>().empty());
}

TEST(CliBenchTest, BusyNeighbourRunsEachBatchAloneAndOnEveryThreadBesideASpinningProcess) {
  const RunResult r = RunCli("bench generate --quick --json --threads 2 --busy-neighbour");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["busy_neighbour"].get<bool>());
  ASSERT_EQ(j["results"].size(), 4u) << r.out;  // batches 1 and 4, at 1 and 2 threads
  for (size_t i = 0; i < 4; ++i) {
    const auto& row = j["results"][i];
    EXPECT_EQ(row["threads"].get<int>(), i % 2 == 0 ? 1 : 2);
    EXPECT_GT(row["decode_tokens_per_second"].get<double>(), 0.0);
    if (i % 2 == 0) {
      EXPECT_EQ(row["pool_parallel_loops"].get<int64_t>(), 0) << "a 1-thread row used the pool";
    }
  }
  const RunResult text = RunCli("bench generate --quick --threads 2 --busy-neighbour");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("machine: "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("with a busy neighbour"), std::string::npos) << text.out;
}

}  // namespace

namespace {

TEST(CliBenchTest, ServeBenchRunsBothAllocatorsAndWritesAPlot) {
  const std::string plot = TempPath("serve.svg");
  RunResult r = RunCli("bench serve --trace ../shared/traces/azure/AzureLLMInferenceTrace_conv.csv --format azure "
                       "--preset tiny-16k --max-requests 12 --time-scale 0 --kv-budget 8MiB --json --plot " + plot);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto brace = r.out.find('{');
  ASSERT_NE(brace, std::string::npos) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out.substr(brace));
  ASSERT_EQ(j["results"].size(), 2u);
  for (const auto& row : j["results"]) {
    for (const char* key : {"requests", "requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                            "itl_p99_ms", "mean_running", "peak_running", "kv_utilization", "preemptions", "prefix_hit_rate"}) {
      EXPECT_TRUE(row.contains(key)) << key;
    }
    EXPECT_EQ(row["requests"], 12);
  }
  EXPECT_EQ(j["results"][0]["allocator"], "paged");
  EXPECT_GT(j["results"][0]["kv_utilization"].get<double>(), 0.9);
  EXPECT_GE(j["results"][0]["peak_running"].get<int>(), j["results"][1]["peak_running"].get<int>());
  std::ifstream svg(plot);
  std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("polyline"), std::string::npos);
  std::remove(plot.c_str());
  EXPECT_EQ(RunCli("bench serve --trace /nonexistent.csv").exit_code, 2);
  EXPECT_EQ(RunCli("bench serve --trace ../shared/traces/azure/AzureLLMInferenceTrace_conv.csv --allocator buddy").exit_code, 2);
}

}  // namespace

namespace {

// `pagekv bench tiers` measures both seals on one block and names the CPU.
TEST(CliBenchTiersTest, ReportsTheChecksumAndTheMacOnOneBlock) {
  const RunResult r = RunCli("bench tiers --block-len 16 --layers 2 --seconds 0.01 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j["cpu"].get<std::string>().empty());
  EXPECT_EQ(j["kv_bytes"], 2 * 2 * 3 * 64 * 16 * 2);
  EXPECT_GT(j["payload_bytes"].get<int64_t>(), j["kv_bytes"].get<int64_t>());
  for (const char* k : {"checksum_seal_gbps", "checksum_check_gbps", "mac_seal_gbps", "mac_check_gbps"}) {
    EXPECT_GT(j[k].get<double>(), 0) << k;
  }
  EXPECT_EQ(RunCli("bench tiers --dtype int4").exit_code, 2);
}

}  // namespace
