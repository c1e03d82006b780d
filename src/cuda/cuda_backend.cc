// CudaBackend (see cuda_backend.h).
#include "cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/layer_ops.h"
#include "cuda/paged_attention.h"
#include "kernels/ops.h"
#include "kernels/weight_formats.h"

namespace pagekv {
namespace {

std::string CudaMessage(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }

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
Result<cuda::KvType> RowType(const KvFormat& f, int32_t row_elems) {
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

}  // namespace

struct CudaBackend::Impl {
  int device = 0;
  std::string name;
  bool bf16_products = false;
  bool tensor_core_prefill = false;
  int multiprocessors = 1;
  cudaStream_t stream = nullptr;       // compute: every math call, in call order
  cudaStream_t copy_stream = nullptr;  // block transfers (tier moves)
  cudaEvent_t compute_done = nullptr;
  mutable std::mutex copy_mu;          // one transfer at a time: the pinned staging
  mutable void* pinned = nullptr;
  mutable size_t pinned_size = 0;
  mutable std::mutex ring_mu;          // H2D's pinned ring
  mutable void* ring = nullptr;
  mutable size_t ring_at = 0;
  mutable bool ring_failed = false;
  cublasHandle_t blas = nullptr;
  mutable std::mutex mu;  // the error, the weight cache, cuBLAS
  mutable Status error = Status::Ok();
  mutable std::map<std::tuple<const std::byte*, int, int64_t, int64_t, bool, int>, DeviceWeights> weights;
  mutable std::map<std::tuple<std::thread::id, int, size_t>, std::pair<void*, size_t>> scratch;
  mutable std::map<const float*, std::pair<float*, int64_t>> vectors;  // host norm weights / biases -> device copies
  mutable std::atomic<int64_t> weight_bytes{0};
  mutable std::atomic<int64_t> fallbacks{0};

  ~Impl() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (auto& [key, w] : weights) cudaFree(w.data);
    for (auto& [key, buf] : scratch) cudaFree(buf.first);
    for (auto& [key, vec] : vectors) cudaFree(vec.first);
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
    std::lock_guard lock(mu);
    if (error.ok()) error = InternalError(std::string("CUDA backend: ") + what + ": " + CudaMessage(e));
  }
  void NoteStatus(const Status& s) const {
    if (s.ok()) return;
    std::lock_guard lock(mu);
    if (error.ok()) error = s;
  }
  // The recorded error (kept), or ok.
  Status Recorded() const {
    std::lock_guard lock(mu);
    return error;
  }
  Status Check(cudaError_t e, const char* what) const {
    Note(e, what);
    return Recorded();
  }

