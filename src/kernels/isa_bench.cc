// Machine microbenchmarks behind the decode kernel's design choices
// (docs/PERFORMANCE.md, "Decode attention"). x86 with AVX-512 only; on other
// CPUs every benchmark is skipped with a message.
//
//   BM_FmaPlus/<variant>: 8 independent 512-bit FMAs per iteration plus the
//     variant's extra work, timed against the 8 FMAs alone in the same
//     benchmark. Counter `fma_slots`: how many FMA cycles the extra work
//     costs per iteration ((variant / baseline - 1) x 8). Variants: 8 f16
//     conversions (vcvtph2ps), 8 bf16 widenings (vpmovzxwd + shift), 8 bf16
//     conversions by shift/mask of 32-bit lanes (4 loads), 8 embedded 32-bit
//     broadcasts, 8 128-bit broadcasts (one per FMA), 4 128-bit broadcasts
//     (one per two FMAs), 8 vdpbf16ps in place of the FMAs (flops x2), and
//     1 or 2 f16 conversions per 8 FMAs (the ratios of the decode kernel).
//   BM_ScatteredRead/<prefetch>/<fmas>/<chunk KiB>/<threads>/<shuffled>:
//     <threads> threads read a 256 MiB buffer in chunks of <chunk KiB> (a
//     stand-in for the K/V slabs of blocks: 4 KiB is block_len 16 at
//     head_dim 128 in f16), in shuffled order (1) or in order (0), the
//     chunks dealt out in turn; each prefetches its next chunk into L2 while
//     it reads this one, with <fmas> 512-bit FMAs of unrelated work per 256
//     bytes read. Prefetch patterns: 0 none, 1 four lines every 256 bytes,
//     2 64-line bursts every 4 KiB, 3 the whole next chunk at its start, 4
//     the first 3 lines of each of its 4 KiB pages at its start, 5 the
//     first 4 lines of the next chunk's page every 4 KiB.
//     Counter `gbps` (all threads together).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#if defined(__x86_64__)
// GCC 12 reports its own AVX-512 intrinsics (_mm512_undefined_* inside
// reductions and widenings) as uninitialized once they are inlined here.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <sys/mman.h>
#define PAGEKV_ISA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))
#endif

