// What a benchmark ran on (include/pagekv/bench.h): the CPU, the instruction
// sets the kernels can use, and the paths they dispatched to.
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "kernels/amx_attention.h"
#include "kernels/amx_matmul.h"
#include "kernels/attention_kernel.h"
#include "kernels/matmul.h"
#include "pagekv/attention.h"
#include "pagekv/machine.h"

namespace pagekv {

MachineFacts DescribeMachine() {
  MachineFacts m;
  m.cpu = "unknown";
  std::set<std::string> flags;
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (line.rfind("model name", 0) == 0 && m.cpu == "unknown") m.cpu = line.substr(colon + 2);
    if (line.rfind("flags", 0) == 0 && flags.empty()) {
      std::istringstream words(line.substr(colon + 1));
      for (std::string w; words >> w;) flags.insert(w);
    }
  }
  m.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
  // The instruction sets that decide which kernel paths exist, in the
  // kernel's terms (/proc/cpuinfo spellings).
  for (const char* f : {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                        "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}) {
    if (flags.count(f) != 0) m.isa.emplace_back(f);
  }
  m.simd_target = kernels::DispatchedTargetName();
  m.attention_path = AttentionSimdTarget();
  m.matmul_path = kernels::MatMulTargetName();
  return m;
}

std::string MachineFacts::Line() const {
  std::string isa_list;
  for (const std::string& f : isa) isa_list += (isa_list.empty() ? "" : " ") + f;
  return "machine: " + cpu + ", " + std::to_string(logical_cpus) + " logical CPUs; ISA " +
         (isa_list.empty() ? "(none of the listed)" : isa_list) + "; dispatched " + simd_target + ", attention " +
         attention_path + ", weight products " + matmul_path;
}

bool SetAmxPaths(bool enabled) {
  const bool attention = kernels::SetAmxForTest(enabled);
  const bool matmul = kernels::SetAmxMatMulForTest(enabled);
  return attention || matmul;
}

}  // namespace pagekv
