// SmolLM2-135M-Instruct through the `pagekv` binary: `pagekv chat` fed on
// stdin (a second turn served from the first turn's cached KV, /reset),
// `generate --chat` giving the same answer, and GGUF files the runner does
// not implement refused with one line naming the key and its value (exit 2).
// The model comes from scripts/fetch-model.sh (make test fetches it).
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/models.h"

namespace {

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("pagekv-rm-" + std::to_string(::getpid()) + "-" + name)).string();
}

// The CLI with `args`, `input` on its stdin; stdout and stderr apart.
RunResult RunCli(const std::string& args, const std::string& input = {}) {
  const std::string in = TempPath("stdin"), err = TempPath("stderr");
  std::ofstream(in, std::ios::binary) << input;
  const std::string cmd = std::string(PAGEKV_CLI_PATH) + " " + args + " <" + in + " 2>" + err;
  RunResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = ReadFile(err);
  std::remove(in.c_str());
  std::remove(err.c_str());
  return r;
}

class RealModelCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = pagekv::testing::SmolLM2Path();
    struct stat st {};
    ASSERT_EQ(::stat(model_.c_str(), &st), 0) << model_ << " is missing: run scripts/fetch-model.sh (make test does)";
  }
  std::string model_;
};

struct TurnStats {
  long prompt = -1, cached = -1, generated = -1;
};

// The "[turn N: P prompt tokens, C from the prefix cache; G generated, ..."
// lines of `pagekv chat`'s stderr.
std::vector<TurnStats> Turns(const std::string& err) {
  std::vector<TurnStats> turns;
  std::istringstream lines(err);
  for (std::string line; std::getline(lines, line);) {
    TurnStats t;
    int n = 0;
    if (std::sscanf(line.c_str(), "[turn %d: %ld prompt tokens, %ld from the prefix cache; %ld generated", &n, &t.prompt,
                    &t.cached, &t.generated) == 4) {
      turns.push_back(t);
    }
  }
  return turns;
}

TEST_F(RealModelCliTest, ChatKeepsTheConversationsKvAcrossTurns) {
  const RunResult r = RunCli("chat --model " + model_ + " --temp 0 -n 48 --block-len 16",
                             "What is the capital of France?\nAnd what is the capital of Germany?\n/reset\n"
                             "What is the capital of France?\n");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<TurnStats> turns = Turns(r.err);
  ASSERT_EQ(turns.size(), 3u) << r.err;
  std::vector<std::string> answers;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) answers.push_back(line);
  ASSERT_EQ(answers.size(), 3u) << r.out;
  EXPECT_NE(answers[0].find("Paris"), std::string::npos) << answers[0];
  EXPECT_NE(answers[1].find("Berlin"), std::string::npos) << answers[1];
  EXPECT_EQ(answers[2], answers[0]) << "after /reset the same question gets the same greedy answer";
  // The second turn's prompt is the first turn's prompt and answer
  // re-rendered, then the new message: every full block of what the first
  // turn computed (its prompt and its answer but the end-of-turn token)
  // comes from the prefix cache.
  const long first_computed = turns[0].prompt + turns[0].generated - 1;
  EXPECT_EQ(turns[0].cached, 0);
  EXPECT_EQ(turns[1].cached, first_computed / 16 * 16) << r.err;
  EXPECT_GT(turns[1].prompt, first_computed);
  // After /reset: the first turn's prompt again, all of its full blocks cached.
  EXPECT_EQ(turns[2].prompt, turns[0].prompt);
  EXPECT_EQ(turns[2].cached, turns[0].prompt / 16 * 16);
  EXPECT_NE(r.err.find("tokens/s"), std::string::npos);
  EXPECT_NE(r.err.find("chat template the model's"), std::string::npos) << r.err;
}

