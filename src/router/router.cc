// `pagekv route` (include/pagekv/router.h): the HTTP front on the server's
// transport, a pool of forwarding workers (cpp-httplib clients, one
// blocking exchange each), the KV-event listener feeding the index
// (kv_events.h) and the backends' health and load, polled.
#include "base/json_nesting.h"
#include "pagekv/router.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <numeric>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <nlohmann/json.hpp>

#include "router/kv_events.h"
#include "router/model_text.h"
#include "router/prometheus_text.h"
#include "server/http_transport.h"
#include "server/metrics.h"
#include "server/request.h"
#include "server/server_state.h"

namespace pagekv {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using server::Exchange;
using server::HttpRequest;
using server::HttpResponse;

struct HostPort {
  std::string host;
  int port = 0;
};

Result<HostPort> ParseHttpUrl(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) return InvalidArgumentError("router: backend '" + url + "': expected http://host:port");
  std::string rest = url.substr(scheme.size());
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || rest.find('/') != std::string::npos) {
    return InvalidArgumentError("router: backend '" + url + "': expected http://host:port");
  }
  char* end = nullptr;
  const std::string port = rest.substr(colon + 1);
  const long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p < 1 || p > 65535) {
    return InvalidArgumentError("router: backend '" + url + "': port '" + port + "' is not in 1..65535");
  }
  return HostPort{rest.substr(0, colon), static_cast<int>(p)};
}

struct Backend {
  RouterBackend o;
  HostPort at;
  std::atomic<bool> up{true};
  std::atomic<int64_t> in_flight{0};
  // Prompt tokens the router's requests there still have to prefill (each
  // request's predicted miss, until its first byte comes back).
  std::atomic<int64_t> pending_prefill{0};
  std::atomic<int64_t> waiting{0}, running{0};
  // KV tokens its running requests hold (vllm:kv_cache_usage_perc x
  // num_gpu_blocks x block_size of its /metrics), as last polled.
  std::atomic<int64_t> kv_tokens{0};
  std::atomic<int64_t> requests{0}, failures{0};
  std::atomic<int64_t> restarts{0}, event_batches{0}, bad_batches{0}, gaps{0};
  // Listener thread only.
  bool seen_seq = false;
  uint64_t last_seq = 0;
};

// The usage a backend reported: usage.prompt_tokens_details.cached_tokens.
std::optional<int64_t> CachedTokens(const json& j) {
  if (!j.is_object() || !j.contains("usage") || !j["usage"].is_object()) return std::nullopt;
  const json& u = j["usage"];
  if (!u.contains("prompt_tokens_details") || !u["prompt_tokens_details"].is_object()) return std::nullopt;
  const json& d = u["prompt_tokens_details"];
  if (!d.contains("cached_tokens") || !d["cached_tokens"].is_number_integer()) return std::nullopt;
  return d["cached_tokens"].get<int64_t>();
}

// The last server-sent event in `tail` that carries a usage.
std::optional<int64_t> StreamCachedTokens(const std::string& tail) {
  size_t end = tail.size();
  while (true) {
    const size_t at = tail.rfind("data: ", end);
    if (at == std::string::npos) return std::nullopt;
    const size_t eol = tail.find('\n', at);
    const std::string line = tail.substr(at + 6, eol == std::string::npos ? std::string::npos : eol - at - 6);
    if (line.find("\"usage\"") != std::string::npos) {
      const json j = json::parse(line, nullptr, false);
      if (std::optional<int64_t> c = CachedTokens(j)) return c;
    }
    if (at == 0) return std::nullopt;
    end = at - 1;
  }
}

class Router {
 public:
  explicit Router(const RouterOptions& o) : o_(o), index_(o.block_len) {}

