// RedisServer (redis_server.h): fork/exec of the real server.
#include "testing/redis_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>
#include <vector>

namespace pagekv::testing {
namespace {

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

std::string FindServer() {
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    for (std::string dir; std::getline(ss, dir, ':');) {
      const std::string p = dir + "/redis-server";
      if (::access(p.c_str(), X_OK) == 0) return p;
    }
  }
  return ::access("/usr/bin/redis-server", X_OK) == 0 ? "/usr/bin/redis-server" : "";
}

}  // namespace

RedisServer::~RedisServer() {
  Kill();
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

Status RedisServer::Start(const std::string& extra_args) {
  if (pid_ > 0) return FailedPreconditionError("redis-server is already running");
  const std::string server = FindServer();
  if (server.empty()) {
    return NotFoundError("redis-server is not installed: install the Debian package redis-server "
                         "(scripts/install-deps.sh does)");
  }
  if (dir_.empty()) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "pagekv-redis-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return UnavailableError("cannot make a temporary directory for redis");
    dir_ = tmpl;
  }
  if (port_ == 0) port_ = FreePort();
  std::vector<std::string> args = {server, "--port", std::to_string(port_), "--bind", "127.0.0.1", "--dir", dir_,
                                   "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
                                   "--logfile", dir_ + "/redis.log"};
  std::stringstream extra(extra_args);
  for (std::string a; extra >> a;) args.push_back(a);
  const pid_t pid = ::fork();
  if (pid < 0) return UnavailableError("fork failed");
  if (pid == 0) {
    // Die with the test process (a crashed test must not leave a server
    // holding ctest's output pipe), and keep off the test's output.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, 0);
      ::dup2(null, 1);
      ::dup2(null, 2);
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  pid_ = pid;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Result<std::string> r = Command("PING"); r.ok() && (r->rfind("+PONG", 0) == 0 || r->find("NOAUTH") != std::string::npos)) {
      return Status::Ok();  // up (NOAUTH: up, with a password)
    }
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return UnavailableError("redis-server exited at start (see " + dir_ + "/redis.log)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Kill();
  return UnavailableError("redis-server did not answer PING within 10 s on port " + std::to_string(port_));
}

void RedisServer::Stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

void RedisServer::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

void RedisServer::Pause() {
  if (pid_ > 0) ::kill(pid_, SIGSTOP);
}

void RedisServer::Resume() {
  if (pid_ > 0) ::kill(pid_, SIGCONT);
}

Result<std::string> RedisServer::Command(const std::string& inline_command) const {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port_));
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return UnavailableError("cannot connect to redis on port " + std::to_string(port_));
  }
  const std::string line = inline_command + "\r\n";
  std::string reply;
  if (::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size())) {
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) reply.assign(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (reply.empty()) return UnavailableError("no reply from redis");
  return reply;
}

}  // namespace pagekv::testing
