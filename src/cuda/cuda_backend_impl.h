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
  mutable std::mutex ints_mu;
  mutable IntArrays ints[kIntArrayEntries];
  mutable uint64_t ints_clock = 0;
  mutable std::atomic<int64_t> int_uploads{0};

  ~Impl() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    graphs.reset();
    cudaFree(blas_workspace);
    for (auto& [key, w] : weights) cudaFree(w.data);
    for (auto& [key, buf] : scratch) cudaFree(buf.first);
    for (auto& [key, vec] : vectors) cudaFree(vec.first);
    for (IntArrays& a : ints) cudaFree(a.device);
    if (copy_stream != nullptr) cudaStreamSynchronize(copy_stream);
    cudaFreeHost(pinned);
    cudaFreeHost(ring);
    if (blas != nullptr) cublasDestroy(blas);
    if (compute_done != nullptr) cudaEventDestroy(compute_done);
    if (copy_stream != nullptr) cudaStreamDestroy(copy_stream);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

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
  void Flush() const {
    std::lock_guard lock(stream_mu);
    if (Recording()) Note(graphs->Flush(), "running a recorded step");
  }
  // Device memory for one call's inputs or temporaries: stream-ordered and
  // freed with `temp` outside a recorded step; while one is recorded, the
  // step's own (a Temp's free would be enqueued before the recorded work
  // that reads it). Null (the error in *e) when none can be had.
  void* CallMemory(size_t bytes, std::optional<Temp>& temp, cudaError_t* e) const {
    *e = cudaSuccess;
    if (bytes == 0) return nullptr;
    if (Recording()) {
      void* p = graphs->Device(bytes);
      if (p == nullptr) *e = cudaErrorMemoryAllocation;
      return p;
    }
    temp.emplace(stream, bytes);
    *e = temp->error();
    return *e == cudaSuccess ? temp->as<void>() : nullptr;
  }
  // A reusable temporary (lane 0: decode's split partials, 1: activations
  // rounded for a product): consumed by the call's own later operations.
  void* LaneMemory(int lane, size_t bytes, std::optional<Temp>& temp, cudaError_t* e) const {
    if (!Recording()) return CallMemory(bytes, temp, e);
    *e = cudaSuccess;
    if (bytes == 0) return nullptr;
    void* p = graphs->Lane(lane, bytes);
    if (p == nullptr) *e = cudaErrorMemoryAllocation;
    return p;
  }
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
  cudaError_t H2D(void* dst, const void* src, size_t bytes) const {
    if (bytes == 0) return cudaSuccess;
    std::lock_guard lock(stream_mu);
    if (Recording()) return graphs->Upload(dst, src, bytes);
    if (ring == nullptr && !ring_failed) {
      if (cudaMallocHost(&ring, kRingBytes) != cudaSuccess) {
        cudaGetLastError();
        ring = nullptr;
        ring_failed = true;
      }
    }
    if (ring == nullptr || bytes > kRingBytes / 4) return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
    size_t at = (ring_at + 255) / 256 * 256;
    if (at + bytes > kRingBytes) {
      if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return e;
      at = 0;
    }
    std::byte* slot = static_cast<std::byte*>(ring) + at;
    std::memcpy(slot, src, bytes);
    ring_at = at + bytes;
    return cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, stream);
  }

  // The device copy of `host`: an entry that holds the same ints, or the
  // least recently used one, written again on the compute stream (after
  // every kernel enqueued before it, so no reader of its old contents sees
  // the new ones). Null, with the error recorded, when it cannot be made.
  // `hold` keeps the entries locked until the caller has enqueued the
  // kernels that read it, so another thread's call cannot rewrite it first.
  const int32_t* DeviceInts(const std::vector<int32_t>& host, std::unique_lock<std::mutex>* hold) const {
    std::lock_guard stream_lock(stream_mu);
    if (Recording()) {
      for (const auto& [ints, device] : step_ints) {
        if (ints == host) return device;
      }
      auto* device = static_cast<int32_t*>(graphs->Device(host.size() * sizeof(int32_t)));
      cudaError_t e = device == nullptr ? cudaErrorMemoryAllocation : graphs->Upload(device, host.data(), host.size() * sizeof(int32_t));
      if (e != cudaSuccess) {
        Note(e, "uploading block tables");
        return nullptr;
      }
      step_ints.emplace_back(host, device);
      ++int_uploads;
      return device;
    }
    std::unique_lock lock(ints_mu);
    ++ints_clock;
    IntArrays* slot = &ints[0];
    for (IntArrays& a : ints) {
      if (a.device != nullptr && a.host.size() == host.size() &&
          std::memcmp(a.host.data(), host.data(), host.size() * sizeof(int32_t)) == 0) {
        a.used = ints_clock;
        *hold = std::move(lock);
        return a.device;
      }
      if (a.used < slot->used) slot = &a;
    }
    cudaError_t e = cudaSuccess;
    if (slot->capacity < host.size()) {
      if (slot->device != nullptr) cudaFreeAsync(slot->device, stream);
      slot->device = nullptr;
      slot->capacity = 0;
      const size_t want = std::max<size_t>(host.size(), 1024);
      e = cudaMallocAsync(reinterpret_cast<void**>(&slot->device), want * sizeof(int32_t), stream);
      if (e == cudaSuccess) slot->capacity = want;
    }
    if (e == cudaSuccess) e = H2D(slot->device, host.data(), host.size() * sizeof(int32_t));
    if (e != cudaSuccess) {
      cudaGetLastError();
      slot->host.clear();
      slot->used = 0;
      Note(e, "uploading block tables");
      return nullptr;
    }
    slot->host = host;
    slot->used = ints_clock;
    ++int_uploads;
    *hold = std::move(lock);
    return slot->device;
  }

  // A weight vector (norm weights, a bias) of n floats where the kernels
  // can read it: itself when it is device (or managed) memory, else its
  // device copy, uploaded on first use and kept (model weights do not
  // change). Null (and the error recorded) when it cannot be.
  const float* Resident(const float* p, int64_t n) const {
    if (p == nullptr) return nullptr;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) == cudaSuccess &&
        (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged)) {
      return p;
    }
    cudaGetLastError();
    std::lock_guard lock(mu);
    auto& [copy, size] = vectors[p];
    if (size >= n) return copy;
    cudaFree(copy);
    copy = nullptr;
    size = 0;
    cudaError_t e = cudaMalloc(&copy, static_cast<size_t>(n) * sizeof(float));
    // Synchronous: the copy is made before the host vector could change.
    if (e == cudaSuccess) e = cudaMemcpy(copy, p, static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      cudaGetLastError();
      cudaFree(copy);
      copy = nullptr;
      NoteStatus(InternalError("CUDA backend: uploading a weight vector: " + CudaMessage(e)));
      return nullptr;
    }
    size = n;
    weight_bytes += n * static_cast<int64_t>(sizeof(float));
    return copy;
  }

  // The device copy of `w` in the type the product needs (uploaded on first use).
  Result<DeviceWeights> Weights(const WeightMatrix& w, Activations activations) const {
    const bool exact = activations == Activations::kF32 || w.type == WeightType::kF32;
    const cudaDataType_t type = exact ? CUDA_R_32F : (w.type == WeightType::kBF16 || bf16_products) ? CUDA_R_16BF : CUDA_R_16F;
    const auto key = std::make_tuple(w.data, static_cast<int>(w.type), w.rows, w.cols, w.panels, static_cast<int>(type));
    std::lock_guard stream_lock(stream_mu);  // the upload below enqueues (never into a recorded step)
    std::lock_guard lock(mu);
    if (auto it = weights.find(key); it != weights.end()) return it->second;
    DeviceWeights dw;
    dw.type = type;
    const int64_t elem = type == CUDA_R_32F ? 4 : 2;
    dw.bytes = w.rows * w.cols * elem;
    if (cudaError_t e = cudaMalloc(&dw.data, static_cast<size_t>(dw.bytes)); e != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhaustedError("CUDA backend: no device memory for a " + std::to_string(w.rows) + " x " +
                                    std::to_string(w.cols) + " weight matrix (" + std::to_string(dw.bytes) +
                                    " bytes): " + CudaMessage(e));
    }
    // Decoded on the host in chunks of rows (WeightRow reads every format
    // and layout), converted to 16 bits on the device.
    const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(w.rows, (int64_t{16} << 20) / (w.cols * 4)));
    std::vector<float> rows(static_cast<size_t>(chunk * w.cols));
    Temp staging(stream, type == CUDA_R_32F ? 0 : rows.size() * sizeof(float));
    cudaError_t e = staging.error();
    for (int64_t r0 = 0; r0 < w.rows && e == cudaSuccess; r0 += chunk) {
      const int64_t n = std::min(chunk, w.rows - r0);
      for (int64_t r = 0; r < n; ++r) pagekv::WeightRow(w, r0 + r, rows.data() + r * w.cols);
      const size_t floats = static_cast<size_t>(n * w.cols);
      if (type == CUDA_R_32F) {
        e = cudaMemcpyAsync(static_cast<float*>(dw.data) + r0 * w.cols, rows.data(), floats * 4, cudaMemcpyHostToDevice,
                            stream);
      } else {
        e = cudaMemcpyAsync(staging.as<float>(), rows.data(), floats * 4, cudaMemcpyHostToDevice, stream);
        void* dst = static_cast<std::byte*>(dw.data) + r0 * w.cols * 2;
        if (e == cudaSuccess) {
          e = type == CUDA_R_16F ? cuda::ToHalf(staging.as<float>(), static_cast<int64_t>(floats), dst, stream)
                                 : cuda::ToBf16(staging.as<float>(), static_cast<int64_t>(floats), dst, stream);
        }
      }
      // The host chunk is reused next: wait for the copy out of it.
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    }
    if (e != cudaSuccess) {
      cudaFree(dw.data);
      return InternalError("CUDA backend: uploading a weight matrix: " + CudaMessage(e));
    }
    weights.emplace(key, dw);
    weight_bytes += dw.bytes;
    return dw;
  }

  Status Product(const WeightMatrix& w, const float* x, int64_t tokens, float* y, Activations activations) const {
    if (w.data == nullptr || x == nullptr || y == nullptr) return InvalidArgumentError("MatMul: null pointer");
    if (w.rows <= 0 || w.cols <= 0 || tokens <= 0) return InvalidArgumentError("MatMul: sizes must be positive");
    if (w.cols % FormatOf(w.type).block_elems != 0) {
      return InvalidArgumentError("MatMul: cols must be a multiple of the format's block");
    }
    if (w.rows > INT32_MAX || w.cols > INT32_MAX || tokens > INT32_MAX) {
      return InvalidArgumentError("MatMul: a dimension past 2^31 - 1 (cuBLAS's limit)");
    }
    PAGEKV_ASSIGN_OR_RETURN(const DeviceWeights dw, Weights(w, activations));
    const int m = static_cast<int>(w.rows), n = static_cast<int>(tokens), k = static_cast<int>(w.cols);
    const float alpha = 1.0f, beta = 0.0f;
    // Row-major Y[tokens][rows] = X[tokens][cols] W[rows][cols]^T is, in
    // cuBLAS's column-major terms, Y^T (rows x tokens) = op(W') X' with W'
    // the cols x rows matrix W's bytes are: op = transpose.
    std::lock_guard lock(stream_mu);
    std::optional<Temp> temp;
    cudaError_t e = cudaSuccess;
    void* x16 = dw.type == CUDA_R_32F ? nullptr : LaneMemory(1, static_cast<size_t>(tokens * w.cols * 2), temp, &e);
    PAGEKV_RETURN_IF_ERROR(Check(e, "activation buffer"));
    const cudaDataType_t type = dw.type;
    const void* wd = dw.data;
    const int64_t count = tokens * w.cols;
    e = Enqueue({0x67656d6d /* "gemm" */, StepGraphs::Key(wd), StepGraphs::Key(static_cast<int>(type)), StepGraphs::Key(m),
                 StepGraphs::Key(n), StepGraphs::Key(k), StepGraphs::Key(x), StepGraphs::Key(x16), StepGraphs::Key(y)},
                [=, this](cudaStream_t s) -> cudaError_t {
                  const void* xb = x;
                  if (x16 != nullptr) {
                    const cudaError_t r = type == CUDA_R_16F ? cuda::ToHalf(x, count, x16, s) : cuda::ToBf16(x, count, x16, s);
                    if (r != cudaSuccess) return r;
                    xb = x16;
                  }
                  cublasSetStream(blas, s);
                  const cublasStatus_t st =
                      cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, wd, type, k, xb, type, k, &beta, y,
                                   CUDA_R_32F, m, type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT);
                  if (st == CUBLAS_STATUS_SUCCESS) return cudaSuccess;
                  NoteStatus(InternalError(std::string("CUDA backend: cublasGemmEx: ") + cublasGetStatusString(st)));
                  return cudaErrorUnknown;
                });
    Note(e, "weight product");
    return Recorded();
  }

  // Spans of each slab of `block` (payload order: layer, plane, head), the
  // arena side `from` and the payload side `to` (swapped by the caller).
  static std::vector<cuda::SpanCopy> BlockSpans(const KvLayout& layout, int64_t block) {
    std::vector<cuda::SpanCopy> spans;
    int64_t at = 0;
    for (const int32_t l : layout.block_layers()) {
      for (int32_t p = 0; p < layout.num_planes(); ++p) {
        const int64_t slab = layout.slab_bytes(l, p);
        for (int32_t h = 0; h < layout.num_heads(); ++h, at += slab) spans.push_back({layout.SlabOffset(l, p, h, block), at, slab});
      }
    }
    return spans;
  }

  cudaError_t Spans(const std::vector<cuda::SpanCopy>& spans, const void* src, void* dst, cudaStream_t on = nullptr) const {
    if (spans.empty()) return cudaSuccess;
    const size_t bytes = spans.size() * sizeof(cuda::SpanCopy);
    const auto count = static_cast<int64_t>(spans.size());
    if (on != nullptr && on != stream) {
      // The copy stream's: its calls wait for their stream anyway.
      Temp d(on, bytes);
      if (d.error() != cudaSuccess) return d.error();
      cudaError_t e = cudaMemcpyAsync(d.as<void>(), spans.data(), bytes, cudaMemcpyHostToDevice, on);
      if (e != cudaSuccess) return e;
      return cuda::CopySpans(d.as<cuda::SpanCopy>(), count, src, dst, on);
    }
    // The compute stream's through the ring (or a recorded step's memory).
    std::lock_guard lock(stream_mu);
    std::optional<Temp> temp;
    cudaError_t e = cudaSuccess;
    auto* d = static_cast<cuda::SpanCopy*>(CallMemory(bytes, temp, &e));
    if (e == cudaSuccess) e = H2D(d, spans.data(), bytes);
    if (e != cudaSuccess) return e;
    return Enqueue({0x7370616e /* "span" */, StepGraphs::Key(d), StepGraphs::Key(count), StepGraphs::Key(src), StepGraphs::Key(dst)},
                   [=](cudaStream_t s) { return cuda::CopySpans(d, count, src, dst, s); });
  }

  // Block transfers run on the copy stream, beside the forward pass on the
  // compute stream: each first waits for the compute work enqueued before
  // it (what may still write or read the block), not for what comes after,
  // and stages through pinned host memory so its DMA is asynchronous. The
  // call returns when its bytes are in place (the callers' protocol: a
  // loaded block is used only after its load returns).
  std::byte* Pinned(size_t bytes) const {
    if (pinned_size < bytes) {
      cudaFreeHost(pinned);
      pinned = nullptr;
      pinned_size = 0;
      if (cudaMallocHost(&pinned, bytes) != cudaSuccess) {
        cudaGetLastError();
        pinned = nullptr;
        return nullptr;
      }
      pinned_size = bytes;
    }
    return static_cast<std::byte*>(pinned);
  }
  cudaError_t AfterCompute() const {
    std::lock_guard lock(stream_mu);  // never inside a capture
    cudaError_t e = cudaEventRecord(compute_done, stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(copy_stream, compute_done, 0);
    return e;
  }

};

}  // namespace pagekv
