// CudaBackend: the device seam (kernels/backend.h) over one NVIDIA GPU.
//
// The KV arena is one cudaMalloc'd allocation with the host arena's
// KvLayout offsets, so block ids, block tables and tier payloads are the
// same on both. Every math call takes device pointers (cudaMalloc'd, or
// AllocateFloats below) and enqueues its work, in call order, on the
// backend's one stream:
//   - weight products through cuBLAS: each WeightMatrix is uploaded once,
//     on its first product, decoded from its file format (every format the
//     CPU reads, panels included) to f32 for Activations::kF32 (SGEMM with
//     no reduced-precision arithmetic) or to 16 bits for kFast (f16, or
//     bf16 for bf16 weights; the activations rounded to the same type,
//     f32 accumulation);
//   - the layer ops of layer_ops.h; K / V rows encoded on the GPU with the
//     host encoder's arithmetic (Hadamard-rotated formats through host
//     staging, counted in host_fallbacks());
//   - decode attention through the flash-decoding kernels (split-K over
//     blocks, a merge kernel), and prefill, chunked prefill and decode steps
//     with sliding windows, soft-capping, partial tables or log-sum-exps
//     through the prefill kernel (paged_attention.h).
// Weights may be host memory (the model's mapped file): weight matrices,
// RMSNorm weights and biases are uploaded on first use and kept, keyed by
// their host address; every other pointer is device memory.
// Block transfers to and from the host (the tiers' moves) run on a second,
// copy stream through pinned staging: each waits for the compute work
// enqueued before it, not for what is enqueued after, so a mover thread's
// transfers overlap the forward pass; each returns when its bytes are in
// place.
// Not on the device (an Unimplemented error naming the fix, from
// CheckLayout when a cache is made): INT4 KIVI layers, Hadamard-rotated
// rows, MLA latent caches, head_dim over 256, more than 16 query heads per
// KV head; and the attention weights token eviction reads
// (DecodeSeq::scores). Scratch that cannot be allocated is recorded as an
// error and returned empty.
//
// Errors: the calls that return a Status return their own and any earlier
// call's recorded error; the void calls record theirs for the next
// Status-returning call or Finish(). Thread safety: calls may come
// from any thread (the model's row loops); the math calls are ordered on
// the compute stream in the order they are made, block transfers as above.
// Weights are cached by their host
// address: a backend serves one loaded model's weights (ForgetWeights()
// before another is loaded at the same addresses).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/backend.h"
#include "pagekv/status.h"

namespace pagekv {

struct CudaBackendOptions {
  int device = 0;  // CUDA device ordinal
  // kFast weight products: weights and activations in bf16 instead of f16
  // (wider range, 3 fewer mantissa bits). bf16 weight files use bf16 either way.
  bool bf16_products = false;
  // Prompt chunks of f16 / bf16 caches (head_dim a multiple of 16 up to 128)
  // through the tensor-core prefill kernel (paged_attention.h
  // TensorCorePrefillShape). Off until that kernel has been checked on a GPU
  // (the device check runs both kernels' tests).
  bool tensor_core_prefill = false;
  // Decode steps of f16 / bf16 caches (head_dim a multiple of 16 up to 128)
  // through the tensor-core decode kernel (TensorCoreDecodeShape), the one
  // meant for GQA. Off until it has been checked on a GPU, as above.
  bool tensor_core_decode = false;
  // Replayable steps (BeginReplayableStep: the engine's decode steps) run
  // as CUDA graphs: recorded, then launched as one graph kept from an
  // earlier step that made the same launches, or captured into a new one.
  // Off until it has been checked on a GPU (the device check runs its tests).
  bool cuda_graphs = false;
};

// Whether a CUDA device can be used here; *why says why not.
bool CudaDeviceAvailable(std::string* why = nullptr);

class CudaBackend final : public Backend {
 public:
  // Errors: no CUDA device or driver (Unavailable, saying so), the device
  // ordinal out of range (InvalidArgument), cuBLAS failing to start.
  static Result<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options = {});
  ~CudaBackend() override;