  Status Start() {
    if (o_.backends.empty()) return InvalidArgumentError("router: no backends (--backend http://host:port, one or more)");
    if (o_.block_len < 1) return InvalidArgumentError("router: --block-len must be at least 1");
    if (o_.workers < 1 || o_.io_threads < 1) return InvalidArgumentError("router: workers and io_threads must be at least 1");
    if (!(o_.load_weight >= 0)) return InvalidArgumentError("router: --load-weight must not be negative");
    if (!(o_.kv_usage_weight >= 0)) return InvalidArgumentError("router: --kv-usage-weight must not be negative");
    for (const RouterBackend& b : o_.backends) {
      auto be = std::make_unique<Backend>();
      be->o = b;
      PAGEKV_ASSIGN_OR_RETURN(be->at, ParseHttpUrl(b.url));
      backends_.push_back(std::move(be));
    }
    for (const std::string& k : o_.api_keys) {
      if (k.empty()) return InvalidArgumentError("router: an API key is empty");
      key_digests_.push_back(server::Sha256(k));
      key_salts_.push_back(server::TenantSalt(k));
    }
    PAGEKV_ASSIGN_OR_RETURN(text_, router::ModelText::Open(o_.model_path, o_.tokenizer_path, o_.chat_template));
    server::HttpLimits limits;
    PAGEKV_ASSIGN_OR_RETURN(
        http_, server::HttpTransport::Listen(
                   o_.host, o_.port, limits, [this](HttpRequest r, std::shared_ptr<Exchange> ex) { Handle(std::move(r), ex); },
                   [](int status, const std::string& m) { return server::ErrorJson(status, m); }, o_.io_threads));
    for (int i = 0; i < o_.workers; ++i) workers_.emplace_back([this] { Work(); });
    listener_ = std::thread([this] { Listen(); });
    health_ = std::thread([this] { Poll(); });
    if (o_.on_listening) o_.on_listening(http_->port());
    return Status::Ok();
  }

