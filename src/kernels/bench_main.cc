// main() of every Google Benchmark binary (cmake/PageKV.cmake's
// pagekv_benchmark): the machine the figures come from (CPU, instruction
// sets, dispatched paths) goes into the benchmark's context, printed above
// the table and written into --benchmark_format=json output.
#include <benchmark/benchmark.h>

#include "pagekv/machine.h"

int main(int argc, char** argv) {
  benchmark::AddCustomContext("pagekv_machine", pagekv::DescribeMachine().Line());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
