// RunFleetBench (include/pagekv/bench.h): real `pagekv serve` processes
// behind a real `pagekv route`, driven over loopback HTTP by a trace.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/trace.h"
#include "pagekv/bench.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/synth_model.h"

namespace pagekv {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

// A `pagekv` child process whose first "listening on http://HOST:PORT"
// line gives its port; killed when it goes.
class Child {
 public:
  static Result<std::unique_ptr<Child>> Start(std::vector<std::string> args) {
    int out[2];
    if (::pipe(out) != 0) return UnavailableError("fleet bench: pipe failed");
    const pid_t pid = ::fork();
    if (pid < 0) return UnavailableError("fleet bench: fork failed");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(out[1], 1);
      ::close(out[0]);
      // Its log lines would cut through the progress bar.
      const int null = ::open("/dev/null", O_WRONLY);
      if (null >= 0) ::dup2(null, 2);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    auto c = std::unique_ptr<Child>(new Child());
    c->pid_ = pid;
    c->out_ = ::fdopen(out[0], "r");
    char line[512];
    while (std::fgets(line, sizeof line, c->out_) != nullptr) {
      const std::string s(line);
      const size_t at = s.find("listening on http://");
      if (at == std::string::npos) continue;
      c->port_ = std::atoi(s.c_str() + s.find(':', at + 20) + 1);
      return c;
    }
    return UnavailableError("fleet bench: '" + args[0] + " " + args[1] + "' exited before listening (its flags or model)");
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      for (int i = 0; i < 50 && ::waitpid(pid_, nullptr, WNOHANG) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) std::fclose(out_);
  }
  int port() const { return port_; }
  // SIGKILL: a crash, nothing finished gracefully.
  void Crash() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  Child() = default;
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
};

double Series(const std::string& text, const std::string& name) {
  for (size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    if (at > 0 && text[at - 1] != '\n') continue;
    const char next = text[at + name.size()];
    if (next != ' ' && next != '{') continue;
    const size_t eol = text.find('\n', at);
    return std::strtod(text.c_str() + text.rfind(' ', eol) + 1, nullptr);
  }
  return 0;
}

struct Sent {
  bool ok = false;
  double ttft_ms = 0;
  int64_t prompt_tokens = 0, cached = 0, completion = 0;
  std::string text;  // the streamed completion, joined
};

// The text pieces of the whole server-sent events in `buf` (consumed).
void TakeText(std::string& buf, std::string& text) {
  size_t end;
  while ((end = buf.find("\n\n")) != std::string::npos) {
    const std::string event = buf.substr(0, end);
    buf.erase(0, end + 2);
    if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
    const json j = json::parse(event.substr(6), nullptr, false);
    if (j.is_object() && j.contains("choices") && j["choices"].is_array() && !j["choices"].empty() &&
        j["choices"][0].contains("text") && j["choices"][0]["text"].is_string()) {
      text += j["choices"][0]["text"].get<std::string>();
    }
  }
}

// One streamed completion of token ids through the router.
Sent Send(int port, const std::vector<int32_t>& prompt, int32_t max_tokens) {
  Sent s;
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::minutes(10));
  const json body = {{"prompt", prompt},       {"max_tokens", max_tokens}, {"temperature", 0},
                     {"ignore_eos", true},      {"stream", true},           {"stream_options", {{"include_usage", true}}}};
  std::string tail, events;
  const auto t0 = Clock::now();
  bool first = true;
  // cpp-httplib 0.11 has no streamed POST helper: through the request API.
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers.emplace("Content-Type", "application/json");
  req.body = body.dump();
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (first && std::string_view(data, n).find("\"text\"") != std::string_view::npos) {
      s.ttft_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      first = false;
    }
    tail.append(data, n);
    if (tail.size() > (64u << 10)) tail.erase(0, tail.size() - (32u << 10));
    events.append(data, n);
    TakeText(events, s.text);
    return true;
  };
  httplib::Response r;
  httplib::Error err = httplib::Error::Success;
  if (!cli.send(req, r, err) || r.status != 200) return s;
  const size_t at = tail.rfind("\"usage\"");
  if (at == std::string::npos) return s;
  const size_t start = tail.rfind("data: ", at);
  const size_t end = tail.find('\n', at);
  const json j = json::parse(tail.substr(start + 6, end - start - 6), nullptr, false);
  if (j.is_discarded() || !j.contains("usage")) return s;
  s.prompt_tokens = j["usage"].value("prompt_tokens", 0);
  s.completion = j["usage"].value("completion_tokens", 0);
  s.cached = j["usage"]["prompt_tokens_details"].value("cached_tokens", 0);
  s.ok = true;
  return s;
}

