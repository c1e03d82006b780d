// RunServer (include/pagekv/server.h): the routes and the OpenAI answers over
// the Beast transport (http_transport.h), in front of the engine.
#include "pagekv/server.h"

#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <nlohmann/json.hpp>

#include "server/http_transport.h"
#include "server/metrics.h"
#include "server/request.h"

namespace pagekv {
namespace {

using server::Exchange;
using server::FieldError;
using server::HttpRequest;
using server::HttpResponse;
using server::ParsedRequest;
using server::ParseRequest;
using server::Sha256;

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

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
  static const std::set<std::string> kRoutes = {"/health", "/metrics", "/v1/models", "/v1/completions",
                                                "/v1/chat/completions", "/reset_prefix_cache"};
  if (kRoutes.count(path) != 0) return path;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "unmatched";
}

struct Shared {
  Engine* engine = nullptr;
  std::string model;
  std::vector<std::array<unsigned char, 32>> key_digests;  // SHA-256 of each API key
  std::vector<std::string> key_salts;                      // each key's cache salt
  bool report_cached_always = false;
  // The series of /metrics (docs/OPENAI_API.md lists them).
  server::Labels model_label;  // {model_name: the served name}
  server::Labels cache_config;  // vllm:cache_config_info's labels
  server::Histogram ttft{kTtftBuckets}, itl{kTokenGapBuckets}, tpot{kTokenGapBuckets};
  server::Histogram e2e{kRequestBuckets}, queue{kRequestBuckets}, prefill{kRequestBuckets}, decode{kRequestBuckets},
      inference{kRequestBuckets};
  std::unique_ptr<server::Histogram> prompt_len, generation_len;  // buckets up to the context
  server::CounterSet finished;   // by finished_reason
  server::CounterSet responses;  // by route and status
  std::mutex mu;
  std::set<RequestId> in_flight;
  std::atomic<bool> draining{false};
  int64_t requests_total = 0;
  const server::HttpTransport* transport = nullptr;
  int64_t created = 0;  // the server's start, as the models' "created"
  boost::asio::thread_pool* workers = nullptr;
};

// OpenAI's error object: a type its SDKs map to exception classes (with
// the HTTP status) and a string code naming the case (docs/OPENAI_API.md).
std::string ErrorType(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 429: return "rate_limit_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

std::string ErrorCode(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "invalid_api_key";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 413: return "request_too_large";
    case 415: return "unsupported_media_type";
    case 429: return "rate_limit_exceeded";
    case 431: return "request_header_fields_too_large";
    case 501: return "not_implemented";
    case 503: return "service_unavailable";
    case 505: return "http_version_not_supported";
    default: return status >= 500 ? "internal_error" : "invalid_request_error";
  }
}

std::string ErrorJson(int status, const std::string& message, const std::string& param = {}, std::string code = {}) {
  json e = {{"error", {{"message", message}, {"type", ErrorType(status)}, {"param", param.empty() ? json(nullptr) : json(param)},
                       {"code", code.empty() ? ErrorCode(status) : code}}}};
  // Replacing invalid UTF-8 (a model name, a parser's quote of the body):
  // an error answer must never throw.
  return e.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Which API key the request carries: its index, -1 for none or a wrong one.
// Every key is compared, in constant time, whatever matches.
int KeyIndex(const Shared& sh, const std::string& auth) {
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
    c["logprobs"] = nullptr;
  } else {
    c["text"] = text;
    c["logprobs"] = nullptr;
  }
  c["finish_reason"] = finish == FinishReason::kNone ? json(nullptr) : json(FinishName(finish));
  return c;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// vLLM's finished_reason values.
const char* FinishedReason(FinishReason f) {
  switch (f) {
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "abort";
    case FinishReason::kError: return "error";
    default: return "stop";
  }
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

void Answer(Shared&, Exchange& ex, HttpResponse r) { ex.Respond(std::move(r)); }

// An exchange whose answers are counted by route and status.
class CountedExchange : public Exchange {
 public:
  CountedExchange(std::shared_ptr<Exchange> inner, std::string route, server::CounterSet* counts)
      : inner_(std::move(inner)), route_(std::move(route)), counts_(counts) {}
  void Respond(HttpResponse response) override {
    Count(response.status);
    inner_->Respond(std::move(response));
  }
  void BeginStream(int status, std::string content_type) override {
    Count(status);
    inner_->BeginStream(status, std::move(content_type));
  }
  void Write(std::string chunk) override { inner_->Write(std::move(chunk)); }
  void End() override { inner_->End(); }
  void OnClientGone(std::function<void()> f) override { inner_->OnClientGone(std::move(f)); }

 private:
  void Count(int status) {
    if (!counted_.exchange(true)) counts_->Add({{"route", route_}, {"status", std::to_string(status)}});
  }
  std::shared_ptr<Exchange> inner_;
  std::string route_;
  server::CounterSet* counts_;
  std::atomic<bool> counted_{false};
};

void AnswerJson(Shared& sh, Exchange& ex, std::string body) { Answer(sh, ex, {200, "application/json", {}, std::move(body)}); }

void AnswerError(Shared& sh, Exchange& ex, int status, const std::string& message, const std::string& param = {},
                 std::vector<std::pair<std::string, std::string>> headers = {}, std::string code = {}) {
  Answer(sh, ex, {status, "application/json", std::move(headers), ErrorJson(status, message, param, std::move(code))});
}

// OpenAI's logprobs object of one choice: per generated token its piece,
// log-probability and the top alternatives (completions: parallel lists
// and text offsets from `offset`; chat: a list of entries with bytes).
json Logprobs(const Engine& engine, const RequestResult& r, bool chat, int top, size_t offset) {
  auto piece = [&](int32_t t) { return engine.Detokenize({t}); };
  const size_t steps = std::min(r.tokens.size(), r.token_logprobs.size());
  auto alternatives = [&](size_t i, auto&& add) {
    if (top <= 0 || i >= r.step_top.size()) return;
    for (const auto& [id, logit] : r.step_top[i]) add(id, logit - r.step_logsumexp[i]);
  };
  if (chat) {
    auto entry = [&](int32_t t, float lp) {
      const std::string p = piece(t);
      json bytes = json::array();
      for (unsigned char c : p) bytes.push_back(c);
      return json{{"token", p}, {"logprob", lp}, {"bytes", std::move(bytes)}};
    };
    json content = json::array();
    for (size_t i = 0; i < steps; ++i) {
      json e = entry(r.tokens[i], r.token_logprobs[i]);
      json tops = json::array();
      alternatives(i, [&](int32_t id, float lp) { tops.push_back(entry(id, lp)); });
      e["top_logprobs"] = std::move(tops);
      content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}};
  }
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (size_t i = 0; i < steps; ++i) {
    const std::string p = piece(r.tokens[i]);
    tokens.push_back(p);
    lps.push_back(r.token_logprobs[i]);
    offsets.push_back(offset);
    offset += p.size();
    json alt = json::object();
    alternatives(i, [&](int32_t id, float lp) { alt[piece(id)] = lp; });
    tops.push_back(top > 0 ? std::move(alt) : json(nullptr));
  }
  return {{"tokens", std::move(tokens)}, {"token_logprobs", std::move(lps)}, {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

// One generation request from its Submit to its end, over its choices
// (prompts x n engine requests): the engine's updates (on the engine's
// thread) become the answer; each choice's end is collected on a worker
// (Wait must not run on the engine's thread), and the answer completes
// when the last one has ended.
struct Generation : std::enable_shared_from_this<Generation> {
  Shared* sh = nullptr;
  std::shared_ptr<Exchange> ex;
  bool chat = false, stream = false, report_cached = false;
  std::string id, object;
  int64_t created = 0;
  int n = 1;                      // choices per prompt (usage counts each prompt once)
  int logprobs = -1;              // -1 off, else the top alternatives per token
  bool include_usage = false;     // a stream ends with a usage chunk
  std::vector<std::string> echo;  // per choice: text before the answer

  std::mutex mu;
  bool started = false;              // Submit returned: the ids known, the stream begun
  std::vector<TokenUpdate> pending;  // updates before started
  std::vector<RequestId> rids;
  std::vector<bool> first;           // per choice: its first chunk is still to come
  std::vector<std::optional<RequestResult>> results;
  size_t ended = 0;

  size_t IndexOf(RequestId rid) const {
    return static_cast<size_t>(std::find(rids.begin(), rids.end(), rid) - rids.begin());
  }

  json Chunk(size_t i, const TokenUpdate& u) {
    std::string text = u.text;
    if (first[i]) text.insert(0, echo[i]);
    json choice = Choice(chat, true, text, u.finish, first[i]);
    choice["index"] = i;
    first[i] = false;
    return {{"id", id}, {"object", object}, {"created", created}, {"model", sh->model}, {"choices", json::array({choice})}};
  }

  void OnUpdate(const TokenUpdate& u) {
    std::lock_guard lock(mu);
    if (!started) {
      if (stream || u.finish != FinishReason::kNone) pending.push_back(u);
      return;
    }
    DeliverLocked(u);
  }

  void DeliverLocked(const TokenUpdate& u) {
    const size_t i = IndexOf(u.id);
    if (i >= rids.size()) return;
    if (u.finish != FinishReason::kNone) {
      json last = stream ? Chunk(i, u) : json();
      boost::asio::post(*sh->workers, [self = shared_from_this(), i, last = std::move(last)]() mutable {
        self->Finish(i, std::move(last));
      });
      return;
    }
    if (stream) ex->Write("data: " + Dump(Chunk(i, u)) + "\n\n");
  }

  // After a successful Submit of every choice.
  void Started(std::vector<RequestId> ids) {
    std::lock_guard lock(mu);
    rids = std::move(ids);
    first.assign(rids.size(), true);
    results.resize(rids.size());
    started = true;
    if (stream) ex->BeginStream(200, "text/event-stream");
    for (const TokenUpdate& u : pending) DeliverLocked(u);
    pending.clear();
  }

  json TotalUsage() const {
    json u = {{"prompt_tokens", 0}, {"completion_tokens", 0}, {"total_tokens", 0},
              {"prompt_tokens_details", {{"cached_tokens", 0}}}};
    for (size_t i = 0; i < results.size(); ++i) {
      const json one = Usage(*results[i], report_cached);
      const bool prompt_once = i % static_cast<size_t>(n) == 0;  // the choices of one prompt share it
      if (prompt_once) {
        u["prompt_tokens"] = u["prompt_tokens"].get<int64_t>() + one["prompt_tokens"].get<int64_t>();
        u["prompt_tokens_details"]["cached_tokens"] = u["prompt_tokens_details"]["cached_tokens"].get<int64_t>() +
                                                      one["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
      }
      u["completion_tokens"] = u["completion_tokens"].get<int64_t>() + one["completion_tokens"].get<int64_t>();
    }
    u["total_tokens"] = u["prompt_tokens"].get<int64_t>() + u["completion_tokens"].get<int64_t>();
    return u;
  }

  // A worker: choice i has ended.
  void Finish(size_t i, json last) {
    RequestResult r = sh->engine->Wait(rids[i]);
    {
      std::lock_guard lock(sh->mu);
      sh->in_flight.erase(rids[i]);
    }
    Observe(*sh, r);
    std::lock_guard lock(mu);
    results[i] = std::move(r);
    const bool all = ++ended == rids.size();
    if (stream) {
      ex->Write("data: " + Dump(last) + "\n\n");
      if (all) {
        if (include_usage) {  // OpenAI's shape: one more chunk, no choices, the whole request's usage
          const json u = {{"id", id}, {"object", object}, {"created", created}, {"model", sh->model},
                          {"choices", json::array()}, {"usage", TotalUsage()}};
          ex->Write("data: " + Dump(u) + "\n\n");
        }
        ex->Write("data: [DONE]\n\n");
        ex->End();
      }
      return;
    }
    if (!all) return;
    json choices = json::array();
    for (size_t k = 0; k < results.size(); ++k) {
      if (results[k]->finish == FinishReason::kError) return AnswerError(*sh, *ex, 500, results[k]->error.message());
      json c = Choice(chat, false, echo[k] + results[k]->text, results[k]->finish, true);
      c["index"] = k;
      if (logprobs >= 0) c["logprobs"] = Logprobs(*sh->engine, *results[k], chat, logprobs, echo[k].size());
      choices.push_back(std::move(c));
    }
    json out = {{"id", id}, {"object", object}, {"created", created}, {"model", sh->model},
                {"choices", std::move(choices)}, {"usage", TotalUsage()}};
    AnswerJson(*sh, *ex, Dump(out));
  }
};

// A worker: a completion or chat request, from its body to Submit.
void HandleGenerate(Shared& sh, const HttpRequest& req, const std::shared_ptr<Exchange>& ex, bool chat) {
  {
    std::lock_guard lock(sh.mu);
    ++sh.requests_total;
  }
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    std::string why = "the body is not a JSON object";
    try {
      const json reparsed = json::parse(req.body);
      why = "the body is " + std::string(reparsed.type_name()) + ", not a JSON object";
    } catch (const json::exception& e) {  // a parse error, or a number out of range (1e400)
      why = std::string("malformed JSON: ") + e.what();
    }
    return AnswerError(sh, *ex, 400, why);
  }
  if (body.contains("model") && body["model"].is_string() && body["model"].get<std::string>() != sh.model) {
    return AnswerError(sh, *ex, 404,
                       "model '" + body["model"].get<std::string>() + "' does not exist; this server has '" + sh.model + "'",
                       "model", {}, "model_not_found");
  }
  auto g = std::make_shared<Generation>();
  g->sh = &sh;
  g->ex = ex;
  g->chat = chat;
  ParsedRequest parsed;
  try {
    const int key = KeyIndex(sh, req.Header("authorization"));
    parsed = ParseRequest(body, *sh.engine, key >= 0 ? sh.key_salts[static_cast<size_t>(key)] : "", chat);
  } catch (const FieldError& e) {
    return AnswerError(sh, *ex, 400, e.message, e.field, {}, e.code);
  }
  g->stream = parsed.stream;
  g->report_cached = parsed.own_salt || sh.report_cached_always;
  g->n = parsed.n;
  g->logprobs = parsed.logprobs;
  g->include_usage = parsed.include_usage;
  g->echo = std::move(parsed.echo);
  g->object = chat ? (g->stream ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  g->created = static_cast<int64_t>(std::time(nullptr));
  // The n choices of a prompt are submitted as a group: its prompt is
  // prefilled once and forked to each (copy on write), or shared through
  // the prefix cache.
  std::vector<RequestId> ids;
  Status failed = Status::Ok();
  for (size_t p = 0; p < parsed.choices.size() && failed.ok(); p += static_cast<size_t>(g->n)) {
    std::vector<EngineRequest> group;
    for (size_t j = p; j < p + static_cast<size_t>(g->n); ++j) {
      parsed.choices[j].on_update = [g](const TokenUpdate& u) { g->OnUpdate(u); };
      group.push_back(std::move(parsed.choices[j]));
    }
    if (group.size() == 1) {
      Result<RequestId> one = sh.engine->Submit(std::move(group[0]));
      if (one.ok()) {
        ids.push_back(*one);
      } else {
        failed = one.status();
      }
      continue;
    }
    Result<std::vector<RequestId>> got = sh.engine->SubmitShared(std::move(group));
    if (got.ok()) {
      ids.insert(ids.end(), got->begin(), got->end());
    } else {
      failed = got.status();
    }
  }
  if (!failed.ok()) {
    // All or nothing: the choices already queued are taken back.
    for (RequestId rid : ids) {
      if (sh.engine->Cancel(rid)) (void)sh.engine->Wait(rid);
    }
    const StatusCode c = failed.code();
    if (c == StatusCode::kUnavailable) return AnswerError(sh, *ex, 429, failed.message(), "", {{"Retry-After", "1"}});
    const bool too_long = c == StatusCode::kOutOfRange;  // the prompt and max_tokens exceed the context
    return AnswerError(sh, *ex, 400, failed.message(), too_long ? "max_tokens" : "", {},
                       too_long ? "context_length_exceeded" : "");
  }
  {
    std::lock_guard lock(sh.mu);
    sh.in_flight.insert(ids.begin(), ids.end());
  }
  g->id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(ids.front());
  g->Started(ids);
  // The client gone before its answer ended, streaming or not: its decoding
  // stops; the ends are collected as for any other request.
  ex->OnClientGone([&sh, ids] {
    for (RequestId rid : ids) sh.engine->Cancel(rid);
  });
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
  server::MetricsText out;
  const server::Labels& model = sh.model_label;
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
    std::vector<std::pair<server::Labels, double>> finished = sh.finished.Samples();
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
    server::Labels l = model;
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
    std::vector<std::pair<server::Labels, double>> responses = sh.responses.Samples();
    if (responses.empty()) responses.push_back({{{"route", "/health"}, {"status", "200"}}, 0.0});
    out.Add("pagekv_http_responses_total",
            "HTTP answers by route (unmatched: any path this server does not have; transport: refused before "
            "routing) and status",
            "counter", responses);
  }
  if (sh.transport != nullptr) {
    const server::TransportStats t = sh.transport->Stats();
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
    std::vector<std::pair<server::Labels, double>> hits, misses, corrupt, forged, errors, blocks, bytes, healthy;
    for (const TierStats& t : m.tiers->tiers) {
      const server::Labels l = with("tier", t.name);
      hits.push_back({l, d(t.hits)});
      misses.push_back({l, d(t.misses)});
      corrupt.push_back({l, d(t.corrupt)});
      forged.push_back({l, d(t.unauthenticated)});
      errors.push_back({l, d(t.errors)});
      blocks.push_back({l, d(t.blocks_now)});
      bytes.push_back({l, d(t.bytes_now)});
      healthy.push_back({l, t.healthy ? 1.0 : 0.0});
    }
    std::vector<std::pair<server::Labels, double>> loaded;
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
  server::AddProcessMetrics(out);
  return out.str();
}

// An I/O thread: cheap endpoints answered here, generation handed to a
// worker.
void Route(Shared& sh, HttpRequest req, std::shared_ptr<Exchange> raw) {
  const auto ex = std::make_shared<CountedExchange>(std::move(raw), RouteLabel(req.path), &sh.responses);
  const bool v1 = req.path.rfind("/v1/", 0) == 0;
  if (sh.draining.load() && v1) return AnswerError(sh, *ex, 503, "the server is shutting down", "", {{"Retry-After", "5"}});
  if (v1 && !sh.key_digests.empty() && KeyIndex(sh, req.Header("authorization")) < 0) {
    return AnswerError(sh, *ex, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'");
  }
  const bool get = req.method == "GET";
  auto wrong_method = [&](const char* allow) {
    AnswerError(sh, *ex, 405, "use " + std::string(allow) + " on " + req.path, "", {{"Allow", allow}});
  };
  if (req.path == "/health") {
    if (!get) return wrong_method("GET");
    // A load balancer stops sending here while the server drains.
    if (sh.draining.load()) return Answer(sh, *ex, {503, "application/json", {{"Retry-After", "5"}}, "{\"status\":\"draining\"}"});
    return AnswerJson(sh, *ex, "{\"status\":\"ok\"}");
  }
  const json model = {{"id", sh.model}, {"object", "model"}, {"created", sh.created}, {"owned_by", "pagekv"}};
  if (req.path == "/v1/models") {
    if (!get) return wrong_method("GET");
    return AnswerJson(sh, *ex, Dump({{"object", "list"}, {"data", json::array({model})}}));
  }
  if (req.path.rfind("/v1/models/", 0) == 0) {
    if (!get) return wrong_method("GET");
    const std::string id = req.path.substr(11);
    if (id != sh.model) {
      return AnswerError(sh, *ex, 404, "model '" + id + "' does not exist; this server has '" + sh.model + "'", "model", {},
                         "model_not_found");
    }
    return AnswerJson(sh, *ex, Dump(model));
  }
  if (req.path == "/metrics") {
    if (!get) return wrong_method("GET");
    // The engine's metrics take its lock: on a worker, not an I/O thread.
    boost::asio::post(*sh.workers, [&sh, ex] { Answer(sh, *ex, {200, "text/plain; version=0.0.4", {}, Metrics(sh)}); });
    return;
  }
  if (req.path == "/reset_prefix_cache") {
    if (req.method != "POST") return wrong_method("POST");
    if (!sh.key_digests.empty() && KeyIndex(sh, req.Header("authorization")) < 0) {
      return AnswerError(sh, *ex, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'");
    }
    // Waits for the current step: on a worker.
    boost::asio::post(*sh.workers, [&sh, ex] {
      const Status s = sh.engine->ResetPrefixCache();
      if (!s.ok()) return AnswerError(sh, *ex, 400, s.message());
      Answer(sh, *ex, {200, "application/json", {}, "{\"status\":\"ok\"}"});
    });
    return;
  }
  if (req.path == "/v1/completions" || req.path == "/v1/chat/completions") {
    if (req.method != "POST") return wrong_method("POST");
    const bool chat = req.path == "/v1/chat/completions";
    boost::asio::post(*sh.workers, [&sh, req = std::move(req), ex, chat] {
      try {
        HandleGenerate(sh, req, ex, chat);
      } catch (...) {  // never the exception's text to the client
        AnswerError(sh, *ex, 500, "internal error while handling the request");
      }
    });
    return;
  }
  AnswerError(sh, *ex, 404, "no such endpoint: " + req.path);
}

}  // namespace

Status RunServer(const ServerOptions& o, const std::atomic<bool>& stop) {
  Shared sh;
  sh.model = o.model_name;
  if (sh.model.empty()) {
    const size_t slash = o.engine.model_path.find_last_of('/');
    sh.model = slash == std::string::npos ? o.engine.model_path : o.engine.model_path.substr(slash + 1);
  }
  EngineOptions eo = o.engine;
  // KV events' default topic names this server: kv@<hostname>:<port>@<model>.
  if (eo.kv_events.model.empty()) eo.kv_events.model = sh.model;
  if (eo.kv_events.instance.empty() && o.port != 0) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
    eo.kv_events.instance = std::string(host) + ":" + std::to_string(o.port);
  }
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(eo));
  sh.engine = engine.get();
  sh.model_label = {{"model_name", sh.model}};
  sh.prompt_len = std::make_unique<server::Histogram>(OneTwoFive(engine->context_len()));
  sh.generation_len = std::make_unique<server::Histogram>(OneTwoFive(engine->context_len()));
  {
    const EngineMetrics em = engine->Metrics();
    sh.cache_config = {{"block_size", std::to_string(eo.block_len)},
                       {"cache_dtype", std::string(DTypeName(eo.kv_dtype))},
                       {"enable_prefix_caching", eo.prefix_cache ? "True" : "False"},
                       {"num_gpu_blocks", std::to_string(em.blocks_total)},
                       {"bytes_per_block", std::to_string(em.bytes_per_block)},
                       {"model_name", sh.model}};
  }
  for (const std::string& k : o.api_keys) {
    if (k.empty()) return InvalidArgumentError("server: an API key is empty");
    sh.key_digests.push_back(Sha256(k));
    const std::array<unsigned char, 32> salt = Sha256("pagekv tenant salt:", k);
    sh.key_salts.emplace_back(reinterpret_cast<const char*>(salt.data()), 16);
  }
  sh.report_cached_always = o.report_cached_tokens_always;
  sh.created = static_cast<int64_t>(std::time(nullptr));
  if (o.workers < 1) return InvalidArgumentError("server: at least one worker thread is needed");
  server::HttpLimits limits;
  limits.max_body_bytes = o.max_body_bytes;
  limits.max_header_bytes = o.max_header_bytes;
  limits.max_headers = o.max_headers;
  limits.max_connections = o.max_connections;
  limits.header_timeout = std::chrono::milliseconds(o.header_timeout_ms);
  limits.body_timeout = std::chrono::milliseconds(o.body_timeout_ms);
  limits.idle_timeout = std::chrono::milliseconds(o.idle_timeout_ms);
  limits.write_timeout = std::chrono::milliseconds(o.write_timeout_ms);
  boost::asio::thread_pool workers(static_cast<size_t>(o.workers));
  sh.workers = &workers;
  Result<std::unique_ptr<server::HttpTransport>> transport = server::HttpTransport::Listen(
      o.host, o.port, limits, [&sh](HttpRequest req, std::shared_ptr<Exchange> ex) { Route(sh, std::move(req), std::move(ex)); },
      [&sh](int status, const std::string& message) {
        sh.responses.Add({{"route", "transport"}, {"status", std::to_string(status)}});
        return ErrorJson(status, message);
      },
      o.io_threads);
  if (!transport.ok()) {
    workers.join();
    return transport.status();
  }
  sh.transport = transport->get();
  engine->Start();
  std::fprintf(stderr, "pagekv serve: chat template: %s\n", sh.engine->chat_template_name().c_str());
  if (o.on_listening) o.on_listening((*transport)->port());
  while (!stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Shutdown: refuse new generation requests (503); give in-flight ones 5 s
  // to finish, then cancel them (their streams end with a final event);
  // then close the connections.
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
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // their last bytes reach the sockets
  (*transport)->Stop();
  workers.join();
  // The engine goes before the transport: its last callbacks may still
  // reach an exchange.
  engine->Stop();
  engine.reset();
  transport->reset();
  return Status::Ok();

}

}  // namespace pagekv
