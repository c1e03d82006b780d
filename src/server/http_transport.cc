// HttpTransport (http_transport.h) on Boost.Beast and Asio. One strand per
// connection; every handler below runs on its connection's strand, so a
// connection's state needs no lock. Exchanges (called from the server's
// workers and the engine's thread) post onto that strand.
#include "server/http_transport.h"

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace pagekv::server {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Parser = http::request_parser<http::string_body>;

constexpr std::chrono::seconds kLingerTime{2};  // reading what a refused client still sends, before closing
constexpr size_t kLingerBytes = 1 << 20;
constexpr int kMaxRefusing = 64;  // 503 answers being written at once; past that, closed unanswered

bool EqualsNoCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

void ConfigureParser(Parser& p, const HttpLimits& l) {
  p.header_limit(static_cast<std::uint32_t>(l.max_header_bytes));
  p.body_limit(static_cast<std::uint64_t>(l.max_body_bytes));
}

std::string BodyTooLarge(const HttpLimits& l) {
  return "the body is larger than --max-body-bytes (" + std::to_string(l.max_body_bytes) + ")";
}

// The first coding in a comma-separated list that is not `allowed`.
std::optional<std::string_view> CodingOtherThan(std::string_view list, std::string_view allowed) {
  while (!list.empty()) {
    const size_t comma = list.find(',');
    const std::string_view coding = Trim(list.substr(0, comma));
    if (!coding.empty() && !EqualsNoCase(coding, allowed)) return coding;
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
  }
  return std::nullopt;
}

// The checks made once the header is in, before any body byte is read.
std::optional<HttpRefusal> CheckHeader(const Parser& p, const HttpLimits& l) {
  const auto& m = p.get();
  if (m.version() != 10 && m.version() != 11) {
    return HttpRefusal{505, "HTTP version " + std::to_string(m.version() / 10) + "." + std::to_string(m.version() % 10) +
                                " is not supported: send HTTP/1.1"};
  }
  int count = 0;
  for (const auto& f : m) {
    ++count;
    const std::string_view v(f.value().data(), f.value().size());
    if (f.name() == http::field::content_encoding) {
      // A compressed body is refused, never inflated (a few KB of gzip
      // inflate to gigabytes).
      if (const std::optional<std::string_view> c = CodingOtherThan(v, "identity")) {
        return HttpRefusal{415, "Content-Encoding '" + std::string(*c) + "' is not accepted: send the body uncompressed"};
      }
    }
    if (f.name() == http::field::transfer_encoding) {
      if (const std::optional<std::string_view> c = CodingOtherThan(v, "chunked")) {
        return HttpRefusal{501, "Transfer-Encoding '" + std::string(*c) + "' is not supported: send chunked or a Content-Length"};
      }
    }
  }
  if (m.count(http::field::content_length) > 0 && m.count(http::field::transfer_encoding) > 0) {
    // Two framings: a proxy in front may read the other one (smuggling).
    return HttpRefusal{400, "the request has both Content-Length and Transfer-Encoding: send one"};
  }
  if (count > l.max_headers) {
    return HttpRefusal{431, "the request has " + std::to_string(count) + " header fields; at most " +
                                std::to_string(l.max_headers) + " are accepted"};
  }
  if (p.content_length() && *p.content_length() > static_cast<std::uint64_t>(l.max_body_bytes)) {
    return HttpRefusal{413, BodyTooLarge(l)};
  }
  return std::nullopt;
}

// After a chunked body: its trailer fields joined the header's, and count
// against the same limit.
std::optional<HttpRefusal> CheckTrailers(const Parser& p, const HttpLimits& l) {
  const http::request<http::string_body>& m = p.get();
  const auto count = static_cast<int>(std::distance(m.begin(), m.end()));
  if (count > l.max_headers) {
    return HttpRefusal{431, "the request has " + std::to_string(count) + " header and trailer fields; at most " +
                                std::to_string(l.max_headers) + " are accepted"};
  }
  return std::nullopt;
}

HttpRefusal RefusalFor(const beast::error_code& ec, const HttpLimits& l) {
  if (ec == http::error::header_limit) {
    return {431, "the request header is larger than " + std::to_string(l.max_header_bytes) + " bytes"};
  }
  if (ec == http::error::body_limit) return {413, BodyTooLarge(l)};
  if (ec == http::error::partial_message) return {400, "the request was cut short"};
  return {400, "malformed HTTP request: " + ec.message()};
}

HttpRequest ToRequest(Parser& p) {
  http::request<http::string_body> m = p.release();
  HttpRequest r;
  r.method = std::string(m.method_string());
  const std::string_view target(m.target().data(), m.target().size());
  const size_t q = target.find('?');
  r.path = std::string(target.substr(0, q));
  if (q != std::string_view::npos) r.query = std::string(target.substr(q + 1));
  for (const auto& f : m) {
    std::string name(f.name_string());
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    r.headers.emplace_back(std::move(name), std::string(f.value()));
  }
  r.body = std::move(m.body());
  return r;
}

std::string CleanValue(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c != '\r' && c != '\n') out += c;
  }
  return out;
}

