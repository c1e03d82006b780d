// CudaBackend's insides, shared by its two files (cuda_backend.cc: memory,
// transfers, weight products and the layer ops; cuda_backend_attention.cc:
// the attention calls). Not part of the module's interface.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/layer_ops.h"
#include "cuda/paged_attention.h"
#include "cuda/step_graphs.h"
#include "kernels/ops.h"
#include "kernels/weight_formats.h"

namespace pagekv {
namespace cuda_backend_internal {

inline std::string CudaMessage(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }

// The device arena: cudaMalloc'd, zeroed (as a fresh host arena is).
class DeviceArena final : public KvArena {
 public:
  DeviceArena(std::byte* data, int64_t size) : KvArena(data, size, false) {}
  ~DeviceArena() override { cudaFree(data()); }
};

// A stream-ordered temporary: freed (stream-ordered) when it goes out of scope.
class Temp {
 public:
  Temp(cudaStream_t stream, size_t bytes) : stream_(stream) {
    if (bytes > 0) error_ = cudaMallocAsync(&p_, bytes, stream);
  }
  ~Temp() {
    if (p_ != nullptr) cudaFreeAsync(p_, stream_);
  }
  Temp(const Temp&) = delete;
  Temp& operator=(const Temp&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  cudaError_t error() const { return error_; }

 private:
  cudaStream_t stream_;
  void* p_ = nullptr;
  cudaError_t error_ = cudaSuccess;
};

struct DeviceWeights {
  void* data = nullptr;
  cudaDataType_t type = CUDA_R_32F;
  int64_t bytes = 0;
};

// The cuda::KvType of a layer's stored rows, or an error naming what the
// device does not read.
inline Result<cuda::KvType> RowType(const KvFormat& f, int32_t row_elems) {
  if (f.IsKivi()) return UnimplementedError("INT4 KIVI layers are not read on the CUDA backend: use --kv-dtype f16, bf16, int8 or fp8, or the CPU backend");
  if (f.hadamard) return UnimplementedError("Hadamard-rotated KV rows are not read on the CUDA backend: store them unrotated, or use the CPU backend");
  if (f.scale_axis == ScaleAxis::kNone) {
    switch (f.dtype) {
      case DType::kF32: return cuda::KvType::kF32;
      case DType::kF16: return cuda::KvType::kF16;
      case DType::kBF16: return cuda::KvType::kBF16;
      default: break;
    }
  } else if (f.IsStoredQuantized(row_elems)) {
    switch (f.dtype) {
      case DType::kInt8: return cuda::KvType::kInt8;
      case DType::kFP8E4M3: return cuda::KvType::kFp8E4M3;
      case DType::kFP8E5M2: return cuda::KvType::kFp8E5M2;
      default: break;
    }
  }
  return UnimplementedError("this KV row format is not read on the CUDA backend");
}

}  // namespace cuda_backend_internal

using cuda_backend_internal::CudaMessage;
using cuda_backend_internal::RowType;
using cuda_backend_internal::Temp;
using cuda_backend_internal::DeviceWeights;
using cuda_backend_internal::DeviceArena;
using cuda_backend_internal::StepGraphs;

struct CudaBackend::Impl {
  int device = 0;
  std::string name;
  bool bf16_products = false;
  bool tensor_core_prefill = false;
  bool tensor_core_decode = false;
  int multiprocessors = 1;
  cudaStream_t stream = nullptr;       // compute: every math call, in call order
  cudaStream_t copy_stream = nullptr;  // block transfers (tier moves)
  cudaEvent_t compute_done = nullptr;
  mutable std::mutex copy_mu;          // one transfer at a time: the pinned staging
  mutable void* pinned = nullptr;
  mutable size_t pinned_size = 0;
  // The compute stream's order: every call that enqueues on `stream` holds
  // it for the whole call (recursive: calls use each other), so that a
  // call's work is contiguous on the stream, a recorded step's calls see one
  // consistent state, and a capture sees only the step's work. It also
  // guards the pinned ring, the cuBLAS handle and the step recorder. Lock
  // order: stream_mu, then mu, then err_mu.
  mutable std::recursive_mutex stream_mu;
  mutable void* ring = nullptr;  // H2D's pinned ring
  mutable size_t ring_at = 0;
  mutable bool ring_failed = false;
  cublasHandle_t blas = nullptr;
  void* blas_workspace = nullptr;  // given to cuBLAS where steps are captured
  // Decode steps as CUDA graphs (CudaBackendOptions::cuda_graphs): null when off.
  std::unique_ptr<StepGraphs> graphs;
  mutable std::mutex mu;      // the weight cache, the scratch map, the weight vectors
  mutable std::mutex err_mu;  // the error (taken last)
  mutable Status error = Status::Ok();
  mutable std::map<std::tuple<const std::byte*, int, int64_t, int64_t, bool, int>, DeviceWeights> weights;
  mutable std::map<std::tuple<std::thread::id, int, size_t>, std::pair<void*, size_t>> scratch;
  mutable std::map<const float*, std::pair<float*, int64_t>> vectors;  // host norm weights / biases -> device copies
  mutable std::atomic<int64_t> weight_bytes{0};
  mutable std::atomic<int64_t> fallbacks{0};
  // The integer arrays of recent attention calls (block tables, lengths,
  // query rows, windows), kept on the device: every layer of a step reads
  // the same ones, so they cross once a step instead of once a layer. A few
  // entries, so that a model's two kinds of layer (sliding-window and
  // global) and its decode and prefill calls do not evict each other.
  struct IntArrays {
    std::vector<int32_t> host;
    int32_t* device = nullptr;
    size_t capacity = 0;  // ints
    uint64_t used = 0;    // for least-recently-used replacement
  };
  static constexpr int kIntArrayEntries = 4;
  mutable IntArrays ints[kIntArrayEntries];  // under stream_mu
  mutable uint64_t ints_clock = 0;
  mutable std::atomic<int64_t> int_uploads{0};

