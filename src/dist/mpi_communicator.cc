// The Communicator over MPI_COMM_WORLD (Open MPI from Debian).
// The C API only (Open MPI's mpi.h otherwise declares the removed C++
// bindings, whose library we do not link).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "pagekv/dist.h"

namespace pagekv {
namespace {

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

Status Check(int code, const char* what) {
  if (code == MPI_SUCCESS) return Status::Ok();
  return InternalError(std::string("MPI ") + what + " failed: " + MpiErrorText(code));
}

class Mpi final : public Communicator {
 public:
  explicit Mpi(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~Mpi() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_WORLD && !finalized) MPI_Comm_free(&comm_);
  }
  Mpi(const Mpi&) = delete;
  Mpi& operator=(const Mpi&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  Status AllReduceSum(float* buf, int64_t n) override {
    if (n < 0 || (n > 0 && buf == nullptr)) return InvalidArgumentError("AllReduceSum: a negative count or a null buffer");
    if (size_ == 1 || n == 0) return Status::Ok();
    // Reduce to rank 0, then broadcast: one sum, the same bits on every
    // rank (an all-reduce's algorithm may add in a different order on
    // different ranks, and the ranks must sample the same token).
    constexpr int64_t kChunk = int64_t{1} << 30;
    for (int64_t at = 0; at < n; at += kChunk) {
      const int count = static_cast<int>(std::min(kChunk, n - at));
      float* p = buf + at;
      PAGEKV_RETURN_IF_ERROR(Check(MPI_Reduce(rank_ == 0 ? MPI_IN_PLACE : p, rank_ == 0 ? p : nullptr, count, MPI_FLOAT,
                                              MPI_SUM, 0, comm_),
                                   "Reduce"));
      PAGEKV_RETURN_IF_ERROR(Check(MPI_Bcast(p, count, MPI_FLOAT, 0, comm_), "Bcast"));
    }
    return Status::Ok();
  }

  Status Broadcast(void* buf, int64_t bytes, int root) override {
    if (bytes < 0 || root < 0 || root >= size_ || (bytes > 0 && buf == nullptr)) {
      return InvalidArgumentError("Broadcast: a negative size, a null buffer or a root outside [0, " + std::to_string(size_) + ")");
    }
    constexpr int64_t kChunk = int64_t{1} << 30;
    for (int64_t at = 0; at < bytes; at += kChunk) {
      const int count = static_cast<int>(std::min(kChunk, bytes - at));
      PAGEKV_RETURN_IF_ERROR(Check(MPI_Bcast(static_cast<char*>(buf) + at, count, MPI_BYTE, root, comm_), "Bcast"));
    }
    return Status::Ok();
  }

  Result<int> StartSum(float* buf, int64_t n) override {
    if (n < 0 || (n > 0 && buf == nullptr)) return InvalidArgumentError("StartSum: a negative count or a null buffer");
    if (n * size_ >= (int64_t{1} << 29)) return InvalidArgumentError("StartSum: 2 GiB or more gathered: use AllReduceSum");
    const int handle = next_handle_++;
    Pending& p = pending_[handle];
    p.buf = buf;
    p.n = n;
    if (size_ == 1 || n == 0) return handle;
    // Every rank's part to every rank (an all-gather, nonblocking), summed
    // in rank order at the wait: the same bits everywhere without a second,
    // dependent round (a reduce then a broadcast cannot be chained without
    // waiting in between).
    if (!spare_.empty()) {  // a buffer an earlier sum gave back: no allocation (and page faults) per call
      p.gathered = std::move(spare_.back());
      spare_.pop_back();
    }
    p.gathered.resize(static_cast<size_t>(n * size_));
    const int count = static_cast<int>(n);
    if (Status st = Check(MPI_Iallgather(buf, count, MPI_FLOAT, p.gathered.data(), count, MPI_FLOAT, comm_, &p.request),
                          "Iallgather");
        !st.ok()) {
      pending_.erase(handle);
      return st;
    }
    p.started = true;
    return handle;
  }

  Status WaitSum(int handle) override {
    auto it = pending_.find(handle);
    if (it == pending_.end()) return InvalidArgumentError("WaitSum: unknown handle " + std::to_string(handle));
    Pending p = std::move(it->second);
    pending_.erase(it);
    if (!p.started) return Status::Ok();
    PAGEKV_RETURN_IF_ERROR(Check(MPI_Wait(&p.request, MPI_STATUS_IGNORE), "Wait"));
    // ((part 0 + part 1) + part 2) + ...: rank order for every element, one
    // contiguous pass per rank (vectorised by the compiler).
    const float* g = p.gathered.data();
    float* out = p.buf;
    std::copy_n(g, p.n, out);
    for (int r = 1; r < size_; ++r) {
      const float* part = g + static_cast<int64_t>(r) * p.n;
      for (int64_t i = 0; i < p.n; ++i) out[i] += part[i];
    }
    if (spare_.size() < 4) spare_.push_back(std::move(p.gathered));
    return Status::Ok();
  }

  Status AllGather(const void* send, int64_t bytes, void* recv) override {
    if (bytes < 0 || bytes >= (int64_t{1} << 31) || (bytes > 0 && (send == nullptr || recv == nullptr))) {
      return InvalidArgumentError("AllGather: a negative size (or 2 GiB or more) or a null buffer");
    }
    if (bytes == 0) return Status::Ok();
    const int count = static_cast<int>(bytes);
    return Check(MPI_Allgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_), "Allgather");
  }

