// Partial attention (context parallel): each part reads only some blocks of
// a sequence (its table holds kNoBlock for the others) and gives each row's
// log-sum-exp; MergeAttentionParts must give back the attention over every
// block: against the one-call result and the double-precision reference, on
// every SIMD target, for decode (whole sequences and flash-decoding chunks,
// some of which read nothing) and chunked prefill (queries that see no block
// of a part), parts that hold nothing of a sequence, and every format the
// partial path reads.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention_kernel.h"
#include "kernels/paged_fixture.h"
#include "pagekv/attention.h"
#include "testing/reference_attention.h"

namespace pagekv {
namespace {

using testing::PagedFixture;
using testing::RandomQ;
using testing::Tolerance;

class PartialAttentionTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { kernels::SetTargetForTest(GetParam()); }
  void TearDown() override { kernels::SetTargetForTest(0); }
};

// The parts' tables: block i of every sequence goes to part owner(seq, i);
// the others see kNoBlock there.
std::vector<std::vector<std::vector<BlockId>>> SplitTables(const PagedFixture& f, size_t seqs, int parts,
                                                           const std::vector<std::vector<int>>& owner) {
  std::vector<std::vector<std::vector<BlockId>>> t(static_cast<size_t>(parts), std::vector<std::vector<BlockId>>(seqs));
  for (size_t s = 0; s < seqs; ++s) {
    const std::span<const BlockId> table = f.Table(s);
    for (int p = 0; p < parts; ++p) {
      for (size_t i = 0; i < table.size(); ++i) {
        t[static_cast<size_t>(p)][s].push_back(owner[s][i] == p ? table[i] : kNoBlock);
      }
    }
  }
  return t;
}

// Owners: striped (i % parts), random, and everything on part 0 for the
// last sequence (the other parts hold nothing of it).
std::vector<std::vector<int>> Owners(const std::vector<int64_t>& lengths, int32_t block_len, int parts, bool striped,
                                     std::mt19937& rng) {
  std::vector<std::vector<int>> owner;
  std::uniform_int_distribution<int> pick(0, parts - 1);
  for (size_t s = 0; s < lengths.size(); ++s) {
    std::vector<int>& o = owner.emplace_back();
    for (int64_t i = 0; i < (lengths[s] + block_len - 1) / block_len; ++i) {
      o.push_back(s + 1 == lengths.size() ? 0 : striped ? static_cast<int>(i % parts) : pick(rng));
    }
  }
  return owner;
}

double MaxRelDiff(const float* a, const float* b, int64_t rows, int32_t d) {
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double scale = 1e-30, diff = 0;
    for (int32_t x = 0; x < d; ++x) {
      scale = std::max(scale, std::fabs(static_cast<double>(b[r * d + x])));
      diff = std::max(diff, std::fabs(static_cast<double>(a[r * d + x]) - b[r * d + x]));
      if (std::isnan(a[r * d + x])) return std::numeric_limits<double>::infinity();
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

struct Shape {
  int32_t q_heads, kv_heads, head_dim;
};

TEST_P(PartialAttentionTest, DecodePartsMergeToTheWholeAttention) {
  uint32_t seed = 11;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kInt8}) {
    for (Shape s : {Shape{4, 4, 64}, Shape{8, 2, 128}, Shape{6, 3, 13}}) {
      for (int parts : {2, 3}) {
        for (bool striped : {true, false}) {
          for (int64_t split : {int64_t{0}, int64_t{16}}) {
            const int32_t bl = 16;
            const std::vector<int64_t> lengths = {1, bl - 1, bl + 1, 7 * bl + 5, 40 * bl, 3 * bl + 2};
            PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, bl, dtype, lengths, seed++);
            const auto owner = Owners(lengths, bl, parts, striped, f.rng());
            const auto tables = SplitTables(f, lengths.size(), parts, owner);
            const size_t per_seq = static_cast<size_t>(s.q_heads) * s.head_dim;
            const std::vector<float> q = RandomQ(f.rng(), per_seq * lengths.size());
            const int64_t rows = static_cast<int64_t>(lengths.size()) * s.q_heads;
            AttentionOptions whole_opts;
            whole_opts.split_tokens = split;
            std::vector<float> whole(q.size(), std::nanf("")), whole_lse(static_cast<size_t>(rows), std::nanf(""));
            whole_opts.lse = whole_lse.data();
            std::vector<DecodeSeq> seqs;
            for (size_t i = 0; i < lengths.size(); ++i) seqs.push_back({f.Table(i), lengths[i]});
            ASSERT_TRUE(PagedDecodeAttention(f.Kv(0), seqs, q.data(), whole.data(), whole_opts).ok());
            std::vector<std::vector<float>> outs(static_cast<size_t>(parts)), lses(static_cast<size_t>(parts));
            for (int p = 0; p < parts; ++p) {
              std::vector<DecodeSeq> part;
              for (size_t i = 0; i < lengths.size(); ++i) part.push_back({tables[static_cast<size_t>(p)][i], lengths[i]});
              outs[static_cast<size_t>(p)].assign(q.size(), std::nanf(""));
              lses[static_cast<size_t>(p)].assign(static_cast<size_t>(rows), std::nanf(""));
              AttentionOptions o;
              o.partial = true;
              o.split_tokens = split;
              o.lse = lses[static_cast<size_t>(p)].data();
              const Status st = PagedDecodeAttention(f.Kv(0), part, q.data(), outs[static_cast<size_t>(p)].data(), o);
              ASSERT_TRUE(st.ok()) << st.ToString();
              // The last sequence is all part 0's: the others read nothing of it.
              if (p > 0) {
                const size_t last = lengths.size() - 1;
                for (int32_t h = 0; h < s.q_heads; ++h) {
                  EXPECT_EQ(lses[static_cast<size_t>(p)][last * static_cast<size_t>(s.q_heads) + static_cast<size_t>(h)],
                            -std::numeric_limits<float>::infinity());
                }
                for (size_t x = last * per_seq; x < (last + 1) * per_seq; ++x) EXPECT_EQ(outs[static_cast<size_t>(p)][x], 0.0f);
              }
            }
            std::vector<const float*> op, lp;
            for (int p = 0; p < parts; ++p) {
              op.push_back(outs[static_cast<size_t>(p)].data());
              lp.push_back(lses[static_cast<size_t>(p)].data());
            }
            std::vector<float> merged(q.size(), std::nanf("")), merged_lse(static_cast<size_t>(rows));
            MergeAttentionParts(op, lp, rows, s.head_dim, merged.data(), merged_lse.data());
            const std::string what = std::string(DTypeName(dtype)) + " " + std::to_string(s.q_heads) + "/" +
                                     std::to_string(s.kv_heads) + "x" + std::to_string(s.head_dim) + " parts " +
                                     std::to_string(parts) + (striped ? " striped" : " random") + " split " +
                                     std::to_string(split);
            EXPECT_LE(MaxRelDiff(merged.data(), whole.data(), rows, s.head_dim), 2e-5) << what;
            for (int64_t r = 0; r < rows; ++r) {
              EXPECT_NEAR(merged_lse[static_cast<size_t>(r)], whole_lse[static_cast<size_t>(r)],
                          1e-4 * std::max(1.0f, std::fabs(whole_lse[static_cast<size_t>(r)])))
                  << what << " row " << r;
            }
            for (size_t i = 0; i < lengths.size(); ++i) {
              const std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(i * per_seq),
                                           q.begin() + static_cast<std::ptrdiff_t>((i + 1) * per_seq));
              const std::vector<double> ref = testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, qd, 1,
                                                                          f.K(i, 0), f.V(i, 0), lengths[i]);
              EXPECT_LE(testing::MaxRowRelError(merged.data() + i * per_seq, ref, s.q_heads, s.head_dim), Tolerance(dtype))
                  << what << " sequence " << i;
            }
          }
        }
      }
    }
  }
}

