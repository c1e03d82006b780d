// What the server's files share (internal to src/server): the state of one
// running server, its answers, and its metrics.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio/thread_pool.hpp>
#include <nlohmann/json.hpp>

#include "pagekv/engine.h"
#include "server/http_transport.h"
#include "server/metrics.h"

namespace pagekv::server {

// Bucket bounds of the latency histograms (metrics_page.cc).
extern const std::vector<double> kTtftBuckets, kTokenGapBuckets, kRequestBuckets;

struct Shared {
  Engine* engine = nullptr;
  std::string model;
  std::vector<std::array<unsigned char, 32>> key_digests;  // SHA-256 of each API key
  std::vector<std::string> key_salts;                      // each key's cache salt
  bool report_cached_always = false;
  // The series of /metrics (docs/OPENAI_API.md lists them).
  Labels model_label;  // {model_name: the served name}
  Labels cache_config;  // vllm:cache_config_info's labels
  Histogram ttft{kTtftBuckets}, itl{kTokenGapBuckets}, tpot{kTokenGapBuckets};
  Histogram e2e{kRequestBuckets}, queue{kRequestBuckets}, prefill{kRequestBuckets}, decode{kRequestBuckets},
      inference{kRequestBuckets};
  std::unique_ptr<Histogram> prompt_len, generation_len;  // buckets up to the context
  CounterSet finished;   // by finished_reason
  CounterSet responses;  // by route and status
  std::mutex mu;
  std::set<RequestId> in_flight;
  std::atomic<bool> draining{false};
  std::atomic<bool> ready{false};  // the engine created and every field set
  int64_t requests_total = 0;
  const HttpTransport* transport = nullptr;
  int64_t created = 0;  // the server's start, as the models' "created"
  int32_t max_running = 0;  // /props' total_slots
  boost::asio::thread_pool* workers = nullptr;
};

// OpenAI's error object for `status` (the code: `code`, or the status's).
std::string ErrorJson(int status, const std::string& message, const std::string& param = {}, std::string code = {});
// Which API key the request carries: its index, -1 for none or a wrong one.
int KeyIndex(const Shared& sh, const std::string& auth);
// JSON text, invalid UTF-8 replaced (an answer never throws).
std::string Dump(const nlohmann::json& j);
void Answer(Shared& sh, Exchange& ex, HttpResponse r);
void AnswerJson(Shared& sh, Exchange& ex, std::string body);
void AnswerError(Shared& sh, Exchange& ex, int status, const std::string& message, const std::string& param = {},
                 std::vector<std::pair<std::string, std::string>> headers = {}, std::string code = {});

// An exchange whose answers are counted by route and status.
class CountedExchange : public Exchange {
 public:
  CountedExchange(std::shared_ptr<Exchange> inner, std::string route, CounterSet* counts)
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
  CounterSet* counts_;
  std::atomic<bool> counted_{false};
};

// metrics_page.cc: the route label of a path, a finished request into the
// histograms and counters, the /metrics text.
std::string RouteLabel(const std::string& path);
std::vector<double> OneTwoFive(int64_t max);
void Observe(Shared& sh, const RequestResult& r);
std::string Metrics(Shared& sh);

// llama_api.cc: llama-server's /tokenize, /detokenize, /apply-template,
// /props and /slots; the chunk and end objects of its /completion.
bool IsLlamaRoute(const std::string& path);
void HandleLlama(Shared& sh, const HttpRequest& req, const std::shared_ptr<Exchange>& ex);
nlohmann::json LlamaChunk(const Shared& sh, const TokenUpdate& u, const std::string& text, int n_probs);
nlohmann::json LlamaProbs(const Shared& sh, const std::vector<TokenLogprob>& lps);
nlohmann::json LlamaEnd(const Shared& sh, const RequestResult& r, const std::string& content, int n_probs);

}  // namespace pagekv::server
