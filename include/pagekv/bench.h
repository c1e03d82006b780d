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
#include "pagekv/engine.h"
#include "pagekv/machine.h"
#include "pagekv/replay.h"
#include "pagekv/status.h"

namespace pagekv {

enum class BenchSet : uint8_t {
  kQuick,    // a seconds-long smoke run (tests)
  kDefault,  // batch 8, contexts 4096 and 16384, block_len 128, three head configs, f16, bf16 and int8
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
  bool attention_weights = false;  // the calls also reported attention weights
  // The peer layout (AttentionBenchOptions::peer_head_major): the same calls
  // with each (sequence, KV head)'s K and V one contiguous run.
  double head_major_seconds = 0;
  double ratio_to_head_major = 0;  // head_major_seconds / seconds_per_call (1 = paging costs nothing)
  bool mla = false;                // a latent-cache row: head_dim is the latent row (rank + rope)
  double mla_total_seconds = 0;    // MlaDecodeAttention: the latent kernel plus the W_UK / W_UV products
};

struct AttentionBenchReport {
  std::string device;       // "cpu", or the device backend's name ("cuda:0 (NVIDIA H200)")
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
  // Also have the kernel report every token's attention weight (what H2O
  // needs each step), to measure what that costs.
  bool attention_weights = false;
  // Also time every shape on a contiguous head-major cache: the same kernel
  // with block tables in order, so each (sequence, KV head)'s K and V rows
  // are one contiguous run ([head][sequence][token][dim], what a
  // non-paged cache such as ggml's head-major one reads): the table is
  // still read, but each next block is the next slab in memory.
  bool peer_head_major = false;
  // Multi-head latent attention on DeepSeek-V3's latent cache (rank 512 +
  // rope 64 per token, one row shared by every query head; 128 query heads
  // unless `heads` says Q/1): each row times the latent kernel (what the
  // roofline judges: latent bytes in, 4 * heads * 576 flops per cached
  // token), and mla_total_seconds the whole absorbed attention with its
  // per-head W_UK / W_UV products (f32 weights).
  bool mla = false;
  // Where the cache lives and the kernels run: "cpu", or "cuda" / "cuda:N"
  // (EngineOptions::device): the same shapes in device memory through the
  // CUDA backend, judged against the device's read bandwidth measured by a
  // streaming read in the same run (no FMA ceiling: the rows' bound is
  // memory; no scalar baseline; MLA and attention weights are skipped, as
  // the device does not run them).
  std::string device = "cpu";
  bool tensor_cores = false;  // EngineOptions::tensor_cores (a CUDA device only)
};

// Runs the decode-attention grid. Errors: the OS refusing memory for a shape
// (ResourceExhausted), which stops the run; a device that is not there
// (MakeDeviceBackend's errors).
Result<AttentionBenchReport> RunAttentionBench(const AttentionBenchOptions& options);

// `pagekv bench generate`: whole-model throughput on the paged cache. For
// each batch size: `batch` prompts of prompt_len random token ids prefilled
// in one step, then decode_steps steps of one token per sequence, timed
// apart. The decode step is judged against its roofline: every weight byte
// and every cached K/V byte read once per step, at the stream bandwidth
// measured in the same run, or its multiply-adds at the measured FMA rate,
// whichever is longer.
struct GenerateBenchResult {
  int64_t batch = 0;
  int64_t prompt_len = 0;
  int64_t decode_steps = 0;
  double prefill_seconds = 0;
  double prefill_tokens_per_second = 0;
  double decode_seconds = 0;
  double decode_tokens_per_second = 0;  // batch * decode_steps / decode_seconds
  double decode_step_ms = 0;
  double decode_attention_share = 0;    // of decode time, in the attention kernels
  double decode_matmul_share = 0;       // of decode time, in weight products
  double decode_communication_share = 0;  // of decode time, in the tensor-parallel collectives
  double decode_communication_ms = 0;     // per decode step
  int64_t kv_bytes_per_token = 0;       // this process's pool (a tensor-parallel rank's: its heads)
  int64_t step_weight_bytes = 0;        // weight bytes one decode step reads
  int64_t step_kv_bytes = 0;            // K/V bytes one decode step reads (mean over the steps)
  double step_flops = 0;                // multiply-adds x 2 of one decode step (mean)
  double step_floor_ms = 0;             // max(bytes / stream bandwidth, flops / FMA rate)
  double ratio_to_roofline = 0;         // step_floor_ms / decode_step_ms
  std::string bound;                    // "memory" or "compute"
  int threads = 0;                      // the row's thread count
  // What the thread pool did during the decode steps (base/thread_pool.h):
  // loops handed to workers, run alone after a late or crowded one, late (a
  // worker descheduled while holding work), crowded (the caller descheduled
  // while working), worker spins found descheduled; host stalls: such
  // trouble seen while nothing else on the machine was runnable (ignored).
  int64_t pool_parallel_loops = 0, pool_solo_loops = 0, pool_late_loops = 0, pool_crowded_loops = 0,
          pool_preempted_spins = 0, pool_host_stalls = 0;
};

struct GenerateBenchReport {
  std::string model;             // path, or "synthetic <preset>"
  int64_t parameters = 0;
  std::string weight_type;       // of the matrices
  std::string kv_dtype;
  int32_t block_len = 0;
  std::string kv_cache;          // "uniform", or "hybrid (G groups of k layers)"
  std::string device = "cpu";    // or the device backend's name
  std::string simd_target;
  int threads = 0;
  double stream_read_gbps = 0;   // a device's read bandwidth with --device
  double fma_gflops = 0;
  bool busy_neighbour = false;
  std::vector<GenerateBenchResult> results;
};

struct GenerateBenchOptions {
  std::string model_path;                   // a GGUF; empty = synthetic, written for the run
  std::string synth_preset = "llama-110m";  // when model_path is empty
  std::string weight_type = "f16";          // of the synthetic model: f32, f16, bf16, q8_0
  std::vector<int64_t> batches = {1, 8, 32};
  int64_t prompt_len = 128;
  int64_t decode_steps = 32;
  int32_t block_len = 16;
  DType kv_dtype = DType::kF16;
  KvGroups kv_groups = KvGroups::kAuto;  // sliding-window models: hybrid (auto) or uniform cache
  int num_threads = 0;  // 0 = every hardware thread
  // Run every batch twice, on 1 thread and on num_threads, while another
  // process keeps one core busy (a spinning child, started for the run and
  // killed after it): what a shared machine does to a thread pool.
  bool busy_neighbour = false;
  EngineOptions::MlaPrefill mla_prefill = EngineOptions::MlaPrefill::kAuto;  // deepseek2 models' prompt chunks
  // Tensor / pipeline parallel (EngineOptions::parallel): every rank runs
  // the benchmark with the same options; each measures its own share.
  ModelParallel parallel;
  bool overlap_communication = true;  // EngineOptions::overlap_communication
  // EngineOptions::device: "cpu", or "cuda" / "cuda:N": the model and the
  // pool on the GPU, the step judged against the device's read bandwidth
  // measured in the run (weights counted as the device holds them: 2 bytes
  // per element on the fast path; no FMA ceiling; the attention / matmul
  // shares are launch times there, not device times).
  std::string device = "cpu";
  bool tensor_cores = false;  // EngineOptions::tensor_cores (a CUDA device only)
  bool cuda_graphs = false;   // EngineOptions::cuda_graphs (a CUDA device only)
  std::function<void(const GenerateBenchResult&)> on_result;  // progress, optional
};

// Errors: an unreadable model, invalid sizes, a prompt longer than the
// model's context, a pool the OS refuses.
Result<GenerateBenchReport> RunGenerateBench(const GenerateBenchOptions& options);

// `pagekv bench serve`: a serving trace's arrivals and lengths against the
// engine, for the paged and the contiguous allocator under the same KV
// budget. Prompt token ids are synthesised (from Mooncake hash ids, so
// shared prefixes are real); each request's output is forced to the trace's
// output length; max_tokens (what the contiguous allocator reserves) is the
// context left after the prompt unless set. Running sequences, KV blocks in
// use, stored tokens and reserved slots are sampled over time.
struct ServeBenchOptions {
  std::string trace_path;
  TraceFormat format = TraceFormat::kAuto;
  std::string model_path;                 // empty: a synthetic model, written for the run
  std::string synth_preset = "small-16k"; // which one (include/pagekv/synth_model.h)
  int64_t kv_budget_bytes = 32ll << 20;
  std::vector<Allocator> allocators = {Allocator::kPaged, Allocator::kContiguous};
  // Sliding-window models: one paged run per entry (e.g. hybrid and
  // uniform, in one run: their prefix hit rates and peaks side by side).
  std::vector<KvGroups> kv_groups = {KvGroups::kAuto};
  int64_t max_requests = 0;               // 0 = the whole trace
  double time_scale = 0.01;               // arrival gaps are multiplied by this
  int32_t max_tokens = 0;                 // per request; 0 = the context left after the prompt
  int32_t block_len = 16;
  DType kv_dtype = DType::kF16;
  int64_t max_step_tokens = 2048;
  int32_t max_running = 256;
  int threads = 0;
  EngineOptions::MlaPrefill mla_prefill = EngineOptions::MlaPrefill::kAuto;  // deepseek2 models' prompt chunks
  // Lower KV tiers to compare, each a paged run of its own (the allocators
  // are then ignored): "none", "host", "disk", "redis", or a '+' join such
  // as "host+redis"; "+inline" moves blocks on the stepping thread instead
  // of the tiers' (EngineOptions::background_tier_moves = false), e.g.
  // "host,host+inline". Empty: no tier comparison.
  std::vector<std::string> tier_configs;
  int64_t host_cache_bytes = 256ll << 20;  // the host tier where a config names it
  int64_t disk_cache_bytes = 1ll << 30;    // the disk tier: a temporary file in TMPDIR, removed after
  std::string redis_url;                   // required when a config names redis
  std::string redis_password;
  std::function<void(const std::string& allocator, int64_t done, int64_t total)> on_progress;
};

struct ServeSample {
  double t = 0;  // seconds from the start
  int64_t running = 0, waiting = 0;
  int64_t blocks_used = 0;     // held, or reserved (contiguous)
  int64_t tokens_stored = 0, slots_reserved = 0;
  double table_contiguity = 1;  // EngineMetrics::table_contiguity
};

struct ServeBenchResult {
  std::string allocator;
  int64_t requests = 0;        // completed
  int64_t skipped = 0;         // longer than the model's context, or larger than the pool
  double seconds = 0;
  double requests_per_s = 0;
  double output_tokens_per_s = 0;
  double ttft_p50_ms = 0, ttft_p99_ms = 0, itl_p50_ms = 0, itl_p99_ms = 0;
  double mean_running = 0;     // time-weighted over the run
  double mean_table_contiguity = 0;  // EngineMetrics::table_contiguity, time-weighted (paged runs)
  int64_t peak_running = 0;
  double kv_utilization = 0;   // tokens stored / slots reserved, over the run
  int64_t preemptions = 0;
  double prefix_hit_rate = 0;  // prompt tokens found cached (in the pool or a lower tier) / prompt tokens
  std::string tiers = "none";  // the lower tiers of this run
  int64_t pool_hit_blocks = 0, host_hit_blocks = 0, disk_hit_blocks = 0, redis_hit_blocks = 0;
  int64_t tier_errors = 0;     // I/O failures and corrupt payloads (recomputed)
  // Where the tier moves ran: blocks loaded on the tiers' threads, and
  // evictions that copied the block on the allocation path / found it
  // copied ahead.
  int64_t background_loads = 0, evictions_copied = 0, evictions_precopied = 0;
  int64_t blocks = 0;          // the pool
  std::vector<ServeSample> samples;
};

struct ServeBenchReport {
  std::string model;
  int64_t blocks = 0;          // the pool both allocators share
  int64_t kv_budget_bytes = 0;
  std::vector<ServeBenchResult> results;
};

Result<ServeBenchReport> RunServeBench(const ServeBenchOptions& options);

// An SVG of running sequences and KV blocks in use over time, one line per
// allocator.
std::string ServePlotSvg(const ServeBenchReport& report);

// `pagekv bench fleet`: a trace against several `pagekv serve` processes
// behind `pagekv route`, all on loopback, once per (backend count, routing
// policy, tier) combination: each run starts fresh processes, sends the
// trace's first requests at their (scaled) arrival times as streamed
// completions, and reads each answer's time to first token and
// usage.cached_tokens. The oracle is one unbounded pool seeing the same
// requests in the same order (each request hits the longest prefix of full
// blocks any earlier one had, less its last token).
struct FleetBenchOptions {
  std::string cli_path;                   // the pagekv binary (backends and router)
  std::string trace_path;
  TraceFormat format = TraceFormat::kAuto;
  std::string model_path;                 // empty: a synthetic model, written for the run
  std::string synth_preset = "tiny-16k";
  std::vector<int> backend_counts = {2, 3};
  std::vector<std::string> policies = {"round-robin", "least-loaded", "kv"};
  double load_weight = 0.25;              // the router's --load-weight (kv policy)
  double kv_usage_weight = 0.0;           // the router's --kv-usage-weight (kv policy)
  // "none" or "cluster" (every backend's tier: the Redis Cluster at
  // redis_cluster, a namespace of its own per run).
  std::vector<std::string> tier_configs = {"none"};
  std::string redis_cluster;
  int64_t kv_budget_bytes = 8ll << 20;    // each backend's pool
  int64_t max_requests = 100;             // 0 = the whole trace
  double time_scale = 0.01;
  int32_t max_tokens = 16;                // per request: prefix reuse is what is measured
  int32_t block_len = 16;
  // Tokens per 512-token chunk of the trace (1..512): 32 shrinks prompts
  // 16x with the same prefix structure (hash ids), so a run takes minutes
  // on CPUs instead of hours.
  int32_t chunk_tokens = 512;
  int threads_per_backend = 1;
  // > 0: the first backend is killed when this request is sent (its
  // requests cut or answered elsewhere: `failed`, and `mismatched` must
  // stay 0).
  int64_t kill_backend_after = 0;
  // > 0, with the cluster tier: the cluster's first listed node (a primary
  // as scripts/redis-cluster.sh starts it) is shut down without saving
  // when this request is sent (once: the cluster stays as failed over).
  int64_t kill_primary_after = 0;
  std::function<void(const std::string& run, int64_t done, int64_t total)> on_progress;
};

struct FleetRun {
  int backends = 0;
  std::string policy, tiers;
  int64_t requests = 0, failed = 0, skipped = 0;  // skipped: longer than the context
  int64_t prompt_tokens = 0, cached_tokens = 0;
  double hit_rate = 0;                    // cached_tokens / prompt_tokens (as the backends reported)
  double ttft_p50_ms = 0, ttft_p99_ms = 0;
  double output_tokens_per_s = 0, seconds = 0;
  int64_t exact_predictions = 0, reported_decisions = 0;  // the router's (kv policy: predicted = reported)
  // Answers that differ from the same request's answer in an earlier run
  // (greedy decoding: any difference is wrong output).
  int64_t mismatched = 0;
  bool killed_backend = false;
  std::string killed_primary;  // the cluster node shut down during the run, if any
  // With a kill: the requests in three phases, by when each was sent:
  // before the kill, from the kill until the cluster had promoted the killed
  // primary's replica (a backend kill: until its requests were answered
  // elsewhere, i.e. none), and after; each phase's hit rate against the
  // one-pool oracle's on the same requests. A phase after the window below
  // the oracle is what the window's lost writes cost.
  int64_t kill_index = -1;       // the first request sent after the kill
  int64_t promoted_index = -1;   // the first request sent after the promotion (-1: not seen)
  double promotion_seconds = 0;  // from the kill to the promotion
  double phase_hit_rate[3] = {0, 0, 0};
  double phase_oracle_hit_rate[3] = {0, 0, 0};
};

struct FleetBenchReport {
  std::string model;
  double oracle_hit_rate = 0;             // one unbounded pool, the same requests
  std::vector<FleetRun> runs;
};

Result<FleetBenchReport> RunFleetBench(const FleetBenchOptions& options);

// `pagekv bench collectives` (under mpirun): the cost of the traffic a
// split model sends, per message size: the all-ranks sum tensor parallel
// does twice a layer (AllReduceSum: a reduce to rank 0 and a broadcast), a
// broadcast, and a one-way message between ranks 0 and 1 (pipeline stages;
// half a ping-pong round trip). Every rank calls it with the same sizes;
// each reports its own timings.
struct CollectiveBenchResult {
  int64_t bytes = 0;
  // all_reduce: AllReduceSum (reduce then broadcast); start_sum: StartSum
  // then WaitSum at once (the all-gather form the overlapped tensor sums
  // use, nothing to hide it under).
  double all_reduce_us = 0, start_sum_us = 0, broadcast_us = 0, send_us = 0;
  double send_gbps = 0;  // bytes / send_us
};
Result<std::vector<CollectiveBenchResult>> RunCollectiveBench(Communicator& comm, const std::vector<int64_t>& sizes,
                                                              double seconds_per_size = 0.2);

}  // namespace pagekv
