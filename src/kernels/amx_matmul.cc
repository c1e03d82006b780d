// Weight products through AMX-BF16 tiles (see amx_matmul.h for the layout
// and the accuracy argument).
//
// Per thread and task (up to kAmxMaxRows weight rows, every token):
//   1. the two 16-row panels are converted once into B tiles: for each pair
//      of columns (c, c + 1), one 64-byte row holding (w[n][c], w[n][c + 1])
//      for the 16 rows n, as bf16 hi and, unless the weights are bf16, lo;
//   2. for each 32 tokens, four C tiles (2 token tiles x 2 row tiles)
//      accumulate over the columns, 32 at a time: Xhi.Whi, Xlo.Whi and
//      Xhi.Wlo, twelve tile products per step (eight for bf16 weights);
//   3. each C tile goes straight into Y (rows past the valid ones, and
//      padding tokens, through a small buffer).
// Tile registers: tmm0-3 C, tmm4-5 W (B), tmm6-7 X (A); all 16 x 64 bytes.
//
// The tile state needs the kernel's permission (amx_support.h); each call
// configures the tiles and releases them at its end, so a thread holds no
// tile state between calls.
// GCC 12 warns inside its own AVX-512 headers (amx_attention.cc says why).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "kernels/amx_matmul.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "kernels/amx_support.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define PAGEKV_HAVE_AMX_MATMUL 1
#include <immintrin.h>
#endif

namespace pagekv::kernels {

namespace {
std::atomic<bool> amx_matmul_allowed{true};
}  // namespace

bool AmxMatMulEnabled() { return CpuAndKernelHaveAmxBf16() && amx_matmul_allowed.load(std::memory_order_relaxed); }

bool SetAmxMatMulForTest(bool allowed) {
  amx_matmul_allowed.store(allowed, std::memory_order_relaxed);
  return CpuAndKernelHaveAmxBf16();
}

#ifdef PAGEKV_HAVE_AMX_MATMUL
namespace {

// A per-thread buffer of 64-byte aligned bf16, grown to the widest call seen.
struct TileBuffer {
  uint16_t* data = nullptr;
  size_t cap = 0;
  ~TileBuffer() { std::free(data); }
  uint16_t* Get(size_t elems) {
    if (elems > cap) {
      std::free(data);
      data = static_cast<uint16_t*>(std::aligned_alloc(64, (elems * 2 + 63) / 64 * 64));
      cap = data != nullptr ? elems : 0;
    }
    return data;
  }
};

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")
#endif

// bf16 (as 16-bit lanes) back to f32.
inline __m512 Widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// a and b as bf16 hi (rounded to nearest even) and lo = bf16(x - hi), both
// [a's 16 | b's 16]. lo is zero where x is not finite (hi carries it).
inline void Split(__m512 a, __m512 b, __m512i* hi, __m512i* lo) {
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // QNaN, +Inf, -Inf, SNaN
  const __m512 ra = _mm512_maskz_sub_ps(static_cast<__mmask16>(~_mm512_fpclass_ps_mask(a, kNotFinite)), a,
                                        Widen(_mm512_castsi512_si256(h)));
  const __m512 rb = _mm512_maskz_sub_ps(static_cast<__mmask16>(~_mm512_fpclass_ps_mask(b, kNotFinite)), b,
                                        Widen(_mm512_extracti64x4_epi64(h, 1)));
  *hi = h;
  *lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(rb, ra));
}

// Column c of a panel (16 rows) as f32.
template <AmxPanelType kType>
inline __m512 Column(const void* panel, int64_t c) {
  if constexpr (kType == AmxPanelType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(panel) + c * 16);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(panel) + c * 16));
    if constexpr (kType == AmxPanelType::kF16) {
      return _mm512_cvtph_ps(h);
    } else {
      return Widen(h);
    }
  }
}

// One panel as B tiles: row c / 2 of `hi` (and `lo`) holds the pairs
// (w[n][c], w[n][c + 1]) for n = 0..15.
template <AmxPanelType kType>
void PanelToTiles(const void* panel, int64_t cols, uint16_t* hi, uint16_t* lo) {
  // Word 2n of the result is word n of the [c | c + 1] input, word 2n + 1 word 16 + n.
  alignas(64) static constexpr uint16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  for (int64_t c = 0; c < cols; c += 2) {
    const __m512 a = Column<kType>(panel, c), b = Column<kType>(panel, c + 1);
    if constexpr (kType == AmxPanelType::kBF16) {
      const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // exact: the values are bf16
      _mm512_store_si512(hi + c * 16, _mm512_permutexvar_epi16(pairs, h));
    } else {
      __m512i h, l;
      Split(a, b, &h, &l);
      _mm512_store_si512(hi + c * 16, _mm512_permutexvar_epi16(pairs, h));
      _mm512_store_si512(lo + c * 16, _mm512_permutexvar_epi16(pairs, l));
    }
  }
}

