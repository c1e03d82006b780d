#include "base/thread_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexExactlyOnce) {
  ThreadPool pool(4);
  for (int64_t n : {1, 2, 3, 17, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool.ParallelFor(n, 0, [&](int64_t i) { hits[static_cast<size_t>(i)].fetch_add(1); });
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(ThreadPoolTest, ResultsWrittenByWorkersAreVisibleAfterTheCall) {
  ThreadPool pool(3);
  std::vector<int64_t> out(10000, -1);
  for (int round = 0; round < 50; ++round) {
    pool.ParallelFor(static_cast<int64_t>(out.size()), 0, [&](int64_t i) { out[static_cast<size_t>(i)] = i * round; });
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], static_cast<int64_t>(i) * round);
  }
}

TEST(ThreadPoolTest, HonoursTheThreadLimit) {
  ThreadPool pool(4);
  std::atomic<int> inside{0}, most{0};
  pool.ParallelFor(200, 2, [&](int64_t) {
    const int now = inside.fetch_add(1) + 1;
    int prev = most.load();
    while (now > prev && !most.compare_exchange_weak(prev, now)) {
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    inside.fetch_sub(1);
  });
  EXPECT_LE(most.load(), 2);
}

TEST(ThreadPoolTest, ConcurrentCallersAreSerialisedSafely) {
  ThreadPool pool(2);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 20; ++r) pool.ParallelFor(100, 0, [&](int64_t i) { total.fetch_add(i); });
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 3 * 20 * (99 * 100 / 2));
}

// A worker descheduled while it holds an index (here: sleeping in it) makes
// the caller wait once; the pool then runs the next calls on the caller
// alone, and hands work to the workers again after the solo stretch (200 ms
// here, so a loaded machine does not outrun it). The caller's longest index
// (its wait for the worker to wake) must stay under a quarter of the 200 ms.
// One loop whose worker sleeps 200 ms in the first index it claims; the
// caller's indices wait (bounded) until a worker holds one, so the loop is
// shared even when the worker wakes slowly on a loaded machine. False when
// no worker claimed an index within 2 s.
bool LoopWithALateWorker(ThreadPool& pool) {
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> slept{false};
  pool.ParallelFor(3, 0, [&](int64_t) {
    if (std::this_thread::get_id() != caller) {
      if (!slept.exchange(true)) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      return;
    }
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!slept && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  });
  return slept;
}

