// The llama forward pass over the paged cache against the goldens of the real
// stories260K model: greedy ids, first-step logits and the mean NLL.
#include "engine/forward_step.h"
#include "model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "layout/float16.h"
#include "pagekv/prefix_cache.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace pagekv {
namespace {

constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";

constexpr const char* kBin = "../shared/models/stories260K/stories260K.bin";

struct GoldenCase {
  bool gguf;  // else the llama2.c .bin
  int32_t block_len;
  DType dtype;
};

class LlamaGoldenTest : public ::testing::TestWithParam<GoldenCase> {
 protected:
  void SetUp() override {
    std::ifstream in("../shared/goldens/stories260K.json");
    ASSERT_TRUE(in.good()) << "tests read ../shared/goldens (see README)";
    golden_ = nlohmann::json::parse(in);
    Result<std::unique_ptr<LlamaModel>> model = UnimplementedError("unset");
    if (GetParam().gguf) {
      auto file = GgufFile::Open(kGguf);
      ASSERT_TRUE(file.ok()) << file.status().ToString();
      model = LlamaModel::FromGguf(std::move(*file));
    } else {
      model = LlamaModel::FromLlama2c(kBin);
    }
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(*model);
  }

  std::unique_ptr<KvCache> MakeCache(int32_t block_len, DType dtype) {
    auto cache = KvCache::Create({.config = model_->CacheGeometry(block_len, dtype, 64), .prefault = false});
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    return std::move(*cache);
  }

  static int32_t Argmax(const float* v, int32_t n) {
    return static_cast<int32_t>(std::max_element(v, v + n) - v);  // lowest id on ties
  }

  nlohmann::json golden_;
  std::unique_ptr<LlamaModel> model_;
};

TEST_P(LlamaGoldenTest, GreedyGenerationReproducesTheGoldens) {
  const auto [gguf, block_len, dtype] = GetParam();
  const int32_t vocab = model_->config().vocab_size;
  for (const auto& p : golden_["prompts"]) {
    auto cache = MakeCache(block_len, dtype);
    const SeqId seq = cache->AddSequence();
    const std::vector<int32_t> prompt = p["prompt_ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> want = p["generated_ids"].get<std::vector<int32_t>>();
    std::vector<float> logits(prompt.size() * static_cast<size_t>(vocab));
    ASSERT_TRUE(*ForwardSequence(*model_, *cache, seq, prompt, logits.data()));
    const float* last = logits.data() + (prompt.size() - 1) * static_cast<size_t>(vocab);
    if (dtype == DType::kF32) {
      const std::vector<double> first = p["first_step_full_logits"].get<std::vector<double>>();
      for (int32_t t = 0; t < vocab; ++t) {
        ASSERT_NEAR(last[t], first[static_cast<size_t>(t)], 1e-4 * std::max(1.0, std::fabs(first[static_cast<size_t>(t)])))
            << "token " << t << " of '" << p["prompt"].get<std::string>() << "'";
      }
    }
    std::vector<int32_t> got;
    std::vector<float> step(last, last + vocab);
    const auto& steps = p["steps"];
    for (size_t k = 0; k < want.size(); ++k) {
      if (dtype == DType::kF32 && k < steps.size()) {
        // Per-step top-5 logits within 1e-4 relative.
        const auto ids = steps[k]["top5_ids"].get<std::vector<int32_t>>();
        const auto vals = steps[k]["top5_logits"].get<std::vector<double>>();
        for (size_t i = 0; i < ids.size(); ++i) {
          ASSERT_NEAR(step[static_cast<size_t>(ids[i])], vals[i], 1e-4 * std::max(1.0, std::fabs(vals[i])))
              << "step " << k;
        }
      }
      const int32_t next = Argmax(step.data(), vocab);
      got.push_back(next);
      if (k + 1 == want.size()) break;
      ASSERT_TRUE(*ForwardSequence(*model_, *cache, seq, {&next, 1}, step.data()));
    }
    // f16 and bf16 KV give the same 64 greedy ids as f32 on this model (the
    // smallest golden margin is 0.07, far above 16-bit rounding of K and V).
    EXPECT_EQ(got, want) << p["prompt"].get<std::string>() << " with " << DTypeName(dtype) << " KV";
    cache->CheckInvariants();
  }
}

// The NLL golden is checked with f32 KV (its tolerance, 1e-4, is below what
// 16-bit K and V would keep).
class LlamaNllTest : public LlamaGoldenTest {};

TEST_P(LlamaNllTest, MeanNegativeLogLikelihoodOfTheGoldenText) {
  const auto [gguf, block_len, dtype] = GetParam();
  const std::vector<int32_t> ids = golden_["nll"]["token_ids"].get<std::vector<int32_t>>();
  const auto scored = golden_["nll"]["n_scored"].get<size_t>();
  ASSERT_GE(ids.size(), scored + 1);
  auto cache = MakeCache(block_len, dtype);
  const SeqId seq = cache->AddSequence();
  const int32_t vocab = model_->config().vocab_size;
  std::vector<float> logits(scored * static_cast<size_t>(vocab));
  // Two chunks, split off a block boundary, to exercise chunked prefill.
  const size_t split = 37;
  ASSERT_TRUE(*ForwardSequence(*model_, *cache, seq, std::span<const int32_t>(ids).subspan(0, split), logits.data()));
  ASSERT_TRUE(*ForwardSequence(*model_, *cache, seq, std::span<const int32_t>(ids).subspan(split, scored - split),
                               logits.data() + split * static_cast<size_t>(vocab)));
  double total = 0;
  for (size_t i = 0; i < scored; ++i) {
    const float* l = logits.data() + i * static_cast<size_t>(vocab);
    const double mx = *std::max_element(l, l + vocab);
    double sum = 0;
    for (int32_t t = 0; t < vocab; ++t) sum += std::exp(l[t] - mx);
    total += -(l[ids[i + 1]] - mx - std::log(sum));
  }
  const double want = golden_["nll"]["mean_nll_nats"].get<double>();
  EXPECT_NEAR(total / static_cast<double>(scored), want, 1e-4 * want);
}

INSTANTIATE_TEST_SUITE_P(FilesBlockLensAndDtypes, LlamaGoldenTest,
                         ::testing::Values(GoldenCase{true, 16, DType::kF32}, GoldenCase{true, 128, DType::kF32},
                                           GoldenCase{true, 16, DType::kF16}, GoldenCase{true, 128, DType::kBF16},
                                           GoldenCase{false, 16, DType::kF32}, GoldenCase{false, 128, DType::kF16}),
                         [](const auto& info) {
                           return std::string(info.param.gguf ? "Gguf" : "Llama2c") + "_BlockLen" +
                                  std::to_string(info.param.block_len) + "_" +
                                  std::string(DTypeName(info.param.dtype));
                         });

INSTANTIATE_TEST_SUITE_P(FilesAndBlockLens, LlamaNllTest,
                         ::testing::Values(GoldenCase{true, 16, DType::kF32}, GoldenCase{true, 128, DType::kF32},
                                           GoldenCase{false, 16, DType::kF32}),
                         [](const auto& info) {
                           return std::string(info.param.gguf ? "Gguf" : "Llama2c") + "_BlockLen" +
                                  std::to_string(info.param.block_len);
                         });

TEST(LlamaModelTest, CorruptLlama2cCheckpointsAreErrors) {
  EXPECT_EQ(LlamaModel::FromLlama2c("../shared/models/nope.bin").status().code(), StatusCode::kNotFound);
  // A GGUF file read as a llama2.c header: its magic makes an absurd dim.
  auto r = LlamaModel::FromLlama2c(kGguf);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  // The tokenizer file: a valid-looking small header, but far too short.
  r = LlamaModel::FromLlama2c("../shared/models/stories260K/tok512.bin");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
}

TEST(LlamaModelTest, BadInputIsAnErrorAndLeavesTheSequenceUnchanged) {
  auto file = GgufFile::Open(kGguf);
  ASSERT_TRUE(file.ok());
  auto model = std::move(*LlamaModel::FromGguf(std::move(*file)));
  auto cache = std::move(*KvCache::Create({.config = model->CacheGeometry(16, DType::kF32, 8), .prefault = false}));
  const SeqId seq = cache->AddSequence();
  std::vector<float> logits(512 * 4);
  const std::vector<int32_t> bad = {1, 512};
  EXPECT_EQ(ForwardSequence(*model, *cache, seq, bad, logits.data()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->View(seq)->num_tokens, 0);
  // The pool holds 8 x 16 = 128 tokens: more is a plain "does not fit".
  std::vector<int32_t> many(129, 5);
  std::vector<float> big(129 * 512);
  EXPECT_FALSE(*ForwardSequence(*model, *cache, seq, many, big.data()));
  EXPECT_EQ(cache->View(seq)->num_tokens, 0);
  // A cache of another geometry is refused.
  CacheConfig other = model->CacheGeometry(16, DType::kF32, 8);
  other.num_layers = 2;
  auto wrong = std::move(*KvCache::Create({.config = other, .prefault = false}));
  const SeqId s2 = wrong->AddSequence();
  EXPECT_EQ(ForwardSequence(*model, *wrong, s2, {bad.data(), 1}, logits.data()).status().code(), StatusCode::kInvalidArgument);
}

TEST(LlamaModelTest, ABatchedStepMixingPromptChunksAndDecodesMatchesSeparateCalls) {
  auto file = GgufFile::Open(kGguf);
  ASSERT_TRUE(file.ok());
  auto model = std::move(*LlamaModel::FromGguf(std::move(*file)));
  const int32_t vocab = model->config().vocab_size;
  auto make = [&] { return std::move(*KvCache::Create({.config = model->CacheGeometry(8, DType::kF16, 64), .prefault = false})); };
  auto solo = make(), batched = make();
  const std::vector<int32_t> a = {1, 403, 407, 261, 378, 9, 30}, b = {1, 14, 71}, c = {1, 200, 201, 202, 203, 204, 205, 206, 207, 208};
  std::vector<SeqId> s1, s2;
  for (int i = 0; i < 3; ++i) {
    s1.push_back(solo->AddSequence());
    s2.push_back(batched->AddSequence());
  }
  // Sequence 0 is already 7 tokens long (decodes one), 1 gets a 3-token
  // chunk, 2 a 10-token prompt crossing a block boundary.
  std::vector<float> scratch(10 * static_cast<size_t>(vocab));
  ASSERT_TRUE(*ForwardSequence(*model, *solo, s1[0], a, scratch.data()));
  ASSERT_TRUE(*ForwardSequence(*model, *batched, s2[0], a, scratch.data()));
  const int32_t next = 42;
  std::vector<float> want0(vocab), want1(3 * static_cast<size_t>(vocab)), want2(10 * static_cast<size_t>(vocab));
  ASSERT_TRUE(*ForwardSequence(*model, *solo, s1[0], {&next, 1}, want0.data()));
  ASSERT_TRUE(*ForwardSequence(*model, *solo, s1[1], b, want1.data()));
  ASSERT_TRUE(*ForwardSequence(*model, *solo, s1[2], c, want2.data()));
  std::vector<float> got0(vocab), got1(3 * static_cast<size_t>(vocab)), got2(vocab);
  const std::vector<ForwardItem> items = {{s2[0], {&next, 1}, got0.data(), false},
                                          {s2[1], b, got1.data(), true},
                                          {s2[2], c, got2.data(), false}};
  ForwardTimings timings;
  ASSERT_TRUE(*ForwardStep(*model, *batched, items, {.threads = 0, .timings = &timings}));
  for (int32_t i = 0; i < vocab; ++i) {
    EXPECT_NEAR(got0[i], want0[i], 1e-4f * (1 + std::fabs(want0[i])));
    EXPECT_NEAR(got2[i], want2[9 * static_cast<size_t>(vocab) + i], 1e-4f * (1 + std::fabs(want2[i])));
  }
  for (size_t i = 0; i < got1.size(); ++i) EXPECT_NEAR(got1[i], want1[i], 1e-4f * (1 + std::fabs(want1[i])));
  EXPECT_EQ(batched->View(s2[2])->num_tokens, 10);
  EXPECT_GT(timings.total, 0);
  EXPECT_GT(timings.attention, 0);
  EXPECT_GT(timings.matmul, 0);
  EXPECT_LE(timings.attention + timings.matmul, timings.total);
}

TEST(LlamaModelTest, ABatchedStepIsAllOrNothing) {
  auto file = GgufFile::Open(kGguf);
  ASSERT_TRUE(file.ok());
  auto model = std::move(*LlamaModel::FromGguf(std::move(*file)));
  // 4 blocks of 8 tokens: the first item fits, the second does not.
  auto cache = std::move(*KvCache::Create({.config = model->CacheGeometry(8, DType::kF32, 4), .prefault = false}));
  const SeqId x = cache->AddSequence(), y = cache->AddSequence();
  const std::vector<int32_t> small(9, 5), big(24, 6);
  const std::vector<ForwardItem> items = {{x, small, nullptr, false}, {y, big, nullptr, false}};
  EXPECT_FALSE(*ForwardStep(*model, *cache, items));
  EXPECT_EQ(cache->View(x)->num_tokens, 0);
  EXPECT_EQ(cache->Stats().blocks_used, 0);
  // A bad token in the second item leaves the first untouched too.
  const std::vector<int32_t> bad = {1, 100000};
  const std::vector<ForwardItem> with_bad = {{x, small, nullptr, false}, {y, bad, nullptr, false}};
  EXPECT_EQ(ForwardStep(*model, *cache, with_bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->View(x)->num_tokens, 0);
  // One sequence twice in a step is refused.
  const std::vector<ForwardItem> twice = {{x, small, nullptr, false}, {x, small, nullptr, false}};
  const Status s = ForwardStep(*model, *cache, twice).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("twice"), std::string::npos);
  cache->CheckInvariants();
}

// A failure injected at every (item, layer) store of a step: the cache and
// the prefix cache come back exactly as before it (block tables, the shared
// block a copy-on-write replaced, lengths, reference counts, free and cached
// counts, contents), and the step then runs as if nothing had happened.
TEST(LlamaModelTest, AStepThatFailsAtAnyStoreLeavesTheCacheExactlyAsBefore) {
  auto file = GgufFile::Open(kGguf);
  ASSERT_TRUE(file.ok());
  auto model = std::move(*LlamaModel::FromGguf(std::move(*file)));
  const int32_t layers = model->config().num_layers, vocab = model->config().vocab_size;
  auto make = [&] { return std::move(*KvCache::Create({.config = model->CacheGeometry(8, DType::kF16, 32), .prefault = false})); };
  auto cache = make();
  auto prefix = std::move(*PrefixCache::Create(*cache, {}));
  // A finished request's published blocks (cached, free); A with a shared
  // partial block forked to B; C new.
  std::vector<int32_t> done(16);
  for (size_t i = 0; i < done.size(); ++i) done[i] = static_cast<int32_t>(1 + 11 * i % 400);
  const PrefixCache::Admitted d = *prefix->AddSequence(done, {}, "done");
  ASSERT_TRUE(*ForwardSequence(*model, *cache, d.seq, done, nullptr));
  ASSERT_TRUE(prefix->Publish(d.seq, done).ok());
  ASSERT_TRUE(prefix->Free(d.seq).ok());
  const std::vector<int32_t> a_prompt = {1, 403, 407, 261, 378, 9, 30, 41, 52, 63, 74, 85};
  const SeqId a = cache->AddSequence();
  ASSERT_TRUE(*ForwardSequence(*model, *cache, a, a_prompt, nullptr));
  const SeqId b = *cache->Fork(a);
  const SeqId c = cache->AddSequence();
  const std::vector<int32_t> ta = {7, 8, 9}, tb = {10, 11}, tc = {1, 200, 201, 202, 203, 204, 205, 206, 207, 208};
  auto snapshot = [&] {
    std::vector<int64_t> out = {cache->FreeBlockCount(), cache->CachedFreeBlockCount(), prefix->Stats().cached_blocks,
                                prefix->Stats().evicted};
    for (SeqId s : {a, b, c}) {
      const SequenceView v = *cache->View(s);
      out.push_back(v.num_tokens);
      for (BlockId blk : v.blocks) {
        out.push_back(ToInt(blk));
        out.push_back(cache->BlockRefCount(blk));
      }
    }
    return out;
  };
  auto contents = [&](SeqId s) {
    const KvLayout& l = cache->layout();
    const int64_t n = cache->View(s)->num_tokens;
    std::vector<std::byte> k(static_cast<size_t>(l.num_layers() * n * l.num_heads() * l.row_bytes())), v(k.size());
    EXPECT_TRUE(cache->Read(s, 0, {n, k.data(), v.data()}).ok());
    k.insert(k.end(), v.begin(), v.end());
    return k;
  };
  const std::vector<int64_t> before = snapshot();
  const std::vector<std::byte> a_kv = contents(a), b_kv = contents(b);
  std::vector<float> la(vocab), lb(vocab), lc(vocab);
  const std::vector<ForwardItem> items = {{a, ta, la.data(), false}, {b, tb, lb.data(), false}, {c, tc, lc.data(), false}};
  for (size_t item = 0; item < items.size(); ++item) {
    for (int32_t layer = 0; layer < layers; ++layer) {
      const StepFault fault = [&](size_t i, int32_t l) {
        return i == item && l == layer ? InternalError("injected") : Status::Ok();
      };
      const Result<bool> r = ForwardStep(*model, *cache, items, {}, &fault);
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().message(), "injected");
      EXPECT_EQ(snapshot(), before) << "item " << item << " layer " << layer;
      EXPECT_EQ(contents(a), a_kv);
      EXPECT_EQ(contents(b), b_kv);
      cache->CheckInvariants();
      prefix->CheckInvariants();
    }
  }
  // The step itself, after all that, gives what it gives on a cache that
  // never failed.
  ASSERT_TRUE(*ForwardStep(*model, *cache, items));
  auto clean = make();
  const SeqId ca = clean->AddSequence();
  ASSERT_TRUE(*ForwardSequence(*model, *clean, ca, a_prompt, nullptr));
  const SeqId cb = *clean->Fork(ca);
  const SeqId cc = clean->AddSequence();
  std::vector<float> wa(vocab), wb(vocab), wc(vocab);
  const std::vector<ForwardItem> again = {{ca, ta, wa.data(), false}, {cb, tb, wb.data(), false}, {cc, tc, wc.data(), false}};
  ASSERT_TRUE(*ForwardStep(*model, *clean, again));
  EXPECT_EQ(la, wa);
  EXPECT_EQ(lb, wb);
  EXPECT_EQ(lc, wc);
}

TEST(LlamaModelTest, AStepThatDoesNotFitEvictsNoPrefixCacheBlocks) {
  auto file = GgufFile::Open(kGguf);
  ASSERT_TRUE(file.ok());
  auto model = std::move(*LlamaModel::FromGguf(std::move(*file)));
  auto cache = std::move(*KvCache::Create({.config = model->CacheGeometry(8, DType::kF32, 8), .prefault = false}));
  auto prefix = std::move(*PrefixCache::Create(*cache, {}));
  // A finished request leaves 3 published blocks cached (free, evictable).
  std::vector<int32_t> done(24);
  for (size_t i = 0; i < done.size(); ++i) done[i] = static_cast<int32_t>(1 + 7 * i % 400);
  const PrefixCache::Admitted a = *prefix->AddSequence(done, {}, "done");
  ASSERT_TRUE(*ForwardSequence(*model, *cache, a.seq, done, nullptr));
  ASSERT_TRUE(prefix->Publish(a.seq, done).ok());
  ASSERT_TRUE(prefix->Free(a.seq).ok());
  ASSERT_EQ(cache->CachedFreeBlockCount(), 3);
  // 7 blocks for x (5 plain + 2 cached ones) and 2 for y: 9 > 8. Reserving
  // x first would evict two cached blocks before y is found not to fit.
  const SeqId x = cache->AddSequence(), y = cache->AddSequence();
  const std::vector<int32_t> xs(56, 5), ys(16, 6);
  const std::vector<ForwardItem> items = {{x, xs, nullptr, false}, {y, ys, nullptr, false}};
  EXPECT_FALSE(*ForwardStep(*model, *cache, items));
  EXPECT_EQ(cache->CachedFreeBlockCount(), 3);
  EXPECT_EQ(prefix->Stats().evicted, 0);
  EXPECT_EQ(cache->View(x)->num_tokens, 0);
  EXPECT_EQ(cache->View(y)->num_tokens, 0);
  // A prompt that continues it still hits all three blocks.
  std::vector<int32_t> more = done;
  more.push_back(9);
  EXPECT_EQ(prefix->AddSequence(more, {}, "again")->match.num_tokens, 24);
  cache->CheckInvariants();
}

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {

// stories260K re-encoded with its matrices (and, for f16, its norms) in
// another GGUF type, through GgufWriter.
std::string Reencode(const GgufFile& f, GgmlType to) {
  GgufWriter w;
  for (const auto& [key, v] : f.metadata()) EXPECT_TRUE(w.AddValue(key, v).ok()) << key;
  for (const GgufTensor& t : f.tensors()) {
    const auto* x = reinterpret_cast<const float*>(t.data);
    const bool matrix = t.dims.size() == 2;
    if (to == GgmlType::kF16) {
      std::vector<uint16_t> h(static_cast<size_t>(t.num_elements));
      for (size_t i = 0; i < h.size(); ++i) h[i] = F32ToF16(x[i]);
      w.AddTensor(t.name, GgmlType::kF16, t.dims, h.data(), h.size() * 2);
    } else if (to == GgmlType::kQ8_0 && matrix && t.dims[0] % 32 == 0) {
      std::vector<std::byte> q(static_cast<size_t>(t.num_elements / 32 * 34));
      EncodeQ8_0(x, t.num_elements, q.data());
      w.AddTensor(t.name, GgmlType::kQ8_0, t.dims, q.data(), q.size());
    } else {
      w.AddTensor(t.name, GgmlType::kF32, t.dims, t.data, static_cast<size_t>(t.num_bytes));
    }
  }
  return w.Finish();
}

TEST(LlamaWeightTypesTest, F16AndQ8_0WeightsTrackTheF32Model) {
  std::ifstream in("../shared/goldens/stories260K.json");
  const auto golden = nlohmann::json::parse(in)["prompts"][0];
  auto f32_file = std::move(*GgufFile::Open(kGguf));
  const std::vector<int32_t> prompt = golden["prompt_ids"].get<std::vector<int32_t>>();
  const std::vector<double> want = golden["first_step_full_logits"].get<std::vector<double>>();
  for (GgmlType type : {GgmlType::kF16, GgmlType::kQ8_0}) {
    auto file = GgufFile::FromBytes(Reencode(*f32_file, type));
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    auto model = LlamaModel::FromGguf(std::move(*file));
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    auto cache = std::move(*KvCache::Create({.config = (*model)->CacheGeometry(16, DType::kF32, 16), .prefault = false}));
    const SeqId seq = cache->AddSequence();
    std::vector<float> logits(prompt.size() * 512);
    ASSERT_TRUE(*ForwardSequence(**model, *cache, seq, prompt, logits.data()));
    const float* last = logits.data() + (prompt.size() - 1) * 512;
    double worst = 0;
    for (int32_t t = 0; t < 512; ++t) worst = std::max(worst, std::fabs(last[t] - want[static_cast<size_t>(t)]));
    // Rounding the weights moves the logits by about 2^-11 (f16) or 2^-8
    // (q8_0) of their scale; both keep the golden's first greedy token.
    EXPECT_LT(worst, type == GgmlType::kF16 ? 0.02 : 0.2) << GgmlTypeName(static_cast<uint32_t>(type));
    EXPECT_EQ(std::max_element(last, last + 512) - last, golden["generated_ids"][0].get<int>());
  }
}

}  // namespace
}  // namespace pagekv
