// RunServeBench (include/pagekv/bench.h): a trace replayed against the
// engine with each allocator, sampled over time.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "bench/trace.h"
#include "pagekv/bench.h"
#include "pagekv/synth_model.h"

namespace pagekv {
namespace {

using Clock = std::chrono::steady_clock;

// The tiers a config string names ("host+redis"); the disk file, if any, at disk_path.
Result<TierOptions> TiersFor(const ServeBenchOptions& o, const std::string& config, const std::string& disk_path) {
  TierOptions t;
  if (config == "none") return t;
  size_t at = 0;
  while (at <= config.size()) {
    const size_t plus = std::min(config.find('+', at), config.size());
    const std::string name = config.substr(at, plus - at);
    if (name == "host") {
      t.host_bytes = o.host_cache_bytes;
    } else if (name == "disk") {
      t.disk_path = disk_path;
      t.disk_bytes = o.disk_cache_bytes;
    } else if (name == "inline") {
      // RunOne: moves on the stepping thread
    } else if (name == "redis") {
      if (o.redis_url.empty()) return InvalidArgumentError("bench serve: tier config '" + config + "' needs --redis URL");
      t.redis_url = o.redis_url;
      t.redis_password = o.redis_password;
      // A namespace of this run alone, expiring, so runs never hit each other's blocks.
      t.redis_namespace = "pagekv-bench:" + std::to_string(::getpid()) + ":" + config;
      t.redis_ttl_seconds = 3600;
    } else {
      return InvalidArgumentError("bench serve: unknown tier '" + name + "' in '" + config +
                                  "' (use none, host, disk, redis, joined by '+', and '+inline')");
    }
    at = plus + 1;
  }
  return t;
}

Result<ServeBenchResult> RunOne(const ServeBenchOptions& o, const std::string& model, Allocator allocator,
                                const std::vector<bench::TraceRequest>& trace, const TierOptions& tiers = {},
                                const std::string& tier_name = "none", KvGroups groups = KvGroups::kAuto,
                                bool name_groups = false) {
  EngineOptions eo;
  eo.kv_groups = groups;
  eo.tiers = tiers;
  eo.background_tier_moves = tier_name.find("inline") == std::string::npos;
  eo.model_path = model;
  eo.block_len = o.block_len;
  eo.kv_dtype = o.kv_dtype;
  eo.kv_budget_bytes = o.kv_budget_bytes;
  eo.max_step_tokens = o.max_step_tokens;
  eo.max_running = o.max_running;
  eo.max_queue = static_cast<int64_t>(trace.size()) + 1;
  eo.allocator = allocator;
  eo.watermark_blocks = 0;
  eo.threads = o.threads;
  eo.mla_prefill = o.mla_prefill;
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(eo));
  ServeBenchResult r;
  r.allocator = allocator == Allocator::kPaged ? "paged" : "contiguous";
  r.tiers = tier_name;
  if (tier_name != "none") r.allocator += "+" + tier_name;
  if (name_groups) r.allocator += "+" + std::string(KvGroupsName(groups));