  ~Impl();

  // Every call runs on the backend's device, whichever host thread makes it.
  void Enter() const { cudaSetDevice(device); }

  void Note(cudaError_t e, const char* what) const {
    if (e == cudaSuccess) return;
    std::lock_guard lock(err_mu);
    if (error.ok()) error = InternalError(std::string("CUDA backend: ") + what + ": " + CudaMessage(e));
  }
  void NoteStatus(const Status& s) const {
    if (s.ok()) return;
    std::lock_guard lock(err_mu);
    if (error.ok()) error = s;
  }
  // The recorded error (kept), or ok.
  Status Recorded() const {
    std::lock_guard lock(err_mu);
    return error;
  }
  Status Check(cudaError_t e, const char* what) const {
    Note(e, what);
    return Recorded();
  }

  // --- The compute stream, and recorded steps (step_graphs.h) ---
  std::unique_lock<std::recursive_mutex> Lock() const { return std::unique_lock(stream_mu); }
  // Whether a replayable step is being recorded (stream_mu held).
  bool Recording() const { return graphs != nullptr && graphs->recording(); }
  // Enqueues `op` on the compute stream now, or appends it to the step being
  // recorded with `key`: every value it launches with beside memory
  // contents (StepGraphs::Key of each pointer, size and scalar), so that a
  // step whose keys all equal a kept graph's makes that graph's launches.
  template <typename Op>
  cudaError_t Enqueue(std::initializer_list<uint64_t> key, Op&& op) const {
    std::lock_guard lock(stream_mu);
    if (Recording()) {
      graphs->Append(key, std::forward<Op>(op));
      return cudaSuccess;
    }
    return op(stream);
  }
  // Runs what the step recorded so far and ends the recording, before a
  // call that waits for the device or cannot be recorded; the rest of the
  // step then runs call by call.
  void Flush() const;
  // Device memory for one call's inputs or temporaries: stream-ordered and
  // freed with `temp` outside a recorded step; while one is recorded, the
  // step's own (a Temp's free would be enqueued before the recorded work
  // that reads it). Null (the error in *e) when none can be had.
  void* CallMemory(size_t bytes, std::optional<Temp>& temp, cudaError_t* e) const;
  // A reusable temporary (lane 0: decode's split partials, 1: activations
  // rounded for a product): consumed by the call's own later operations.
  void* LaneMemory(int lane, size_t bytes, std::optional<Temp>& temp, cudaError_t* e) const;
  // A recorded step's block tables: each distinct array once per step, at
  // an offset of the step's memory that repeats from step to step.
  mutable std::vector<std::pair<std::vector<int32_t>, int32_t*>> step_ints;

  // Host -> device on the compute stream through a pinned ring, so the copy
  // is a true asynchronous DMA (a pageable source may make the runtime wait
  // for the stream before copying it) and the caller's buffer is free at
  // return. The ring is written again only after the stream has finished
  // every copy out of it (one stream sync per wrap). Sources larger than a
  // quarter of it, or no pinned memory, go pageable.
  // While a step is recorded, the bytes go to the step's own pinned memory
  // and their copy is one of its operations (step_graphs.h).
  static constexpr size_t kRingBytes = size_t{8} << 20;
  cudaError_t H2D(void* dst, const void* src, size_t bytes) const;

  // The device copy of `host`: an entry that holds the same ints, or the
  // least recently used one, written again on the compute stream (after
  // every kernel enqueued before it, so no reader of its old contents sees
  // the new ones). Null, with the error recorded, when it cannot be made.
  // The caller holds stream_mu until it has enqueued the kernels that read
  // it, so another thread's call cannot rewrite the entry first.
  const int32_t* DeviceInts(const std::vector<int32_t>& host) const;

  // A weight vector (norm weights, a bias) of n floats where the kernels
  // can read it: itself when it is device (or managed) memory, else its
  // device copy, uploaded on first use and kept (model weights do not
  // change). Null (and the error recorded) when it cannot be.
  const float* Resident(const float* p, int64_t n) const;

  // The device copy of `w` in the type the product needs (uploaded on first use).
  Result<DeviceWeights> Weights(const WeightMatrix& w, Activations activations) const;

  Status Product(const WeightMatrix& w, const float* x, int64_t tokens, float* y, Activations activations) const;

  // Spans of each slab of `block` (payload order: layer, plane, head), the
  // arena side `from` and the payload side `to` (swapped by the caller).
  static std::vector<cuda::SpanCopy> BlockSpans(const KvLayout& layout, int64_t block);

  cudaError_t Spans(const std::vector<cuda::SpanCopy>& spans, const void* src, void* dst, cudaStream_t on = nullptr) const;

  // Block transfers run on the copy stream, beside the forward pass on the
  // compute stream: each first waits for the compute work enqueued before
  // it (what may still write or read the block), not for what comes after,
  // and stages through pinned host memory so its DMA is asynchronous. The
  // call returns when its bytes are in place (the callers' protocol: a
  // loaded block is used only after its load returns).
  std::byte* Pinned(size_t bytes) const;
  cudaError_t AfterCompute() const;

};

}  // namespace pagekv
