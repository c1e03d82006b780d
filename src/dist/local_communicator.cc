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
  [[noreturn]] void Abort(int code) override { std::_Exit(code); }
};

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

std::shared_ptr<Communicator> LocalCommunicator() { return std::make_shared<Local>(); }

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
