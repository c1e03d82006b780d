// A server binary the end-to-end tests start as a child process (`pagekv
// serve`, `pagekv route`, or either under `mpirun`): the port it prints in
// its "listening on http://HOST:PORT" line, a signal, its exit status.
//
// Thread safety: none; one test thread drives it.
#pragma once

#include <sys/types.h>

#include <cstdio>
#include <string>
#include <vector>

namespace pagekv::testing {

class ChildProcess {
 public:
  // Starts argv[0] (a path) with `env` added to the environment
  // ("NAME=value" each) and reads its stdout until a line says
  // "listening on http://HOST:PORT" (port() is 0 if it exited first or
  // timeout_s passed).
  ChildProcess(const std::vector<std::string>& argv, const std::vector<std::string>& env = {}, int timeout_s = 60);
  ~ChildProcess();  // SIGTERM if still running; SIGKILL if it has not exited 10 s later
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  int port() const { return port_; }
  void Signal(int sig);
  // Waits up to timeout_s for the child to exit: its exit code, 128 + the
  // signal that ended it, or -1 when it is still running (then killed).
  int Wait(int timeout_s);
  // What the child wrote to stdout after the "listening" line, up to its
  // exit (call after Wait).
  std::string RestOfOutput();

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
};

// A loopback port nothing listens on now.
int FreeLoopbackPort();

}  // namespace pagekv::testing
