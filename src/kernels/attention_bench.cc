// Hot-loop microbenchmarks of the attention kernels, one thread, so the
// figure is the kernel's compute cost without memory stalls.
//   BM_DecodeHot: one sequence, one KV head, 1024 tokens (L2-resident), f32,
//     f16, bf16 and int8 rows.
//     Counters: ns_per_token (per KV head), and the f32 GFLOP/s that
//     implies (4 * G * head_dim flops per token).
//   BM_DecodeHotBf16Widened / BM_DecodeHotBf16Dot: BM_DecodeHot's bf16 rows
//     with the AVX-512 BF16 dot products turned off / on (where the CPU has
//     them), whichever the CPU's default is.
//   BM_DecodeHotNoAmx: the same bf16 and f16 rows with AMX tiles turned off.
//   BM_PrefillHot: one sequence's last chunk of 512 queries over a prefix of
//     512 cached tokens plus themselves (causal), head_dim 64 or 128, one
//     KV head, f16. Counter: GFLOP/s (4 * head_dim flops per query row and
//     visible token). BM_PrefillHotNoAmx: the same without AMX tiles.
// docs/PERFORMANCE.md quotes these.
#include <chrono>
#include <cstring>
#include <vector>

#include <benchmark/benchmark.h>

#include "kernels/amx_attention.h"
#include "kernels/attention_kernel.h"
#include "layout/float16.h"
#include "pagekv/attention.h"

