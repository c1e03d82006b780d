// Test-only: a paged arena filled by hand for the attention kernels' tests
// (attention_test.cc, partial_attention_test.cc): random K and V in every
// storage format, kept in double (as stored) for the reference, each
// sequence's blocks a random subset of the pool in random order, and one
// NaN-poisoned block nobody uses.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "layout/float16.h"
#include "layout/quantize.h"
#include "pagekv/attention.h"
#include "pagekv/kv_layout.h"

namespace pagekv::testing {

inline double Tolerance(DType d) { return d == DType::kF32 ? 1e-5 : DTypeBits(d) == 8 ? 1e-4 : 2e-3; }

// A paged arena filled by hand: each sequence's blocks are a random subset of
// the pool in random order; K and V values are kept (as stored) in double for
// the reference.
class PagedFixture {
 public:
  // layer_dtypes (optional): a format per layer instead of dtype everywhere.
  PagedFixture(int32_t layers, int32_t q_heads, int32_t kv_heads, int32_t head_dim, int32_t block_len, DType dtype,
               std::vector<int64_t> lengths, uint32_t seed, std::vector<DType> layer_dtypes = {}, bool hadamard = false)
      : rng_(seed), lengths_(std::move(lengths)) {
    CacheConfig c;
    c.num_layers = layers;
    c.num_q_heads = q_heads;
    c.num_kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.block_len = block_len;
    c.format = KvFormat::ForDType(dtype, head_dim);
    for (DType d : layer_dtypes) c.layer_formats.push_back(KvFormat::ForDType(d, head_dim));
    if (hadamard) c.format = c.format.WithHadamard();
    auto dtype_of = [&](int32_t l) { return layer_dtypes.empty() ? dtype : layer_dtypes[static_cast<size_t>(l)]; };
    int64_t blocks = 0;
    for (int64_t n : lengths_) blocks += (n + block_len - 1) / block_len;
    c.num_blocks = blocks + 3;  // a few blocks nobody uses
    layout_ = std::make_unique<KvLayout>(*KvLayout::Create(c));
    arena_.resize(static_cast<size_t>(layout_->total_bytes() / 64 + 1));
    std::vector<int32_t> ids(static_cast<size_t>(c.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng_);
    size_t next = 0;
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t n : lengths_) {
      std::vector<BlockId> table;
      for (int64_t b = 0; b < (n + block_len - 1) / block_len; ++b) table.push_back(BlockId{ids[next++]});
      // Values per layer: [token][kv_head][head_dim] for K and V.
      std::vector<std::vector<double>> k(static_cast<size_t>(layers)), v(static_cast<size_t>(layers));
      for (int32_t l = 0; l < layers; ++l) {
        const DType ld = dtype_of(l);
        for (int64_t t = 0; t < n; ++t) {
          for (int32_t h = 0; h < kv_heads; ++h) {
            for (int32_t plane = 0; plane < 2; ++plane) {
              std::byte* row = arena() + layout_->RowOffset(l, plane, h, ToInt(table[static_cast<size_t>(t / block_len)]),
                                                            static_cast<int32_t>(t % block_len));
              auto& dst = plane == 0 ? k[static_cast<size_t>(l)] : v[static_cast<size_t>(l)];
              if (!c.FormatOf(l).IsPlainFloat()) {
                std::vector<float> x(static_cast<size_t>(head_dim)), back(x.size());
                for (float& e : x) e = static_cast<float>(u(rng_));
                if (hadamard) quant::HadamardInPlace(x.data(), head_dim);  // stored as H x
                if (ld == DType::kInt8) {
                  quant::EncodeInt8Row(x.data(), head_dim, row);
                  quant::DecodeInt8Row(row, head_dim, back.data());
                } else {
                  quant::EncodeFp8Row(x.data(), head_dim, ld == DType::kFP8E4M3, row);
                  quant::DecodeFp8Row(row, head_dim, ld == DType::kFP8E4M3, back.data());
                }
                if (hadamard) quant::HadamardInPlace(back.data(), head_dim);  // what the kernel must see: H^T of the stored row
                dst.insert(dst.end(), back.begin(), back.end());
                continue;
              }
              for (int32_t x = 0; x < head_dim; ++x) dst.push_back(Store(ld, row, x, u(rng_)));
            }
          }
        }
      }
      // Reorder K and V from [token][head][plane interleaved] pushes to [token][head][dim].
      tables_.push_back(std::move(table));
      k_.push_back(std::move(k));
      v_.push_back(std::move(v));
    }
    spare_ = BlockId{ids[next]};
    // The spare block is all ones: NaN in every float format and in the
    // int8 / fp8 rows' scales, so a kernel that reads it gives NaN.
    for (int32_t l = 0; l < layers; ++l) {
      for (int32_t plane = 0; plane < 2; ++plane) {
        for (int32_t h = 0; h < kv_heads; ++h) {
          for (int32_t t = 0; t < block_len; ++t) {
            std::memset(arena() + layout_->RowOffset(l, plane, h, ToInt(spare_), t), 0xFF,
                        static_cast<size_t>(layout_->row_bytes(l)));
          }
        }
      }
    }
  }

  // A block of the pool no sequence uses, holding NaN everywhere.
  BlockId PoisonBlock() const { return spare_; }

  std::byte* arena() { return reinterpret_cast<std::byte*>(arena_.data()); }
  const KvLayout& layout() const { return *layout_; }
  PagedKv Kv(int32_t layer) { return {layout_.get(), arena(), layer}; }
  std::span<const BlockId> Table(size_t i) const { return tables_[i]; }
  const std::vector<double>& K(size_t seq, int32_t layer) const { return k_[seq][static_cast<size_t>(layer)]; }
  const std::vector<double>& V(size_t seq, int32_t layer) const { return v_[seq][static_cast<size_t>(layer)]; }
  std::mt19937& rng() { return rng_; }

 private:
  // Writes x rounded to dtype; returns the stored value.
  static double Store(DType d, std::byte* row, int32_t i, double x) {
    switch (d) {
      case DType::kF32: {
        const auto f = static_cast<float>(x);
        std::memcpy(row + 4 * i, &f, 4);
        return f;
      }
      case DType::kF16: {
        const uint16_t h = F32ToF16(static_cast<float>(x));
        std::memcpy(row + 2 * i, &h, 2);
        return F16ToF32(h);
      }
      default: {
        const uint16_t h = F32ToBF16(static_cast<float>(x));
        std::memcpy(row + 2 * i, &h, 2);
        return BF16ToF32(h);
      }
    }
  }

  struct alignas(64) Line { std::byte b[64]; };
  std::mt19937 rng_;
  std::vector<int64_t> lengths_;
  std::unique_ptr<KvLayout> layout_;
  std::vector<Line> arena_;
  std::vector<std::vector<BlockId>> tables_;
  std::vector<std::vector<std::vector<double>>> k_, v_;  // [seq][layer][token][head][dim]
  BlockId spare_{0};
};

inline std::vector<float> RandomQ(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);  // larger than K: peaky softmax
  std::vector<float> q(n);
  for (auto& x : q) x = u(rng);
  return q;
}

}  // namespace pagekv::testing
