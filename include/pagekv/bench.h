// Benchmarks behind `pagekv bench ...`, as a library so that the CLI, tests
// and users' own harnesses run the same code.
//
// Every result is reported against ceilings measured in the same run (memory
// read bandwidth, fp32 FMA rate), because shared machines drift: a roofline
// ratio stays meaningful when the absolute speed does not.
//
// Thread safety: RunAttentionBench uses the whole machine; run one at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "pagekv/dtype.h"
#include "pagekv/status.h"

namespace pagekv {

enum class BenchSet : uint8_t {
  kQuick,    // a seconds-long smoke run (tests)
  kDefault,  // batch 8, contexts 4096 and 16384, block_len 128, three head configs, f16 and bf16
  kFull,     // the whole grid: batch 1/8/32, contexts 512/4096/16384, block_len 16/64/128, 1 and all threads
};

struct AttentionBenchResult {
  int64_t batch = 0;
  int64_t ctx = 0;
  int32_t q_heads = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_len = 0;
  DType dtype = DType::kF16;
  int threads = 0;
  int64_t calls = 0;               // timed calls (median taken)
  double seconds_per_call = 0;
  int64_t kv_bytes = 0;            // K and V bytes one call reads
  double flops = 0;                // 2 * G * head_dim per K row and per V row
  double gbps = 0;                 // kv_bytes / seconds_per_call
  double ratio_to_stream = 0;      // gbps / stream_read_gbps
  double floor_seconds = 0;        // max(kv_bytes / bandwidth, flops / fma rate)
  double ratio_to_roofline = 0;    // floor_seconds / seconds_per_call
  std::string bound;               // "memory" or "compute": which floor is larger
  int64_t rotation_bytes = 0;      // KV footprint the calls rotate over (cold when >> LLC)
  double stream_read_gbps = 0;     // the ceilings this row is judged by, probed
  double fma_gflops = 0;           // right before and after it (the better kept)
  double scalar_seconds = 0;       // straightforward scalar loop over a contiguous cache
  double speedup_vs_scalar = 0;    // scalar_seconds / seconds_per_call
};

struct AttentionBenchReport {
  std::string simd_target;
  int threads = 0;
  double stream_read_gbps = 0;
  double fma_gflops = 0;
  std::vector<AttentionBenchResult> results;
  std::vector<std::string> skipped;  // shapes not run, with the reason
};

struct AttentionBenchOptions {
  BenchSet set = BenchSet::kDefault;
  int num_threads = 0;                  // 0 = every hardware thread
  bool scalar_baseline = true;          // also time the contiguous scalar loop
  std::function<void(const AttentionBenchResult&)> on_result;  // progress, optional
  // Each non-empty list replaces that axis of the chosen set.
  std::vector<int64_t> batches;
  std::vector<int64_t> contexts;
  std::vector<int32_t> block_lens;
  std::vector<std::pair<int32_t, int32_t>> heads;  // (q_heads, kv_heads)
  std::vector<DType> dtypes;
};

// Runs the decode-attention grid. Errors: the OS refusing memory for a shape
// (ResourceExhausted), which stops the run.
Result<AttentionBenchReport> RunAttentionBench(const AttentionBenchOptions& options);

}  // namespace pagekv
