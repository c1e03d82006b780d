// `pagekv generate --tp N` under a real `mpirun`: the same greedy output as
// one process, and bad input (a rank count that does not match, a size that
// does not split the heads, a model missing on one rank, no launcher)
// failing every rank with exit 2, none left waiting in a collective (each
// run is bounded by `timeout`: a hang fails the test, it does not stall it).
// The same for --cp (context slices). `pagekv plan --tp / --cp`: one rank's
// pool. `pagekv serve --tp / --pp / --cp`: rank 0
// serves, the others step with it; the same answers as one server, and a
// SIGTERM to mpirun stops every rank cleanly.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <signal.h>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "testing/child_process.h"

namespace {

constexpr const char* kModel = "../shared/models/stories260K/stories260K.gguf";

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout and stderr together
};

RunResult RunCmd(const std::string& cmd) {
  RunResult r;
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Mpirun(int np) {
  // Shared-memory copies without ptrace (containers forbid it), and Open
  // MPI's lifetime allocations (in plugins unloaded by exit, so no
  // suppression can name them) not reported as leaks under the asan build.
  return "OMPI_MCA_btl_vader_single_copy_mechanism=none ASAN_OPTIONS=detect_leaks=0 "
         "timeout 120 " + std::string(PAGEKV_MPIRUN) + " --allow-run-as-root --oversubscribe --bind-to none -np " +
         std::to_string(np) + " ";
}

std::string Cli() { return PAGEKV_CLI_PATH; }

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(TensorParallelCliTest, GreedyOutputEqualsOneProcess) {
  const std::string args = " generate --model " + std::string(kModel) +
                           " --prompt 'Once upon a time' --prompt 'Lily and Ben' -n 32 --json";
  const RunResult one = RunCmd(Cli() + args);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  for (const auto& [np, flags] : std::vector<std::pair<int, std::string>>{
           {2, " --tp 2"}, {4, " --tp 4"}, {2, " --pp 2"}, {4, " --pp 4"}, {4, " --tp 2 --pp 2"},
           {2, " --cp 2"}, {4, " --cp 4"}, {4, " --tp 2 --cp 2"}, {4, " --pp 2 --cp 2"},
           {2, " --tp 2 --host-cache 1MiB"}, {2, " --pp 2 --host-cache 1MiB"}}) {  // KV tiers per shard
    SCOPED_TRACE(flags);
    const RunResult tp = RunCmd(Mpirun(np) + Cli() + args + flags);
    ASSERT_EQ(tp.exit_code, 0) << tp.out;
    // Rank 0 alone prints: two outputs and the stats line, as one process does.
    std::vector<nlohmann::json> a, b;
    for (const RunResult* r : {&one, &tp}) {
      size_t start = 0;
      while (start < r->out.size()) {
        const size_t eol = r->out.find('\n', start);
        const std::string line = r->out.substr(start, eol == std::string::npos ? std::string::npos : eol - start);
        start = eol == std::string::npos ? r->out.size() : eol + 1;
        nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_object() && j.contains("generated_ids")) (r == &one ? a : b).push_back(j["generated_ids"]);
      }
    }
    ASSERT_EQ(a.size(), 2u) << one.out;
    EXPECT_EQ(b, a) << tp.out;
  }
}

TEST(TensorParallelCliTest, ARankCountThatDoesNotMatchFailsEveryRank) {
  const RunResult r = RunCmd(Mpirun(3) + Cli() + " generate --model " + kModel + " --prompt x --tp 2");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_EQ(Count(r.out, "--tp 2 needs 2 ranks, but this job has 3: run mpirun -np 2"), 3u) << r.out;
}

TEST(TensorParallelCliTest, ASizeThatDoesNotSplitTheHeadsFailsEveryRank) {
  const RunResult r = RunCmd(Mpirun(3) + Cli() + " generate --model " + kModel + " --prompt x --tp 3");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_EQ(Count(r.out, "does not split 8 query heads over 4 KV heads"), 3u) << r.out;
  EXPECT_NE(r.out.find("use one of 1, 2, 4, 8"), std::string::npos) << r.out;
}

TEST(TensorParallelCliTest, MoreStagesThanLayersFailEveryRank) {
  const RunResult r = RunCmd(Mpirun(6) + Cli() + " generate --model " + kModel + " --prompt x --pp 6");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_EQ(Count(r.out, "pipeline parallel size 6 exceeds the model's 5 layers: use at most 5 stages"), 6u) << r.out;
  const RunResult wrong = RunCmd(Mpirun(3) + Cli() + " generate --model " + kModel + " --prompt x --tp 2 --pp 2");
  EXPECT_EQ(wrong.exit_code, 2) << wrong.out;
  EXPECT_EQ(Count(wrong.out, "--tp 2 x --pp 2 needs 4 ranks, but this job has 3: run mpirun -np 4"), 3u) << wrong.out;
}