  void Stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (http_) http_->Stop();
    for (std::thread& t : workers_) t.join();
    if (listener_.joinable()) listener_.join();
    if (health_.joinable()) health_.join();
  }

 private:
  void Handle(HttpRequest req, std::shared_ptr<Exchange> ex) {
    if (req.path == "/health") {
      const bool any = std::any_of(backends_.begin(), backends_.end(), [](const auto& b) { return b->up.load(); });
      return ex->Respond({any ? 200 : 503, "application/json", {}, any ? R"({"status":"ok"})" : R"({"status":"no backend up"})"});
    }
    if (req.path == "/metrics") return ex->Respond({200, "text/plain; version=0.0.4", {}, MetricsPage()});
    const bool generate = req.path == "/v1/completions" || req.path == "/v1/chat/completions";
    if (!generate && req.path != "/v1/models" && req.path.rfind("/v1/models/", 0) != 0) {
      return ex->Respond({404, "application/json", {}, server::ErrorJson(404, "no route " + req.path, {}, "not_found")});
    }
    if (generate && req.method != "POST") {
      return ex->Respond({405, "application/json", {}, server::ErrorJson(405, "use POST", {}, "method_not_allowed")});
    }
    {
      std::lock_guard lock(mu_);
      // Past this many waiting for a worker, new requests are refused at
      // once rather than queued without bound (a flood costs no memory).
      if (jobs_.size() >= kMaxQueued) {
        ++no_backend_;
        return ex->Respond({503, "application/json", {{"Retry-After", "1"}},
                            server::ErrorJson(503, "the router's queue is full; retry shortly", {}, "service_unavailable")});
      }
      jobs_.push_back([this, r = std::move(req), ex]() mutable { Route(std::move(r), ex); });
    }
    cv_.notify_one();
  }

  void Work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (stopping_ && jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  // The order to try backends in for one request, and each one's
  // predicted hit (tokens).
  struct Decision {
    std::vector<int> order;
    std::vector<int64_t> predicted;
  };

  Decision Decide(const std::vector<int32_t>* tokens, const std::optional<std::string>& salt, int64_t adapter) {
    const int n = static_cast<int>(backends_.size());
    Decision d;
    d.predicted.assign(static_cast<size_t>(n), 0);
    std::vector<double> cost(static_cast<size_t>(n), 0);
    if (tokens != nullptr) {
      std::vector<router::KvIndex::Hit> hits;
      {
        std::lock_guard lock(index_mu_);
        hits = index_.Match(*tokens, salt, adapter, n);
      }
      for (int k = 0; k < n; ++k) d.predicted[static_cast<size_t>(k)] = hits[static_cast<size_t>(k)].blocks * o_.block_len;
    }
    const auto prompt = tokens != nullptr ? static_cast<double>(tokens->size()) : 0.0;
    for (int k = 0; k < n; ++k) {
      const Backend& b = *backends_[static_cast<size_t>(k)];
      const double load = static_cast<double>(b.in_flight.load() + b.waiting.load());
      switch (o_.policy) {
        case RoutePolicy::kKvAware:
          // The prefill the request waits for there: what is queued before
          // it, then its own miss (a time-to-first-token estimate in tokens).
          // Then the KV its running requests hold: the decode work it
          // shares its steps with (and the pool a miss must find room in).
          cost[static_cast<size_t>(k)] = prompt - static_cast<double>(d.predicted[static_cast<size_t>(k)]) +
                                         o_.load_weight * static_cast<double>(b.pending_prefill.load()) +
                                         o_.kv_usage_weight * static_cast<double>(b.kv_tokens.load());
          break;
        case RoutePolicy::kLeastLoaded: cost[static_cast<size_t>(k)] = load; break;
        case RoutePolicy::kRoundRobin: break;
      }
    }
    // Equal costs (round-robin: all of them) go in turn: requests with
    // nothing cached anywhere spread over the backends.
    d.order.resize(static_cast<size_t>(n));
    std::iota(d.order.begin(), d.order.end(), 0);
    std::rotate(d.order.begin(), d.order.begin() + static_cast<std::ptrdiff_t>(rr_++ % static_cast<uint64_t>(n)), d.order.end());
    std::stable_sort(d.order.begin(), d.order.end(),
                     [&](int a, int b) { return cost[static_cast<size_t>(a)] < cost[static_cast<size_t>(b)]; });
    // Backends known down go last (tried only when every other one failed).
    std::stable_partition(d.order.begin(), d.order.end(), [&](int k) { return backends_[static_cast<size_t>(k)]->up.load(); });
    return d;
  }

  void Route(HttpRequest req, const std::shared_ptr<Exchange>& ex) {
    ++requests_;
    // Parse as the backends will (errors are theirs to answer: the request
    // goes on without a prediction).
    std::optional<std::vector<int32_t>> tokens;
    std::optional<std::string> salt;
    int64_t adapter = 0;
    if (req.method == "POST") {
      // Refused here, as every backend would: parsed values recurse per level.
      if (Status deep = CheckJsonNesting(req.body, "the body"); !deep.ok()) {
        return ex->Respond({400, "application/json", {}, server::ErrorJson(400, deep.message())});
      }
      const json body = json::parse(req.body, nullptr, false);
      if (!body.is_discarded()) {
        try {
          int key = -1;
          const std::string auth = req.Header("authorization");
          if (auth.rfind("Bearer ", 0) == 0) {
            const auto d = server::Sha256(std::string_view(auth).substr(7));
            for (size_t i = 0; i < key_digests_.size(); ++i) {
              if (key_digests_[i] == d) key = static_cast<int>(i);
            }
          }
          const server::ParsedRequest p = server::ParseRequest(body, *text_, key >= 0 ? key_salts_[static_cast<size_t>(key)] : "",
                                                               req.path == "/v1/chat/completions");
          if (!p.choices.empty()) {
            tokens = p.choices[0].prompt;
            salt = p.choices[0].extra.cache_salt;
            adapter = p.choices[0].extra.adapter_id;
          }
        } catch (const server::FieldError&) {
          ++unparsed_;
        }
      }
    }
    const Decision d = Decide(tokens ? &*tokens : nullptr, salt, adapter);
    auto gone = std::make_shared<std::atomic<bool>>(false);
    ex->OnClientGone([gone] { *gone = true; });
    for (size_t attempt = 0; attempt < d.order.size(); ++attempt) {
      const int k = d.order[attempt];
      Backend& b = *backends_[static_cast<size_t>(k)];
      if (attempt > 0) ++retries_;
      const int64_t miss = tokens ? std::max<int64_t>(0, static_cast<int64_t>(tokens->size()) - d.predicted[static_cast<size_t>(k)]) : 0;
      const Outcome out = Forward(req, ex, b, *gone, miss);
      if (out == Outcome::kRetry) continue;
      if (out == Outcome::kDone) {
        ++b.requests;
        RecordDecision(d.predicted[static_cast<size_t>(k)], last_cached_);
      }
      return;
    }
    ++no_backend_;
    ex->Respond({503, "application/json", {{"Retry-After", "1"}},
                 server::ErrorJson(503, "no backend could take the request (all down or full)", {}, "service_unavailable")});
  }

  enum class Outcome { kDone, kRetry, kCut };
  static inline thread_local std::optional<int64_t> last_cached_;

  // One attempt on one backend. kRetry: nothing reached the client.
  Outcome Forward(const HttpRequest& req, const std::shared_ptr<Exchange>& ex, Backend& b, const std::atomic<bool>& gone,
                  int64_t miss) {
    last_cached_.reset();
    httplib::Client cli(b.at.host, b.at.port);
    cli.set_connection_timeout(std::chrono::seconds(2));
    cli.set_read_timeout(std::chrono::milliseconds(o_.backend_timeout_ms));
    cli.set_write_timeout(std::chrono::seconds(30));
    httplib::Request hreq;
    hreq.method = req.method;
    hreq.path = req.path + (req.query.empty() ? "" : "?" + req.query);
    for (const auto& [name, value] : req.headers) {
      if (name == "authorization" || name == "content-type" || name == "accept") hreq.headers.emplace(name, value);
    }
    hreq.body = req.body;
    int status = 0;
    std::string content_type, body, tail;
    bool streaming = false;
    hreq.response_handler = [&](const httplib::Response& r) {
      status = r.status;
      content_type = r.get_header_value("Content-Type");
      if (status == 200 && content_type.rfind("text/event-stream", 0) == 0) {
        streaming = true;
        ex->BeginStream(200, content_type);
      }
      return true;
    };
    bool prefilled = false;
    auto first_byte = [&] {
      if (!prefilled) b.pending_prefill -= miss;
      prefilled = true;
    };
    hreq.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      first_byte();
      if (streaming) {
        ex->Write(std::string(data, n));
        tail.append(data, n);
        if (tail.size() > (64u << 10)) tail.erase(0, tail.size() - (32u << 10));
      } else {
        body.append(data, n);
      }
      return !gone.load();
    };
    ++b.in_flight;
    b.pending_prefill += miss;
    httplib::Response hres;
    httplib::Error err = httplib::Error::Success;
    const bool ok = cli.send(hreq, hres, err);
    first_byte();
    --b.in_flight;
    if (streaming) {
      ex->End();  // whole, or cut by a backend that died mid-stream (or a client gone)
      if (!ok) {
        ++b.failures;
        return Outcome::kCut;
      }
      last_cached_ = StreamCachedTokens(tail);
      return Outcome::kDone;
    }
    if (!ok) {
      ++b.failures;
      b.up = false;  // until its /health answers
      return gone.load() ? Outcome::kCut : Outcome::kRetry;
    }
    if (status == 429 || status == 503) {
      ++b.failures;
      return Outcome::kRetry;
    }
    if (body.empty()) body = hres.body;
    HttpResponse r;
    r.status = status;
    r.content_type = content_type.empty() ? "application/json" : content_type;
    if (std::string ra = hres.get_header_value("Retry-After"); !ra.empty()) r.headers.emplace_back("Retry-After", ra);
    if (status == 200) last_cached_ = CachedTokens(json::parse(body, nullptr, false));
    r.body = std::move(body);
    ex->Respond(std::move(r));
    return Outcome::kDone;
  }

  void RecordDecision(int64_t predicted, std::optional<int64_t> reported) {
    std::lock_guard lock(stats_mu_);
    ++decisions_;
    predicted_tokens_ += predicted;
    if (!reported) return;
    ++reported_decisions_;
    reported_tokens_ += *reported;
    predicted_reported_ += predicted;
    abs_error_ += std::abs(predicted - *reported);
    exact_ += predicted == *reported ? 1 : 0;
  }

  // The KV events of every backend into the index.
  void Listen() {
    zmq::context_t ctx(1);
    std::vector<zmq::socket_t> subs;
    std::vector<int> of;  // backend of each socket
    for (size_t k = 0; k < backends_.size(); ++k) {
      if (backends_[k]->o.kv_events.empty()) continue;
      zmq::socket_t s(ctx, zmq::socket_type::sub);
      s.set(zmq::sockopt::subscribe, "");
      s.set(zmq::sockopt::linger, 0);
      try {
        s.connect(backends_[k]->o.kv_events);
      } catch (const zmq::error_t&) {
        continue;  // a bad address: no prediction for this backend (its flags were checked at start)
      }
      subs.push_back(std::move(s));
      of.push_back(static_cast<int>(k));
    }
    std::vector<zmq::pollitem_t> items;
    for (zmq::socket_t& s : subs) items.push_back({s.handle(), 0, ZMQ_POLLIN, 0});
    while (!Stopping()) {
      if (items.empty()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      zmq::poll(items.data(), items.size(), std::chrono::milliseconds(100));
      for (size_t i = 0; i < items.size(); ++i) {
        if ((items[i].revents & ZMQ_POLLIN) == 0) continue;
        std::vector<zmq::message_t> parts;
        if (!zmq::recv_multipart(subs[i], std::back_inserter(parts), zmq::recv_flags::dontwait)) continue;
        Backend& b = *backends_[static_cast<size_t>(of[i])];
        if (parts.size() != 3 || parts[1].size() != 8) {
          ++b.bad_batches;
          continue;
        }
        uint64_t seq = 0;
        for (int j = 0; j < 8; ++j) seq = seq << 8 | static_cast<const uint8_t*>(parts[1].data())[j];
        Result<router::DecodedBatch> batch = router::DecodeKvEventBatch({static_cast<const char*>(parts[2].data()), parts[2].size()});
        if (!batch.ok()) {
          ++b.bad_batches;
          continue;
        }
        std::lock_guard lock(index_mu_);
        if (b.seen_seq && seq <= b.last_seq) {
          index_.Forget(of[i]);  // its sequence started again: a restarted backend with an empty pool
          ++b.restarts;
        } else if (b.seen_seq && seq != b.last_seq + 1) {
          b.gaps += static_cast<int64_t>(seq - b.last_seq - 1);
        }
        b.seen_seq = true;
        b.last_seq = seq;
        ++b.event_batches;
        index_.Apply(of[i], *batch);
      }
    }
  }

  // Every backend's /health and load (/metrics), every health_interval_ms.
  void Poll() {
    while (!Stopping()) {
      for (auto& bp : backends_) {
        Backend& b = *bp;
        httplib::Client cli(b.at.host, b.at.port);
        cli.set_connection_timeout(std::chrono::seconds(1));
        cli.set_read_timeout(std::chrono::seconds(2));
        const httplib::Result h = cli.Get("/health");
        b.up = h && h->status == 200;
        if (!b.up) continue;
        if (const httplib::Result m = cli.Get("/metrics"); m && m->status == 200) {
          b.waiting = static_cast<int64_t>(router::SeriesValue(m->body, "vllm:num_requests_waiting").value_or(0));
          b.running = static_cast<int64_t>(router::SeriesValue(m->body, "vllm:num_requests_running").value_or(0));
          const double usage = router::SeriesValue(m->body, "vllm:kv_cache_usage_perc").value_or(0);
          const auto label = [&](const char* l) {
            const std::optional<std::string> v = router::LabelValue(m->body, "vllm:cache_config_info", l);
            return v ? std::strtod(v->c_str(), nullptr) : 0.0;
          };
          const double tokens = usage * label("num_gpu_blocks") * label("block_size");
          b.kv_tokens = std::isfinite(tokens) && tokens > 0 ? static_cast<int64_t>(std::min(tokens, 1e15)) : 0;
        }
      }
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(o_.health_interval_ms), [&] { return stopping_; });
    }
  }

  bool Stopping() {
    std::lock_guard lock(mu_);
    return stopping_;
  }

  std::string MetricsPage() {
    server::MetricsText m;
    std::vector<std::pair<server::Labels, double>> up, sent, fails, in_flight, pending, kv, blocks, batches, gaps;
    router::KvIndexStats is;
    {
      std::lock_guard lock(index_mu_);
      is = index_.Stats();
      for (size_t k = 0; k < backends_.size(); ++k) {
        blocks.push_back({{{"backend", backends_[k]->o.url}}, static_cast<double>(index_.BackendBlocks(static_cast<int>(k)))});
      }
    }
    for (const auto& b : backends_) {
      const server::Labels l = {{"backend", b->o.url}};
      up.push_back({l, b->up ? 1.0 : 0.0});
      sent.push_back({l, static_cast<double>(b->requests.load())});
      fails.push_back({l, static_cast<double>(b->failures.load())});
      in_flight.push_back({l, static_cast<double>(b->in_flight.load())});
      pending.push_back({l, static_cast<double>(b->pending_prefill.load())});
      kv.push_back({l, static_cast<double>(b->kv_tokens.load())});
      batches.push_back({l, static_cast<double>(b->event_batches.load())});
      gaps.push_back({l, static_cast<double>(b->gaps.load())});
    }
    m.Add("pagekv_router_backend_up", "1 while the backend's /health answers", "gauge", up);
    m.Add("pagekv_router_backend_requests_total", "requests answered by the backend", "counter", sent);
    m.Add("pagekv_router_backend_failures_total", "attempts that failed on the backend (unreachable, 429, 503, cut)", "counter", fails);
    m.Add("pagekv_router_backend_in_flight", "requests the router has in flight on the backend", "gauge", in_flight);
    m.Add("pagekv_router_backend_pending_prefill_tokens", "prompt tokens the router's requests there have yet to prefill (predicted misses)",
          "gauge", pending);
    m.Add("pagekv_router_backend_kv_tokens", "KV tokens the backend's running requests hold (its /metrics, last polled)", "gauge", kv);
    m.Add("pagekv_router_index_blocks", "blocks the index holds for the backend", "gauge", blocks);
    m.Add("pagekv_router_event_batches_total", "KV event batches received from the backend", "counter", batches);
    m.Add("pagekv_router_event_gaps_total", "KV event batches missed (sequence gaps)", "counter", gaps);
    m.Counter("pagekv_router_requests_total", "requests received", {}, static_cast<double>(requests_.load()));
    m.Counter("pagekv_router_retries_total", "attempts on another backend after one failed", {}, static_cast<double>(retries_.load()));
    m.Counter("pagekv_router_unavailable_total", "requests no backend could take (503)", {}, static_cast<double>(no_backend_.load()));
    m.Counter("pagekv_router_unparsed_total", "requests routed without a prediction (a body the backend will refuse)", {},
              static_cast<double>(unparsed_.load()));
    m.Counter("pagekv_router_index_unknown_parent_total", "stored events whose chain start the router never saw", {},
              static_cast<double>(is.unknown_parent));
    std::lock_guard lock(stats_mu_);
    m.Counter("pagekv_router_decisions_total", "requests routed and answered", {}, static_cast<double>(decisions_));
    m.Counter("pagekv_router_predicted_hit_tokens_total", "prompt tokens the index predicted the chosen backend holds", {},
              static_cast<double>(predicted_tokens_));
    m.Counter("pagekv_router_reported_decisions_total", "answered decisions whose usage reported cached_tokens", {},
              static_cast<double>(reported_decisions_));
    m.Counter("pagekv_router_reported_hit_tokens_total", "usage.prompt_tokens_details.cached_tokens of those", {},
              static_cast<double>(reported_tokens_));
    m.Counter("pagekv_router_reported_predicted_hit_tokens_total", "the predicted hit tokens of those", {},
              static_cast<double>(predicted_reported_));
    m.Counter("pagekv_router_prediction_error_tokens_total", "sum of |predicted - reported| over those", {},
              static_cast<double>(abs_error_));
    m.Counter("pagekv_router_exact_predictions_total", "of those, predicted exactly", {}, static_cast<double>(exact_));
    return m.str();
  }

  static constexpr size_t kMaxQueued = 4096;
  const RouterOptions o_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::array<unsigned char, 32>> key_digests_;
  std::vector<std::string> key_salts_;
  std::unique_ptr<router::ModelText> text_;
  std::unique_ptr<server::HttpTransport> http_;
  std::mutex index_mu_;
  router::KvIndex index_;
  std::atomic<uint64_t> rr_{0};
  std::atomic<int64_t> requests_{0}, retries_{0}, no_backend_{0}, unparsed_{0};
  std::mutex stats_mu_;
  int64_t decisions_ = 0, predicted_tokens_ = 0, reported_decisions_ = 0, reported_tokens_ = 0, predicted_reported_ = 0,
          abs_error_ = 0, exact_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> workers_;
  std::thread listener_, health_;
};

}  // namespace

const char* RoutePolicyName(RoutePolicy p) {
  switch (p) {
    case RoutePolicy::kKvAware: return "kv";
    case RoutePolicy::kRoundRobin: return "round-robin";
    case RoutePolicy::kLeastLoaded: return "least-loaded";
  }
  return "kv";
}

Result<RoutePolicy> ParseRoutePolicy(const std::string& name) {
  if (name == "kv") return RoutePolicy::kKvAware;
  if (name == "round-robin") return RoutePolicy::kRoundRobin;
  if (name == "least-loaded") return RoutePolicy::kLeastLoaded;
  return InvalidArgumentError("route policy '" + name + "': use kv, round-robin or least-loaded");
}

Status RunRouter(const RouterOptions& options, const std::atomic<bool>& stop) {
  Router r(options);
  if (Status s = r.Start(); !s.ok()) {
    r.Stop();
    return s;
  }
  while (!stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  r.Stop();
  return Status::Ok();
}

}  // namespace pagekv
