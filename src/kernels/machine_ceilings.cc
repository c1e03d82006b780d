// Roofline ceilings, measured with the same Highway dispatch as the kernels.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/machine_ceilings.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "kernels/machine_ceilings.h"

HWY_BEFORE_NAMESPACE();
namespace pagekv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sum of n floats, four independent accumulators so loads, not adds, bind.
float SumFloats(const float* HWY_RESTRICT p, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  int64_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    a0 = hn::Add(a0, hn::LoadU(d, p + i));
    a1 = hn::Add(a1, hn::LoadU(d, p + i + lanes));
    a2 = hn::Add(a2, hn::LoadU(d, p + i + 2 * lanes));
    a3 = hn::Add(a3, hn::LoadU(d, p + i + 3 * lanes));
  }
  float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
  for (; i < n; ++i) s += p[i];
  return s;
}

// `iters` rounds of 12 independent FMAs (enough to cover FMA latency x
// throughput); returns a value depending on all of them. flops = iters * 12 *
// lanes * 2.
float FmaLoop(int64_t iters, float seed) {
  const hn::ScalableTag<float> d;
  const auto m = hn::Set(d, 0.999999f), c = hn::Set(d, 1e-7f);
  hn::Vec<decltype(d)> a[12];
  for (int i = 0; i < 12; ++i) a[i] = hn::Set(d, seed + static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < 12; ++i) a[i] = hn::MulAdd(a[i], m, c);
  }
  auto s = a[0];
  for (int i = 1; i < 12; ++i) s = hn::Add(s, a[i]);
  return hn::GetLane(hn::SumOfLanes(d, s));
}

int64_t FloatLanes() { return static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>())); }

}  // namespace HWY_NAMESPACE
}  // namespace pagekv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagekv::kernels {

HWY_EXPORT(SumFloats);
HWY_EXPORT(FmaLoop);
HWY_EXPORT(FloatLanes);

double MeasureStreamReadGbps(int threads, int64_t bytes, int repeats) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  void* mem = mmap(nullptr, static_cast<size_t>(n) * sizeof(float), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 0;
  madvise(mem, static_cast<size_t>(n) * sizeof(float), MADV_HUGEPAGE);
  auto* p = static_cast<float*>(mem);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = 1.0f;
  double best = 0;
  volatile float sink = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const int nt = omp_get_num_threads(), id = omp_get_thread_num();
      const int64_t begin = n * id / nt, end = n * (id + 1) / nt;
      total += HWY_DYNAMIC_DISPATCH(SumFloats)(p + begin, end - begin);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + total;
    best = std::max(best, static_cast<double>(n) * sizeof(float) / s / 1e9);
  }
  munmap(mem, static_cast<size_t>(n) * sizeof(float));
  return best;
}

double MeasureFmaGflops(int threads, int repeats) {
  constexpr int64_t kIters = 20'000'000;
  const int64_t lanes = HWY_DYNAMIC_DISPATCH(FloatLanes)();
  double best = 0;
  volatile float sink = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    float total = 0;
    int used = 1;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#pragma omp single
      used = omp_get_num_threads();
      total += HWY_DYNAMIC_DISPATCH(FmaLoop)(kIters, static_cast<float>(omp_get_thread_num()));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + total;
    best = std::max(best, static_cast<double>(kIters) * 12 * lanes * 2 * used / s / 1e9);
  }
  return best;
}

}  // namespace pagekv::kernels
#endif  // HWY_ONCE
