// The HTTP/1.1 transport of `pagekv serve`: Boost.Beast's parser on Asio,
// asynchronous end to end, so a connection costs a socket and a few
// kilobytes, never a thread. What a hostile client can hold is bounded:
//
//   - the header: at most max_header_bytes (request line included) and
//     max_headers fields, else 431; it must arrive within header_timeout of
//     its first byte;
//   - the body: at most max_body_bytes after de-chunking (a Content-Length
//     past it is refused before a byte is read, a chunked body as soon as it
//     passes), else 413; a Content-Encoding other than identity is 415 and
//     never inflated; the body must arrive within body_timeout;
//   - an idle keep-alive connection is closed after idle_timeout, a client
//     that does not read its answer after write_timeout per write;
//   - at most max_connections at once; past that a connection gets a 503
//     (Retry-After) and is closed.
//
// Handlers run on the I/O threads and must not block: the server answers
// cheap endpoints there and hands generation to its own workers. An answer
// is given through an Exchange from any thread (a whole response, or a
// chunked stream), and the Exchange reports a client that went away before
// its answer ended (its socket closed, reset, or a write timed out), so the
// server can cancel the decoding it was waiting for.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "pagekv/status.h"

namespace pagekv::server {

struct HttpLimits {
  int64_t max_body_bytes = 1 << 20;
  int64_t max_header_bytes = 16 * 1024;
  int max_headers = 100;
  int max_connections = 512;
  std::chrono::milliseconds header_timeout{10'000};
  std::chrono::milliseconds body_timeout{30'000};
  std::chrono::milliseconds idle_timeout{30'000};
  std::chrono::milliseconds write_timeout{30'000};
};

// Why a limit is bad, or empty when every one is usable.
std::string CheckLimits(const HttpLimits& limits);

struct HttpRequest {
  std::string method;  // as sent: "GET", "POST"
  std::string path;    // the target up to '?'
  std::string query;   // after '?', without it
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-case, in order
  std::string body;
  // The first value of a header (name in lower case); "" when absent.
  std::string Header(std::string_view lower_name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  // extra ones (CR and LF are dropped from values)
  std::string body;
  bool close = false;  // end the connection after it
};

// One request's answer. Thread-safe; every call after the answer ended, or
// after the client went away, does nothing.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual void Respond(HttpResponse response) = 0;
  // A chunked answer: the status line and headers, then chunks, then End.
  virtual void BeginStream(int status, std::string content_type) = 0;
  virtual void Write(std::string chunk) = 0;
  virtual void End() = 0;
  // `f` runs once (on an I/O thread, or at once when it already happened)
  // if the client goes away before the answer ended.
  virtual void OnClientGone(std::function<void()> f) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<Exchange>)>;
// The body of an error the transport answers itself (431, 413, 415, 400,
// 503), for `status` and a message naming the problem.
using ErrorBody = std::function<std::string(int status, const std::string& message)>;

struct TransportStats {
  int64_t connections_now = 0;
  int64_t connections_total = 0;
  int64_t refused_total = 0;   // over max_connections: answered 503
  int64_t timeouts_total = 0;  // closed by a header, body, idle or write deadline
  int64_t rejected_total = 0;  // answered 4xx by the transport (431, 413, 415, 400)
  int64_t client_gone_total = 0;  // went away before their answer ended
};

class HttpTransport {
 public:
  // Binds host:port (0: any free port) and listens. Errors: bad limits, an
  // address that is not here, a port in use.
  static Result<std::unique_ptr<HttpTransport>> Listen(const std::string& host, int port, const HttpLimits& limits,
                                                       HttpHandler handler, ErrorBody error_body, int io_threads);
  virtual ~HttpTransport() = default;
  virtual int port() const = 0;
  virtual TransportStats Stats() const = 0;
  // Stops accepting, closes every connection (their exchanges report the
  // client gone) and joins the I/O threads. Called by the destructor too.
  virtual void Stop() = 0;
};

// Parses `bytes` as one request under `limits`, as the transport would
// (the same parser and checks, but in memory, without deadlines): the
// request, or the status and message the transport would answer. The fuzz
// target's entry point.
struct HttpRefusal {
  int status = 400;
  std::string message;
};
std::variant<HttpRequest, HttpRefusal> ParseHttpRequest(std::string_view bytes, const HttpLimits& limits);

}  // namespace pagekv::server
