// The two ceilings of a roofline, measured on this machine, now: sustained
// memory read bandwidth and the fp32 fused-multiply-add rate of the widest
// SIMD target the kernels dispatch to. Benchmarks report results against
// these, measured in the same run, because shared machines drift.
#pragma once

#include <cstdint>
#include <memory>

namespace pagekv::kernels {

// A buffer allocated and faulted in once, so the read bandwidth can be
// measured again cheaply next to every benchmark row (shared machines drift
// within minutes).
class StreamProbe {
 public:
  // nullptr when the OS refuses `bytes`.
  static std::unique_ptr<StreamProbe> Create(int64_t bytes, int threads);
  ~StreamProbe();
  StreamProbe(const StreamProbe&) = delete;
  StreamProbe& operator=(const StreamProbe&) = delete;

  // GB/s of a read-only vector sum over the buffer; the best of `repeats`.
  double MeasureGbps(int repeats = 3) const;

 private:
  StreamProbe(float* data, int64_t n, int threads) : data_(data), n_(n), threads_(threads) {}
  float* data_;
  int64_t n_;
  int threads_;
};

// GB/s of a read-only vector sum over `bytes` (make it many times the
// last-level cache), split over `threads` threads; the best of `repeats`.
double MeasureStreamReadGbps(int threads, int64_t bytes, int repeats = 3);

// GFLOP/s of independent vector FMAs on `threads` threads (2 flops per lane
// per FMA); the best of `repeats`.
double MeasureFmaGflops(int threads, int repeats = 3);

}  // namespace pagekv::kernels
