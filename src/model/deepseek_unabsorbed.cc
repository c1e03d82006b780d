// DeepseekModel's unabsorbed prefill (deepseek_model.h): when a prompt
// chunk is long enough that materialising per-head keys and values once
// costs fewer multiply-adds than reading the latent rows at rank + rope per
// head and query, the sequence's stored latent rows are read back, every
// head's keys [W_UK c_kv, k_pe] and values W_UV c_kv go into a per-head
// f32 scratch cache, and the per-head paged kernel runs the chunk over it.
#include <algorithm>
#include <cstring>
#include <vector>

#include "base/thread_pool.h"
#include "layout/float16.h"
#include "layout/quantize.h"
#include "model/deepseek_model.h"
#include "model/model_internal.h"
#include "pagekv/attention.h"

namespace pagekv {

using model_internal::ForRows;
using model_internal::Scratch;

bool DeepseekModel::Unabsorbed(int64_t n, const ForwardOptions& options) const {
  switch (options.mla_prefill) {
    case ForwardOptions::MlaPrefill::kAbsorbed: return false;
    case ForwardOptions::MlaPrefill::kUnabsorbed: return true;
    case ForwardOptions::MlaPrefill::kAuto: break;
  }
  // Per cached token and head: absorbed, 2 (rank + rope) multiply-adds per
  // query; unabsorbed, rank (nope + v) once to materialise the key and value
  // plus 2 D per query (D = max(nope + rope, v): values padded to the key's
  // width for the per-head kernel).
  const ModelConfig& c = config_;
  const int64_t lat = c.kv_lora_rank + c.qk_rope_dim, D = std::max(c.head_dim, c.v_head_dim);
  if (lat <= D) return false;
  return n * 2 * (lat - D) > int64_t{c.kv_lora_rank} * (c.qk_nope_dim + c.v_head_dim);
}

namespace {

struct alignas(kSlabAlignment) ArenaLine {
  std::byte b[kSlabAlignment];
};

// A stored latent row of any plain or 8-bit format back to f32.
void DecodeLatentRow(const KvFormat& f, const std::byte* row, int32_t n, float* out) {
  switch (f.dtype) {
    case DType::kF32: std::memcpy(out, row, static_cast<size_t>(n) * 4); return;
    case DType::kF16:
    case DType::kBF16:
      for (int32_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, row + 2 * i, 2);
        out[i] = f.dtype == DType::kF16 ? F16ToF32(h) : BF16ToF32(h);
      }
      return;
    case DType::kInt8: quant::DecodeInt8Row(row, n, out); return;
    default: quant::DecodeFp8Row(row, n, f.dtype == DType::kFP8E4M3, out); return;
  }
}

}  // namespace