  Result<bool> AllOk(bool ok) override {
    int mine = ok ? 1 : 0, all = 0;
    PAGEKV_RETURN_IF_ERROR(Check(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, comm_), "Allreduce"));
    return all == 1;
  }

  Result<bool> AllEqual(uint64_t value) override {
    unsigned long long v[2] = {value, ~value}, r[2] = {0, 0};
    // min(value) == max(value) <=> min(value) == ~min(~value).
    PAGEKV_RETURN_IF_ERROR(Check(MPI_Allreduce(v, r, 2, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm_), "Allreduce"));
    return r[0] == ~r[1];
  }

  Status Send(const void* buf, int64_t bytes, int dest, int tag) override {
    PAGEKV_RETURN_IF_ERROR(CheckPeer(buf, bytes, dest, tag));
    constexpr int64_t kChunk = int64_t{1} << 30;
    for (int64_t at = 0; at < bytes; at += kChunk) {
      const int count = static_cast<int>(std::min(kChunk, bytes - at));
      PAGEKV_RETURN_IF_ERROR(Check(MPI_Send(static_cast<const char*>(buf) + at, count, MPI_BYTE, dest, tag, comm_), "Send"));
    }
    return Status::Ok();
  }

  Status Recv(void* buf, int64_t bytes, int source, int tag) override {
    PAGEKV_RETURN_IF_ERROR(CheckPeer(buf, bytes, source, tag));
    constexpr int64_t kChunk = int64_t{1} << 30;
    for (int64_t at = 0; at < bytes; at += kChunk) {
      const int count = static_cast<int>(std::min(kChunk, bytes - at));
      MPI_Status st;
      PAGEKV_RETURN_IF_ERROR(
          Check(MPI_Recv(static_cast<char*>(buf) + at, count, MPI_BYTE, source, tag, comm_, &st), "Recv"));
      int got = 0;
      MPI_Get_count(&st, MPI_BYTE, &got);
      if (got != count) {
        return InternalError("MPI Recv: " + std::to_string(got) + " bytes came from rank " + std::to_string(source) +
                             ", " + std::to_string(count) + " were expected (the ranks disagree on the step)");
      }
    }
    return Status::Ok();
  }

  Result<std::shared_ptr<Communicator>> Split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    PAGEKV_RETURN_IF_ERROR(Check(MPI_Comm_split(comm_, color, key, &sub), "Comm_split"));
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    return std::shared_ptr<Communicator>(std::make_shared<Mpi>(sub));
  }

  [[noreturn]] void Abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  Status CheckPeer(const void* buf, int64_t bytes, int peer, int tag) const {
    if (bytes < 0 || peer < 0 || peer >= size_ || peer == rank_ || tag < 0 || (bytes > 0 && buf == nullptr)) {
      return InvalidArgumentError("Send / Recv: a negative size or tag, a null buffer, or a peer " + std::to_string(peer) +
                                  " that is not another rank of [0, " + std::to_string(size_) + ")");
    }
    return Status::Ok();
  }

  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    float* buf = nullptr;
    int64_t n = 0;
    bool started = false;
    std::vector<float> gathered;
  };
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  int next_handle_ = 1;
  std::map<int, Pending> pending_;
  std::vector<std::vector<float>> spare_;  // gather buffers kept for the next sums
};

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

bool MpiBuilt() { return true; }

Result<std::shared_ptr<Communicator>> MpiWorld() {
  static std::mutex mu;
  static std::shared_ptr<Communicator> world;
  std::lock_guard lock(mu);
  if (world) return world;
  if (!LaunchedByMpi()) {
    return FailedPreconditionError("this process was not started by an MPI launcher: run it as `mpirun -np N pagekv ...`");
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // SERIALIZED: a serving engine's loop thread makes the calls, not the
    // main thread, one thread at a time.
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) return InternalError("MPI_Init_thread failed: " + MpiErrorText(rc));
    if (provided < MPI_THREAD_SERIALIZED) {
      return InternalError("this MPI library gives thread level " + std::to_string(provided) +
                           ", below MPI_THREAD_SERIALIZED (calls from a thread other than the main one)");
    }
    // Errors come back as codes (turned into a Status), not an abort.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    std::atexit(FinalizeAtExit);
  }
  world = std::make_shared<Mpi>(MPI_COMM_WORLD);
  return world;
}

}  // namespace pagekv
