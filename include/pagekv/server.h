// `pagekv serve`: an OpenAI-compatible HTTP server over the engine.
//
//   POST /v1/completions        prompt -> text (stream: server-sent events)
//   POST /v1/chat/completions   messages -> assistant message (stream too)
//   GET  /v1/models             the one loaded model (and /v1/models/{id})
//   GET  /health                {"status":"ok"}; 503 while draining
//   GET  /metrics               Prometheus text: KV blocks, prefix hit rate,
//                               preemptions, queue, throughput, TTFT and
//                               inter-token latency histograms
//
// Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}
// with string codes (docs/OPENAI_API.md):
// 400 malformed JSON or a bad field (named), 401 a wrong or missing API key
// (when one is set), 404 an unknown model or endpoint, 405 a wrong method,
// 413 a body over max_body_bytes, 415 a compressed body, 431 a header past
// its limits, 429 a full queue (with Retry-After), 503 too many connections
// or a server shutting down. A client that disconnects before its answer
// ended, streaming or not, cancels its request; its blocks return to the
// pool.
//
// Chat messages become one prompt: each message's content on its own line,
// in order (stories-style models have no chat template). The cache salt is
// not taken from requests: with an API key set, every request shares one
// salt derived from it (the trust boundary of include/pagekv/prefix_cache.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pagekv/engine.h"
#include "pagekv/status.h"

namespace pagekv {

struct ServerOptions {
  EngineOptions engine;
  std::string host = "127.0.0.1";  // loopback unless asked otherwise
  int port = 8080;                 // 0 = any free port
  // Any of these in 'Authorization: Bearer KEY' admits a /v1/ request
  // (compared in constant time); empty = no authentication. Each key is its
  // own tenant: its requests' KV is salted with a secret derived from the
  // key, so keys never share cached prefixes.
  std::vector<std::string> api_keys;
  // usage.prompt_tokens_details.cached_tokens is reported only for requests
  // that bring their own "cache_salt" (their hits are then blocks under a
  // salt they supplied), so one client cannot confirm another's prefix by
  // it; others read 0. true: reported for every request (one tenant).
  bool report_cached_tokens_always = false;
  // What one client can hold (the transport refuses past these; see
  // docs/SECURITY.md): a body of max_body_bytes after de-chunking (413; a
  // compressed body is 415), a header of max_header_bytes and max_headers
  // fields (431), max_connections at once (503 past it), the header within
  // header_timeout_ms of its first byte, the body within body_timeout_ms, an
  // idle keep-alive connection kept idle_timeout_ms, a client that does not
  // read its answer write_timeout_ms per write. A slow client costs a
  // socket, never a thread: io_threads serve every connection.
  int64_t max_body_bytes = 1 << 20;
  int64_t max_header_bytes = 16 * 1024;
  int max_headers = 100;
  int max_connections = 512;
  int64_t header_timeout_ms = 10'000;
  int64_t body_timeout_ms = 30'000;
  int64_t idle_timeout_ms = 30'000;
  int64_t write_timeout_ms = 30'000;
  int io_threads = 2;
  // Threads that parse and tokenize generation requests (never waiting on a
  // client: the body is in before one is used).
  int workers = 2;
  std::string model_name;          // default: the model file's name
  // Called once the socket is bound, with the port (before serving).
  std::function<void(int port)> on_listening;
};

// Serves until `stop` becomes true (checked every 100 ms; a SIGINT/SIGTERM
// handler may set it). Then stops accepting, ends in-flight requests
// (streams get a final event), and returns Ok. Errors: the model, the pool,
// a port that cannot be bound.
//
// A model split over ranks (options.engine.parallel): every rank calls it
// with the same options. Rank 0 serves HTTP and leads its engine
// (EngineOptions::parallel_leader); the others serve nothing and step with
// it (Engine::Follow) until rank 0 stops; they ignore `stop`.
Status RunServer(const ServerOptions& options, const std::atomic<bool>& stop);

}  // namespace pagekv