TEST(ThreadPoolTest, ALateWorkerSendsTheNextCallsToTheCallerAloneForAWhile) {
  // Another task is runnable beside the pool (a neighbour on this machine).
  ThreadPool pool(2, std::chrono::milliseconds(200), [] { return 3; });
  const std::thread::id caller = std::this_thread::get_id();
  const ThreadPool::Stats before = pool.stats();
  if (!LoopWithALateWorker(pool)) GTEST_SKIP() << "no worker claimed an index within 2 s (an overloaded machine)";
  const ThreadPool::Stats late = pool.stats();
  EXPECT_EQ(late.late_loops - before.late_loops + late.crowded_loops - before.crowded_loops, 1)
      << "late " << late.late_loops << ", crowded " << late.crowded_loops << ", parallel " << late.parallel_loops;
  EXPECT_EQ(late.host_stalls, before.host_stalls);
  EXPECT_TRUE(pool.RunningAlone());
  std::atomic<int> elsewhere{0};
  std::vector<std::atomic<int>> hits(100);
  pool.ParallelFor(100, 0, [&](int64_t i) {
    hits[static_cast<size_t>(i)].fetch_add(1);
    if (std::this_thread::get_id() != caller) elsewhere.fetch_add(1);
  });
  for (const auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_EQ(elsewhere.load(), 0) << "a call during the solo stretch ran on a worker";
  EXPECT_GE(pool.stats().solo_loops - late.solo_loops, 2);  // RunningAlone() and the call
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_FALSE(pool.RunningAlone());
  const int64_t parallel = pool.stats().parallel_loops;
  pool.ParallelFor(4, 0, [](int64_t) {});
  EXPECT_EQ(pool.stats().parallel_loops, parallel + 1);
}

// A neighbour that comes back a little after each solo stretch doubles the
// next one, however many quick loops ran in between (at batch 1 a dozen
// loops fit in the few milliseconds before the neighbour takes a core
// again; counting loops alone restarted every stretch from the shortest).
TEST(ThreadPoolTest, TroubleSoonAfterAStretchDoublesTheNextOneWhateverTheLoopCount) {
  ThreadPool pool(2, std::chrono::milliseconds(500), [] { return 3; });
  if (!LoopWithALateWorker(pool)) GTEST_SKIP() << "no worker claimed an index within 2 s (an overloaded machine)";
  ASSERT_EQ(pool.stats().last_stretch_us, 500000);
  while (pool.RunningAlone()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (int i = 0; i < 20; ++i) pool.ParallelFor(4, 0, [](int64_t) {});  // more loops than the probe counts
  // The next trouble ~200 ms after the stretch ended (the worker's sleep).
  if (!LoopWithALateWorker(pool)) GTEST_SKIP() << "a quick loop was late (an overloaded machine): the pool went solo";
  EXPECT_EQ(pool.stats().last_stretch_us, 1000000);
}

// The same late loop while nothing else on this machine is runnable (the
// host paused a vCPU, as on a shared cloud host): going solo would only lose
// the second core, so the pool counts a host stall and keeps both threads.
TEST(ThreadPoolTest, TroubleWithNothingElseRunnableIsAHostStallAndChangesNothing) {
  std::atomic<int> asked{0};
  ThreadPool pool(2, std::chrono::milliseconds(200), [&] {
    asked.fetch_add(1);
    return 1;  // only the caller
  });
  const ThreadPool::Stats before = pool.stats();
  if (!LoopWithALateWorker(pool)) GTEST_SKIP() << "no worker claimed an index within 2 s (an overloaded machine)";
  const ThreadPool::Stats after = pool.stats();
  EXPECT_GE(asked.load(), 1);
  EXPECT_EQ(after.late_loops - before.late_loops + after.crowded_loops - before.crowded_loops, 1);
  EXPECT_GE(after.host_stalls - before.host_stalls, 1);
  EXPECT_FALSE(pool.RunningAlone());
  const int64_t parallel = pool.stats().parallel_loops;
  pool.ParallelFor(4, 0, [](int64_t) {});
  EXPECT_EQ(pool.stats().parallel_loops, parallel + 1);
}

// An unreadable count (-1) is taken as a competitor being there: the pool
// behaves as it did before it looked.
TEST(ThreadPoolTest, AnUnknownRunnableCountCountsAsACompetitor) {
  ThreadPool pool(2, std::chrono::milliseconds(200), [] { return -1; });
  if (!LoopWithALateWorker(pool)) GTEST_SKIP() << "no worker claimed an index within 2 s (an overloaded machine)";
  EXPECT_EQ(pool.stats().host_stalls, 0);
  EXPECT_TRUE(pool.RunningAlone());
}

// Loops of every size and thread limit from two callers, some right after
// the workers went to sleep: every index runs exactly once (the claim
// counter is tagged with its loop, so a worker that saw an older loop never
// takes an index of a newer one).
TEST(ThreadPoolTest, BackToBackLoopsFromManyThreadsRunEveryIndexOnce) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  for (int c = 0; c < 2; ++c) {
    callers.emplace_back([&, c] {
      for (int r = 0; r < 300; ++r) {
        const int64_t n = 1 + (r * 7 + c) % 40;
        pool.ParallelFor(n, 1 + r % 3, [&](int64_t i) { total.fetch_add(i + 1); });
        if (r % 50 == 0) std::this_thread::sleep_for(std::chrono::microseconds(500));  // workers fall asleep
      }
    });
  }
  for (auto& t : callers) t.join();
  int64_t expected = 0;
  for (int c = 0; c < 2; ++c)
    for (int r = 0; r < 300; ++r) {
      const int64_t n = 1 + (r * 7 + c) % 40;
      expected += n * (n + 1) / 2;
    }
  EXPECT_EQ(total.load(), expected);
}

}  // namespace
}  // namespace pagekv