  // Host -> device on the compute stream through a pinned ring, so the copy
  // is a true asynchronous DMA (a pageable source may make the runtime wait
  // for the stream before copying it) and the caller's buffer is free at
  // return. The ring is written again only after the stream has finished
  // every copy out of it (one stream sync per wrap). Sources larger than a
  // quarter of it, or no pinned memory, go pageable.
  static constexpr size_t kRingBytes = size_t{8} << 20;
  cudaError_t H2D(void* dst, const void* src, size_t bytes) const {
    if (bytes == 0) return cudaSuccess;
    std::lock_guard lock(ring_mu);
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

  template <typename T>
  cudaError_t Upload(const Temp& dst, const std::vector<T>& host) const {
    if (dst.error() != cudaSuccess) return dst.error();
    return H2D(dst.as<void>(), host.data(), host.size() * sizeof(T));
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
      if (error.ok()) error = InternalError("CUDA backend: uploading a weight vector: " + CudaMessage(e));
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
    Temp x16(stream, dw.type == CUDA_R_32F ? 0 : static_cast<size_t>(tokens * w.cols * 2));
    const void* xb = x;
    if (dw.type != CUDA_R_32F) {
      PAGEKV_RETURN_IF_ERROR(Check(x16.error(), "activation buffer"));
      const cudaError_t e = dw.type == CUDA_R_16F ? cuda::ToHalf(x, tokens * w.cols, x16.as<void>(), stream)
                                                  : cuda::ToBf16(x, tokens * w.cols, x16.as<void>(), stream);
      PAGEKV_RETURN_IF_ERROR(Check(e, "rounding the activations"));
      xb = x16.as<void>();
    }
    cublasStatus_t s;
    {
      std::lock_guard lock(mu);
      cublasSetStream(blas, stream);
      s = cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, dw.data, dw.type, k, xb, dw.type, k, &beta, y,
                       CUDA_R_32F, m, dw.type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT);
    }
    if (s != CUBLAS_STATUS_SUCCESS) {
      return InternalError(std::string("CUDA backend: cublasGemmEx: ") + cublasGetStatusString(s));
    }
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
    if (on == nullptr) on = stream;
    Temp d(on, spans.size() * sizeof(cuda::SpanCopy));
    if (d.error() != cudaSuccess) return d.error();
    // The compute stream's through the ring; the copy stream's calls wait
    // for their stream anyway.
    cudaError_t e = on == stream ? H2D(d.as<void>(), spans.data(), spans.size() * sizeof(cuda::SpanCopy))
                                 : cudaMemcpyAsync(d.as<void>(), spans.data(), spans.size() * sizeof(cuda::SpanCopy),
                                                   cudaMemcpyHostToDevice, on);
    if (e != cudaSuccess) return e;
    return cuda::CopySpans(d.as<cuda::SpanCopy>(), static_cast<int64_t>(spans.size()), src, dst, on);
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
    cudaError_t e = cudaEventRecord(compute_done, stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(copy_stream, compute_done, 0);
    return e;
  }

  struct LayerView {
    cuda::KvType type;
    const std::byte* k = nullptr;
    const std::byte* v = nullptr;
    int64_t head_stride = 0, slab_stride = 0, row_bytes = 0;
  };
  static Result<LayerView> View(const PagedKv& kv) {
    if (kv.layout == nullptr || kv.arena == nullptr) return InvalidArgumentError("attention: null layout or arena");
    const KvLayout& layout = *kv.layout;
    if (kv.layer < 0 || kv.layer >= layout.num_layers()) return OutOfRangeError("attention: layer out of range");
    if (layout.config().kind != CacheKind::kPerHead) {
      return UnimplementedError("MLA latent caches are not read on the CUDA backend yet: use the CPU backend");
    }
    PAGEKV_ASSIGN_OR_RETURN(const cuda::KvType type, RowType(layout.format(kv.layer), layout.row_elems()));
    LayerView v{type};
    v.k = kv.arena + layout.SlabOffset(kv.layer, 0, 0, 0);
    v.v = kv.arena + layout.SlabOffset(kv.layer, 1, 0, 0);
    v.head_stride = layout.head_stride(kv.layer, 0);
    v.slab_stride = layout.slab_stride(kv.layer, 0);
    v.row_bytes = layout.row_bytes(kv.layer);
    return v;
  }

  // One sequence's table as int32 (kNoBlock kept as -1 where `partial`
  // allows it), checked as the CPU kernels check it.
  static Status Table(const KvLayout& layout, std::span<const BlockId> blocks, int64_t num_tokens, int64_t window,
                      bool partial, int32_t max_blocks, int32_t* out) {
    const int64_t need = (num_tokens + layout.block_len() - 1) / layout.block_len();
    if (static_cast<int64_t>(blocks.size()) < need) {
      return InvalidArgumentError("attention: a block table shorter than its sequence");
    }
    // Blocks wholly before the window are never read: -1 there.
    const int64_t first = window > 0 ? std::max<int64_t>(0, num_tokens - window) / layout.block_len() : 0;
    for (int64_t b = 0; b < max_blocks; ++b) {
      int32_t id = -1;
      if (b < need && b >= first) {
        id = ToInt(blocks[static_cast<size_t>(b)]);
        if (id == ToInt(kNoBlock) && partial) {
          id = -1;
        } else if (id < 0 || id >= layout.num_blocks()) {
          return InvalidArgumentError("attention: a block id outside the pool");
        }
      }
      out[b] = id;
    }
    return Status::Ok();
  }
};

bool CudaDeviceAvailable(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why != nullptr) {
      *why = e != cudaSuccess ? "no usable CUDA driver or device (" + CudaMessage(e) + ")" : "no CUDA device";
    }
    cudaGetLastError();
    return false;
  }
  return true;
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;

Result<std::unique_ptr<CudaBackend>> CudaBackend::Create(const CudaBackendOptions& options) {
  std::string why;
  if (!CudaDeviceAvailable(&why)) return UnavailableError("--device cuda: " + why + " on this machine; use --device cpu");
  int n = 0;
  cudaGetDeviceCount(&n);
  if (options.device < 0 || options.device >= n) {
    return InvalidArgumentError("CUDA device " + std::to_string(options.device) + " does not exist (this machine has " +
                                std::to_string(n) + ")");
  }
  auto impl = std::make_unique<Impl>();
  impl->device = options.device;
  impl->bf16_products = options.bf16_products;
  impl->tensor_core_prefill = options.tensor_core_prefill;
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) return UnavailableError("CUDA: " + CudaMessage(e));
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, options.device); e != cudaSuccess) {
    return UnavailableError("CUDA: " + CudaMessage(e));
  }
  impl->name = "cuda:" + std::to_string(options.device) + " (" + prop.name + ")";
  impl->multiprocessors = std::max(1, prop.multiProcessorCount);
  if (cudaError_t e = cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return UnavailableError("CUDA: creating a stream: " + CudaMessage(e));
  }
  if (cudaError_t e = cudaStreamCreateWithFlags(&impl->copy_stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return UnavailableError("CUDA: creating a stream: " + CudaMessage(e));
  }
  if (cudaError_t e = cudaEventCreateWithFlags(&impl->compute_done, cudaEventDisableTiming); e != cudaSuccess) {
    return UnavailableError("CUDA: creating an event: " + CudaMessage(e));
  }
  if (cublasStatus_t s = cublasCreate(&impl->blas); s != CUBLAS_STATUS_SUCCESS) {
    return UnavailableError(std::string("cuBLAS: ") + cublasGetStatusString(s));
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

std::string CudaBackend::name() const { return impl_->name; }

Status CudaBackend::CheckLayout(const KvLayout& layout) const {
  const CacheConfig& cc = layout.config();
  if (cc.kind != CacheKind::kPerHead) {
    return UnimplementedError("MLA latent caches are not read on the CUDA backend yet: use --device cpu");
  }
  if (cc.head_dim > 256) return UnimplementedError("head_dim over 256 is not read on the CUDA backend: use --device cpu");
  if (cc.num_q_heads / cc.num_kv_heads > 16) {
    return UnimplementedError("more than 16 query heads per KV head are not read on the CUDA backend: use --device cpu");
  }
  for (int32_t l = 0; l < layout.num_layers(); ++l) {
    Result<cuda::KvType> t = RowType(layout.format(l), layout.row_elems());
    if (!t.ok()) {
      return UnimplementedError(t.status().message() + (layout.uniform() ? "" : " (layer " + std::to_string(l) + ")"));
    }
  }
  return Status::Ok();
}

void CudaBackend::StoreKvRows(const KvLayout& layout, std::byte* arena, int32_t layer, std::span<const int64_t> slots,
                              const std::byte* k, const std::byte* v) const {
  if (slots.empty()) return;
  impl_->Enter();
  Temp d_slots(impl_->stream, slots.size() * sizeof(int64_t));
  cudaError_t e = d_slots.error();
  if (e == cudaSuccess) {
    e = impl_->H2D(d_slots.as<void>(), slots.data(), slots.size() * sizeof(int64_t));
  }
  const std::byte* planes[2] = {k, v};
  for (int32_t p = 0; p < layout.num_planes() && e == cudaSuccess; ++p) {
    e = cuda::ScatterRows(d_slots.as<int64_t>(), static_cast<int64_t>(slots.size()), layout.num_heads(),
                          layout.row_bytes(layer), layout.block_len(), planes[p],
                          arena + layout.SlabOffset(layer, p, 0, 0), layout.head_stride(layer, p),
                          layout.slab_stride(layer, p), impl_->stream);
  }
  impl_->Note(e, "storing K / V rows");
}

void CudaBackend::ToHost(const void* src, size_t bytes, void* dst) const {
  if (bytes == 0) return;
  impl_->Enter();
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, impl_->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(impl_->stream);
  impl_->Note(e, "to host");
}

void CudaBackend::FromHost(const void* src, size_t bytes, void* dst) const {
  if (bytes == 0) return;
  impl_->Enter();
  impl_->Note(impl_->H2D(dst, src, bytes), "from host");
}

Result<double> CudaBackend::DeviceReadGbps(int64_t bytes) const {
  if (bytes < (int64_t{1} << 20)) return InvalidArgumentError("read probe: give at least 1 MiB");
  impl_->Enter();
  const cudaStream_t stream = impl_->stream;
  Temp buf(stream, static_cast<size_t>(bytes)), sink(stream, sizeof(float));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(buf.error(), "read probe buffer"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(sink.error(), "read probe buffer"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(cudaMemsetAsync(buf.as<void>(), 0, static_cast<size_t>(bytes), stream), "read probe"));
  cudaEvent_t start = nullptr, stop = nullptr;
  PAGEKV_RETURN_IF_ERROR(impl_->Check(cudaEventCreate(&start), "read probe events"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(cudaEventCreate(&stop), "read probe events"));
  double best = 0;
  cudaError_t e = cuda::ReadStream(buf.as<void>(), bytes / 16, sink.as<float>(), stream);  // warm-up
  for (int i = 0; i < 5 && e == cudaSuccess; ++i) {
    e = cudaEventRecord(start, stream);
    if (e == cudaSuccess) e = cuda::ReadStream(buf.as<void>(), bytes / 16, sink.as<float>(), stream);
    if (e == cudaSuccess) e = cudaEventRecord(stop, stream);
    if (e == cudaSuccess) e = cudaEventSynchronize(stop);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
    if (e == cudaSuccess && ms > 0) best = std::max(best, static_cast<double>(bytes / 16 * 16) / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  PAGEKV_RETURN_IF_ERROR(impl_->Check(e, "read probe"));
  return best;
}

std::span<std::byte> CudaBackend::Scratch(int pool, size_t slot, size_t bytes) const {
  impl_->Enter();
  const auto key = std::make_tuple(std::this_thread::get_id(), pool, slot);
  std::lock_guard lock(impl_->mu);
  auto& [p, size] = impl_->scratch[key];
  if (size < bytes) {
    // Grown by half again, so a growing step does not reallocate every time;
    // the old buffer may still be read by work in flight.
    cudaStreamSynchronize(impl_->stream);
    cudaFree(p);
    p = nullptr;
    size = 0;
    const size_t want = std::max(bytes, bytes + bytes / 2);
    if (cudaError_t e = cudaMalloc(&p, want); e != cudaSuccess) {
      cudaGetLastError();
      p = nullptr;
      if (impl_->error.ok()) {
        impl_->error = ResourceExhaustedError("CUDA backend: no device memory for " + std::to_string(want) +
                                              " bytes of activations: " + CudaMessage(e));
      }
      return {};
    }
    size = want;
  }
  return {static_cast<std::byte*>(p), bytes};
}

Result<std::unique_ptr<KvArena>> CudaBackend::AllocateArena(const KvArenaOptions& options) const {
  if (options.size_bytes <= 0) return InvalidArgumentError("arena size must be positive");
  impl_->Enter();
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, static_cast<size_t>(options.size_bytes)); e != cudaSuccess) {
    cudaGetLastError();
    size_t free = 0, total = 0;
    cudaMemGetInfo(&free, &total);
    return ResourceExhaustedError("the KV arena of " + std::to_string(options.size_bytes) +
                                  " bytes does not fit in device memory (" + std::to_string(free) +
                                  " bytes free): give a smaller --kv-budget");
  }
  auto arena = std::make_unique<DeviceArena>(static_cast<std::byte*>(p), options.size_bytes);
  PAGEKV_RETURN_IF_ERROR(impl_->Check(cudaMemsetAsync(p, 0, static_cast<size_t>(options.size_bytes), impl_->stream), "zeroing the arena"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(cudaStreamSynchronize(impl_->stream), "zeroing the arena"));
  return std::unique_ptr<KvArena>(std::move(arena));
}

void CudaBackend::CopyBlocks(const KvLayout& layout, std::byte* arena, std::span<const BlockCopy> copies) const {
  impl_->Enter();
  // The copies of one launch run at once: a copy that reads or writes a
  // block an earlier copy of the same launch writes (or reads) starts the
  // next launch, so the order is the CPU backend's.
  std::vector<cuda::SpanCopy> spans;
  std::vector<int32_t> reads, writes;
  auto flush = [&] {
    impl_->Note(impl_->Spans(spans, arena, arena), "copying blocks");
    spans.clear();
    reads.clear();
    writes.clear();
  };
  auto has = [](const std::vector<int32_t>& v, int32_t x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  for (const BlockCopy& c : copies) {
    const int32_t src = ToInt(c.src), dst = ToInt(c.dst);
    if (has(writes, src) || has(writes, dst) || has(reads, dst)) flush();
    for (const int32_t l : layout.block_layers()) {
      for (int32_t p = 0; p < layout.num_planes(); ++p) {
        const int64_t bytes = layout.kivi(l) ? layout.slab_bytes(l, p) : c.filled * layout.row_bytes(l);
        for (int32_t h = 0; h < layout.num_heads(); ++h) {
          spans.push_back({layout.SlabOffset(l, p, h, src), layout.SlabOffset(l, p, h, dst), bytes});
        }
      }
    }
    reads.push_back(src);
    writes.push_back(dst);
  }
  flush();
}

void CudaBackend::BlockToHost(const KvLayout& layout, const std::byte* arena, BlockId block,
                              std::span<std::byte> host) const {
  impl_->Enter();
  std::lock_guard lock(impl_->copy_mu);
  const cudaStream_t copy = impl_->copy_stream;
  std::byte* pinned = impl_->Pinned(host.size());
  Temp staging(copy, host.size());
  cudaError_t e = pinned == nullptr ? cudaErrorMemoryAllocation : staging.error();
  if (e == cudaSuccess) e = impl_->AfterCompute();
  if (e == cudaSuccess) e = impl_->Spans(Impl::BlockSpans(layout, ToInt(block)), arena, staging.as<void>(), copy);
  if (e == cudaSuccess) e = cudaMemcpyAsync(pinned, staging.as<void>(), host.size(), cudaMemcpyDeviceToHost, copy);
  if (e == cudaSuccess) e = cudaStreamSynchronize(copy);
  if (e == cudaSuccess) std::memcpy(host.data(), pinned, host.size());
  impl_->Note(e, "block to host");
}

void CudaBackend::HostToBlock(const KvLayout& layout, std::byte* arena, BlockId block,
                              std::span<const std::byte> host) const {
  impl_->Enter();
  std::lock_guard lock(impl_->copy_mu);
  const cudaStream_t copy = impl_->copy_stream;
  std::byte* pinned = impl_->Pinned(host.size());
  Temp staging(copy, host.size());
  std::vector<cuda::SpanCopy> spans = Impl::BlockSpans(layout, ToInt(block));
  for (cuda::SpanCopy& s : spans) std::swap(s.from, s.to);
  cudaError_t e = pinned == nullptr ? cudaErrorMemoryAllocation : staging.error();
  if (e == cudaSuccess) {
    std::memcpy(pinned, host.data(), host.size());
    e = impl_->AfterCompute();
  }
  if (e == cudaSuccess) e = cudaMemcpyAsync(staging.as<void>(), pinned, host.size(), cudaMemcpyHostToDevice, copy);
  if (e == cudaSuccess) e = impl_->Spans(spans, staging.as<void>(), arena, copy);
  if (e == cudaSuccess) e = cudaStreamSynchronize(copy);
  impl_->Note(e, "host to block");
}

void CudaBackend::EncodeKvRows(const KvFormat& format, int32_t elems, const float* src, int64_t rows,
                               std::byte* dst) const {
  impl_->Enter();
  const int64_t row_bytes = EncodedRowBytes(format, elems);
  Result<cuda::KvType> type = format.IsKivi() ? Result<cuda::KvType>(cuda::KvType::kF16) : RowType(format, elems);
  if (type.ok()) {
    impl_->Note(cuda::EncodeRows(*type, elems, src, rows, dst, row_bytes, impl_->stream), "encoding K / V rows");
    return;
  }
  // Formats the GPU does not encode (Hadamard-rotated rows): through the
  // host encoder.
  ++impl_->fallbacks;
  std::vector<float> in(static_cast<size_t>(rows * elems));
  std::vector<std::byte> out(static_cast<size_t>(rows * row_bytes));
  cudaError_t e = cudaMemcpyAsync(in.data(), src, in.size() * 4, cudaMemcpyDeviceToHost, impl_->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(impl_->stream);
  if (e == cudaSuccess) {
    pagekv::EncodeKvRows(format, elems, in.data(), rows, out.data());
    e = cudaMemcpyAsync(dst, out.data(), out.size(), cudaMemcpyHostToDevice, impl_->stream);
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize(impl_->stream);  // `out` leaves scope
  impl_->Note(e, "encoding K / V rows on the host");
}

Status CudaBackend::MatMul(const WeightMatrix& w, const float* x, int64_t tokens, float* y, int /*threads*/,
                           Activations activations) const {
  impl_->Enter();
  return impl_->Product(w, x, tokens, y, activations);
}

Status CudaBackend::MatMulShared(std::span<const MatMulOutput> outputs, const float* x, int64_t tokens, int /*threads*/,
                                 Activations activations) const {
  impl_->Enter();
  for (const MatMulOutput& o : outputs) PAGEKV_RETURN_IF_ERROR(impl_->Product(o.w, x, tokens, o.y, activations));
  return Status::Ok();
}

void CudaBackend::WeightRow(const WeightMatrix& w, int64_t r, float* out) const {
  impl_->Enter();
  std::vector<float> row(static_cast<size_t>(w.cols));
  pagekv::WeightRow(w, r, row.data());
  impl_->Note(impl_->H2D(out, row.data(), row.size() * 4), "weight row");
}

void CudaBackend::RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps,
                              float* out) const {
  impl_->Enter();
  const float* w = impl_->Resident(weight, width);
  if (w == nullptr) return;
  impl_->Note(cuda::RmsNormRows(x, w, rows, width, eps, out, impl_->stream), "RmsNorm");
}

void CudaBackend::AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width) const {
  impl_->Enter();
  const float* b = impl_->Resident(bias, width);
  if (b == nullptr) return;
  impl_->Note(cuda::AddBiasRows(x, b, rows, width, impl_->stream), "bias");
}

void CudaBackend::AddInPlace(float* x, const float* y, int64_t n) const {
  impl_->Enter();
  impl_->Note(cuda::AddInPlace(x, y, n, impl_->stream), "add");
}

void CudaBackend::SwiGluInPlace(float* gate, const float* up, int64_t n) const {
  impl_->Enter();
  impl_->Note(cuda::SwiGluInPlace(gate, up, n, impl_->stream), "SwiGLU");
}

void CudaBackend::GeluGluInPlace(float* gate, const float* up, int64_t n) const {
  impl_->Enter();
  impl_->Note(cuda::GeluGluInPlace(gate, up, n, impl_->stream), "GeGLU");
}

void CudaBackend::ScaleInPlace(float* x, float s, int64_t n) const {
  impl_->Enter();
  impl_->Note(cuda::ScaleInPlace(x, s, n, impl_->stream), "scale");
}

void CudaBackend::RopeTables(const Rope& rope, std::span<const int64_t> positions, float* cos, float* sin) const {
  impl_->Enter();
  // The angles in double on the host (Rope::Tables), then the tables up.
  const size_t n = positions.size() * static_cast<size_t>(rope.params().rope_dims);
  std::vector<float> c(n), s(n);
  rope.Tables(positions, c.data(), s.data());
  cudaError_t e = impl_->H2D(cos, c.data(), n * 4);
  if (e == cudaSuccess) e = impl_->H2D(sin, s.data(), n * 4);
  impl_->Note(e, "rotary tables");
}

void CudaBackend::RopeApply(const Rope& rope, float* x, int64_t rows, int32_t width, const float* cos,
                            const float* sin) const {
  impl_->Enter();
  const RopeParams& p = rope.params();
  impl_->Note(cuda::RopeApply(x, rows, width, p.head_dim, p.rope_dims, p.halves, cos, sin, impl_->stream), "rotary");
}

Status CudaBackend::DecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, float* out,
                                    const AttentionOptions& options) const {
  impl_->Enter();
  PAGEKV_ASSIGN_OR_RETURN(const Impl::LayerView view, Impl::View(kv));
  if (q == nullptr || out == nullptr) return InvalidArgumentError("attention: null q or out");
  if (seqs.empty()) return Status::Ok();
  const KvLayout& layout = *kv.layout;
  const CacheConfig& cc = layout.config();
  const auto num = static_cast<int32_t>(seqs.size());
  int64_t max_blocks = 1, longest = 0;
  bool windowed = false;
  for (const DecodeSeq& s : seqs) {
    if (s.num_tokens < 1) return InvalidArgumentError("attention: a sequence with no tokens");
    if (s.window < 0) return InvalidArgumentError("attention: a negative window");
    if (s.scores != nullptr) {
      return UnimplementedError("attention weights for token eviction are not computed on the CUDA backend: use the CPU backend for --evict");
    }
    windowed |= s.window > 0;
    max_blocks = std::max(max_blocks, (s.num_tokens + layout.block_len() - 1) / layout.block_len());
    longest = std::max(longest, s.num_tokens);
  }
  if (max_blocks > INT32_MAX / std::max(num, 1) || longest > INT32_MAX) return InvalidArgumentError("attention: too long");
  std::vector<int32_t> tables(static_cast<size_t>(num) * max_blocks), lens(static_cast<size_t>(num));
  for (int32_t i = 0; i < num; ++i) {
    const DecodeSeq& s = seqs[static_cast<size_t>(i)];
    PAGEKV_RETURN_IF_ERROR(Impl::Table(layout, s.blocks, s.num_tokens, s.window, options.partial,
                                       static_cast<int32_t>(max_blocks), &tables[static_cast<size_t>(i) * max_blocks]));
    lens[static_cast<size_t>(i)] = static_cast<int32_t>(s.num_tokens);
  }
  const cudaStream_t stream = impl_->stream;
  Temp d_tables(stream, tables.size() * 4), d_lens(stream, lens.size() * 4);
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_tables, tables), "block tables"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_lens, lens), "context lengths"));
  const bool fast = !windowed && options.softcap == 0 && options.lse == nullptr && !options.partial &&
                    cc.head_dim % 8 == 0 && cc.head_dim <= 256 && cc.num_q_heads / cc.num_kv_heads <= 16;
  if (fast) {
    cuda::DecodeParams p;
    p.type = view.type;
    p.num_seqs = num;
    p.q_heads = cc.num_q_heads;
    p.kv_heads = cc.num_kv_heads;
    p.head_dim = cc.head_dim;
    p.block_len = layout.block_len();
    p.k_plane = view.k;
    p.v_plane = view.v;
    p.head_stride = view.head_stride;
    p.slab_stride = view.slab_stride;
    p.row_bytes = view.row_bytes;
    p.block_tables = d_tables.as<int32_t>();
    p.max_blocks = static_cast<int32_t>(max_blocks);
    p.context_lens = d_lens.as<int32_t>();
    p.q = q;
    p.out = out;
    p.scale = options.scale;
    if (options.split_tokens > 0) {
      p.blocks_per_split = static_cast<int32_t>((options.split_tokens + layout.block_len() - 1) / layout.block_len());
    }
    int32_t splits = cuda::Splits(p, static_cast<int32_t>(longest), impl_->multiprocessors);
    if (splits > 1 && p.blocks_per_split == 0) p.blocks_per_split = static_cast<int32_t>((max_blocks + splits - 1) / splits);
    if (p.blocks_per_split > 0) splits = static_cast<int32_t>((max_blocks + p.blocks_per_split - 1) / p.blocks_per_split);
    Temp scratch(stream, splits > 1 ? cuda::ScratchBytes(p, splits) : 0);
    PAGEKV_RETURN_IF_ERROR(impl_->Check(scratch.error(), "decode scratch"));
    p.scratch = scratch.as<void>();
    if (splits <= 1) p.blocks_per_split = 0;
    return impl_->Check(cuda::PagedDecodeAttention(p, std::max(splits, 1), stream), "decode attention");
  }
  // Windows, soft-capping, partial tables, log-sum-exps: one query each
  // through the prefill kernel.
  std::vector<int32_t> ones(static_cast<size_t>(num), 1), starts(static_cast<size_t>(num)), windows(static_cast<size_t>(num));
  for (int32_t i = 0; i < num; ++i) {
    starts[static_cast<size_t>(i)] = i;
    windows[static_cast<size_t>(i)] = static_cast<int32_t>(std::min<int64_t>(seqs[static_cast<size_t>(i)].window, INT32_MAX));
  }
  Temp d_ones(stream, ones.size() * 4), d_starts(stream, starts.size() * 4), d_windows(stream, windows.size() * 4);
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_ones, ones), "query lengths"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_starts, starts), "query rows"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_windows, windows), "windows"));
  cuda::PrefillParams p;
  p.type = view.type;
  p.num_seqs = num;
  p.q_heads = cc.num_q_heads;
  p.kv_heads = cc.num_kv_heads;
  p.head_dim = cc.head_dim;
  p.block_len = layout.block_len();
  p.k_plane = view.k;
  p.v_plane = view.v;
  p.head_stride = view.head_stride;
  p.slab_stride = view.slab_stride;
  p.row_bytes = view.row_bytes;
  p.block_tables = d_tables.as<int32_t>();
  p.max_blocks = static_cast<int32_t>(max_blocks);
  p.context_lens = d_lens.as<int32_t>();
  p.query_lens = d_ones.as<int32_t>();
  p.query_starts = d_starts.as<int32_t>();
  p.windows = d_windows.as<int32_t>();
  p.max_query_len = 1;
  p.q = q;
  p.out = out;
  p.lse = options.lse;
  p.scale = options.scale;
  p.softcap = options.softcap;
  return impl_->Check(cuda::PagedPrefillAttention(p, stream), "decode attention (general kernel)");
}

