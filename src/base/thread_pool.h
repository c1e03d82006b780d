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
// A busy neighbour (another process on one of the cores) must not make a
// call slower than running it alone, so:
//  - indices are claimed one at a time from one counter tagged with the
//    loop's generation, and the caller waits only for indices a worker has
//    claimed, never for a worker that has not started yet: a descheduled
//    worker's share is done by whoever is running;
//  - a worker can still be descheduled in the middle of an index it holds.
//    When the caller, done with everything else, waits for such an index far
//    longer than any index it ran itself, the loop counts as late and the
//    pool runs the following calls on the caller alone for a while (5 ms,
//    doubling while trouble recurs in the first loops after each stretch,
//    up to 1 s; back to 5 ms when it comes after a run of good parallel
//    loops: a noisy host, not a neighbour). The same happens when the caller, sampled every fourth
//    loop, ran for under 70% of the wall time of its own share (it was
//    descheduled: its core is shared, so more threads only slow the loop).
//    Stats() counts each case;
//  - a worker whose spin between loops was descheduled (its core is shared)
//    sleeps between loops for the next 50 ms instead of spinning, so it does
//    not take the core from the caller when the scheduler puts both there;
//    it is woken for each loop then (a futex call on the caller's side);
//  - all of this only when another task of this machine is runnable beside
//    the pool's awake threads (the kernel's count of running tasks,
//    /proc/loadavg, read only when trouble is seen). A virtual machine's
//    host pausing a vCPU looks the same from inside (a late worker, a caller
//    with less CPU time than wall time, a long gap in a spin) but there is
//    nothing here to yield to, and going solo or sleeping only loses the
//    second core: such trouble is counted as a host stall and ignored.
//
// Thread safety: ParallelFor may be called from any thread; concurrent calls
// are serialised (one loop runs at a time). REQUIRES: fn does not call
// ParallelFor on the same pool (that would deadlock).
#pragma once

#include <atomic>
#include <chrono>
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
  // num_threads - 1 workers; `shortest_solo`: the first solo stretch after
  // a late or crowded loop (tests lengthen it). REQUIRES: 1 <= num_threads
  // <= 65535, shortest_solo > 0.
  //
  // `runnable_tasks`: how many tasks the kernel could run right now, this
  // thread included (-1: unknown, taken as a competitor being there); by
  // default read from /proc/loadavg. Tests replace it.
  explicit ThreadPool(int num_threads, std::chrono::milliseconds shortest_solo = std::chrono::milliseconds(5),
                      std::function<int()> runnable_tasks = nullptr);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(i) for every i in [0, n) on at most max_threads threads (0 or
  // more than the pool: all of them); indices are handed out one at a time
  // in increasing order. Returns when every call has returned.
  // REQUIRES: n < 2^32.
  void ParallelFor(int64_t n, int max_threads, const std::function<void(int64_t)>& fn);

  // True while the pool runs calls on the caller alone (after a late or
  // crowded loop): a caller with a better single-thread form of its work
  // (one pass instead of chunks) should use it then. Counted as a solo loop.
  bool RunningAlone();

  // What the pool did with the calls that could use more than one thread.
  struct Stats {
    int64_t parallel_loops = 0;  // handed to workers
    int64_t solo_loops = 0;      // run on the caller alone after a late loop
    int64_t late_loops = 0;      // the caller waited for a descheduled worker
    int64_t preempted_spins = 0; // a worker descheduled while spinning for work
    int64_t crowded_loops = 0;   // the caller lost its core while working
    // Late or crowded loops and preempted spins seen while no other task
    // of this machine was runnable (the host paused a vCPU): ignored.
    int64_t host_stalls = 0;
    int64_t last_stretch_us = 0;  // the length of the latest solo stretch (0: none yet)
  };
  Stats stats() const;

  // The process-wide pool with one thread per hardware thread, created on
  // first use.
  static ThreadPool& Shared();

 private:
  using Clock = std::chrono::steady_clock;
  void WorkerLoop(int index);
  // Claims and runs indices of loop `generation` until none is left or the
  // loop is no longer current. Returns how many it ran; the longest one's
  // duration in *longest (when not null).
  int64_t Work(uint32_t generation, Clock::duration* longest);

  // Fixed at construction, before any worker starts: workers read it while
  // the constructor is still filling workers_.
  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one ParallelFor at a time

  // How long an idle worker, or a caller waiting for stragglers, spins
  // before blocking.
  static constexpr int64_t kSpinMicros = 200;

  std::mutex mutex_;  // pairs with the two condition variables
  std::condition_variable wake_;
  std::condition_variable done_;
  // (generation << 16) | helpers: wakes the workers; those with index <
  // helpers join the loop.
  std::atomic<uint64_t> epoch_{0};
  // (generation mod 2^32 << 32) | next index: a worker claims index i by
  // moving it from (g, i) to (g, i + 1), so a worker that saw an older loop
  // can never take an index of a newer one.
  std::atomic<uint64_t> claim_{0};
  // The loop's size and function, in the slot of its generation's parity: a
  // worker reading a slot for loop g while g is current sees g's values (the
  // slot is rewritten only for g + 2, which starts after g has finished).
  std::atomic<int64_t> loop_n_[2] = {0, 0};
  std::atomic<const std::function<void(int64_t)>*> loop_fn_[2] = {nullptr, nullptr};
  std::atomic<int64_t> finished_{0};  // indices of the current loop that returned
  std::atomic<bool> stop_{false};

  // Lateness handling (the caller's side, under call_mutex_).
  // Written under call_mutex_; read by RunningAlone() without it.
  std::atomic<Clock::rep> solo_until_{0};
  Clock::time_point last_trouble_{};
  Clock::time_point stretch_end_{};  // when the last solo stretch ended (or ends)
  std::atomic<int64_t> last_stretch_us_{0};
  const Clock::duration min_backoff_;
  Clock::duration backoff_;
  static constexpr Clock::duration kMaxBackoff = std::chrono::seconds(1);
  std::atomic<int64_t> parallel_loops_{0}, solo_loops_{0}, late_loops_{0}, preempted_spins_{0}, crowded_loops_{0},
      host_stalls_{0};
  // Whether a task other than the pool's awake threads is runnable now.
  bool CompetitorRunning() const;
  const std::function<int()> runnable_tasks_;
  std::atomic<int> sleeping_{0};  // workers blocked on wake_
  int loops_since_sample_ = 0;
  int64_t parallel_since_solo_ = 0;  // parallel loops since the last trouble
  // Trouble within this many parallel loops after a solo stretch, or within
  // one stretch's length of time after it, doubles the next one (the
  // neighbour is still there); later trouble restarts from the shortest.
  static constexpr int64_t kProbeLoops = 8;
  static constexpr int kCpuSampleEvery = 4;
  static constexpr Clock::duration kCrowdedMinWall = std::chrono::microseconds(50);
  // How long a worker sleeps between loops instead of spinning after one of
  // its spins was descheduled.
  static constexpr Clock::duration kQuiet = std::chrono::milliseconds(50);
};

}  // namespace pagekv
