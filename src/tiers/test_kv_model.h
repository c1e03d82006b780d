// Test-only: a deterministic stand-in for a model's K/V, for tests of the
// prefix cache and the tiers over a real KvCache. Every row's values depend
// on every token up to its position (as real KV does) and on a salt, so a
// block served for the wrong prefix or tenant shows up as different bytes.
// Shares no code with the cache: rows are written with WriteLayer and read
// back with Read.
#pragma once

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"

namespace pagekv::test_kv {

inline std::unique_ptr<KvCache> MakeCache(int64_t blocks, int32_t block_len) {
  CacheConfig c;
  c.num_layers = 2;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.block_len = block_len;
  c.format = KvFormat::Plain(DType::kF32);
  c.num_blocks = blocks;
  auto cache = KvCache::Create({.config = c, .prefault = false});
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return cache.ok() ? std::move(*cache) : nullptr;
}

inline std::vector<int32_t> Tokens(int32_t first, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

inline float Value(const std::vector<int32_t>& tokens, int64_t pos, int layer, int plane, int head, int elem, int salt) {
  uint64_t h = static_cast<uint64_t>(salt);
  for (int64_t i = 0; i <= pos; ++i) h = h * 31 + static_cast<uint64_t>(tokens[static_cast<size_t>(i)]);
  return static_cast<float>((h % 1000) + layer * 7 + plane * 3 + head * 5 + elem) * 0.5f;
}

// Writes the rows of tokens [from, tokens.size()) at the end of seq.
inline void Compute(KvCache& cache, SeqId seq, const std::vector<int32_t>& tokens, int64_t from, int salt) {
  const KvLayout& l = cache.layout();
  const int64_t n = static_cast<int64_t>(tokens.size()) - from;
  ASSERT_EQ(cache.View(seq)->num_tokens, from);
  ASSERT_TRUE(*cache.Reserve(seq, n));
  for (int layer = 0; layer < l.num_layers(); ++layer) {
    std::vector<float> k(static_cast<size_t>(n * l.num_heads() * l.row_elems())), v(k.size());
    for (int64_t i = 0; i < n; ++i) {
      for (int h = 0; h < l.num_heads(); ++h) {
        for (int e = 0; e < l.row_elems(); ++e) {
          const size_t at = static_cast<size_t>((i * l.num_heads() + h) * l.row_elems() + e);
          k[at] = Value(tokens, from + i, layer, 0, h, e, salt);
          v[at] = Value(tokens, from + i, layer, 1, h, e, salt);
        }
      }
    }
    ASSERT_TRUE(cache.WriteLayer(seq, layer, from, {n, k.data(), v.data()}).ok());
  }
}

// The first token whose cached rows differ from what Compute writes for
// `tokens` (-1 when every cached row of seq is right).
inline int64_t FirstWrongToken(const KvCache& cache, SeqId seq, const std::vector<int32_t>& tokens, int salt) {
  const KvLayout& l = cache.layout();
  const int64_t n = cache.View(seq)->num_tokens;
  const size_t row = static_cast<size_t>(l.num_heads() * l.row_elems());
  std::vector<float> k(static_cast<size_t>(l.num_layers() * n) * row), v(k.size());
  if (!cache.Read(seq, 0, {n, k.data(), v.data()}).ok()) return 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int layer = 0; layer < l.num_layers(); ++layer) {
      for (int h = 0; h < l.num_heads(); ++h) {
        for (int e = 0; e < l.row_elems(); ++e) {
          const size_t at = static_cast<size_t>(layer * n + i) * row + static_cast<size_t>(h * l.row_elems() + e);
          if (k[at] != Value(tokens, i, layer, 0, h, e, salt) || v[at] != Value(tokens, i, layer, 1, h, e, salt)) return i;
        }
      }
    }
  }
  return -1;
}

// Every cached row of seq equals what Compute writes.
inline void ExpectExactKv(const KvCache& cache, SeqId seq, const std::vector<int32_t>& tokens, int salt) {
  EXPECT_EQ(FirstWrongToken(cache, seq, tokens, salt), -1) << "the first token with wrong KV";
}

}  // namespace pagekv::test_kv
