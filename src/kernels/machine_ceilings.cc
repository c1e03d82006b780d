// Roofline ceilings, measured with the same Highway dispatch as the kernels.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/machine_ceilings.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include <vector>

#include "base/thread_pool.h"
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

std::unique_ptr<StreamProbe> StreamProbe::Create(int64_t bytes, int threads) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  void* mem = mmap(nullptr, static_cast<size_t>(n) * sizeof(float), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return nullptr;
  madvise(mem, static_cast<size_t>(n) * sizeof(float), MADV_HUGEPAGE);
  auto* p = static_cast<float*>(mem);
  // First touch from the threads that will read it.
  ThreadPool::Shared().ParallelFor(threads, threads, [&](int64_t id) {
    for (int64_t i = n * id / threads, end = n * (id + 1) / threads; i < end; ++i) p[i] = 1.0f;
  });
  return std::unique_ptr<StreamProbe>(new StreamProbe(p, n, threads));
}

StreamProbe::~StreamProbe() { munmap(data_, static_cast<size_t>(n_) * sizeof(float)); }

double StreamProbe::MeasureGbps(int repeats) const {
  double best = 0;
  volatile float sink = 0;
  const float* p = data_;
  const int64_t n = n_;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> partial(static_cast<size_t>(threads_));
    const int64_t nt = threads_;
    ThreadPool::Shared().ParallelFor(nt, threads_, [&](int64_t id) {
      const int64_t begin = n * id / nt, end = n * (id + 1) / nt;
      partial[static_cast<size_t>(id)] = HWY_DYNAMIC_DISPATCH(SumFloats)(p + begin, end - begin);
    });
    float total = 0;
    for (float x : partial) total += x;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + total;
    best = std::max(best, static_cast<double>(n) * sizeof(float) / s / 1e9);
  }
  return best;
}

double MeasureStreamReadGbps(int threads, int64_t bytes, int repeats) {
  const std::unique_ptr<StreamProbe> probe = StreamProbe::Create(bytes, threads);
  return probe ? probe->MeasureGbps(repeats) : 0.0;
}

double MeasureFmaGflops(int threads, int repeats) {
  constexpr int64_t kIters = 20'000'000;
  const int64_t lanes = HWY_DYNAMIC_DISPATCH(FloatLanes)();
  double best = 0;
  volatile float sink = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const int used = std::min(threads, ThreadPool::Shared().num_threads());
    std::vector<float> partial(static_cast<size_t>(used));
    ThreadPool::Shared().ParallelFor(used, used, [&](int64_t id) {
      partial[static_cast<size_t>(id)] = HWY_DYNAMIC_DISPATCH(FmaLoop)(kIters, static_cast<float>(id));
    });
    float total = 0;
    for (float x : partial) total += x;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + total;
    best = std::max(best, static_cast<double>(kIters) * 12 * lanes * 2 * used / s / 1e9);
  }
  return best;
}

}  // namespace pagekv::kernels
#endif  // HWY_ONCE
