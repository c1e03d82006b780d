// Paged attention through Intel AMX tiles (AMX-BF16), for bf16 K/V and tasks
// of at least eight query rows per KV head (GQA decode with G >= 8, prefill),
// and for f16 K/V from sixteen rows (each row split into bf16 hi + lo tiles
// as it is read: Run<true>).
//
// Why: at G = 8 the vector kernel spends its time on per-token work, not on
// memory: each score is a dot product reduced across lanes, and each V row is
// multiplied by G broadcast probabilities. A tile instruction does a
// 16 x 16 x 32 product in one go (about 16 cycles).
//
// The products, per chunk of keys (a block, or several blocks of 16) and each
// group of up to 16 query rows:
//   scores^T (tokens x rows) = K (tokens x dims) . Q^T          K is the A tile,
//       read in place from the block (16 rows, row_bytes apart); Q^T is the B
//       tile, built once per task (the dword transpose of 16 rows: pairs of
//       dimensions). Scores come out token-major: one vector per token, one
//       lane per query row, so the softmax's max and sum over tokens are
//       vertical (no reduction across lanes).
//   acc (rows x dims) += P (rows x tokens) . V                 P is the A tile,
//       transposed from the token-major probabilities 16 x 16 at a time in
//       registers; V is the B tile: pairs of tokens interleaved per dimension
//       (VNNI), built per 32-token step in a small buffer. The accumulator
//       tiles are loaded from and stored to a padded copy of acc, so they
//       carry across chunks.
//
// Accuracy: K and V are used as stored. q and p are split as hi + lo, two
// bf16 each (x - hi - lo < 2^-16 |x|); bf16 products are exact in f32 and
// summed in f32, as in kernels/bf16_dot-inl.h. The tests run every shape with
// this path on and off.
//
// Measured and not kept (docs/PERFORMANCE.md): the same tiles for int8 K/V
// (q as an exact 16-bit integer in a signed and an unsigned byte through
// TDPBSSD / TDPBSUD, V widened to bf16) ran at 0.20-0.29 of the roofline
// against the vector kernel's 0.26-0.53; G = 4 ran no faster than the vector
// kernel's AVX-512 BF16 dot products.
//
// The tile state needs the kernel's permission (arch_prctl
// ARCH_REQ_XCOMP_PERM); each call configures the tiles and releases them at
// its end, so a thread holds no tile state between calls.
// GCC 12 warns inside its own AVX-512 headers (the `_mm512_undefined_*`
// placeholder operands of masked intrinsics; -Wuninitialized at -O1, as in
// the TSan build); the warning is about the
// headers, not this file, and the same code compiles cleanly in clang.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "kernels/amx_attention.h"
#include "kernels/amx_support.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define PAGEKV_HAVE_AMX_KERNEL 1
#include <immintrin.h>
#endif

