#include <cstdlib>
#include <string>

#include "pagekv/dist.h"

namespace pagekv {
namespace {

class Local final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "local"; }
  Status AllReduceSum(float*, int64_t n) override {
    return n < 0 ? InvalidArgumentError("AllReduceSum: negative count") : Status::Ok();
  }
  Status Broadcast(void*, int64_t bytes, int root) override {
    if (bytes < 0 || root != 0) return InvalidArgumentError("Broadcast: negative size or a root other than 0 (of 1 rank)");
    return Status::Ok();
  }
  Result<bool> AllOk(bool ok) override { return ok; }
  Result<bool> AllEqual(uint64_t) override { return true; }
  Status Send(const void*, int64_t, int dest, int) override {
    return InvalidArgumentError("Send to rank " + std::to_string(dest) + " of a one-rank communicator");
  }
  Status Recv(void*, int64_t, int source, int) override {
    return InvalidArgumentError("Recv from rank " + std::to_string(source) + " of a one-rank communicator");
  }
  Result<std::shared_ptr<Communicator>> Split(int, int) override { return std::shared_ptr<Communicator>(std::make_shared<Local>()); }
  [[noreturn]] void Abort(int code) override { std::_Exit(code); }
};

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

std::shared_ptr<Communicator> LocalCommunicator() { return std::make_shared<Local>(); }

Result<ModelParallel> SplitWorld(std::shared_ptr<Communicator> world, int tp, int pp) {
  if (tp < 1 || pp < 1) return InvalidArgumentError("--tp and --pp must be at least 1");
  ModelParallel mp;
  if (world == nullptr || (tp == 1 && pp == 1)) return mp;
  if (world->size() != tp * pp) {
    const std::string flags = pp == 1   ? "--tp " + std::to_string(tp)
                              : tp == 1 ? "--pp " + std::to_string(pp)
                                        : "--tp " + std::to_string(tp) + " x --pp " + std::to_string(pp);
    return InvalidArgumentError(flags + " needs " + std::to_string(tp * pp) + " ranks, but this job has " +
                                std::to_string(world->size()) + ": run mpirun -np " + std::to_string(tp * pp));
  }
  const int r = world->rank();
  mp.all = world;
  // Every rank calls both splits, in the same order.
  PAGEKV_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> tensor, world->Split(r / tp, r % tp));
  PAGEKV_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> pipeline, world->Split(r % tp, r / tp));
  if (tp > 1) mp.tensor = std::move(tensor);
  if (pp > 1) mp.pipeline = std::move(pipeline);
  return mp;
}

bool LaunchedByMpi() {
  return Env("OMPI_COMM_WORLD_SIZE") != nullptr || Env("PMIX_RANK") != nullptr || Env("PMI_RANK") != nullptr ||
         Env("PMI_SIZE") != nullptr;
}

int LocalRanks() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"}) {
    if (const char* v = Env(name)) {
      const long n = std::strtol(v, nullptr, 10);
      if (n >= 1 && n <= 1 << 20) return static_cast<int>(n);
    }
  }
  return 1;
}

}  // namespace pagekv
