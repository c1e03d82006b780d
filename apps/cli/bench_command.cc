// `pagekv bench`: the benchmarks against the machine's measured ceilings;
// `bench attention` is in bench_attention_command.cc, `bench collectives` in
// bench_collectives_command.cc.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "machine_output.h"
#include "tp_flags.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

// --mla-prefill (EngineOptions::MlaPrefill), for the commands that run the engine.
EngineOptions::MlaPrefill ParseMlaPrefill(const std::string& s) {
  return s == "absorbed"     ? EngineOptions::MlaPrefill::kAbsorbed
         : s == "unabsorbed" ? EngineOptions::MlaPrefill::kUnabsorbed
                             : EngineOptions::MlaPrefill::kAuto;
}

void AddMlaPrefillOption(CLI::App& cmd, std::string& value) {
  cmd.add_option("--mla-prefill", value,
                 "deepseek2 models' prompt chunks: auto (default: per chunk, the form with fewer multiply-adds), "
                 "absorbed or unabsorbed")
      ->check(CLI::IsMember({"auto", "absorbed", "unabsorbed"}));
}

struct GenerateBenchArgs {
  bool json = false, quick = false;
  int threads = 0;
  std::string model, preset = "llama-110m", weight_type = "f16", kv_dtype = "f16";
  std::vector<int64_t> batches = {1, 8, 32};
  int64_t prompt_len = 128, steps = 32;
  int32_t block_len = 16;
  bool busy_neighbour = false, no_overlap = false, no_amx = false;
  std::string mla_prefill = "auto";
  std::string kv_cache = "auto";
  int tp = 1, pp = 1, cp = 1;
  bool block_len_given = false;
  std::string device = "cpu";
  bool tensor_cores = false;
  bool cuda_graphs = false;
};

