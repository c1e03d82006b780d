// A model split over MPI ranks (run under `mpirun -np N`: 2 and 4 in make
// test), every way the job's size allows: tensor parallel (each rank holds
// its share of the heads and their KV), pipeline parallel (each holds a
// range of the layers and their KV; steps in micro-batches), and both at 4
// ranks (2 x 2). The results must be the one-process results: greedy tokens
// identical, logits within 1e-5 of the largest logit, on stories260K (GGUF
// and llama2.c), and on synthetic models whose head counts split awkwardly
// (KV heads fewer than the ranks: replicated), qwen2 biases, q8_0 weights;
// the engine's preemption and prefix cache under sharding; ranks that
// disagree on a step stop there together, none hangs. Each rank computes
// the one-process reference itself (the whole model, no communicator).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "engine/forward_step.h"
#include "model/model.h"
#include "model/model_loader.h"
#include "pagekv/dist.h"
#include "pagekv/engine.h"
#include "pagekv/generate.h"
#include "pagekv/kv_cache.h"
#include "pagekv/plan.h"
#include "pagekv/synth_model.h"
#include "testing/models.h"
#include "testing/redis_server.h"
#include "testing/sanitized.h"

namespace pagekv {
namespace {

// Tokens per block: 8 per context rank (each holds a slice of 8 tokens of
// every block), so the one-process reference reads the same blocks.
int32_t BlockLen(const ModelParallel& p) { return 8 * p.context_size(); }

// Every sum formed as one process forms it: pipeline stages alone (tensor
// ranks add partial sums, context ranks merge partial attention).
bool Exact(const ModelParallel& p) { return p.tensor_size() == 1 && p.context_size() == 1; }

using testing::kSanitized;

constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";
constexpr const char* kBin = "../shared/models/stories260K/stories260K.bin";
constexpr const char* kTok = "../shared/models/stories260K/tok512.bin";

std::shared_ptr<Communicator> World() {
  if (!LaunchedByMpi()) return nullptr;
  Result<std::shared_ptr<Communicator>> w = MpiWorld();
  return w.ok() ? *w : nullptr;
}

class TensorParallelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tp_ = World();
    if (tp_ == nullptr || tp_->size() < 2) GTEST_SKIP() << "run under mpirun -np 2 (or more): ctest does";
    dir_ = std::filesystem::temp_directory_path() /
           ("pagekv-tp-" + std::to_string(::getpid()) + "-" + std::to_string(tp_->rank()));
    std::filesystem::create_directories(dir_);
    // Every split of this job's ranks (each rank makes them in the same
    // order): all tensor, all pipeline, all context, and at 4 ranks each
    // pair of 2 x 2.
    const int n = tp_->size();
    struct Split {
      int t, p, c;
    };
    std::vector<Split> wanted = {{n, 1, 1}, {1, n, 1}};
    if ((n & (n - 1)) == 0) wanted.push_back({1, 1, n});  // context slices of a power-of-two block: 2, 4, 8 ranks
    if (n == 4) wanted.insert(wanted.end(), {{2, 2, 1}, {2, 1, 2}, {1, 2, 2}});
    for (const Split& w : wanted) {
      Result<ModelParallel> mp = SplitWorld(tp_, w.t, w.p, w.c);
      ASSERT_TRUE(mp.ok()) << mp.status().ToString();
      splits_.push_back({"tp " + std::to_string(w.t) + " x pp " + std::to_string(w.p) + " x cp " + std::to_string(w.c), *mp});
    }
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // A synthetic model in this rank's directory (every rank writes the same bytes).
  std::string Synth(SynthModelSpec spec, const std::string& weight_type) {
    const std::string path = (dir_ / (spec.name + "-" + weight_type + ".gguf")).string();
    EXPECT_TRUE(WriteSynthModel(spec, 7, weight_type, path).ok());
    return path;
  }

  // Whether this job's size splits the model's heads (every rank decides
  // the same).
  bool Splits(const std::string& path, const ModelParallel& parallel, const std::string& tokenizer = {}) {
    Result<LoadedModel> m = LoadModel(path, tokenizer, parallel);
    if (!m.ok()) {
      EXPECT_TRUE(m.status().code() == StatusCode::kInvalidArgument || m.status().code() == StatusCode::kUnimplemented)
          << m.status().ToString();
    }
    const Result<bool> all = tp_->AllOk(m.ok());
    EXPECT_TRUE(all.ok() && *all == m.ok()) << "every rank refuses alike";
    return m.ok();
  }

