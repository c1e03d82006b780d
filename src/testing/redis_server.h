// A real redis-server for tests: started on a free loopback port in a fresh
// temporary directory (no persistence), stopped, killed or restarted empty
// on demand, and removed with its directory when the object goes.
//
// Thread safety: none; one test thread drives it.
#pragma once

#include <sys/types.h>

#include <string>

#include "pagekv/status.h"

namespace pagekv::testing {

class RedisServer {
 public:
  RedisServer() = default;
  ~RedisServer();  // SIGKILL if running, then removes the directory
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  // Starts redis-server (from PATH, or /usr/bin/redis-server) and waits up
  // to 10 s until it answers PING. The port is chosen the first time and
  // kept across restarts. Errors name what failed (not installed: install
  // the Debian package redis-server, which scripts/install-deps.sh does).
  Status Start(const std::string& extra_args = {});
  void Stop();   // SIGTERM and wait
  void Kill();   // SIGKILL and wait (a crash)
  void Pause();  // SIGSTOP: connections stay open, nothing answers (a hung server)
  void Resume(); // SIGCONT
  bool running() const { return pid_ > 0; }

  // Before the first Start: listen on this port instead of a free one
  // (a cluster node also needs port + 10000 for its bus).
  void UsePort(int port) { port_ = port; }
  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }

  // Sends one inline command (e.g. "DBSIZE") and returns the raw reply line.
  Result<std::string> Command(const std::string& inline_command) const;

 private:
  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace pagekv::testing
