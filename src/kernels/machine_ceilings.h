// The two ceilings of a roofline, measured on this machine, now: sustained
// memory read bandwidth and the fp32 fused-multiply-add rate of the widest
// SIMD target the kernels dispatch to. Benchmarks report results against
// these, measured in the same run, because shared machines drift.
#pragma once

#include <cstdint>

namespace pagekv::kernels {

// GB/s of a read-only vector sum over `bytes` (make it many times the
// last-level cache), split over `threads` threads; the best of `repeats`.
double MeasureStreamReadGbps(int threads, int64_t bytes, int repeats = 3);

// GFLOP/s of independent vector FMAs on `threads` threads (2 flops per lane
// per FMA); the best of `repeats`.
double MeasureFmaGflops(int threads, int repeats = 3);

}  // namespace pagekv::kernels