  std::shared_ptr<Communicator> tp_;  // the job's world
  std::vector<std::pair<std::string, ModelParallel>> splits_;
  std::filesystem::path dir_;
};

// tiny's width with 8 query heads over 2 KV heads (GQA 4): at 4 ranks each
// KV head is replicated on 2 of them; at 2, split.
SynthModelSpec Awkward() {
  SynthModelSpec s = *FindSynthModelPreset("tiny");
  s.name = "tp-awkward";
  s.num_heads = 8;
  s.num_kv_heads = 2;
  return s;
}

// One query head over one KV head per... MQA: 4 heads over 1 (replicated on every rank).
SynthModelSpec Mqa() {
  SynthModelSpec s = *FindSynthModelPreset("tiny");
  s.name = "tp-mqa";
  s.num_kv_heads = 1;
  return s;
}

struct Greedy {
  std::vector<std::vector<int32_t>> ids;
  // Per sequence and step: the gap between the two best logits, relative
  // to the best's magnitude.
  std::vector<std::vector<double>> gaps;
};

Greedy GreedyRun(const std::string& path, const std::string& tokenizer, const ModelParallel& parallel, bool prefix_cache,
                 int32_t block_len) {
  GenerateOptions o;
  o.model_path = path;
  o.tokenizer_path = tokenizer;
  o.prompts = {"Once upon a time", "Lily and Ben went to the park", "Once upon a time there was"};
  o.max_new_tokens = 24;
  o.block_len = block_len;
  o.threads = 1;
  o.prefix_cache = prefix_cache;
  o.parallel = parallel;
  o.top_logits = 2;
  Result<GenerateReport> r = Generate(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  Greedy g;
  if (!r.ok()) return g;
  for (const GenerateOutput& out : r->outputs) {
    g.ids.push_back(out.generated_ids);
    std::vector<double>& gaps = g.gaps.emplace_back();
    for (const auto& top : out.step_top) {
      gaps.push_back(top.size() < 2 ? 1.0
                                    : (static_cast<double>(top[0].second) - top[1].second) /
                                          std::max(1e-30, std::fabs(static_cast<double>(top[0].second))));
    }
  }
  return g;
}

// Split over ranks, the tokens must be the one-process tokens, except that
// under tensor parallel (whose sums add the shards' partial sums in another
// order, moving logits by ~1e-5 of their size on a 30-layer model) a
// sequence may take the other token where the one-process run's two best
// logits were a near tie (within 2e-4 of the best); from there on that
// sequence's context differs and it is not compared further. Returns how
// many sequences did.
int ExpectSameTokens(const Greedy& want, const Greedy& got, bool exact) {
  EXPECT_EQ(got.ids.size(), want.ids.size());
  int flips = 0;
  for (size_t i = 0; i < std::min(got.ids.size(), want.ids.size()); ++i) {
    if (exact || got.ids[i] == want.ids[i]) {
      EXPECT_EQ(got.ids[i], want.ids[i]) << "prompt " << i;
      continue;
    }
    size_t t = 0;
    while (t < got.ids[i].size() && t < want.ids[i].size() && got.ids[i][t] == want.ids[i][t]) ++t;
    if (t >= want.gaps[i].size()) {
      ADD_FAILURE() << "prompt " << i << ": the runs differ in length, not in a token";
      continue;
    }
    EXPECT_LT(want.gaps[i][t], 2e-4) << "prompt " << i << " step " << t << " took another token where the one-process "
                                     << "run's best logit led by " << want.gaps[i][t] << " (relative): not a near tie";
    ++flips;
  }
  return flips;
}

// The collectives the model uses, against sums formed here: every rank
// knows every rank's values (a function of the rank), so the rank-order sum
// is computed locally and compared bit for bit.
TEST_F(TensorParallelTest, NonblockingSumsAndGathersGiveTheRankOrderResultOnEveryRank) {
  const int n = tp_->size(), me = tp_->rank();
  auto value = [](int rank, int64_t i, int which) {
    return std::ldexp(static_cast<float>((rank * 7919 + i * 104729 + which * 31) % 2003) - 1001.0f, (rank + i) % 9 - 4);
  };
  for (const int64_t count : {int64_t{1}, int64_t{3}, int64_t{768}, int64_t{100000}}) {
    SCOPED_TRACE(count);
    // Two sums in flight at once, waited for in the reverse order.
    std::vector<float> a(static_cast<size_t>(count)), b(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      a[static_cast<size_t>(i)] = value(me, i, 0);
      b[static_cast<size_t>(i)] = value(me, i, 1);
    }
    Result<int> ha = tp_->StartSum(a.data(), count);
    Result<int> hb = tp_->StartSum(b.data(), count);
    ASSERT_TRUE(ha.ok() && hb.ok());
    EXPECT_NE(*ha, *hb);
    ASSERT_TRUE(tp_->WaitSum(*hb).ok());
    ASSERT_TRUE(tp_->WaitSum(*ha).ok());
    int64_t wrong = 0;
    for (int64_t i = 0; i < count; ++i) {
      float sa = value(0, i, 0), sb = value(0, i, 1);
      for (int r = 1; r < n; ++r) {
        sa += value(r, i, 0);
        sb += value(r, i, 1);
      }
      wrong += a[static_cast<size_t>(i)] != sa || b[static_cast<size_t>(i)] != sb;
    }
    EXPECT_EQ(wrong, 0) << "elements that are not the rank-order sum";
    const Result<bool> same = tp_->AllEqual(std::hash<std::string_view>{}(
        std::string_view(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float))));
    EXPECT_TRUE(same.ok() && *same) << "the ranks' sums differ in their bits";
    // The gather: every rank's bytes in rank order.
    std::vector<int32_t> mine(static_cast<size_t>(count), me * 1000 + 1), all(static_cast<size_t>(count * n));
    ASSERT_TRUE(tp_->AllGather(mine.data(), count * 4, all.data()).ok());
    for (int r = 0; r < n; ++r) EXPECT_EQ(all[static_cast<size_t>(r * count + count - 1)], r * 1000 + 1);
  }
  // Errors, on every rank alike (no collective started).
  EXPECT_FALSE(tp_->StartSum(nullptr, 4).ok());
  EXPECT_FALSE(tp_->StartSum(nullptr, -1).ok());
  EXPECT_FALSE(tp_->WaitSum(987654).ok()) << "an unknown handle";
  Result<int> once = tp_->StartSum(nullptr, 0);
  ASSERT_TRUE(once.ok());
  EXPECT_TRUE(tp_->WaitSum(*once).ok());
  EXPECT_FALSE(tp_->WaitSum(*once).ok()) << "a handle waited for twice";
}

TEST_F(TensorParallelTest, GreedyTokensEqualOneProcess) {
  struct Case {
    std::string name, path, tokenizer;
  };
  std::vector<Case> cases = {{"stories260K.gguf", kGguf, ""}, {"stories260K.bin (llama2.c)", kBin, kTok}};
  SynthModelSpec qwen = Awkward();
  qwen.name = "tp-qwen2";
  qwen.arch = "qwen2";
  cases.push_back({"8 heads over 2 KV heads, f32", Synth(Awkward(), "f32"), ""});
  cases.push_back({"8 heads over 2 KV heads, q8_0", Synth(Awkward(), "q8_0"), ""});
  cases.push_back({"4 heads over 1 KV head (MQA), f16", Synth(Mqa(), "f16"), ""});
  cases.push_back({"qwen2 (q / k / v biases), bf16", Synth(qwen, "bf16"), ""});
  // 6 heads over 3 KV heads: splits at 3 ranks (and 6), not at 2 or 4.
  SynthModelSpec three = *FindSynthModelPreset("tiny");
  three.name = "tp-three";
  three.dim = 96;
  three.num_heads = 6;
  three.num_kv_heads = 3;
  cases.push_back({"6 heads over 3 KV heads, f32", Synth(three, "f32"), ""});
  if (!kSanitized && std::filesystem::exists(testing::SmolLM2Path())) {
    cases.push_back({"SmolLM2-135M", testing::SmolLM2Path(), ""});
  }
  for (const auto& [split, parallel] : splits_) {
    SCOPED_TRACE(split);
    int ran = 0;
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      if (!Splits(c.path, parallel, c.tokenizer)) continue;  // e.g. SmolLM2's 9 heads at 2 or 4 ranks
      for (bool prefix : {false, true}) {
        SCOPED_TRACE(prefix ? "with the prefix cache" : "without the prefix cache");
        const Greedy want = GreedyRun(c.path, c.tokenizer, {}, prefix, BlockLen(parallel));
        const Greedy got = GreedyRun(c.path, c.tokenizer, parallel, prefix, BlockLen(parallel));
        ASSERT_EQ(want.ids.size(), 3u);
        // Pipeline stages alone compute every sum as one process: exact.
        ExpectSameTokens(want, got, Exact(parallel));
      }
      ++ran;
    }
    EXPECT_GE(ran, 1);
  }
}

