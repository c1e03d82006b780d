#include "base/thread_pool.h"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "base/check.h"

namespace pagekv {

namespace {

// The kernel's count of runnable tasks now (the fourth field of
// /proc/loadavg: "running/total"), the reader included; -1 when unreadable.
int RunnableTasksFromProc() {
  const int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[128];
  const ssize_t got = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (got <= 0) return -1;
  buf[got] = '\0';
  int fields = 0, running = -1;
  for (const char* p = buf; *p != '\0'; ++p) {
    if (*p == ' ' && ++fields == 3) {
      running = static_cast<int>(std::strtol(p + 1, nullptr, 10));
      break;
    }
  }
  return running;
}

}  // namespace

ThreadPool::ThreadPool(int num_threads, std::chrono::milliseconds shortest_solo, std::function<int()> runnable_tasks)
    : num_threads_(num_threads),
      min_backoff_(shortest_solo),
      backoff_(shortest_solo),
      runnable_tasks_(runnable_tasks ? std::move(runnable_tasks) : std::function<int()>(RunnableTasksFromProc)) {
  PAGEKV_CHECK(num_threads >= 1 && num_threads <= 0xffff && shortest_solo.count() > 0);
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

ThreadPool::Stats ThreadPool::stats() const {
  Stats s;
  s.parallel_loops = parallel_loops_.load(std::memory_order_relaxed);
  s.solo_loops = solo_loops_.load(std::memory_order_relaxed);
  s.late_loops = late_loops_.load(std::memory_order_relaxed);
  s.preempted_spins = preempted_spins_.load(std::memory_order_relaxed);
  s.crowded_loops = crowded_loops_.load(std::memory_order_relaxed);
  s.host_stalls = host_stalls_.load(std::memory_order_relaxed);
  s.last_stretch_us = last_stretch_us_.load(std::memory_order_relaxed);
  return s;
}

bool ThreadPool::CompetitorRunning() const {
  const int running = runnable_tasks_();
  if (running < 0) return true;  // unknown: assume the worst, as before
  return running > num_threads() - sleeping_.load(std::memory_order_relaxed);
}

bool ThreadPool::RunningAlone() {
  if (Clock::now().time_since_epoch().count() >= solo_until_.load(std::memory_order_relaxed)) return false;
  solo_loops_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

int64_t ThreadPool::Work(uint32_t generation, Clock::duration* longest) {
  const size_t slot = generation & 1u;
  int64_t ran = 0;
  for (;;) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(word >> 32) != generation) return ran;  // a newer loop: not ours
    const auto index = static_cast<int64_t>(word & 0xffffffffu);
    const int64_t n = loop_n_[slot].load(std::memory_order_acquire);
    if (index >= n) return ran;
    // Claimed only if the loop is still the one read above.
    if (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    const std::function<void(int64_t)>& fn = *loop_fn_[slot].load(std::memory_order_acquire);
    if (longest != nullptr) {
      const Clock::time_point start = Clock::now();
      fn(index);
      *longest = std::max(*longest, Clock::now() - start);
    } else {
      fn(index);
    }
    ++ran;
    if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_one();
    }
  }
}

namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A gap this long between two looks at the clock in a spin means the
// spinning thread was descheduled: something else wants its core.
constexpr auto kPreemptedGap = std::chrono::microseconds(50);

// Spins until done() or `micros` pass, or the thread is found to have been
// descheduled while spinning (*preempted set); returns done().
template <typename Pred>
bool SpinUntil(Pred done, int64_t micros, bool* preempted) {
  auto last = std::chrono::steady_clock::now();
  const auto deadline = last + std::chrono::microseconds(micros);
  for (int i = 0;; ++i) {
    if (done()) return true;
    CpuRelax();
    if ((i & 63) == 63) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last > kPreemptedGap) {
        *preempted = true;
        return done();
      }
      if (now > deadline) return done();
      last = now;
    }
  }
}

// CPU time this thread has run. A system call (~0.7 us on these VMs), so
// sampled, not read on every loop.
std::chrono::nanoseconds ThreadCpuTime() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

}  // namespace

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;  // generation of the last loop this worker looked at
  // After a spin was descheduled, the core is shared with another thread or
  // process: spinning would take its time from whoever runs there (the
  // caller, when both land on one core), so the worker sleeps between loops
  // for a while instead.
  Clock::time_point quiet_until{};
  for (;;) {
    auto fresh = [&] {
      return stop_.load(std::memory_order_acquire) || (epoch_.load(std::memory_order_acquire) >> 16) != seen;
    };
    bool preempted = false;
    const bool spin = Clock::now() >= quiet_until;
    if (!(spin && SpinUntil(fresh, kSpinMicros, &preempted))) {
      if (preempted) {
        if (CompetitorRunning()) {
          quiet_until = Clock::now() + kQuiet;
          preempted_spins_.fetch_add(1, std::memory_order_relaxed);
        } else {
          host_stalls_.fetch_add(1, std::memory_order_relaxed);
        }
      }
      sleeping_.fetch_add(1, std::memory_order_relaxed);
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, fresh);
      }
      sleeping_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    const uint64_t epoch = epoch_.load(std::memory_order_acquire);
    seen = epoch >> 16;
    if (static_cast<uint64_t>(index) >= (epoch & 0xffff)) continue;  // not needed for this loop
    Work(static_cast<uint32_t>(seen), nullptr);
  }
}

