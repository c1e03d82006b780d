// The HTTP transport on its own: ParseHttpRequest's limits and checks (the
// same ones the sockets go through), then a real transport on a loopback
// port with test handlers, driven by raw sockets: keep-alive and pipelining,
// HTTP/1.0, 100-continue, a handler's exception, a client that goes away
// while its answer is pending or while it is streamed, a client that stops
// reading, the header / body / idle deadlines, and the connection cap.
#include "server/http_transport.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include "testing/loopback_client.h"

namespace pagekv::server {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

HttpRefusal Refused(std::string_view bytes, const HttpLimits& l = {}) {
  auto r = ParseHttpRequest(bytes, l);
  if (std::holds_alternative<HttpRequest>(r)) {
    ADD_FAILURE() << "accepted: " << bytes.substr(0, 80);
    return {};
  }
  return std::get<HttpRefusal>(r);
}

HttpRequest Accepted(std::string_view bytes, const HttpLimits& l = {}) {
  auto r = ParseHttpRequest(bytes, l);
  if (std::holds_alternative<HttpRefusal>(r)) {
    ADD_FAILURE() << "refused " << std::get<HttpRefusal>(r).status << " " << std::get<HttpRefusal>(r).message;
    return {};
  }
  return std::get<HttpRequest>(r);
}

TEST(ParseHttpRequestTest, AcceptsRequestsAndDecodesChunkedBodies) {
  HttpRequest r = Accepted("GET /v1/models?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer k\r\n\r\n");
  EXPECT_EQ(r.method, "GET");
  EXPECT_EQ(r.path, "/v1/models");
  EXPECT_EQ(r.query, "x=1");
  EXPECT_EQ(r.Header("authorization"), "Bearer k");
  EXPECT_EQ(r.Header("missing"), "");
  r = Accepted("POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n");
  EXPECT_EQ(r.body, "abcde");
  r = Accepted("POST /x HTTP/1.1\r\nContent-Length: 4\r\nContent-Encoding: identity\r\n\r\nabcd");
  EXPECT_EQ(r.body, "abcd");
}

TEST(ParseHttpRequestTest, HeaderLimitsAre431) {
  HttpLimits l;
  l.max_headers = 10;
  std::string many = "GET / HTTP/1.1\r\n";
  for (int i = 0; i < 11; ++i) many += "X-" + std::to_string(i) + ": v\r\n";
  HttpRefusal r = Refused(many + "\r\n", l);
  EXPECT_EQ(r.status, 431);
  EXPECT_NE(r.message.find("11 header fields"), std::string::npos) << r.message;
  l.max_headers = 100;
  l.max_header_bytes = 2048;
  r = Refused("GET / HTTP/1.1\r\nX: " + std::string(3000, 'a') + "\r\n\r\n", l);
  EXPECT_EQ(r.status, 431);
  EXPECT_NE(r.message.find("2048 bytes"), std::string::npos) << r.message;
  // A long request line counts too.
  EXPECT_EQ(Refused("GET /" + std::string(3000, 'a') + " HTTP/1.1\r\n\r\n", l).status, 431);
  // Trailer fields after a chunked body join the header's and count against
  // the same limit (the HTTP fuzzer found them passing it).
  l.max_headers = 4;
  std::string trailers = "POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n";
  for (int i = 0; i < 5; ++i) trailers += "T-" + std::to_string(i) + ": v\r\n";
  r = Refused(trailers + "\r\n", l);
  EXPECT_EQ(r.status, 431);
  EXPECT_NE(r.message.find("trailer"), std::string::npos) << r.message;
}

TEST(ParseHttpRequestTest, BodyLimitsEncodingsAndVersions) {
  HttpLimits l;
  l.max_body_bytes = 10;
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n", l).status, 413);  // before any body byte
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n6\r\nabcdef\r\n0\r\n\r\n", l).status,
            413);
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nab", l).status, 415);
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nContent-Encoding: identity, br\r\nContent-Length: 2\r\n\r\nab", l).status, 415);
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", l).status, 501);
  const HttpRefusal v2 = Refused("GET / HTTP/2.0\r\n\r\n", l);
  EXPECT_TRUE(v2.status == 400 || v2.status == 505) << v2.status << " " << v2.message;
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab", l).status, 400);  // cut short
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", l).status, 400);
  EXPECT_EQ(Refused("POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", l).status, 400);
  EXPECT_EQ(Refused("NOT HTTP\r\n\r\n", l).status, 400);
  EXPECT_EQ(Refused("GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", l).status, 400);
  EXPECT_EQ(Refused("", l).status, 400);
}