Status CudaBackend::PrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, float* out,
                                     const AttentionOptions& options) const {
  impl_->Enter();
  PAGEKV_ASSIGN_OR_RETURN(const Impl::LayerView view, Impl::View(kv));
  if (q == nullptr || out == nullptr) return InvalidArgumentError("attention: null q or out");
  if (seqs.empty()) return Status::Ok();
  const KvLayout& layout = *kv.layout;
  const CacheConfig& cc = layout.config();
  const auto num = static_cast<int32_t>(seqs.size());
  int64_t max_blocks = 1, rows = 0, longest_query = 0;
  for (const PrefillSeq& s : seqs) {
    if (s.num_queries < 1 || s.num_queries > s.num_tokens) {
      return InvalidArgumentError("attention: num_queries must be in [1, num_tokens]");
    }
    if (s.score_queries < 0 || s.score_queries > s.num_queries) {
      return InvalidArgumentError("attention: score_queries must be in [0, num_queries]");
    }
    if (s.window < 0) return InvalidArgumentError("attention: a negative window");
    if (s.scores != nullptr) {
      return UnimplementedError("attention weights for token eviction are not computed on the CUDA backend: use the CPU backend for --evict");
    }
    max_blocks = std::max(max_blocks, (s.num_tokens + layout.block_len() - 1) / layout.block_len());
    rows += s.num_queries;
    longest_query = std::max(longest_query, s.num_queries);
    if (s.num_tokens > INT32_MAX || rows > INT32_MAX) return InvalidArgumentError("attention: too long");
  }
  if (max_blocks > INT32_MAX / num) return InvalidArgumentError("attention: too long");
  std::vector<int32_t> tables(static_cast<size_t>(num) * max_blocks), lens(static_cast<size_t>(num)),
      qlens(static_cast<size_t>(num)), starts(static_cast<size_t>(num)), windows(static_cast<size_t>(num));
  int64_t row = 0;
  for (int32_t i = 0; i < num; ++i) {
    const PrefillSeq& s = seqs[static_cast<size_t>(i)];
    // The first query's window decides which blocks are read at all.
    const int64_t first_window = s.window > 0 ? s.window + s.num_queries - 1 : 0;
    PAGEKV_RETURN_IF_ERROR(Impl::Table(layout, s.blocks, s.num_tokens, first_window, options.partial,
                                       static_cast<int32_t>(max_blocks), &tables[static_cast<size_t>(i) * max_blocks]));
    lens[static_cast<size_t>(i)] = static_cast<int32_t>(s.num_tokens);
    qlens[static_cast<size_t>(i)] = static_cast<int32_t>(s.num_queries);
    starts[static_cast<size_t>(i)] = static_cast<int32_t>(row);
    windows[static_cast<size_t>(i)] = static_cast<int32_t>(std::min<int64_t>(s.window, INT32_MAX));
    row += s.num_queries;
  }
  const cudaStream_t stream = impl_->stream;
  Temp d_tables(stream, tables.size() * 4), d_lens(stream, lens.size() * 4), d_qlens(stream, qlens.size() * 4),
      d_starts(stream, starts.size() * 4), d_windows(stream, windows.size() * 4);
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_tables, tables), "block tables"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_lens, lens), "context lengths"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_qlens, qlens), "query lengths"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_starts, starts), "query rows"));
  PAGEKV_RETURN_IF_ERROR(impl_->Check(impl_->Upload(d_windows, windows), "windows"));
  cuda::PrefillParams p;
  p.type = view.type;
  p.num_seqs = num;
  p.q_heads = cc.num_q_heads;
  p.kv_heads = cc.num_kv_heads;
  p.head_dim = cc.head_dim;
  p.block_len = layout.block_len();
  p.k_plane = view.k;
  p.v_plane = view.v;
  p.head_stride = view.head_stride;
  p.slab_stride = view.slab_stride;
  p.row_bytes = view.row_bytes;
  p.block_tables = d_tables.as<int32_t>();
  p.max_blocks = static_cast<int32_t>(max_blocks);
  p.context_lens = d_lens.as<int32_t>();
  p.query_lens = d_qlens.as<int32_t>();
  p.query_starts = d_starts.as<int32_t>();
  p.windows = d_windows.as<int32_t>();
  p.max_query_len = static_cast<int32_t>(longest_query);
  p.q = q;
  p.out = out;
  p.lse = options.lse;
  p.scale = options.scale;
  p.softcap = options.softcap;
  // Enough rows for the tensor cores' 64-row tiles to pay.
  p.tensor_cores = impl_->tensor_core_prefill && cuda::TensorCorePrefillShape(p) &&
                   longest_query * (cc.num_q_heads / cc.num_kv_heads) >= 16;
  return impl_->Check(cuda::PagedPrefillAttention(p, stream), "prefill attention");
}