TEST(TensorParallelCliTest, ContextParallelSizesThatDoNotSplitABlockFailEveryRank) {
  // 3 slices of a power-of-two block: impossible at any block length.
  const RunResult three = RunCmd(Mpirun(3) + Cli() + " generate --model " + kModel + " --prompt x --cp 3");
  EXPECT_EQ(three.exit_code, 2) << three.out;
  EXPECT_EQ(Count(three.out, "3 context slices"), 3u) << three.out;
  EXPECT_NE(three.out.find("2, 4, 8"), std::string::npos) << three.out;
  // Slices under 8 tokens.
  const RunResult small = RunCmd(Mpirun(2) + Cli() + " generate --model " + kModel + " --prompt x --cp 2 --block-len 8");
  EXPECT_EQ(small.exit_code, 2) << small.out;
  EXPECT_EQ(Count(small.out, "does not split into 2 context slices of at least 8 tokens"), 2u) << small.out;
  const RunResult wrong = RunCmd(Mpirun(3) + Cli() + " generate --model " + kModel + " --prompt x --tp 2 --cp 2");
  EXPECT_EQ(wrong.exit_code, 2) << wrong.out;
  EXPECT_EQ(Count(wrong.out, "--tp 2 x --cp 2 needs 4 ranks, but this job has 3: run mpirun -np 4"), 3u) << wrong.out;
}

TEST(TensorParallelCliTest, AModelMissingOnOneRankFailsBothWithoutAHang) {
  // Two programs in one job (MPMD): rank 1 is given a path that does not exist.
  const RunResult r = RunCmd(Mpirun(1) + Cli() + " generate --model " + kModel + " --prompt x --tp 2 : -np 1 " + Cli() +
                          " generate --model /nonexistent/model.gguf --prompt x --tp 2");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("rank 1: cannot open model file '/nonexistent/model.gguf'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 0: another tensor parallel rank failed while preparing"), std::string::npos) << r.out;
}

TEST(TensorParallelCliTest, TpWithoutALauncherSaysHowToStartIt) {
  const RunResult r = RunCmd(Cli() + " generate --model " + kModel + " --prompt x --tp 2");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("mpirun -np 2 pagekv generate"), std::string::npos) << r.out;
}

std::string Complete(int port, const nlohmann::json& body) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(60, 0);
  auto res = cli.Post("/v1/completions", body.dump(), "application/json");
  EXPECT_TRUE(res) << httplib::to_string(res.error());
  if (!res) return {};
  EXPECT_EQ(res->status, 200) << res->body;
  const nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices")) return res->body;
  return j["choices"][0]["text"].get<std::string>();
}

TEST(TensorParallelCliTest, ServeSplitOverRanksAnswersAsOneServer) {
  const std::vector<nlohmann::json> bodies = {
      {{"prompt", "Once upon a time"}, {"max_tokens", 24}, {"temperature", 0}},
      {{"prompt", "Lily and Ben went to the park"}, {"max_tokens", 24}, {"temperature", 0.9}, {"seed", 7}},
      {{"prompt", "Once upon a time"}, {"max_tokens", 16}, {"temperature", 0}},  // a prefix-cache hit
      {{"prompt", "The little cat"}, {"max_tokens", 12}, {"temperature", 0.7}, {"top_p", 0.9}, {"seed", 3},
       {"stop", nlohmann::json::array({"."})}}};
  std::vector<std::string> want;
  {
    pagekv::testing::ChildProcess one({Cli(), "serve", "--model", kModel, "--port", "0", "--threads", "1"});
    ASSERT_GT(one.port(), 0);
    for (const auto& b : bodies) want.push_back(Complete(one.port(), b));
  }
  for (const std::string& flags : {std::string("--tp"), std::string("--pp"), std::string("--cp")}) {
    SCOPED_TRACE(flags);
    pagekv::testing::ChildProcess split({PAGEKV_MPIRUN, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
                                 Cli(), "serve", "--model", kModel, "--port", "0", flags, "2"},
                                {"OMPI_MCA_btl_vader_single_copy_mechanism=none", "ASAN_OPTIONS=detect_leaks=0"});
    ASSERT_GT(split.port(), 0) << "rank 0 did not start listening";
    for (size_t i = 0; i < bodies.size(); ++i) EXPECT_EQ(Complete(split.port(), bodies[i]), want[i]) << "request " << i;
    // Several at once: batched steps, the same answers.
    std::vector<std::thread> clients;
    std::vector<std::string> got(bodies.size());
    for (size_t i = 0; i < bodies.size(); ++i) clients.emplace_back([&, i] { got[i] = Complete(split.port(), bodies[i]); });
    for (std::thread& t : clients) t.join();
    EXPECT_EQ(got, want);
    // mpirun passes SIGTERM to every rank: rank 0 drains and stops its
    // engine, which stops the followers'; the job ends (mpirun itself exits
    // non-zero after a signal, whatever its ranks did).
    split.Signal(SIGTERM);
    EXPECT_GE(split.Wait(30), 0) << "the job did not end";
    EXPECT_NE(split.RestOfOutput().find("pagekv serve: stopped"), std::string::npos) << "rank 0 stopped cleanly";
  }
}

