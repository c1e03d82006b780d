// `pagekv route`: the KV-aware router in front of `pagekv serve` instances
// (include/pagekv/router.h). SIGINT / SIGTERM: stop, exit 0.
#include <csignal>
#include <cstdio>
#include <string>

#include "commands.h"
#include "secrets.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

struct RouteArgs {
  std::vector<std::string> backends;
  std::string model, tokenizer, chat_template, policy = "kv", host = "127.0.0.1", api_key_env, api_key_file;
  int port = 8090, io_threads = 2, workers = 32;
  int32_t block_len = 16;
  double load_weight = 0.25, kv_usage_weight = 0.0, health_interval = 0.5;
};

int RunRoute(const RouteArgs& a) {
  RouterOptions o;
  for (const std::string& b : a.backends) {
    RouterBackend rb;
    const size_t comma = b.find(',');
    rb.url = b.substr(0, comma);
    if (comma != std::string::npos) rb.kv_events = b.substr(comma + 1);
    if (!rb.kv_events.empty() && rb.kv_events.rfind("tcp://", 0) != 0 && rb.kv_events.rfind("ipc://", 0) != 0) {
      std::fprintf(stderr, "error: --backend %s: the KV events endpoint must be tcp://HOST:PORT or ipc://PATH\n", b.c_str());
      return kExitBadInput;
    }
    o.backends.push_back(std::move(rb));
  }
  Result<RoutePolicy> policy = ParseRoutePolicy(a.policy);
  if (!policy.ok()) {
    std::fprintf(stderr, "error: --policy: %s\n", policy.status().message().c_str());
    return kExitBadInput;
  }
  o.policy = *policy;
  o.model_path = a.model;
  o.tokenizer_path = a.tokenizer;
  o.chat_template = a.chat_template;
  o.block_len = a.block_len;
  o.load_weight = a.load_weight;
  o.kv_usage_weight = a.kv_usage_weight;
  o.host = a.host;
  o.port = a.port;
  o.io_threads = a.io_threads;
  o.workers = a.workers;
  o.health_interval_ms = static_cast<int64_t>(a.health_interval * 1000.0 + 0.5);
  auto add_keys = [&](const char* flag, const std::string& source, bool from_file) {
    std::string text;
    if (!(from_file ? ReadSecretFile(flag, source, text) : ReadSecretEnv(flag, source, text))) return false;
    const std::vector<std::string> keys = SecretLines(text);
    o.api_keys.insert(o.api_keys.end(), keys.begin(), keys.end());
    return true;
  };
  if ((!a.api_key_env.empty() && !add_keys("--api-key-env", a.api_key_env, false)) ||
      (!a.api_key_file.empty() && !add_keys("--api-key-file", a.api_key_file, true))) {
    return kExitBadInput;
  }
  o.on_listening = [&](int port) {
    std::printf("pagekv route: listening on http://%s:%d (%zu backends, policy %s)\n", a.host.c_str(), port,
                o.backends.size(), RoutePolicyName(o.policy));
    std::fflush(stdout);
  };
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGPIPE, SIG_IGN);
  const Status s = RunRouter(o, g_stop);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.message().c_str());
    return s.code() == StatusCode::kIoError || s.code() == StatusCode::kInternal ? kExitFailed : kExitBadInput;
  }
  std::printf("pagekv route: stopped\n");
  return kExitOk;
}

}  // namespace

CLI::App* AddRouteCommand(CLI::App& app, int& exit_code) {
  static RouteArgs args;
  CLI::App* cmd = app.add_subcommand("route", "A KV-aware router in front of several `pagekv serve` instances");
  cmd->add_option("--backend", args.backends,
                  "A backend: URL[,KV_EVENTS], e.g. http://127.0.0.1:8081,tcp://127.0.0.1:5557 (its --kv-events "
                  "endpoint; without it, no prediction for that backend); repeat for each")
      ->required();
  cmd->add_option("--model", args.model, "The model the backends serve (tokenizer and chat template; weights unread)")->required();
  cmd->add_option("--tokenizer", args.tokenizer, "llama2.c tokenizer.bin (for .bin checkpoints)");
  cmd->add_option("--chat-template", args.chat_template, "The backends' --chat-template, if they were given one");
  cmd->add_option("--block-len", args.block_len, "The backends' --block-len (default 16)")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--policy", args.policy, "kv (default: longest cached prefix against load), round-robin, least-loaded");
  cmd->add_option("--load-weight", args.load_weight,
                  "kv policy: the weight of prefill tokens queued on a backend against the request's own uncached ones (default 0.25)")
      ->check(CLI::Range(0.0, 1e12));
  cmd->add_option("--kv-usage-weight", args.kv_usage_weight,
                  "kv policy: the weight of KV tokens a backend's running requests hold (its /metrics; default 0)")
      ->check(CLI::Range(0.0, 1e12));
  cmd->add_option("--api-key-env", args.api_key_env, "The backends' API keys (one per line) from this environment variable");
  cmd->add_option("--api-key-file", args.api_key_file, "The backends' API keys (one per line) from this file");
  cmd->add_option("--host", args.host, "Address to listen on (default 127.0.0.1)");
  cmd->add_option("--port", args.port, "Port (default 8090; 0 = any free port, printed)")->check(CLI::Range(0, 65535));
  cmd->add_option("--io-threads", args.io_threads, "Threads serving every connection (default 2)")->check(CLI::Range(1, 256));
  cmd->add_option("--workers", args.workers, "Requests forwarded at once (default 32)")->check(CLI::Range(1, 4096));
  cmd->add_option("--health-interval", args.health_interval, "Seconds between the backends' /health and /metrics polls (default 0.5)")
      ->check(CLI::Range(0.01, 3600.0));
  cmd->callback([&exit_code] { exit_code = RunRoute(args); });
  return cmd;
}

}  // namespace pagekv::cli