namespace pagekv {
namespace {

#if defined(__x86_64__)

bool HaveAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

enum Variant { kNone, kCvtF16, kWidenBf16, kPairsBf16, kBcast32, kBcast128, kBcast128Half, kDpbf16, kCvtF16One, kCvtF16Two };

// Runs `iters` iterations of 8 FMAs (chains 0..7) plus the variant's work;
// returns a value that depends on every chain. One instantiation per
// variant, so each loop keeps its chains in registers.
template <Variant v>
PAGEKV_ISA_TARGET float FmaLoopT(int64_t iters, const uint16_t* h, const float* f) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 m = _mm512_set1_ps(0.9999f);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < iters; ++k) {
    const uint16_t* ph = h + (k & 63) * 128;  // 8 distinct vectors per iteration
    const float* pf = f + (k & 63) * 32;
    __asm__ volatile("" : "+r"(ph), "+r"(pf));  // no hoisting of the loads
    switch (v) {  // a constant: one case survives
      case kNone:
        for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(a[i], m, m);
        break;
      case kCvtF16:
        for (int i = 0; i < 8; ++i) {
          const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + 16 * i)));
          a[i] = _mm512_fmadd_ps(a[i], c, m);
        }
        break;
      case kWidenBf16:
        for (int i = 0; i < 8; ++i) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + 16 * i));
          const __m512 c = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
          a[i] = _mm512_fmadd_ps(a[i], c, m);
        }
        break;
      case kPairsBf16:
        for (int i = 0; i < 8; i += 2) {
          const __m512i x = _mm512_loadu_si512(ph + 16 * i);
          a[i] = _mm512_fmadd_ps(a[i], _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), m);
          a[i + 1] = _mm512_fmadd_ps(a[i + 1], _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask)), m);
        }
        break;
      case kBcast32:
        for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(a[i], _mm512_set1_ps(pf[i]), m);
        break;
      case kBcast128:
        for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(a[i], _mm512_broadcast_f32x4(_mm_loadu_ps(pf + 4 * i)), m);
        break;
      case kBcast128Half:
        for (int i = 0; i < 8; i += 2) {
          const __m512 b = _mm512_broadcast_f32x4(_mm_loadu_ps(pf + 2 * i));
          a[i] = _mm512_fmadd_ps(a[i], b, m);
          a[i + 1] = _mm512_fmadd_ps(a[i + 1], b, m);
        }
        break;
      case kCvtF16One:  // the ratio of an ideal f16 G = 8 decode: each K/V vector converted once for 8 FMAs
        a[0] = _mm512_fmadd_ps(a[0], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph))), m);
        for (int i = 1; i < 8; ++i) a[i] = _mm512_fmadd_ps(a[i], m, m);
        break;
      case kCvtF16Two:  // one per 4 FMAs: the kernel's 4-row tiles
        for (int i = 0; i < 8; ++i) {
          a[i] = i % 4 == 0 ? _mm512_fmadd_ps(a[i], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + 4 * i))), m)
                            : _mm512_fmadd_ps(a[i], m, m);
        }
        break;
      case kDpbf16: {
        const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));
        for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, x);
        break;
      }
    }
  }
  __m512 s = a[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

float FmaLoop(Variant v, int64_t iters, const uint16_t* h, const float* f) {
  switch (v) {
    case kNone: return FmaLoopT<kNone>(iters, h, f);
    case kCvtF16: return FmaLoopT<kCvtF16>(iters, h, f);
    case kWidenBf16: return FmaLoopT<kWidenBf16>(iters, h, f);
    case kPairsBf16: return FmaLoopT<kPairsBf16>(iters, h, f);
    case kBcast32: return FmaLoopT<kBcast32>(iters, h, f);
    case kBcast128: return FmaLoopT<kBcast128>(iters, h, f);
    case kBcast128Half: return FmaLoopT<kBcast128Half>(iters, h, f);
    case kDpbf16: return FmaLoopT<kDpbf16>(iters, h, f);
    case kCvtF16One: return FmaLoopT<kCvtF16One>(iters, h, f);
    case kCvtF16Two: return FmaLoopT<kCvtF16Two>(iters, h, f);
  }
  return 0;
}

double SecondsOf(Variant v, int64_t iters, const uint16_t* h, const float* f) {
  const auto t0 = std::chrono::steady_clock::now();
  benchmark::DoNotOptimize(FmaLoop(v, iters, h, f));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void BM_FmaPlus(benchmark::State& state) {
  if (!HaveAvx512()) {
    state.SkipWithError("needs AVX-512 (F, BW, VL, BF16)");
    return;
  }
  const auto v = static_cast<Variant>(state.range(0));
  std::vector<uint16_t> h(64 * 128 + 128, 0x3c00);  // 1.0 in f16 (and a bf16 denormal: integer ops only)
  std::vector<float> f(64 * 32 + 64, 1.0f);
  constexpr int64_t kIters = 2'000'000;
  double base = 0, with = 0;
  for (auto _ : state) {
    base += SecondsOf(kNone, kIters, h.data(), f.data());
    with += SecondsOf(v, kIters, h.data(), f.data());
  }
  state.counters["fma_slots"] = (with / base - 1.0) * 8.0;
  state.counters["ns_per_iter"] = with / static_cast<double>(state.iterations() * kIters) * 1e9;
  static const char* const kNames[] = {"8 FMAs alone",      "+ 8 vcvtph2ps",         "+ 8 bf16 widenings",
                                       "+ 4 bf16 pair loads", "+ 8 32-bit broadcasts", "+ 8 128-bit broadcasts",
                                       "+ 4 128-bit broadcasts", "8 vdpbf16ps instead",   "+ 1 vcvtph2ps",
                                       "+ 2 vcvtph2ps"};
  state.SetLabel(kNames[v]);
}
BENCHMARK(BM_FmaPlus)->DenseRange(kNone, kCvtF16Two)->Unit(benchmark::kMillisecond);

// Sums one 32 KiB chunk, prefetching `next` in the given pattern, with
// `fmas` 512-bit FMAs of other work per 256 bytes (asm, so the compiler
// neither drops nor spills them).
PAGEKV_ISA_TARGET float ReadChunk(const char* p, const char* next, int64_t kChunk, int pattern, int fmas) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  if (next != nullptr && pattern == 3) {
    for (int64_t o = 0; o < kChunk; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
  }
  for (int64_t o = 0; o < kChunk; o += 256) {
    if (next != nullptr) {
      if (pattern == 1) {
        for (int l = 0; l < 4; ++l) _mm_prefetch(next + o + 64 * l, _MM_HINT_T1);
      } else if (pattern == 4 && o == 0) {  // page heads, to start the hardware streamer
        for (int64_t pg = 0; pg < kChunk; pg += 4096)
          for (int l = 0; l < 3; ++l) _mm_prefetch(next + pg + 64 * l, _MM_HINT_T1);
      } else if (pattern == 5 && (o & 4095) == 0) {  // the next page's head, every page
        for (int l = 0; l < 4; ++l) _mm_prefetch(next + o + 64 * l, _MM_HINT_T1);
      } else if (pattern == 2 && (o & 4095) == 0) {
        for (int l = 0; l < 64; ++l) _mm_prefetch(next + o + 64 * l, _MM_HINT_T1);
      }
    }
    for (int k = 0; k < fmas; k += 8) {
      __asm__ volatile(
          "vfmadd231ps %%zmm24, %%zmm25, %%zmm16\n\tvfmadd231ps %%zmm24, %%zmm25, %%zmm17\n\t"
          "vfmadd231ps %%zmm24, %%zmm25, %%zmm18\n\tvfmadd231ps %%zmm24, %%zmm25, %%zmm19\n\t"
          "vfmadd231ps %%zmm24, %%zmm25, %%zmm20\n\tvfmadd231ps %%zmm24, %%zmm25, %%zmm21\n\t"
          "vfmadd231ps %%zmm24, %%zmm25, %%zmm22\n\tvfmadd231ps %%zmm24, %%zmm25, %%zmm23" ::
              : "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23");
    }
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(reinterpret_cast<const float*>(p + o)));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(reinterpret_cast<const float*>(p + o + 64)));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(reinterpret_cast<const float*>(p + o + 128)));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(reinterpret_cast<const float*>(p + o + 192)));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