TEST(TensorParallelCliTest, PlanPrintsOneRanksPool) {
  const RunResult one = RunCmd(Cli() + " plan --preset llama3-8b --budget 8GiB --json");
  const RunResult tp = RunCmd(Cli() + " plan --preset llama3-8b --budget 8GiB --tp 4 --json");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  ASSERT_EQ(tp.exit_code, 0) << tp.out;
  const nlohmann::json a = nlohmann::json::parse(one.out), b = nlohmann::json::parse(tp.out);
  EXPECT_EQ(b["bytes_per_token"].get<int64_t>() * 4, a["bytes_per_token"].get<int64_t>()) << "2 of Llama 3 8B's 8 KV heads";
  EXPECT_EQ(b["tokens_capacity"].get<int64_t>(), a["tokens_capacity"].get<int64_t>() * 4);
  EXPECT_EQ(b["tensor_parallel"]["kv_heads_per_rank"], 2);
  EXPECT_EQ(b["tensor_parallel"]["q_heads_per_rank"], 8);
  const RunResult pp = RunCmd(Cli() + " plan --preset llama3-8b --budget 8GiB --pp 4 --tp 2 --json");
  ASSERT_EQ(pp.exit_code, 0) << pp.out;
  const nlohmann::json c = nlohmann::json::parse(pp.out);
  EXPECT_EQ(c["bytes_per_token"].get<int64_t>() * 8, a["bytes_per_token"].get<int64_t>()) << "8 of 32 layers, 2 of 8 KV heads";
  EXPECT_EQ(c["pipeline_parallel"]["layers_per_rank"], 8);
  const RunResult uneven = RunCmd(Cli() + " plan --preset llama3-8b --pp 3 --json");
  ASSERT_EQ(uneven.exit_code, 0) << uneven.out;
  EXPECT_EQ(nlohmann::json::parse(uneven.out)["pipeline_parallel"]["layers_per_rank"], 11) << "32 layers over 3: the largest stage";
  const RunResult bad = RunCmd(Cli() + " plan --preset llama3-8b --tp 3");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.out.find("use one of 1, 2, 4, 8, 16, 32"), std::string::npos) << bad.out;
  const RunResult mla = RunCmd(Cli() + " plan --preset deepseek-v3 --tp 2");
  EXPECT_EQ(mla.exit_code, 2) << mla.out;
  // Context parallel: a rank holds half of every block, so the same bytes
  // per rank hold twice the blocks, and the pair twice one process's tokens.
  const RunResult cp = RunCmd(Cli() + " plan --preset llama3-8b --budget 8GiB --cp 2 --seq-len 100000 --json");
  ASSERT_EQ(cp.exit_code, 0) << cp.out;
  const nlohmann::json d = nlohmann::json::parse(cp.out);
  EXPECT_EQ(d["num_blocks"].get<int64_t>(), 2 * a["num_blocks"].get<int64_t>());
  EXPECT_EQ(d["context_parallel"]["group_tokens_capacity"].get<int64_t>(), 2 * a["tokens_capacity"].get<int64_t>());
  EXPECT_EQ(d["context_parallel"]["tokens_per_block_per_rank"], 64);
  EXPECT_EQ(d["blocks_per_sequence"], (100000 + 127) / 128) << "a sequence takes whole blocks of 128 tokens";
  const RunResult cp3 = RunCmd(Cli() + " plan --preset llama3-8b --cp 3");
  EXPECT_EQ(cp3.exit_code, 2) << cp3.out;
  EXPECT_NE(cp3.out.find("does not split into 3 slices"), std::string::npos) << cp3.out;
}

}  // namespace
