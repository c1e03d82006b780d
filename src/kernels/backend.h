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
// memory (but for the model's weights: matrices, norm weights and biases
// may stay in host memory, which the backend copies once), and the block
// transfers are its host <-> device copies. What a
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

  // Whether the arena and the pointers the math calls take are host memory
  // a caller may read and write directly (the CPU backend). A device
  // backend's are not: what crosses to the host goes through ToHost, rows
  // into the arena through StoreKvRows, blocks through BlockToHost /
  // HostToBlock.
  virtual bool host_memory() const { return true; }
  // Whether this backend reads and writes a cache laid out by `layout`: an
  // Unimplemented error naming the format or kind it does not, and the fix.
  virtual Status CheckLayout(const KvLayout& /*layout*/) const { return Status::Ok(); }

  // Waits for the work the calls so far enqueued and returns the first
  // error any of them recorded since the last Finish (the void calls of a
  // device backend cannot return theirs); the CPU backend's calls finish
  // before they return and record nothing.
  virtual Status Finish() const { return Status::Ok(); }
  // Brackets a step whose calls repeat from step to step with new inputs (a
  // decode step: one token per sequence), so that a device backend may
  // record them and launch them as one graph (CUDA graphs); End runs what is
  // still recorded and returns the first error recorded. Begin and End come
  // from one thread, around the model's Forward, whatever it returned; the
  // CPU backend does nothing.
  virtual void BeginReplayableStep() const {}
  virtual Status EndReplayableStep() const { return Status::Ok(); }

  // KV store by slot mapping: token i's rows of `layer` (k: [tokens][heads]
  // rows of layout.row_bytes(layer) bytes each, in this backend's memory; v
  // the same, null for an MLA latent cache) go to slot slots[i] = block *
  // block_len + offset of `layout`'s blocks; a negative slot is skipped
  // (another context slice's token). Not for INT4 KIVI layers.
  virtual void StoreKvRows(const KvLayout& layout, std::byte* arena, int32_t layer, std::span<const int64_t> slots,
                           const std::byte* k, const std::byte* v) const = 0;
  // `bytes` bytes of this backend's memory to host memory; returns when
  // they are there. FromHost: the other way, in call order with the math
  // calls (`src` may be reused when it returns).
  virtual void ToHost(const void* src, size_t bytes, void* dst) const = 0;
  virtual void FromHost(const void* src, size_t bytes, void* dst) const = 0;
  // A device backend's memory read bandwidth, measured now by a streaming
  // read of `bytes` bytes (the roofline its kernels are judged by); the CPU
  // backend has none of its own (Unimplemented: the host's stream probe is
  // its ceiling, kernels/machine_ceilings.h).
  virtual Result<double> DeviceReadGbps(int64_t /*bytes*/) const {
    return UnimplementedError("the CPU backend's ceiling is the host's stream probe");
  }
  // Scratch in this backend's memory for the calling thread, reused from
  // call to call: slot `slot` of pool `pool`, at least `bytes` bytes,
  // contents undefined. Valid until the same thread asks for the same slot
  // again with more bytes.
  virtual std::span<std::byte> Scratch(int pool, size_t slot, size_t bytes) const = 0;

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