// One unbounded pool seeing the requests in order: each hits the longest
// prefix of full blocks (less its last token) some earlier one had. The
// tokens each request hits.
std::vector<int64_t> OracleHits(const std::vector<std::vector<int32_t>>& prompts, int32_t block_len) {
  std::set<std::string> seen;
  std::vector<int64_t> hits;
  for (const std::vector<int32_t>& p : prompts) {
    std::vector<BlockKey> keys;
    const int64_t full = static_cast<int64_t>(p.size()) / block_len;
    for (int64_t i = 0; i < full; ++i) {
      keys.push_back(Sha256BlockKey(keys.empty() ? nullptr : &keys.back(),
                                    std::span<const int32_t>(p).subspan(static_cast<size_t>(i * block_len), static_cast<size_t>(block_len)), {}));
    }
    const int64_t may = (static_cast<int64_t>(p.size()) - 1) / block_len;
    int64_t n = 0;
    while (n < may && seen.count(keys[static_cast<size_t>(n)].Hex()) > 0) ++n;
    hits.push_back(n * block_len);
    for (const BlockKey& k : keys) seen.insert(k.Hex());
  }
  return hits;
}

std::vector<std::string> SplitList(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// The stdout of `redis-cli -h HOST -p PORT ARGS...` ("" when it failed).
std::string RedisCli(const std::string& node, const std::string& args) {
  const size_t colon = node.rfind(':');
  if (colon == std::string::npos) return "";
  const std::string cmd = "redis-cli -h " + node.substr(0, colon) + " -p " + node.substr(colon + 1) + " " + args + " 2>/dev/null";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return "";
  std::string out;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  ::pclose(f);
  return out;
}

// Whether the cluster, asked through `ask` (a node that is up), no longer
// has `killed` serving any slot: its replica was promoted (CLUSTER NODES:
// "id ip:port@cport flags master ping pong epoch link [slot ranges...]").
bool Promoted(const std::string& ask, const std::string& killed) {
  const std::string nodes = RedisCli(ask, "CLUSTER NODES");
  if (nodes.empty()) return false;
  size_t at = 0;
  while (at < nodes.size()) {
    size_t eol = nodes.find('\n', at);
    if (eol == std::string::npos) eol = nodes.size();
    std::istringstream line(nodes.substr(at, eol - at));
    at = eol + 1;
    std::vector<std::string> f;
    for (std::string w; line >> w;) f.push_back(w);
    if (f.size() < 8 || f[1].substr(0, f[1].find('@')) != killed) continue;
    return f.size() == 8;  // no slot ranges left on it
  }
  return false;
}

// Shuts the cluster's first listed node down without saving (a crash for
// the cluster: its replica takes over after the node timeout), through
// redis-cli; the node it was, or "" when that failed.
std::string ShutDownNode(const std::string& nodes) {
  const std::string first = nodes.substr(0, nodes.find(','));
  const size_t colon = first.rfind(':');
  if (colon == std::string::npos) return "";
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) {
      ::dup2(null, 1);
      ::dup2(null, 2);
    }
    ::execlp("redis-cli", "redis-cli", "-h", first.substr(0, colon).c_str(), "-p", first.substr(colon + 1).c_str(),
             "SHUTDOWN", "NOSAVE", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return "";
  // redis-cli exits 1 when it could not reach the node (already down).
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "";
  return first;
}

}  // namespace

