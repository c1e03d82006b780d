// ThreadPool: a persistent set of worker threads that run parallel-for loops.
//
// The kernels need exactly one parallel pattern: run fn(i) for i in [0, n)
// on up to T threads, dynamically load-balanced, and return when all are
// done. The caller works too. Between calls workers spin for a short while
// (kSpinMicros) watching an atomic generation counter, then sleep on a
// condition variable: back-to-back calls (one per layer in a decode step)
// start in well under a microsecond instead of paying a futex wake-up
// (~40 us on these VMs). Built on std::thread, std::mutex and atomics (not
// OpenMP) so ThreadSanitizer sees every synchronisation and checks the code
// that runs on it.
//
// Thread safety: ParallelFor may be called from any thread; concurrent calls
// are serialised (one loop runs at a time). REQUIRES: fn does not call
// ParallelFor on the same pool (that would deadlock).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pagekv {

class ThreadPool {
 public:
  // A pool of `num_threads` threads in total: the caller plus
  // num_threads - 1 workers. REQUIRES: num_threads >= 1.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) on at most max_threads threads (0 or
  // more than the pool: all of them); indices are handed out one at a time
  // in increasing order. Returns when every call has returned.
  void ParallelFor(int64_t n, int max_threads, const std::function<void(int64_t)>& fn);

  // The process-wide pool with one thread per hardware thread, created on
  // first use.
  static ThreadPool& Shared();

 private:
  void WorkerLoop(int index);
  void RunIndices();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one ParallelFor at a time

  // How long an idle worker, or a caller waiting for stragglers, spins
  // before blocking.
  static constexpr int64_t kSpinMicros = 200;

  std::mutex mutex_;  // pairs with the two condition variables
  std::condition_variable wake_;
  std::condition_variable done_;
  // The current loop. Written by the caller before it publishes a new epoch
  // (release); read by the workers taking part after they see it (acquire).
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  // (generation << 16) | active workers: one word, so a worker never pairs a
  // generation with another loop's worker count. Workers with index < the
  // count join the loop.
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> running_{0};  // workers still inside the current loop
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> next_{0};
};

}  // namespace pagekv
