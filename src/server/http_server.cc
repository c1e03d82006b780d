// RunServer (include/pagekv/server.h): the routes and the OpenAI answers over
// the Beast transport (http_transport.h), in front of the engine.
#include "base/json_nesting.h"
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
#include "server/server_state.h"

namespace pagekv {
namespace {

using server::Exchange;
using server::FieldError;
using server::HttpRequest;
using server::HttpResponse;
using server::ParsedRequest;
using server::ParseRequest;
using server::Sha256;
using server::Answer;
using server::AnswerError;
using server::AnswerJson;
using server::CountedExchange;
using server::Dump;
using server::ErrorJson;
using server::KeyIndex;
using server::Metrics;
using server::Observe;
using server::OneTwoFive;
using server::RouteLabel;
using server::Shared;

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

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

// OpenAI's logprobs object for some of a choice's tokens: per token its
// piece, log-probability and the top alternatives (completions: parallel
// lists and text offsets, `offset` advanced past them; chat: a list of
// entries with bytes).
json Logprobs(const Engine& engine, const std::vector<TokenLogprob>& lps, bool chat, int top, size_t& offset) {
  auto piece = [&](int32_t t) { return engine.Detokenize({t}); };
  if (chat) {
    auto entry = [&](int32_t t, float lp) {
      const std::string p = piece(t);
      json bytes = json::array();
      for (unsigned char c : p) bytes.push_back(c);
      return json{{"token", p}, {"logprob", lp}, {"bytes", std::move(bytes)}};
    };
    json content = json::array();
    for (const TokenLogprob& t : lps) {
      json e = entry(t.token, t.logprob);
      json tops = json::array();
      if (top > 0) {
        for (const auto& [id, lp] : t.top) tops.push_back(entry(id, lp));
      }
      e["top_logprobs"] = std::move(tops);
      content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}};
  }
  json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (const TokenLogprob& t : lps) {
    const std::string p = piece(t.token);
    tokens.push_back(p);
    values.push_back(t.logprob);
    offsets.push_back(offset);
    offset += p.size();
    json alt = json::object();
    for (const auto& [id, lp] : t.top) alt[piece(id)] = lp;
    tops.push_back(top > 0 ? std::move(alt) : json(nullptr));
  }
  return {{"tokens", std::move(tokens)}, {"token_logprobs", std::move(values)}, {"top_logprobs", std::move(tops)},
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
  bool llama = false;  // llama-server's /completion shapes
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
  std::vector<size_t> offsets;       // per choice: the text offset of its next streamed logprob
  std::vector<std::optional<RequestResult>> results;
  size_t ended = 0;

  size_t IndexOf(RequestId rid) const {
    return static_cast<size_t>(std::find(rids.begin(), rids.end(), rid) - rids.begin());
  }

  json Chunk(size_t i, const TokenUpdate& u) {
    std::string text = u.text;
    if (first[i]) text.insert(0, echo[i]);
    if (llama) {
      first[i] = false;
      return server::LlamaChunk(*sh, u, text, logprobs);
    }
    json choice = Choice(chat, true, text, u.finish, first[i]);
    choice["index"] = i;
    if (logprobs >= 0) choice["logprobs"] = Logprobs(*sh->engine, u.logprobs, chat, logprobs, offsets[i]);
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
    offsets.resize(rids.size());
    for (size_t k = 0; k < rids.size(); ++k) offsets[k] = echo[k].size();
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
    if (stream && llama) {  // the last token's chunk, then the end with the statistics (no [DONE])
      if (!last["content"].get_ref<const std::string&>().empty() || !last["tokens"].empty() ||
          !last.value("completion_probabilities", json::array()).empty()) {
        ex->Write("data: " + Dump(last) + "\n\n");
      }
      ex->Write("data: " + Dump(server::LlamaEnd(*sh, *results[i], "", /*n_probs=*/0)) + "\n\n");  // the chunks had them
      ex->End();
      return;
    }
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
    if (llama) {
      if (results[0]->finish == FinishReason::kError) return AnswerError(*sh, *ex, 500, results[0]->error.message());
      return AnswerJson(*sh, *ex, Dump(server::LlamaEnd(*sh, *results[0], results[0]->text, logprobs)));
    }
    json choices = json::array();
    for (size_t k = 0; k < results.size(); ++k) {
      if (results[k]->finish == FinishReason::kError) return AnswerError(*sh, *ex, 500, results[k]->error.message());
      json c = Choice(chat, false, echo[k] + results[k]->text, results[k]->finish, true);
      c["index"] = k;
      size_t offset = echo[k].size();
      if (logprobs >= 0) c["logprobs"] = Logprobs(*sh->engine, TokenLogprobs(*results[k]), chat, logprobs, offset);
      choices.push_back(std::move(c));
    }
    json out = {{"id", id}, {"object", object}, {"created", created}, {"model", sh->model},
                {"choices", std::move(choices)}, {"usage", TotalUsage()}};
    AnswerJson(*sh, *ex, Dump(out));
  }
};

enum class Api { kNone, kCompletions, kChat, kLlama };

// A worker: a completion or chat request (OpenAI's, or llama-server's
// /completion), from its body to Submit.
void HandleGenerate(Shared& sh, const HttpRequest& req, const std::shared_ptr<Exchange>& ex, Api api) {
  const bool chat = api == Api::kChat;
  {
    std::lock_guard lock(sh.mu);
    ++sh.requests_total;
  }
  if (Status deep = CheckJsonNesting(req.body, "the body"); !deep.ok()) return AnswerError(sh, *ex, 400, deep.message());
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
  g->llama = api == Api::kLlama;
  ParsedRequest parsed;
  try {
    const int key = KeyIndex(sh, req.Header("authorization"));
    bool until_context = false;
    if (g->llama) body = server::LlamaCompletionBody(body, &until_context);
    parsed = ParseRequest(body, *sh.engine, key >= 0 ? sh.key_salts[static_cast<size_t>(key)] : "", chat, until_context);
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

// An I/O thread: cheap endpoints answered here, generation handed to a
// worker.
void Route(Shared& sh, HttpRequest req, std::shared_ptr<Exchange> raw) {
  const auto ex = std::make_shared<CountedExchange>(std::move(raw), RouteLabel(req.path), &sh.responses);
  const bool open = req.path == "/health" || req.path == "/metrics";  // no key: for probes and scrapers
  if (!sh.ready.load(std::memory_order_acquire)) {
    if (req.path == "/health") {
      return Answer(sh, *ex, {503, "application/json", {{"Retry-After", "1"}}, "{\"status\":\"loading\"}"});
    }
    return AnswerError(sh, *ex, 503, "the model is loading", "", {{"Retry-After", "1"}});
  }
  if (sh.draining.load() && !open) return AnswerError(sh, *ex, 503, "the server is shutting down", "", {{"Retry-After", "5"}});
  if (!open && !sh.key_digests.empty() && KeyIndex(sh, req.Header("authorization")) < 0) {
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
    const std::optional<std::string> decoded = server::PercentDecode(std::string_view(req.path).substr(11));
    if (!decoded) {
      return AnswerError(sh, *ex, 400, "the model id in the path has a '%' not followed by two hex digits: escape it as %25",
                         "model", {}, "invalid_request_error");
    }
    const std::string& id = *decoded;
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
    // Waits for the current step: on a worker.
    boost::asio::post(*sh.workers, [&sh, ex] {
      const Status s = sh.engine->ResetPrefixCache();
      if (!s.ok()) return AnswerError(sh, *ex, 400, s.message());
      Answer(sh, *ex, {200, "application/json", {}, "{\"status\":\"ok\"}"});
    });
    return;
  }
  if (server::IsLlamaRoute(req.path)) return server::HandleLlama(sh, req, ex);
  const Api api = req.path == "/v1/completions"        ? Api::kCompletions
                  : req.path == "/v1/chat/completions" ? Api::kChat
                  : req.path == "/completion"          ? Api::kLlama
                                                       : Api::kNone;
  if (api != Api::kNone) {
    if (req.method != "POST") return wrong_method("POST");
    boost::asio::post(*sh.workers, [&sh, req = std::move(req), ex, api] {
      try {
        HandleGenerate(sh, req, ex, api);
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
  if (o.engine.parallel.active() && o.engine.parallel.all->rank() != 0) {
    // A rank other than 0 of a split model: no HTTP; its engine steps with
    // rank 0's (which serves), on the inputs rank 0 sends, until it stops.
    EngineOptions eo = o.engine;
    eo.parallel_leader = true;
    Result<std::unique_ptr<Engine>> follower = Engine::Create(eo);
    // Every rank reports whether its engine came up before any step.
    Result<bool> all = eo.parallel.all->AllOk(follower.ok());
    if (!follower.ok()) return follower.status();
    if (!all.ok()) return all.status();
    if (!*all) return FailedPreconditionError("server: another rank could not create its engine (its error says why)");
    return (*follower)->Follow();
  }
  Shared sh;
  sh.model = o.model_name;
  if (sh.model.empty()) {
    const size_t slash = o.engine.model_path.find_last_of('/');
    sh.model = slash == std::string::npos ? o.engine.model_path : o.engine.model_path.substr(slash + 1);
  }
  for (const std::string& k : o.api_keys) {
    if (k.empty()) return InvalidArgumentError("server: an API key is empty");
    sh.key_digests.push_back(Sha256(k));
    sh.key_salts.push_back(server::TenantSalt(k));
  }
  sh.report_cached_always = o.report_cached_tokens_always;
  sh.created = static_cast<int64_t>(std::time(nullptr));
  sh.model_label = {{"model_name", sh.model}};
  sh.max_running = o.engine.max_running;
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
  // The port is taken first (a taken one fails at once, naming it); while
  // the model loads every route answers 503, /health {"status":"loading"}.
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
  const int port = (*transport)->port();
  EngineOptions eo = o.engine;
  // KV events' default topic names this server: kv@<hostname>:<port>@<model>.
  if (eo.kv_events.model.empty()) eo.kv_events.model = sh.model;
  if (eo.kv_events.instance.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
    eo.kv_events.instance = std::string(host) + ":" + std::to_string(port);
  }
  if (eo.parallel.active()) eo.parallel_leader = true;
  Result<std::unique_ptr<Engine>> created = Engine::Create(eo);
  if (eo.parallel.active()) {
    // Rank 0 serves once every rank's engine is up (they fail together).
    Result<bool> all = eo.parallel.all->AllOk(created.ok());
    if (created.ok() && (!all.ok() || !*all)) {
      created = all.ok() ? Result<std::unique_ptr<Engine>>(FailedPreconditionError(
                               "server: another rank could not create its engine (its error says why)"))
                         : Result<std::unique_ptr<Engine>>(all.status());
    }
  }
  if (!created.ok()) {
    (*transport)->Stop();
    workers.join();
    return created.status();
  }
  std::unique_ptr<Engine> engine = std::move(*created);
  sh.engine = engine.get();
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
  engine->Start();
  sh.ready.store(true, std::memory_order_release);  // after every field above
  std::fprintf(stderr, "pagekv serve: chat template: %s\n", sh.engine->chat_template_name().c_str());
  if (o.on_listening) o.on_listening(port);
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
