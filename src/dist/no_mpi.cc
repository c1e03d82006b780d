// MpiWorld in a build without MPI.
#include "pagekv/dist.h"

namespace pagekv {

bool MpiBuilt() { return false; }

Result<std::shared_ptr<Communicator>> MpiWorld() {
  return UnimplementedError("this build has no MPI: install libopenmpi-dev (scripts/install-deps.sh) and rebuild");
}

}  // namespace pagekv
