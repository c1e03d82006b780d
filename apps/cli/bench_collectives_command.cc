// `pagekv bench collectives` (under mpirun -np N): what a split model's
// traffic costs on this machine, per message size.
#include <cstdio>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "machine_output.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

struct CollectiveBenchArgs {
  bool json = false;
  std::vector<int64_t> sizes = {4, 3072, 24576, 262144, 1048576, 16777216};
  double seconds = 0.2;
};

// `pagekv bench collectives` (mpirun -np N): the traffic of a split model.
int RunCollectiveBenchCommand(const CollectiveBenchArgs& a) {
  Result<std::shared_ptr<Communicator>> world = MpiWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "error: %s (mpirun -np 2 pagekv bench collectives)\n", world.status().message().c_str());
    return kExitBadInput;
  }
  Communicator& comm = **world;
  if (comm.rank() != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) return kExitFailed;
  Result<std::vector<CollectiveBenchResult>> r = RunCollectiveBench(comm, a.sizes, a.seconds);
  if (!r.ok()) {
    std::fprintf(stderr, "error: rank %d: %s\n", comm.rank(), r.status().message().c_str());
    return r.status().code() == StatusCode::kInvalidArgument ? kExitBadInput : kExitFailed;
  }
  if (a.json) {
    nlohmann::ordered_json j;
    j["machine"] = MachineJson();
    j["ranks"] = comm.size();
    j["local_ranks"] = LocalRanks();
    j["results"] = nlohmann::ordered_json::array();
    for (const CollectiveBenchResult& x : *r) {
      j["results"].push_back({{"bytes", x.bytes}, {"all_reduce_us", x.all_reduce_us}, {"start_sum_us", x.start_sum_us},
                              {"broadcast_us", x.broadcast_us},
                              {"send_us", x.send_us}, {"send_gbps", x.send_gbps}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  PrintMachine();
  std::printf("%d ranks (%d on this machine), rank 0's timings\n", comm.size(), LocalRanks());
  std::printf("%12s %16s %14s %14s %12s %10s\n", "bytes", "all-reduce us", "start-sum us", "broadcast us", "send us",
              "send GB/s");
  for (const CollectiveBenchResult& x : *r) {
    std::printf("%12ld %16.2f %14.2f %14.2f %12.2f %10.2f\n", static_cast<long>(x.bytes), x.all_reduce_us, x.start_sum_us,
                x.broadcast_us, x.send_us, x.send_gbps);
  }
  return kExitOk;
}

}  // namespace

void AddBenchCollectivesCommand(CLI::App& bench, int& exit_code) {
  static CollectiveBenchArgs coll;
  CLI::App* cb = bench.add_subcommand("collectives",
                                       "Under mpirun: the cost of a split model's traffic (all-ranks sum, broadcast, stage to stage)");
  cb->add_flag("--json", coll.json, "Print one JSON object");
  cb->add_option("--sizes", coll.sizes, "Message sizes in bytes, multiples of 4 (default 4,3072,24576,262144,1048576,16777216)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 32));
  cb->add_option("--seconds", coll.seconds, "Time per size and operation (default 0.2)")->check(CLI::Range(0.001, 60.0));
  cb->callback([&exit_code] { exit_code = RunCollectiveBenchCommand(coll); });

}

}  // namespace pagekv::cli
