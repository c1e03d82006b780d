// /metrics: vLLM's series and PageKV's own (docs/METRICS.md), and what a
// finished request adds to them.
#include <set>
#include <string>
#include <vector>

#include "server/server_state.h"

namespace pagekv::server {
namespace {

// vLLM's finished_reason values.
const char* FinishedReason(FinishReason f) {
  switch (f) {
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "abort";
    case FinishReason::kError: return "error";
    default: return "stop";
  }
}

}  // namespace

// vLLM's buckets, with finer ones in front for small models on CPUs.
const std::vector<double> kTtftBuckets = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                          1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kTokenGapBuckets = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                              0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kRequestBuckets = {0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                                             15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                                             7680.0};

// 1, 2, 5, 10, 20, 50, ... up to `max` (vLLM's token-count buckets).
std::vector<double> OneTwoFive(int64_t max) {
  std::vector<double> out;
  for (int64_t scale = 1;; scale *= 10) {
    for (int64_t m : {1, 2, 5}) {
      if (m * scale > max) return out;
      out.push_back(static_cast<double>(m * scale));
    }
  }
}

// The route label of a path: the routes this server has, "unmatched" for
// any other (so a scanner's paths do not grow the series without bound).
std::string RouteLabel(const std::string& path) {
  static const std::set<std::string> kRoutes = {
      "/health",   "/metrics",    "/v1/models",     "/v1/completions", "/v1/chat/completions", "/reset_prefix_cache",
      "/tokenize", "/detokenize", "/apply-template", "/props",          "/slots",               "/completion"};
  if (kRoutes.count(path) != 0) return path;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "unmatched";
}

void Observe(Shared& sh, const RequestResult& r) {
  sh.finished.Add({sh.model_label[0], {"finished_reason", FinishedReason(r.finish)}});
  sh.e2e.Observe(r.e2e_time);
  sh.queue.Observe(r.queue_time);
  sh.prefill.Observe(r.prefill_time);
  sh.decode.Observe(r.decode_time);
  sh.inference.Observe(r.prefill_time + r.decode_time);
  sh.prompt_len->Observe(static_cast<double>(r.prompt_tokens));
  sh.generation_len->Observe(static_cast<double>(r.tokens.size()));
  if (!r.tokens.empty()) sh.ttft.Observe(r.time_to_first_token);
  for (double d : r.inter_token) sh.itl.Observe(d);
  if (r.tokens.size() > 1) sh.tpot.Observe(r.decode_time / static_cast<double>(r.tokens.size() - 1));
}

// Prometheus text: vLLM's names and semantics (prefix vllm:, label
// model_name) where vLLM has the series, pagekv_* for what it lacks, the
// process collector's. Only counters, gauges of the present state and
// histograms: nothing that depends on when or how often it is scraped.
std::string Metrics(Shared& sh) {
  const EngineMetrics m = sh.engine->Metrics();
  int64_t requests = 0;
  {
    std::lock_guard lock(sh.mu);
    requests = sh.requests_total;
  }
  MetricsText out;
  const Labels& model = sh.model_label;
  auto d = [](int64_t v) { return static_cast<double>(v); };
  out.Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", model, d(m.running));
  out.Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", model, d(m.waiting + m.loading));
  out.Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", model,
            m.blocks_total > 0 ? d(m.blocks_used) / d(m.blocks_total) : 0.0);
  out.Counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", model,
              d(m.prefix.requested_tokens));
  out.Counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", model,
              d(m.prefix.hit_tokens));
  out.Counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", model, d(m.preemptions));
  out.Counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", model, d(m.prompt_tokens));
  out.Counter("vllm:generation_tokens_total", "Number of generation tokens processed.", model, d(m.generated_tokens));
  {
    std::vector<std::pair<Labels, double>> finished = sh.finished.Samples();
    if (finished.empty()) finished.push_back({{model[0], {"finished_reason", "stop"}}, 0.0});
    out.Add("vllm:request_success_total", "Count of successfully processed requests.", "counter", finished);
  }
  sh.ttft.Render(out, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", model);
  sh.itl.Render(out, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", model);
  sh.tpot.Render(out, "vllm:request_time_per_output_token_seconds",
                 "Histogram of time_per_output_token_seconds per request.", model);
  sh.e2e.Render(out, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", model);
  sh.queue.Render(out, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                  model);
  sh.inference.Render(out, "vllm:request_inference_time_seconds",
                      "Histogram of time spent in RUNNING phase for request.", model);
  sh.prefill.Render(out, "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                    model);
  sh.decode.Render(out, "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                   model);
  sh.prompt_len->Render(out, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", model);
  sh.generation_len->Render(out, "vllm:request_generation_tokens", "Number of generation tokens processed.", model);
  out.Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sh.cache_config, 1);

  // What vLLM does not have.
  auto with = [&](std::string k, std::string v) {
    Labels l = model;
    l.emplace_back(std::move(k), std::move(v));
    return l;
  };
  out.Add("pagekv_kv_blocks", "KV blocks of the pool by state (cached: free but holding prefix-cache KV)", "gauge",
          {{with("state", "used"), d(m.blocks_used)},
           {with("state", "free"), d(m.blocks_free - m.blocks_cached)},
           {with("state", "cached"), d(m.blocks_cached)}});
  out.Counter("pagekv_tokens_evicted_total", "Tokens dropped from running requests by token eviction (--kv-policy)",
              model, d(m.tokens_evicted));
  out.Counter("pagekv_prefix_cache_evicted_blocks_total", "Cached prefix blocks reused for other data", model,
              d(m.prefix.evicted));
  out.Counter("pagekv_kv_event_batches_total", "KV event batches published (--kv-events-endpoint)", model,
              d(m.kv_event_batches));
  out.Counter("pagekv_requests_total", "Generation requests received (completions and chat)", model, d(requests));
  {
    std::vector<std::pair<Labels, double>> responses = sh.responses.Samples();
    if (responses.empty()) responses.push_back({{{"route", "/health"}, {"status", "200"}}, 0.0});
    out.Add("pagekv_http_responses_total",
            "HTTP answers by route (unmatched: any path this server does not have; transport: refused before "
            "routing) and status",
            "counter", responses);
  }
  if (sh.transport != nullptr) {
    const TransportStats t = sh.transport->Stats();
    out.Gauge("pagekv_http_connections", "Open HTTP connections", {}, d(t.connections_now));
    out.Counter("pagekv_http_connections_total", "HTTP connections accepted", {}, d(t.connections_total));
    out.Counter("pagekv_http_connections_refused_total", "Connections past --max-connections, answered 503 and closed",
                {}, d(t.refused_total));
    out.Counter("pagekv_http_timeouts_total", "Connections closed by a header, body, idle or write deadline", {},
                d(t.timeouts_total));
    out.Counter("pagekv_http_rejected_total",
                "Requests the transport refused before routing (431 header, 413 body, 415 encoding, 400 malformed)",
                {}, d(t.rejected_total));
    out.Counter("pagekv_http_client_gone_total",
                "Clients that went away before their answer ended (their requests cancelled)", {},
                d(t.client_gone_total));
  }
  if (m.tiers) {
    std::vector<std::pair<Labels, double>> hits, misses, corrupt, forged, errors, blocks, bytes, healthy;
    for (const TierStats& t : m.tiers->tiers) {
      const Labels l = with("tier", t.name);
      hits.push_back({l, d(t.hits)});
      misses.push_back({l, d(t.misses)});
      corrupt.push_back({l, d(t.corrupt)});
      forged.push_back({l, d(t.unauthenticated)});
      errors.push_back({l, d(t.errors)});
      blocks.push_back({l, d(t.blocks_now)});
      bytes.push_back({l, d(t.bytes_now)});
      healthy.push_back({l, t.healthy ? 1.0 : 0.0});
    }
    std::vector<std::pair<Labels, double>> loaded;
    for (int t = 1; t < kNumTiers; ++t) {
      loaded.push_back({with("tier", TierName(static_cast<Tier>(t))), d(m.prefix.tier_hit_blocks[static_cast<size_t>(t)])});
    }
    out.Add("pagekv_tier_loaded_blocks_total", "Prefix blocks loaded into the pool from a lower tier instead of computed",
            "counter", loaded);
    out.Add("pagekv_tier_hits_total", "Verified blocks a tier returned", "counter", hits);
    out.Add("pagekv_tier_misses_total", "Gets a tier could not serve (absent or dropped as corrupt)", "counter", misses);
    out.Add("pagekv_tier_corrupt_total",
            "Payloads that failed a check (MAC or checksum, size, key, tokens): dropped, recomputed", "counter", corrupt);
    out.Add("pagekv_tier_unauthenticated_total",
            "Of those, payloads whose MAC failed under the tier key (forged, altered, another key): never loaded",
            "counter", forged);
    out.Add("pagekv_tier_errors_total", "I/O and connection failures, and calls refused while a tier backs off",
            "counter", errors);
    out.Add("pagekv_tier_blocks", "Blocks a tier holds (redis: stored by this process)", "gauge", blocks);
    out.Add("pagekv_tier_bytes", "Bytes a tier holds", "gauge", bytes);
    out.Add("pagekv_tier_healthy", "1 when the tier's last call succeeded, 0 while it backs off", "gauge", healthy);
    out.Counter("pagekv_tier_load_failures_total", "Blocks located in a tier that could not be loaded (recomputed)",
                model, d(m.prefix.tier_load_failures));
    out.Counter("pagekv_tier_dropped_total", "Copies down or prefetches dropped by a full mover queue", model,
                d(m.tiers->dropped));
    out.Counter("pagekv_tier_staged_mismatches_total",
                "Prefetched blocks refused at load: fetched for other tokens or another prefix under the same key",
                model, d(m.tiers->staged_mismatches));
  }
  AddProcessMetrics(out);
  return out.str();
}

}  // namespace pagekv::server