// The status line and headers. length: nullopt for a chunked answer (or,
// to an HTTP/1.0 client, one that ends when the connection closes).
std::string Head(int status, std::string_view content_type, const std::vector<std::pair<std::string, std::string>>& headers,
                 std::optional<size_t> length, bool chunked, bool close, bool http10) {
  std::string h = http10 ? "HTTP/1.0 " : "HTTP/1.1 ";
  h += std::to_string(status);
  h += ' ';
  h += std::string(http::obsolete_reason(http::int_to_status(static_cast<unsigned>(status))));
  h += "\r\nServer: pagekv\r\nContent-Type: ";
  h += CleanValue(content_type);
  h += "\r\n";
  for (const auto& [name, value] : headers) {
    h += CleanValue(name);
    h += ": ";
    h += CleanValue(value);
    h += "\r\n";
  }
  if (length) {
    h += "Content-Length: ";
    h += std::to_string(*length);
    h += "\r\n";
  } else if (chunked) {
    h += "Transfer-Encoding: chunked\r\n";
  }
  h += close ? "Connection: close\r\n" : (http10 ? "Connection: keep-alive\r\n" : "");
  h += "\r\n";
  return h;
}

class Impl;
class Connection;

class ExchangeImpl final : public Exchange, public std::enable_shared_from_this<ExchangeImpl> {
 public:
  explicit ExchangeImpl(std::weak_ptr<Connection> c) : conn_(std::move(c)) {}
  void Respond(HttpResponse response) override;
  void BeginStream(int status, std::string content_type) override;
  void Write(std::string chunk) override;
  void End() override;
  void OnClientGone(std::function<void()> f) override {
    std::unique_lock lock(mu_);
    if (gone_) {
      lock.unlock();
      f();
      return;
    }
    if (!ended_) on_gone_ = std::move(f);
  }
  // Connection strand: the answer is all queued, or the client is gone.
  void MarkEnded() {
    std::lock_guard lock(mu_);
    ended_ = true;
    on_gone_ = nullptr;
  }
  bool Gone() {
    std::function<void()> f;
    {
      std::lock_guard lock(mu_);
      if (gone_ || ended_) return false;
      gone_ = true;
      f = std::move(on_gone_);
    }
    if (f) f();
    return true;
  }

  // Connection strand only.
  bool began = false, ended = false;

 private:
  template <class F>
  void Post(F f);
  std::weak_ptr<Connection> conn_;
  std::mutex mu_;
  bool gone_ = false, ended_ = false;
  std::function<void()> on_gone_;
};

class Impl final : public HttpTransport {
 public:
  Impl(const HttpLimits& limits, HttpHandler handler, ErrorBody error_body)
      : limits_(limits), handler_(std::move(handler)), error_body_(std::move(error_body)) {}
  ~Impl() override { Stop(); }

  Status Open(const std::string& host, int port, int io_threads);
  int port() const override { return port_; }
  TransportStats Stats() const override {
    TransportStats s;
    s.connections_now = connections_now_.load();
    s.connections_total = connections_total_.load();
    s.refused_total = refused_total_.load();
    s.timeouts_total = timeouts_total_.load();
    s.rejected_total = rejected_total_.load();
    s.client_gone_total = client_gone_total_.load();
    return s;
  }
  void Stop() override;