namespace pagekv::kernels {

#ifdef PAGEKV_HAVE_AMX_KERNEL
namespace {

std::atomic<bool> amx_allowed{true};

// Fewest rows per task the tiles take: G = 4 measured no faster than the
// vector kernel (0.40-0.46 of the roofline against 0.48-0.49).
constexpr int32_t kMinRows = 8;
// f16 K/V: each token's rows are split into bf16 hi + lo first (~45 ns per
// token and KV head at d = 128, one thread), which the tiles win back only
// from 16 rows: at G = 8 the vector kernel took 44-48 ns per token against
// the tiles' 86-88, at G = 16 104 against 91 (BM_DecodeHot, Intel Xeon).
constexpr int32_t kMinRowsF16 = 16;

// All eight tile registers are 16 rows of 64 bytes. Scores: tmm0 and tmm2
// accumulators (two token tiles), tmm4-5 K, tmm6-7 Q^T hi / lo. P.V: tmm0-1
// accumulators (two dimension tiles), tmm4-5 V, tmm6-7 P hi / lo.


struct Buffers {
  std::vector<uint16_t> q_tiles;   // [group][dim chunk][hi, lo][16 pairs][32] bf16
  std::vector<float> acc;          // [padded rows][d]
  std::vector<float> m, l;         // [padded rows]
  std::vector<float> st;           // [update's tokens rounded up to 32][16] token-major scores / probabilities
  std::vector<uint16_t> p_tiles;   // [group][hi, lo][16 rows][update's tokens rounded up to 32] bf16
  std::vector<uint16_t> v_tile;    // [hi, lo (f16 only)][d / 16][16 token pairs][32] bf16: one step
  std::vector<uint16_t> k_tiles;   // f16 K: [token tile][hi, lo][16 rows][d] bf16, one update's
};

Buffers& ThreadBuffers() {
  thread_local Buffers b;
  return b;
}

// Everything from here to the matching pop is compiled for AVX-512 and AMX
// (called only after the CPU check): GCC's target pragma, clang's attribute
// on every function in the region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")
#endif

// exp(x) for x <= 0 (and -inf -> 0): x = k ln2 + r, |r| <= ln2 / 2, a degree-7
// polynomial for e^r (relative error under 2e-7), then 2^k by vscalefps.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// bf16 of x rounded to nearest even (x finite), and x minus it.
inline __m256i Bf16Hi(__m512 x, __m512* rest) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  *rest = _mm512_sub_ps(x, back);
  return h;
}

// out[c * out_stride + r] = in[r * in_stride + c] for a 16 x 16 tile of f32.
inline void Transpose16(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * in_stride);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // Per group of four input rows, u[4 * grp + k]'s 128-bit lane L holds
  // column 4L + k of those rows.
  for (int grp = 0; grp < 4; ++grp) {
    const __m512 t0 = t[4 * grp], t1 = t[4 * grp + 1], t2 = t[4 * grp + 2], t3 = t[4 * grp + 3];
    r[4 * grp + 0] = _mm512_shuffle_ps(t0, t2, 0x44);
    r[4 * grp + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);
    r[4 * grp + 2] = _mm512_shuffle_ps(t1, t3, 0x44);
    r[4 * grp + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 v = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), w = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88), w2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    _mm512_storeu_ps(out + (0 + k) * out_stride, _mm512_shuffle_f32x4(v, v2, 0x88));
    _mm512_storeu_ps(out + (8 + k) * out_stride, _mm512_shuffle_f32x4(v, v2, 0xDD));
    _mm512_storeu_ps(out + (4 + k) * out_stride, _mm512_shuffle_f32x4(w, w2, 0x88));
    _mm512_storeu_ps(out + (12 + k) * out_stride, _mm512_shuffle_f32x4(w, w2, 0xDD));
  }
}

// Q^T as B tiles, for each group of 16 rows and each chunk of dimensions
// (32 bf16, 64 bytes): tile row p holds dword p (a pair of dimensions) of every query row n at dword n, i.e. the dword transpose of
// the rows' 64 bytes. Rows past `rows` are zero.
inline void TileFromRows(const void* rows16x64, void* tile) {
  Transpose16(static_cast<const float*>(rows16x64), 16, static_cast<float*>(tile), 16);
}

// bf16: q = hi + lo; tiles [group][chunk][hi, lo][512].
void BuildQBf16(const float* q, int32_t rows, int32_t groups, int32_t d, uint16_t* tiles) {
  const int32_t chunks = d / 32;
  for (int32_t grp = 0; grp < groups; ++grp) {
    for (int32_t c = 0; c < chunks; ++c) {
      alignas(64) uint16_t hi[16][32], lo[16][32];
      for (int32_t n = 0; n < 16; ++n) {
        const int32_t r = grp * 16 + n;
        if (r >= rows) {
          _mm512_store_si512(hi[n], _mm512_setzero_si512());
          _mm512_store_si512(lo[n], _mm512_setzero_si512());
          continue;
        }
        __m512 lo0, lo1;
        const __m256i h0 = Bf16Hi(_mm512_loadu_ps(q + int64_t{r} * d + c * 32), &lo0);
        const __m256i h1 = Bf16Hi(_mm512_loadu_ps(q + int64_t{r} * d + c * 32 + 16), &lo1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(hi[n]), h0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(hi[n] + 16), h1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(lo[n]), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo0)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(lo[n] + 16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo1)));
      }
      uint16_t* th = tiles + (static_cast<int64_t>(grp) * chunks + c) * 2 * 512;
      TileFromRows(hi, th);
      TileFromRows(lo, th + 512);
    }
  }
}

