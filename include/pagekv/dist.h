// Processes that share one model: the collectives a sharded forward pass
// needs, behind an interface (a NCCL implementation can follow the CUDA
// backend without the model changing).
//
// A tensor-parallel run (`mpirun -np T pagekv generate --tp T`) gives every
// rank the same Communicator over all T ranks; each rank holds KV heads
// [r*H/T, (r+1)*H/T) of every layer in its own pool and the matching slices
// of the weights, and the ranks meet twice a layer (after the attention
// output projection and after the feed-forward down projection). Every
// rank runs the same deterministic scheduler on the same inputs, so block
// allocation is decided identically everywhere; each step compares a
// digest of the step's block tables across ranks and fails the step if they
// differ (docs/SHARDING.md).
//
// Failure: a collective never waits on a rank that already gave up. Setup
// errors go through AllOk (every rank learns that some rank failed and
// exits with the same error code); an error inside a step on one rank that
// the others cannot see (a collective that failed) aborts the job.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "pagekv/status.h"

namespace pagekv {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local" (one process) or "mpi".
  virtual std::string name() const = 0;

  // buf[0, n) summed over every rank, into every rank's buf; every rank gets
  // the same bits (the sum is formed once, in rank order, and broadcast).
  virtual Status AllReduceSum(float* buf, int64_t n) = 0;
  // Nonblocking sum, for overlapping the traffic with compute: starts
  // adding buf[0, n) over every rank and returns a handle at once;
  // WaitSum(handle) completes it, leaving the sum in buf with the same bits
  // on every rank (each adds the gathered parts in rank order). buf must be
  // neither read nor written in between. Several may be in flight; wait for
  // each exactly once, on the thread that started it. Errors: a negative
  // count, a null buffer, n x size() floats of 2 GiB or more; an unknown
  // handle.
  virtual Result<int> StartSum(float* buf, int64_t n) = 0;
  virtual Status WaitSum(int handle) = 0;
  // root's bytes into every other rank's buf.
  virtual Status Broadcast(void* buf, int64_t bytes, int root) = 0;
  // Every rank's `bytes` bytes of `send`, in rank order, into every rank's
  // recv [size() * bytes] (context parallel: each rank's partial attention).
  // Errors: a negative size, null buffers, bytes of 2 GiB or more.
  virtual Status AllGather(const void* send, int64_t bytes, void* recv) = 0;
  // Whether every rank passed ok (the way ranks fail together: each rank
  // calls it after a step that may fail on some ranks only).
  virtual Result<bool> AllOk(bool ok) = 0;
  // Whether every rank passed the same value.
  virtual Result<bool> AllEqual(uint64_t value) = 0;
  // Point to point (pipeline stages): bytes to / from one rank; `tag`
  // tells messages between the same two ranks apart.
  virtual Status Send(const void* buf, int64_t bytes, int dest, int tag) = 0;
  virtual Status Recv(void* buf, int64_t bytes, int source, int tag) = 0;
  // The ranks that pass the same color, ordered by key: a communicator of
  // their own (every rank of this one must call it).
  virtual Result<std::shared_ptr<Communicator>> Split(int color, int key) = 0;
  // Ends every rank of the job with `code` (an error one rank alone saw in
  // the middle of a collective sequence: the others would wait forever).
  [[noreturn]] virtual void Abort(int code) = 0;
};

// One process: size 1, every collective a no-op.
std::shared_ptr<Communicator> LocalCommunicator();

// How one model is split over processes: tensor parallel (the ranks of one
// pipeline stage share each of its layers' heads), pipeline parallel (each
// stage holds a contiguous range of the layers) and context parallel (the
// ranks of a context group hold the same heads and layers, and each holds
// one slice of every KV block: a sequence's tokens are spread over them).
// `all` spans every rank (what steps are agreed over); null members: not
// split that way. Rank r of `all` is tensor rank r % tp of context rank
// (r / tp) % cp of pipeline stage r / (tp * cp).
struct ModelParallel {
  std::shared_ptr<Communicator> tensor, pipeline, context, all;
  bool active() const { return all != nullptr && all->size() > 1; }
  int tensor_size() const { return tensor != nullptr ? tensor->size() : 1; }
  int pipeline_size() const { return pipeline != nullptr ? pipeline->size() : 1; }
  int context_size() const { return context != nullptr ? context->size() : 1; }
  int context_rank() const { return context != nullptr ? context->rank() : 0; }
};

// `world` (of exactly tp x pp x cp ranks) split into the three. Errors:
// sizes below 1, a world of another size (naming the -np to give).
Result<ModelParallel> SplitWorld(std::shared_ptr<Communicator> world, int tp, int pp, int cp = 1);

// Whether this process was started by an MPI launcher (mpirun / mpiexec of
// Open MPI, or a PMI / PMIx one): reads the launcher's environment, does
// not initialise MPI.
bool LaunchedByMpi();
// The ranks on this machine, from the launcher's environment (1 when not
// launched by one): what a rank's default thread count divides by.
int LocalRanks();

// MPI_COMM_WORLD, MPI initialised on first use (thread level SERIALIZED:
// any thread may call MPI, one at a time) and finalised at exit. Errors: this
// build has no MPI, the process was not started by an MPI launcher, MPI
// failed to initialise.
Result<std::shared_ptr<Communicator>> MpiWorld();

// Whether this build links MPI.
bool MpiBuilt();

}  // namespace pagekv