  const HttpLimits& limits() const { return limits_; }
  const HttpHandler& handler() const { return handler_; }
  std::string ErrorText(int status, const std::string& message) const { return error_body_(status, message); }
  void Register(uint64_t id, std::weak_ptr<Connection> c) {
    std::lock_guard lock(reg_mu_);
    connections_[id] = std::move(c);
  }
  void Unregister(uint64_t id) {
    std::lock_guard lock(reg_mu_);
    connections_.erase(id);
    --connections_now_;
  }

  std::atomic<int64_t> connections_now_{0}, connections_total_{0}, refused_total_{0}, timeouts_total_{0},
      rejected_total_{0}, client_gone_total_{0};
  std::atomic<int> refusing_{0};

 private:
  void Accept();
  void Refuse(tcp::socket socket);

  const HttpLimits limits_;
  const HttpHandler handler_;
  const ErrorBody error_body_;
  int port_ = 0;
  // Declared before the I/O context: connections still owned by its
  // handlers unregister themselves as it is destroyed.
  std::mutex reg_mu_;
  std::map<uint64_t, std::weak_ptr<Connection>> connections_;
  uint64_t next_id_ = 1;
  net::io_context ioc_;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work_;
  tcp::acceptor acceptor_{net::make_strand(ioc_)};
  net::steady_timer retry_{acceptor_.get_executor()};
  std::vector<std::thread> threads_;
  std::atomic<bool> stopped_{false};
};