// 32 f16 values as bf16 hi and lo, hi + lo == x exactly: hi keeps the top 8
// of f16's 11 significant bits (the f32 value truncated to bf16), lo the
// remaining 3 (exact in bf16, whose exponent range is f32's).
inline void SplitF16(__m512i halves, __m512i* hi, __m512i* lo) {
  const __m512i keep = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 x0 = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
  const __m512 x1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
  const __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x0), keep));
  const __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x1), keep));
  *hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(h1, h0));
  *lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0)));
}

// f16 K as A tiles: `tiles` token tiles of 16 rows from `at(tile)`, each as
// bf16 hi and lo copies [tile][hi, lo][16][d] (row stride 2d bytes). Rows
// are converted whatever they hold: scores past a row's limit are masked.
template <typename At>
void BuildKF16(const At& at, int64_t row_bytes, int32_t tiles, int32_t d, uint16_t* out) {
  for (int32_t i = 0; i < tiles; ++i) {
    const std::byte* rows = at(i);
    uint16_t* hi = out + static_cast<int64_t>(i) * 2 * 16 * d;
    uint16_t* lo = hi + 16 * d;
    for (int32_t t = 0; t < 16; ++t) {
      for (int32_t j = 0; j < d; j += 32) {
        __m512i h, l;
        SplitF16(_mm512_loadu_si512(rows + t * row_bytes + j * 2), &h, &l);
        _mm512_storeu_si512(hi + t * d + j, h);
        _mm512_storeu_si512(lo + t * d + j, l);
      }
    }
  }
}

// One step of 32 tokens of V as B tiles: tile j covers dimensions 16j ..
// 16j + 15, row i = tokens (2i, 2i + 1) interleaved per dimension. The
// step's two halves of 16 tokens may come from two blocks (rows[0], rows[1]);
// tokens at or past n are zero (whatever the block holds there). f16 V: the
// hi tiles, then (at tiles + d * 16) the lo ones.
template <bool kF16>
void BuildV(const std::byte* const rows[2], int64_t row_bytes, int32_t n, int32_t d, uint16_t* tiles) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                          36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                          53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  auto load32 = [&](int32_t t, int32_t j) -> __m512i {
    if (t >= n) return _mm512_setzero_si512();
    const std::byte* row = rows[t / 16] + (t % 16) * row_bytes;
    return _mm512_loadu_si512(row + j * 2);
  };
  auto store_pair = [&](uint16_t* set, int32_t i, int32_t j, __m512i a, __m512i b) {
    _mm512_storeu_si512(set + (static_cast<int64_t>(j / 16) * 16 + i) * 32, _mm512_permutex2var_epi16(a, lo_idx, b));
    _mm512_storeu_si512(set + (static_cast<int64_t>(j / 16 + 1) * 16 + i) * 32, _mm512_permutex2var_epi16(a, hi_idx, b));
  };
  const int64_t set_elems = int64_t{d} * 32;  // one set: d / 16 tiles of 16 x 32
  const int32_t pairs = std::min(16, (n + 1) / 2);
  for (int32_t i = 0; i < pairs; ++i) {
    for (int32_t j = 0; j < d; j += 32) {
      const __m512i a = load32(2 * i, j), b = load32(2 * i + 1, j);
      if constexpr (kF16) {
        __m512i ah, al, bh, bl;
        SplitF16(a, &ah, &al);
        SplitF16(b, &bh, &bl);
        store_pair(tiles, i, j, ah, bh);
        store_pair(tiles + set_elems, i, j, al, bl);
      } else {
        store_pair(tiles, i, j, a, b);
      }
    }
  }
  for (int32_t set = 0; set < (kF16 ? 2 : 1); ++set) {
    for (int32_t i = pairs; i < 16; ++i) {
      for (int32_t j = 0; j < d / 16; ++j) {
        _mm512_storeu_si512(tiles + set * set_elems + (static_cast<int64_t>(j) * 16 + i) * 32, _mm512_setzero_si512());
      }
    }
  }
}

