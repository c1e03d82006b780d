// Microbenchmarks of the block pool and the write path.
//
//   BM_AllocateFreePair     one block allocated and released: pairs per second
//   BM_AppendDecodeStep     one decode step (1 token for each of `batch`
//                           sequences) of a 32-layer, 8-KV-head, 128-dim f16
//                           model through KvCache::Append, timed against a
//                           plain memcpy of the same bytes in the same run:
//                           counter `ratio_to_memcpy` = append GB/s / memcpy GB/s.
//                           Also a raw scatter of the same rows to the same
//                           layout offsets in a second buffer (`scatter_GBps`),
//                           which separates the cost of the layout's access
//                           pattern from the cost of the cache's bookkeeping.
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "kvcache/block_pool.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

void BM_AllocateFreePair(benchmark::State& state) {
  BlockPool pool(4096);
  for (auto _ : state) {
    std::optional<BlockId> b = pool.AllocateOne();
    benchmark::DoNotOptimize(b);
    (void)pool.Release(*b);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AllocateFreePair);

void BM_AllocateFreeBatch(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  BlockPool pool(4096);
  std::vector<BlockId> ids;
  ids.reserve(static_cast<size_t>(n));
  for (auto _ : state) {
    ids.clear();
    pool.Allocate(n, ids);
    for (BlockId b : ids) (void)pool.Release(b);
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_AllocateFreeBatch)->Arg(64);

void BM_AppendDecodeStep(benchmark::State& state) {
  const int64_t batch = state.range(0);
  constexpr int64_t kTokensPerSeq = 256;  // each sequence cycles through 2 blocks
  CacheConfig c;
  c.num_layers = 32;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.block_len = 128;
  c.format = KvFormat::Plain(DType::kF16);
  c.num_blocks = batch * 2 + 2;
  auto created = KvCache::Create({.config = c});
  if (!created.ok()) {
    state.SkipWithError(created.status().ToString().c_str());
    return;
  }
  KvCache& cache = **created;
  const int64_t token_bytes = cache.layout().bytes_per_token();  // K and V of one token
  std::vector<uint8_t> k(static_cast<size_t>(token_bytes / 2)), v(k.size());
  std::mt19937 rng(1);
  for (auto& b : k) b = static_cast<uint8_t>(rng());
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  std::vector<SeqId> seqs;
  for (int64_t i = 0; i < batch; ++i) seqs.push_back(cache.AddSequence());
  // The memcpy baseline writes the same bytes into a destination as large as
  // the arena region the appends rotate through.
  std::vector<uint8_t> src(static_cast<size_t>(token_bytes * batch));
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> dst(static_cast<size_t>(token_bytes * batch * kTokensPerSeq));
  std::memset(dst.data(), 0, dst.size());

  // The scatter baseline: same rows, same offsets, a second arena-sized buffer.
  const KvLayout& layout = cache.layout();
  auto* scatter = static_cast<std::byte*>(mmap(nullptr, static_cast<size_t>(layout.total_bytes()),
                                               PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  madvise(scatter, static_cast<size_t>(layout.total_bytes()), MADV_HUGEPAGE);
  std::memset(scatter, 0, static_cast<size_t>(layout.total_bytes()));
  const int64_t row = layout.row_bytes();

  using Clock = std::chrono::steady_clock;
  double append_s = 0, memcpy_s = 0, scatter_s = 0;
  int64_t pos = 0;
  for (auto _ : state) {
    if (pos == kTokensPerSeq) {
      for (SeqId s : seqs) (void)cache.Truncate(s, 0);
      pos = 0;
    }
    const auto t0 = Clock::now();
    for (SeqId s : seqs) {
      if (!*cache.Append(s, {1, k.data(), v.data()})) state.SkipWithError("pool full");
    }
    const auto t1 = Clock::now();
    std::memcpy(dst.data() + pos * batch * token_bytes, src.data(), src.size());
    benchmark::ClobberMemory();
    const auto t2 = Clock::now();
    for (SeqId s : seqs) {
      const SequenceView view = *cache.View(s);
      const int64_t p = view.num_tokens - 1;
      const BlockId b = view.blocks[static_cast<size_t>(p / c.block_len)];
      const auto slot = static_cast<int32_t>(p % c.block_len);
      int64_t r = 0;
      for (int32_t l = 0; l < c.num_layers; ++l)
        for (int32_t pl = 0; pl < 2; ++pl)
          for (int32_t h = 0; h < c.num_kv_heads; ++h, ++r)
            std::memcpy(scatter + layout.RowOffset(l, pl, h, ToInt(b), slot),
                        (pl == 0 ? k.data() : v.data()) + (r % (c.num_kv_heads * c.num_layers)) * row,
                        static_cast<size_t>(row));
    }
    benchmark::ClobberMemory();
    const auto t3 = Clock::now();
    append_s += std::chrono::duration<double>(t1 - t0).count();
    memcpy_s += std::chrono::duration<double>(t2 - t1).count();
    scatter_s += std::chrono::duration<double>(t3 - t2).count();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    ++pos;
  }
  const double bytes = static_cast<double>(state.iterations()) * static_cast<double>(token_bytes * batch);
  state.counters["append_GBps"] = bytes / append_s / 1e9;
  state.counters["memcpy_GBps"] = bytes / memcpy_s / 1e9;
  state.counters["ratio_to_memcpy"] = memcpy_s / append_s;
  state.counters["scatter_GBps"] = bytes / scatter_s / 1e9;
  state.counters["ratio_to_scatter"] = scatter_s / append_s;
  munmap(scatter, static_cast<size_t>(layout.total_bytes()));
  state.counters["bytes_per_step"] = static_cast<double>(token_bytes * batch);
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
}
BENCHMARK(BM_AppendDecodeStep)->Arg(1)->Arg(8)->Arg(32)->UseManualTime();

}  // namespace
}  // namespace pagekv

// main(): src/kernels/bench_main.cc.
