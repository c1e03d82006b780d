// A raw TCP client on 127.0.0.1 for tests of the HTTP server: bytes in and
// out exactly as written, so tests can send what no HTTP library would
// (trickled headers, cut-short bodies, pipelined requests) and see whether
// and when the server closes.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace pagekv::testing {

class LoopbackClient {
 public:
  explicit LoopbackClient(int port);
  ~LoopbackClient();
  LoopbackClient(const LoopbackClient&) = delete;
  LoopbackClient& operator=(const LoopbackClient&) = delete;

  bool connected() const { return connected_; }
  bool Send(std::string_view bytes);
  // Reads until `until` is in what was received (empty: until the peer
  // closes), the peer closes, or the deadline passes; returns everything
  // received so far.
  const std::string& Read(std::string_view until, std::chrono::milliseconds deadline = std::chrono::milliseconds(5000));
  // True once the server has closed the connection, waiting up to `deadline`.
  bool ClosedWithin(std::chrono::milliseconds deadline);
  void Clear() { got_.clear(); }
  void Close();

 private:
  int fd_ = -1;
  bool connected_ = false, closed_ = false;
  std::string got_;
};

}  // namespace pagekv::testing