TEST_F(TensorParallelTest, LogitsMatchOneProcessAndEachRankHoldsItsShare) {
  for (const auto& [split, parallel] : splits_)
  for (const std::string& path : {std::string(kGguf), Synth(Awkward(), "f32"), Synth(Mqa(), "f32")}) {
    SCOPED_TRACE(split + ": " + path);
    if (!Splits(path, parallel)) continue;
    Result<LoadedModel> whole = LoadModel(path);
    Result<LoadedModel> shard = LoadModel(path, {}, parallel);
    ASSERT_TRUE(whole.ok() && shard.ok());
    const ModelConfig& c = whole->model->config();
    const HeadShard hs = shard->model->head_shard();
    const int t = parallel.tensor_size(), p = parallel.pipeline_size();
    EXPECT_EQ(hs.q_heads * t, c.num_heads);
    EXPECT_EQ(hs.kv_heads * t, std::max(c.num_kv_heads, t)) << "KV heads split, or replicated when fewer than the ranks";
    const int32_t bl = BlockLen(parallel);
    const CacheConfig g = shard->model->CacheGeometry(bl, DType::kF32, 16);
    EXPECT_EQ(g.num_kv_heads, hs.kv_heads);
    const int stage = parallel.pipeline != nullptr ? parallel.pipeline->rank() : 0;
    EXPECT_EQ(g.num_layers, c.num_layers * (stage + 1) / p - c.num_layers * stage / p) << "this stage's layers only";
    EXPECT_EQ(shard->model->first_layer(), c.num_layers * stage / p);
    const std::vector<int32_t> ids = whole->tokenizer->EncodePrompt("Once upon a time, in a big forest, there lived", true);
    const int32_t vocab = c.vocab_size;
    auto run = [&](const LoadedModel& m, const ModelParallel& mp) {
      auto cache = KvCache::Create({.config = m.model->CacheGeometry(bl, DType::kF32, 16), .prefault = false,
                                    .slices = mp.context_size(), .slice = mp.context_rank()});
      EXPECT_TRUE(cache.ok());
      std::vector<float> logits(ids.size() * static_cast<size_t>(vocab));
      const SeqId seq = (*cache)->AddSequence();
      // The prompt in two chunks, then a decode step: prefill and decode paths.
      const size_t cut = ids.size() / 2;
      ForwardItem a{seq, std::span<const int32_t>(ids).first(cut), logits.data(), true};
      EXPECT_TRUE(*ForwardStep(*m.model, **cache, {&a, 1}, {.threads = 1, .activations = Activations::kF32}));
      ForwardItem b{seq, std::span<const int32_t>(ids).subspan(cut, ids.size() - cut - 1), logits.data() + cut * vocab, true};
      EXPECT_TRUE(*ForwardStep(*m.model, **cache, {&b, 1}, {.threads = 1, .activations = Activations::kF32}));
      ForwardItem d{seq, std::span<const int32_t>(ids).last(1), logits.data() + (ids.size() - 1) * vocab, true};
      EXPECT_TRUE(*ForwardStep(*m.model, **cache, {&d, 1}, {.threads = 1, .activations = Activations::kF32}));
      return logits;
    };
    const std::vector<float> want = run(*whole, {}), got = run(*shard, parallel);
    double worst = 0;
    for (size_t r = 0; r < ids.size(); ++r) {
      double scale = 1e-30, diff = 0;
      for (int32_t t = 0; t < vocab; ++t) {
        const size_t at = r * static_cast<size_t>(vocab) + static_cast<size_t>(t);
        scale = std::max(scale, std::fabs(static_cast<double>(want[at])));
        diff = std::max(diff, std::fabs(static_cast<double>(got[at]) - want[at]));
      }
      worst = std::max(worst, diff / scale);
    }
    EXPECT_LE(worst, 1e-5) << "relative to each position's largest logit";
    if (!Exact(parallel)) {
      EXPECT_GT(worst, 0.0) << "the shards' sums (or attention parts) are added in another order: some last bit should differ";
    } else {
      EXPECT_EQ(worst, 0.0) << "pipeline stages compute every sum as one process does";
    }
  }
}