namespace pagekv {
namespace {

// One layer, one KV head with `group` query heads.
KvLayout OneHead(int32_t group, int32_t head_dim, int32_t block_len, DType dtype, int64_t blocks) {
  CacheConfig c;
  c.num_layers = 1;
  c.num_kv_heads = 1;
  c.num_q_heads = group;
  c.head_dim = head_dim;
  c.block_len = block_len;
  c.format = dtype == DType::kInt8 ? KvFormat::Int8(head_dim) : KvFormat::Plain(dtype);
  c.num_blocks = blocks;
  return *KvLayout::Create(c);
}

void DecodeHot(benchmark::State& state, int32_t group, DType dtype) {
  constexpr int32_t kHeadDim = 128, kBlockLen = 128, kBlocks = 8;
  const KvLayout layout = OneHead(group, kHeadDim, kBlockLen, dtype, kBlocks);
  std::vector<float> storage(static_cast<size_t>(layout.total_bytes() / 4 + 16));
  auto* arena = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  const int64_t elems = layout.total_bytes() / (DTypeBits(dtype) / 8);
  for (int64_t i = 0; i < elems; ++i) {
    const float x = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
    if (dtype == DType::kInt8) {
      // Bytes whose every 2-byte view is a normal f16 (the rows' scales
      // among them): 0x30 - 0x3f.
      arena[i] = static_cast<std::byte>(0x30 + (i * 37) % 16);
    } else if (dtype == DType::kF32) {
      std::memcpy(arena + 4 * i, &x, 4);
    } else {
      const uint16_t h = dtype == DType::kF16 ? F32ToF16(x) : F32ToBF16(x);
      std::memcpy(arena + 2 * i, &h, 2);
    }
  }
  std::vector<BlockId> table;
  for (int32_t b = kBlocks - 1; b >= 0; --b) table.push_back(BlockId{b});
  const DecodeSeq seq{table, kBlocks * kBlockLen};
  std::vector<float> q(static_cast<size_t>(group * kHeadDim), 0.01f), out(q.size());
  AttentionOptions opts;
  opts.num_threads = 1;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (!PagedDecodeAttention({&layout, arena, 0}, {&seq, 1}, q.data(), out.data(), opts).ok()) {
      state.SkipWithError("attention failed");
    }
    benchmark::DoNotOptimize(out.data());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double tokens = static_cast<double>(state.iterations()) * seq.num_tokens;
  state.counters["ns_per_token"] = seconds / tokens * 1e9;
  state.counters["gflops"] = tokens * 4.0 * group * kHeadDim / seconds / 1e9;
  state.SetLabel(std::string(DTypeName(dtype)) + " G=" + std::to_string(group));
}

void BM_DecodeHot(benchmark::State& state) {
  DecodeHot(state, static_cast<int32_t>(state.range(0)), static_cast<DType>(state.range(1)));
}
BENCHMARK(BM_DecodeHot)
    ->ArgsProduct({{1, 4, 8, 16}, {static_cast<int64_t>(DType::kF32), static_cast<int64_t>(DType::kF16),
                                   static_cast<int64_t>(DType::kBF16), static_cast<int64_t>(DType::kInt8)}});

// bf16 widened to f32 and run through FMAs, where the CPU would otherwise
// use AVX-512 BF16 dot products (BM_DecodeHot's bf16 rows): the two paths in
// one run.
void BM_DecodeHotBf16Widened(benchmark::State& state) {
  kernels::SetBf16DotForTest(false);
  DecodeHot(state, static_cast<int32_t>(state.range(0)), DType::kBF16);
  kernels::ClearBf16DotForTest();
}
BENCHMARK(BM_DecodeHotBf16Widened)->Arg(1)->Arg(4)->Arg(8);

// And through the dot products, wherever the CPU has them (the default on
// AMD, not on Intel: kernels::Bf16DotEnabled).
void BM_DecodeHotBf16Dot(benchmark::State& state) {
  if (!kernels::SetBf16DotForTest(true)) state.SkipWithError("no AVX-512 BF16 here");
  DecodeHot(state, static_cast<int32_t>(state.range(0)), DType::kBF16);
  kernels::ClearBf16DotForTest();
}
BENCHMARK(BM_DecodeHotBf16Dot)->Arg(1)->Arg(4)->Arg(8);

// BM_DecodeHot's bf16 rows without AMX tiles (where the CPU has them): the
// vector kernel, for comparison with the tile path in one run.
void BM_DecodeHotNoAmx(benchmark::State& state) {
  kernels::SetAmxForTest(false);
  DecodeHot(state, static_cast<int32_t>(state.range(0)), static_cast<DType>(state.range(1)));
  kernels::SetAmxForTest(true);
}
BENCHMARK(BM_DecodeHotNoAmx)
    ->ArgsProduct({{4, 8, 16}, {static_cast<int64_t>(DType::kF16), static_cast<int64_t>(DType::kBF16)}});

void PrefillHot(benchmark::State& state) {
  const auto group = static_cast<int32_t>(state.range(0));
  const auto head_dim = static_cast<int32_t>(state.range(1));
  constexpr int32_t kBlockLen = 16, kPrefix = 512, kQueries = 512;
  constexpr int32_t kTokens = kPrefix + kQueries, kBlocks = kTokens / kBlockLen;
  const KvLayout layout = OneHead(group, head_dim, kBlockLen, DType::kF16, kBlocks);
  std::vector<uint16_t> arena(static_cast<size_t>(layout.total_bytes() / 2));
  for (size_t i = 0; i < arena.size(); ++i) arena[i] = F32ToF16(static_cast<float>((i * 37) % 101) / 101.0f - 0.5f);
  std::vector<BlockId> table;
  for (int32_t b = kBlocks - 1; b >= 0; --b) table.push_back(BlockId{b});
  const PrefillSeq seq{table, kTokens, kQueries};
  std::vector<float> q(static_cast<size_t>(kQueries) * group * head_dim, 0.01f), out(q.size());
  AttentionOptions opts;
  opts.num_threads = 1;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (!PagedPrefillAttention({&layout, reinterpret_cast<std::byte*>(arena.data()), 0}, {&seq, 1}, q.data(), out.data(), opts).ok()) {
      state.SkipWithError("attention failed");
    }
    benchmark::DoNotOptimize(out.data());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Query i (0-based in the chunk) sees kPrefix + i + 1 tokens.
  const double pairs = static_cast<double>(kQueries) * kPrefix + kQueries * (kQueries + 1) / 2.0;
  state.counters["gflops"] = static_cast<double>(state.iterations()) * pairs * group * 4.0 * head_dim / seconds / 1e9;
  state.SetLabel("f16 G=" + std::to_string(group) + " head_dim " + std::to_string(head_dim));
}
void BM_PrefillHot(benchmark::State& state) { PrefillHot(state); }
BENCHMARK(BM_PrefillHot)->ArgsProduct({{1, 2, 8}, {64, 128}});

void BM_PrefillHotNoAmx(benchmark::State& state) {
  kernels::SetAmxForTest(false);
  PrefillHot(state);
  kernels::SetAmxForTest(true);
}
BENCHMARK(BM_PrefillHotNoAmx)->ArgsProduct({{1, 2, 8}, {64, 128}});

}  // namespace
}  // namespace pagekv

// main(): src/kernels/bench_main.cc.