  // Sampler thread: the engine's state every 20 ms.
  std::atomic<bool> sampling{true};
  const auto start = Clock::now();
  std::thread sampler([&] {
    while (sampling.load()) {
      const EngineMetrics m = engine->Metrics();
      // Blocks in use: held, plus (contiguous) reserved for tokens to come.
      r.samples.push_back({std::chrono::duration<double>(Clock::now() - start).count(), m.running, m.waiting,
                           (m.slots_reserved + o.block_len - 1) / o.block_len, m.tokens_stored, m.slots_reserved,
                           m.table_contiguity});
      r.blocks = m.blocks_total;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  engine->Start();
  std::vector<RequestId> ids;
  std::vector<int32_t> tokens;
  for (size_t i = 0; i < trace.size(); ++i) {
    const bench::TraceRequest& t = trace[i];
    const auto due = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t.arrival_s * o.time_scale));
    std::this_thread::sleep_until(due);
    bench::TraceTokens(t, static_cast<int64_t>(i), 512, tokens);
    tokens.insert(tokens.begin(), 1);  // BOS
    EngineRequest req;
    req.prompt = tokens;
    const int64_t room = engine->context_len() - static_cast<int64_t>(req.prompt.size());
    const int64_t out = std::max<int64_t>(1, t.output_length);
    if (room < out) {
      ++r.skipped;
      continue;
    }
    req.max_tokens = static_cast<int32_t>(o.max_tokens > 0 ? std::min<int64_t>(o.max_tokens, room) : room);
    req.max_tokens = std::max<int32_t>(req.max_tokens, static_cast<int32_t>(out));
    req.stop_at_tokens = static_cast<int32_t>(out);
    req.ignore_eos = true;
    Result<RequestId> id = engine->Submit(std::move(req));
    if (!id.ok()) {
      if (id.status().code() != StatusCode::kResourceExhausted) return id.status();
      ++r.skipped;  // could never fit this pool
      continue;
    }
    ids.push_back(*id);
  }
  if (ids.empty() && r.skipped > 0) {
    sampling = false;
    sampler.join();
    return ResourceExhaustedError("bench serve (" + r.allocator + "): all " + std::to_string(r.skipped) +
                                  " requests were skipped: none fits a KV budget of " + std::to_string(o.kv_budget_bytes) +
                                  " bytes with its max_tokens; raise --kv-budget or lower --max-tokens");
  }
  std::vector<double> ttft, itl;
  int64_t output_tokens = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const RequestResult res = engine->Wait(ids[i]);
    if (res.finish == FinishReason::kError) return res.error;
    ++r.requests;
    output_tokens += static_cast<int64_t>(res.tokens.size());
    ttft.push_back(res.time_to_first_token * 1e3);
    for (double d : res.inter_token) itl.push_back(d * 1e3);
    if (o.on_progress) o.on_progress(r.allocator, static_cast<int64_t>(i + 1), static_cast<int64_t>(ids.size()));
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  sampling = false;
  sampler.join();
  const EngineMetrics m = engine->Metrics();
  engine->Stop();
  r.requests_per_s = static_cast<double>(r.requests) / r.seconds;
  r.output_tokens_per_s = static_cast<double>(output_tokens) / r.seconds;
  r.ttft_p50_ms = bench::Percentile(ttft, 0.5);
  r.ttft_p99_ms = bench::Percentile(ttft, 0.99);
  r.itl_p50_ms = bench::Percentile(itl, 0.5);
  r.itl_p99_ms = bench::Percentile(itl, 0.99);
  r.preemptions = m.preemptions;
  r.prefix_hit_rate = m.prefix.token_hit_rate;
  r.pool_hit_blocks = m.prefix.tier_hit_blocks[0];
  r.host_hit_blocks = m.prefix.tier_hit_blocks[1];
  r.disk_hit_blocks = m.prefix.tier_hit_blocks[2];
  r.redis_hit_blocks = m.prefix.tier_hit_blocks[3];
  if (m.tiers) {
    for (const TierStats& t : m.tiers->tiers) r.tier_errors += t.errors + t.corrupt;
  }
  r.background_loads = m.prefix.background_loads;
  r.evictions_copied = m.prefix.evictions_copied;
  r.evictions_precopied = m.prefix.evictions_precopied;
  // Time-weighted means over the samples (equal spacing), while any request is in the system.
  double running = 0, stored = 0, reserved = 0, contiguity = 0;
  int64_t n = 0;
  for (const ServeSample& s : r.samples) {
    r.peak_running = std::max(r.peak_running, s.running);
    if (s.running == 0 && s.waiting == 0) continue;
    running += static_cast<double>(s.running);
    contiguity += s.table_contiguity;
    stored += static_cast<double>(s.tokens_stored);
    reserved += static_cast<double>(s.slots_reserved);
    ++n;
  }
  r.mean_running = n > 0 ? running / static_cast<double>(n) : 0;
  r.mean_table_contiguity = n > 0 ? contiguity / static_cast<double>(n) : 0;
  r.kv_utilization = reserved > 0 ? stored / reserved : 0;
  return r;
}

}  // namespace

Result<ServeBenchReport> RunServeBench(const ServeBenchOptions& o) {
  if (o.kv_budget_bytes <= 0) return InvalidArgumentError("bench serve: the KV budget must be positive");
  if (o.time_scale < 0) return InvalidArgumentError("bench serve: --time-scale must be >= 0");
  if (o.allocators.empty()) return InvalidArgumentError("bench serve: no allocator to run");
  PAGEKV_ASSIGN_OR_RETURN(std::vector<bench::TraceRequest> trace, bench::ReadTrace(o.trace_path, o.format, o.max_requests));
  ServeBenchReport report;
  report.kv_budget_bytes = o.kv_budget_bytes;
  std::string model = o.model_path;
  std::string temp;
  if (model.empty()) {
    const char* dir = std::getenv("TMPDIR");
    temp = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/pagekv-bench-serve-" + std::to_string(::getpid()) + ".gguf";
    PAGEKV_ASSIGN_OR_RETURN(SynthModelSpec spec, FindSynthModelPreset(o.synth_preset));
    PAGEKV_RETURN_IF_ERROR(WriteSynthModel(spec, 1, "f32", temp));
    model = temp;
    report.model = "synthetic " + o.synth_preset;
  } else {
    report.model = model;
  }
  const char* dir = std::getenv("TMPDIR");
  const std::string disk = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/pagekv-bench-serve-" +
                           std::to_string(::getpid()) + ".kvcache";
  auto remove_disk = [&] {  // each run starts with an empty disk tier
    std::remove(disk.c_str());
    std::remove((disk + ".index").c_str());
  };
  struct Run {
    Allocator allocator;
    std::string tiers;
    KvGroups groups;
  };
  std::vector<Run> runs;
  const std::vector<KvGroups> groups = o.kv_groups.empty() ? std::vector<KvGroups>{KvGroups::kAuto} : o.kv_groups;
  if (o.tier_configs.empty()) {
    for (Allocator a : o.allocators) {
      for (KvGroups g : groups) {
        runs.push_back({a, "none", g});
        if (a != Allocator::kPaged) break;  // the contiguous allocator once
      }
    }
  } else {
    for (const std::string& c : o.tier_configs) {
      for (KvGroups g : groups) runs.push_back({Allocator::kPaged, c, g});
    }
  }
  for (const Run& run : runs) {
    const Allocator a = run.allocator;
    const std::string& config = run.tiers;
    Result<TierOptions> tiers = TiersFor(o, config, disk);
    Result<ServeBenchResult> r = tiers.ok() ? RunOne(o, model, a, trace, *tiers, config, run.groups,
                                                     groups.size() > 1 && a == Allocator::kPaged)
                                            : Result<ServeBenchResult>(tiers.status());
    remove_disk();
    if (!r.ok()) {
      if (!temp.empty()) std::remove(temp.c_str());
      return r.status();
    }
    report.results.push_back(std::move(*r));
  }
  if (!temp.empty()) std::remove(temp.c_str());
  report.blocks = report.results.front().blocks;  // the first run's pool (a hybrid cache's blocks are smaller)
  return report;
}

std::string ServePlotSvg(const ServeBenchReport& report) {
  constexpr double kW = 900, kH = 520, kLeft = 70, kRight = 20, kTop = 40, kGap = 60;
  const double panel = (kH - kTop - kGap - 40) / 2;
  double t_max = 1, run_max = 1, blocks_max = 1;
  for (const auto& r : report.results) {
    for (const auto& s : r.samples) {
      t_max = std::max(t_max, s.t);
      run_max = std::max(run_max, static_cast<double>(s.running));
      blocks_max = std::max(blocks_max, static_cast<double>(s.blocks_used));
    }
  }
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd"};
  std::string svg;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" font-size=\"12\">\n"
                "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
                "<text x=\"%.0f\" y=\"22\" font-size=\"15\">pagekv bench serve: %s, KV budget %lld MiB</text>\n",
                kW, kH, kLeft, report.model.c_str(), static_cast<long long>(report.kv_budget_bytes >> 20));
  svg += buf;
  auto panel_of = [&](int p, const char* title, double y_max, auto value) {
    const double top = kTop + p * (panel + kGap), bottom = top + panel, width = kW - kLeft - kRight;
    std::snprintf(buf, sizeof(buf),
                  "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n"
                  "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n"
                  "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">%.0f</text><text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">0</text>\n"
                  "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">%.1f s</text>\n",
                  kLeft, top - 6, title, kLeft, bottom, kLeft + width, bottom, kLeft, top, kLeft, bottom, kLeft - 6, top + 10,
                  y_max, kLeft - 6, bottom, kLeft + width, bottom + 16, t_max);
    svg += buf;
    for (size_t i = 0; i < report.results.size(); ++i) {
      svg += "<polyline fill=\"none\" stroke-width=\"1.5\" stroke=\"" + std::string(colors[i % 4]) + "\" points=\"";
      // One pixel column's samples (20 ms apart: thousands per column on
      // a long run) drawn as their range, min then max, so the file stays
      // small and no spike is averaged away.
      const auto& samples = report.results[i].samples;
      for (size_t a = 0; a < samples.size();) {
        const auto column = static_cast<int64_t>(width * samples[a].t / t_max);
        double lo = value(samples[a]), hi = lo;
        size_t b = a + 1;
        for (; b < samples.size() && static_cast<int64_t>(width * samples[b].t / t_max) == column; ++b) {
          lo = std::min(lo, value(samples[b]));
          hi = std::max(hi, value(samples[b]));
        }
        const double x = kLeft + static_cast<double>(column);
        std::snprintf(buf, sizeof(buf), "%.0f,%.1f ", x, bottom - panel * lo / y_max);
        svg += buf;
        if (hi != lo) {
          std::snprintf(buf, sizeof(buf), "%.0f,%.1f ", x, bottom - panel * hi / y_max);
          svg += buf;
        }
        a = b;
      }
      svg += "\"/>\n";
      std::snprintf(buf, sizeof(buf), "<text x=\"%.0f\" y=\"%.0f\" fill=\"%s\">%s</text>\n", kLeft + width - 120,
                    top + 14 + 14 * static_cast<double>(i), colors[i % 4], report.results[i].allocator.c_str());
      svg += buf;
    }
  };
  panel_of(0, "running sequences", run_max, [](const ServeSample& s) { return static_cast<double>(s.running); });
  panel_of(1, "KV blocks in use (held, or reserved by the contiguous allocator)", blocks_max, [](const ServeSample& s) { return static_cast<double>(s.blocks_used); });
  svg += "</svg>\n";
  return svg;
}

}  // namespace pagekv