void ThreadPool::ParallelFor(int64_t n, int max_threads, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  PAGEKV_CHECK(n < (int64_t{1} << 32));
  const int threads = max_threads <= 0 ? num_threads() : std::min(max_threads, num_threads());
  const int helpers = static_cast<int>(std::min<int64_t>(threads - 1, n - 1));
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> call(call_mutex_);
  const Clock::time_point start = Clock::now();
  if (start.time_since_epoch().count() < solo_until_.load(std::memory_order_relaxed)) {  // trouble lately: alone
    solo_loops_.fetch_add(1, std::memory_order_relaxed);
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  parallel_loops_.fetch_add(1, std::memory_order_relaxed);
  ++parallel_since_solo_;
  const uint64_t generation = (epoch_.load(std::memory_order_relaxed) >> 16) + 1;
  const auto tag = static_cast<uint32_t>(generation);
  const size_t slot = tag & 1u;
  // Every index of the previous loop has returned, so no worker reads its
  // slot's values or counts into finished_ any more.
  loop_n_[slot].store(n, std::memory_order_relaxed);
  loop_fn_[slot].store(&fn, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  claim_.store(static_cast<uint64_t>(tag) << 32, std::memory_order_release);
  {
    // Under the mutex, so a worker between its predicate check and its wait
    // cannot miss the new epoch.
    std::lock_guard<std::mutex> lock(mutex_);
    epoch_.store((generation << 16) | static_cast<uint64_t>(helpers), std::memory_order_release);
  }
  wake_.notify_all();
  Clock::duration longest{0};
  // Every kCpuSampleEvery-th loop: did the caller keep its core while it
  // worked? A caller that ran for much less than the wall time of its own
  // share was descheduled: its core is shared (say, with a worker the
  // scheduler put beside it while a busy neighbour holds the other core),
  // and more threads than cores only slow the loop down.
  const bool sample = ++loops_since_sample_ >= kCpuSampleEvery;
  const std::chrono::nanoseconds cpu_start = sample ? ThreadCpuTime() : std::chrono::nanoseconds{0};
  Work(tag, &longest);
  bool crowded = false;
  if (sample) {
    loops_since_sample_ = 0;
    const Clock::duration wall = Clock::now() - start;
    crowded = wall > kCrowdedMinWall && ThreadCpuTime() - cpu_start < wall * 7 / 10;
  }
  auto finished = [&] { return finished_.load(std::memory_order_acquire) == n; };
  if (finished() && !crowded) return;
  const Clock::time_point waiting = Clock::now();
  bool preempted = false;
  if (!finished() && !SpinUntil(finished, kSpinMicros, &preempted)) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, finished);
  }
  // Late: the caller waited for a claimed index much longer than any index
  // it ran itself took (a worker descheduled mid-index; ordinary imbalance
  // is within a few index lengths).
  const Clock::time_point end = Clock::now();
  const Clock::duration limit = 4 * longest + std::chrono::microseconds(100);
  if (crowded || end - waiting > limit) {
    (crowded ? crowded_loops_ : late_loops_).fetch_add(1, std::memory_order_relaxed);
    if (!CompetitorRunning()) {  // the host paused a vCPU: nothing here to yield to
      host_stalls_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    // Trouble again in the first loops after the last solo stretch (the
    // probe): the neighbour is still there, stay alone twice as long.
    // Trouble after a run of good parallel loops is a passing disturbance
    // (a noisy host): start from the shortest stretch. Doubling on any
    // trouble within twice the stretch instead kept a merely noisy machine
    // solo for most of a run (83 of 107 tokens/s on one q8_0 model).
    // A neighbour that takes a core every few milliseconds lands its next
    // trouble a few milliseconds after a short stretch, whatever the loop
    // count (loops of 0.3 ms at batch 1: a dozen in 4 ms), so trouble within
    // one stretch's length of time after it counts too.
    const bool soon = parallel_since_solo_ <= kProbeLoops || end - stretch_end_ < backoff_;
    const bool probe = soon && last_trouble_ != Clock::time_point{} && end - last_trouble_ < 2 * backoff_ + kMaxBackoff;
    backoff_ = probe ? std::max(min_backoff_, std::min(kMaxBackoff, 2 * backoff_)) : min_backoff_;
    last_trouble_ = end;
    parallel_since_solo_ = 0;
    stretch_end_ = end + backoff_;
    last_stretch_us_.store(std::chrono::duration_cast<std::chrono::microseconds>(backoff_).count(), std::memory_order_relaxed);
    solo_until_.store(stretch_end_.time_since_epoch().count(), std::memory_order_relaxed);
  }
}

}  // namespace pagekv
