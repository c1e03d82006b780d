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

}  // namespace
}  // namespace pagekv
