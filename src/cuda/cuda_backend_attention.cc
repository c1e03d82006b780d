// CudaBackend's attention calls (see cuda_backend.h): each sequence's block
// table checked as the CPU kernels check it and uploaded, then decode
// through the flash-decoding kernels, or anything else (prefill, chunked
// prefill, decode with windows, soft-capping, partial tables or
// log-sum-exps) through the prefill kernels.
#include "cuda/cuda_backend.h"

#include "cuda/cuda_backend_impl.h"

namespace pagekv {
namespace {

struct LayerView {
  cuda::KvType type;
  const std::byte* k = nullptr;
  const std::byte* v = nullptr;
  int64_t head_stride = 0, slab_stride = 0, row_bytes = 0;
};
Result<LayerView> View(const PagedKv& kv) {
  if (kv.layout == nullptr || kv.arena == nullptr) return InvalidArgumentError("attention: null layout or arena");
  const KvLayout& layout = *kv.layout;
  if (kv.layer < 0 || kv.layer >= layout.num_layers()) return OutOfRangeError("attention: layer out of range");
  if (layout.config().kind != CacheKind::kPerHead) {
    return UnimplementedError("MLA latent caches are not read on the CUDA backend yet: use the CPU backend");
  }
  PAGEKV_ASSIGN_OR_RETURN(const cuda::KvType type, RowType(layout.format(kv.layer), layout.row_elems()));
  LayerView v{type};
  v.k = kv.arena + layout.SlabOffset(kv.layer, 0, 0, 0);
  v.v = kv.arena + layout.SlabOffset(kv.layer, 1, 0, 0);
  v.head_stride = layout.head_stride(kv.layer, 0);
  v.slab_stride = layout.slab_stride(kv.layer, 0);
  v.row_bytes = layout.row_bytes(kv.layer);
  return v;
}

// One sequence's table as int32 (kNoBlock kept as -1 where `partial`
// allows it), checked as the CPU kernels check it.
Status Table(const KvLayout& layout, std::span<const BlockId> blocks, int64_t num_tokens, int64_t window,
              bool partial, int32_t max_blocks, int32_t* out) {
  const int64_t need = (num_tokens + layout.block_len() - 1) / layout.block_len();
  if (static_cast<int64_t>(blocks.size()) < need) {
    return InvalidArgumentError("attention: a block table shorter than its sequence");
  }
  // Blocks wholly before the window are never read: -1 there.
  const int64_t first = window > 0 ? std::max<int64_t>(0, num_tokens - window) / layout.block_len() : 0;
  for (int64_t b = 0; b < max_blocks; ++b) {
    int32_t id = -1;
    if (b < need && b >= first) {
      id = ToInt(blocks[static_cast<size_t>(b)]);
      if (id == ToInt(kNoBlock) && partial) {
        id = -1;
      } else if (id < 0 || id >= layout.num_blocks()) {
        return InvalidArgumentError("attention: a block id outside the pool");
      }
    }
    out[b] = id;
  }
  return Status::Ok();
}

// What the decode and prefill kernels' parameters share: the layer, the
// uploaded tables and lengths, q, out and the scale.
template <typename Params>
Params LayerParams(const LayerView& view, const KvLayout& layout, int32_t num, int64_t max_blocks,
                   const int32_t* tables, const int32_t* lens, const float* q, float* out, float scale) {
  const CacheConfig& cc = layout.config();
  Params p;
  p.type = view.type;
  p.num_seqs = num;
  p.q_heads = cc.num_q_heads;
  p.kv_heads = cc.num_kv_heads;
  p.head_dim = cc.head_dim;
  p.block_len = layout.block_len();
  p.k_plane = view.k;
  p.v_plane = view.v;
  p.head_stride = view.head_stride;
  p.slab_stride = view.slab_stride;
  p.row_bytes = view.row_bytes;
  p.block_tables = tables;
  p.max_blocks = static_cast<int32_t>(max_blocks);
  p.context_lens = lens;
  p.q = q;
  p.out = out;
  p.scale = scale;
  return p;
}

// The prefill kernels' parameters every call fills alike.
cuda::PrefillParams PrefillFor(const LayerView& view, const KvLayout& layout, int32_t num, int64_t max_blocks,
                               const int32_t* tables, const int32_t* lens, const float* q, float* out,
                               const AttentionOptions& options) {
  auto p = LayerParams<cuda::PrefillParams>(view, layout, num, max_blocks, tables, lens, q, out, options.scale);
  p.lse = options.lse;
  p.softcap = options.softcap;
  return p;
}

using K = StepGraphs;

// The launches, through Impl::Enqueue: the key is every parameter
// (step_graphs.h). (Impl is CudaBackend's private type, deduced here.)
template <typename Impl>
cudaError_t EnqueueDecode(const Impl& impl, const cuda::DecodeParams& p, int32_t splits) {
  return impl.Enqueue(
      {0x64656364 /* "decd" */, K::Key(p.type), K::Key(p.num_seqs), K::Key(p.q_heads), K::Key(p.kv_heads),
       K::Key(p.head_dim), K::Key(p.block_len), K::Key(p.k_plane), K::Key(p.v_plane), K::Key(p.head_stride),
       K::Key(p.slab_stride), K::Key(p.row_bytes), K::Key(p.block_tables), K::Key(p.max_blocks), K::Key(p.context_lens),
       K::Key(p.q), K::Key(p.out), K::Key(p.scale), K::Key(p.blocks_per_split), K::Key(p.scratch),
       K::Key(p.use_chunk_kernel), K::Key(p.tensor_cores), K::Key(splits)},
      [p, splits](cudaStream_t s) { return cuda::PagedDecodeAttention(p, splits, s); });
}

template <typename Impl>
cudaError_t EnqueuePrefill(const Impl& impl, const cuda::PrefillParams& p) {
  return impl.Enqueue(
      {0x70726566 /* "pref" */, K::Key(p.type), K::Key(p.num_seqs), K::Key(p.q_heads), K::Key(p.kv_heads),
       K::Key(p.head_dim), K::Key(p.block_len), K::Key(p.k_plane), K::Key(p.v_plane), K::Key(p.head_stride),
       K::Key(p.slab_stride), K::Key(p.row_bytes), K::Key(p.block_tables), K::Key(p.max_blocks), K::Key(p.context_lens),
       K::Key(p.query_lens), K::Key(p.query_starts), K::Key(p.windows), K::Key(p.max_query_len), K::Key(p.q),
       K::Key(p.out), K::Key(p.lse), K::Key(p.scale), K::Key(p.softcap), K::Key(p.tensor_cores)},
      [p](cudaStream_t s) { return cuda::PagedPrefillAttention(p, s); });
}

}  // namespace

Status CudaBackend::DecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, float* out,
                                    const AttentionOptions& options) const {
  impl_->Enter();
  PAGEKV_ASSIGN_OR_RETURN(const LayerView view, View(kv));
  if (q == nullptr || out == nullptr) return InvalidArgumentError("attention: null q or out");
  if (seqs.empty()) return Status::Ok();
  const KvLayout& layout = *kv.layout;
  const CacheConfig& cc = layout.config();
  const auto num = static_cast<int32_t>(seqs.size());
  int64_t max_blocks = 1, longest = 0;
  bool windowed = false;
  for (const DecodeSeq& s : seqs) {
    if (s.num_tokens < 1) return InvalidArgumentError("attention: a sequence with no tokens");
    if (s.window < 0) return InvalidArgumentError("attention: a negative window");
    if (s.scores != nullptr) {
      return UnimplementedError("attention weights for token eviction are not computed on the CUDA backend: use the CPU backend for --evict");
    }
    windowed |= s.window > 0;
    max_blocks = std::max(max_blocks, (s.num_tokens + layout.block_len() - 1) / layout.block_len());
    longest = std::max(longest, s.num_tokens);
  }
  if (max_blocks > INT32_MAX / std::max(num, 1) || longest > INT32_MAX) return InvalidArgumentError("attention: too long");
  auto lock = impl_->Lock();
  if (impl_->Recording()) {
    // A recorded step's tables padded (-1) to whole multiples of 256
    // tokens, so that the launches, and so the step's graph, stay the same
    // while the longest sequence grows through them (the split count
    // changes every 256 tokens anyway).
    const int64_t bucket = std::max<int64_t>(1, 256 / layout.block_len());
    const int64_t padded = (max_blocks + bucket - 1) / bucket * bucket;
    if (padded <= INT32_MAX / std::max(num, 1)) max_blocks = padded;
  }
  const bool fast = !windowed && options.softcap == 0 && options.lse == nullptr && !options.partial &&
                    cc.head_dim % 8 == 0 && cc.head_dim <= 256 && cc.num_q_heads / cc.num_kv_heads <= 16;
  // One array for the device: [lengths | tables], then for the prefill
  // kernel [query lengths (1) | query rows | windows].
  const size_t n = static_cast<size_t>(num), table_ints = n * static_cast<size_t>(max_blocks);
  std::vector<int32_t> ints(n + table_ints + (fast ? 0 : 3 * n));
  for (int32_t i = 0; i < num; ++i) {
    const DecodeSeq& s = seqs[static_cast<size_t>(i)];
    PAGEKV_RETURN_IF_ERROR(Table(layout, s.blocks, s.num_tokens, s.window, options.partial,
                                       static_cast<int32_t>(max_blocks), &ints[n + static_cast<size_t>(i) * max_blocks]));
    ints[static_cast<size_t>(i)] = static_cast<int32_t>(s.num_tokens);
    if (!fast) {
      ints[n + table_ints + static_cast<size_t>(i)] = 1;
      ints[2 * n + table_ints + static_cast<size_t>(i)] = i;
      ints[3 * n + table_ints + static_cast<size_t>(i)] = static_cast<int32_t>(std::min<int64_t>(s.window, INT32_MAX));
    }
  }
  const int32_t* d_ints = impl_->DeviceInts(ints);  // `lock` held until its readers are enqueued
  if (d_ints == nullptr) return impl_->Recorded();
  const int32_t* d_lens = d_ints;
  const int32_t* d_tables = d_ints + n;
  if (fast) {
    auto p = LayerParams<cuda::DecodeParams>(view, layout, num, max_blocks, d_tables, d_lens, q, out, options.scale);
    p.tensor_cores = impl_->tensor_core_decode;  // where TensorCoreDecodeShape allows; the CUDA cores otherwise
    if (options.split_tokens > 0) {
      p.blocks_per_split = static_cast<int32_t>((options.split_tokens + layout.block_len() - 1) / layout.block_len());
    }
    int32_t splits = cuda::Splits(p, static_cast<int32_t>(longest), impl_->multiprocessors);
    if (splits > 1 && p.blocks_per_split == 0) p.blocks_per_split = static_cast<int32_t>((max_blocks + splits - 1) / splits);
    if (p.blocks_per_split > 0) splits = static_cast<int32_t>((max_blocks + p.blocks_per_split - 1) / p.blocks_per_split);
    std::optional<Temp> temp;
    cudaError_t e = cudaSuccess;
    p.scratch = impl_->LaneMemory(0, splits > 1 ? cuda::ScratchBytes(p, splits) : 0, temp, &e);
    PAGEKV_RETURN_IF_ERROR(impl_->Check(e, "decode scratch"));
    if (splits <= 1) p.blocks_per_split = 0;
    return impl_->Check(EnqueueDecode(*impl_, p, std::max(splits, 1)), "decode attention");
  }
  // Windows, soft-capping, partial tables, log-sum-exps: one query each
  // through the prefill kernel.
  cuda::PrefillParams p = PrefillFor(view, layout, num, max_blocks, d_tables, d_lens, q, out, options);
  p.query_lens = d_ints + n + table_ints;
  p.query_starts = d_ints + 2 * n + table_ints;
  p.windows = d_ints + 3 * n + table_ints;
  p.max_query_len = 1;
  return impl_->Check(EnqueuePrefill(*impl_, p), "decode attention (general kernel)");
}