  std::string name() const override;  // "cuda:0 (device name)"

  bool host_memory() const override { return false; }
  Status CheckLayout(const KvLayout& layout) const override;
  void StoreKvRows(const KvLayout& layout, std::byte* arena, int32_t layer, std::span<const int64_t> slots,
                   const std::byte* k, const std::byte* v) const override;
  void ToHost(const void* src, size_t bytes, void* dst) const override;
  void FromHost(const void* src, size_t bytes, void* dst) const override;
  // The best of five timed streaming reads of a `bytes` buffer (cudaEvents).
  Result<double> DeviceReadGbps(int64_t bytes) const override;
  // Per (thread, pool, slot) device buffers, grown as asked, freed with the backend.
  std::span<std::byte> Scratch(int pool, size_t slot, size_t bytes) const override;

  Result<std::unique_ptr<KvArena>> AllocateArena(const KvArenaOptions& options) const override;
  void CopyBlocks(const KvLayout& layout, std::byte* arena, std::span<const BlockCopy> copies) const override;
  void BlockToHost(const KvLayout& layout, const std::byte* arena, BlockId block,
                   std::span<std::byte> host) const override;
  void HostToBlock(const KvLayout& layout, std::byte* arena, BlockId block,
                   std::span<const std::byte> host) const override;
  void EncodeKvRows(const KvFormat& format, int32_t elems, const float* src, int64_t rows,
                    std::byte* dst) const override;
  Status MatMul(const WeightMatrix& w, const float* x, int64_t tokens, float* y, int threads,
                Activations activations) const override;
  Status MatMulShared(std::span<const MatMulOutput> outputs, const float* x, int64_t tokens, int threads,
                      Activations activations) const override;
  void WeightRow(const WeightMatrix& w, int64_t r, float* out) const override;
  void RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps,
                   float* out) const override;
  void AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width) const override;
  void AddInPlace(float* x, const float* y, int64_t n) const override;
  void SwiGluInPlace(float* gate, const float* up, int64_t n) const override;
  void GeluGluInPlace(float* gate, const float* up, int64_t n) const override;
  void ScaleInPlace(float* x, float s, int64_t n) const override;
  void RopeTables(const Rope& rope, std::span<const int64_t> positions, float* cos, float* sin) const override;
  void RopeApply(const Rope& rope, float* x, int64_t rows, int32_t width, const float* cos,
                 const float* sin) const override;
  Status DecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, float* out,
                         const AttentionOptions& options) const override;
  Status PrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, float* out,
                          const AttentionOptions& options) const override;

  // Waits for every call made so far; returns the first error recorded
  // since the last Finish (and clears it).
  Status Finish() const override;
  // With CudaBackendOptions::cuda_graphs, the calls from here to
  // EndReplayableStep are recorded and run as a CUDA graph (see
  // step_graphs.h); a call that waits for the device (ToHost, Finish) runs
  // what was recorded first, and the rest of the step call by call.
  // Without the option they do nothing.
  void BeginReplayableStep() const override;
  Status EndReplayableStep() const override;
  // Device buffers for a caller (a model's activations, a test's inputs).
  Result<float*> AllocateFloats(int64_t n) const;
  void Free(void* p) const;
  // Host <-> device copies of n floats, in call order (ToDevice returns once
  // `host` may be reused; ToHost once the floats are there).
  Status ToDevice(const float* host, int64_t n, float* device) const;
  Status ToHost(const float* device, int64_t n, float* host) const;

  int64_t weight_bytes() const;    // device bytes of the weights uploaded so far
  int64_t host_fallbacks() const;  // calls that went through host staging
  // Uploads of attention calls' block tables and lengths: once per distinct
  // set (a decode step's layers share one), not once per call.
  int64_t table_uploads() const;
  // Recorded steps so far: launched as a graph (kept or new), graphs
  // captured, and steps that ran call by call (their calls not capturable).
  struct GraphCounts {
    int64_t launches = 0, captures = 0, uncaptured = 0;
  };
  GraphCounts graph_counts() const;
  void ForgetWeights() const;

 private:
  struct Impl;
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagekv
