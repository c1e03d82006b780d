// Test helpers shared by the KvCache test files: a small cache geometry and
// a cache built from it.
#pragma once

#include <memory>

#include <gtest/gtest.h>

#include "pagekv/kv_cache.h"

namespace pagekv {

inline CacheConfig Config(int32_t block_len, DType dtype, int64_t num_blocks, int32_t layers = 3,
                   int32_t kv_heads = 2, int32_t head_dim = 16) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_q_heads = kv_heads * 2;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.block_len = block_len;
  c.format = KvFormat::Plain(dtype);
  c.num_blocks = num_blocks;
  return c;
}

inline std::unique_ptr<KvCache> MakeCache(const CacheConfig& c) {
  auto cache = KvCache::Create({.config = c, .huge_pages = false, .prefault = true});
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return std::move(*cache);
}

}  // namespace pagekv