Status CudaBackend::PrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, float* out,
                                     const AttentionOptions& options) const {
  impl_->Enter();
  PAGEKV_ASSIGN_OR_RETURN(const LayerView view, View(kv));
  if (q == nullptr || out == nullptr) return InvalidArgumentError("attention: null q or out");
  if (seqs.empty()) return Status::Ok();
  const KvLayout& layout = *kv.layout;
  const CacheConfig& cc = layout.config();
  const auto num = static_cast<int32_t>(seqs.size());
  int64_t max_blocks = 1, rows = 0, longest_query = 0;
  for (const PrefillSeq& s : seqs) {
    if (s.num_queries < 1 || s.num_queries > s.num_tokens) {
      return InvalidArgumentError("attention: num_queries must be in [1, num_tokens]");
    }
    if (s.score_queries < 0 || s.score_queries > s.num_queries) {
      return InvalidArgumentError("attention: score_queries must be in [0, num_queries]");
    }
    if (s.window < 0) return InvalidArgumentError("attention: a negative window");
    if (s.scores != nullptr) {
      return UnimplementedError("attention weights for token eviction are not computed on the CUDA backend: use the CPU backend for --evict");
    }
    max_blocks = std::max(max_blocks, (s.num_tokens + layout.block_len() - 1) / layout.block_len());
    rows += s.num_queries;
    longest_query = std::max(longest_query, s.num_queries);
    if (s.num_tokens > INT32_MAX || rows > INT32_MAX) return InvalidArgumentError("attention: too long");
  }
  if (max_blocks > INT32_MAX / num) return InvalidArgumentError("attention: too long");
  // One array for the device: [lengths | tables | query lengths | query rows | windows].
  const size_t n = static_cast<size_t>(num), table_ints = n * static_cast<size_t>(max_blocks);
  std::vector<int32_t> ints(n + table_ints + 3 * n);
  int64_t row = 0;
  for (int32_t i = 0; i < num; ++i) {
    const PrefillSeq& s = seqs[static_cast<size_t>(i)];
    // The first query's window decides which blocks are read at all.
    const int64_t first_window = s.window > 0 ? s.window + s.num_queries - 1 : 0;
    PAGEKV_RETURN_IF_ERROR(Table(layout, s.blocks, s.num_tokens, first_window, options.partial,
                                       static_cast<int32_t>(max_blocks), &ints[n + static_cast<size_t>(i) * max_blocks]));
    ints[static_cast<size_t>(i)] = static_cast<int32_t>(s.num_tokens);
    ints[n + table_ints + static_cast<size_t>(i)] = static_cast<int32_t>(s.num_queries);
    ints[2 * n + table_ints + static_cast<size_t>(i)] = static_cast<int32_t>(row);
    ints[3 * n + table_ints + static_cast<size_t>(i)] = static_cast<int32_t>(std::min<int64_t>(s.window, INT32_MAX));
    row += s.num_queries;
  }
  auto lock = impl_->Lock();
  const int32_t* d_ints = impl_->DeviceInts(ints);  // `lock` held until its readers are enqueued
  if (d_ints == nullptr) return impl_->Recorded();
  cuda::PrefillParams p = PrefillFor(view, layout, num, max_blocks, d_ints + n, d_ints, q, out, options);
  p.query_lens = d_ints + n + table_ints;
  p.query_starts = d_ints + 2 * n + table_ints;
  p.windows = d_ints + 3 * n + table_ints;
  p.max_query_len = static_cast<int32_t>(longest_query);
  // Enough rows for the tensor cores' 64-row tiles to pay.
  p.tensor_cores = impl_->tensor_core_prefill && cuda::TensorCorePrefillShape(p) &&
                   longest_query * (cc.num_q_heads / cc.num_kv_heads) >= 16;
  return impl_->Check(EnqueuePrefill(*impl_, p), "prefill attention");
}

}  // namespace pagekv
