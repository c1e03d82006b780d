// Multi-head latent attention in the absorbed form (pagekv/attention.h):
// the query heads taken into latent space, the latent kernels of
// attention.cc (every query head against the one latent row per token),
// the output taken back out through W_UV.
//
// Work per query and head: qk_nope_dim * kv_lora_rank multiply-adds in,
// v_head_dim * kv_lora_rank out, against (kv_lora_rank + rope_dim) * 2 per
// cached token inside; both projections are split over the pool's threads
// by (query, head).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "pagekv/attention.h"

namespace pagekv {
namespace {

struct MlaShape {
  int32_t heads = 0, rank = 0, rope = 0, nope = 0, vdim = 0;
  int32_t latent() const { return rank + rope; }
};

Status CheckMla(const PagedKv& kv, const float* q, const MlaWeights& w, const float* out, MlaShape& s) {
  if (kv.layout == nullptr) return InvalidArgumentError("mla attention: null layout: pass the cache's layout()");
  const CacheConfig& c = kv.layout->config();
  if (c.kind != CacheKind::kMla) {
    return InvalidArgumentError("mla attention: the layout is not an MLA latent cache (CacheKind::kMla); per-head "
                                "caches use PagedDecodeAttention / PagedPrefillAttention");
  }
  if (q == nullptr || out == nullptr) return InvalidArgumentError("mla attention: null q or out");
  if (w.w_uk == nullptr || w.w_uv == nullptr) return InvalidArgumentError("mla attention: null w_uk or w_uv");
  if (w.qk_nope_dim <= 0 || w.v_head_dim <= 0) {
    return InvalidArgumentError("mla attention: qk_nope_dim " + std::to_string(w.qk_nope_dim) + " and v_head_dim " +
                                std::to_string(w.v_head_dim) + " must be positive");
  }
  s.heads = c.num_q_heads;
  s.rank = c.kv_lora_rank;
  s.rope = c.rope_dim;
  s.nope = w.qk_nope_dim;
  s.vdim = w.v_head_dim;
  return Status::Ok();
}

int Threads(const AttentionOptions& o) {
  return o.num_threads > 0 ? o.num_threads : ThreadPool::Shared().num_threads();
}

// q_lat[i][h] = [w_uk[h]^T q_nope[i][h], q_pe[i][h]] for n queries.
void Absorb(const MlaShape& s, const MlaWeights& w, const float* q, int64_t n, float* q_lat, int threads) {
  const int64_t in_stride = s.nope + s.rope;
  const int64_t jobs = n * s.heads;
  const bool inline_run = static_cast<double>(jobs) * s.nope * s.rank < double{1 << 18};
  ThreadPool::Shared().ParallelFor(jobs, inline_run ? 1 : threads, [&](int64_t job) {
    const int64_t h = job % s.heads;
    const float* qi = q + job * in_stride;
    float* dst = q_lat + job * s.latent();
    std::fill(dst, dst + s.rank, 0.0f);
    const float* wk = w.w_uk + h * static_cast<int64_t>(s.nope) * s.rank;
    for (int32_t a = 0; a < s.nope; ++a) {
      const float x = qi[a];
      const float* row = wk + static_cast<int64_t>(a) * s.rank;
      for (int32_t r = 0; r < s.rank; ++r) dst[r] += x * row[r];
    }
    std::copy(qi + s.nope, qi + s.nope + s.rope, dst + s.rank);
  });
}

// out[i][h][v] = w_uv[h][v] . out_lat[i][h][:rank].
void Expand(const MlaShape& s, const MlaWeights& w, const float* out_lat, int64_t n, float* out, int threads) {
  const int64_t jobs = n * s.heads;
  const bool inline_run = static_cast<double>(jobs) * s.vdim * s.rank < double{1 << 18};
  ThreadPool::Shared().ParallelFor(jobs, inline_run ? 1 : threads, [&](int64_t job) {
    const int64_t h = job % s.heads;
    const float* lat = out_lat + job * s.latent();
    float* dst = out + job * s.vdim;
    const float* wv = w.w_uv + h * static_cast<int64_t>(s.vdim) * s.rank;
    for (int32_t v = 0; v < s.vdim; ++v) {
      const float* row = wv + static_cast<int64_t>(v) * s.rank;
      float sum = 0;
      for (int32_t r = 0; r < s.rank; ++r) sum += row[r] * lat[r];
      dst[v] = sum;
    }
  });
}

AttentionOptions LatentOptions(const AttentionOptions& o, const MlaShape& s) {
  AttentionOptions latent = o;
  if (latent.scale == 0) latent.scale = 1.0f / std::sqrt(static_cast<float>(s.nope + s.rope));
  return latent;
}

}  // namespace

Status MlaDecodeAttention(const PagedKv& kv, std::span<const DecodeSeq> seqs, const float* q, const MlaWeights& w,
                          float* out, const AttentionOptions& options) {
  MlaShape s;
  PAGEKV_RETURN_IF_ERROR(CheckMla(kv, q, w, out, s));
  const auto n = static_cast<int64_t>(seqs.size());
  std::vector<float> q_lat(static_cast<size_t>(n * s.heads * s.latent()));
  std::vector<float> out_lat(q_lat.size());
  const int threads = Threads(options);
  Absorb(s, w, q, n, q_lat.data(), threads);
  PAGEKV_RETURN_IF_ERROR(PagedDecodeAttention(kv, seqs, q_lat.data(), out_lat.data(), LatentOptions(options, s)));
  Expand(s, w, out_lat.data(), n, out, threads);
  return Status::Ok();
}

Status MlaPrefillAttention(const PagedKv& kv, std::span<const PrefillSeq> seqs, const float* q, const MlaWeights& w,
                           float* out, const AttentionOptions& options) {
  MlaShape s;
  PAGEKV_RETURN_IF_ERROR(CheckMla(kv, q, w, out, s));
  int64_t n = 0;
  for (const PrefillSeq& sq : seqs) n += std::max<int64_t>(0, sq.num_queries);
  std::vector<float> q_lat(static_cast<size_t>(n * s.heads * s.latent()));
  std::vector<float> out_lat(q_lat.size());
  const int threads = Threads(options);
  Absorb(s, w, q, n, q_lat.data(), threads);
  PAGEKV_RETURN_IF_ERROR(PagedPrefillAttention(kv, seqs, q_lat.data(), out_lat.data(), LatentOptions(options, s)));
  Expand(s, w, out_lat.data(), n, out, threads);
  return Status::Ok();
}

}  // namespace pagekv
