// `pagekv bench generate`: whole-model prefill and decode throughput on the
// paged cache, the decode step against its roofline (include/pagekv/bench.h).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "base/thread_pool.h"
#include "engine/engine_internal.h"
#include "engine/forward_step.h"
#include "kernels/machine_ceilings.h"
#include "model/model.h"
#include "model/model_loader.h"
#include "pagekv/attention.h"
#include "pagekv/bench.h"
#include "pagekv/engine.h"
#include "pagekv/kv_cache.h"
#include "pagekv/synth_model.h"

namespace pagekv {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// A synthetic model written to a temporary file that is removed when done.
class TempModel {
 public:
  ~TempModel() {
    if (!path_.empty()) std::remove(path_.c_str());
  }
  Status Write(const GenerateBenchOptions& o) {
    PAGEKV_ASSIGN_OR_RETURN(SynthModelSpec spec, FindSynthModelPreset(o.synth_preset));
    const char* dir = std::getenv("TMPDIR");
    path_ = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/pagekv-bench-" + o.synth_preset + "-" +
            std::to_string(::getpid()) + ".gguf";
    Status s = WriteSynthModel(spec, /*seed=*/1, o.weight_type, path_);
    if (!s.ok()) path_.clear();
    return s;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Another process that keeps one core busy for as long as this lives: a
// forked child spinning until it is killed (it touches nothing the parent's
// threads hold, so forking a threaded process is safe here).
class BusyNeighbour {
 public:
  ~BusyNeighbour() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Status Start() {
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) return InternalError("bench generate: could not fork the busy neighbour");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // gone with the bench, however it ends
      if (::getppid() != parent) ::_exit(0);  // the bench already ended
      for (;;) asm volatile("" ::: "memory");  // a loop the compiler keeps
    }
    return Status::Ok();
  }

 private:
  pid_t pid_ = -1;
};

}  // namespace