TEST_F(TensorParallelTest, RanksThatDisagreeOnAStepAllStopThereAndStayInStep) {
  for (const auto& [split, parallel] : splits_) {
  SCOPED_TRACE(split);
  if (!Splits(kGguf, parallel)) continue;  // 3 ranks do not split stories260K's 8 heads over 4
  Result<LoadedModel> m = LoadModel(kGguf, {}, parallel);
  ASSERT_TRUE(m.ok());
  auto cache = KvCache::Create({.config = m->model->CacheGeometry(BlockLen(parallel), DType::kF32, 16 / parallel.context_size()),
                                .prefault = false, .slices = parallel.context_size(), .slice = parallel.context_rank()});
  ASSERT_TRUE(cache.ok());
  const SeqId seq = (*cache)->AddSequence();
  std::vector<int32_t> tokens = {1, 403, 407, 261};
  if (tp_->rank() == 1) tokens[2] = 300;  // this rank's scheduler saw another prompt
  ForwardItem item{seq, tokens, nullptr, false};
  Result<bool> r = ForwardStep(*m->model, **cache, {&item, 1}, {.threads = 1});
  ASSERT_FALSE(r.ok()) << "every rank refuses the step, none waits in a collective for the others";
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("block tables differ"), std::string::npos) << r.status().message();
  EXPECT_EQ((*cache)->View(seq)->num_tokens, 0) << "nothing reserved is left behind";
  // The same step everywhere runs, on every rank.
  tokens[2] = 407;
  std::vector<float> logits(static_cast<size_t>(m->model->config().vocab_size));
  item.logits = logits.data();
  r = ForwardStep(*m->model, **cache, {&item, 1}, {.threads = 1});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(*r);
  // A pool too small for the step: every rank says so (false), none runs it.
  std::vector<int32_t> many(200, 403);
  const SeqId other = (*cache)->AddSequence();
  ForwardItem big{other, many, nullptr, false};
  r = ForwardStep(*m->model, **cache, {&big, 1}, {.threads = 1});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
  }
}

