#include "tp_flags.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <thread>

#include "commands.h"

namespace pagekv::cli {

ParallelJoin JoinParallel(int tp, int pp, int cp, const std::string& command) {
  ParallelJoin j;
  if (tp * pp * cp <= 1) return j;
  const std::string flags = (tp > 1 ? " --tp " + std::to_string(tp) : "") + (pp > 1 ? " --pp " + std::to_string(pp) : "") +
                            (cp > 1 ? " --cp " + std::to_string(cp) : "");
  Result<std::shared_ptr<Communicator>> world = MpiWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "error:%s: %s (mpirun -np %d pagekv %s ...%s)\n", flags.c_str(), world.status().message().c_str(),
                 tp * pp * cp, command.c_str(), flags.c_str());
    j.exit_code = kExitBadInput;
    return j;
  }
  Result<ModelParallel> split = SplitWorld(*world, tp, pp, cp);
  if (!split.ok()) {
    std::fprintf(stderr, "error: rank %d: %s\n", (*world)->rank(), split.status().message().c_str());
    j.exit_code = split.status().code() == StatusCode::kInvalidArgument ? kExitBadInput : kExitFailed;
    return j;
  }
  j.parallel = *split;
  j.rank = (*world)->rank();
  if (j.rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) j.exit_code = kExitFailed;
  return j;
}

int RankThreads(int threads, int ranks) {
  if (threads > 0 || ranks <= 1) return threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / LocalRanks());
}

}  // namespace pagekv::cli