Result<GenerateBenchReport> RunGenerateBench(const GenerateBenchOptions& o) {
  if (o.batches.empty() || o.prompt_len < 1 || o.decode_steps < 1) {
    return InvalidArgumentError("bench generate: batches, prompt length and decode steps must be positive");
  }
  for (int64_t b : o.batches) {
    if (b < 1 || b > 4096) return InvalidArgumentError("bench generate: batch " + std::to_string(b) + " is outside [1, 4096]");
  }
  GenerateBenchReport report;
  TempModel temp;
  std::string path = o.model_path;
  if (path.empty()) {
    PAGEKV_RETURN_IF_ERROR(temp.Write(o));
    path = temp.path();
    report.model = "synthetic " + o.synth_preset;
    report.weight_type = o.weight_type;
  } else {
    report.model = path;
    report.weight_type = "as stored";
  }
  PAGEKV_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(path, {}, o.parallel));
  const Model* model = loaded.model.get();
  const ModelConfig& c = model->config();
  if (o.prompt_len + o.decode_steps + 1 > c.context_len) {  // the last step's sampled token takes a position too
    return OutOfRangeError("bench generate: prompt " + std::to_string(o.prompt_len) + " + " +
                           std::to_string(o.decode_steps) + " steps + 1 exceed the model's context of " +
                           std::to_string(c.context_len));
  }
  report.parameters = model->ParameterCount();
  report.kv_dtype = std::string(DTypeName(o.kv_dtype));
  report.block_len = o.block_len;
  // A device: made once here for its read probe (the engine makes its own).
  PAGEKV_ASSIGN_OR_RETURN(const std::unique_ptr<Backend> device, MakeDeviceBackend(o.device, {o.tensor_cores, o.cuda_graphs}));
  if (device != nullptr) {
    if (o.busy_neighbour) return InvalidArgumentError("bench generate: --busy-neighbour measures the CPU's thread pool: drop --device");
    report.device = device->name();
  }
  report.simd_target = device != nullptr ? "CUDA" : AttentionSimdTarget();
  report.threads = o.num_threads > 0 ? o.num_threads : ThreadPool::Shared().num_threads();
  report.busy_neighbour = o.busy_neighbour;
  CacheConfig geometry = model->CacheGeometry(o.block_len, o.kv_dtype, 1);
  if (c.hybrid() && o.kv_groups != KvGroups::kUniform) geometry.layer_windows = c.layer_windows;  // as the engine does
  PAGEKV_ASSIGN_OR_RETURN(const KvLayout layout, KvLayout::Create(geometry));
  report.kv_cache = layout.hybrid() ? "hybrid (" + std::to_string(layout.num_groups()) + " groups of " +
                                          std::to_string(layout.layers_per_block()) + " layers)"
                                    : "uniform";
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(3, c.vocab_size - 1);
  BusyNeighbour neighbour;
  std::vector<int> thread_counts = {report.threads};
  if (o.busy_neighbour) {
    PAGEKV_RETURN_IF_ERROR(neighbour.Start());
    if (report.threads > 1) thread_counts = {1, report.threads};
  }
  for (int64_t batch : o.batches)
  for (int threads : thread_counts) {
    // The engine, stepped here: one step prefills every prompt, then one
    // decode step per token for the whole batch (greedy).
    const int64_t per_seq = o.prompt_len + o.decode_steps + 1;
    EngineOptions eo;
    eo.model_path = path;
    eo.block_len = o.block_len;
    eo.kv_dtype = o.kv_dtype;
    eo.kv_groups = o.kv_groups;
    eo.prefix_cache = false;
    eo.num_blocks = batch * (layout.BlocksHeld(per_seq, batch * o.prompt_len) + layout.num_groups());
    eo.watermark_blocks = 0;
    eo.max_step_tokens = batch * o.prompt_len;
    eo.max_running = static_cast<int32_t>(batch);
    eo.max_queue = batch;
    eo.threads = threads;
    eo.mla_prefill = o.mla_prefill;
    eo.overlap_communication = o.overlap_communication;
    eo.parallel = o.parallel;
    eo.device = o.device;
    eo.tensor_cores = o.tensor_cores;
    eo.cuda_graphs = o.cuda_graphs;
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, CreateEngineWithModel(eo, loaded));
    for (int64_t i = 0; i < batch; ++i) {
      EngineRequest r;
      r.prompt.push_back(1);
      while (static_cast<int64_t>(r.prompt.size()) < o.prompt_len) r.prompt.push_back(token(rng));
      r.max_tokens = static_cast<int32_t>(o.decode_steps + 1);
      r.ignore_eos = true;
      PAGEKV_RETURN_IF_ERROR(engine->Submit(std::move(r)).status());
    }
    auto start = std::chrono::steady_clock::now();
    PAGEKV_RETURN_IF_ERROR(engine->Step().status());
    GenerateBenchResult r;
    r.batch = batch;
    r.prompt_len = o.prompt_len;
    r.decode_steps = o.decode_steps;
    r.prefill_seconds = Seconds(start);
    r.prefill_tokens_per_second = static_cast<double>(batch * o.prompt_len) / r.prefill_seconds;
    const EngineMetrics before = engine->Metrics();
    if (before.generated_tokens != batch) {
      return InternalError("bench generate: the first step prefilled " + std::to_string(before.generated_tokens) +
                           " of " + std::to_string(batch) + " prompts");
    }
    const ThreadPool::Stats pool_before = ThreadPool::Shared().stats();
    start = std::chrono::steady_clock::now();
    for (int64_t step = 0; step < o.decode_steps; ++step) PAGEKV_RETURN_IF_ERROR(engine->Step().status());
    r.decode_seconds = Seconds(start);
    const ThreadPool::Stats pool_after = ThreadPool::Shared().stats();
    r.threads = threads;
    r.pool_parallel_loops = pool_after.parallel_loops - pool_before.parallel_loops;
    r.pool_solo_loops = pool_after.solo_loops - pool_before.solo_loops;
    r.pool_late_loops = pool_after.late_loops - pool_before.late_loops;
    r.pool_crowded_loops = pool_after.crowded_loops - pool_before.crowded_loops;
    r.pool_preempted_spins = pool_after.preempted_spins - pool_before.preempted_spins;
    r.pool_host_stalls = pool_after.host_stalls - pool_before.host_stalls;
    const EngineMetrics after = engine->Metrics();
    if (after.generated_tokens != batch * (o.decode_steps + 1)) {
      return InternalError("bench generate: the decode steps ran " + std::to_string(after.generated_tokens) +
                           " tokens, not " + std::to_string(batch * (o.decode_steps + 1)));
    }
    r.decode_tokens_per_second = static_cast<double>(batch * o.decode_steps) / r.decode_seconds;
    r.decode_step_ms = 1e3 * r.decode_seconds / static_cast<double>(o.decode_steps);
    const double forward = after.forward_seconds - before.forward_seconds;
    r.decode_attention_share = (after.attention_seconds - before.attention_seconds) / forward;
    r.decode_matmul_share = (after.matmul_seconds - before.matmul_seconds) / forward;
    r.decode_communication_share = (after.communication_seconds - before.communication_seconds) / forward;
    r.decode_communication_ms =
        1e3 * (after.communication_seconds - before.communication_seconds) / static_cast<double>(o.decode_steps);
    r.kv_bytes_per_token = after.bytes_per_token;
    // Per step: weights once; K and V of every cached position of every layer
    // (the mean context over the steps); the attention's multiply-adds are
    // 2 * head_dim per (query head, position) (MLA: 2 * (rank + rope), the
    // absorbed form's) and the matrices' per token.
    const double mean_ctx = static_cast<double>(o.prompt_len) + static_cast<double>(o.decode_steps + 1) / 2.0;
    r.step_weight_bytes = model->StepWeightBytes();
    // A sliding layer reads only its window (uniform cache or hybrid).
    double token_layers_read = 0;
    for (int32_t l = 0; l < c.num_layers; ++l) {
      token_layers_read += c.window(l) > 0 ? std::min<double>(mean_ctx, c.window(l)) : mean_ctx;
    }
    r.step_kv_bytes = static_cast<int64_t>(static_cast<double>(batch) * token_layers_read *
                                           static_cast<double>(layout.bytes_per_token()) / c.num_layers);
    r.step_flops = 2.0 * static_cast<double>(batch) *
                   (static_cast<double>(model->MatrixMultiplyAddsPerToken()) +
                    static_cast<double>(c.num_layers) * c.num_heads * static_cast<double>(c.AttentionMultiplyAdds()) * mean_ctx);
    // Ceilings measured right after the rows they judge.
    double row_stream = 0, row_fma = 0;
    if (device != nullptr) {
      // The device holds every matrix decoded to 16 bits (the fast path).
      r.step_weight_bytes = 2 * model->MatrixMultiplyAddsPerToken();
      Result<double> gbps = device->DeviceReadGbps(int64_t{1} << 30);
      row_stream = gbps.ok() ? *gbps : 0.0;
    } else {
      const std::unique_ptr<kernels::StreamProbe> probe = kernels::StreamProbe::Create(int64_t{256} << 20, threads);
      // Rows at the report's thread count are judged by the best ceilings
      // seen so far (as before), 1-thread rows by their own probe.
      row_stream = probe != nullptr ? probe->MeasureGbps() : 0.0;
      row_fma = kernels::MeasureFmaGflops(threads, 2);
    }
    if (threads == report.threads) {
      row_stream = report.stream_read_gbps = std::max(report.stream_read_gbps, row_stream);
      row_fma = report.fma_gflops = std::max(report.fma_gflops, row_fma);
    }
    const double memory_ms = 1e3 * static_cast<double>(r.step_weight_bytes + r.step_kv_bytes) / (row_stream * 1e9);
    const double compute_ms = row_fma > 0 ? 1e3 * r.step_flops / (row_fma * 1e9) : 0.0;
    r.step_floor_ms = std::max(memory_ms, compute_ms);
    r.bound = memory_ms >= compute_ms ? "memory" : "compute";
    r.ratio_to_roofline = r.step_floor_ms / r.decode_step_ms;
    if (o.on_result) o.on_result(r);
    report.results.push_back(r);
  }
  return report;
}

}  // namespace pagekv
