// `--tp N` of the commands that run a model: joining the MPI job as one of
// its N ranks.
#pragma once

#include <memory>
#include <string>

#include "pagekv/dist.h"

namespace pagekv::cli {

struct TensorParallelJoin {
  std::shared_ptr<Communicator> comm;  // null with --tp 1
  int rank = 0;
  int exit_code = -1;  // >= 0: the command ends with it (the error is printed)
};

// With tp > 1: MPI's world, which must have exactly tp ranks (each rank
// checks on its own, no collective yet, so a wrong -np fails every rank
// at once); ranks other than 0 get stdout sent to /dev/null (every rank
// computes the same report; rank 0 prints it). `command` names the
// subcommand in the advice ("generate").
TensorParallelJoin JoinTensorParallel(int tp, const std::string& command);

// The kernel threads of one rank: `threads` when given, else this
// machine's hardware threads shared among the ranks running on it.
int RankThreads(int threads, int tp);

}  // namespace pagekv::cli