using Client = testing::LoopbackClient;

std::string ErrorBodyFor(int status, const std::string& message) {
  return "{\"status\":" + std::to_string(status) + ",\"message\":\"" + message + "\"}";
}

struct Fixture {
  std::mutex mu;
  std::vector<std::shared_ptr<Exchange>> held;  // answers the test gives later
  std::atomic<int> gone{0};
  std::unique_ptr<HttpTransport> t;

  explicit Fixture(HttpLimits l = {}) {
    auto r = HttpTransport::Listen(
        "127.0.0.1", 0, l,
        [this](HttpRequest req, std::shared_ptr<Exchange> ex) {
          if (req.path == "/echo") {
            return ex->Respond({200, "text/plain", {{"X-Method", req.method}}, req.method == "HEAD" ? "head-body" : req.body});
          }
          if (req.path == "/throw") throw std::runtime_error("secret detail");
          if (req.path == "/hold" || req.path == "/stream") {
            ex->OnClientGone([this] { ++gone; });
            if (req.path == "/stream") ex->BeginStream(200, "text/event-stream");
            std::lock_guard lock(mu);
            held.push_back(ex);
            return;
          }
          ex->Respond({404, "application/json", {}, "{}"});
        },
        ErrorBodyFor, 2);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    t = std::move(*r);
  }
  int port() const { return t->port(); }
  std::shared_ptr<Exchange> Held(size_t i) {
    for (int k = 0; k < 500; ++k) {
      {
        std::lock_guard lock(mu);
        if (held.size() > i) return held[i];
      }
      std::this_thread::sleep_for(10ms);
    }
    return nullptr;
  }
};

TEST(HttpTransportTest, KeepAlivePipeliningHttp10AndContinue) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.connected());
  // Two requests in one write: two answers, in order, on one connection.
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\noneGET /echo HTTP/1.1\r\n\r\n"));
  std::string got = c.Read("X-Method: GET");
  got = c.Read("\r\n\r\n", 1000ms);
  EXPECT_EQ(got.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << got;
  EXPECT_LT(got.find("\r\n\r\none"), got.find("X-Method: GET")) << got;
  EXPECT_EQ(got.find("Connection: close"), std::string::npos) << got;
  // 100-continue: the server asks for the body.
  c.Clear();
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"));
  EXPECT_EQ(c.Read("\r\n\r\n").rfind("HTTP/1.1 100 Continue\r\n\r\n", 0), 0u);
  ASSERT_TRUE(c.Send("body"));
  EXPECT_NE(c.Read("\r\n\r\nbody").find("\r\n\r\nbody"), std::string::npos);
  // HEAD: the headers without the body, and the connection goes on.
  c.Clear();
  ASSERT_TRUE(c.Send("HEAD /echo HTTP/1.1\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nok"));
  got = c.Read("\r\n\r\nok");
  EXPECT_NE(got.find("X-Method: HEAD\r\nContent-Length: 9\r\n\r\nHTTP/1.1 200 OK"), std::string::npos) << got;
  EXPECT_EQ(got.find("head-body"), std::string::npos) << got;
  EXPECT_NE(got.find("X-Method: POST"), std::string::npos) << got;
  // HTTP/1.0 without keep-alive: answered, then closed.
  Client old(f.port());
  ASSERT_TRUE(old.Send("GET /echo HTTP/1.0\r\n\r\n"));
  EXPECT_TRUE(old.ClosedWithin(3000ms));
  EXPECT_EQ(old.Read("").rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << old.Read("");
}

TEST(HttpTransportTest, RefusalsCarryTheErrorBodyAndAnExceptionIsA500WithoutItsText) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nab"));
  const std::string got = c.Read("}");
  EXPECT_EQ(got.rfind("HTTP/1.1 415 ", 0), 0u) << got;
  EXPECT_NE(got.find("\"status\":415"), std::string::npos) << got;
  EXPECT_NE(got.find("Connection: close"), std::string::npos) << got;
  EXPECT_TRUE(c.ClosedWithin(3000ms));
  Client e(f.port());
  ASSERT_TRUE(e.Send("GET /throw HTTP/1.1\r\n\r\n"));
  const std::string err = e.Read("}");
  EXPECT_EQ(err.rfind("HTTP/1.1 500 ", 0), 0u) << err;
  EXPECT_EQ(err.find("secret detail"), std::string::npos) << err;
  EXPECT_GE(f.t->Stats().rejected_total, 1);
}

