// CpuBackend (kernels/backend.h): the dispatched kernels over an mmap'd arena.
#include <cstring>
#include <vector>

#include "kernels/backend.h"

namespace pagekv {
namespace {

// f(arena offset, payload offset, slab bytes) for every slab of a block, in
// payload order (layer, plane, head); a hybrid cache's block holds its
// group's layers, at the offsets of group 0's (KvLayout::block_layers).
template <typename F>
void ForEachSlab(const KvLayout& layout, int64_t block, F&& f) {
  size_t at = 0;
  for (const int32_t l : layout.block_layers()) {
    for (int32_t p = 0; p < layout.num_planes(); ++p) {
      const auto slab = static_cast<size_t>(layout.slab_bytes(l, p));
      for (int32_t h = 0; h < layout.num_heads(); ++h, at += slab) f(layout.SlabOffset(l, p, h, block), at, slab);
    }
  }
}

class Cpu final : public Backend {
 public:
  std::string name() const override { return "cpu"; }

  Result<std::unique_ptr<KvArena>> AllocateArena(const KvArenaOptions& options) const override {
    return KvArena::Create(options);
  }

  void StoreKvRows(const KvLayout& layout, std::byte* arena, int32_t layer, std::span<const int64_t> slots,
                   const std::byte* k, const std::byte* v) const override {
    const int64_t row = layout.row_bytes(layer), heads = layout.num_heads(), bl = layout.block_len();
    const std::byte* planes[2] = {k, v};
    for (int32_t p = 0; p < layout.num_planes(); ++p) {
      for (size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] < 0) continue;
        const int64_t b = slots[i] / bl;
        const auto slot = static_cast<int32_t>(slots[i] % bl);
        const std::byte* src = planes[p] + static_cast<int64_t>(i) * heads * row;
        for (int32_t h = 0; h < heads; ++h) {
          std::memcpy(arena + layout.RowOffset(layer, p, h, b, slot), src + h * row, static_cast<size_t>(row));
        }
      }
    }
  }

  void ToHost(const void* src, size_t bytes, void* dst) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void FromHost(const void* src, size_t bytes, void* dst) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }

  std::span<std::byte> Scratch(int pool, size_t slot, size_t bytes) const override {
    // Per thread: a long step's buffers are tens of MiB, which allocated
    // fresh every step cost page faults and zero-filling.
    thread_local std::vector<std::vector<std::vector<std::byte>>> pools;
    const auto p = static_cast<size_t>(pool);
    if (pools.size() <= p) pools.resize(p + 1);
    std::vector<std::vector<std::byte>>& slots = pools[p];
    if (slots.size() <= slot) slots.resize(slot + 1);
    if (slots[slot].size() < bytes) slots[slot].resize(bytes);
    return {slots[slot].data(), bytes};
  }

  void CopyBlocks(const KvLayout& layout, std::byte* arena, std::span<const BlockCopy> copies) const override {
    for (const BlockCopy& c : copies) {
      for (const int32_t l : layout.block_layers()) {
        for (int32_t p = 0; p < layout.num_planes(); ++p) {
          const auto bytes = static_cast<size_t>(layout.kivi(l) ? layout.slab_bytes(l, p) : c.filled * layout.row_bytes(l));
          for (int32_t h = 0; h < layout.num_heads(); ++h) {
            std::memcpy(arena + layout.SlabOffset(l, p, h, ToInt(c.dst)), arena + layout.SlabOffset(l, p, h, ToInt(c.src)),
                        bytes);
          }
        }
      }
    }
  }

  void BlockToHost(const KvLayout& layout, const std::byte* arena, BlockId block,
                   std::span<std::byte> host) const override {
    ForEachSlab(layout, ToInt(block),
                [&](int64_t offset, size_t at, size_t slab) { std::memcpy(host.data() + at, arena + offset, slab); });
  }

  void HostToBlock(const KvLayout& layout, std::byte* arena, BlockId block,
                   std::span<const std::byte> host) const override {
    ForEachSlab(layout, ToInt(block),
                [&](int64_t offset, size_t at, size_t slab) { std::memcpy(arena + offset, host.data() + at, slab); });
  }

  void EncodeKvRows(const KvFormat& format, int32_t elems, const float* src, int64_t rows,
                    std::byte* dst) const override {
    pagekv::EncodeKvRows(format, elems, src, rows, dst);
  }

  Status MatMul(const WeightMatrix& w, const float* x, int64_t tokens, float* y, int threads,
                Activations activations) const override {
    return pagekv::MatMul(w, x, tokens, y, threads, activations);
  }
  Status MatMulShared(std::span<const MatMulOutput> outputs, const float* x, int64_t tokens, int threads,
                      Activations activations) const override {
    return pagekv::MatMulShared(outputs, x, tokens, threads, activations);
  }
  void WeightRow(const WeightMatrix& w, int64_t r, float* out) const override { pagekv::WeightRow(w, r, out); }
  void RmsNormRows(const float* x, const float* weight, int64_t rows, int32_t width, float eps,
                   float* out) const override {
    pagekv::RmsNormRows(x, weight, rows, width, eps, out);
  }
  void AddBiasRows(float* x, const float* bias, int64_t rows, int64_t width) const override {
    pagekv::AddBiasRows(x, bias, rows, width);
  }
  void AddInPlace(float* x, const float* y, int64_t n) const override { pagekv::AddInPlace(x, y, n); }
  void SwiGluInPlace(float* gate, const float* up, int64_t n) const override { pagekv::SwiGluInPlace(gate, up, n); }
  void GeluGluInPlace(float* gate, const float* up, int64_t n) const override { pagekv::GeluGluInPlace(gate, up, n); }
  void ScaleInPlace(float* x, float s, int64_t n) const override { pagekv::ScaleInPlace(x, s, n); }
  void RopeTables(const Rope& rope, std::span<const int64_t> positions, float* cos, float* sin) const override {
    rope.Tables(positions, cos, sin);
  }
  void RopeApply(const Rope& rope, float* x, int64_t rows, int32_t width, const float* cos,
                 const float* sin) const override {
    rope.Apply(x, rows, width, cos, sin);
  }
  Status DecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, float* out,
                         const AttentionOptions& options) const override {
    return PagedDecodeAttention(kv, seqs, q, out, options);
  }
  Status PrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, float* out,
                          const AttentionOptions& options) const override {
    return PagedPrefillAttention(kv, seqs, q, out, options);
  }
};

}  // namespace

const Backend& CpuBackend() {
  static const Cpu cpu;
  return cpu;
}

}  // namespace pagekv
