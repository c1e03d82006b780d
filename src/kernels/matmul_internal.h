// What matmul.cc's per-target kernels and the plain C++ around them share
// (matmul_driver.cc: the calls' work split; packed_weights.cc: the panel
// layouts and WeightRow): the block formats' panel layouts, the tile and
// token limits, one call's task, and the dispatched kernels' entry points.
// Not part of the module's interface.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/amx_matmul.h"
#include "kernels/matmul.h"
#include "kernels/weight_formats.h"

namespace pagekv::kernels {

constexpr int64_t kQ8Block = 32;       // elements per q8_0 block
constexpr int64_t kQ8BlockBytes = 34;  // f16 scale + 32 int8
// q8_0 in panels (PackedWeights): per 16-row panel and 32-column block, the
// 16 rows' f16 scales (32 bytes), then for each pair of columns (2j, 2j + 1)
// the 16 rows' two int8 (32 bytes): the same 544 bytes as 16 q8_0 blocks,
// read front to back by every kernel, the pairs as the int16 pair products
// (vpmaddwd / vpdpwssd) take them.
constexpr int64_t kQ8PanelBlockBytes = 16 * kQ8BlockBytes;
// q4_k in panels: per 16-row panel and 256-column block, the rows' f16 d
// (32 bytes) and dmin (32), their sub-block scales [8][16] and mins [8][16]
// as bytes (256), then for each four columns c .. c + 3 the 16 rows'
// nibbles in 32 bytes: row n's byte 2n holds columns c (low nibble) and
// c + 2, byte 2n + 1 columns c + 1 and c + 3, so widened to 16-bit lanes
// the low nibbles are each row's (c, c + 1) pair and the high ones its
// (c + 2, c + 3) pair. 2368 bytes, 2.8% over the rows' own 2304.
constexpr int64_t kQ4KPanelBlockBytes = 64 + 256 + 2048;
constexpr int64_t kQ4KQuantsAt = 320;  // offset of the nibbles in a panel block
// Where element e (0..255) of row n (0..15) sits in a q4_k panel block: its
// byte, and the nibble's shift.
constexpr int64_t Q4KNibbleByte(int e, int n) { return kQ4KQuantsAt + 32 * (e / 4) + 2 * n + e % 2; }
constexpr int Q4KNibbleShift(int e) { return 4 * ((e % 4) / 2); }
// q5_k in panels: q4_k's layout with each 32-column sub-block's nibbles
// (256 bytes) followed by their fifth bits (64: two 32-byte lines, one per
// four four-column steps, as NibbleFormat lays them out below), so that the
// kernels read one stream: 320 + 8 x 320 = 2880 bytes, 2.3% over the rows'
// own 2816. Where element e of row n sits in either k-quant layout:
constexpr int64_t kQ5KPanelBlockBytes = 320 + 8 * (256 + 64);
constexpr int64_t KNibbleByte(bool fifth, int e, int n) {
  return kQ4KQuantsAt + (fifth ? 320 : 256) * (e / 32) + 32 * ((e % 32) / 4) + 2 * n + e % 2;
}
constexpr int64_t Q5KFifthByte(int e, int n) { return kQ4KQuantsAt + 320 * (e / 32) + 256 + 32 * ((e % 32) / 16) + 2 * n + e % 2; }
// q6_k in panels: per 16-row panel and 256-column block, the rows' f16 d
// (32 bytes), then per 16-element group, in the order the kernel reads
// them (one stream, as q8_0's and q4_k's): the rows' int8 scales (16
// bytes), the low four bits of the group's values as q4_k's nibbles are
// laid out (128), and their high two bits (64): row n's bytes 2n and 2n + 1
// of each 32-byte line hold, for the group's first four-column step of a
// pair, the high bits of columns c and c + 1 at bits 0-1 and of c + 2, c + 3
// at bits 4-5, and for the second the same at bits 2-3 and 6-7, so that
// shifted into place they complete the low nibbles' int16 pairs. 3360
// bytes, the rows' own.
constexpr int64_t kQ6KGroupBytes = 16 + 128 + 64;
constexpr int64_t kQ6KPanelBlockBytes = 32 + 16 * kQ6KGroupBytes;
constexpr int64_t Q6KGroupAt(int g) { return 32 + kQ6KGroupBytes * g; }
constexpr int64_t Q6KScaleByte(int g, int n) { return Q6KGroupAt(g) + n; }
constexpr int64_t Q6KLowByte(int e, int n) { return Q6KGroupAt(e / 16) + 16 + 32 * ((e % 16) / 4) + 2 * n + e % 2; }
constexpr int64_t Q6KHighByte(int e, int n) { return Q6KGroupAt(e / 16) + 144 + 32 * ((e % 16) / 8) + 2 * n + e % 2; }
constexpr int Q6KHighShift(int e) { return 2 * ((e / 4) % 2) + 4 * ((e % 4) / 2); }
// The 32-element formats with 4-bit values (q4_0, q4_1) and 5-bit ones
// (q5_0, q5_1) in panels, each value d * (q - offset) + m: per 16-row panel
// and 32-column block the rows' f16 d (32 bytes), their f16 m where the
// format has one (32), the values' low four bits as q4_k's nibbles (256:
// per four columns c .. c + 3, row n's byte 2n holds c and c + 2, byte
// 2n + 1 c + 1 and c + 3), and for the 5-bit formats the fifth bits in two
// 32-byte lines, one per four four-column steps (for step j, row n's bytes
// 2n and 2n + 1 hold at bits j % 4 and 4 + j % 4 the bits of the same
// columns as the step's nibble bytes, so that shifted into bit 4 they
// complete the nibbles' int16 pairs). The rows' own bytes, in the order the
// kernels (intdot::NibblePanel) read them.
struct NibbleFormat {
  bool min = false, fifth = false;
  int offset = 0;  // 8 (q4_0), 16 (q5_0), 0 (q4_1, q5_1: m instead)
  constexpr int64_t NibblesAt() const { return min ? 64 : 32; }
  constexpr int64_t BlockBytes() const { return NibblesAt() + 256 + (fifth ? 64 : 0); }
  constexpr int64_t NibbleByte(int e, int n) const { return NibblesAt() + 32 * (e / 4) + 2 * n + e % 2; }
  constexpr int64_t FifthByte(int e, int n) const { return NibblesAt() + 256 + 32 * (e / 16) + 2 * n + e % 2; }
  // The ggml block's own layout: d, then m, then the fifth bits (uint32), then 16 bytes of nibbles.
  constexpr int64_t SourceBitsAt() const { return min ? 4 : 2; }
  constexpr int64_t SourceNibblesAt() const { return SourceBitsAt() + (fifth ? 4 : 0); }
};
constexpr NibbleFormat NibbleFormatOf(WeightType t) {
  return t == WeightType::kQ4_0   ? NibbleFormat{false, false, 8}
         : t == WeightType::kQ4_1 ? NibbleFormat{true, false, 0}
         : t == WeightType::kQ5_0 ? NibbleFormat{false, true, 16}
         : t == WeightType::kQ5_1 ? NibbleFormat{true, true, 0}
                                  : NibbleFormat{};
}
constexpr bool IsNibbleFormat(WeightType t) {
  return t == WeightType::kQ4_0 || t == WeightType::kQ4_1 || t == WeightType::kQ5_0 || t == WeightType::kQ5_1;
}
constexpr int FifthShift(int e) { return (e / 4) % 4 + 4 * ((e % 4) / 2); }
// Element e (0..31) of row n of a nibble-format panel block, as its integer q.
inline int NibbleValue(const NibbleFormat& f, const uint8_t* blk, int e, int n) {
  const int low = (blk[f.NibbleByte(e, n)] >> Q4KNibbleShift(e)) & 0x0F;
  return f.fifth ? low | ((blk[f.FifthByte(e, n)] >> FifthShift(e)) & 1) << 4 : low;
}
// Bytes of one 16-row panel's block in a block format's panel layout (0: none).
constexpr int64_t PanelBlockBytes(WeightType t) {
  return t == WeightType::kQ8_0   ? kQ8PanelBlockBytes
         : IsNibbleFormat(t)      ? NibbleFormatOf(t).BlockBytes()
         : t == WeightType::kQ4_K ? kQ4KPanelBlockBytes
         : t == WeightType::kQ5_K ? kQ5KPanelBlockBytes
         : t == WeightType::kQ6_K ? kQ6KPanelBlockBytes
                                  : 0;
}
inline bool PanelLayout(WeightType t) { return !IsBlockQuantized(t) || PanelBlockBytes(t) > 0; }
// Bytes of one 16-row panel of `cols` columns.
inline int64_t PanelBytes(WeightType t, int64_t cols) {
  if (IsBlockQuantized(t)) return cols / FormatOf(t).block_elems * PanelBlockBytes(t);
  return cols * 16 * (t == WeightType::kF32 ? 4 : 2);
}
constexpr int kPanelRows = 16;         // rows per panel (WeightMatrix::panels)
constexpr int64_t kIntMaxTokens = 15;  // Activations::kFast runs block formats as integer products up to this many tokens
constexpr int64_t kPanelPadRows = 32;  // packed rows are padded to a multiple of this (the widest tile)
// Tokens from which the decoded-panel path beats decoding per token tile
// (and the integer path: measured on SmolLM2's Q4_1, docs/PERFORMANCE.md).
constexpr int64_t kDecodedPanelMinTokens = 16;

// One call's task, shared by every thread.
struct MatMulTask {
  WeightMatrix w;
  int64_t row_bytes = 0;  // row-major: bytes per row; panels: bytes per panel
  const float* x = nullptr;
  int64_t tokens = 0;
  float* y = nullptr;
  // Activations::kFast on a block format: X as q16 rows (int_dot-inl.h), else null.
  const int16_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xs = nullptr;
  // Set where the call runs through AMX tiles (amx_matmul.h; panels and
  // block formats from AmxMinTokens tokens): X split into bf16 hi + lo.
  const AmxActivations* amx = nullptr;
};

}  // namespace pagekv::kernels

namespace pagekv::kernels {

// The dispatched kernels (matmul.cc): rows [row_begin, row_end) of a
// row-major or panel task for every token; whether the integer-activation
// products run here; X rounded to q16 rows (int_dot-inl.h).
void RowRange(const MatMulTask& task, int64_t row_begin, int64_t row_end);
void PanelRange(const MatMulTask& task, int64_t row_begin, int64_t row_end);
bool IntDot();
void QuantizeQ16(const float* x, int64_t tokens, int64_t cols, int16_t* xq, float* xd, float* xs);
bool AmxTarget();

}  // namespace pagekv::kernels