// Software prefetches of a list of byte ranges into L2, spread evenly over
// `points` calls of Step().
class LinePrefetcher {
 public:
  void Reset(int32_t points) {
    points_ = std::max(points, 1);
    count_ = 0;
    seg_ = 0;
    off_ = 0;
    lines_ = 0;
    per_step_ = 0;
  }
  void Add(const std::byte* p, int64_t bytes) {
    if (count_ < kMaxSegments) {
      segs_[count_++] = {p, bytes};
      lines_ += (bytes + 63) / 64;
    }
  }
  void Plan() { per_step_ = (lines_ + points_ - 1) / points_; }
  void Step() {
    for (int64_t k = 0; k < per_step_ && seg_ < count_; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(segs_[seg_].p + off_), _MM_HINT_T1);
      off_ += 64;
      if (off_ >= segs_[seg_].bytes) {
        ++seg_;
        off_ = 0;
      }
    }
  }

 private:
  static constexpr int32_t kMaxSegments = 2 * kMaxBlockLen / 16 + 2;
  struct Segment {
    const std::byte* p;
    int64_t bytes;
  };
  Segment segs_[kMaxSegments];
  int32_t count_ = 0, seg_ = 0, points_ = 1;
  int64_t off_ = 0, lines_ = 0, per_step_ = 0;
};

// Tokens per softmax update at least (several blocks of 16): measured
// 0.39 -> 0.41 of the roofline at block_len 16 against one 32-token step.
constexpr int32_t kMinChunk = 64;

