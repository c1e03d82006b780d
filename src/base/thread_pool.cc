#include "base/thread_pool.h"

#include <algorithm>
#include <chrono>

#include "base/check.h"

namespace pagekv {

ThreadPool::ThreadPool(int num_threads) {
  PAGEKV_CHECK(num_threads >= 1 && num_threads <= 0xffff);
  workers_.reserve(static_cast<size_t>(num_threads - 1));
  for (int i = 0; i < num_threads - 1; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true, std::memory_order_release);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ThreadPool& ThreadPool::Shared() {
  static ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

void ThreadPool::RunIndices() {
  for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_;
       i = next_.fetch_add(1, std::memory_order_relaxed)) {
    (*fn_)(i);
  }
}

namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until done() or kSpinMicros pass; returns done().
template <typename Pred>
bool SpinUntil(Pred done, int64_t micros) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  for (int i = 0;; ++i) {
    if (done()) return true;
    CpuRelax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return done();
  }
}

}  // namespace

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;  // generation of the last loop this worker looked at
  for (;;) {
    auto fresh = [&] {
      return stop_.load(std::memory_order_acquire) || (epoch_.load(std::memory_order_acquire) >> 16) != seen;
    };
    if (!SpinUntil(fresh, kSpinMicros)) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, fresh);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    const uint64_t epoch = epoch_.load(std::memory_order_acquire);
    seen = epoch >> 16;
    if (static_cast<uint64_t>(index) >= (epoch & 0xffff)) continue;  // not needed for this loop
    RunIndices();
    if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, int max_threads, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  const int threads = max_threads <= 0 ? num_threads() : std::min(max_threads, num_threads());
  const int helpers = static_cast<int>(std::min<int64_t>(threads - 1, n - 1));
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> call(call_mutex_);
  fn_ = &fn;
  n_ = n;
  next_.store(0, std::memory_order_relaxed);
  running_.store(helpers, std::memory_order_relaxed);
  {
    // Under the mutex, so a worker between its predicate check and its wait
    // cannot miss the new epoch.
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t generation = (epoch_.load(std::memory_order_relaxed) >> 16) + 1;
    epoch_.store((generation << 16) | static_cast<uint64_t>(helpers), std::memory_order_release);
  }
  wake_.notify_all();
  RunIndices();
  auto finished = [&] { return running_.load(std::memory_order_acquire) == 0; };
  if (!SpinUntil(finished, kSpinMicros)) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, finished);
  }
  fn_ = nullptr;
}

}  // namespace pagekv