int RunGenerateBenchCommand(const GenerateBenchArgs& a) {
  GenerateBenchOptions o;
  const ParallelJoin join = JoinParallel(a.tp, a.pp, a.cp, "bench generate");
  if (join.exit_code >= 0) return join.exit_code;
  o.parallel = join.parallel;
  o.model_path = a.model;
  o.synth_preset = a.quick ? "tiny" : a.preset;
  o.weight_type = a.weight_type;
  o.batches = a.quick ? std::vector<int64_t>{1, 4} : a.batches;
  o.prompt_len = a.quick ? 16 : a.prompt_len;
  o.decode_steps = a.quick ? 4 : a.steps;
  o.block_len = a.cp > 1 && !a.block_len_given ? a.block_len * a.cp : a.block_len;
  o.num_threads = RankThreads(a.threads, a.tp * a.pp * a.cp);
  o.busy_neighbour = a.busy_neighbour;
  o.device = a.device;
  o.tensor_cores = a.tensor_cores;
  o.cuda_graphs = a.cuda_graphs;
  o.mla_prefill = ParseMlaPrefill(a.mla_prefill);
  o.overlap_communication = !a.no_overlap;
  if (a.no_amx) SetAmxPaths(false);
  Result<DType> dt = ParseDType(a.kv_dtype);
  if (!dt.ok()) {
    std::fprintf(stderr, "error: --kv-dtype: %s\n", dt.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_dtype = *dt;
  Result<KvGroups> groups = ParseKvGroups(a.kv_cache);
  if (!groups.ok()) {
    std::fprintf(stderr, "error: --kv-cache: %s\n", groups.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_groups = *groups;
  // The header with the first row, so that a run that cannot start (no
  // such device, a bad flag found late) prints its one-line error alone.
  bool header_printed = false;
  auto print_header = [&a, &header_printed] {
    if (header_printed) return;
    header_printed = true;
    PrintMachine();
    if (a.busy_neighbour) std::printf("with a busy neighbour: another process spins on one core throughout\n");
    if (a.tp * a.pp * a.cp > 1) {
      std::printf("tensor parallel %d x pipeline parallel %d x context parallel %d (these figures are rank 0's: its "
                  "heads' and layers' weights and its slice of the KV; comm = time in the collectives and stage "
                  "transfers, waiting for the other ranks included)\n",
                  a.tp, a.pp, a.cp);
      if (a.tp > 1) std::printf("tensor sums: %s\n", a.no_overlap ? "each waited for at once (--no-overlap)" : "overlapped with the other half projection");
    }
    std::printf("%5s %3s %7s %6s %12s %12s %9s %8s %8s %8s %9s %7s %-7s %s\n", "batch", "thr", "prompt", "steps",
                "prefill t/s", "decode t/s", "ms/step", "attn", "matmul", "comm", "floor ms", "ratio", "bound",
                "pool: parallel/solo/late/crowded loops, preempted spins, host stalls");
  };
  if (!a.json) {
    o.on_result = [&print_header](const GenerateBenchResult& r) {
      print_header();
      std::printf("%5ld %3d %7ld %6ld %12.1f %12.1f %9.2f %7.1f%% %7.1f%% %7.1f%% %9.2f %7.2f %-7s %ld/%ld/%ld/%ld, %ld, %ld\n",
                  static_cast<long>(r.batch), r.threads, static_cast<long>(r.prompt_len),
                  static_cast<long>(r.decode_steps), r.prefill_tokens_per_second, r.decode_tokens_per_second,
                  r.decode_step_ms, 100 * r.decode_attention_share, 100 * r.decode_matmul_share,
                  100 * r.decode_communication_share, r.step_floor_ms,
                  r.ratio_to_roofline, r.bound.c_str(), static_cast<long>(r.pool_parallel_loops),
                  static_cast<long>(r.pool_solo_loops), static_cast<long>(r.pool_late_loops),
                  static_cast<long>(r.pool_crowded_loops),
                  static_cast<long>(r.pool_preempted_spins), static_cast<long>(r.pool_host_stalls));
      std::fflush(stdout);
    };
  }
  Result<GenerateBenchReport> r = RunGenerateBench(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    const StatusCode c = r.status().code();
    return c == StatusCode::kInvalidArgument || c == StatusCode::kOutOfRange || c == StatusCode::kNotFound ||
                   c == StatusCode::kDataLoss || c == StatusCode::kUnavailable
               ? kExitBadInput
               : kExitFailed;
  }
  if (a.json) {
    nlohmann::ordered_json j;
    j["machine"] = MachineJson();
    j["model"] = r->model;
    j["parameters"] = r->parameters;
    j["weight_type"] = r->weight_type;
    j["kv_dtype"] = r->kv_dtype;
    j["block_len"] = r->block_len;
    j["kv_cache"] = r->kv_cache;
    j["device"] = r->device;
    j["simd_target"] = r->simd_target;
    j["threads"] = r->threads;
    j["stream_read_gbps"] = r->stream_read_gbps;
    j["fma_gflops"] = r->fma_gflops;
    j["busy_neighbour"] = r->busy_neighbour;
    j["tensor_parallel"] = a.tp;
    j["context_parallel"] = a.cp;
    j["pipeline_parallel"] = a.pp;
    j["overlap_communication"] = !a.no_overlap;
    j["results"] = nlohmann::ordered_json::array();
    for (const GenerateBenchResult& x : r->results) {
      j["results"].push_back({{"batch", x.batch},
                              {"prompt_len", x.prompt_len},
                              {"decode_steps", x.decode_steps},
                              {"prefill_seconds", x.prefill_seconds},
                              {"prefill_tokens_per_second", x.prefill_tokens_per_second},
                              {"decode_seconds", x.decode_seconds},
                              {"decode_tokens_per_second", x.decode_tokens_per_second},
                              {"decode_step_ms", x.decode_step_ms},
                              {"decode_attention_share", x.decode_attention_share},
                              {"decode_matmul_share", x.decode_matmul_share},
                              {"decode_communication_share", x.decode_communication_share},
                              {"decode_communication_ms", x.decode_communication_ms},
                              {"kv_bytes_per_token", x.kv_bytes_per_token},
                              {"step_weight_bytes", x.step_weight_bytes},
                              {"step_kv_bytes", x.step_kv_bytes},
                              {"step_flops", x.step_flops},
                              {"step_floor_ms", x.step_floor_ms},
                              {"ratio_to_roofline", x.ratio_to_roofline},
                              {"bound", x.bound},
                              {"threads", x.threads},
                              {"pool_parallel_loops", x.pool_parallel_loops},
                              {"pool_solo_loops", x.pool_solo_loops},
                              {"pool_late_loops", x.pool_late_loops},
                              {"pool_crowded_loops", x.pool_crowded_loops},
                              {"pool_preempted_spins", x.pool_preempted_spins},
                              {"pool_host_stalls", x.pool_host_stalls}});
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else if (r->device != "cpu") {
    std::printf("%s, %.1fM parameters, %s weights, %s KV, block_len %d, %s cache; %s: device read %.1f GB/s\n",
                r->model.c_str(), static_cast<double>(r->parameters) / 1e6, r->weight_type.c_str(), r->kv_dtype.c_str(),
                r->block_len, r->kv_cache.c_str(), r->device.c_str(), r->stream_read_gbps);
  } else {
    std::printf("%s, %.1fM parameters, %s weights, %s KV, block_len %d, %s cache; %d threads (%s): stream read %.1f GB/s, "
                "fp32 FMA %.1f GFLOP/s\n",
                r->model.c_str(), static_cast<double>(r->parameters) / 1e6, r->weight_type.c_str(),
                r->kv_dtype.c_str(), r->block_len, r->kv_cache.c_str(), r->threads, r->simd_target.c_str(), r->stream_read_gbps,
                r->fma_gflops);
  }
  return kExitOk;
}

// A progress bar on stderr: "\rLABEL [####....] done/total", a newline at the end.
void Progress(const std::string& label, int label_width, int64_t done, int64_t total) {
  constexpr int width = 40;
  const int filled = static_cast<int>(width * done / std::max<int64_t>(total, 1));
  std::fprintf(stderr, "\r%-*s [%s%s] %ld/%ld", label_width, label.c_str(), std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(width - filled), '.').c_str(), static_cast<long>(done), static_cast<long>(total));
  if (done == total) std::fprintf(stderr, "\n");
}

struct ServeBenchArgs {
  std::string trace, format = "auto", model, preset = "small-16k", kv_budget = "32MiB", allocator = "both", plot, kv_dtype = "f16";
  int64_t max_requests = 0, step_tokens = 2048;
  double time_scale = 0.01;
  int32_t max_tokens = 0, block_len = 16, max_running = 256;
  std::string mla_prefill = "auto", kv_cache = "auto";
  int threads = 0;
  bool json = false;
  std::string tiers, host_cache = "256MiB", disk_cache_size = "1GiB", redis, redis_password_env = "PAGEKV_REDIS_PASSWORD";
};

int RunServeBenchCommand(const ServeBenchArgs& a) {
  ServeBenchOptions o;
  o.trace_path = a.trace;
  Result<TraceFormat> format = ParseTraceFormat(a.format);
  if (!format.ok()) {
    std::fprintf(stderr, "error: --format: %s\n", format.status().message().c_str());
    return kExitBadInput;
  }
  o.format = *format;
  if (a.allocator == "paged") {
    o.allocators = {Allocator::kPaged};
  } else if (a.allocator == "contiguous") {
    o.allocators = {Allocator::kContiguous};
  } else if (a.allocator != "both") {
    std::fprintf(stderr, "error: --allocator '%s': use paged, contiguous or both\n", a.allocator.c_str());
    return kExitBadInput;
  }
  Result<int64_t> budget = ParseByteSize(a.kv_budget);
  if (!budget.ok()) {
    std::fprintf(stderr, "error: --kv-budget: %s\n", budget.status().message().c_str());
    return kExitBadInput;
  }
  Result<DType> dt = ParseDType(a.kv_dtype);
  if (!dt.ok()) {
    std::fprintf(stderr, "error: --kv-dtype: %s\n", dt.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_budget_bytes = *budget;
  o.kv_dtype = *dt;
  if (a.kv_cache == "both") {
    o.kv_groups = {KvGroups::kHybrid, KvGroups::kUniform};
  } else {
    Result<KvGroups> groups = ParseKvGroups(a.kv_cache);
    if (!groups.ok()) {
      std::fprintf(stderr, "error: --kv-cache: %s (or both)\n", groups.status().message().c_str());
      return kExitBadInput;
    }
    o.kv_groups = {*groups};
  }
  o.model_path = a.model == "synthetic" ? "" : a.model;
  o.synth_preset = a.preset;
  o.max_requests = a.max_requests;
  o.time_scale = a.time_scale;
  o.max_tokens = a.max_tokens;
  o.block_len = a.block_len;
  o.max_step_tokens = a.step_tokens;
  o.max_running = a.max_running;
  o.mla_prefill = ParseMlaPrefill(a.mla_prefill);
  o.threads = a.threads;
  if (!a.tiers.empty()) {
    std::stringstream list(a.tiers);
    for (std::string c; std::getline(list, c, ',');) {
      if (!c.empty()) o.tier_configs.push_back(c);
    }
    for (auto [flag, text, out] : {std::tuple{"--host-cache", &a.host_cache, &o.host_cache_bytes},
                                   std::tuple{"--disk-cache-size", &a.disk_cache_size, &o.disk_cache_bytes}}) {
      Result<int64_t> v = ParseByteSize(*text);
      if (!v.ok() || *v <= 0) {
        std::fprintf(stderr, "error: %s '%s': %s\n", flag, text->c_str(), v.ok() ? "must be positive" : v.status().message().c_str());
        return kExitBadInput;
      }
      *out = *v;
    }
    o.redis_url = a.redis;
    if (const char* pw = std::getenv(a.redis_password_env.c_str())) o.redis_password = pw;
  }
  o.on_progress = [](const std::string& allocator, int64_t done, int64_t total) {
    if (done % 20 == 0 || done == total) Progress(allocator, 10, done, total);
  };
  if (!a.json) PrintMachine();
  Result<ServeBenchReport> r = RunServeBench(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    const StatusCode c = r.status().code();
    return c == StatusCode::kInternal || c == StatusCode::kIoError ? kExitFailed : kExitBadInput;
  }
  if (!a.plot.empty()) {
    std::FILE* f = std::fopen(a.plot.c_str(), "w");
    const std::string svg = ServePlotSvg(*r);
    if (f == nullptr || std::fwrite(svg.data(), 1, svg.size(), f) != svg.size()) {
      std::fprintf(stderr, "error: cannot write --plot '%s'\n", a.plot.c_str());
      if (f != nullptr) std::fclose(f);
      return kExitFailed;
    }
    std::fclose(f);
  }
  auto row = [](const ServeBenchResult& x) {
    return nlohmann::ordered_json{{"allocator", x.allocator}, {"requests", x.requests}, {"skipped", x.skipped},
                                  {"seconds", x.seconds}, {"requests_per_s", x.requests_per_s},
                                  {"output_tokens_per_s", x.output_tokens_per_s}, {"ttft_p50_ms", x.ttft_p50_ms},
                                  {"ttft_p99_ms", x.ttft_p99_ms}, {"itl_p50_ms", x.itl_p50_ms}, {"itl_p99_ms", x.itl_p99_ms},
                                  {"mean_running", x.mean_running}, {"peak_running", x.peak_running},
                                  {"mean_table_contiguity", x.mean_table_contiguity},
                                  {"kv_utilization", x.kv_utilization}, {"preemptions", x.preemptions},
                                  {"prefix_hit_rate", x.prefix_hit_rate}, {"tiers", x.tiers},
                                  {"pool_hit_blocks", x.pool_hit_blocks}, {"host_hit_blocks", x.host_hit_blocks},
                                  {"disk_hit_blocks", x.disk_hit_blocks}, {"redis_hit_blocks", x.redis_hit_blocks},
                                  {"tier_errors", x.tier_errors}, {"background_loads", x.background_loads},
                                  {"evictions_copied", x.evictions_copied},
                                  {"evictions_precopied", x.evictions_precopied}};
  };
  if (a.json) {
    nlohmann::ordered_json j;
    if (r->results.size() == 1) j = row(r->results[0]);
    j["machine"] = MachineJson();
    j["model"] = r->model;
    j["kv_budget_bytes"] = r->kv_budget_bytes;
    j["blocks"] = r->blocks;
    if (r->results.size() > 1) {
      j["results"] = nlohmann::ordered_json::array();
      for (const auto& x : r->results) j["results"].push_back(row(x));
    }
    if (r->results.size() == 2 && o.tier_configs.empty()) {
      const ServeBenchResult &p = r->results[0], &c = r->results[1];
      j["paged_vs_contiguous"] = {{"mean_running", c.mean_running > 0 ? p.mean_running / c.mean_running : 0},
                                  {"output_tokens_per_s", c.output_tokens_per_s > 0 ? p.output_tokens_per_s / c.output_tokens_per_s : 0}};
    }
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("%s, KV budget %s (%ld blocks of %d tokens)\n", r->model.c_str(), FormatBytes(r->kv_budget_bytes).c_str(),
              static_cast<long>(r->blocks), a.block_len);
  std::printf("%-17s %8s %8s %10s %9s %9s %9s %9s %9s %6s %7s %6s %8s %7s\n", "allocator", "requests", "req/s", "out tok/s",
              "ttft p50", "ttft p99", "itl p50", "itl p99", "mean run", "peak", "kv util", "preem", "prefix", "contig");
  for (const auto& x : r->results) {
    std::printf("%-17s %8ld %8.2f %10.1f %8.1fms %8.1fms %8.2fms %8.2fms %9.1f %6ld %7.3f %6ld %7.1f%% %7.3f\n", x.allocator.c_str(),
                static_cast<long>(x.requests), x.requests_per_s, x.output_tokens_per_s, x.ttft_p50_ms, x.ttft_p99_ms,
                x.itl_p50_ms, x.itl_p99_ms, x.mean_running, static_cast<long>(x.peak_running), x.kv_utilization,
                static_cast<long>(x.preemptions), 100 * x.prefix_hit_rate, x.mean_table_contiguity);
  }
  if (!o.tier_configs.empty()) {
    std::printf("\nprefix blocks found by tier (loaded instead of computed)\n%-17s %10s %10s %10s %10s %8s\n", "run", "pool",
                "host", "disk", "redis", "errors");
    for (const auto& x : r->results) {
      std::printf("%-17s %10ld %10ld %10ld %10ld %8ld\n", x.allocator.c_str(), static_cast<long>(x.pool_hit_blocks),
                  static_cast<long>(x.host_hit_blocks), static_cast<long>(x.disk_hit_blocks),
                  static_cast<long>(x.redis_hit_blocks), static_cast<long>(x.tier_errors));
    }
  }
  return kExitOk;
}

struct FleetBenchArgs {
  std::string trace, format = "auto", preset = "tiny-16k", kv_budget = "8MiB", redis_cluster;
  std::vector<int> backends = {2, 3};
  std::vector<std::string> policies = {"round-robin", "least-loaded", "kv"}, tiers = {"none"};
  int64_t max_requests = 100;
  double time_scale = 0.01;
  int32_t max_tokens = 16, block_len = 16, chunk_tokens = 512;
  int threads = 1;
  double load_weight = 0.25, kv_usage_weight = 0.0;
  int64_t kill_backend_after = 0, kill_primary_after = 0;
  bool json = false;
};

int RunFleetBenchCommand(const FleetBenchArgs& a) {
  FleetBenchOptions o;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) {
    std::fprintf(stderr, "error: cannot find this binary (/proc/self/exe) to start the backends with\n");
    return kExitFailed;
  }
  o.cli_path.assign(self, static_cast<size_t>(n));
  o.trace_path = a.trace;
  Result<TraceFormat> format = ParseTraceFormat(a.format);
  if (!format.ok()) {
    std::fprintf(stderr, "error: --format: %s\n", format.status().message().c_str());
    return kExitBadInput;
  }
  o.format = *format;
  o.synth_preset = a.preset;
  Result<int64_t> budget = ParseByteSize(a.kv_budget);
  if (!budget.ok() || *budget <= 0) {
    std::fprintf(stderr, "error: --kv-budget '%s': %s\n", a.kv_budget.c_str(),
                 budget.ok() ? "must be positive" : budget.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_budget_bytes = *budget;
  o.backend_counts = a.backends;
  o.policies = a.policies;
  o.tier_configs = a.tiers;
  o.redis_cluster = a.redis_cluster;
  o.max_requests = a.max_requests;
  o.time_scale = a.time_scale;
  o.max_tokens = a.max_tokens;
  o.block_len = a.block_len;
  o.chunk_tokens = a.chunk_tokens;
  o.load_weight = a.load_weight;
  o.kv_usage_weight = a.kv_usage_weight;
  o.kill_backend_after = a.kill_backend_after;
  o.kill_primary_after = a.kill_primary_after;
  o.threads_per_backend = a.threads;
  o.on_progress = [](const std::string& run, int64_t done, int64_t total) { Progress(run, 36, done, total); };
  if (!a.json) PrintMachine();
  Result<FleetBenchReport> r = RunFleetBench(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    const StatusCode c = r.status().code();
    return c == StatusCode::kInternal || c == StatusCode::kIoError ? kExitFailed : kExitBadInput;
  }
  if (a.json) {
    nlohmann::ordered_json j;
    j["machine"] = MachineJson();
    j["model"] = r->model;
    j["oracle_hit_rate"] = r->oracle_hit_rate;
    j["runs"] = nlohmann::ordered_json::array();
    for (const FleetRun& x : r->runs) {
      j["runs"].push_back({{"backends", x.backends}, {"policy", x.policy}, {"tiers", x.tiers}, {"requests", x.requests},
                           {"failed", x.failed}, {"skipped", x.skipped}, {"prompt_tokens", x.prompt_tokens},
                           {"cached_tokens", x.cached_tokens}, {"hit_rate", x.hit_rate},
                           {"hit_rate_vs_oracle", r->oracle_hit_rate > 0 ? x.hit_rate / r->oracle_hit_rate : 0},
                           {"ttft_p50_ms", x.ttft_p50_ms}, {"ttft_p99_ms", x.ttft_p99_ms},
                           {"output_tokens_per_s", x.output_tokens_per_s}, {"seconds", x.seconds},
                           {"exact_predictions", x.exact_predictions}, {"reported_decisions", x.reported_decisions},
                           {"mismatched", x.mismatched}, {"killed_backend", x.killed_backend},
                           {"killed_primary", x.killed_primary}});
      if (x.kill_index >= 0) {
        auto& k = j["runs"].back();
        k["kill_index"] = x.kill_index;
        k["promoted_index"] = x.promoted_index;
        k["promotion_seconds"] = x.promotion_seconds;
        const char* names[3] = {"before", "window", "after"};
        for (int ph = 0; ph < 3; ++ph) {
          k["phases"][names[ph]] = {{"hit_rate", x.phase_hit_rate[ph]}, {"oracle_hit_rate", x.phase_oracle_hit_rate[ph]}};
        }
      }
    }
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("%s, oracle (one unbounded pool) hit rate %.1f%%\n", r->model.c_str(), 100 * r->oracle_hit_rate);
  std::printf("%-9s %-13s %-8s %8s %6s %9s %11s %10s %10s %10s %9s %10s\n", "backends", "policy", "tiers", "requests", "failed",
              "hit rate", "vs oracle", "ttft p50", "ttft p99", "out tok/s", "exact", "mismatch");
  for (const FleetRun& x : r->runs) {
    std::printf("%-9d %-13s %-8s %8ld %6ld %8.1f%% %10.2fx %8.0fms %8.0fms %10.1f %4ld/%-4ld %10ld\n", x.backends, x.policy.c_str(),
                x.tiers.c_str(), static_cast<long>(x.requests), static_cast<long>(x.failed), 100 * x.hit_rate,
                r->oracle_hit_rate > 0 ? x.hit_rate / r->oracle_hit_rate : 0.0, x.ttft_p50_ms, x.ttft_p99_ms,
                x.output_tokens_per_s, static_cast<long>(x.exact_predictions), static_cast<long>(x.reported_decisions),
                static_cast<long>(x.mismatched));
    if (x.kill_index >= 0) {
      std::printf("          killed %s at request %ld", x.killed_primary.empty() ? "a backend" : x.killed_primary.c_str(),
                  static_cast<long>(x.kill_index));
      if (!x.killed_primary.empty()) {
        if (x.promoted_index >= 0) {
          std::printf(", replica promoted after %.1f s (request %ld)", x.promotion_seconds, static_cast<long>(x.promoted_index));
        } else {
          std::printf(", no promotion seen");
        }
      }
      std::printf("; hit rate / oracle: before %.1f%% / %.1f%%, window %.1f%% / %.1f%%, after %.1f%% / %.1f%%\n",
                  100 * x.phase_hit_rate[0], 100 * x.phase_oracle_hit_rate[0], 100 * x.phase_hit_rate[1],
                  100 * x.phase_oracle_hit_rate[1], 100 * x.phase_hit_rate[2], 100 * x.phase_oracle_hit_rate[2]);
    }
  }
  return kExitOk;
}

struct SealBenchArgs {
  bool json = false;
  int32_t block_len = 128, layers = 30, kv_heads = 3, head_dim = 64;
  std::string dtype = "f16";
  double seconds = 0.5;
};

// `pagekv bench tiers`: what the tier payload's seal costs, checksum vs MAC,
// on one block of a model's shape (default: SmolLM2-135M, f16, 128 tokens).
int RunSealBench(const SealBenchArgs& a) {
  Result<DType> dt = ParseDType(a.dtype);
  if (!dt.ok() || DTypeBits(*dt) < 8) {
    std::fprintf(stderr, "error: --dtype '%s': give f32, f16, bf16, int8 or an fp8 type\n", a.dtype.c_str());
    return kExitBadInput;
  }
  const int64_t kv_bytes = int64_t{2} * a.layers * a.kv_heads * a.head_dim * a.block_len * DTypeBits(*dt) / 8;
  Result<SealSpeed> r = MeasureSealSpeed(a.block_len, kv_bytes, a.seconds);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    return kExitBadInput;
  }
  const double mb = static_cast<double>(r->payload_bytes) / 1e6;
  if (a.json) {
    nlohmann::ordered_json j;
    j["machine"] = MachineJson();
    j["cpu"] = j["machine"]["cpu"];
    j["block_len"] = a.block_len;
    j["kv_bytes"] = kv_bytes;
    j["payload_bytes"] = r->payload_bytes;
    j["checksum_seal_gbps"] = r->checksum_seal_gbps;
    j["checksum_check_gbps"] = r->checksum_check_gbps;
    j["mac_seal_gbps"] = r->mac_seal_gbps;
    j["mac_check_gbps"] = r->mac_check_gbps;
    j["memcpy_gbps"] = r->memcpy_gbps;
    j["mac_check_ms_per_block"] = mb / r->mac_check_gbps;
    j["checksum_check_ms_per_block"] = mb / r->checksum_check_gbps;
    std::printf("%s\n", j.dump().c_str());
    return kExitOk;
  }
  PrintMachine();
  std::printf("block of %d tokens: %lld KV bytes, payload %.2f MB\n", a.block_len, static_cast<long long>(kv_bytes), mb);
  std::printf("  %-22s %8s %8s %10s\n", "seal", "put GB/s", "get GB/s", "get ms/blk");
  std::printf("  %-22s %8.2f %8.2f %10.3f\n", "xxh3-64 checksum", r->checksum_seal_gbps, r->checksum_check_gbps,
              mb / r->checksum_check_gbps);
  std::printf("  %-22s %8.2f %8.2f %10.3f\n", "HMAC-SHA-256 (keyed)", r->mac_seal_gbps, r->mac_check_gbps,
              mb / r->mac_check_gbps);
  std::printf("  memcpy of the KV: %.2f GB/s\n", r->memcpy_gbps);
  return kExitOk;
}

}  // namespace

CLI::App* AddBenchCommand(CLI::App& app, int& exit_code) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks, reported against the machine's measured ceilings");
  bench->require_subcommand(1);
  AddBenchAttentionCommand(*bench, exit_code);

  static ServeBenchArgs serve;
  CLI::App* sv = bench->add_subcommand("serve", "A serving trace against the engine: paged vs contiguous allocation");
  sv->add_option("--trace", serve.trace, "Trace: Azure CSV or Mooncake JSON lines")->required();
  sv->add_option("--format", serve.format, "azure, mooncake or auto (default: by extension)");
  sv->add_option("--kv-budget", serve.kv_budget, "KV pool for each allocator (default 32MiB: two contiguous reservations of the default model's 16K context)");
  sv->add_option("--allocator", serve.allocator, "paged, contiguous or both (default: both, in one run)");
  sv->add_option("--model", serve.model, "A GGUF model, or 'synthetic' (default)");
  sv->add_option("--preset", serve.preset, "The synthetic model's shape (default small-16k; tiny-16k is cheaper)");
  sv->add_option("--max-requests", serve.max_requests, "Use the first N requests (default: all)")->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  sv->add_option("--time-scale", serve.time_scale, "Multiply arrival gaps by this (default 0.01)")->check(CLI::Range(0.0, 1e6));
  sv->add_option("--max-tokens", serve.max_tokens, "max_tokens per request (default: the context left after the prompt)")
      ->check(CLI::Range(0, 1 << 30));
  sv->add_option("--block-len", serve.block_len, "Tokens per KV block (default 16)");
  sv->add_option("--kv-dtype", serve.kv_dtype, "KV storage (default f16)");
  sv->add_option("--kv-cache", serve.kv_cache,
                 "Sliding-window models: auto (default), hybrid, uniform, or both (one paged run each, side by side)");
  sv->add_option("--max-step-tokens", serve.step_tokens, "Tokens per engine step (default 2048)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  sv->add_option("--max-running", serve.max_running, "Sequences per step (default 256)")->check(CLI::Range(1, 1 << 16));
  AddMlaPrefillOption(*sv, serve.mla_prefill);
  sv->add_option("--threads", serve.threads, "Threads (default: all cores)")->check(CLI::Range(0, 4096));
  sv->add_option("--tiers", serve.tiers,
                  "Compare lower KV tiers, one paged run each: a comma list of none, host, disk, redis or '+' joins, "
                  "e.g. none,host,host+redis (the allocator is then paged); '+inline' runs the tier moves on the stepping thread");
  sv->add_option("--host-cache", serve.host_cache, "Host tier size where --tiers names host (default 256MiB)");
  sv->add_option("--disk-cache-size", serve.disk_cache_size, "Disk tier size where --tiers names disk (a temporary file; default 1GiB)");
  sv->add_option("--redis", serve.redis, "redis://HOST[:PORT] where --tiers names redis (password: PAGEKV_REDIS_PASSWORD)");
  sv->add_option("--plot", serve.plot, "Write an SVG of running sequences and KV blocks over time");
  sv->add_flag("--json", serve.json, "Print one JSON object");
  sv->callback([&exit_code] { exit_code = RunServeBenchCommand(serve); });

  static FleetBenchArgs fleet;
  CLI::App* fl = bench->add_subcommand(
      "fleet", "A trace against several `pagekv serve` behind `pagekv route`: hit rate, TTFT and throughput per routing policy");
  fl->add_option("--trace", fleet.trace, "Trace: Mooncake JSON lines (hash ids give shared prefixes)")->required();
  fl->add_option("--format", fleet.format, "auto (default), mooncake or azure");
  fl->add_option("--preset", fleet.preset, "The synthetic model's shape (default tiny-16k)");
  fl->add_option("--backends", fleet.backends, "Backend counts, one run each (default 2,3)")->delimiter(',')->check(CLI::Range(1, 16));
  fl->add_option("--policies", fleet.policies, "Routing policies (default round-robin,least-loaded,kv)")->delimiter(',');
  fl->add_option("--tiers", fleet.tiers, "none (default) and / or cluster (the Redis Cluster of --redis-cluster, shared)")->delimiter(',');
  fl->add_option("--redis-cluster", fleet.redis_cluster, "HOST:PORT[,...] of a Redis Cluster (scripts/redis-cluster.sh starts one)");
  fl->add_option("--kv-budget", fleet.kv_budget, "Each backend's KV pool (default 8MiB)");
  fl->add_option("--max-requests", fleet.max_requests, "The trace's first N requests (default 100; 0 = all)")->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  fl->add_option("--time-scale", fleet.time_scale, "Multiply arrival gaps by this (default 0.01)")->check(CLI::Range(0.0, 1e6));
  fl->add_option("--max-tokens", fleet.max_tokens, "Tokens generated per request (default 16)")->check(CLI::Range(1, 1 << 20));
  fl->add_option("--block-len", fleet.block_len, "Tokens per KV block (default 16)")->check(CLI::Range(1, 4096));
  fl->add_option("--threads", fleet.threads, "Threads per backend (default 1)")->check(CLI::Range(1, 256));
  fl->add_option("--load-weight", fleet.load_weight, "The router's --load-weight (default 0.25)")->check(CLI::Range(0.0, 1e12));
  fl->add_option("--kv-usage-weight", fleet.kv_usage_weight, "The router's --kv-usage-weight (default 0)")->check(CLI::Range(0.0, 1e12));
  fl->add_option("--kill-backend-after", fleet.kill_backend_after,
                 "Kill the first backend when this request is sent (every run): rerouting, and no wrong output")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  fl->add_option("--kill-primary-after", fleet.kill_primary_after,
                 "With --tiers cluster: shut the cluster's first node down when this request is sent (failover mid-run)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  fl->add_option("--chunk-tokens", fleet.chunk_tokens,
                 "Tokens per 512-token trace chunk (default 512; 32 shrinks prompts 16x, same prefix structure)")
      ->check(CLI::Range(1, 512));
  fl->add_flag("--json", fleet.json, "Print one JSON object");
  fl->callback([&exit_code] { exit_code = RunFleetBenchCommand(fleet); });

  static SealBenchArgs seal;
  CLI::App* tb = bench->add_subcommand("tiers", "What a tier payload's seal costs: xxh3 checksum vs HMAC-SHA-256, per block");
  tb->add_flag("--json", seal.json, "Print one JSON object");
  tb->add_option("--block-len", seal.block_len, "Tokens per block (default 128)")->check(CLI::Range(1, 1 << 16));
  tb->add_option("--layers", seal.layers, "Layers (default 30: SmolLM2-135M)")->check(CLI::Range(1, 1024));
  tb->add_option("--kv-heads", seal.kv_heads, "KV heads (default 3)")->check(CLI::Range(1, 1024));
  tb->add_option("--head-dim", seal.head_dim, "Head dimension (default 64)")->check(CLI::Range(1, 4096));
  tb->add_option("--dtype", seal.dtype, "KV dtype (default f16)");
  tb->add_option("--seconds", seal.seconds, "Time for each measurement (default 0.5)")->check(CLI::Range(0.01, 60.0));
  tb->callback([&exit_code] { exit_code = RunSealBench(seal); });

  AddBenchCollectivesCommand(*bench, exit_code);

  static GenerateBenchArgs gen;
  CLI::App* g = bench->add_subcommand("generate", "Model prefill and decode tokens/s, the decode step vs its roofline");
  g->add_flag("--json", gen.json, "Print one JSON object");
  g->add_flag("--quick", gen.quick, "A seconds-long smoke run on the tiny synthetic model");
  g->add_option("--model", gen.model, "A GGUF model (default: a synthetic one written for the run)");
  g->add_option("--preset", gen.preset, "Synthetic model shape (default llama-110m)");
  g->add_option("--device", gen.device,
                "cpu (default), or cuda / cuda:N: the model and the pool on the GPU, judged against the device's read "
                "bandwidth measured in the run");
  g->add_flag("--tensor-cores", gen.tensor_cores, "On a CUDA device: attention of f16 / bf16 caches (head_dim a multiple of 16 up to 128) on the tensor cores, " "prompt chunks and decode steps (not yet the default: not yet run on a GPU)");
  g->add_flag("--cuda-graphs", gen.cuda_graphs, "On a CUDA device: decode steps launched as CUDA graphs, one launch per step, "
                "replayed while the launches repeat (not yet the default: not yet run on a GPU)");
  g->add_option("--weight-type", gen.weight_type, "Synthetic model weights: f32, f16 (default), bf16, q8_0");
  g->add_option("--batch", gen.batches, "Batch sizes (default 1,8,32)")->delimiter(',')->check(CLI::Range(1, 4096));
  g->add_option("--prompt-len", gen.prompt_len, "Prompt tokens per sequence (default 128)")->check(CLI::Range(1, 1 << 20));
  g->add_option("--steps", gen.steps, "Decode steps (default 32)")->check(CLI::Range(1, 1 << 20));
  g->add_option("--block-len", gen.block_len, "Tokens per KV block (default 16; with --cp, 16 x cp)")
      ->check(CLI::Range(1, 4096))
      ->each([](const std::string&) { gen.block_len_given = true; });
  g->add_option("--kv-cache", gen.kv_cache,
                "Sliding-window models: auto (default: hybrid), hybrid (a block table per group of layers, sliding "
                "groups keep only their window) or uniform (every layer keeps every token, the windows as a mask)");
  g->add_option("--kv-dtype", gen.kv_dtype, "KV storage: f32, f16 (default), bf16, int8, fp8_e4m3, fp8_e5m2, int4 (KIVI: --block-len a multiple of 32)");
  g->add_option("--threads", gen.threads, "Threads (default: all cores; with --tp, shared among the ranks)")->check(CLI::Range(0, 4096));
  g->add_option("--tp", gen.tp, "Tensor parallel ranks (run under mpirun -np N; default 1)")->check(CLI::Range(1, 1 << 16));
  g->add_option("--pp", gen.pp, "Pipeline parallel stages (mpirun -np tp x pp; default 1)")->check(CLI::Range(1, 1 << 16));
  g->add_option("--cp", gen.cp, "Context parallel ranks, each holding one slice of every KV block (mpirun -np tp x pp x cp; default 1)")
      ->check(CLI::Range(1, 1 << 16));
  g->add_flag("--no-overlap", gen.no_overlap,
              "With --tp: wait for each sum over the ranks at once instead of overlapping it with the next half "
              "projection (what the overlap is measured against)");
  g->add_flag("--busy-neighbour", gen.busy_neighbour,
              "Run each batch on 1 thread and on --threads while another process keeps one core busy");
  g->add_flag("--no-amx", gen.no_amx,
              "Leave the Intel AMX tiles unused (attention and weight products): what they are measured against");
  AddMlaPrefillOption(*g, gen.mla_prefill);
  g->callback([&exit_code] { exit_code = RunGenerateBenchCommand(gen); });
  return bench;
}

}  // namespace pagekv::cli
