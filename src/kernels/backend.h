// The device seam: one object that owns where the KV pool's bytes live and
// every operation that touches them or runs the model's math. The block
// manager (kvcache) allocates its arena, copies blocks on write and moves
// blocks to and from host memory through it; the model (model/) runs its
// matmuls, layer ops, K/V encoding and paged attention through it; the
// tiers' mover reaches the pool through the block manager, so through it
// too. The CPU backend (CpuBackend) is the dispatched Highway kernels of
// this module over an mmap'd arena.
//
// A device backend (the CUDA issue) implements the same calls over device
// memory: pointers given to the math calls are then in that backend's
// memory, and the block transfers are its host <-> device copies. What a
// device backend needs beyond this interface (weights uploaded once,
// activation buffers of its own, streams) comes with it; the scheduler and
// the model's order of operations do not change.
//
// Thread safety: every call is const and may run on any thread; callers
// keep concurrent calls on disjoint memory (a mover's block transfer beside
// a forward pass over other blocks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kernels/kv_arena.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "pagekv/attention.h"
#include "pagekv/ids.h"
#include "pagekv/kv_layout.h"
#include "pagekv/status.h"

namespace pagekv {

// Copy-on-write of one block: `dst` gets `src`'s first `filled` slots of
// every slab (the whole slab for INT4 KIVI layers, whose slabs are groups).
struct BlockCopy {
  BlockId src{};
  BlockId dst{};
  int32_t filled = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // The KV pool's memory. Errors: a size <= 0, the device refusing it.
  virtual Result<std::unique_ptr<KvArena>> AllocateArena(const KvArenaOptions& options) const = 0;

  // Block moves inside an arena laid out by `layout`.
  virtual void CopyBlocks(const KvLayout& layout, std::byte* arena, std::span<const BlockCopy> copies) const = 0;
  // A block's bytes to / from host memory, in payload order (layer, plane,
  // head; KvCache::ReadBlock): host.size() == the layout's payload bytes.
  virtual void BlockToHost(const KvLayout& layout, const std::byte* arena, BlockId block,
                           std::span<std::byte> host) const = 0;
  virtual void HostToBlock(const KvLayout& layout, std::byte* arena, BlockId block,
                           std::span<const std::byte> host) const = 0;

  // store_kv, its encoding half: rows of `elems` floats to the format's
  // stored rows (kernels/ops.h EncodeKvRows); StepKv::Store places them.
  virtual void EncodeKvRows(const KvFormat& format, int32_t elems, const float* src, int64_t rows,
                            std::byte* dst) const = 0;

  // The model's math (kernels/matmul.h, kernels/ops.h, pagekv/attention.h).
  virtual Status MatMul(const WeightMatrix& w, const float* x, int64_t tokens, float* y, int threads,
                        Activations activations) const = 0;
  virtual Status MatMulShared(std::span<const MatMulOutput> outputs, const float* x, int64_t tokens, int threads,
                              Activations activations) const = 0;
  virtual void WeightRow(const WeightMatrix& w, int64_t r, float* out) const = 0;
  virtual void RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps,
                           float* out) const = 0;
  virtual void AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width) const = 0;
  virtual void AddInPlace(float* x, const float* y, int64_t n) const = 0;
  virtual void SwiGluInPlace(float* gate, const float* up, int64_t n) const = 0;
  virtual void GeluGluInPlace(float* gate, const float* up, int64_t n) const = 0;
  virtual void ScaleInPlace(float* x, float s, int64_t n) const = 0;
  virtual void RopeTables(const Rope& rope, std::span<const int64_t> positions, float* cos, float* sin) const = 0;
  virtual void RopeApply(const Rope& rope, float* x, int64_t rows, int32_t width, const float* cos,
                         const float* sin) const = 0;
  virtual Status DecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, float* out,
                                 const AttentionOptions& options) const = 0;
  virtual Status PrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, float* out,
                                  const AttentionOptions& options) const = 0;
};

// The process's CPU backend.
const Backend& CpuBackend();

}  // namespace pagekv
