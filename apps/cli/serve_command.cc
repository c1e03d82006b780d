// `pagekv serve`: the OpenAI-compatible HTTP server (include/pagekv/server.h).
// SIGINT / SIGTERM: stop accepting, finish or cancel in-flight requests,
// exit 0.
#include <csignal>
#include <cstdio>
#include <string>

#include "commands.h"
#include "kv_event_flags.h"
#include "secrets.h"
#include "tier_flags.h"
#include "tp_flags.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

struct ServeArgs {
  std::string model, tokenizer, host = "127.0.0.1", api_key_env, api_key_file, kv_budget = "256MiB", kv_dtype = "f32", name, kv_layer_dtypes, kv_rotate = "none", kv_policy = "none", chat_template;
  double kv_budget_fraction = 1.0;
  int port = 8080;
  int64_t max_body = 1 << 20, max_queue = 256, step_tokens = 256, blocks = 0, max_header_bytes = 16 * 1024;
  int max_headers = 100, max_connections = 512, io_threads = 2, workers = 2;
  double header_timeout = 10, body_timeout = 30, idle_timeout = 30, write_timeout = 30;
  int32_t block_len = 16, max_running = 64;
  bool no_prefix_cache = false, report_cached_tokens = false;
  int threads = 0, tp = 1, pp = 1, cp = 1;
  bool block_len_given = false;
  std::vector<std::string> api_keys;
  TierArgs tiers;
  KvEventArgs kv_events;
  std::string device = "cpu";
  bool tensor_cores = false;
  bool cuda_graphs = false;
};

int RunServe(const ServeArgs& a) {
  ServerOptions o;
  // Split over ranks: rank 0 serves HTTP, the others step with it.
  const ParallelJoin join = JoinParallel(a.tp, a.pp, a.cp, "serve");
  if (join.exit_code >= 0) return join.exit_code;
  o.engine.parallel = join.parallel;
  o.engine.model_path = a.model;
  o.engine.tokenizer_path = a.tokenizer;
  // Context parallel: each rank holds block_len / cp tokens of every block.
  o.engine.block_len = a.cp > 1 && !a.block_len_given ? a.block_len * a.cp : a.block_len;
  o.engine.max_step_tokens = a.step_tokens;
  o.engine.max_running = a.max_running;
  o.engine.max_queue = a.max_queue;
  o.engine.prefix_cache = !a.no_prefix_cache;
  o.engine.threads = RankThreads(a.threads, a.tp * a.pp * a.cp);
  o.engine.device = a.device;
  o.engine.tensor_cores = a.tensor_cores;
  o.engine.cuda_graphs = a.cuda_graphs;
  o.engine.chat_template = a.chat_template;
  o.engine.kv_events = ToKvEventsOptions(a.kv_events);
  if (!ToTierOptions(a.tiers, o.engine.tiers)) return kExitBadInput;
  Result<DType> dt = ParseDType(a.kv_dtype);
  if (!dt.ok()) {
    std::fprintf(stderr, "error: --kv-dtype: %s\n", dt.status().message().c_str());
    return kExitBadInput;
  }
  o.engine.kv_dtype = *dt;
  o.engine.kv_layer_dtypes = a.kv_layer_dtypes;
  o.engine.kv_hadamard = a.kv_rotate == "hadamard";
  Result<EvictionOptions> ev = ParseEvictionPolicy(a.kv_policy, a.kv_budget_fraction);
  if (!ev.ok()) {
    std::fprintf(stderr, "error: --kv-policy / --kv-keep: %s\n", ev.status().message().c_str());
    return kExitBadInput;
  }
  o.engine.eviction = *ev;
  if (a.blocks > 0) {
    o.engine.num_blocks = a.blocks;
  } else {
    Result<int64_t> budget = ParseByteSize(a.kv_budget);
    if (!budget.ok()) {
      std::fprintf(stderr, "error: --kv-budget: %s\n", budget.status().message().c_str());
      return kExitBadInput;
    }
    o.engine.kv_budget_bytes = *budget;
  }
  o.host = a.host;
  o.port = a.port;
  if (!a.api_keys.empty()) {
    std::fprintf(stderr, "warning: --api-key shows the key to every user of this machine (ps, /proc) and in shell "
                         "history; use --api-key-env or --api-key-file\n");
  }
  o.api_keys = a.api_keys;
  // Keys, one per line, from the environment variable and / or the file.
  auto add_keys = [&](const char* flag, const std::string& source, bool from_file) {
    std::string text;
    if (!(from_file ? ReadSecretFile(flag, source, text) : ReadSecretEnv(flag, source, text))) return false;
    const std::vector<std::string> keys = SecretLines(text);
    if (keys.empty()) std::fprintf(stderr, "error: %s %s holds no key (one per line)\n", flag, source.c_str());
    o.api_keys.insert(o.api_keys.end(), keys.begin(), keys.end());
    return !keys.empty();
  };
  if ((!a.api_key_env.empty() && !add_keys("--api-key-env", a.api_key_env, false)) ||
      (!a.api_key_file.empty() && !add_keys("--api-key-file", a.api_key_file, true))) {
    return kExitBadInput;
  }
  o.report_cached_tokens_always = a.report_cached_tokens;
  o.max_body_bytes = a.max_body;
  o.max_header_bytes = a.max_header_bytes;
  o.max_headers = a.max_headers;
  o.max_connections = a.max_connections;
  auto ms = [](double seconds) { return static_cast<int64_t>(seconds * 1000.0 + 0.5); };
  o.header_timeout_ms = ms(a.header_timeout);
  o.body_timeout_ms = ms(a.body_timeout);
  o.idle_timeout_ms = ms(a.idle_timeout);
  o.write_timeout_ms = ms(a.write_timeout);
  o.io_threads = a.io_threads;
  o.workers = a.workers;
  o.model_name = a.name;
  o.on_listening = [&](int port) {
    std::printf("pagekv serve: listening on http://%s:%d\n", a.host.c_str(), port);
    std::fflush(stdout);
  };
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGPIPE, SIG_IGN);
  const Status s = RunServer(o, g_stop);
  if (!s.ok()) {
    if (a.tp * a.pp * a.cp > 1) {
      std::fprintf(stderr, "error: rank %d: %s\n", join.rank, s.message().c_str());
    } else {
      std::fprintf(stderr, "error: %s\n", s.message().c_str());
    }
    return s.code() == StatusCode::kIoError || s.code() == StatusCode::kInternal ? kExitFailed : kExitBadInput;
  }
  std::printf("pagekv serve: stopped\n");
  return kExitOk;
}

}  // namespace

