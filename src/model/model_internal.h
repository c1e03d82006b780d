// What the runners' forward passes share inside model/: timing, per-thread
// scratch, the split of per-row work over the pool, and what GGUF metadata
// keys and tensor names look like.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "base/thread_pool.h"
#include "kernels/backend.h"
#include "model/gguf_file.h"

namespace pagekv::model_internal {

// Adds the seconds of its lifetime to *sink when there is one.
class Stopwatch {
 public:
  explicit Stopwatch(double* sink) : sink_(sink), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() {
    if (sink_ != nullptr) *sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;

 private:
  double* sink_;
  std::chrono::steady_clock::time_point start_;
};

// Per-thread scratch for a forward pass's activations, reused from step to
// step: a long step's buffers are tens of MiB, which allocated fresh every
// step cost page faults and zero-filling. Contents are not cleared; every
// use writes its rows before reading them.
template <typename T>
std::span<T> Scratch(size_t slot, size_t n) {
  thread_local std::vector<std::vector<T>> pool;
  if (pool.size() <= slot) pool.resize(slot + 1);
  if (pool[slot].size() < n) pool[slot].resize(n);
  return {pool[slot].data(), n};
}

// The same in the backend's memory (kernels/backend.h Backend::Scratch):
// what a runner that also runs on a device backend takes its activations
// from. Pools: 0 floats, 1 bytes.
template <typename T>
std::span<T> Scratch(const Backend& be, size_t slot, size_t n) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, std::byte>);
  constexpr int kPool = std::is_same_v<T, float> ? 0 : 1;
  const std::span<std::byte> b = be.Scratch(kPool, slot, n * sizeof(T));
  return {reinterpret_cast<T*>(b.data()), n};
}

// Per-row work (norms, rotary, KV conversion, residuals, SiLU) of a long
// step split over the pool in chunks of rows, so the second core does not
// wait through it; a decode step's few rows stay on this thread.
// fn(first row, end row).
template <typename Fn>
void ForRows(int64_t n, int threads, const Fn& fn) {
  constexpr int64_t kChunk = 64;
  if (n < 2 * kChunk || threads == 1) {
    fn(int64_t{0}, n);
    return;
  }
  ThreadPool::Shared().ParallelFor((n + kChunk - 1) / kChunk, threads,
                                   [&](int64_t i) { fn(i * kChunk, std::min(n, (i + 1) * kChunk)); });
}

// "blk.<n>.<part>" with n in [0, layers): the part, else empty.
std::string_view LayerPart(std::string_view name, int32_t layers, int32_t* layer = nullptr);

// Whether `key` (after "<arch>.") is in `known`.
bool KeyIn(std::string_view key, std::span<const std::string_view> known);

// Refuses any "<arch>.*" key outside `known` by name: a model that needs
// something the runner does not do must not run silently wrong.
Status CheckArchKeys(const GgufFile& file, const std::string& arch, std::span<const std::string_view> known);

// An int metadata key in (0, 2^24], or its default when absent (`required`
// false) or an error naming it.
Status ReadDim(const GgufFile& file, const std::string& key, int32_t& out, bool required = true);

}  // namespace pagekv::model_internal