TEST_F(TensorParallelTest, PreemptionAndThePrefixCacheGiveTheOneProcessTokens) {
  const std::vector<std::string> prompts = {"Once upon a time", "Lily and Ben went to the park", "The little cat",
                                            "Once upon a time, in a big forest, there lived a bear", "Once upon a time"};
  auto run = [&](const ModelParallel& parallel, int64_t blocks) {
    EngineOptions o;
    o.model_path = kGguf;
    o.block_len = BlockLen(parallel);
    o.num_blocks = blocks;
    o.watermark_blocks = 0;
    o.threads = 1;
    o.prefix_cache = true;
    o.parallel = parallel;
    Result<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    std::vector<std::vector<int32_t>> out;
    if (!e.ok()) return std::make_pair(out, int64_t{0});
    std::vector<RequestId> ids;
    for (const std::string& p : prompts) {
      EngineRequest r;
      r.prompt = (*e)->Encode(p);
      r.max_tokens = 40;
      r.ignore_eos = true;
      ids.push_back(*(*e)->Submit(r));
    }
    if (Status st = (*e)->RunUntilIdle(); !st.ok()) {
      ADD_FAILURE() << st.ToString();
      return std::make_pair(out, int64_t{0});  // the requests left are never answered: do not wait for them
    }
    int64_t preemptions = 0;
    for (RequestId id : ids) {
      const RequestResult r = (*e)->Wait(id);
      out.push_back(r.tokens);
      preemptions += r.preemptions;
    }
    return std::make_pair(out, preemptions);
  };
  const auto want = run({}, 256);
  for (const auto& [split, parallel] : splits_) {
    SCOPED_TRACE(split);
    if (!Splits(kGguf, parallel)) continue;
    const int64_t cp = parallel.context_size();
    const auto got = run(parallel, cp == 1 ? 18 : cp == 2 ? 9 : 5);  // about as many tokens as 18 blocks of 8
    EXPECT_EQ(got.first, want.first);
    EXPECT_GT(got.second, 0) << "the small pool was meant to preempt";
  }
}