CLI::App* AddServeCommand(CLI::App& app, int& exit_code) {
  static ServeArgs args;
  CLI::App* cmd = app.add_subcommand("serve", "An OpenAI-compatible HTTP server (completions, chat, streaming, metrics)");
  cmd->add_option("--model", args.model, "Model: a .gguf file, or a llama2.c .bin (with --tokenizer)")->required();
  cmd->add_option("--tokenizer", args.tokenizer, "llama2.c tokenizer.bin (for .bin checkpoints)");
  cmd->add_option("--host", args.host, "Address to listen on (default 127.0.0.1: loopback only)");
  cmd->add_option("--port", args.port, "Port (default 8080; 0 = any free port, printed)")->check(CLI::Range(0, 65535));
  cmd->add_option("--tp", args.tp,
                  "Tensor parallel ranks (under mpirun -np tp x pp; rank 0 serves, the others step with it; default 1)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--pp", args.pp, "Pipeline parallel stages (under mpirun -np tp x pp; default 1)")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--cp", args.cp, "Context parallel ranks, each holding one slice of every KV block (under mpirun -np "
                                   "tp x pp x cp; default 1)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--api-key-env", args.api_key_env,
                  "Require 'Authorization: Bearer KEY' on /v1/ endpoints, the keys (one per line) from this environment "
                  "variable; each key is a tenant with its own prefix cache");
  cmd->add_option("--api-key-file", args.api_key_file, "As --api-key-env, the keys (one per line) from this file");
  cmd->add_option("--api-key", args.api_keys, "An API key on the command line (visible in ps: prefer --api-key-env)");
  cmd->add_flag("--report-cached-tokens", args.report_cached_tokens,
                "Report usage.cached_tokens to every request (default: only to requests with their own cache_salt, "
                "so no client learns whether another's prompt is cached)");
  cmd->add_option("--max-body-bytes", args.max_body, "Largest request body (default 1 MiB; larger: 413)")
      ->check(CLI::Range(int64_t{64}, int64_t{1} << 30));
  cmd->add_option("--max-header-bytes", args.max_header_bytes,
                  "Largest request header, request line included (default 16 KiB; larger: 431)")
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 24));
  cmd->add_option("--max-headers", args.max_headers, "Most header fields in a request (default 100; more: 431)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--max-connections", args.max_connections,
                  "Connections at once; past it a new one gets 503 and is closed (default 512)")
      ->check(CLI::Range(1, 1 << 20));
  const auto seconds = CLI::Range(0.001, 86400.0);
  cmd->add_option("--header-timeout", args.header_timeout, "Seconds a request header may take from its first byte (default 10)")
      ->check(seconds);
  cmd->add_option("--body-timeout", args.body_timeout, "Seconds a request body may take (default 30)")->check(seconds);
  cmd->add_option("--idle-timeout", args.idle_timeout, "Seconds an idle keep-alive connection is kept (default 30)")
      ->check(seconds);
  cmd->add_option("--write-timeout", args.write_timeout,
                  "Seconds one write of an answer may wait for a client that does not read (default 30)")
      ->check(seconds);
  cmd->add_option("--io-threads", args.io_threads, "Threads serving every connection (default 2)")->check(CLI::Range(1, 256));
  cmd->add_option("--http-workers", args.workers, "Threads parsing and tokenizing generation requests (default 2)")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--max-queue", args.max_queue, "Requests waiting beyond which new ones get 429 (default 256)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--kv-budget", args.kv_budget, "KV pool size, e.g. 256MiB (default)");
  cmd->add_option("--blocks", args.blocks, "KV pool size in blocks (instead of --kv-budget)")->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  cmd->add_option("--block-len", args.block_len, "Tokens per KV block (default 16; with --cp, 16 x cp)")
      ->each([](const std::string&) { args.block_len_given = true; });
  cmd->add_option("--kv-dtype", args.kv_dtype,
                  "KV storage: f32 (default), f16, bf16, int8, fp8_e4m3, fp8_e5m2 (one f16 scale per row), int4 (KIVI; "
                  "--block-len a multiple of 32)");
  cmd->add_option("--kv-rotate", args.kv_rotate,
                  "none (default) or hadamard: int8 / fp8 rows stored rotated by the Hadamard transform")
      ->check(CLI::IsMember({"none", "hadamard"}));
  cmd->add_option("--kv-policy", args.kv_policy,
                  "Token eviction per request: none (default), streaming, h2o, snapkv (needs --no-prefix-cache)");
  cmd->add_option("--kv-keep", args.kv_budget_fraction, "Fraction of each request's tokens --kv-policy keeps, (0, 1]");
  cmd->add_option("--kv-layer-dtypes", args.kv_layer_dtypes,
                  "Per-layer overrides of --kv-dtype: LAYERS=DTYPE,... (index, -1 = last, or a:b), e.g. 0=f16,-1=f16");
  cmd->add_option("--max-step-tokens", args.step_tokens, "Tokens per engine step (chunked prefill; default 256)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--max-running", args.max_running, "Sequences per step (default 64)")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--served-model-name", args.name, "Model id in the API (default: the file name)");
  cmd->add_option("--chat-template", args.chat_template,
                  "Chat template for /v1/chat/completions: chatml, llama3, llama2, mistral, gemma, phi3, zephyr, or a "
                  "Jinja file (default: the model's own; ChatML when it has none)");
  cmd->add_flag("--no-prefix-cache", args.no_prefix_cache, "Do not share prompt blocks between requests");
  cmd->add_option("--device", args.device,
                  "Where the KV cache lives and the model runs: cpu (default), cuda or cuda:N (an NVIDIA GPU; "
                  "llama / qwen2 and gemma3 models)");
  cmd->add_flag("--tensor-cores", args.tensor_cores, "On a CUDA device: attention of f16 / bf16 caches (head_dim a multiple of 16 up to 128) on the tensor cores, " "prompt chunks and decode steps (not yet the default: not yet run on a GPU)");
  cmd->add_flag("--cuda-graphs", args.cuda_graphs, "On a CUDA device: decode steps launched as CUDA graphs, one launch per step, "
                "replayed while the launches repeat (not yet the default: not yet run on a GPU)");
  cmd->add_option("--threads", args.threads, "Threads for the kernels (default: all cores)")->check(CLI::Range(0, 4096));
  AddTierFlags(cmd, args.tiers);
  AddKvEventFlags(cmd, args.kv_events);
  cmd->callback([&exit_code] { exit_code = RunServe(args); });
  return cmd;
}

}  // namespace pagekv::cli