Status CudaBackend::Finish() const {
  impl_->Enter();
  impl_->Note(cudaStreamSynchronize(impl_->stream), "synchronize");
  std::lock_guard lock(impl_->mu);
  Status s = impl_->error;
  impl_->error = Status::Ok();
  return s;
}

Result<float*> CudaBackend::AllocateFloats(int64_t n) const {
  if (n <= 0) return InvalidArgumentError("AllocateFloats: n must be positive");
  impl_->Enter();
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, static_cast<size_t>(n) * sizeof(float)); e != cudaSuccess) {
    cudaGetLastError();
    return ResourceExhaustedError("CUDA backend: no device memory for " + std::to_string(n) + " floats: " + CudaMessage(e));
  }
  return static_cast<float*>(p);
}

void CudaBackend::Free(void* p) const {
  impl_->Enter();
  cudaStreamSynchronize(impl_->stream);
  cudaFree(p);
}

Status CudaBackend::ToDevice(const float* host, int64_t n, float* device) const {
  impl_->Enter();
  return impl_->Check(impl_->H2D(device, host, static_cast<size_t>(n) * 4), "to device");
}

Status CudaBackend::ToHost(const float* device, int64_t n, float* host) const {
  impl_->Enter();
  cudaError_t e = cudaMemcpyAsync(host, device, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost, impl_->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(impl_->stream);
  return impl_->Check(e, "to host");
}

int64_t CudaBackend::weight_bytes() const { return impl_->weight_bytes.load(); }
int64_t CudaBackend::host_fallbacks() const { return impl_->fallbacks.load(); }

void CudaBackend::ForgetWeights() const {
  impl_->Enter();
  cudaStreamSynchronize(impl_->stream);
  std::lock_guard lock(impl_->mu);
  for (auto& [key, w] : impl_->weights) cudaFree(w.data);
  impl_->weights.clear();
  for (auto& [key, vec] : impl_->vectors) cudaFree(vec.first);
  impl_->vectors.clear();
  impl_->weight_bytes = 0;
}

}  // namespace pagekv