TEST_P(PartialAttentionTest, ChunkedPrefillPartsMergeToTheWholeAttention) {
  uint32_t seed = 500;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (Shape s : {Shape{4, 2, 64}, Shape{8, 1, 32}}) {
      for (int parts : {2, 4}) {
        const int32_t bl = 8;
        // Whole prompts and trailing chunks starting anywhere in a block:
        // early queries see no block of the later parts.
        const std::vector<int64_t> lengths = {5, 3 * bl, 6 * bl + 3, 9 * bl + 1};
        const std::vector<int64_t> queries = {5, 3 * bl, 2 * bl + 5, 1};
        PagedFixture f(1, s.q_heads, s.kv_heads, s.head_dim, bl, dtype, lengths, seed++);
        const auto owner = Owners(lengths, bl, parts, /*striped=*/true, f.rng());
        const auto tables = SplitTables(f, lengths.size(), parts, owner);
        const size_t per_query = static_cast<size_t>(s.q_heads) * s.head_dim;
        int64_t total_q = 0;
        for (int64_t n : queries) total_q += n;
        const std::vector<float> q = RandomQ(f.rng(), per_query * static_cast<size_t>(total_q));
        const int64_t rows = total_q * s.q_heads;
        std::vector<std::vector<float>> outs(static_cast<size_t>(parts)), lses(static_cast<size_t>(parts));
        for (int p = 0; p < parts; ++p) {
          std::vector<PrefillSeq> part;
          for (size_t i = 0; i < lengths.size(); ++i) part.push_back({tables[static_cast<size_t>(p)][i], lengths[i], queries[i]});
          outs[static_cast<size_t>(p)].assign(q.size(), std::nanf(""));
          lses[static_cast<size_t>(p)].assign(static_cast<size_t>(rows), std::nanf(""));
          AttentionOptions o;
          o.partial = true;
          o.lse = lses[static_cast<size_t>(p)].data();
          const Status st = PagedPrefillAttention(f.Kv(0), part, q.data(), outs[static_cast<size_t>(p)].data(), o);
          ASSERT_TRUE(st.ok()) << st.ToString();
        }
        std::vector<const float*> op, lp;
        for (int p = 0; p < parts; ++p) {
          op.push_back(outs[static_cast<size_t>(p)].data());
          lp.push_back(lses[static_cast<size_t>(p)].data());
        }
        // Merged in place into part 0's buffer (the caller's usual case).
        MergeAttentionParts(op, lp, rows, s.head_dim, outs[0].data());
        size_t at = 0;
        for (size_t i = 0; i < lengths.size(); ++i) {
          const std::vector<double> qd(q.begin() + static_cast<std::ptrdiff_t>(at * per_query),
                                       q.begin() + static_cast<std::ptrdiff_t>((at + static_cast<size_t>(queries[i])) * per_query));
          const std::vector<double> ref = testing::ReferenceAttention({s.q_heads, s.kv_heads, s.head_dim, 0, 0}, qd,
                                                                      queries[i], f.K(i, 0), f.V(i, 0), lengths[i]);
          EXPECT_LE(testing::MaxRowRelError(outs[0].data() + at * per_query, ref, queries[i] * s.q_heads, s.head_dim),
                    Tolerance(dtype))
              << DTypeName(dtype) << " parts " << parts << " sequence " << i;
          at += static_cast<size_t>(queries[i]);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, PartialAttentionTest, ::testing::ValuesIn(kernels::SupportedTargets()),
                         [](const ::testing::TestParamInfo<int64_t>& i) { return kernels::TargetName(i.param); });

TEST(PartialAttention, HolesAreErrorsUnlessPartialAndWeightsAreRefused) {
  PagedFixture f(1, 4, 2, 16, 8, DType::kF32, {20}, 3);
  std::vector<BlockId> table(f.Table(0).begin(), f.Table(0).end());
  table[1] = kNoBlock;
  std::vector<float> q(4 * 16, 0.5f), out(q.size());
  std::vector<DecodeSeq> seqs = {{table, 20}};
  Status st = PagedDecodeAttention(f.Kv(0), seqs, q.data(), out.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << "a hole is a bad table unless the call is partial";
  AttentionOptions o;
  o.partial = true;
  EXPECT_TRUE(PagedDecodeAttention(f.Kv(0), seqs, q.data(), out.data(), o).ok());
  std::vector<float> scores(2 * 20, 0.0f);
  seqs[0].scores = scores.data();
  st = PagedDecodeAttention(f.Kv(0), seqs, q.data(), out.data(), o);
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented) << st.ToString();
}

TEST(MergeAttentionParts, WeighsPartsByTheirLogSumExpAndKeepsEmptyRowsZero) {
  // Two rows of d = 2: row 0 from both parts, row 1 from neither.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> a = {1, 2, 7, 7}, b = {3, 6, 9, 9};
  const std::vector<float> la = {std::log(1.0f), -inf}, lb = {std::log(3.0f), -inf};
  std::vector<float> out(4, std::nanf("")), lse(2);
  const std::vector<const float*> outs = {a.data(), b.data()}, lses = {la.data(), lb.data()};
  MergeAttentionParts(outs, lses, 2, 2, out.data(), lse.data());
  EXPECT_FLOAT_EQ(out[0], (1 * 1 + 3 * 3) / 4.0f);
  EXPECT_FLOAT_EQ(out[1], (2 * 1 + 6 * 3) / 4.0f);
  EXPECT_FLOAT_EQ(lse[0], std::log(4.0f));
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_EQ(out[3], 0.0f);
  EXPECT_EQ(lse[1], -inf);
}

}  // namespace
}  // namespace pagekv
