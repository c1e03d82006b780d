// RunServer (include/pagekv/server.h): cpp-httplib in front of the engine.
#include "pagekv/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <limits>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "server/request.h"

namespace pagekv {
namespace {

using server::FieldError;
using server::ParsedRequest;
using server::ParseRequest;
using server::Sha256;

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// A Prometheus histogram with fixed buckets (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void Observe(double v) {
    std::lock_guard lock(mu_);
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    ++counts_[i];
    sum_ += v;
    ++count_;
  }
  std::string Render(const std::string& name, const std::string& help) const {
    std::lock_guard lock(mu_);
    std::string out = "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    int64_t cumulative = 0;
    char buf[64];
    for (size_t i = 0; i < bounds_.size(); ++i) {
      cumulative += counts_[i];
      std::snprintf(buf, sizeof(buf), "%g", bounds_[i]);
      out += name + "_bucket{le=\"" + buf + "\"} " + std::to_string(cumulative) + "\n";
    }
    out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
    std::snprintf(buf, sizeof(buf), "%.9g", sum_);
    out += name + "_sum " + buf + "\n" + name + "_count " + std::to_string(count_) + "\n";
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;
  double sum_ = 0;
  int64_t count_ = 0;
};

struct Shared {
  Engine* engine = nullptr;
  std::string model;
  std::vector<std::array<unsigned char, 32>> key_digests;  // SHA-256 of each API key
  std::vector<std::string> key_salts;                      // each key's cache salt
  bool report_cached_always = false;
  Histogram ttft{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram itl{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
  std::mutex mu;
  std::set<RequestId> in_flight;
  std::atomic<bool> draining{false};
  int64_t requests_total = 0, errors_total = 0;
  Clock::time_point last_scrape = Clock::now();
  int64_t last_generated = 0;
};

void SendError(httplib::Response& res, int status, const std::string& message, const std::string& type,
               const std::string& param = {}) {
  json e = {{"error", {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
                       {"code", status}}}};
  res.status = status;
  // Replacing invalid UTF-8 (a model name, a parser's quote of the body):
  // an error answer must never throw.
  res.set_content(e.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

// Which API key the request carries: its index, -1 for none or a wrong one.
// Every key is compared, in constant time, whatever matches.
int KeyIndex(const Shared& sh, const httplib::Request& req) {
  const std::string auth = req.get_header_value("Authorization");
  if (auth.rfind("Bearer ", 0) != 0) return -1;
  const std::array<unsigned char, 32> d = Sha256(std::string_view(auth).substr(7));
  int found = -1;
  for (size_t i = 0; i < sh.key_digests.size(); ++i) {
    const bool eq = CRYPTO_memcmp(d.data(), sh.key_digests[i].data(), d.size()) == 0;
    found = eq ? static_cast<int>(i) : found;
  }
  return found;
}


json Usage(const RequestResult& r, bool report_cached) {
  return {{"prompt_tokens", r.prompt_tokens},
          {"completion_tokens", static_cast<int64_t>(r.tokens.size())},
          {"total_tokens", r.prompt_tokens + static_cast<int64_t>(r.tokens.size())},
          {"prompt_tokens_details", {{"cached_tokens", report_cached ? r.cached_prompt_tokens : 0}}}};
}

std::string FinishName(FinishReason f) { return f == FinishReason::kNone ? "" : FinishReasonName(f); }

json Choice(bool chat, bool delta, const std::string& text, FinishReason finish, bool first) {
  json c = {{"index", 0}};
  if (chat) {
    json m = {{"content", text}};
    if (!delta || first) m["role"] = "assistant";
    c[delta ? "delta" : "message"] = m;
  } else {
    c["text"] = text;
    c["logprobs"] = nullptr;
  }
  c["finish_reason"] = finish == FinishReason::kNone ? json(nullptr) : json(FinishName(finish));
  return c;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Streams of one request: the engine's updates, handed to the HTTP thread.
struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TokenUpdate> updates;
};

void Observe(Shared& sh, const RequestResult& r) {
  if (!r.tokens.empty()) sh.ttft.Observe(r.time_to_first_token);
  for (double d : r.inter_token) sh.itl.Observe(d);
}

void HandleGenerate(Shared& sh, const httplib::Request& req, const std::string& text, httplib::Response& res,
                    bool chat) {
  {
    std::lock_guard lock(sh.mu);
    ++sh.requests_total;
  }
  json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    std::string why = "the body is not a JSON object";
    try {
      const json reparsed = json::parse(text);
      why = "the body is " + std::string(reparsed.type_name()) + ", not a JSON object";
    } catch (const json::exception& e) {  // a parse error, or a number out of range (1e400)
      why = std::string("malformed JSON: ") + e.what();
    }
    return SendError(res, 400, why, "invalid_request_error");
  }
  if (body.contains("model") && body["model"].is_string() && body["model"].get<std::string>() != sh.model) {
    return SendError(res, 404, "model '" + body["model"].get<std::string>() + "' does not exist; this server has '" + sh.model + "'",
                     "invalid_request_error", "model");
  }
  bool stream = false, own_salt = false;
  EngineRequest er;
  try {
    const int key = KeyIndex(sh, req);
    ParsedRequest parsed = ParseRequest(body, *sh.engine, key >= 0 ? sh.key_salts[static_cast<size_t>(key)] : "", chat);
    er = std::move(parsed.request);
    stream = parsed.stream;
    own_salt = parsed.own_salt;
  } catch (const FieldError& e) {
    return SendError(res, 400, e.message, "invalid_request_error", e.field);
  }
  auto updates = std::make_shared<Stream>();
  if (stream) {
    er.on_update = [updates](const TokenUpdate& u) {
      std::lock_guard lock(updates->mu);
      updates->updates.push_back(u);
      updates->cv.notify_all();
    };
  }
  Result<RequestId> id = sh.engine->Submit(std::move(er));
  if (!id.ok()) {
    const StatusCode c = id.status().code();
    if (c == StatusCode::kUnavailable) {
      res.set_header("Retry-After", "1");
      return SendError(res, 429, id.status().message(), "rate_limit_error");
    }
    return SendError(res, 400, id.status().message(), "invalid_request_error",
                     c == StatusCode::kOutOfRange ? "max_tokens" : "");
  }
  const RequestId rid = *id;
  {
    std::lock_guard lock(sh.mu);
    sh.in_flight.insert(rid);
  }
  const std::string cid = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(rid);
  const bool report_cached = own_salt || sh.report_cached_always;
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const char* object = chat ? "chat.completion" : "text_completion";
  auto done = [&sh, rid] {
    std::lock_guard lock(sh.mu);
    sh.in_flight.erase(rid);
  };
  if (!stream) {
    const RequestResult r = sh.engine->Wait(rid);
    done();
    Observe(sh, r);
    if (r.finish == FinishReason::kError) return SendError(res, 500, r.error.message(), "server_error");
    json out = {{"id", cid}, {"object", object}, {"created", created}, {"model", sh.model},
                {"choices", json::array({Choice(chat, false, r.text, r.finish, true)})},
                {"usage", Usage(r, report_cached)}};
    res.set_content(Dump(out), "application/json");
    return;
  }
  const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
  auto first = std::make_shared<bool>(true);
  res.set_chunked_content_provider(
      "text/event-stream",
      [&sh, updates, rid, cid, created, chat, chunk_object, first, done, report_cached](size_t,
                                                                                        httplib::DataSink& sink) {
        std::deque<TokenUpdate> batch;
        {
          std::unique_lock lock(updates->mu);
          updates->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return !updates->updates.empty(); });
          batch.swap(updates->updates);
        }
        if (!sink.is_writable()) {
          sh.engine->Cancel(rid);  // the client went away
          return false;
        }
        for (const TokenUpdate& u : batch) {
          json chunk = {{"id", cid}, {"object", chunk_object}, {"created", created}, {"model", sh.model},
                        {"choices", json::array({Choice(chat, true, u.text, u.finish, *first)})}};
          *first = false;
          if (u.finish != FinishReason::kNone) {
            const RequestResult r = sh.engine->Wait(rid);
            done();
            Observe(sh, r);
            chunk["usage"] = Usage(r, report_cached);
          }
          const std::string data = "data: " + Dump(chunk) + "\n\n";
          if (!sink.write(data.data(), data.size())) {
            sh.engine->Cancel(rid);
            return false;
          }
          if (u.finish != FinishReason::kNone) {
            static constexpr char kDone[] = "data: [DONE]\n\n";
            sink.write(kDone, sizeof(kDone) - 1);
            sink.done();
            return true;
          }
        }
        return true;
      },
      [&sh, rid, done](bool success) {
        // A stream that ended early (client gone, server stopping): cancel
        // the request and collect its result so nothing stays behind.
        if (!success && sh.engine->Cancel(rid)) (void)sh.engine->Wait(rid);
        done();
      });
}

std::string Metrics(Shared& sh) {
  const EngineMetrics m = sh.engine->Metrics();
  double tokens_per_second = 0;
  int64_t requests = 0, errors = 0;
  {
    std::lock_guard lock(sh.mu);
    const auto now = Clock::now();
    const double dt = std::chrono::duration<double>(now - sh.last_scrape).count();
    if (dt > 0) tokens_per_second = static_cast<double>(m.generated_tokens - sh.last_generated) / dt;
    sh.last_scrape = now;
    sh.last_generated = m.generated_tokens;
    requests = sh.requests_total;
    errors = sh.errors_total;
  }
  std::string out;
  auto gauge = [&](const std::string& name, const std::string& help, const std::string& type,
                   const std::vector<std::pair<std::string, double>>& samples) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    char buf[64];
    for (const auto& [labels, v] : samples) {
      std::snprintf(buf, sizeof(buf), "%.9g", v);
      out += name + labels + " " + buf + "\n";
    }
  };
  gauge("pagekv_kv_blocks", "KV blocks of the pool by state (cached: free but holding prefix-cache KV)", "gauge",
        {{"{state=\"used\"}", static_cast<double>(m.blocks_used)},
         {"{state=\"free\"}", static_cast<double>(m.blocks_free - m.blocks_cached)},
         {"{state=\"cached\"}", static_cast<double>(m.blocks_cached)}});
  gauge("pagekv_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up", "gauge",
        {{"", m.prefix.token_hit_rate}});
  gauge("pagekv_preemptions_total", "Sequences preempted for lack of KV blocks", "counter",
        {{"", static_cast<double>(m.preemptions)}});
  gauge("pagekv_tokens_evicted_total", "Tokens dropped from running requests by token eviction (--kv-policy)", "counter",
        {{"", static_cast<double>(m.tokens_evicted)}});
  gauge("pagekv_queue_length", "Requests waiting for admission", "gauge", {{"", static_cast<double>(m.waiting)}});
  gauge("pagekv_running_sequences", "Sequences in the running batch", "gauge", {{"", static_cast<double>(m.running)}});
  gauge("pagekv_generated_tokens_total", "Tokens generated", "counter", {{"", static_cast<double>(m.generated_tokens)}});
  gauge("pagekv_tokens_per_second", "Generated tokens per second since the previous scrape", "gauge",
        {{"", tokens_per_second}});
  gauge("pagekv_requests_total", "Generation requests received", "counter", {{"", static_cast<double>(requests)}});
  gauge("pagekv_request_errors_total", "Requests answered with an error status", "counter", {{"", static_cast<double>(errors)}});
  if (m.tiers) {
    std::vector<std::pair<std::string, double>> hits, misses, corrupt, forged, errors, blocks, bytes, healthy;
    for (const TierStats& t : m.tiers->tiers) {
      const std::string l = "{tier=\"" + t.name + "\"}";
      hits.push_back({l, static_cast<double>(t.hits)});
      misses.push_back({l, static_cast<double>(t.misses)});
      corrupt.push_back({l, static_cast<double>(t.corrupt)});
      forged.push_back({l, static_cast<double>(t.unauthenticated)});
      errors.push_back({l, static_cast<double>(t.errors)});
      blocks.push_back({l, static_cast<double>(t.blocks_now)});
      bytes.push_back({l, static_cast<double>(t.bytes_now)});
      healthy.push_back({l, t.healthy ? 1.0 : 0.0});
    }
    std::vector<std::pair<std::string, double>> loaded;
    for (int t = 1; t < kNumTiers; ++t) {
      loaded.push_back({"{tier=\"" + std::string(TierName(static_cast<Tier>(t))) + "\"}",
                        static_cast<double>(m.prefix.tier_hit_blocks[static_cast<size_t>(t)])});
    }
    gauge("pagekv_tier_loaded_blocks_total", "Prefix blocks loaded into the pool from a lower tier instead of computed",
          "counter", loaded);
    gauge("pagekv_tier_hits_total", "Verified blocks a tier returned", "counter", hits);
    gauge("pagekv_tier_misses_total", "Gets a tier could not serve (absent or dropped as corrupt)", "counter", misses);
    gauge("pagekv_tier_corrupt_total", "Payloads that failed a check (MAC or checksum, size, key, tokens): dropped, recomputed",
          "counter", corrupt);
    gauge("pagekv_tier_unauthenticated_total",
          "Of those, payloads whose MAC failed under the tier key (forged, altered, another key): never loaded", "counter",
          forged);
    gauge("pagekv_tier_errors_total", "I/O and connection failures, and calls refused while a tier backs off", "counter",
          errors);
    gauge("pagekv_tier_blocks", "Blocks a tier holds (redis: stored by this process)", "gauge", blocks);
    gauge("pagekv_tier_bytes", "Bytes a tier holds", "gauge", bytes);
    gauge("pagekv_tier_healthy", "1 when the tier's last call succeeded, 0 while it backs off", "gauge", healthy);
    gauge("pagekv_tier_load_failures_total", "Blocks located in a tier that could not be loaded (recomputed)", "counter",
          {{"", static_cast<double>(m.prefix.tier_load_failures)}});
    gauge("pagekv_tier_dropped_total", "Copies down or prefetches dropped by a full mover queue", "counter",
          {{"", static_cast<double>(m.tiers->dropped)}});
    gauge("pagekv_tier_staged_mismatches_total",
          "Prefetched blocks refused at load: fetched for other tokens or another prefix under the same key", "counter",
          {{"", static_cast<double>(m.tiers->staged_mismatches)}});
  }
  out += sh.ttft.Render("pagekv_time_to_first_token_seconds", "Seconds from submission to the first token");
  out += sh.itl.Render("pagekv_inter_token_latency_seconds", "Seconds between consecutive tokens of a request");
  return out;
}

// Debian's cpp-httplib (0.11, compiled) listens with a backlog of 5: a burst
// of concurrent connections overflows it and clients see dropped SYNs and
// failed reads. listen() again on the bound socket raises the backlog; the
// library does not expose the socket, so find it by its port.
void RaiseListenBacklog(int port) {
  for (int fd = 3; fd < 4096; ++fd) {
    int accepting = 0;
    socklen_t len = sizeof(accepting);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0 || accepting == 0) continue;
    sockaddr_storage addr{};
    socklen_t addr_len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &addr_len) != 0) continue;
    int bound = -1;
    if (addr.ss_family == AF_INET) bound = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
    if (addr.ss_family == AF_INET6) bound = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
    if (bound == port) ::listen(fd, SOMAXCONN);
  }
}

}  // namespace