class Connection final : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Impl& t, tcp::socket socket, uint64_t id)
      : t_(t),
        stream_(std::move(socket)),
        id_(id),
        buffer_(static_cast<size_t>(std::max<int64_t>(int64_t{1} << 20, 2 * t.limits().max_header_bytes))) {}
  ~Connection() { t_.Unregister(id_); }

  auto executor() { return stream_.get_executor(); }

  void Start() { ReadRequest(/*first=*/true); }

  // Strand: closes at once (the transport stopping).
  void Close() {
    ClientGone();
    Shut();
  }

  // Strand: the exchange calls.
  void Respond(ExchangeImpl* ex, HttpResponse r) {
    if (ex != current_.get() || ex->ended || ex->began || closed_) return;
    const bool close = r.close || !keep_alive_;
    out_ += Head(r.status, r.content_type, r.headers, r.body.size(), false, close, http10_);
    if (!head_) out_ += r.body;  // an answer to HEAD: the headers of the same GET, no body
    EndAnswer(close);
  }
  void BeginStream(ExchangeImpl* ex, int status, const std::string& content_type) {
    if (ex != current_.get() || ex->ended || ex->began || closed_) return;
    ex->began = true;
    // An HTTP/1.0 client has no chunked coding: the stream ends with the
    // connection.
    out_ += Head(status, content_type, {{"Cache-Control", "no-cache"}}, std::nullopt, !http10_, http10_ || !keep_alive_, http10_);
    WriteNext();
  }
  void Write(ExchangeImpl* ex, const std::string& chunk) {
    if (ex != current_.get() || ex->ended || !ex->began || closed_ || chunk.empty()) return;
    if (http10_) {
      out_ += chunk;
    } else {
      char size[24];
      std::snprintf(size, sizeof size, "%zx\r\n", chunk.size());
      out_ += size;
      out_ += chunk;
      out_ += "\r\n";
    }
    WriteNext();
  }
  void End(ExchangeImpl* ex) {
    if (ex != current_.get() || ex->ended || !ex->began || closed_) return;
    if (!http10_) out_ += "0\r\n\r\n";
    EndAnswer(http10_ || !keep_alive_);
  }

 private:
  void EndAnswer(bool close) {
    current_->ended = true;
    current_->MarkEnded();
    close_after_ = close;
    answer_queued_ = true;
    WriteNext();
  }

  // Waits for a request. The first on a connection has header_timeout from
  // the accept; a keep-alive connection waits idle_timeout for a first byte,
  // then header_timeout for the rest of the header.
  void ReadRequest(bool first) {
    current_.reset();
    answer_queued_ = false;
    close_after_ = false;
    parser_.emplace();
    ConfigureParser(*parser_, t_.limits());
    if (first || buffer_.size() > 0) return ReadHeader();
    stream_.expires_after(t_.limits().idle_timeout);
    stream_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](beast::error_code ec, size_t n) {
      if (ec) {
        if (ec == beast::error::timeout) ++self->t_.timeouts_total_;
        return self->Shut();
      }
      self->buffer_.commit(n);
      self->ReadHeader();
    });
  }

  void ReadHeader() {
    stream_.expires_after(t_.limits().header_timeout);
    http::async_read_header(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
      self->OnHeader(ec);
    });
  }

  void OnHeader(beast::error_code ec) {
    if (ec) {
      if (ec == beast::error::timeout) {
        ++t_.timeouts_total_;
        return Shut();
      }
      if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset) return Shut();
      return Refuse(RefusalFor(ec, t_.limits()));
    }
    if (std::optional<HttpRefusal> r = CheckHeader(*parser_, t_.limits())) return Refuse(*r);
    http10_ = parser_->get().version() == 10;
    head_ = parser_->get().method() == http::verb::head;
    keep_alive_ = parser_->get().keep_alive();
    const auto expect = parser_->get()[http::field::expect];
    if (!parser_->is_done() && EqualsNoCase(Trim(std::string_view(expect.data(), expect.size())), "100-continue") && !http10_) {
      static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
      stream_.expires_after(t_.limits().write_timeout);
      net::async_write(stream_, net::buffer(kContinue, sizeof(kContinue) - 1),
                       [self = shared_from_this()](beast::error_code wec, size_t) {
                         if (wec) return self->Shut();
                         self->ReadBody();
                       });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    if (parser_->is_done()) return Dispatch();
    stream_.expires_after(t_.limits().body_timeout);
    http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) {
        if (ec == beast::error::timeout) {
          ++self->t_.timeouts_total_;
          return self->Shut();
        }
        return self->Refuse(RefusalFor(ec, self->t_.limits()));
      }
      if (std::optional<HttpRefusal> r = CheckTrailers(*self->parser_, self->t_.limits())) return self->Refuse(*r);
      self->Dispatch();
    });
  }

  void Dispatch() {
    stream_.expires_never();
    current_ = std::make_shared<ExchangeImpl>(weak_from_this());
    HttpRequest req = ToRequest(*parser_);
    parser_.reset();
    Watch();
    std::shared_ptr<ExchangeImpl> ex = current_;
    try {
      t_.handler()(std::move(req), ex);
    } catch (...) {  // never the exception's text to the client
      ex->Respond({500, "application/json", {}, t_.ErrorText(500, "internal error while handling the request"), true});
    }
  }

  // An answer the transport gives itself; the connection closes after it
  // (the rest of what the client sends is never parsed).
  void Refuse(const HttpRefusal& r) {
    ++t_.rejected_total_;
    current_ = std::make_shared<ExchangeImpl>(weak_from_this());
    keep_alive_ = false;
    head_ = false;
    HttpResponse res{r.status, "application/json", {}, t_.ErrorText(r.status, r.message), true};
    Respond(current_.get(), std::move(res));
  }

  // Waits for the socket to become readable while an answer is pending: a
  // read of 0 bytes (peeked, nothing consumed) is the client gone. Bytes
  // mean a pipelined next request; the watch ends there (a reset still
  // shows as a failed write).
  void Watch() {
    const uint64_t gen = ++watch_gen_;
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), gen](beast::error_code ec) {
      if (ec || gen != self->watch_gen_ || self->closed_) return;
      char c;
      const ssize_t n = ::recv(self->stream_.socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n > 0) return;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return self->Watch();
      self->ClientGone();
      self->Shut();
    });
  }

  void WriteNext() {
    if (writing_ || closed_) return;
    if (out_.empty()) {
      if (answer_queued_) AnswerWritten();
      return;
    }
    writing_ = true;
    sending_.swap(out_);
    out_.clear();
    stream_.expires_after(t_.limits().write_timeout);
    net::async_write(stream_, net::buffer(sending_), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->writing_ = false;
      self->sending_.clear();
      if (ec) {
        if (ec == beast::error::timeout) ++self->t_.timeouts_total_;
        self->ClientGone();
        return self->Shut();
      }
      self->stream_.expires_never();
      self->WriteNext();
    });
  }

  void AnswerWritten() {
    ++watch_gen_;
    beast::error_code ec;
    stream_.socket().cancel(ec);  // the watch
    if (close_after_) return Linger();
    ReadRequest(/*first=*/false);
  }

  // Half-closes, then reads and drops what the client still sends for a
  // moment: closing with unread input would reset the connection and could
  // destroy the answer before the client read it.
  void Linger() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return Shut();
    stream_.expires_after(kLingerTime);
    DrainSome();
  }
  void DrainSome() {
    stream_.async_read_some(net::buffer(drain_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->drained_ += n;
      if (ec || self->drained_ > kLingerBytes) return self->Shut();
      self->DrainSome();
    });
  }

  void ClientGone() {
    if (current_ && !current_->ended && current_->Gone()) ++t_.client_gone_total_;
    if (current_) current_->ended = true;
  }

  void Shut() {
    if (closed_) return;
    closed_ = true;
    ClientGone();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

  Impl& t_;
  beast::tcp_stream stream_;
  const uint64_t id_;
  beast::flat_buffer buffer_;  // bounded: a header, or one read of the body
  std::optional<Parser> parser_;
  std::shared_ptr<ExchangeImpl> current_;
  bool keep_alive_ = false, http10_ = false, head_ = false;
  bool writing_ = false, answer_queued_ = false, close_after_ = false, closed_ = false;
  std::string out_, sending_;
  uint64_t watch_gen_ = 0;
  std::array<char, 16384> drain_{};
  size_t drained_ = 0;
};

