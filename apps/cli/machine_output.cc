#include "machine_output.h"

#include <cstdio>

#include "pagekv/pagekv.h"

namespace pagekv::cli {

nlohmann::ordered_json MachineJson() {
  const MachineFacts m = DescribeMachine();
  return {{"cpu", m.cpu}, {"logical_cpus", m.logical_cpus}, {"isa", m.isa}, {"simd_target", m.simd_target},
          {"attention_path", m.attention_path}, {"matmul_path", m.matmul_path}};
}

void PrintMachine() { std::printf("%s\n", DescribeMachine().Line().c_str()); }

}  // namespace pagekv::cli
