// CudaBackend::Impl's larger members (cuda_backend_impl.h): uploads, the
// recorded steps' memory, block tables on the device, weights, products and
// span copies.
#include "cuda/cuda_backend_impl.h"

namespace pagekv {

CudaBackend::Impl::~Impl() {
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

void CudaBackend::Impl::Flush() const {
  std::lock_guard lock(stream_mu);
  if (Recording()) Note(graphs->Flush(), "running a recorded step");
}

void* CudaBackend::Impl::CallMemory(size_t bytes, std::optional<Temp>& temp, cudaError_t* e) const {
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

void* CudaBackend::Impl::LaneMemory(int lane, size_t bytes, std::optional<Temp>& temp, cudaError_t* e) const {
  if (!Recording()) return CallMemory(bytes, temp, e);
  *e = cudaSuccess;
  if (bytes == 0) return nullptr;
  void* p = graphs->Lane(lane, bytes);
  if (p == nullptr) *e = cudaErrorMemoryAllocation;
  return p;
}

cudaError_t CudaBackend::Impl::H2D(void* dst, const void* src, size_t bytes) const {
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

const int32_t* CudaBackend::Impl::DeviceInts(const std::vector<int32_t>& host) const {
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
  ++ints_clock;
  IntArrays* slot = &ints[0];
  for (IntArrays& a : ints) {
    if (a.device != nullptr && a.host.size() == host.size() &&
        std::memcmp(a.host.data(), host.data(), host.size() * sizeof(int32_t)) == 0) {
      a.used = ints_clock;
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
  return slot->device;
}

const float* CudaBackend::Impl::Resident(const float* p, int64_t n) const {
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

Result<DeviceWeights> CudaBackend::Impl::Weights(const WeightMatrix& w, Activations activations) const {
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

Status CudaBackend::Impl::Product(const WeightMatrix& w, const float* x, int64_t tokens, float* y, Activations activations) const {
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

std::vector<cuda::SpanCopy> CudaBackend::Impl::BlockSpans(const KvLayout& layout, int64_t block) {
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

cudaError_t CudaBackend::Impl::Spans(const std::vector<cuda::SpanCopy>& spans, const void* src, void* dst, cudaStream_t on) const {
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

std::byte* CudaBackend::Impl::Pinned(size_t bytes) const {
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

cudaError_t CudaBackend::Impl::AfterCompute() const {
  std::lock_guard lock(stream_mu);  // never inside a capture
  cudaError_t e = cudaEventRecord(compute_done, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(copy_stream, compute_done, 0);
  return e;
}

}  // namespace pagekv