// kF16: K and V stored as f16, each split into bf16 hi + lo (exact) as
// they are read: the scores take qhi.Khi + qlo.Khi + qhi.Klo, P.V
// phi.Vhi + plo.Vhi + phi.Vlo (the dropped lo.lo products are under 2^-16
// of |q||K| and |p||V|).
template <bool kF16>
void Run(const RowTask& task) {
  const int32_t d = task.head_dim, rows = task.rows, bl = task.block_len;
  const int32_t groups = (rows + 15) / 16, padded = groups * 16;
  const int64_t row_bytes = task.row_bytes;
  // Tokens per softmax update: a block, or as many whole blocks as make
  // kMinChunk, so that P.V steps (32 tokens, a whole bf16 tile) are full.
  // Weights and per-block maxima then refer to that update's maximum, for
  // all its blocks alike.
  const int32_t chunk = bl >= kMinChunk ? bl : kMinChunk / bl * bl;
  Buffers& b = ThreadBuffers();
  const int32_t dchunks = d / 32;
  b.q_tiles.resize(static_cast<size_t>(groups) * dchunks * 2 * 512);
  BuildQBf16(task.q, rows, groups, d, b.q_tiles.data());
  b.acc.assign(static_cast<size_t>(padded) * d, 0.0f);
  std::memcpy(b.acc.data(), task.acc, sizeof(float) * static_cast<size_t>(rows) * d);
  b.m.assign(padded, -std::numeric_limits<float>::infinity());
  b.l.assign(padded, 0.0f);
  std::copy(task.m, task.m + rows, b.m.begin());
  std::copy(task.l, task.l + rows, b.l.begin());
  const int32_t span_max = (chunk + 31) / 32 * 32;
  b.st.resize(static_cast<size_t>(span_max) * 16);
  b.p_tiles.resize(static_cast<size_t>(groups) * 2 * 16 * span_max);
  b.v_tile.resize(static_cast<size_t>(kF16 ? 2 : 1) * (d / 16) * 16 * 32);
  if (kF16) b.k_tiles.resize(static_cast<size_t>((chunk + 15) / 16) * 2 * 16 * d);
  const int64_t v_set = int64_t{d} * 32;  // elements of one set of V tiles (d / 16 of 16 x 32)
  int32_t limit_rel[kMaxRows + 16];

  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);

  int64_t max_limit = 0;
  for (int32_t r = 0; r < rows; ++r) max_limit = std::max(max_limit, task.limit[r]);
  const int64_t end = std::min(task.tok_end, max_limit);
  const int64_t v_stride = task.v_slab_stride > 0 ? task.v_slab_stride : task.slab_stride;
  float* st = b.st.data();
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Rows t .. t + 15 of K or V at position p (a multiple of 16, inside one block).
  auto k_at = [&](int64_t p) { return task.k_region + ToInt(task.blocks[p / bl]) * task.slab_stride + (p % bl) * row_bytes; };
  auto v_at = [&](int64_t p) { return task.v_region + ToInt(task.blocks[p / bl]) * v_stride + (p % bl) * row_bytes; };

  LinePrefetcher pf;
  for (int64_t start = task.tok_begin; start < end; start += chunk) {
    const int32_t n = static_cast<int32_t>(std::min<int64_t>(chunk, end - start));
    const int32_t tiles = (n + 15) / 16;
    const int32_t steps = (n + 31) / 32;
    // The next chunk's K and V into L2, a few lines from every loop of this
    // chunk: blocks are scattered and hardware prefetchers stop at pages,
    // and a burst of prefetches stalls on the line-fill buffers with no
    // work in flight (half the time in one profile).
    const int64_t next = start + chunk;
    if (next < end) {
      const int64_t next_n = std::min<int64_t>(chunk, end - next);
      const int32_t points = (tiles + 1) / 2 + n / 2 + steps * (d / 32) * groups;
      pf.Reset(points);
      for (int64_t p = next; p < next + next_n; p += 16) pf.Add(k_at(p), std::min<int64_t>(16, next + next_n - p) * row_bytes);
      for (int64_t p = next; p < next + next_n; p += 16) pf.Add(v_at(p), std::min<int64_t>(16, next + next_n - p) * row_bytes);
      pf.Plan();
    } else {
      pf.Reset(1);
    }
    const int32_t span = steps * 32;  // tokens the P.V steps cover (those past n have p = 0)
    bool any_valid = false;
    for (int32_t r = 0; r < padded; ++r) {
      limit_rel[r] = r < rows ? static_cast<int32_t>(std::clamp<int64_t>(task.limit[r] - start, 0, n)) : 0;
      any_valid |= limit_rel[r] > 0;
    }
    if (!any_valid) continue;

    alignas(64) float corr_all[kMaxRows + 16];
    if constexpr (kF16) {
      BuildKF16([&](int32_t i) { return k_at(start + int64_t{i} * 16); }, row_bytes, tiles, d, b.k_tiles.data());
    }
    const int64_t k_tile_elems = int64_t{2} * 16 * d;
    for (int32_t grp = 0; grp < groups; ++grp) {
      // 1. Scores, token-major: st[t][row], two tiles of 16 tokens at a
      // time, q's hi and lo products into one accumulator per token tile.
      for (int32_t i = 0; i < tiles; i += 2) {
        pf.Step();
        const bool two = i + 1 < tiles;
        [[maybe_unused]] const std::byte* k0 = k_at(start + int64_t{i} * 16);
        [[maybe_unused]] const std::byte* k1 = two ? k_at(start + int64_t{i + 1} * 16) : k0;
        _tile_zero(0);
        _tile_zero(2);
        for (int32_t c = 0; c < dchunks; ++c) {
          const uint16_t* qt = b.q_tiles.data() + (static_cast<int64_t>(grp) * dchunks + c) * 2 * 512;
          _tile_loadd(6, qt, 64);
          _tile_loadd(7, qt + 512, 64);
          if constexpr (kF16) {
            const uint16_t* kh0 = b.k_tiles.data() + i * k_tile_elems + c * 32;
            const uint16_t* kh1 = two ? kh0 + k_tile_elems : kh0;
            _tile_loadd(4, kh0, int64_t{d} * 2);
            _tile_loadd(5, kh1, int64_t{d} * 2);
            _tile_loadd(1, kh0 + 16 * d, int64_t{d} * 2);
            _tile_loadd(3, kh1 + 16 * d, int64_t{d} * 2);
            _tile_dpbf16ps(0, 1, 6);
            _tile_dpbf16ps(2, 3, 6);
          } else {
            _tile_loadd(4, k0 + c * 64, row_bytes);
            _tile_loadd(5, k1 + c * 64, row_bytes);
          }
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(0, 4, 7);
          _tile_dpbf16ps(2, 5, 7);
        }
        _tile_stored(0, st + i * 256, 64);
        if (two) _tile_stored(2, st + (i + 1) * 256, 64);
      }
      // 2. Online softmax, one lane per row: max and sum over tokens are vertical.
      const __m512i rel = _mm512_loadu_si512(limit_rel + grp * 16);
      const __mmask16 valid = _mm512_cmpgt_epi32_mask(rel, _mm512_setzero_si512());
      __m512 vm[4] = {neg_inf, neg_inf, neg_inf, neg_inf};  // four chains of maxima
      for (int32_t t = 0; t < n; ++t) {
        const __mmask16 in = _mm512_cmpgt_epi32_mask(rel, _mm512_set1_epi32(t));
        vm[t % 4] = _mm512_mask_max_ps(vm[t % 4], in, vm[t % 4], _mm512_loadu_ps(st + t * 16));
      }
      const __m512 vmax = _mm512_max_ps(_mm512_max_ps(vm[0], vm[1]), _mm512_max_ps(vm[2], vm[3]));
      float* mrow = b.m.data() + grp * 16;
      float* lrow = b.l.data() + grp * 16;
      const __m512 m_old = _mm512_loadu_ps(mrow);
      const __m512 m_new = _mm512_max_ps(m_old, vmax);
      const __mmask16 had = _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ);
      // corr: 1 for rows with nothing in this chunk, 0 for rows seeing their first keys.
      const __m512 corr = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), valid,
                                             _mm512_maskz_mov_ps(had, Exp(_mm512_sub_ps(m_old, m_new))));
      _mm512_store_ps(corr_all + grp * 16, corr);
      __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
      int32_t t = 0;
      for (; t + 2 <= n; t += 2) {
        if (grp == 0) pf.Step();
        const __mmask16 in0 = _mm512_cmpgt_epi32_mask(rel, _mm512_set1_epi32(t));
        const __mmask16 in1 = _mm512_cmpgt_epi32_mask(rel, _mm512_set1_epi32(t + 1));
        const __m512 p0 = _mm512_maskz_mov_ps(in0, Exp(_mm512_sub_ps(_mm512_loadu_ps(st + t * 16), m_new)));
        const __m512 p1 = _mm512_maskz_mov_ps(in1, Exp(_mm512_sub_ps(_mm512_loadu_ps(st + (t + 1) * 16), m_new)));
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
        _mm512_storeu_ps(st + t * 16, p0);
        _mm512_storeu_ps(st + (t + 1) * 16, p1);
      }
      for (; t < n; ++t) {
        const __mmask16 in = _mm512_cmpgt_epi32_mask(rel, _mm512_set1_epi32(t));
        const __m512 p = _mm512_maskz_mov_ps(in, Exp(_mm512_sub_ps(_mm512_loadu_ps(st + t * 16), m_new)));
        sum0 = _mm512_add_ps(sum0, p);
        _mm512_storeu_ps(st + t * 16, p);
      }
      const __m512 sum = _mm512_add_ps(sum0, sum1);
      for (t = n; t < span; ++t) _mm512_storeu_ps(st + t * 16, _mm512_setzero_ps());
      _mm512_storeu_ps(lrow, _mm512_mask_fmadd_ps(_mm512_loadu_ps(lrow), valid, corr, sum));
      _mm512_storeu_ps(mrow, _mm512_mask_mov_ps(m_old, valid, m_new));
      if (task.weights_out != nullptr) {
        for (int32_t g = 0; g < 16 && grp * 16 + g < rows; ++g) {
          const int32_t r = grp * 16 + g;
          if (limit_rel[r] == 0) continue;
          float* w = task.weights_out + r * task.weights_stride + (start - task.tok_begin);
          for (int32_t u = 0; u < limit_rel[r]; ++u) w[u] = st[u * 16 + g];
          for (int64_t blk = start; blk < start + limit_rel[r]; blk += bl)
            task.block_max_out[r * task.block_max_stride + (blk - task.tok_begin) / bl] = mrow[g];
        }
      }
      // 3. P (rows x tokens) as bf16 hi + lo A tiles, 16 tokens at a time.
      uint16_t* ph = b.p_tiles.data() + static_cast<int64_t>(grp) * 2 * 16 * span_max;
      uint16_t* pl = ph + 16 * span_max;
      const int32_t real = std::min(16, rows - grp * 16);
      for (int32_t i = 0; i < span / 16; ++i) {
        alignas(64) float pt[256];
        Transpose16(st + i * 256, 16, pt, 16);
        for (int32_t g = 0; g < 16; ++g) {
          __m512 rest;
          const __m256i h = Bf16Hi(_mm512_load_ps(pt + g * 16), &rest);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + g * span_max + i * 16), h);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + g * span_max + i * 16),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest)));
        }
      }
      float* acc = b.acc.data() + static_cast<int64_t>(grp) * 16 * d;
      for (int32_t g = 0; g < real; ++g) {
        const __m512 cg = _mm512_set1_ps(corr_all[grp * 16 + g]);
        for (int32_t j = 0; j < d; j += 16) _mm512_storeu_ps(acc + g * d + j, _mm512_mul_ps(cg, _mm512_loadu_ps(acc + g * d + j)));
      }
    }
    // 4. acc += P . V, one step of 32 tokens at a time, two accumulator tiles
    // (dimension tiles j and j + 1) in flight.
    for (int32_t s = 0; s < steps; ++s) {
      const std::byte* vrows[2] = {v_at(start + int64_t{s} * 32),
                                   2 * s + 1 < tiles ? v_at(start + int64_t{s} * 32 + 16) : nullptr};
      BuildV<kF16>(vrows, row_bytes, std::min(32, n - s * 32), d, b.v_tile.data());
      for (int32_t grp = 0; grp < groups; ++grp) {
        const uint16_t* ph = b.p_tiles.data() + static_cast<int64_t>(grp) * 2 * 16 * span_max + s * 32;
        const uint16_t* pl = ph + 16 * span_max;
        float* acc = b.acc.data() + static_cast<int64_t>(grp) * 16 * d;
        _tile_loadd(6, ph, int64_t{span_max} * 2);
        _tile_loadd(7, pl, int64_t{span_max} * 2);
        for (int32_t j = 0; j < d / 16; j += 2) {
          pf.Step();
          const uint16_t* vt = b.v_tile.data() + static_cast<int64_t>(j) * 16 * 32;
          _tile_loadd(0, acc + j * 16, int64_t{d} * 4);
          _tile_loadd(1, acc + j * 16 + 16, int64_t{d} * 4);
          _tile_loadd(4, vt, 64);
          _tile_loadd(5, vt + 16 * 32, 64);
          if constexpr (kF16) {
            _tile_loadd(2, vt + v_set, 64);
            _tile_loadd(3, vt + v_set + 16 * 32, 64);
            _tile_dpbf16ps(0, 6, 2);
            _tile_dpbf16ps(1, 6, 3);
          }
          _tile_dpbf16ps(0, 6, 4);
          _tile_dpbf16ps(1, 6, 5);
          _tile_dpbf16ps(0, 7, 4);
          _tile_dpbf16ps(1, 7, 5);
          _tile_stored(0, acc + j * 16, int64_t{d} * 4);
          _tile_stored(1, acc + j * 16 + 16, int64_t{d} * 4);
        }
      }
    }
  }
  _tile_release();
  std::memcpy(task.acc, b.acc.data(), sizeof(float) * static_cast<size_t>(rows) * d);
  std::copy(b.m.begin(), b.m.begin() + rows, task.m);
  std::copy(b.l.begin(), b.l.begin() + rows, task.l);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace

bool AmxEnabled() { return CpuAndKernelHaveAmxBf16() && amx_allowed.load(std::memory_order_relaxed); }

bool SetAmxForTest(bool allowed) {
  amx_allowed.store(allowed, std::memory_order_relaxed);
  return CpuAndKernelHaveAmxBf16();
}

bool AmxAttendRows(const RowTask& task) {
  if ((task.dtype != DType::kBF16 && task.dtype != DType::kF16) ||
      task.rows < (task.dtype == DType::kF16 ? kMinRowsF16 : kMinRows) || task.softcap > 0 || task.begin != nullptr ||
      task.block_len % 16 != 0 ||
      task.head_dim % 32 != 0 || task.head_dim > 256 || task.row_bytes != int64_t{task.head_dim} * 2) {
    return false;
  }
  if (!AmxEnabled()) return false;
  if (task.dtype == DType::kF16) {
    Run<true>(task);
  } else {
    Run<false>(task);
  }
  return true;
}

#else  // not x86-64 GCC / clang

bool AmxEnabled() { return false; }
bool SetAmxForTest(bool) { return false; }
bool AmxAttendRows(const RowTask&) { return false; }

#endif

}  // namespace pagekv::kernels