template <class F>
void ExchangeImpl::Post(F f) {
  if (std::shared_ptr<Connection> c = conn_.lock()) {
    net::post(c->executor(), [c, self = shared_from_this(), f = std::move(f)]() mutable { f(*c, self.get()); });
  }
}
void ExchangeImpl::Respond(HttpResponse response) {
  Post([r = std::move(response)](Connection& c, ExchangeImpl* self) mutable { c.Respond(self, std::move(r)); });
}
void ExchangeImpl::BeginStream(int status, std::string content_type) {
  Post([status, ct = std::move(content_type)](Connection& c, ExchangeImpl* self) { c.BeginStream(self, status, ct); });
}
void ExchangeImpl::Write(std::string chunk) {
  Post([d = std::move(chunk)](Connection& c, ExchangeImpl* self) { c.Write(self, d); });
}
void ExchangeImpl::End() {
  Post([](Connection& c, ExchangeImpl* self) { c.End(self); });
}

// A connection past max_connections: a 503 written with a short deadline,
// then closed.
class Refuser final : public std::enable_shared_from_this<Refuser> {
 public:
  Refuser(Impl& t, tcp::socket s, std::string answer) : t_(t), stream_(std::move(s)), answer_(std::move(answer)) {
    ++t_.refusing_;
  }
  ~Refuser() { --t_.refusing_; }
  void Start() {
    stream_.expires_after(std::chrono::seconds(1));
    net::async_write(stream_, net::buffer(answer_), [self = shared_from_this()](beast::error_code, size_t) {
      beast::error_code ec;
      self->stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
      self->stream_.async_read_some(net::buffer(self->drain_), [self](beast::error_code, size_t) { self->stream_.close(); });
    });
  }

 private:
  Impl& t_;
  beast::tcp_stream stream_;
  std::string answer_;
  std::array<char, 4096> drain_{};
};

Status Impl::Open(const std::string& host, int port, int io_threads) {
  const std::string where = host + ":" + std::to_string(port);
  beast::error_code ec;
  tcp::resolver resolver(ioc_);
  const auto results = resolver.resolve(host, std::to_string(port), tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || results.empty()) return IoError("cannot listen on " + where + ": the address does not resolve (" + ec.message() + ")");
  const tcp::endpoint ep = results.begin()->endpoint();
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return IoError("cannot listen on " + where + " (" + ec.message() + ": in use, or not an address here)");
  port_ = acceptor_.local_endpoint().port();
  work_.emplace(net::make_work_guard(ioc_));
  Accept();
  for (int i = 0; i < io_threads; ++i) threads_.emplace_back([this] { ioc_.run(); });
  return Status::Ok();
}

void Impl::Accept() {
  acceptor_.async_accept(net::make_strand(ioc_), [this](beast::error_code ec, tcp::socket socket) {
    if (stopped_.load() || !acceptor_.is_open()) return;
    if (ec) {
      // Out of descriptors, most often: try again shortly, not in a spin.
      retry_.expires_after(std::chrono::milliseconds(50));
      retry_.async_wait([this](beast::error_code) {
        if (!stopped_.load()) Accept();
      });
      return;
    }
    ++connections_total_;
    if (connections_now_.load() >= limits_.max_connections) {
      Refuse(std::move(socket));
    } else {
      ++connections_now_;
      const uint64_t id = next_id_++;
      auto c = std::make_shared<Connection>(*this, std::move(socket), id);
      Register(id, c);
      c->Start();
    }
    Accept();
  });
}