TEST(HttpTransportTest, AClientThatGoesAwayIsReportedWhetherItsAnswerIsPendingOrStreaming) {
  Fixture f;
  {
    Client c(f.port());
    ASSERT_TRUE(c.Send("GET /hold HTTP/1.1\r\n\r\n"));
    ASSERT_NE(f.Held(0), nullptr);
    EXPECT_EQ(f.gone.load(), 0);
  }  // closed with the answer pending
  for (int i = 0; i < 300 && f.gone.load() < 1; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(f.gone.load(), 1);
  f.Held(0)->Respond({200, "text/plain", {}, "late"});  // ignored, no crash
  {
    Client c(f.port());
    ASSERT_TRUE(c.Send("GET /stream HTTP/1.1\r\n\r\n"));
    ASSERT_NE(f.Held(1), nullptr);
    f.Held(1)->Write("data: 1\n\n");
    EXPECT_NE(c.Read("data: 1").find("Transfer-Encoding: chunked"), std::string::npos);
  }
  for (int i = 0; i < 300 && f.gone.load() < 2; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(f.gone.load(), 2);
  // An answer that ended is not reported when its client then leaves.
  {
    Client c(f.port());
    ASSERT_TRUE(c.Send("GET /hold HTTP/1.1\r\n\r\n"));
    ASSERT_NE(f.Held(2), nullptr);
    f.Held(2)->Respond({200, "text/plain", {}, "done"});
    EXPECT_NE(c.Read("done").find("done"), std::string::npos);
  }
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(f.gone.load(), 2);
  // OnClientGone after the client left runs at once.
  std::atomic<bool> late{false};
  f.Held(0)->OnClientGone([&] { late = true; });
  EXPECT_TRUE(late.load());
  EXPECT_EQ(f.t->Stats().client_gone_total, 2);
}

TEST(HttpTransportTest, AClientThatStopsReadingIsCutOffByTheWriteDeadline) {
  HttpLimits l;
  l.write_timeout = 300ms;
  Fixture f(l);
  Client c(f.port());
  ASSERT_TRUE(c.Send("GET /stream HTTP/1.1\r\n\r\n"));
  ASSERT_NE(f.Held(0), nullptr);
  const std::string chunk(1 << 20, 'x');
  const auto start = Clock::now();
  while (f.gone.load() == 0 && Clock::now() - start < 20s) {
    f.Held(0)->Write(chunk);
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(f.gone.load(), 1) << "a client that reads nothing held its stream for 20 s";
  EXPECT_GE(f.t->Stats().timeouts_total, 1);
}

TEST(HttpTransportTest, HeaderBodyAndIdleDeadlinesCloseTheConnection) {
  HttpLimits l;
  l.header_timeout = 400ms;
  l.body_timeout = 400ms;
  l.idle_timeout = 400ms;
  Fixture f(l);
  Client slow_header(f.port()), slow_body(f.port()), idle(f.port()), silent(f.port());
  ASSERT_TRUE(slow_header.Send("GET /echo HTTP/1.1\r\nX-A: 1\r\n"));
  ASSERT_TRUE(slow_body.Send("POST /echo HTTP/1.1\r\nContent-Length: 100\r\n\r\nonly ten.."));
  ASSERT_TRUE(idle.Send("GET /echo HTTP/1.1\r\n\r\n"));
  EXPECT_NE(idle.Read("\r\n\r\n").find("200 OK"), std::string::npos);
  const auto start = Clock::now();
  // The header's deadline runs from its start, however the bytes trickle.
  std::thread trickle([&] {
    for (int i = 0; i < 20; ++i) {
      if (!slow_header.Send("X-B: 2\r\n")) return;
      std::this_thread::sleep_for(100ms);
    }
  });
  EXPECT_TRUE(slow_header.ClosedWithin(3000ms));
  trickle.join();
  EXPECT_TRUE(slow_body.ClosedWithin(3000ms));
  EXPECT_TRUE(idle.ClosedWithin(3000ms));
  EXPECT_TRUE(silent.ClosedWithin(3000ms));  // a connection that never sends a byte
  EXPECT_LT(Clock::now() - start, 2500ms);
  EXPECT_GE(f.t->Stats().timeouts_total, 4);
}

TEST(HttpTransportTest, ConnectionsPastTheCapGet503AndTheCapFreesAsTheyClose) {
  HttpLimits l;
  l.max_connections = 4;
  Fixture f(l);
  std::vector<std::unique_ptr<Client>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<Client>(f.port()));
    ASSERT_TRUE(held.back()->Send("GET /echo HTTP/1.1\r\n"));  // a header never finished
  }
  for (int i = 0; i < 300 && f.t->Stats().connections_now < 4; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(f.t->Stats().connections_now, 4);
  Client over(f.port());
  ASSERT_TRUE(over.connected());
  const std::string got = over.Read("}");
  EXPECT_EQ(got.rfind("HTTP/1.1 503 ", 0), 0u) << got;
  EXPECT_NE(got.find("Retry-After: 1"), std::string::npos) << got;
  EXPECT_NE(got.find("too many connections (4)"), std::string::npos) << got;
  EXPECT_EQ(f.t->Stats().refused_total, 1);
  held.clear();
  for (int i = 0; i < 300 && f.t->Stats().connections_now > 0; ++i) std::this_thread::sleep_for(10ms);
  Client again(f.port());
  ASSERT_TRUE(again.Send("GET /echo HTTP/1.1\r\n\r\n"));
  EXPECT_NE(again.Read("\r\n\r\n").find("200 OK"), std::string::npos);
}

TEST(HttpTransportTest, StopClosesEveryConnectionAndReportsPendingAnswers) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.Send("GET /hold HTTP/1.1\r\n\r\n"));
  ASSERT_NE(f.Held(0), nullptr);
  f.t->Stop();
  EXPECT_EQ(f.gone.load(), 1);
  EXPECT_TRUE(c.ClosedWithin(2000ms));
  f.Held(0)->Respond({200, "text/plain", {}, "after stop"});  // no crash
}

TEST(HttpTransportTest, BadLimitsAndAddressesAreErrors) {
  HttpLimits l;
  l.max_connections = 0;
  auto r = HttpTransport::Listen("127.0.0.1", 0, l, [](HttpRequest, std::shared_ptr<Exchange>) {}, ErrorBodyFor, 1);
  EXPECT_FALSE(r.ok());
  r = HttpTransport::Listen("127.0.0.1", 70000, {}, [](HttpRequest, std::shared_ptr<Exchange>) {}, ErrorBodyFor, 1);
  EXPECT_FALSE(r.ok());
  Fixture f;
  r = HttpTransport::Listen("127.0.0.1", f.port(), {}, [](HttpRequest, std::shared_ptr<Exchange>) {}, ErrorBodyFor, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot listen"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace pagekv::server
