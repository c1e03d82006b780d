// What a benchmark ran on: the CPU, the instruction sets the kernels can
// use and the paths they dispatched to. Printed at the top of every
// `pagekv bench` and in the Google Benchmark binaries' context (`make
// bench`), because the build machines are not one CPU.
#pragma once

#include <string>
#include <vector>

namespace pagekv {

struct MachineFacts {
  std::string cpu;                // /proc/cpuinfo's model name ("unknown" elsewhere)
  int logical_cpus = 0;
  std::vector<std::string> isa;   // the kernel-relevant instruction sets present
  std::string simd_target;        // the Highway target the kernels dispatched to
  std::string attention_path;     // AttentionSimdTarget()
  std::string matmul_path;        // the weight products' target (+VNNI: AVX-512 VNNI in the int16 products)
  std::string Line() const;       // one line, "machine: ..."
};
MachineFacts DescribeMachine();

// Turns the Intel AMX tile paths (the attention kernels' and the weight
// products') on or off for this process; on by default where the CPU and
// kernel allow them. What `pagekv bench generate --no-amx` measures
// against. Returns whether this machine has them at all.
bool SetAmxPaths(bool enabled);

}  // namespace pagekv