// Copies the valid part of a 16 x 16 C tile stored at `tile` into y.
void CopyOut(const float* tile, int tokens, int rows, float* y, int64_t y_stride) {
  for (int t = 0; t < tokens; ++t) std::memcpy(y + t * y_stride, tile + t * 16, static_cast<size_t>(rows) * 4);
}

// Tile-major: the A tile of tokens 16 T.. and columns 32 s.. is the 1 KiB at
// element (T * cols / 32 + s) * 512, its rows 64 bytes apart, so a tile load
// reads one contiguous run.
inline int64_t TileOffset(int64_t t, int64_t c, int64_t cols) {
  return ((t / 16) * (cols / 32) + c / 32) * 512 + (t % 16) * 32;
}

void SplitImpl(const float* x, int64_t tokens, int64_t cols, int64_t t_begin, int64_t t_end, uint16_t* hi, uint16_t* lo) {
  const int64_t padded = std::min(AmxPaddedTokens(tokens), t_end);
  for (int64_t t = t_begin; t < std::min(tokens, t_end); ++t) {
    for (int64_t c = 0; c < cols; c += 32) {
      __m512i h, l;
      Split(_mm512_loadu_ps(x + t * cols + c), _mm512_loadu_ps(x + t * cols + c + 16), &h, &l);
      _mm512_storeu_si512(hi + TileOffset(t, c, cols), h);
      _mm512_storeu_si512(lo + TileOffset(t, c, cols), l);
    }
  }
  for (int64_t t = std::max(tokens, t_begin); t < padded; ++t) {
    for (int64_t c = 0; c < cols; c += 32) {
      _mm512_storeu_si512(hi + TileOffset(t, c, cols), _mm512_setzero_si512());
      _mm512_storeu_si512(lo + TileOffset(t, c, cols), _mm512_setzero_si512());
    }
  }
}

// The calling thread's staged B tiles: per panel, hi then lo, each
// 16 x cols bf16 (cols / 2 rows of 32).
struct Staging {
  TileBuffer buffer;
  int64_t cols = 0;
  uint16_t* Panel(int p, bool lo) { return buffer.data + (2 * p + (lo ? 1 : 0)) * 16 * cols; }
};
Staging& ThreadStaging() {
  thread_local Staging s;
  return s;
}

template <AmxPanelType kType>
void StageImpl(int first, int count, const void* panels, int64_t panel_elems, int64_t cols) {
  constexpr int64_t kElemBytes = kType == AmxPanelType::kF32 ? 4 : 2;
  Staging& st = ThreadStaging();
  // Room for the panels of one task (AmxRowsPerTask): the callers stage no
  // more, and the buffer keeps its contents between the calls of a task.
  const int64_t panels_max = AmxRowsPerTask(cols) / 16;
  if (first + count > panels_max || st.buffer.Get(static_cast<size_t>(2 * panels_max * 16 * cols)) == nullptr) {
    std::abort();  // a caller staged more than a task, or no memory for a few MiB
  }
  st.cols = cols;
  for (int p = 0; p < count; ++p) {
    const void* panel = static_cast<const char*>(panels) + p * panel_elems * kElemBytes;
    PanelToTiles<kType>(panel, cols, st.Panel(first + p, false), st.Panel(first + p, true));
  }
}

