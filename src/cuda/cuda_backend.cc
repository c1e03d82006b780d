// CudaBackend (see cuda_backend.h): memory, transfers, weight products and
// the layer ops; the attention calls are in cuda_backend_attention.cc.
#include "cuda/cuda_backend.h"

#include "cuda/cuda_backend_impl.h"

namespace pagekv {

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
  impl->tensor_core_decode = options.tensor_core_decode;
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
  if (options.cuda_graphs) {
    // A workspace of its own for cuBLAS, so that a captured product does
    // not allocate one (cuBLAS's guidance for graphs: 32 MiB covers Hopper).
    constexpr size_t kWorkspace = size_t{32} << 20;
    if (cudaError_t e = cudaMalloc(&impl->blas_workspace, kWorkspace); e != cudaSuccess) {
      return UnavailableError("CUDA: no device memory for cuBLAS's workspace: " + CudaMessage(e));
    }
    if (cublasStatus_t s = cublasSetWorkspace(impl->blas, impl->blas_workspace, kWorkspace); s != CUBLAS_STATUS_SUCCESS) {
      return UnavailableError(std::string("cuBLAS: setting its workspace: ") + cublasGetStatusString(s));
    }
    impl->graphs = std::make_unique<StepGraphs>(impl->stream);
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
  auto lock = impl_->Lock();
  std::optional<Temp> temp;
  cudaError_t e = cudaSuccess;
  const size_t bytes = slots.size() * sizeof(int64_t);
  auto* d_slots = static_cast<int64_t*>(impl_->CallMemory(bytes, temp, &e));
  if (e == cudaSuccess) e = impl_->H2D(d_slots, slots.data(), bytes);
  const std::byte* planes[2] = {k, v};
  const auto tokens = static_cast<int64_t>(slots.size());
  const int32_t heads = layout.num_heads(), block_len = layout.block_len();
  const int64_t row_bytes = layout.row_bytes(layer);
  for (int32_t p = 0; p < layout.num_planes() && e == cudaSuccess; ++p) {
    const std::byte* src = planes[p];
    std::byte* plane = arena + layout.SlabOffset(layer, p, 0, 0);
    const int64_t head_stride = layout.head_stride(layer, p), slab_stride = layout.slab_stride(layer, p);
    e = impl_->Enqueue({0x73746f72 /* "stor" */, StepGraphs::Key(d_slots), StepGraphs::Key(tokens), StepGraphs::Key(heads),
                        StepGraphs::Key(row_bytes), StepGraphs::Key(block_len), StepGraphs::Key(src), StepGraphs::Key(plane),
                        StepGraphs::Key(head_stride), StepGraphs::Key(slab_stride)},
                       [=](cudaStream_t s) {
                         return cuda::ScatterRows(d_slots, tokens, heads, row_bytes, block_len, src, plane, head_stride,
                                                  slab_stride, s);
                       });
  }
  impl_->Note(e, "storing K / V rows");
}

void CudaBackend::ToHost(const void* src, size_t bytes, void* dst) const {
  if (bytes == 0) return;
  impl_->Enter();
  auto lock = impl_->Lock();
  impl_->Flush();
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
  auto lock = impl_->Lock();
  impl_->Flush();
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
  auto stream_lock = impl_->Lock();
  std::lock_guard lock(impl_->mu);
  auto& [p, size] = impl_->scratch[key];
  if (size < bytes) {
    // Grown by half again, so a growing step does not reallocate every time;
    // the old buffer may still be read by work in flight (or recorded in a
    // step, not yet enqueued: freed once that step has run).
    if (impl_->Recording()) {
      if (p != nullptr) impl_->graphs->Retire(p);
    } else {
      cudaStreamSynchronize(impl_->stream);
      cudaFree(p);
    }
    p = nullptr;
    size = 0;
    const size_t want = std::max(bytes, bytes + bytes / 2);
    if (cudaError_t e = cudaMalloc(&p, want); e != cudaSuccess) {
      cudaGetLastError();
      p = nullptr;
      impl_->NoteStatus(ResourceExhaustedError("CUDA backend: no device memory for " + std::to_string(want) +
                                               " bytes of activations: " + CudaMessage(e)));
      return {};
    }
    size = want;
  }
  return {static_cast<std::byte*>(p), bytes};
}

Result<std::unique_ptr<KvArena>> CudaBackend::AllocateArena(const KvArenaOptions& options) const {
  if (options.size_bytes <= 0) return InvalidArgumentError("arena size must be positive");
  impl_->Enter();
  auto lock = impl_->Lock();
  impl_->Flush();
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
  auto lock = impl_->Lock();
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
  auto lock = impl_->Lock();
  const int64_t row_bytes = EncodedRowBytes(format, elems);
  Result<cuda::KvType> type = format.IsKivi() ? Result<cuda::KvType>(cuda::KvType::kF16) : RowType(format, elems);
  if (type.ok()) {
    const cuda::KvType t = *type;
    impl_->Note(impl_->Enqueue({0x656e6372 /* "encr" */, StepGraphs::Key(t), StepGraphs::Key(elems), StepGraphs::Key(src),
                                StepGraphs::Key(rows), StepGraphs::Key(dst), StepGraphs::Key(row_bytes)},
                               [=](cudaStream_t s) { return cuda::EncodeRows(t, elems, src, rows, dst, row_bytes, s); }),
                "encoding K / V rows");
    return;
  }
  // Formats the GPU does not encode (Hadamard-rotated rows): through the
  // host encoder (a recorded step runs what it has first, then call by call).
  impl_->Flush();
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
  auto lock = impl_->Lock();
  const float* w = impl_->Resident(weight, width);
  if (w == nullptr) return;
  impl_->Note(impl_->Enqueue({0x726d736e /* "rmsn" */, StepGraphs::Key(x), StepGraphs::Key(w), StepGraphs::Key(rows),
                              StepGraphs::Key(width), StepGraphs::Key(eps), StepGraphs::Key(out)},
                             [=](cudaStream_t s) { return cuda::RmsNormRows(x, w, rows, width, eps, out, s); }),
              "RmsNorm");
}

void CudaBackend::AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width) const {
  impl_->Enter();
  auto lock = impl_->Lock();
  const float* b = impl_->Resident(bias, width);
  if (b == nullptr) return;
  impl_->Note(impl_->Enqueue({0x62696173 /* "bias" */, StepGraphs::Key(x), StepGraphs::Key(b), StepGraphs::Key(rows),
                              StepGraphs::Key(width)},
                             [=](cudaStream_t s) { return cuda::AddBiasRows(x, b, rows, width, s); }),
              "bias");
}

