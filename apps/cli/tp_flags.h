// `--tp N` / `--pp N` / `--cp N` of the commands that run a model: joining
// the MPI job as one of its ranks.
#pragma once

#include <string>

#include "pagekv/dist.h"

namespace pagekv::cli {

struct ParallelJoin {
  ModelParallel parallel;  // empty with --tp 1 --pp 1 --cp 1
  int rank = 0;            // in the whole job
  int exit_code = -1;      // >= 0: the command ends with it (the error is printed)
};

// With tp x pp x cp > 1: MPI's world, which must have exactly that many
// ranks (each rank checks on its own, before any collective, so a wrong -np
// fails every rank at once), split into tensor, pipeline and context groups; ranks
// other than 0 get stdout sent to /dev/null (every rank computes the same
// report; rank 0 prints it). `command` names the subcommand in the advice
// ("generate").
ParallelJoin JoinParallel(int tp, int pp, int cp, const std::string& command);

// The kernel threads of one rank: `threads` when given, else this
// machine's hardware threads shared among the ranks running on it.
int RankThreads(int threads, int ranks);

}  // namespace pagekv::cli
