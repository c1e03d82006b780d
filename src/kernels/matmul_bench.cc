// Weight-product benchmarks at the shapes of the llama-110m synthetic model:
// PageKV's Highway MatMul for every weight type, and, when the build found
// OpenBLAS, cblas_sgemm on the same f32 product, so the choice recorded in
// docs/ARCHITECTURE.md can be re-measured. Counters: weight GB/s (the bound
// with few tokens) and GFLOP/s (the bound with many). Both run on every
// hardware thread.
#include <random>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "kernels/amx_matmul.h"
#include "kernels/matmul.h"
#include "layout/float16.h"

#ifdef PAGEKV_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace pagekv {
namespace {

struct Shape {
  int64_t rows, cols;
};
// llama-110m's products, then small-16k's (the serving benchmark's model).
constexpr Shape kShapes[] = {{768, 768}, {2560, 768}, {768, 2560}, {32000, 768}, {256, 256}, {768, 256}, {256, 768}, {32000, 256}};

std::vector<float> Random(int64_t n) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

void Counters(benchmark::State& state, int64_t weight_bytes, double flops) {
  state.counters["weight_GBps"] =
      benchmark::Counter(static_cast<double>(weight_bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOPs"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_MatMul(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int64_t tokens = state.range(1);
  // 0-3: row-major f32, f16, bf16, q8_0; 4, 5: f32, f16 in panels (PackedWeights).
  const bool panels = state.range(2) >= 4;
  const auto type = static_cast<WeightType>(panels ? state.range(2) - 4 : state.range(2));
  const std::vector<float> w = Random(s.rows * s.cols);
  std::vector<std::byte> bytes(static_cast<size_t>(s.rows * WeightRowBytes(type, s.cols)));
  for (int64_t i = 0; i < s.rows * s.cols; ++i) {
    const float x = w[static_cast<size_t>(i)];
    if (type == WeightType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else if (type == WeightType::kQ8_0) {
      if (i % 32 == 0) {
        const uint16_t h = F32ToF16(1.0f / 127);
        std::memcpy(bytes.data() + i / 32 * 34, &h, 2);
      }
      bytes[static_cast<size_t>(i / 32 * 34 + 2 + i % 32)] = static_cast<std::byte>(static_cast<int8_t>(x * 127));
    } else {
      const uint16_t h = type == WeightType::kF16 ? F32ToF16(x) : F32ToBF16(x);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  const std::vector<float> x = Random(tokens * s.cols);
  std::vector<float> y(static_cast<size_t>(tokens * s.rows));
  WeightMatrix m{bytes.data(), type, s.rows, s.cols};
  Result<PackedWeights> packed = PackedWeights::Pack(m);
  if (panels) m = packed->matrix();
  for (auto _ : state) {
    benchmark::DoNotOptimize(MatMul(m, x.data(), tokens, y.data()));
    benchmark::ClobberMemory();
  }
  Counters(state, static_cast<int64_t>(bytes.size()), 2.0 * static_cast<double>(s.rows * s.cols * tokens));
}

void Args(benchmark::internal::Benchmark* b, bool all_types) {
  for (int64_t shape = 0; shape < static_cast<int64_t>(std::size(kShapes)); ++shape) {
    for (int64_t tokens : {1, 8, 32, 128}) {
      if (all_types) {
        for (int64_t type = 0; type < 6; ++type) b->Args({shape, tokens, type});
      } else {
        b->Args({shape, tokens});
      }
    }
  }
  b->UseRealTime();
}

BENCHMARK(BM_MatMul)->Apply([](benchmark::internal::Benchmark* b) { Args(b, true); });

// ggml block formats at SmolLM2-135M's shapes (q, k/v, gate/up, down, the
// classifier) for the 32-element formats, and at llama-110m's (q, k/v,
// gate/up, down, the classifier: columns a multiple of 256) for the
// k-quants; random blocks with realistic scales: args shape, tokens,
// weight type (as WeightType), activations (0 f32, 1 int16, 2 int16 with
// AVX-512 VNNI turned off: the same as 1 on CPUs without it), threads (0 =
// all).
constexpr Shape kQuantShapes[] = {{576, 576}, {192, 576}, {1536, 576}, {576, 1536}, {49152, 576}};
constexpr Shape kKQuantShapes[] = {{768, 768}, {256, 768}, {2560, 768}, {768, 2560}, {32000, 768}};
static_assert(std::size(kQuantShapes) == std::size(kKQuantShapes));

void BM_QuantMatMul(benchmark::State& state) {
  const auto type = static_cast<WeightType>(state.range(2));
  const Shape s = (FormatOf(type).block_elems == 256 ? kKQuantShapes : kQuantShapes)[state.range(0)];
  const int64_t tokens = state.range(1);
  const Activations act = state.range(3) >= 1 ? Activations::kFast : Activations::kF32;
  kernels::SetVnniForTest(state.range(3) != 2);
  const int threads = static_cast<int>(state.range(4));
  std::vector<std::byte> bytes(static_cast<size_t>(s.rows * WeightRowBytes(type, s.cols)));
  std::mt19937 rng(3);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  // Keep every f16 scale finite: rewrite each block's first two bytes (and
  // the K formats' d / dmin where they sit) with small values.
  const WeightFormat& f = FormatOf(type);
  const std::vector<int> halves = type == WeightType::kQ2_K   ? std::vector<int>{80, 82}
                                  : type == WeightType::kQ3_K ? std::vector<int>{108}
                                  : type == WeightType::kQ6_K ? std::vector<int>{208}
                                  : (type == WeightType::kQ4_1 || type == WeightType::kQ5_1 || type == WeightType::kQ4_K ||
                                     type == WeightType::kQ5_K)
                                      ? std::vector<int>{0, 2}
                                      : std::vector<int>{0};
  for (size_t at = 0; at < bytes.size(); at += static_cast<size_t>(f.block_bytes)) {
    for (int off : halves) {
      const uint16_t h = F32ToF16(0.01f);
      std::memcpy(bytes.data() + at + off, &h, 2);
    }
  }
  const std::vector<float> x = Random(tokens * s.cols);
  std::vector<float> y(static_cast<size_t>(tokens * s.rows));
  const WeightMatrix m{bytes.data(), type, s.rows, s.cols};
  if (Status st = MatMul(m, x.data(), tokens, y.data(), threads, act); !st.ok()) {
    state.SkipWithError(st.message().c_str());
    return;
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(MatMul(m, x.data(), tokens, y.data(), threads, act));
    benchmark::ClobberMemory();
  }
  kernels::SetVnniForTest(true);
  Counters(state, static_cast<int64_t>(bytes.size()), 2.0 * static_cast<double>(s.rows * s.cols * tokens));
}
BENCHMARK(BM_QuantMatMul)->Apply([](benchmark::internal::Benchmark* b) {
  for (int64_t type : {static_cast<int64_t>(WeightType::kQ4_1), static_cast<int64_t>(WeightType::kQ8_0),
                       static_cast<int64_t>(WeightType::kQ4_K), static_cast<int64_t>(WeightType::kQ6_K)}) {
    for (int64_t shape = 0; shape < static_cast<int64_t>(std::size(kQuantShapes)); ++shape) {
      for (int64_t tokens : {1, 4, 16, 64}) {
        for (int64_t act : {0, 1, 2}) {
          if (act >= 1 && tokens >= 16) continue;  // the same path as f32 there
          for (int64_t threads : {1, 0}) b->Args({shape, tokens, type, act, threads});
        }
      }
    }
  }
  b->UseRealTime();
});

// Many tokens (prefill) with and without the AMX-BF16 tiles
// (kernels/amx_matmul.cc), at llama-110m's shapes: args shape (kShapes),
// tokens, weights (0-2: f32, f16, bf16 in panels, as the model packs them;
// 3 q8_0, 4 q4_k, 5 q6_k), tiles (1 on, 0 off: the f32 vector kernels),
// threads (0 = all); the fast path (Activations::kFast). Skipped where the
// CPU has no AMX.
void BM_ManyTokens(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int64_t tokens = state.range(1);
  const int64_t kind = state.range(2);
  const WeightType type = kind <= 2   ? static_cast<WeightType>(kind)
                          : kind == 3 ? WeightType::kQ8_0
                          : kind == 4 ? WeightType::kQ4_K
                                      : WeightType::kQ6_K;
  const bool amx = state.range(3) != 0;
  if (!kernels::SetAmxMatMulForTest(true)) {
    state.SkipWithError("no AMX-BF16 on this CPU");
    return;
  }
  const int threads = static_cast<int>(state.range(4));
  std::vector<std::byte> bytes(static_cast<size_t>(s.rows * WeightRowBytes(type, s.cols)));
  if (IsBlockQuantized(type)) {
    std::mt19937 rng(3);
    for (auto& b : bytes) b = static_cast<std::byte>(rng());
    const int64_t block_bytes = FormatOf(type).block_bytes;
    const std::vector<int> halves = type == WeightType::kQ6_K ? std::vector<int>{208}
                                    : type == WeightType::kQ4_K ? std::vector<int>{0, 2}
                                                                : std::vector<int>{0};
    for (size_t at = 0; at < bytes.size(); at += static_cast<size_t>(block_bytes)) {
      for (int off : halves) {
        const uint16_t h = F32ToF16(0.01f);
        std::memcpy(bytes.data() + at + off, &h, 2);
      }
    }
  } else {
    const std::vector<float> w = Random(s.rows * s.cols);
    for (int64_t i = 0; i < s.rows * s.cols; ++i) {
      const float v = w[static_cast<size_t>(i)];
      if (type == WeightType::kF32) {
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      } else {
        const uint16_t h = type == WeightType::kF16 ? F32ToF16(v) : F32ToBF16(v);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
  }
  WeightMatrix m{bytes.data(), type, s.rows, s.cols};
  Result<PackedWeights> packed = IsBlockQuantized(type) ? Result<PackedWeights>(InvalidArgumentError("")) : PackedWeights::Pack(m);
  if (packed.ok()) m = packed->matrix();
  const std::vector<float> x = Random(tokens * s.cols);
  std::vector<float> y(static_cast<size_t>(tokens * s.rows));
  kernels::SetAmxMatMulForTest(amx);
  for (auto _ : state) {
    benchmark::DoNotOptimize(MatMul(m, x.data(), tokens, y.data(), threads, Activations::kFast));
    benchmark::ClobberMemory();
  }
  kernels::SetAmxMatMulForTest(true);
  Counters(state, static_cast<int64_t>(bytes.size()), 2.0 * static_cast<double>(s.rows * s.cols * tokens));
}
BENCHMARK(BM_ManyTokens)->Apply([](benchmark::internal::Benchmark* b) {
  for (int64_t shape : {0, 1, 2, 3}) {
    for (int64_t tokens : {16, 32, 128, 512}) {
      for (int64_t kind = 0; kind < 6; ++kind) {
        for (int64_t amx : {1, 0}) {
          for (int64_t threads : {1, 0}) b->Args({shape, tokens, kind, amx, threads});
        }
      }
    }
  }
  b->UseRealTime();
});

#ifdef PAGEKV_HAVE_OPENBLAS
void BM_OpenBlasSgemm(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  const int64_t tokens = state.range(1);
  openblas_set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  const std::vector<float> w = Random(s.rows * s.cols), x = Random(tokens * s.cols);
  std::vector<float> y(static_cast<size_t>(tokens * s.rows));
  for (auto _ : state) {
    // Y[tokens][rows] = X[tokens][cols] * W[rows][cols]^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tokens), static_cast<int>(s.rows),
                static_cast<int>(s.cols), 1.0f, x.data(), static_cast<int>(s.cols), w.data(),
                static_cast<int>(s.cols), 0.0f, y.data(), static_cast<int>(s.rows));
    benchmark::ClobberMemory();
  }
  Counters(state, s.rows * s.cols * 4, 2.0 * static_cast<double>(s.rows * s.cols * tokens));
}
BENCHMARK(BM_OpenBlasSgemm)->Apply([](benchmark::internal::Benchmark* b) { Args(b, false); });
#endif

}  // namespace
}  // namespace pagekv

namespace pagekv {
namespace {
// One token (decode) through block-format matrices read cold from DRAM:
// 160 MiB of copies of one shape, a different copy each call, as a model's
// decode step streams its weights. args rows, cols (llama-110m's q / qkv /
// gate+up / classifier, and down; SmolLM2-135M's for q4_1, gemma-3-270m's
// for q5_0), weight type (as WeightType: 3 q8_0, 4 q4_0, 5 q4_1, 6 q5_0,
// 7 q5_1, 10 q4_k, 11 q5_k, 12 q6_k), layout (0 row-major, 1 panels as the model packs
// q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k and q6_k); integer activations,
// every thread.
void BM_ColdDecode(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const auto type = static_cast<WeightType>(state.range(2));
  const bool panels = state.range(3) != 0;
  const int64_t bytes = rows * WeightRowBytes(type, cols);
  const int copies = static_cast<int>((int64_t{160} << 20) / bytes + 1);
  const WeightFormat& f = FormatOf(type);
  const int half = type == WeightType::kQ6_K ? 208 : 0;  // where each block's f16 d sits
  std::vector<std::vector<std::byte>> mats(static_cast<size_t>(copies));
  std::mt19937 rng(5);
  for (auto& m : mats) {
    m.resize(static_cast<size_t>(bytes));
    for (auto& b : m) b = static_cast<std::byte>(rng() & 0x3F);
    const uint16_t h = F32ToF16(0.01f);
    for (size_t i = 0; i < m.size(); i += static_cast<size_t>(f.block_bytes)) std::memcpy(m.data() + i + half, &h, 2);
  }
  std::vector<WeightMatrix> ms;
  std::vector<PackedWeights> packed;
  for (auto& m : mats) {
    ms.push_back({m.data(), type, rows, cols});
    if (!panels) continue;
    Result<PackedWeights> p = PackedWeights::Pack(ms.back());
    if (!p.ok()) {
      state.SkipWithError(p.status().message().c_str());
      return;
    }
    ms.back() = p->matrix();
    packed.push_back(std::move(*p));
    std::vector<std::byte>().swap(m);
  }
  const std::vector<float> x = Random(cols);
  std::vector<float> y(static_cast<size_t>(rows));
  size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(MatMul(ms[i], x.data(), 1, y.data(), 0, Activations::kFast));
    i = (i + 1) % ms.size();
  }
  Counters(state, bytes, 2.0 * static_cast<double>(rows * cols));
}
BENCHMARK(BM_ColdDecode)
    ->ArgsProduct({{768, 1280, 5120, 32000}, {768}, {3}, {0, 1}})
    ->ArgsProduct({{768}, {2560}, {3}, {0, 1}})
    ->ArgsProduct({{576, 1536}, {576}, {5}, {0, 1}})
    ->ArgsProduct({{576}, {1536}, {5}, {0, 1}})
    ->ArgsProduct({{1024, 2048}, {640}, {6}, {0, 1}})
    ->ArgsProduct({{768, 5120}, {768}, {4, 7}, {0, 1}})
    ->ArgsProduct({{768, 5120}, {768}, {11}, {0, 1}})
    ->ArgsProduct({{768, 5120, 32000}, {768}, {10}, {0, 1}})
    ->ArgsProduct({{768}, {2560}, {10}, {0, 1}})
    ->ArgsProduct({{768, 5120, 32000}, {768}, {12}, {0, 1}})
    ->ArgsProduct({{768}, {2560}, {12}, {0, 1}})
    ->UseRealTime();
}  // namespace
}  // namespace pagekv

// main(): src/kernels/bench_main.cc.