void BM_ScatteredRead(benchmark::State& state) {
  if (!HaveAvx512()) {
    state.SkipWithError("needs AVX-512 (F, BW, VL, BF16)");
    return;
  }
  const int pattern = static_cast<int>(state.range(0));
  const int fmas = static_cast<int>(state.range(1));
  const int64_t chunk = state.range(2) << 10;
  const int threads = static_cast<int>(state.range(3));
  const bool shuffled = state.range(4) != 0;
  constexpr size_t kBytes = size_t{256} << 20;
  const size_t chunks = kBytes / static_cast<size_t>(chunk);
  void* mem = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    state.SkipWithError("mmap of 256 MiB failed");
    return;
  }
  madvise(mem, kBytes, MADV_HUGEPAGE);
  std::memset(mem, 0, kBytes);
  const char* buf = static_cast<const char*>(mem);
  std::vector<size_t> order(chunks);
  std::iota(order.begin(), order.end(), 0);
  if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(1));
  auto read = [&](size_t first) {
    float sum = 0;
    for (size_t i = first; i < chunks; i += static_cast<size_t>(threads)) {
      const size_t after = i + static_cast<size_t>(threads);
      const char* next = pattern != 0 && after < chunks ? buf + order[after] * chunk : nullptr;
      sum += ReadChunk(buf + order[i] * chunk, next, chunk, pattern, fmas);
    }
    benchmark::DoNotOptimize(sum);
  };
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> others;
    for (int w = 1; w < threads; ++w) others.emplace_back(read, static_cast<size_t>(w));
    read(0);
    for (std::thread& t : others) t.join();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  munmap(mem, kBytes);
  state.counters["gbps"] = static_cast<double>(kBytes) * static_cast<double>(state.iterations()) / seconds / 1e9;
}
// The 32 KiB chunks on one thread, every prefetch pattern, with and without
// other work; then block-sized chunks on one and two threads, shuffled and
// in order (docs/PERFORMANCE.md, "A core's reads, and shuffled 4 KiB slabs").
BENCHMARK(BM_ScatteredRead)->ArgsProduct({{0, 1, 2, 3, 4, 5}, {0, 32}, {32}, {1}, {1}})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ScatteredRead)
    ->ArgsProduct({{0, 3, 4}, {0, 16, 32, 48}, {4, 8, 32}, {1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

#else  // !__x86_64__

void BM_FmaPlus(benchmark::State& state) {
  for (auto _ : state) state.SkipWithError("x86 with AVX-512 only");
}
BENCHMARK(BM_FmaPlus);

#endif

}  // namespace
}  // namespace pagekv

// main(): src/kernels/bench_main.cc.