TEST_F(RealModelCliTest, GenerateChatGivesTheSameAnswerAndStopsAtTheEndOfTheTurn) {
  const RunResult chat = RunCli("chat --model " + model_ + " --temp 0 --no-stats", "What is the capital of France?\n");
  ASSERT_EQ(chat.exit_code, 0) << chat.err;
  const RunResult gen = RunCli("generate --model " + model_ + " --chat --prompt 'What is the capital of France?' --json");
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  const nlohmann::json j = nlohmann::json::parse(gen.out.substr(0, gen.out.find('\n')));
  EXPECT_EQ(j["finish_reason"], "stop");
  EXPECT_EQ(j["completion"].get<std::string>() + "\n", chat.out);
  EXPECT_EQ(j["completion"].get<std::string>().find("<|im_end|>"), std::string::npos);
  // Long conversations: a message past the context is an error for that
  // turn, and the chat goes on.
  const RunResult big = RunCli("chat --model " + model_ + " --temp 0 -n 16 --no-stats",
                               std::string(40000, 'a') + "\nWhat is the capital of France?\n");
  EXPECT_EQ(big.exit_code, 0) << big.err;
  EXPECT_NE(big.err.find("the context holds 8192"), std::string::npos) << big.err;
  EXPECT_NE(big.out.find("Paris"), std::string::npos) << big.out;
}

TEST_F(RealModelCliTest, ChatBadInputExitsTwo) {
  EXPECT_EQ(RunCli("chat --model " + model_ + " --temp -1").exit_code, 2);
  EXPECT_EQ(RunCli("chat --model " + model_ + " --chat-template nosuch").exit_code, 2);
  EXPECT_EQ(RunCli("chat --model /nonexistent.gguf").exit_code, 2);
  EXPECT_EQ(RunCli("chat --model " + model_ + " --kv-budget 1KiB").exit_code, 2);
}

// A copy of `file` with the first occurrence of `from` after `after`
// replaced by `to` (same length: offsets stay valid).
std::string Patched(const std::string& file, const std::string& after, const std::string& from, const std::string& to) {
  std::string bytes = ReadFile(file);
  size_t at = bytes.find(after);
  EXPECT_NE(at, std::string::npos) << after;
  at = bytes.find(from, at);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(from.size(), to.size());
  bytes.replace(at, from.size(), to);
  return bytes;
}

TEST_F(RealModelCliTest, UnsupportedFilesAreOneLineNamingTheKeyAndValueAndExitTwo) {
  const std::string tiny = TempPath("tiny.gguf"), yarn = TempPath("yarn.gguf");
  ASSERT_EQ(RunCli("synth-model --preset tiny --out " + tiny).exit_code, 0);
  ASSERT_EQ(RunCli("synth-model --preset tiny --rope-scaling yarn --rope-factor 2 --out " + yarn).exit_code, 0);
  struct Case {
    std::string name, bytes, needle;
  };
  const std::string smollm = model_;
  std::string type_id(4, '\0');
  const uint32_t iq2_xxs = 16;
  std::memcpy(type_id.data(), &iq2_xxs, 4);
  // blk.0.attn_q.weight's info: name, u32 n_dims (2), two u64 dims, u32 type.
  std::string iq = ReadFile(tiny);
  const size_t info = iq.find("blk.0.attn_q.weight") + std::strlen("blk.0.attn_q.weight") + 4 + 16;
  iq.replace(info, 4, type_id);
  const std::vector<Case> cases = {
      {"architecture", Patched(tiny, "general.architecture", "llama", "gpt-j"), "general.architecture"},
      {"tokenizer", Patched(tiny, "tokenizer.ggml.model", "llama", "rwkv5"), "tokenizer.ggml.model"},
      {"pre-tokenizer", Patched(smollm, "tokenizer.ggml.pre", "smollm", "dbrx00"), "tokenizer.ggml.pre"},
      {"rope scaling", Patched(yarn, "rope.scaling.type", "yarn", "ntk4"), "rope.scaling.type"},
      {"weight type", iq, "iq2_xxs"},
      {"unknown key", Patched(tiny, "llama.rope.freq_base", "rope.freq_base", "sliding_window"), "llama.sliding_window"},
  };
  const std::vector<std::string> values = {"gpt-j", "rwkv5", "dbrx00", "ntk4", "blk.0.attn_q.weight", "sliding_window"};
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    const std::string path = TempPath("bad.gguf");
    std::ofstream(path, std::ios::binary) << cases[i].bytes;
    const RunResult r = RunCli("generate --model " + path + " --prompt hi -n 1");
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_NE(r.err.find(cases[i].needle), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(values[i]), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    std::remove(path.c_str());
  }
  std::remove(tiny.c_str());
  std::remove(yarn.c_str());
}

}  // namespace