// Context parallel: each rank's pool holds one slice of every block, so
// with one process's bytes per rank the group holds a sequence C times
// longer than one process can; it decodes to the one-process tokens (of a
// pool large enough).
TEST_F(TensorParallelTest, ContextParallelHoldsASequenceLongerThanOneProcessCan) {
  auto engine = [&](const ModelParallel& parallel, int64_t budget) {
    EngineOptions o;
    o.model_path = kGguf;
    o.block_len = BlockLen(parallel);
    o.kv_dtype = DType::kF32;
    o.kv_budget_bytes = budget;
    o.watermark_blocks = 0;
    o.threads = 1;
    o.parallel = parallel;
    return Engine::Create(o);
  };
  for (const auto& [split, parallel] : splits_) {
    if (parallel.context_size() == 1 || parallel.tensor_size() > 1 || parallel.pipeline_size() > 1) continue;
    SCOPED_TRACE(split);
    const int64_t budget = int64_t{200} * 1280;  // 200 tokens of stories260K's f32 KV (5 layers x 4 heads x 8 x 2 x 4 bytes)
    auto one = engine({}, budget);  // one process with the bytes each rank has
    auto big = engine({}, int64_t{1} << 24);
    auto split_engine = engine(parallel, budget);
    ASSERT_TRUE(one.ok() && big.ok() && split_engine.ok()) << split_engine.status().ToString();
    EngineRequest r;
    r.prompt = (*big)->Encode("Once upon a time");
    r.max_tokens = 300;  // ~305 positions: more than 200 tokens' blocks
    r.ignore_eos = true;
    EXPECT_EQ((*one)->Submit(r).status().code(), StatusCode::kResourceExhausted) << "one process cannot hold it";
    const RequestId big_id = *(*big)->Submit(r);
    ASSERT_TRUE((*big)->RunUntilIdle().ok());
    const RequestResult want = (*big)->Wait(big_id);
    ASSERT_EQ(want.tokens.size(), 300u);
    Result<RequestId> id = (*split_engine)->Submit(r);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ASSERT_TRUE((*split_engine)->RunUntilIdle().ok());
    const RequestResult got = (*split_engine)->Wait(*id);
    EXPECT_EQ(got.finish, FinishReason::kLength) << got.error.ToString();
    EXPECT_EQ(got.tokens, want.tokens);
    const EngineMetrics m = (*split_engine)->Metrics();
    EXPECT_LE(m.blocks_total * m.bytes_per_block, budget) << "this rank's pool within its budget";
    EXPECT_GE(m.blocks_total * BlockLen(parallel), 305) << "the group's blocks hold the whole sequence";
  }
}

TEST_F(TensorParallelTest, ALeaderEngineTakesRequestsAndItsFollowersStepWithIt) {
  // One process's answers to the greedy requests (each rank computes them).
  const std::vector<std::string> prompts = {"Once upon a time", "Lily and Ben went to the park", "Once upon a time"};
  std::vector<std::vector<int32_t>> want;
  {
    EngineOptions o;
    o.model_path = kGguf;
    o.block_len = 8;
    o.threads = 1;
    o.prefix_cache = true;
    auto e = std::move(*Engine::Create(o));
    for (const std::string& p : prompts) {
      EngineRequest r;
      r.prompt = e->Encode(p);
      r.max_tokens = 20;
      r.ignore_eos = true;
      const RequestId id = *e->Submit(r);
      ASSERT_TRUE(e->RunUntilIdle().ok());
      want.push_back(e->Wait(id).tokens);
    }
  }
  for (const auto& [split, parallel] : splits_) {
    SCOPED_TRACE(split);
    if (!Splits(kGguf, parallel)) continue;
    EngineOptions o;
    o.model_path = kGguf;
    o.block_len = BlockLen(parallel);
    o.threads = 1;
    o.prefix_cache = true;
    o.parallel = parallel;
    o.parallel_leader = true;
    Result<std::unique_ptr<Engine>> created = Engine::Create(o);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    Engine& e = **created;
    if (tp_->rank() != 0) {
      EXPECT_TRUE(e.Follow().ok());
      EXPECT_FALSE(e.Follow().ok()) << "a stopped follower says so";
      continue;
    }
    EXPECT_FALSE(e.Follow().ok()) << "rank 0 leads; it does not follow";
    e.Start();  // the loop thread makes the collectives from here on
    // Requests from several threads at once: greedy ones, unseeded sampled
    // ones (the leader draws their seeds and sends them), one cancelled.
    std::vector<RequestId> greedy_ids(prompts.size()), sampled_ids(2);
    std::vector<std::thread> clients;
    for (size_t i = 0; i < prompts.size(); ++i) {
      clients.emplace_back([&, i] {
        EngineRequest r;
        r.prompt = e.Encode(prompts[i]);
        r.max_tokens = 20;
        r.ignore_eos = true;
        greedy_ids[i] = *e.Submit(r);
      });
    }
    for (size_t i = 0; i < sampled_ids.size(); ++i) {
      clients.emplace_back([&, i] {
        EngineRequest r;
        r.prompt = e.Encode("The little cat");
        r.max_tokens = 16;
        r.ignore_eos = true;
        r.sampling.temperature = 0.9f;
        sampled_ids[i] = *e.Submit(r);
      });
    }
    for (std::thread& t : clients) t.join();
    EngineRequest long_one;
    long_one.prompt = e.Encode("One day");
    long_one.max_tokens = 400;
    long_one.ignore_eos = true;
    const RequestId cancelled = *e.Submit(long_one);
    EXPECT_TRUE(e.Cancel(cancelled));
    for (size_t i = 0; i < prompts.size(); ++i) {
      const RequestResult r = e.Wait(greedy_ids[i]);
      EXPECT_EQ(r.finish, FinishReason::kLength) << r.error.ToString();
      EXPECT_EQ(r.tokens, want[i]) << "request " << i;
    }
    for (RequestId id : sampled_ids) {
      const RequestResult r = e.Wait(id);
      EXPECT_EQ(r.finish, FinishReason::kLength) << "the followers sampled as the leader did: " << r.error.ToString();
      EXPECT_EQ(r.tokens.size(), 16u);
    }
    EXPECT_EQ(e.Wait(cancelled).finish, FinishReason::kCancelled);
    EXPECT_TRUE(e.ResetPrefixCache().ok()) << "a reset reaches the followers' prefix caches in the same step";
    EngineRequest after;
    after.prompt = e.Encode(prompts[0]);
    after.max_tokens = 20;
    after.ignore_eos = true;
    const RequestResult again = e.Wait(*e.Submit(after));
    EXPECT_EQ(again.tokens, want[0]);
    EXPECT_EQ(again.cached_prompt_tokens, 0) << "the reset emptied the prefix cache";
    e.Stop();  // and its followers
  }
}

