// `pagekv bench generate`: whole-model prefill and decode throughput on the
// paged cache, the decode step against its roofline (include/pagekv/bench.h).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "base/thread_pool.h"
#include "engine/forward_step.h"
#include "kernels/machine_ceilings.h"
#include "model/gguf_file.h"
#include "model/llama_model.h"
#include "pagekv/attention.h"
#include "pagekv/bench.h"
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
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model, LlamaModel::FromGguf(std::move(file)));
  const LlamaConfig& c = model->config();
  if (o.prompt_len + o.decode_steps > c.context_len) {
    return OutOfRangeError("bench generate: prompt " + std::to_string(o.prompt_len) + " + " +
                           std::to_string(o.decode_steps) + " steps exceed the model's context of " +
                           std::to_string(c.context_len));
  }
  report.parameters = model->ParameterCount();
  report.kv_dtype = std::string(DTypeName(o.kv_dtype));
  report.block_len = o.block_len;
  report.simd_target = AttentionSimdTarget();
  report.threads = o.num_threads > 0 ? o.num_threads : ThreadPool::Shared().num_threads();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(3, c.vocab_size - 1);
  for (int64_t batch : o.batches) {
    const int64_t per_seq = o.prompt_len + o.decode_steps;
    KvCacheOptions co;
    co.config = model->CacheGeometry(o.block_len, o.kv_dtype, batch * ((per_seq + o.block_len - 1) / o.block_len));
    PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
    std::vector<SeqId> seqs;
    std::vector<ForwardItem> items;
    std::vector<float> logits(static_cast<size_t>(batch * c.vocab_size));
    for (int64_t i = 0; i < batch; ++i) {
      auto& p = prompts[static_cast<size_t>(i)];
      p.push_back(1);
      while (static_cast<int64_t>(p.size()) < o.prompt_len) p.push_back(token(rng));
      seqs.push_back(cache->AddSequence());
      items.push_back({seqs.back(), p, logits.data() + i * c.vocab_size, false});
    }
    const ForwardOptions fo{o.num_threads, nullptr};
    auto start = std::chrono::steady_clock::now();
    PAGEKV_ASSIGN_OR_RETURN(bool fit, ForwardStep(*model, *cache, items, fo));
    if (!fit) return InternalError("bench generate: the pool was sized too small");
    GenerateBenchResult r;
    r.batch = batch;
    r.prompt_len = o.prompt_len;
    r.decode_steps = o.decode_steps;
    r.prefill_seconds = Seconds(start);
    r.prefill_tokens_per_second = static_cast<double>(batch * o.prompt_len) / r.prefill_seconds;
    // Decode: greedy next tokens, one step per token for the whole batch.
    std::vector<int32_t> next(static_cast<size_t>(batch));
    ForwardTimings timings;
    const ForwardOptions timed{o.num_threads, &timings};
    start = std::chrono::steady_clock::now();
    for (int64_t step = 0; step < o.decode_steps; ++step) {
      for (int64_t i = 0; i < batch; ++i) {
        const float* row = logits.data() + i * c.vocab_size;
        next[static_cast<size_t>(i)] = static_cast<int32_t>(std::max_element(row, row + c.vocab_size) - row);
        items[static_cast<size_t>(i)].tokens = {&next[static_cast<size_t>(i)], 1};
      }
      PAGEKV_ASSIGN_OR_RETURN(bool step_fit, ForwardStep(*model, *cache, items, timed));
      if (!step_fit) return InternalError("bench generate: the pool was sized too small");
    }
    r.decode_seconds = Seconds(start);
    r.decode_tokens_per_second = static_cast<double>(batch * o.decode_steps) / r.decode_seconds;
    r.decode_step_ms = 1e3 * r.decode_seconds / static_cast<double>(o.decode_steps);
    r.decode_attention_share = timings.attention / timings.total;
    r.decode_matmul_share = timings.matmul / timings.total;
    // Per step: weights once; K and V of every cached position of every layer
    // (the mean context over the steps); the attention's multiply-adds are
    // 2 * head_dim per (query head, position) and the matrices' per token.
    const double mean_ctx = static_cast<double>(o.prompt_len) + static_cast<double>(o.decode_steps + 1) / 2.0;
    const KvLayout& layout = cache->layout();
    r.step_weight_bytes = model->StepWeightBytes();
    r.step_kv_bytes = static_cast<int64_t>(static_cast<double>(batch) * mean_ctx * static_cast<double>(layout.bytes_per_token()));
    r.step_flops = 2.0 * static_cast<double>(batch) *
                   (static_cast<double>(model->MatrixMultiplyAddsPerToken()) +
                    2.0 * c.num_layers * c.num_heads * c.head_dim * mean_ctx);
    // Ceilings measured right after the rows they judge.
    const std::unique_ptr<kernels::StreamProbe> probe = kernels::StreamProbe::Create(int64_t{256} << 20, report.threads);
    report.stream_read_gbps = std::max(report.stream_read_gbps, probe != nullptr ? probe->MeasureGbps() : 0.0);
    report.fma_gflops = std::max(report.fma_gflops, kernels::MeasureFmaGflops(report.threads, 2));
    const double memory_ms = 1e3 * static_cast<double>(r.step_weight_bytes + r.step_kv_bytes) / (report.stream_read_gbps * 1e9);
    const double compute_ms = 1e3 * r.step_flops / (report.fma_gflops * 1e9);
    r.step_floor_ms = std::max(memory_ms, compute_ms);
    r.bound = memory_ms >= compute_ms ? "memory" : "compute";
    r.ratio_to_roofline = r.step_floor_ms / r.decode_step_ms;
    if (o.on_result) o.on_result(r);
    report.results.push_back(r);
  }
  return report;
}

}  // namespace pagekv