void CudaBackend::AddInPlace(float* x, const float* y, int64_t n) const {
  impl_->Enter();
  impl_->Note(impl_->Enqueue({0x61646420 /* "add " */, StepGraphs::Key(x), StepGraphs::Key(y), StepGraphs::Key(n)},
                             [=](cudaStream_t s) { return cuda::AddInPlace(x, y, n, s); }),
              "add");
}

void CudaBackend::SwiGluInPlace(float* gate, const float* up, int64_t n) const {
  impl_->Enter();
  impl_->Note(impl_->Enqueue({0x73776967 /* "swig" */, StepGraphs::Key(gate), StepGraphs::Key(up), StepGraphs::Key(n)},
                             [=](cudaStream_t s) { return cuda::SwiGluInPlace(gate, up, n, s); }),
              "SwiGLU");
}

void CudaBackend::GeluGluInPlace(float* gate, const float* up, int64_t n) const {
  impl_->Enter();
  impl_->Note(impl_->Enqueue({0x67656c75 /* "gelu" */, StepGraphs::Key(gate), StepGraphs::Key(up), StepGraphs::Key(n)},
                             [=](cudaStream_t s) { return cuda::GeluGluInPlace(gate, up, n, s); }),
              "GeGLU");
}

void CudaBackend::ScaleInPlace(float* x, float s, int64_t n) const {
  impl_->Enter();
  impl_->Note(impl_->Enqueue({0x7363616c /* "scal" */, StepGraphs::Key(x), StepGraphs::Key(s), StepGraphs::Key(n)},
                             [=](cudaStream_t st) { return cuda::ScaleInPlace(x, s, n, st); }),
              "scale");
}

