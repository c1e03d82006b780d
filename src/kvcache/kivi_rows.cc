// INT4 KIVI rows of a KvCache (kivi_rows.h).
#include "kvcache/kivi_rows.h"

#include <cstring>
#include <vector>

#include "layout/float16.h"
#include "layout/quantize.h"

namespace pagekv::kivi {
namespace {

struct Geometry {
  int32_t g = 0, d = 0, heads = 0, bl = 0;
  int64_t row = 0;        // f16 row bytes (2 * d)
  int64_t group_bytes = 0;  // one key group in the K slab
  int64_t value_row = 0;    // one value row in the V slab
};

Geometry Of(const KvLayout& l, int32_t layer) {
  Geometry g;
  g.g = l.kivi_group(layer);
  g.d = l.row_elems();
  g.heads = l.num_heads();
  g.bl = l.block_len();
  g.row = l.row_bytes(layer);
  g.group_bytes = quant::Int4KeyGroupBytes(g.g, g.d);
  g.value_row = quant::Int4ValueRowBytes(g.d);
  return g;
}

void F16RowsToF32(const std::byte* src, int64_t values, float* dst) {
  for (int64_t i = 0; i < values; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = F16ToF32(h);
  }
}

void F32ToF16Rows(const float* src, int64_t values, std::byte* dst) {
  for (int64_t i = 0; i < values; ++i) {
    const uint16_t h = F32ToF16(src[i]);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

// Where group `first / G` of a sequence lives: its block's K slab group and
// the V slab rows of its tokens.
struct GroupAt {
  std::byte* k;  // the key group
  std::byte* v;  // the value row of the group's first token
};

GroupAt Locate(const KvLayout& l, const Geometry& g, std::byte* arena, std::span<const BlockId> blocks,
               int32_t layer, int32_t head, int64_t first) {
  const int64_t block = ToInt(blocks[static_cast<size_t>(first / g.bl)]);
  const int64_t in_block = first % g.bl;
  return {arena + l.SlabOffset(layer, 0, head, block) + (in_block / g.g) * g.group_bytes,
          arena + l.SlabOffset(layer, 1, head, block) + in_block * g.value_row};
}

// Quantizes the tail's full group (first token at `first`) into its block.
void Seal(const KvLayout& l, const Geometry& g, std::byte* arena, std::span<const BlockId> blocks,
          const std::byte* tail, int32_t layer, int64_t first) {
  std::vector<float> x(static_cast<size_t>(g.g) * static_cast<size_t>(g.d));
  for (int32_t h = 0; h < g.heads; ++h) {
    const GroupAt at = Locate(l, g, arena, blocks, layer, h, first);
    F16RowsToF32(tail + l.TailOffset(layer, 0, h), int64_t{g.g} * g.d, x.data());
    quant::EncodeInt4KeyGroup(x.data(), g.g, g.d, at.k);
    F16RowsToF32(tail + l.TailOffset(layer, 1, h), int64_t{g.g} * g.d, x.data());
    for (int32_t t = 0; t < g.g; ++t) quant::EncodeInt4ValueRow(x.data() + int64_t{t} * g.d, g.d, at.v + t * g.value_row);
  }
}

// Decodes the sealed group starting at `first` of one head: K and V [G][D] f32.
void DecodeGroup(const KvLayout& l, const Geometry& g, const std::byte* arena, std::span<const BlockId> blocks,
                 int32_t layer, int32_t head, int64_t first, float* k, float* v) {
  const GroupAt at = Locate(l, g, const_cast<std::byte*>(arena), blocks, layer, head, first);
  quant::DecodeInt4KeyGroup(at.k, g.g, g.d, k);
  for (int32_t t = 0; t < g.g; ++t) quant::DecodeInt4ValueRow(at.v + t * g.value_row, g.d, v + int64_t{t} * g.d);
}

}  // namespace

void WriteRows(const KvLayout& layout, std::byte* arena, std::span<const BlockId> blocks, std::byte* tail,
               int32_t layer, int64_t pos, int64_t n, const std::byte* k, const std::byte* v, int64_t src_token_stride) {
  const Geometry g = Of(layout, layer);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pos + i;
    const int64_t slot = p % g.g;
    for (int32_t h = 0; h < g.heads; ++h) {
      std::memcpy(tail + layout.TailOffset(layer, 0, h) + slot * g.row, k + i * src_token_stride + h * g.row,
                  static_cast<size_t>(g.row));
      std::memcpy(tail + layout.TailOffset(layer, 1, h) + slot * g.row, v + i * src_token_stride + h * g.row,
                  static_cast<size_t>(g.row));
    }
    if (slot == g.g - 1) Seal(layout, g, arena, blocks, tail, layer, p - slot);
  }
}

void ReadRows(const KvLayout& layout, const std::byte* arena, std::span<const BlockId> blocks, const std::byte* tail,
              int32_t layer, int64_t len, int64_t begin, int64_t n, std::byte* k, std::byte* v,
              int64_t dst_token_stride) {
  const Geometry g = Of(layout, layer);
  const int64_t sealed = len / g.g * g.g;
  std::vector<float> kf(static_cast<size_t>(g.g) * static_cast<size_t>(g.d)), vf(kf.size());
  for (int32_t h = 0; h < g.heads; ++h) {
    int64_t decoded = -1;  // first token of the group in kf / vf
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = begin + i;
      std::byte* dk = k + i * dst_token_stride + h * g.row;
      std::byte* dv = v + i * dst_token_stride + h * g.row;
      if (p >= sealed) {
        std::memcpy(dk, tail + layout.TailOffset(layer, 0, h) + (p % g.g) * g.row, static_cast<size_t>(g.row));
        std::memcpy(dv, tail + layout.TailOffset(layer, 1, h) + (p % g.g) * g.row, static_cast<size_t>(g.row));
        continue;
      }
      const int64_t first = p / g.g * g.g;
      if (first != decoded) {
        DecodeGroup(layout, g, arena, blocks, layer, h, first, kf.data(), vf.data());
        decoded = first;
      }
      F32ToF16Rows(kf.data() + (p - first) * g.d, g.d, dk);
      F32ToF16Rows(vf.data() + (p - first) * g.d, g.d, dv);
    }
  }
}

void RefillTail(const KvLayout& layout, const std::byte* arena, std::span<const BlockId> blocks, std::byte* tail,
                int32_t layer, int64_t old_len, int64_t new_len) {
  const Geometry g = Of(layout, layer);
  const int64_t first = new_len / g.g * g.g;
  if (new_len % g.g == 0 || first + g.g > old_len) return;  // empty tail, or the group was never sealed
  std::vector<float> kf(static_cast<size_t>(g.g) * static_cast<size_t>(g.d)), vf(kf.size());
  for (int32_t h = 0; h < g.heads; ++h) {
    DecodeGroup(layout, g, arena, blocks, layer, h, first, kf.data(), vf.data());
    F32ToF16Rows(kf.data(), (new_len - first) * g.d, tail + layout.TailOffset(layer, 0, h));
    F32ToF16Rows(vf.data(), (new_len - first) * g.d, tail + layout.TailOffset(layer, 1, h));
  }
}

}  // namespace pagekv::kivi
