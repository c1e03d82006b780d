// `pagekv bench collectives`: what the tensor / pipeline parallel traffic
// costs on this machine, per message size, under mpirun.
#include <algorithm>
#include <chrono>
#include <vector>

#include "pagekv/bench.h"

namespace pagekv {

Result<std::vector<CollectiveBenchResult>> RunCollectiveBench(Communicator& comm, const std::vector<int64_t>& sizes,
                                                              double seconds_per_size) {
  if (comm.size() < 2) return InvalidArgumentError("bench collectives: run under mpirun -np 2 or more");
  std::vector<CollectiveBenchResult> out;
  using Clock = std::chrono::steady_clock;
  for (int64_t bytes : sizes) {
    if (bytes < 4 || bytes % 4 != 0) return InvalidArgumentError("bench collectives: sizes are whole floats (multiples of 4 bytes)");
    std::vector<float> buf(static_cast<size_t>(bytes / 4), 1.0f);
    CollectiveBenchResult r;
    r.bytes = bytes;
    // Every rank runs the same number of iterations: rank 0 decides from a
    // first timed call and broadcasts it.
    auto iterations = [&](auto&& once) -> Result<int64_t> {
      const auto t0 = Clock::now();
      PAGEKV_RETURN_IF_ERROR(once());
      const double one = std::max(1e-7, std::chrono::duration<double>(Clock::now() - t0).count());
      int64_t n = std::clamp<int64_t>(static_cast<int64_t>(seconds_per_size / one), 5, 100000);
      PAGEKV_RETURN_IF_ERROR(comm.Broadcast(&n, sizeof n, 0));
      return n;
    };
    auto timed = [&](auto&& once) -> Result<double> {
      PAGEKV_ASSIGN_OR_RETURN(const int64_t n, iterations(once));
      PAGEKV_ASSIGN_OR_RETURN(const bool ok, comm.AllOk(true));  // start together
      (void)ok;
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < n; ++i) PAGEKV_RETURN_IF_ERROR(once());
      return 1e6 * std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(n);
    };
    PAGEKV_ASSIGN_OR_RETURN(r.all_reduce_us, timed([&] { return comm.AllReduceSum(buf.data(), bytes / 4); }));
    PAGEKV_ASSIGN_OR_RETURN(r.start_sum_us, timed([&]() -> Status {
                              PAGEKV_ASSIGN_OR_RETURN(const int handle, comm.StartSum(buf.data(), bytes / 4));
                              return comm.WaitSum(handle);
                            }));
    PAGEKV_ASSIGN_OR_RETURN(r.broadcast_us, timed([&] { return comm.Broadcast(buf.data(), bytes, 0); }));
    // Ping-pong between ranks 0 and 1 (the others wait): one way is half a round trip.
    const int rank = comm.rank();
    PAGEKV_ASSIGN_OR_RETURN(const double round_trip, timed([&]() -> Status {
                              if (rank == 0) {
                                PAGEKV_RETURN_IF_ERROR(comm.Send(buf.data(), bytes, 1, 7));
                                return comm.Recv(buf.data(), bytes, 1, 7);
                              }
                              if (rank == 1) {
                                PAGEKV_RETURN_IF_ERROR(comm.Recv(buf.data(), bytes, 0, 7));
                                return comm.Send(buf.data(), bytes, 0, 7);
                              }
                              return Status::Ok();
                            }));
    r.send_us = round_trip / 2;
    r.send_gbps = static_cast<double>(bytes) / (r.send_us * 1e3);
    out.push_back(r);
  }
  return out;
}

}  // namespace pagekv