void CudaBackend::RopeTables(const Rope& rope, std::span<const int64_t> positions, float* cos, float* sin) const {
  impl_->Enter();
  auto lock = impl_->Lock();
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
  const int32_t head_dim = p.head_dim, rope_dims = p.rope_dims;
  const bool halves = p.halves;
  impl_->Note(impl_->Enqueue({0x726f7065 /* "rope" */, StepGraphs::Key(x), StepGraphs::Key(rows), StepGraphs::Key(width),
                              StepGraphs::Key(head_dim), StepGraphs::Key(rope_dims), StepGraphs::Key(halves),
                              StepGraphs::Key(cos), StepGraphs::Key(sin)},
                             [=](cudaStream_t s) { return cuda::RopeApply(x, rows, width, head_dim, rope_dims, halves, cos, sin, s); }),
              "rotary");
}

Status CudaBackend::Finish() const {
  impl_->Enter();
  auto lock = impl_->Lock();
  impl_->Flush();
  impl_->Note(cudaStreamSynchronize(impl_->stream), "synchronize");
  std::lock_guard err_lock(impl_->err_mu);
  Status s = impl_->error;
  impl_->error = Status::Ok();
  return s;
}

void CudaBackend::BeginReplayableStep() const {
  if (impl_->graphs == nullptr) return;
  impl_->Enter();
  auto lock = impl_->Lock();
  impl_->Flush();
  // The step's pinned and device memory is rewritten: nothing may still read it.
  cudaError_t e = cudaStreamSynchronize(impl_->stream);
  impl_->step_ints.clear();
  if (e == cudaSuccess) e = impl_->graphs->Begin();
  impl_->Note(e, "starting a recorded step");
}

Status CudaBackend::EndReplayableStep() const {
  if (impl_->graphs == nullptr) return impl_->Recorded();
  impl_->Enter();
  auto lock = impl_->Lock();
  impl_->Flush();
  impl_->step_ints.clear();
  return impl_->Recorded();
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
  auto lock = impl_->Lock();
  impl_->Flush();
  cudaStreamSynchronize(impl_->stream);
  cudaFree(p);
}

Status CudaBackend::ToDevice(const float* host, int64_t n, float* device) const {
  impl_->Enter();
  return impl_->Check(impl_->H2D(device, host, static_cast<size_t>(n) * 4), "to device");
}

Status CudaBackend::ToHost(const float* device, int64_t n, float* host) const {
  impl_->Enter();
  auto lock = impl_->Lock();
  impl_->Flush();
  cudaError_t e = cudaMemcpyAsync(host, device, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost, impl_->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(impl_->stream);
  return impl_->Check(e, "to host");
}

int64_t CudaBackend::weight_bytes() const { return impl_->weight_bytes.load(); }
int64_t CudaBackend::host_fallbacks() const { return impl_->fallbacks.load(); }
int64_t CudaBackend::table_uploads() const { return impl_->int_uploads.load(); }

CudaBackend::GraphCounts CudaBackend::graph_counts() const {
  auto lock = impl_->Lock();
  if (impl_->graphs == nullptr) return {};
  return {impl_->graphs->launches(), impl_->graphs->captures(), impl_->graphs->uncaptured()};
}

void CudaBackend::ForgetWeights() const {
  impl_->Enter();
  auto stream_lock = impl_->Lock();
  impl_->Flush();
  cudaStreamSynchronize(impl_->stream);
  std::lock_guard lock(impl_->mu);
  for (auto& [key, w] : impl_->weights) cudaFree(w.data);
  impl_->weights.clear();
  for (auto& [key, vec] : impl_->vectors) cudaFree(vec.first);
  impl_->vectors.clear();
  impl_->weight_bytes = 0;
}

}  // namespace pagekv
