// `pagekv route`: a KV-aware router in front of several `pagekv serve`
// instances (docs/ROUTER.md).
//
//   POST /v1/completions, /v1/chat/completions   forwarded to one backend
//                                                (streams pass through)
//   GET  /v1/models                              a backend's answer
//   GET  /health                                 ok while a backend is up
//   GET  /metrics                                the router's Prometheus text
//
// It subscribes to every backend's KV events (docs/KV_EVENTS.md) and keeps a
// global index of which backend holds which blocks, by content (the token
// blocks and the cache salt), so a request's cached prefix on each backend
// is known before it is sent. The kv-aware policy sends a request to the
// backend where it costs least:
//
//   cost = prompt tokens the backend would compute (its predicted miss)
//        + load_weight * prompt tokens queued there before it (the predicted
//          misses of the router's requests there not yet answered)
//        + kv_usage_weight * KV tokens its running requests hold (from its
//          /metrics: the decode work a new request shares steps with)
//
// (a time-to-first-token estimate in prefill tokens);
// round-robin and least-loaded (in flight + waiting) are the baselines. A
// backend that cannot be reached, or answers 429 / 503 before any byte went
// to the client, is retried on the next best one (it is marked down until
// its /health answers again); one that dies mid-stream ends that stream.
// Requests are parsed as the backends parse them (the same tokenizer and
// chat template, from the model file, and the same tenant salts from the
// API keys), so the prediction holds; each decision's predicted hit is
// compared with the usage.prompt_tokens_details.cached_tokens the backend
// reports (per-decision metrics).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pagekv/status.h"

namespace pagekv {

struct RouterBackend {
  std::string url;        // http://host:port of a `pagekv serve`
  std::string kv_events;  // its --kv-events endpoint (tcp://host:port); empty: none (no prediction for it)
};

enum class RoutePolicy : uint8_t { kKvAware, kRoundRobin, kLeastLoaded };
const char* RoutePolicyName(RoutePolicy p);  // "kv", "round-robin", "least-loaded"
Result<RoutePolicy> ParseRoutePolicy(const std::string& name);

struct RouterOptions {
  std::vector<RouterBackend> backends;
  // The model the backends serve (its tokenizer and chat template; the
  // weights are not read), its tokenizer for a llama2.c checkpoint, and a
  // chat template override as the backends were given.
  std::string model_path, tokenizer_path, chat_template;
  int32_t block_len = 16;  // the backends' --block-len
  RoutePolicy policy = RoutePolicy::kKvAware;
  // How much a prefill token queued on a backend weighs against one of the
  // request's own uncached tokens: 1 is the greedy time-to-first-token
  // choice; less keeps conversations on their KV (0: always the longest
  // hit). 0.25 measured best on the Mooncake conversation trace
  // (docs/PERFORMANCE.md).
  double load_weight = 0.25;
  // How much a KV token held by a backend's running requests weighs (its
  // vllm:kv_cache_usage_perc x num_gpu_blocks x block_size, polled every
  // health_interval_ms).
  double kv_usage_weight = 0.0;
  // The backends' API keys: each is a tenant whose salt the router derives
  // as they do; the Authorization header is forwarded as it came.
  std::vector<std::string> api_keys;
  std::string host = "127.0.0.1";
  int port = 8090;  // 0 = any free port
  int io_threads = 2;
  int workers = 32;  // requests forwarded at once (each holds a thread while its backend answers)
  int64_t health_interval_ms = 500;   // /health and /metrics of every backend
  int64_t backend_timeout_ms = 600'000;  // a backend's whole answer
  std::function<void(int port)> on_listening;
};

// Routes until `stop` becomes true (checked every 100 ms). Errors: no
// backend, a bad url, the model file, a port that cannot be bound.
Status RunRouter(const RouterOptions& options, const std::atomic<bool>& stop);

}  // namespace pagekv
