#include "testing/loopback_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace pagekv::testing {

using Clock = std::chrono::steady_clock;

LoopbackClient::LoopbackClient(int port) {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  connected_ = fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
}

LoopbackClient::~LoopbackClient() { Close(); }

bool LoopbackClient::Send(std::string_view s) {
  return fd_ >= 0 && send(fd_, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size());
}

const std::string& LoopbackClient::Read(std::string_view until, std::chrono::milliseconds deadline) {
  const auto end = Clock::now() + deadline;
  while (fd_ >= 0 && !closed_ && (until.empty() || got_.find(until) == std::string::npos)) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (left <= 0) break;
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) break;
    char buf[16384];
    const ssize_t n = recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) {
      closed_ = true;
      break;
    }
    got_.append(buf, static_cast<size_t>(n));
  }
  return got_;
}

bool LoopbackClient::ClosedWithin(std::chrono::milliseconds deadline) {
  Read("", deadline);
  return closed_;
}

void LoopbackClient::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

}  // namespace pagekv::testing