Status RunServer(const ServerOptions& o, const std::atomic<bool>& stop) {
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(o.engine));
  Shared sh;
  sh.engine = engine.get();
  for (const std::string& k : o.api_keys) {
    if (k.empty()) return InvalidArgumentError("server: an API key is empty");
    sh.key_digests.push_back(Sha256(k));
    const std::array<unsigned char, 32> salt = Sha256("pagekv tenant salt:", k);
    sh.key_salts.emplace_back(reinterpret_cast<const char*>(salt.data()), 16);
  }
  sh.report_cached_always = o.report_cached_tokens_always;
  sh.model = o.model_name;
  if (sh.model.empty()) {
    const size_t slash = o.engine.model_path.find_last_of('/');
    sh.model = slash == std::string::npos ? o.engine.model_path : o.engine.model_path.substr(slash + 1);
  }
  engine->Start();

  httplib::Server svr;
  svr.new_task_queue = [] { return new httplib::ThreadPool(64); };
  svr.set_payload_max_length(static_cast<size_t>(o.max_body_bytes));
  // An exception that escapes a handler is a 500 with a JSON body; its text
  // never reaches the client (httplib's default puts it in a header).
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    SendError(res, 500, "internal error while handling the request", "server_error");
  });
  svr.set_pre_routing_handler([&sh](const httplib::Request& req, httplib::Response& res) {
    // Before any body is read: a compressed body is refused, not inflated
    // (a few KB of gzip can inflate to gigabytes).
    if (const std::string enc = req.get_header_value("Content-Encoding"); !enc.empty() && enc != "identity") {
      res.set_header("Connection", "close");
      SendError(res, 415, "Content-Encoding '" + enc + "' is not accepted: send the body uncompressed",
                "invalid_request_error");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (sh.draining.load() && req.path.rfind("/v1/", 0) == 0) {
      res.set_header("Retry-After", "5");
      SendError(res, 503, "the server is shutting down", "server_error");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (sh.key_digests.empty() || req.path.rfind("/v1/", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    if (KeyIndex(sh, req) < 0) {
      SendError(res, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  svr.set_error_handler([&sh, &o](const httplib::Request&, httplib::Response& res) {
    {
      std::lock_guard lock(sh.mu);
      ++sh.errors_total;
    }
    if (!res.body.empty()) return;
    if (res.status == 413) {
      SendError(res, 413, "the body is larger than --max-body-bytes (" + std::to_string(o.max_body_bytes) + ")",
                "invalid_request_error");
    } else if (res.status == 404) {
      SendError(res, 404, "no such endpoint", "invalid_request_error");
    }
  });
  // The body is read here as it streams, whatever its transfer encoding, and
  // refused as soon as it passes --max-body-bytes (httplib bounds only a
  // Content-Length body; a chunked one it would read whole).
  auto generate = [&sh, &o](bool chat) {
    return [&sh, &o, chat](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
      std::string body;
      bool too_large = false;
      const bool read = reader([&](const char* data, size_t n) {
        if (body.size() + n > static_cast<size_t>(o.max_body_bytes)) {
          too_large = true;
          return false;
        }
        body.append(data, n);
        return true;
      });
      too_large = too_large || res.status == 413;  // a Content-Length past the limit: httplib's own check
      if (too_large || !read) {
        res.set_header("Connection", "close");  // the rest of the body is never read
        return too_large ? SendError(res, 413,
                                     "the body is larger than --max-body-bytes (" + std::to_string(o.max_body_bytes) + ")",
                                     "invalid_request_error")
                         : SendError(res, 400, "the body could not be read (malformed chunked encoding, or cut short)",
                                     "invalid_request_error");
      }
      HandleGenerate(sh, req, body, res, chat);
    };
  };
  svr.Post("/v1/completions", generate(false));
  svr.Post("/v1/chat/completions", generate(true));
  svr.Get("/v1/models", [&sh](const httplib::Request&, httplib::Response& res) {
    json out = {{"object", "list"}, {"data", json::array({{{"id", sh.model}, {"object", "model"}, {"created", 0}, {"owned_by", "pagekv"}}})}};
    res.set_content(out.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  });
  svr.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("{\"status\":\"ok\"}", "application/json"); });
  svr.Get("/metrics", [&sh](const httplib::Request&, httplib::Response& res) {
    res.set_content(Metrics(sh), "text/plain; version=0.0.4");
  });

  const int port = o.port == 0 ? svr.bind_to_any_port(o.host) : (svr.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port < 0) return IoError("cannot listen on " + o.host + ":" + std::to_string(o.port) + " (in use, or not an address here)");
  RaiseListenBacklog(port);
  std::fprintf(stderr, "pagekv serve: chat template: %s\n", sh.engine->chat_template_name().c_str());
  if (o.on_listening) o.on_listening(port);
  std::atomic<bool> listener_done{false};
  std::thread listener([&svr, &listener_done] {
    svr.listen_after_bind();
    listener_done = true;
  });
  // httplib's stop() does nothing before listen has begun (the listener
  // would then serve for ever): a SIGTERM during start-up waits for it.
  while (!svr.is_running() && !listener_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  while (!stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Shutdown: refuse new generation requests (503); give in-flight ones 5 s
  // to finish, then cancel them (their streams end with a final event);
  // then close the socket.
  sh.draining = true;
  for (int i = 0; i < 50; ++i) {
    {
      std::lock_guard lock(sh.mu);
      if (sh.in_flight.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  {
    std::lock_guard lock(sh.mu);
    for (RequestId id : sh.in_flight) engine->Cancel(id);
  }
  for (int i = 0; i < 20; ++i) {  // the cancelled streams write their last event
    {
      std::lock_guard lock(sh.mu);
      if (sh.in_flight.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  svr.stop();
  listener.join();
  engine->Stop();
  return Status::Ok();
}

}  // namespace pagekv
