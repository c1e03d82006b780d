#include <cstdlib>
#include <cstring>
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
  Result<int> StartSum(float* buf, int64_t n) override {
    if (n < 0 || (n > 0 && buf == nullptr)) return InvalidArgumentError("StartSum: a negative count or a null buffer");
    return 0;
  }
  Status WaitSum(int handle) override {
    return handle == 0 ? Status::Ok() : InvalidArgumentError("WaitSum: unknown handle " + std::to_string(handle));
  }
  Status AllGather(const void* send, int64_t bytes, void* recv) override {
    if (bytes < 0 || bytes >= (int64_t{1} << 31) || (bytes > 0 && (send == nullptr || recv == nullptr))) {
      return InvalidArgumentError("AllGather: a negative size (or 2 GiB or more) or a null buffer");
    }
    if (bytes > 0 && send != recv) std::memmove(recv, send, static_cast<size_t>(bytes));
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

Result<ModelParallel> SplitWorld(std::shared_ptr<Communicator> world, int tp, int pp, int cp) {
  if (tp < 1 || pp < 1 || cp < 1) return InvalidArgumentError("--tp, --pp and --cp must be at least 1");
  ModelParallel mp;
  if (world == nullptr || (tp == 1 && pp == 1 && cp == 1)) return mp;
  if (world->size() != tp * pp * cp) {
    std::string flags;
    for (const auto& [name, n] : {std::pair{"--tp ", tp}, std::pair{"--pp ", pp}, std::pair{"--cp ", cp}}) {
      if (n > 1) flags += (flags.empty() ? "" : " x ") + (name + std::to_string(n));
    }
    return InvalidArgumentError(flags + " needs " + std::to_string(tp * pp * cp) + " ranks, but this job has " +
                                std::to_string(world->size()) + ": run mpirun -np " + std::to_string(tp * pp * cp));
  }
  const int r = world->rank();
  const int t = r % tp, c = (r / tp) % cp, s = r / (tp * cp);
  mp.all = world;
  // Every rank calls every split, in the same order.
  PAGEKV_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> tensor, world->Split(r / tp, t));
  PAGEKV_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> pipeline, world->Split(r % (tp * cp), s));
  PAGEKV_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> context, world->Split(s * tp + t, c));
  if (tp > 1) mp.tensor = std::move(tensor);
  if (pp > 1) mp.pipeline = std::move(pipeline);
  if (cp > 1) mp.context = std::move(context);
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
