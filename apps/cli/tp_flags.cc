#include "tp_flags.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "commands.h"

namespace pagekv::cli {

TensorParallelJoin JoinTensorParallel(int tp, const std::string& command) {
  TensorParallelJoin j;
  if (tp <= 1) return j;
  Result<std::shared_ptr<Communicator>> world = MpiWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "error: --tp %d: %s (mpirun -np %d pagekv %s ... --tp %d)\n", tp, world.status().message().c_str(), tp,
                 command.c_str(), tp);
    j.exit_code = kExitBadInput;
    return j;
  }
  if ((*world)->size() != tp) {
    std::fprintf(stderr, "error: rank %d: --tp %d needs %d ranks, but this job has %d: run mpirun -np %d\n", (*world)->rank(), tp,
                 tp, (*world)->size(), tp);
    j.exit_code = kExitBadInput;
    return j;
  }
  j.comm = *world;
  j.rank = (*world)->rank();
  if (j.rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) j.exit_code = kExitFailed;
  return j;
}

int RankThreads(int threads, int tp) {
  if (threads > 0 || tp <= 1) return threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / LocalRanks());
}

}  // namespace pagekv::cli