// KV tiers under sharding. Conversations whose pool cannot keep them
// between turns restore each turn's prefix from a lower tier: each rank's
// tiers hold its shard, under keys of its own (one Redis server and one
// disk path shared by the job; a shard reading another's bytes would fail
// their geometry check and recompute), and the ranks agree on every tier
// answer, also where their tiers hold different blocks (a RAM tier of 6
// blocks on odd ranks, of thousands on the others): the tokens are the
// one-process tokens, and every rank took the same hits.
TEST_F(TensorParallelTest, KvTiersHoldEachRanksShardAndTheRanksAgreeOnTheirAnswers) {
  const std::vector<std::string> openings = {"Once upon a time", "Lily and Ben went to the park", "The little cat",
                                             "One day, a boy named Tom", "Sara had a red ball"};
  constexpr int kTurns = 3;
  struct Run {
    std::vector<std::vector<int32_t>> replies;  // by turn, then conversation
    EngineMetrics metrics;
  };
  auto run = [&](const ModelParallel& parallel, int64_t blocks, const TierOptions& tiers) {
    EngineOptions o;
    o.model_path = kGguf;
    o.block_len = BlockLen(parallel);
    o.num_blocks = blocks;
    o.watermark_blocks = 0;
    o.threads = 1;
    o.prefix_cache = true;
    o.tiers = tiers;
    o.parallel = parallel;
    Run out;
    Result<std::unique_ptr<Engine>> e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return out;
    std::vector<std::vector<int32_t>> prompts;
    for (const std::string& s : openings) prompts.push_back((*e)->Encode(s));
    const std::vector<int32_t> user = (*e)->Encode("Then they");
    for (int t = 0; t < kTurns; ++t) {
      std::vector<RequestId> ids;
      for (size_t c = 0; c < prompts.size(); ++c) {
        if (t > 0) {
          const std::vector<int32_t>& reply = out.replies[out.replies.size() - prompts.size() + c];
          prompts[c].insert(prompts[c].end(), reply.begin(), reply.end());
          prompts[c].insert(prompts[c].end(), user.begin() + 1, user.end());  // without BOS
        }
        EngineRequest r;
        r.prompt = prompts[c];
        r.max_tokens = 20;
        r.ignore_eos = true;
        ids.push_back(*(*e)->Submit(r));
      }
      if (Status st = (*e)->RunUntilIdle(); !st.ok()) {
        ADD_FAILURE() << st.ToString();
        return out;
      }
      for (RequestId id : ids) out.replies.push_back((*e)->Wait(id).tokens);
    }
    (*e)->CheckInvariants();
    out.metrics = (*e)->Metrics();
    return out;
  };
  auto tier_hits = [](const EngineMetrics& m) {
    return m.prefix.tier_hit_blocks[1] + m.prefix.tier_hit_blocks[2] + m.prefix.tier_hit_blocks[3];
  };
  const Run want = run({}, 1024, {});
  // One Redis server and one disk path for the whole job (rank 0's).
  testing::RedisServer redis;
  int64_t shared[2] = {::getpid(), 0};
  if (tp_->rank() == 0) {
    const Status started = redis.Start();
    EXPECT_TRUE(started.ok()) << started.ToString();
    shared[1] = started.ok() ? redis.port() : 0;
  }
  ASSERT_TRUE(tp_->Broadcast(shared, sizeof shared, 0).ok());
  ASSERT_NE(shared[1], 0) << "rank 0 could not start redis-server";
  const std::filesystem::path disk =
      std::filesystem::temp_directory_path() / ("pagekv-tp-tiers-" + std::to_string(shared[0]));
  for (const auto& [split, parallel] : splits_) {
    SCOPED_TRACE(split);
    if (!Splits(kGguf, parallel)) continue;
    const int64_t blocks = 24 / parallel.context_size();  // 192 tokens: a turn fits, the earlier ones do not stay
    struct Case {
      std::string name;
      TierOptions tiers;
    };
    std::vector<Case> cases(3);
    cases[0].name = "RAM, of different sizes";
    cases[0].tiers.host_bytes = tp_->rank() % 2 == 1 ? 64 << 10 : 8 << 20;
    cases[1].name = "disk";
    cases[1].tiers.disk_path = disk.string();
    cases[1].tiers.disk_bytes = 8 << 20;
    cases[2].name = "redis";
    cases[2].tiers.redis_url = "redis://127.0.0.1:" + std::to_string(shared[1]);
    cases[2].tiers.redis_namespace = "pagekv-tp:" + split;  // the job's; each shard's keys go under it
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      const Run got = run(parallel, blocks, c.tiers);
      EXPECT_EQ(got.replies, want.replies);
      const int64_t hits = tier_hits(got.metrics);
      EXPECT_GT(hits, 0) << "no block came back from a lower tier";
      const Result<bool> same = tp_->AllEqual(static_cast<uint64_t>(hits));
      EXPECT_TRUE(same.ok() && *same) << "the ranks took different tier hits";
      ASSERT_TRUE(got.metrics.tiers.has_value());
      for (const TierStats& t : got.metrics.tiers->tiers) EXPECT_EQ(t.corrupt, 0) << t.name << ": another shard's bytes";
      if (c.name == "disk") {
        // One file per shard beside the path given, none at it.
        ASSERT_TRUE(tp_->AllOk(true).ok());  // every rank's engine is gone
        EXPECT_FALSE(std::filesystem::exists(disk));
        int files = 0;
        for (const auto& f : std::filesystem::directory_iterator(disk.parent_path())) {
          const std::string name = f.path().filename().string();
          if (name.rfind(disk.filename().string() + ".", 0) == 0 && name.find(".index") == std::string::npos) ++files;
        }
        EXPECT_EQ(files, tp_->size());
        ASSERT_TRUE(tp_->AllOk(true).ok());
        if (tp_->rank() == 0) {
          for (const auto& f : std::filesystem::directory_iterator(disk.parent_path())) {
            if (f.path().filename().string().rfind(disk.filename().string() + ".", 0) == 0) std::filesystem::remove(f.path());
          }
        }
        ASSERT_TRUE(tp_->AllOk(true).ok());
      }
    }
  }
}

TEST_F(TensorParallelTest, RefusesWhatItDoesNotShard) {
  SynthModelSpec ds = *FindSynthModelPreset("tiny-deepseek2");
  Result<LoadedModel> m = LoadModel(Synth(ds, "f32"), {}, splits_.front().second);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(m.status().message().find("llama and qwen2"), std::string::npos) << m.status().message();
  EngineOptions o;
  o.model_path = kGguf;
  o.parallel = splits_.back().second;  // pipeline stages: stories260K's 5 layers split at any of these sizes
  o.eviction.policy = EvictionPolicy::kStreaming;
  Result<std::unique_ptr<Engine>> e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace pagekv
