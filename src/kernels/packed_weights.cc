// PackedWeights::Pack (matmul.h): rows regrouped into the panel layouts of
// matmul_internal.h; and WeightRow, one row decoded from any layout.
#include <cstring>
#include <string>
#include <vector>

#include "kernels/matmul_internal.h"
#include "layout/float16.h"

namespace pagekv {

Result<PackedWeights> PackedWeights::Pack(const WeightMatrix& w) {
  if (w.data == nullptr || w.rows <= 0 || w.cols <= 0) return InvalidArgumentError("pack weights: empty matrix");
  if (w.panels) return InvalidArgumentError("pack weights: the matrix is already in panels");
  if (!kernels::PanelLayout(w.type)) {
    return InvalidArgumentError("pack weights: " + std::string(FormatOf(w.type).name) +
                                " rows stay row-major (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k and q6_k have a panel layout)");
  }
  const int64_t block = FormatOf(w.type).block_elems;
  if (w.cols % block != 0) {
    return InvalidArgumentError("pack weights: " + std::string(FormatOf(w.type).name) + " rows need a multiple of " +
                                std::to_string(block) + " columns, got " + std::to_string(w.cols));
  }
  const int64_t padded = (w.rows + kernels::kPanelPadRows - 1) / kernels::kPanelPadRows * kernels::kPanelPadRows;
  PackedWeights p;
  const int64_t panel_bytes = kernels::PanelBytes(w.type, w.cols);
  p.bytes_ = padded / kernels::kPanelRows * panel_bytes;
  p.data_.reset(static_cast<std::byte*>(std::aligned_alloc(64, static_cast<size_t>((p.bytes_ + 63) / 64 * 64))));
  if (p.data_ == nullptr) return ResourceExhaustedError("pack weights: out of memory for " + std::to_string(p.bytes_) + " bytes");
  std::memset(p.data_.get(), 0, static_cast<size_t>(p.bytes_));
  const int64_t row_bytes = WeightRowBytes(w.type, w.cols);
  if (w.type == WeightType::kQ6_K) {
    // kQ6KPanelBlockBytes: per panel and block, the rows' d, their group
    // scales, then the values' low nibbles and high bits.
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int n = static_cast<int>(r % kernels::kPanelRows);
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / 256; ++b) {
        const auto* in = reinterpret_cast<const uint8_t*>(src + b * FormatOf(w.type).block_bytes);
        auto* out = reinterpret_cast<uint8_t*>(panel + b * kernels::kQ6KPanelBlockBytes);
        std::memcpy(out + 2 * n, in + 208, 2);
        for (int g = 0; g < 16; ++g) out[kernels::Q6KScaleByte(g, n)] = in[192 + g];
        for (int e = 0; e < 256; ++e) {
          // weight_formats.cc's order: half h, then four runs of 32 (k).
          const int h = e / 128, k = (e % 128) / 32, l = e % 32;
          const uint8_t ql = in[64 * h + l + 32 * (k % 2)];
          const int low = k < 2 ? ql & 0x0F : ql >> 4;
          const int high = (in[128 + 32 * h + l] >> (2 * k)) & 3;
          out[kernels::Q6KLowByte(e, n)] |= static_cast<uint8_t>(low << (4 * ((e % 4) / 2)));
          out[kernels::Q6KHighByte(e, n)] |= static_cast<uint8_t>(high << kernels::Q6KHighShift(e));
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  if (kernels::IsNibbleFormat(w.type)) {
    // kernels::NibbleFormat: per panel and block, the rows' d (and m), then
    // their values' low nibbles (and fifth bits).
    const kernels::NibbleFormat f = kernels::NibbleFormatOf(w.type);
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int n = static_cast<int>(r % kernels::kPanelRows);
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / 32; ++b) {
        const std::byte* in = src + b * FormatOf(w.type).block_bytes;
        auto* out = reinterpret_cast<uint8_t*>(panel + b * f.BlockBytes());
        std::memcpy(out + 2 * n, in, 2);
        if (f.min) std::memcpy(out + 32 + 2 * n, in + 2, 2);
        uint32_t fifth = 0;
        if (f.fifth) std::memcpy(&fifth, in + f.SourceBitsAt(), 4);
        const auto* qs = reinterpret_cast<const uint8_t*>(in + f.SourceNibblesAt());
        for (int e = 0; e < 32; ++e) {  // element e: qs[e]'s low nibble, then qs[e - 16]'s high one; bit e
          const int low = e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4;
          out[f.NibbleByte(e, n)] |= static_cast<uint8_t>(low << kernels::Q4KNibbleShift(e));
          if (f.fifth) out[f.FifthByte(e, n)] |= static_cast<uint8_t>(((fifth >> e) & 1) << kernels::FifthShift(e));
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  if (w.type == WeightType::kQ4_K || w.type == WeightType::kQ5_K) {
    // kQ4KPanelBlockBytes / kQ5KPanelBlockBytes: per panel and block, the
    // rows' d and dmin, their sub-block scales and mins as bytes, then per
    // pair of columns the rows' two nibbles (q5_k: each sub-block's fifth
    // bits after its nibbles).
    const bool fifth = w.type == WeightType::kQ5_K;
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int64_t n = r % kernels::kPanelRows;
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / 256; ++b) {
        const std::byte* in = src + b * FormatOf(w.type).block_bytes;
        auto* out = reinterpret_cast<uint8_t*>(panel + b * kernels::PanelBlockBytes(w.type));
        std::memcpy(out + 2 * n, in, 2);
        std::memcpy(out + 32 + 2 * n, in + 2, 2);
        for (int j = 0; j < 8; ++j) Q4KScaleMin(in, j, out[64 + 16 * j + n], out[192 + 16 * j + n]);  // q5_k's sit alike
        // q5_k: the fifth bits qh[32] at 16 (element e's is bit e / 32 of qh[e % 32]), the nibbles after.
        const auto* qh = reinterpret_cast<const uint8_t*>(in + 16);
        const auto* qs = reinterpret_cast<const uint8_t*>(in + (fifth ? 48 : 16));
        // Element e: chunk e / 64 of qs's 32-byte groups, the low nibble
        // for the first 32 of the chunk, the high one for the rest.
        auto nibble = [&](int e) { return e % 64 < 32 ? qs[32 * (e / 64) + e % 64] & 0x0F : qs[32 * (e / 64) + e % 64 - 32] >> 4; };
        for (int e = 0; e < 256; ++e) {
          out[kernels::KNibbleByte(fifth, e, static_cast<int>(n))] |= static_cast<uint8_t>(nibble(e) << kernels::Q4KNibbleShift(e));
          if (fifth) {
            out[kernels::Q5KFifthByte(e, static_cast<int>(n))] |=
                static_cast<uint8_t>(((qh[e % 32] >> (e / 32)) & 1) << kernels::FifthShift(e));
          }
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  if (w.type == WeightType::kQ8_0) {
    // kQ8PanelBlockBytes: per panel and block, the rows' scales, then per
    // pair of columns the rows' two bytes.
    for (int64_t r = 0; r < w.rows; ++r) {
      const std::byte* src = w.data + r * row_bytes;
      const int64_t n = r % kernels::kPanelRows;
      std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * panel_bytes;
      for (int64_t b = 0; b < w.cols / kernels::kQ8Block; ++b) {
        const std::byte* in = src + b * kernels::kQ8BlockBytes;
        std::byte* out = panel + b * kernels::kQ8PanelBlockBytes;
        std::memcpy(out + 2 * n, in, 2);
        for (int64_t j = 0; j < kernels::kQ8Block / 2; ++j) {
          std::memcpy(out + 2 * kernels::kPanelRows + j * 2 * kernels::kPanelRows + 2 * n, in + 2 + 2 * j, 2);
        }
      }
    }
    p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
    return p;
  }
  const int64_t elem = w.type == WeightType::kF32 ? 4 : 2;
  for (int64_t r = 0; r < w.rows; ++r) {
    const std::byte* src = w.data + r * row_bytes;
    std::byte* panel = p.data_.get() + (r / kernels::kPanelRows) * w.cols * kernels::kPanelRows * elem;
    const int64_t lane = r % kernels::kPanelRows;
    for (int64_t c = 0; c < w.cols; ++c) {
      std::memcpy(panel + (c * kernels::kPanelRows + lane) * elem, src + c * elem, static_cast<size_t>(elem));
    }
  }
  p.matrix_ = WeightMatrix{p.data_.get(), w.type, w.rows, w.cols, true};
  return p;
}

bool HasPanelLayout(WeightType type) { return kernels::PanelLayout(type); }

void WeightRow(const WeightMatrix& w, int64_t r, float* out) {
  if (w.type == WeightType::kQ6_K && w.panels) {
    const int n = static_cast<int>(r % kernels::kPanelRows);
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * kernels::PanelBytes(w.type, w.cols);
    for (int64_t b = 0; b < w.cols / 256; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kernels::kQ6KPanelBlockBytes);
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      for (int e = 0; e < 256; ++e) {
        const int low = (blk[kernels::Q6KLowByte(e, n)] >> (4 * ((e % 4) / 2))) & 0x0F;
        const int high = (blk[kernels::Q6KHighByte(e, n)] >> kernels::Q6KHighShift(e)) & 3;
        const auto sc = static_cast<int8_t>(blk[kernels::Q6KScaleByte(e / 16, n)]);
        out[b * 256 + e] = d * static_cast<float>(sc) * static_cast<float>((low | high << 4) - 32);
      }
    }
    return;
  }
  if (kernels::IsNibbleFormat(w.type) && w.panels) {
    const kernels::NibbleFormat f = kernels::NibbleFormatOf(w.type);
    const int n = static_cast<int>(r % kernels::kPanelRows);
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * kernels::PanelBytes(w.type, w.cols);
    for (int64_t b = 0; b < w.cols / 32; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * f.BlockBytes());
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      float m = 0.0f;
      if (f.min) {
        std::memcpy(&h, blk + 32 + 2 * n, 2);
        m = F16ToF32(h);
      }
      for (int e = 0; e < 32; ++e) out[b * 32 + e] = d * static_cast<float>(kernels::NibbleValue(f, blk, e, n) - f.offset) + m;
    }
    return;
  }
  if ((w.type == WeightType::kQ4_K || w.type == WeightType::kQ5_K) && w.panels) {
    const bool fifth = w.type == WeightType::kQ5_K;
    const int64_t n = r % kernels::kPanelRows;
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * kernels::PanelBytes(w.type, w.cols);
    for (int64_t b = 0; b < w.cols / 256; ++b) {
      const auto* blk = reinterpret_cast<const uint8_t*>(panel + b * kernels::PanelBlockBytes(w.type));
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float d = F16ToF32(h);
      std::memcpy(&h, blk + 32 + 2 * n, 2);
      const float dmin = F16ToF32(h);
      for (int e = 0; e < 256; ++e) {
        const int sub = e / 32;
        int u = (blk[kernels::KNibbleByte(fifth, e, static_cast<int>(n))] >> kernels::Q4KNibbleShift(e)) & 0x0F;
        if (fifth) u |= ((blk[kernels::Q5KFifthByte(e, static_cast<int>(n))] >> kernels::FifthShift(e)) & 1) << 4;
        out[b * 256 + e] = d * static_cast<float>(blk[64 + 16 * sub + n]) * static_cast<float>(u) -
                           dmin * static_cast<float>(blk[192 + 16 * sub + n]);
      }
    }
    return;
  }
  if (w.type == WeightType::kQ8_0 && w.panels) {
    const int64_t n = r % kernels::kPanelRows;
    const std::byte* panel = w.data + (r / kernels::kPanelRows) * (w.cols / kernels::kQ8Block * kernels::kQ8PanelBlockBytes);
    for (int64_t b = 0; b < w.cols / kernels::kQ8Block; ++b) {
      const std::byte* blk = panel + b * kernels::kQ8PanelBlockBytes;
      uint16_t h;
      std::memcpy(&h, blk + 2 * n, 2);
      const float scale = F16ToF32(h);
      for (int64_t e = 0; e < kernels::kQ8Block; ++e) {
        const auto q = static_cast<int8_t>(blk[2 * kernels::kPanelRows + (e / 2) * 2 * kernels::kPanelRows + 2 * n + e % 2]);
        out[b * kernels::kQ8Block + e] = scale * static_cast<float>(q);
      }
    }
    return;
  }
  if (IsBlockQuantized(w.type)) {  // row-major only
    DecodeWeights(w.type, w.data + r * WeightRowBytes(w.type, w.cols), w.cols, out);
    return;
  }
  // Element i of row r: adjacent to element i - 1 in a row-major matrix;
  // in panels, kPanelRows elements (one column of the panel) further on.
  const int64_t elem = w.type == WeightType::kF32 ? 4 : 2;
  const std::byte* p = w.panels ? w.data + ((r / kernels::kPanelRows) * w.cols * kernels::kPanelRows + r % kernels::kPanelRows) * elem
                                : w.data + r * WeightRowBytes(w.type, w.cols);
  const int64_t step = w.panels ? kernels::kPanelRows * elem : elem;
  uint16_t h;
  for (int64_t i = 0; i < w.cols; ++i) {
    switch (w.type) {
      case WeightType::kF32: std::memcpy(&out[i], p + step * i, 4); break;
      case WeightType::kF16: std::memcpy(&h, p + step * i, 2); out[i] = F16ToF32(h); break;
      case WeightType::kBF16: std::memcpy(&h, p + step * i, 2); out[i] = BF16ToF32(h); break;
      default: break;  // block formats: above
    }
  }
}

}  // namespace pagekv