Result<FleetBenchReport> RunFleetBench(const FleetBenchOptions& o) {
  if (o.cli_path.empty()) return InvalidArgumentError("fleet bench: the pagekv binary is not known");
  if (o.backend_counts.empty() || o.policies.empty() || o.tier_configs.empty()) {
    return InvalidArgumentError("fleet bench: give at least one backend count, policy and tier config");
  }
  for (int n : o.backend_counts) {
    if (n < 1 || n > 16) return InvalidArgumentError("fleet bench: backend counts must be within 1..16");
  }
  if (o.chunk_tokens < 1 || o.chunk_tokens > 512) return InvalidArgumentError("fleet bench: --chunk-tokens must be within 1..512");
  for (const std::string& t : o.tier_configs) {
    if (t != "none" && t != "cluster") return InvalidArgumentError("fleet bench: tier config '" + t + "': use none or cluster");
    if (t == "cluster" && o.redis_cluster.empty()) {
      return InvalidArgumentError("fleet bench: the cluster tier needs --redis-cluster HOST:PORT[,...] (e.g. from scripts/redis-cluster.sh)");
    }
  }
  PAGEKV_ASSIGN_OR_RETURN(std::vector<bench::TraceRequest> trace, bench::ReadTrace(o.trace_path, o.format, o.max_requests));
  FleetBenchReport report;
  std::string model = o.model_path, temp;
  int32_t vocab = 0, context = 0;
  if (model.empty()) {
    const char* dir = std::getenv("TMPDIR");
    temp = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/pagekv-bench-fleet-" + std::to_string(::getpid()) + ".gguf";
    PAGEKV_ASSIGN_OR_RETURN(SynthModelSpec spec, FindSynthModelPreset(o.synth_preset));
    PAGEKV_RETURN_IF_ERROR(WriteSynthModel(spec, 1, "f32", temp));
    model = temp;
    vocab = spec.vocab_size;
    context = spec.context_len;
    report.model = "synthetic " + o.synth_preset;
  } else {
    return InvalidArgumentError("fleet bench: only a synthetic model for now (--preset): its prompts are the trace's synthetic token ids");
  }
  struct Cleanup {
    std::string path;
    ~Cleanup() {
      if (!path.empty()) std::remove(path.c_str());
    }
  } cleanup{temp};
  // The requests that fit the context, with their prompts and arrival times.
  std::vector<std::vector<int32_t>> prompts;
  std::vector<double> arrivals;
  int64_t skipped = 0;
  for (size_t i = 0; i < trace.size(); ++i) {
    std::vector<int32_t> p;
    bench::TraceTokens(trace[i], static_cast<int64_t>(i), vocab, p, o.chunk_tokens);
    if (static_cast<int64_t>(p.size()) + o.max_tokens > context || p.empty()) {
      ++skipped;
      continue;
    }
    prompts.push_back(std::move(p));
    arrivals.push_back(trace[i].arrival_s * o.time_scale);
  }
  const std::vector<int64_t> oracle_hits = OracleHits(prompts, o.block_len);
  {
    int64_t total = 0, hit = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      total += static_cast<int64_t>(prompts[i].size());
      hit += oracle_hits[i];
    }
    report.oracle_hit_rate = total > 0 ? static_cast<double>(hit) / static_cast<double>(total) : 0;
  }
  std::vector<std::string> reference(prompts.size());  // each request's first answer over the runs
  int run_id = 0;
  for (const std::string& tiers : o.tier_configs) {
    for (int n : o.backend_counts) {
      for (const std::string& policy : o.policies) {
        ++run_id;
        FleetRun run;
        run.backends = n;
        run.policy = policy;
        run.tiers = tiers;
        run.skipped = skipped;
        std::vector<std::unique_ptr<Child>> backends;
        std::vector<std::string> route = {o.cli_path, "route", "--model", model, "--port", "0", "--policy", policy,
                                          "--block-len", std::to_string(o.block_len), "--health-interval", "0.2",
                                          "--load-weight", std::to_string(o.load_weight), "--kv-usage-weight",
                                          std::to_string(o.kv_usage_weight)};
        for (int k = 0; k < n; ++k) {
          const int events = FreePort();
          std::vector<std::string> args = {o.cli_path, "serve", "--model", model, "--port", "0", "--kv-budget",
                                           std::to_string(o.kv_budget_bytes), "--block-len", std::to_string(o.block_len),
                                           "--threads", std::to_string(o.threads_per_backend), "--report-cached-tokens",
                                           "--max-body-bytes", std::to_string(64 << 20), "--kv-events-endpoint",
                                           "tcp://127.0.0.1:" + std::to_string(events)};
          if (tiers == "cluster") {
            args.insert(args.end(), {"--redis-cluster", o.redis_cluster, "--redis-namespace",
                                     "pagekv:fleet-" + std::to_string(::getpid()) + "-" + std::to_string(run_id)});
          }
          PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Child> b, Child::Start(args));
          route.push_back("--backend");
          route.push_back("http://127.0.0.1:" + std::to_string(b->port()) + ",tcp://127.0.0.1:" + std::to_string(events));
          backends.push_back(std::move(b));
        }
        PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Child> router, Child::Start(route));
        std::this_thread::sleep_for(std::chrono::milliseconds(500));  // subscriptions and first health polls
        const std::string name = std::to_string(n) + " backends, " + policy + ", " + tiers;
        std::vector<Sent> results(prompts.size());
        std::atomic<int64_t> done{0};
        std::vector<std::thread> clients;
        const auto t0 = Clock::now();
        // After a primary's kill: watches for its replica's promotion.
        std::thread watcher;
        std::atomic<bool> promoted{false}, stop_watching{false};
        Clock::time_point killed_at{};
        for (size_t i = 0; i < prompts.size(); ++i) {
          std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrivals[i])));
          if (o.kill_backend_after > 0 && static_cast<int64_t>(i) == o.kill_backend_after && !backends.empty()) {
            backends.front()->Crash();  // requests on it are cut; the next ones go elsewhere
            run.killed_backend = true;
            run.kill_index = static_cast<int64_t>(i);
            run.promoted_index = static_cast<int64_t>(i);
          }
          if (tiers == "cluster" && o.kill_primary_after > 0 && static_cast<int64_t>(i) == o.kill_primary_after) {
            killed_at = Clock::now();
            run.killed_primary = ShutDownNode(o.redis_cluster);
            if (!run.killed_primary.empty()) run.kill_index = static_cast<int64_t>(i);
            const std::vector<std::string> nodes = SplitList(o.redis_cluster);
            if (!run.killed_primary.empty() && nodes.size() > 1) {
              watcher = std::thread([&, ask = nodes[1], killed = run.killed_primary] {
                while (!stop_watching && !Promoted(ask, killed)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                if (!stop_watching) {
                  run.promotion_seconds = std::chrono::duration<double>(Clock::now() - killed_at).count();
                  promoted = true;
                }
              });
            }
          }
          if (run.kill_index >= 0 && run.promoted_index < 0 && promoted) run.promoted_index = static_cast<int64_t>(i);
          clients.emplace_back([&, i] {
            results[i] = Send(router->port(), prompts[i], o.max_tokens);
            const int64_t d = ++done;
            if (o.on_progress) o.on_progress(name, d, static_cast<int64_t>(prompts.size()));
          });
        }
        for (std::thread& t : clients) t.join();
        run.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        stop_watching = true;
        if (watcher.joinable()) watcher.join();
        std::vector<double> ttft;
        int64_t completion = 0;
        for (size_t i = 0; i < results.size(); ++i) {
          const Sent& s = results[i];
          if (!s.ok) {
            ++run.failed;
            continue;
          }
          // Greedy decoding of the same prompt: every run's answer must be
          // the same, wherever it ran and whatever it hit.
          if (reference[i].empty()) {
            reference[i] = s.text;
          } else if (reference[i] != s.text) {
            ++run.mismatched;
          }
          ++run.requests;
          run.prompt_tokens += s.prompt_tokens;
          run.cached_tokens += s.cached;
          completion += s.completion;
          ttft.push_back(s.ttft_ms);
        }
        if (run.kill_index >= 0) {
          const int64_t end = static_cast<int64_t>(results.size());
          const int64_t bounds[4] = {0, run.kill_index, run.promoted_index >= 0 ? run.promoted_index : end, end};
          for (int ph = 0; ph < 3; ++ph) {
            int64_t total = 0, hit = 0, oracle = 0;
            for (int64_t i = bounds[ph]; i < bounds[ph + 1]; ++i) {
              const Sent& s = results[static_cast<size_t>(i)];
              if (!s.ok) continue;
              total += s.prompt_tokens;
              hit += s.cached;
              oracle += oracle_hits[static_cast<size_t>(i)];
            }
            run.phase_hit_rate[ph] = total > 0 ? static_cast<double>(hit) / static_cast<double>(total) : 0;
            run.phase_oracle_hit_rate[ph] = total > 0 ? static_cast<double>(oracle) / static_cast<double>(total) : 0;
          }
        }
        run.hit_rate = run.prompt_tokens > 0 ? static_cast<double>(run.cached_tokens) / static_cast<double>(run.prompt_tokens) : 0;
        run.ttft_p50_ms = bench::Percentile(ttft, 0.5);
        run.ttft_p99_ms = bench::Percentile(ttft, 0.99);
        run.output_tokens_per_s = run.seconds > 0 ? static_cast<double>(completion) / run.seconds : 0;
        httplib::Client cli("127.0.0.1", router->port());
        if (auto m = cli.Get("/metrics"); m && m->status == 200) {
          run.exact_predictions = static_cast<int64_t>(Series(m->body, "pagekv_router_exact_predictions_total"));
          run.reported_decisions = static_cast<int64_t>(Series(m->body, "pagekv_router_reported_decisions_total"));
        }
        report.runs.push_back(std::move(run));
      }
    }
  }
  return report;
}

}  // namespace pagekv