Status DeepseekModel::UnabsorbedAttention(const Layer& L, const PagedKv& kv, const KvSpan& view, const float* q,
                                          int64_t n, float* o, const ForwardOptions& options, const Backend& be) const {
  const ModelConfig& c = config_;
  const KvLayout& layout = *kv.layout;
  const int64_t N = view.num_tokens, H = c.num_heads, nope = c.qk_nope_dim, rope = c.qk_rope_dim;
  const int64_t rank = c.kv_lora_rank, vdim = c.v_head_dim, qk = c.head_dim, lat = rank + rope;
  const int32_t D = std::max(c.head_dim, c.v_head_dim);
  // Scratch slots past Compute's (20 of them).
  float* rows = Scratch<float>(40, static_cast<size_t>(N * lat)).data();
  float* c_kv = Scratch<float>(41, static_cast<size_t>(N * rank)).data();
  float* k_nope = Scratch<float>(42, static_cast<size_t>(H * N * nope)).data();
  float* v = Scratch<float>(43, static_cast<size_t>(H * N * vdim)).data();
  const KvFormat& format = layout.format(kv.layer);
  const int64_t bl = layout.block_len();
  ForRows(N, options.threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const BlockId b = view.blocks[static_cast<size_t>(t / bl)];
      DecodeLatentRow(format, kv.arena + layout.RowOffset(kv.layer, 0, 0, ToInt(b), static_cast<int32_t>(t % bl)),
                      static_cast<int32_t>(lat), rows + t * lat);
      std::memcpy(c_kv + t * rank, rows + t * lat, static_cast<size_t>(rank) * 4);
    }
  });
  {
    std::vector<Status> errors(static_cast<size_t>(2 * H));
    ThreadPool::Shared().ParallelFor(2 * H, options.threads, [&](int64_t job) {
      const auto h = static_cast<size_t>(job / 2);
      errors[static_cast<size_t>(job)] =
          job % 2 == 0 ? be.MatMul(L.wk_b_t[h], c_kv, N, k_nope + static_cast<int64_t>(h) * N * nope, 1, options.activations)
                       : be.MatMul(L.wv_b[h], c_kv, N, v + static_cast<int64_t>(h) * N * vdim, 1, options.activations);
    });
    for (const Status& s : errors) PAGEKV_RETURN_IF_ERROR(s);
  }
  // A per-head f32 scratch cache of N tokens: K = [k_nope, k_pe], V = v,
  // both padded with zeros to D.
  CacheConfig cc;
  cc.num_layers = 1;
  cc.num_q_heads = c.num_heads;
  cc.num_kv_heads = c.num_heads;
  cc.head_dim = D;
  cc.block_len = 128;
  cc.format = KvFormat::Plain(DType::kF32);
  cc.num_blocks = (N + cc.block_len - 1) / cc.block_len;
  PAGEKV_ASSIGN_OR_RETURN(const KvLayout per_head, KvLayout::Create(cc));
  std::byte* arena = reinterpret_cast<std::byte*>(
      Scratch<ArenaLine>(0, static_cast<size_t>((per_head.total_bytes() + kSlabAlignment - 1) / kSlabAlignment)).data());
  std::vector<BlockId> table(static_cast<size_t>(cc.num_blocks));
  for (int64_t b = 0; b < cc.num_blocks; ++b) table[static_cast<size_t>(b)] = BlockId{static_cast<int32_t>(b)};
  ForRows(N, options.threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto block = static_cast<int32_t>(t / cc.block_len);
      const auto slot = static_cast<int32_t>(t % cc.block_len);
      for (int64_t h = 0; h < H; ++h) {
        auto* k = reinterpret_cast<float*>(arena + per_head.RowOffset(0, 0, static_cast<int32_t>(h), block, slot));
        auto* vv = reinterpret_cast<float*>(arena + per_head.RowOffset(0, 1, static_cast<int32_t>(h), block, slot));
        std::memcpy(k, k_nope + (h * N + t) * nope, static_cast<size_t>(nope) * 4);
        std::memcpy(k + nope, rows + t * lat + rank, static_cast<size_t>(rope) * 4);
        std::fill(k + qk, k + D, 0.0f);
        std::memcpy(vv, v + (h * N + t) * vdim, static_cast<size_t>(vdim) * 4);
        std::fill(vv + vdim, vv + D, 0.0f);
      }
    }
  });
  const float* q_in = q;
  float* q_pad = nullptr;
  if (D != qk) {
    q_pad = Scratch<float>(44, static_cast<size_t>(n * H * D)).data();
    for (int64_t r = 0; r < n * H; ++r) {
      std::memcpy(q_pad + r * D, q + r * qk, static_cast<size_t>(qk) * 4);
      std::fill(q_pad + r * D + qk, q_pad + (r + 1) * D, 0.0f);
    }
    q_in = q_pad;
  }
  float* out = Scratch<float>(45, static_cast<size_t>(n * H * D)).data();
  AttentionOptions ao;
  ao.num_threads = options.threads;
  ao.scale = c.attn_scale;
  const PrefillSeq seq{table, N, n};
  PAGEKV_RETURN_IF_ERROR(be.PrefillAttention(PagedKv{&per_head, arena, 0}, {&seq, 1}, q_in, out, ao));
  for (int64_t r = 0; r < n * H; ++r) std::memcpy(o + r * vdim, out + r * D, static_cast<size_t>(vdim) * 4);
  return Status::Ok();
}

}  // namespace pagekv
