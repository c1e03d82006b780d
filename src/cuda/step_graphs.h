// CUDA graphs of replayable steps, for CudaBackend (cuda_backend.h,
// CudaBackendOptions::cuda_graphs). Not part of the module's interface.
//
// A decode step makes the same backend calls in the same order with the
// same sizes and pointers from one step to the next; only the contents of a
// few host arrays change (token ids, positions, slots, block tables and
// lengths). So while a step is recorded, each call does its host work at
// once (checks, tables, the host bytes it uploads) and, instead of
// enqueueing, appends its enqueue as an operation, with a key: every value
// the operation launches with beside memory contents. Host bytes are copied
// into pinned memory of the step's own, at an offset that depends only on
// the order and sizes of the calls, and their upload is one of the
// operations; device temporaries come from device memory of the step's own
// (inputs, bump-allocated) or from reusable lanes (a value the next
// operations in stream order consume, so one buffer serves every call).
//
// At the end of the step (or at the first call that must wait for the
// device), the keys of the whole step are compared with those of the
// graphs kept: equal keys mean the same launches from the same addresses,
// so the kept graph is launched, reading the new contents; otherwise the
// operations are captured into a new graph (kept, least recently used
// replaced), which is launched. Operations that cannot be captured run as
// they are, and the keys are remembered as not capturable.
//
// Thread safety: none of its own; CudaBackend calls it under the lock that
// orders its compute stream.
#pragma once

#include <cuda_runtime.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

namespace pagekv::cuda_backend_internal {

class StepGraphs {
 public:
  using Op = std::function<cudaError_t(cudaStream_t)>;

  explicit StepGraphs(cudaStream_t stream) : stream_(stream) {}
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  // A key's element for a value an operation launches with.
  template <typename T>
  static uint64_t Key(T v) {
    if constexpr (std::is_pointer_v<T>) {
      return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(v));
    } else if constexpr (std::is_same_v<T, float>) {
      return std::bit_cast<uint32_t>(v);
    } else if constexpr (std::is_enum_v<T>) {
      return static_cast<uint64_t>(static_cast<std::underlying_type_t<T>>(v));
    } else {
      static_assert(std::is_integral_v<T>, "a key holds pointers, integers, enums and floats");
      return static_cast<uint64_t>(v);
    }
  }

  bool recording() const { return recording_; }
  // Starts recording a step. The stream must be idle (the caller has
  // synchronized it): the step's pinned and device memory is rewritten.
  // Errors: freeing or allocating the step's memory.
  cudaError_t Begin();
  // Appends an operation (recording) with its key.
  void Append(std::initializer_list<uint64_t> key, Op op);
  // Host bytes copied now into the step's pinned memory and uploaded to
  // `dst` by an operation; an error when pinned memory cannot be had.
  cudaError_t Upload(void* dst, const void* src, size_t bytes);
  // `bytes` of the step's device memory, valid until the step has run
  // (null when it cannot be allocated).
  void* Device(size_t bytes);
  // Reusable device buffer `lane` (0 or 1) of at least `bytes`: what one
  // operation writes and the next ones read, in stream order.
  void* Lane(int lane, size_t bytes);
  // A device buffer the recorded operations may still read: freed at the
  // next Begin, once the stream has run them.
  void Retire(void* device) { retired_device_.push_back(device); }
  // Ends recording and runs the operations (a kept graph, a new one, or the
  // operations themselves); the first error.
  cudaError_t Flush();

  int64_t launches() const { return launches_; }    // graph launches
  int64_t captures() const { return captures_; }    // graphs captured and instantiated
  int64_t uncaptured() const { return uncaptured_; }  // steps run operation by operation

 private:
  // Memory allocated in chunks during a step, one chunk of the total from
  // the next Begin on (so a step's offsets, and so its keys, settle).
  struct Bump {
    bool pinned = false;
    std::vector<std::pair<std::byte*, size_t>> chunks;
    size_t at = 0;  // in the last chunk
    std::byte* Take(size_t bytes);  // null when it cannot be allocated
    cudaError_t Add(size_t bytes);  // a chunk
    cudaError_t Settle();  // at Begin: one chunk, offsets from 0
    void Free();
  };
  struct Graph {
    std::vector<uint64_t> key;
    cudaGraphExec_t exec = nullptr;  // null: not capturable, run the operations
    uint64_t used = 0;
  };
  static constexpr size_t kGraphs = 16;
  static constexpr uint64_t kEnd = ~uint64_t{0};

  cudaError_t RunOps();

  cudaStream_t stream_;
  bool recording_ = false;
  std::vector<Op> ops_;
  std::vector<uint64_t> key_;
  Bump host_{true}, device_{false};
  std::pair<void*, size_t> lanes_[2] = {};
  std::vector<void*> retired_device_, retired_host_;
  std::vector<Graph> graphs_;
  uint64_t clock_ = 0;
  int64_t launches_ = 0, captures_ = 0, uncaptured_ = 0;
};

}  // namespace pagekv::cuda_backend_internal