template <bool kLo>
void MultiplyImpl(const AmxActivations& x, int valid_rows, float* y, int64_t y_stride) {
  Staging& st = ThreadStaging();
  const int64_t cols = x.cols;
  const int64_t steps = cols / 32;
  const int pairs = (valid_rows + 31) / 32;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float scratch[16 * 16];
  // Tokens in chunks whose X stays in L2 while every staged row pair runs
  // over them (the staged rows stay there too: AmxRowsPerTask).
  const int64_t chunk = AmxTokensPerChunk(cols);
  for (int64_t c0 = 0; c0 < x.tokens; c0 += chunk)
  for (int q = 0; q < pairs; ++q)
  for (int64_t t0 = c0; t0 < std::min(x.tokens, c0 + chunk); t0 += 32) {
    const bool two = t0 + 16 < x.tokens;  // the second token tile holds a real token
    // The A tiles of token tiles t0 / 16 and the next, tile-major (TileOffset).
    const uint16_t* xh0 = x.hi + (t0 / 16) * steps * 512;
    const uint16_t* xl0 = x.lo + (t0 / 16) * steps * 512;
    const uint16_t* xh1 = xh0 + steps * 512;
    const uint16_t* xl1 = xl0 + steps * 512;
    const int tok0 = static_cast<int>(std::min<int64_t>(16, x.tokens - t0));
    const int tok1 = two ? static_cast<int>(std::min<int64_t>(16, x.tokens - t0 - 16)) : 0;
    {
      const uint16_t* whi0 = st.Panel(2 * q, false);
      const uint16_t* whi1 = st.Panel(2 * q + 1, false);
      const uint16_t* wlo0 = st.Panel(2 * q, true);
      const uint16_t* wlo1 = st.Panel(2 * q + 1, true);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t b = s * 512;  // this step's tiles (16 rows of 32 bf16)
        _tile_loadd(4, whi0 + b, 64);
        _tile_loadd(5, whi1 + b, 64);
        _tile_loadd(6, xh0 + b, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        if (two) {
          _tile_loadd(7, xh1 + b, 64);
          _tile_dpbf16ps(2, 7, 4);
          _tile_dpbf16ps(3, 7, 5);
        }
        _tile_loadd(6, xl0 + b, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        if (two) {
          _tile_loadd(7, xl1 + b, 64);
          _tile_dpbf16ps(2, 7, 4);
          _tile_dpbf16ps(3, 7, 5);
        }
        if constexpr (kLo) {
          _tile_loadd(4, wlo0 + b, 64);
          _tile_loadd(5, wlo1 + b, 64);
          _tile_loadd(6, xh0 + b, 64);
          _tile_dpbf16ps(0, 6, 4);
          _tile_dpbf16ps(1, 6, 5);
          if (two) {
            _tile_loadd(7, xh1 + b, 64);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
          }
        }
      }
      // Out: C tile (i, j) is tokens t0 + 16 i.., rows 32 q + 16 j...
      const int rows0 = std::min(16, valid_rows - 32 * q), rows1 = std::max(0, std::min(16, valid_rows - 32 * q - 16));
      float* y0 = y + t0 * y_stride + 32 * q;
      float* y1 = y0 + 16 * y_stride;
      const int64_t ys = y_stride * 4;
      if (tok0 == 16 && rows0 == 16) {
        _tile_stored(0, y0, ys);
      } else {
        _tile_stored(0, scratch, 64);
        CopyOut(scratch, tok0, rows0, y0, y_stride);
      }
      if (rows1 > 0) {
        if (tok0 == 16 && rows1 == 16) {
          _tile_stored(1, y0 + 16, ys);
        } else {
          _tile_stored(1, scratch, 64);
          CopyOut(scratch, tok0, rows1, y0 + 16, y_stride);
        }
      }
      if (tok1 > 0) {
        if (tok1 == 16 && rows0 == 16) {
          _tile_stored(2, y1, ys);
        } else {
          _tile_stored(2, scratch, 64);
          CopyOut(scratch, tok1, rows0, y1, y_stride);
        }
        if (rows1 > 0) {
          if (tok1 == 16 && rows1 == 16) {
            _tile_stored(3, y1 + 16, ys);
          } else {
            _tile_stored(3, scratch, 64);
            CopyOut(scratch, tok1, rows1, y1 + 16, y_stride);
          }
        }
      }
    }
  }
  _tile_release();
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace

void AmxSplitActivations(const float* x, int64_t tokens, int64_t cols, int64_t t_begin, int64_t t_end, uint16_t* hi,
                         uint16_t* lo) {
  SplitImpl(x, tokens, cols, t_begin, t_end, hi, lo);
}

void AmxStagePanels(int first, int count, const void* panels, AmxPanelType type, int64_t panel_elems, int64_t cols) {
  switch (type) {
    case AmxPanelType::kF32: return StageImpl<AmxPanelType::kF32>(first, count, panels, panel_elems, cols);
    case AmxPanelType::kF16: return StageImpl<AmxPanelType::kF16>(first, count, panels, panel_elems, cols);
    case AmxPanelType::kBF16: return StageImpl<AmxPanelType::kBF16>(first, count, panels, panel_elems, cols);
  }
}

void AmxMultiplyStaged(const AmxActivations& x, int valid_rows, bool w_exact, float* y, int64_t y_stride) {
  if (w_exact) {
    MultiplyImpl<false>(x, valid_rows, y, y_stride);
  } else {
    MultiplyImpl<true>(x, valid_rows, y, y_stride);
  }
}

#else  // not x86-64 GCC / clang: AmxMatMulEnabled() is false, so these are never called.

void AmxSplitActivations(const float*, int64_t, int64_t, int64_t, int64_t, uint16_t*, uint16_t*) {}
void AmxStagePanels(int, int, const void*, AmxPanelType, int64_t, int64_t) {}
void AmxMultiplyStaged(const AmxActivations&, int, bool, float*, int64_t) {}

#endif

}  // namespace pagekv::kernels