void Impl::Refuse(tcp::socket socket) {
  ++refused_total_;
  if (refusing_.load() >= kMaxRefusing) {
    beast::error_code ec;
    socket.close(ec);
    return;
  }
  const std::string body =
      ErrorText(503, "too many connections (" + std::to_string(limits_.max_connections) + "): try again shortly");
  std::string answer = Head(503, "application/json", {{"Retry-After", "1"}}, body.size(), false, true, false) + body;
  std::make_shared<Refuser>(*this, std::move(socket), std::move(answer))->Start();
}

void Impl::Stop() {
  if (stopped_.exchange(true)) return;
  if (threads_.empty()) return;
  net::post(acceptor_.get_executor(), [this] {
    beast::error_code ec;
    acceptor_.close(ec);
    retry_.cancel();
  });
  std::vector<std::shared_ptr<Connection>> live;
  {
    std::lock_guard lock(reg_mu_);
    for (auto& [id, w] : connections_) {
      if (auto c = w.lock()) live.push_back(std::move(c));
    }
  }
  for (auto& c : live) net::post(c->executor(), [c] { c->Close(); });
  live.clear();
  work_.reset();
  // The closed connections' handlers finish; give them a moment, then stop.
  for (int i = 0; i < 100 && connections_now_.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ioc_.stop();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

}  // namespace

std::string HttpRequest::Header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return value;
  }
  return {};
}

std::string CheckLimits(const HttpLimits& l) {
  if (l.max_body_bytes < 1) return "the body limit must be at least 1 byte";
  if (l.max_header_bytes < 1024 || l.max_header_bytes > (int64_t{1} << 30)) return "the header limit must be 1 KiB to 1 GiB";
  if (l.max_headers < 1) return "the header count limit must be at least 1";
  if (l.max_connections < 1) return "the connection limit must be at least 1";
  for (auto t : {l.header_timeout, l.body_timeout, l.idle_timeout, l.write_timeout}) {
    if (t.count() < 1) return "every timeout must be at least 1 ms";
  }
  return {};
}

Result<std::unique_ptr<HttpTransport>> HttpTransport::Listen(const std::string& host, int port, const HttpLimits& limits,
                                                             HttpHandler handler, ErrorBody error_body, int io_threads) {
  if (const std::string why = CheckLimits(limits); !why.empty()) return InvalidArgumentError("server: " + why);
  if (port < 0 || port > 65535) return InvalidArgumentError("server: port " + std::to_string(port) + " is not 0-65535");
  if (io_threads < 1) return InvalidArgumentError("server: at least one I/O thread is needed");
  auto t = std::make_unique<Impl>(limits, std::move(handler), std::move(error_body));
  PAGEKV_RETURN_IF_ERROR(t->Open(host, port, io_threads));
  return std::unique_ptr<HttpTransport>(std::move(t));
}

std::variant<HttpRequest, HttpRefusal> ParseHttpRequest(std::string_view bytes, const HttpLimits& limits) {
  if (bytes.empty()) return HttpRefusal{400, "the request is empty"};
  Parser p;
  ConfigureParser(p, limits);
  bool checked = false;
  beast::error_code ec;
  while (!p.is_done()) {
    size_t n = 0;
    if (!bytes.empty()) {
      n = p.put(net::buffer(bytes.data(), bytes.size()), ec);
      bytes.remove_prefix(n);
      if (ec == http::error::need_more) ec = {};
      if (ec) return RefusalFor(ec, limits);
    }
    if (p.is_header_done() && !checked) {
      checked = true;
      if (std::optional<HttpRefusal> r = CheckHeader(p, limits)) return *r;
    }
    if (n == 0 && !p.is_done()) {  // no progress: what is here is not enough (the client would wait, then close)
      p.put_eof(ec);
      if (ec) return RefusalFor(ec, limits);
      break;
    }
  }
  if (!p.is_done()) return HttpRefusal{400, "the request was cut short"};
  if (std::optional<HttpRefusal> r = CheckTrailers(p, limits)) return *r;
  return ToRequest(p);
}

}  // namespace pagekv::server
