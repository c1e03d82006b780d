// The CUDA paged decode attention against a double-precision reference on
// the host, and (with --bench) its speed against the device's own measured
// read bandwidth. Needs only the CUDA toolkit (no other library), so it
// builds and runs on a GPU machine that has nothing else
// (scripts/cuda-device-check.sh); in the project's build it is a CTest test
// that exits 77 (reported as skipped) where no GPU is present.
//
// Cases: every KV type (f32, f16, bf16, int8, fp8 E4M3 / E5M2), G = 1, 2, 4, 8 and 16, head_dim 64,
// 128, 256 (and 8, 80), block_len 16, 32, 128, contexts around block
// boundaries (1, bl - 1, bl, bl + 1, many blocks), mixed lengths in one
// batch, shuffled block tables drawn from a pool larger than the batch,
// one split, the chosen split and 1, 2, 3 blocks per split, through both
// kernels (16-byte chunks per thread, and the general one); the output is
// poisoned with NaN first so every element must be written.
//
// Prefill (PagedPrefillAttention) on the same caches: every sequence's
// queries a chunk of its last positions (1, block_len - 1, block_len,
// block_len + 1 and the whole prompt: a chunk starting at every kind of
// position in a block), sliding windows, soft-capped logits, partial
// tables (entries of blocks held elsewhere), and the rows' log-sum-exps,
// against the same double reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/paged_attention.h"

namespace {

using pagekv::cuda::DecodeParams;
using pagekv::cuda::KvType;

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

using pagekv::cuda::ElementBytes;
using pagekv::cuda::RowBytesNeeded;
using pagekv::cuda::ScaledRows;

const char* Name(KvType t) {
  switch (t) {
    case KvType::kF32: return "f32";
    case KvType::kF16: return "f16";
    case KvType::kBF16: return "bf16";
    case KvType::kInt8: return "int8";
    case KvType::kFp8E4M3: return "e4m3";
    case KvType::kFp8E5M2: return "e5m2";
  }
  return "?";
}

// A plain stored value and what it reads back as.
float Store(KvType t, float x, unsigned char* out) {
  if (t == KvType::kF32) {
    std::memcpy(out, &x, 4);
    return x;
  }
  if (t == KvType::kF16) {
    const __half h = __float2half_rn(x);
    std::memcpy(out, &h, 2);
    return __half2float(h);
  }
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  std::memcpy(out, &b, 2);
  return __bfloat162float(b);
}

// An 8-bit code's value from the formats' definitions (sign, exponent,
// mantissa; docs/KV_LAYOUT.md), written out independently of the kernel's
// bit tricks.
double CodeValue(KvType t, uint8_t c) {
  if (t == KvType::kInt8) return static_cast<int8_t>(c);
  const bool e4m3 = t == KvType::kFp8E4M3;
  const int mant_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int e = (c & 0x7F) >> mant_bits, m = c & ((1 << mant_bits) - 1);
  const double frac = static_cast<double>(m) / (1 << mant_bits);
  const double mag = e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, e - bias);
  return (c & 0x80) ? -mag : mag;
}

// One row of `d` elements written at `row` in type t; `values` gets what
// each element reads back as (the 8-bit formats: code value x row scale).
// The 8-bit rows hold random codes (never NaN or Inf) under a random f16
// scale that puts the values near [-1.5, 1.5].
void StoreRow(KvType t, int d, std::mt19937& rng, unsigned char* row, float* values) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  if (!ScaledRows(t)) {
    for (int j = 0; j < d; ++j) values[j] = Store(t, u(rng), row + static_cast<int64_t>(j) * ElementBytes(t));
    return;
  }
  const double top = t == KvType::kInt8 ? 127.0 : t == KvType::kFp8E4M3 ? 448.0 : 57344.0;
  const __half s = __float2half_rn(static_cast<float>((1.0 + 0.5 * u(rng)) / top));
  const double sv = __half2float(s);
  std::memcpy(row + d, &s, 2);
  std::uniform_int_distribution<int> code(0, 255);
  for (int j = 0; j < d; ++j) {
    uint8_t c;
    do {
      c = static_cast<uint8_t>(code(rng));
    } while ((t == KvType::kInt8 && c == 0x80) || (t == KvType::kFp8E4M3 && (c & 0x7F) == 0x7F) ||
             (t == KvType::kFp8E5M2 && (c & 0x7C) == 0x7C));
    row[j] = c;
    values[j] = static_cast<float>(CodeValue(t, c) * sv);
  }
}

struct Shape {
  KvType type;
  int q_heads, kv_heads, d, bl;
  std::vector<int> contexts;
};

// One layer's cache in the layout of docs/KV_LAYOUT.md: planes K then V,
// each [head][block][slot][row], slabs 64-byte aligned.
struct Cache {
  int64_t row_bytes, slab_stride, head_stride, plane_bytes;
  int num_blocks;
  std::vector<unsigned char> bytes;
  std::vector<float> values;  // what each stored element reads as: [plane][head][block][slot][d]
};

struct Case {
  Shape s;
  Cache c;
  std::vector<int32_t> tables;  // [seq][max_blocks]
  int max_blocks = 0;
  std::vector<float> q;
};

Case Make(const Shape& s, std::mt19937& rng) {
  Case k;
  k.s = s;
  const int seqs = static_cast<int>(s.contexts.size());
  for (int c : s.contexts) k.max_blocks = std::max(k.max_blocks, (c + s.bl - 1) / s.bl);
  k.max_blocks = std::max(k.max_blocks, 1);
  Cache& c = k.c;
  c.num_blocks = seqs * k.max_blocks + 5;  // spare blocks: tables drawn from a larger pool
  // Rows as the host arena spaces them: plain rows 16-byte multiples, 8-bit
  // rows head_dim + 2 bytes (2-byte aligned only).
  c.row_bytes = RowBytesNeeded(s.type, s.d);
  if (!ScaledRows(s.type)) c.row_bytes = (c.row_bytes + 15) / 16 * 16;
  c.slab_stride = (s.bl * c.row_bytes + 63) / 64 * 64;
  c.head_stride = static_cast<int64_t>(c.num_blocks) * c.slab_stride;
  c.plane_bytes = static_cast<int64_t>(s.kv_heads) * c.head_stride;
  c.bytes.assign(static_cast<size_t>(2 * c.plane_bytes), 0);
  c.values.assign(static_cast<size_t>(2) * s.kv_heads * c.num_blocks * s.bl * s.d, 0.0f);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t plane = 0; plane < 2; ++plane)
    for (int h = 0; h < s.kv_heads; ++h)
      for (int b = 0; b < c.num_blocks; ++b)
        for (int t = 0; t < s.bl; ++t) {
          const int64_t off = plane * c.plane_bytes + h * c.head_stride + b * c.slab_stride + t * c.row_bytes;
          const size_t at = static_cast<size_t>((((plane * s.kv_heads + h) * c.num_blocks + b) * s.bl + t) * s.d);
          StoreRow(s.type, s.d, rng, c.bytes.data() + off, c.values.data() + at);
        }
  std::vector<int32_t> ids(static_cast<size_t>(c.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  k.tables.assign(static_cast<size_t>(seqs) * k.max_blocks, 0);
  for (size_t i = 0; i < k.tables.size(); ++i) k.tables[i] = ids[i];
  k.q.resize(static_cast<size_t>(seqs) * s.q_heads * s.d);
  for (float& x : k.q) x = 2.0f * u(rng);
  return k;
}

std::vector<double> Reference(const Case& k) {
  const Shape& s = k.s;
  const int seqs = static_cast<int>(s.contexts.size()), G = s.q_heads / s.kv_heads;
  std::vector<double> out(static_cast<size_t>(seqs) * s.q_heads * s.d, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  auto val = [&](int plane, int h, int tok, int seq, int j) {
    const int64_t b = k.tables[static_cast<size_t>(seq) * k.max_blocks + tok / s.bl];
    const size_t at = static_cast<size_t>((((plane * s.kv_heads + h) * k.c.num_blocks + b) * s.bl + tok % s.bl) * s.d + j);
    return static_cast<double>(k.c.values[at]);
  };
  for (int seq = 0; seq < seqs; ++seq) {
    const int n = s.contexts[static_cast<size_t>(seq)];
    for (int qh = 0; qh < s.q_heads; ++qh) {
      const int h = qh / G;
      const float* q = k.q.data() + (static_cast<size_t>(seq) * s.q_heads + qh) * s.d;
      std::vector<double> sc(static_cast<size_t>(n));
      double m = -INFINITY;
      for (int t = 0; t < n; ++t) {
        double dot = 0;
        for (int j = 0; j < s.d; ++j) dot += static_cast<double>(q[j]) * val(0, h, t, seq, j);
        sc[static_cast<size_t>(t)] = dot * scale;
        m = std::max(m, sc[static_cast<size_t>(t)]);
      }
      double l = 0;
      for (double& x : sc) l += (x = std::exp(x - m));
      double* o = out.data() + (static_cast<size_t>(seq) * s.q_heads + qh) * s.d;
      for (int t = 0; t < n; ++t)
        for (int j = 0; j < s.d; ++j) o[j] += sc[static_cast<size_t>(t)] / l * val(1, h, t, seq, j);
    }
  }
  return out;
}

struct Device {
  void* arena = nullptr;
  int32_t* tables = nullptr;
  int32_t* lens = nullptr;
  float* q = nullptr;
  float* out = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  ~Device() {
    cudaFree(arena);
    cudaFree(tables);
    cudaFree(lens);
    cudaFree(q);
    cudaFree(out);
    cudaFree(scratch);
  }
};

DecodeParams Params(const Case& k, const Device& dev) {
  DecodeParams p;
  p.type = k.s.type;
  p.num_seqs = static_cast<int32_t>(k.s.contexts.size());
  p.q_heads = k.s.q_heads;
  p.kv_heads = k.s.kv_heads;
  p.head_dim = k.s.d;
  p.block_len = k.s.bl;
  p.k_plane = dev.arena;
  p.v_plane = static_cast<char*>(dev.arena) + k.c.plane_bytes;
  p.head_stride = k.c.head_stride;
  p.slab_stride = k.c.slab_stride;
  p.row_bytes = k.c.row_bytes;
  p.block_tables = dev.tables;
  p.max_blocks = k.max_blocks;
  p.context_lens = dev.lens;
  p.q = dev.q;
  p.out = dev.out;
  return p;
}

void Upload(const Case& k, Device& dev) {
  CHECK_CUDA(cudaMalloc(&dev.arena, k.c.bytes.size()));
  CHECK_CUDA(cudaMemcpy(dev.arena, k.c.bytes.data(), k.c.bytes.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dev.tables, k.tables.size() * 4));
  CHECK_CUDA(cudaMemcpy(dev.tables, k.tables.data(), k.tables.size() * 4, cudaMemcpyHostToDevice));
  std::vector<int32_t> lens(k.s.contexts.begin(), k.s.contexts.end());
  CHECK_CUDA(cudaMalloc(&dev.lens, lens.size() * 4));
  CHECK_CUDA(cudaMemcpy(dev.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dev.q, k.q.size() * 4));
  CHECK_CUDA(cudaMemcpy(dev.q, k.q.data(), k.q.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dev.out, k.q.size() * 4));
}

int RunTests() {
  std::mt19937 rng(7);
  std::vector<Shape> shapes;
  for (KvType t : {KvType::kF32, KvType::kF16, KvType::kBF16, KvType::kInt8, KvType::kFp8E4M3, KvType::kFp8E5M2}) {
    shapes.push_back({t, 4, 4, 64, 16, {1, 15, 16, 17, 100}});
    shapes.push_back({t, 8, 2, 128, 16, {33, 1, 257, 64}});
    shapes.push_back({t, 8, 1, 128, 32, {31, 32, 33, 500}});
    shapes.push_back({t, 16, 2, 256, 128, {127, 128, 129, 700}});
    shapes.push_back({t, 16, 1, 64, 16, {1000, 5}});
    shapes.push_back({t, 6, 3, 80, 16, {47, 48, 49}});
    shapes.push_back({t, 2, 2, 8, 16, {3, 40}});
    shapes.push_back({t, 16, 1, 128, 16, {65, 300}});   // G = 16 over 16 chunks: the reduce-scatter all the way
    shapes.push_back({t, 4, 2, 128, 32, {31, 97}});     // G = 2
    shapes.push_back({t, 12, 4, 32, 16, {50, 7}});      // G = 3 (a tile of 4), 4 chunks
  }
  int failures = 0, checked = 0;
  for (const Shape& s : shapes) {
    const Case k = Make(s, rng);
    const std::vector<double> ref = Reference(k);
    Device dev;
    Upload(k, dev);
    int longest = *std::max_element(s.contexts.begin(), s.contexts.end());
    for (int variant = 0; variant < 15; ++variant) {
      const int bps = std::vector<int>{0, -1, 1, 2, 3}[variant % 5];  // -1: one split, no scratch
      // The chunk kernel (where head_dim / 8 is a power of two), the general
      // one, then the tensor-core one (where its shape allows).
      const bool tc = variant >= 10;
      const bool chunk = variant < 5;
      DecodeParams p = Params(k, dev);
      p.use_chunk_kernel = chunk;
      p.tensor_cores = tc;
      if (tc && !pagekv::cuda::TensorCoreDecodeShape(p)) break;
      int splits = 1;
      if (bps >= 0) {
        p.blocks_per_split = bps;
        int sms = 0;
        CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        splits = pagekv::cuda::Splits(p, longest, sms);
        if (bps > 0) splits = std::max(splits, (k.max_blocks + bps - 1) / bps);
        if (bps == 0 && splits > 1) {
          // The chosen splits must cover the table's blocks.
          p.blocks_per_split = (k.max_blocks + splits - 1) / splits;
        }
        const size_t need = pagekv::cuda::ScratchBytes(p, splits);
        if (need > dev.scratch_bytes) {
          cudaFree(dev.scratch);
          CHECK_CUDA(cudaMalloc(&dev.scratch, need));
          dev.scratch_bytes = need;
        }
        p.scratch = dev.scratch;
      }
      CHECK_CUDA(cudaMemset(dev.out, 0xff, k.q.size() * 4));  // NaN everywhere
      CHECK_CUDA(pagekv::cuda::PagedDecodeAttention(p, splits, nullptr));
      CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<float> got(k.q.size());
      CHECK_CUDA(cudaMemcpy(got.data(), dev.out, got.size() * 4, cudaMemcpyDeviceToHost));
      double worst = 0;
      for (size_t row = 0; row < got.size() / s.d; ++row) {
        double big = 1e-30;
        for (int j = 0; j < s.d; ++j) big = std::max(big, std::fabs(ref[row * s.d + j]));
        for (int j = 0; j < s.d; ++j) {
          const double e = std::isnan(got[row * s.d + j]) ? INFINITY : std::fabs(got[row * s.d + j] - ref[row * s.d + j]) / big;
          worst = std::max(worst, e);
        }
      }
      ++checked;
      if (!(worst <= 2e-5)) {
        ++failures;
        std::printf("FAIL %s q/kv %d/%d d %d bl %d blocks/split %d (splits %d, %s kernel): max row-relative error %.3g\n",
                    Name(s.type), s.q_heads, s.kv_heads, s.d, s.bl, bps, splits, tc ? "tensor-core" : chunk ? "chunk" : "general", worst);
      }
    }
  }
  // Bad shapes are refused.
  {
    DecodeParams p;
    if (pagekv::cuda::PagedDecodeAttention(p, 1, nullptr) != cudaErrorInvalidValue) {
      ++failures;
      std::printf("FAIL: an empty shape was not refused\n");
    }
    cudaGetLastError();
  }
  std::printf("%d of %d checks passed\n", checked - failures, checked);
  return failures == 0 ? 0 : 1;
}

// --- Prefill --------------------------------------------------------------------

struct PrefillCase {
  std::vector<int> query_lens;  // per sequence
  std::vector<int> windows;     // per sequence (0: all)
  float softcap = 0;
  bool partial = false;         // some table entries -1 (blocks held elsewhere)
};

// out [rows][q_heads][d] and lse [rows][q_heads] in double, rows of the
// sequences in order.
void PrefillReference(const Case& k, const PrefillCase& pc, const std::vector<int32_t>& tables, std::vector<double>& out,
                      std::vector<double>& lse) {
  const Shape& s = k.s;
  const int seqs = static_cast<int>(s.contexts.size()), G = s.q_heads / s.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  int rows = 0;
  for (int ql : pc.query_lens) rows += ql;
  out.assign(static_cast<size_t>(rows) * s.q_heads * s.d, 0.0);
  lse.assign(static_cast<size_t>(rows) * s.q_heads, -INFINITY);
  auto val = [&](int plane, int h, int tok, int seq, int j) {
    const int64_t b = tables[static_cast<size_t>(seq) * k.max_blocks + tok / s.bl];
    const size_t at = static_cast<size_t>((((plane * s.kv_heads + h) * k.c.num_blocks + b) * s.bl + tok % s.bl) * s.d + j);
    return static_cast<double>(k.c.values[at]);
  };
  int row = 0;
  for (int seq = 0; seq < seqs; ++seq) {
    const int n = s.contexts[static_cast<size_t>(seq)], ql = pc.query_lens[static_cast<size_t>(seq)];
    const int w = pc.windows[static_cast<size_t>(seq)];
    for (int j = 0; j < ql; ++j, ++row) {
      const int pos = n - ql + j, lo = w > 0 ? std::max(0, pos - w + 1) : 0;
      for (int qh = 0; qh < s.q_heads; ++qh) {
        const int h = qh / G;
        const float* q = k.q.data() + (static_cast<size_t>(row) * s.q_heads + qh) * s.d;
        std::vector<double> sc;
        std::vector<int> toks;
        double m = -INFINITY;
        for (int t = lo; t <= pos; ++t) {
          if (tables[static_cast<size_t>(seq) * k.max_blocks + t / s.bl] < 0) continue;
          double dot = 0;
          for (int i = 0; i < s.d; ++i) dot += static_cast<double>(q[i]) * val(0, h, t, seq, i);
          double x = dot * scale;
          if (pc.softcap > 0) x = pc.softcap * std::tanh(x / pc.softcap);
          sc.push_back(x);
          toks.push_back(t);
          m = std::max(m, x);
        }
        if (toks.empty()) continue;
        double l = 0;
        for (double& x : sc) l += (x = std::exp(x - m));
        double* o = out.data() + (static_cast<size_t>(row) * s.q_heads + qh) * s.d;
        for (size_t i = 0; i < toks.size(); ++i)
          for (int jd = 0; jd < s.d; ++jd) o[jd] += sc[i] / l * val(1, h, toks[i], seq, jd);
        lse[static_cast<size_t>(row) * s.q_heads + qh] = m + std::log(l);
      }
    }
  }
}

int RunPrefillTests() {
  std::mt19937 rng(11);
  std::vector<Shape> shapes;
  for (KvType t : {KvType::kF32, KvType::kF16, KvType::kBF16, KvType::kInt8, KvType::kFp8E4M3, KvType::kFp8E5M2}) {
    shapes.push_back({t, 4, 4, 64, 16, {1, 15, 16, 17, 100}});
    shapes.push_back({t, 8, 2, 128, 16, {33, 257, 64}});
    shapes.push_back({t, 16, 2, 256, 128, {127, 129, 300}});
    shapes.push_back({t, 16, 1, 64, 16, {200, 5}});
    shapes.push_back({t, 6, 3, 80, 16, {47, 48, 49}});
    shapes.push_back({t, 12, 4, 32, 32, {50, 7, 90}});
    shapes.push_back({t, 2, 2, 8, 16, {3, 40}});
  }
  int failures = 0, checked = 0;
  for (const Shape& s : shapes) {
    Case k = Make(s, rng);
    const int seqs = static_cast<int>(s.contexts.size());
    for (int variant = 0; variant < 7; ++variant) {
      PrefillCase pc;
      for (int n : s.contexts) {
        // Chunks that start at every kind of position of a block: one
        // query, bl - 1, bl, bl + 1, the whole prompt.
        const int want = std::vector<int>{1, s.bl - 1, s.bl, s.bl + 1, n, n, 1}[variant];
        pc.query_lens.push_back(std::clamp(want, 1, n));
        pc.windows.push_back(variant == 5 ? std::max(1, n / 3) : variant == 6 ? 7 : 0);
      }
      pc.softcap = variant == 4 ? 2.0f : 0.0f;
      pc.partial = variant == 3 || variant == 6;
      std::vector<int32_t> tables = k.tables;
      if (pc.partial) {
        for (size_t i = 0; i < tables.size(); ++i) {
          if (i % 3 == 1) tables[i] = -1;
        }
      }
      int rows = 0, longest = 0;
      std::vector<int32_t> starts, lens(s.contexts.begin(), s.contexts.end());
      for (int ql : pc.query_lens) {
        starts.push_back(rows);
        rows += ql;
        longest = std::max(longest, ql);
      }
      k.q.resize(static_cast<size_t>(rows) * s.q_heads * s.d);
      std::uniform_real_distribution<float> u(-2.0f, 2.0f);
      for (float& x : k.q) x = u(rng);
      std::vector<double> ref, ref_lse;
      PrefillReference(k, pc, tables, ref, ref_lse);
      Device dev;
      Case up = k;
      up.tables = tables;
      Upload(up, dev);
      int32_t *qlens = nullptr, *qstarts = nullptr, *wins = nullptr;
      float* lse = nullptr;
      CHECK_CUDA(cudaMalloc(&qlens, seqs * 4));
      CHECK_CUDA(cudaMalloc(&qstarts, seqs * 4));
      CHECK_CUDA(cudaMalloc(&wins, seqs * 4));
      CHECK_CUDA(cudaMalloc(&lse, ref_lse.size() * 4));
      CHECK_CUDA(cudaMemcpy(qlens, pc.query_lens.data(), seqs * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(qstarts, starts.data(), seqs * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(wins, pc.windows.data(), seqs * 4, cudaMemcpyHostToDevice));
      pagekv::cuda::PrefillParams p;
      const DecodeParams dp = Params(up, dev);
      p.type = dp.type;
      p.num_seqs = seqs;
      p.q_heads = s.q_heads;
      p.kv_heads = s.kv_heads;
      p.head_dim = s.d;
      p.block_len = s.bl;
      p.k_plane = dp.k_plane;
      p.v_plane = dp.v_plane;
      p.head_stride = dp.head_stride;
      p.slab_stride = dp.slab_stride;
      p.row_bytes = dp.row_bytes;
      p.block_tables = dev.tables;
      p.max_blocks = k.max_blocks;
      p.context_lens = dev.lens;
      p.query_lens = qlens;
      p.query_starts = qstarts;
      p.windows = wins;
      p.max_query_len = longest;
      p.q = dev.q;
      p.out = dev.out;
      p.lse = lse;
      p.softcap = pc.softcap;
      // The CUDA-core kernel, then (f16 / bf16, head_dim a multiple of 16 up
      // to 128) the tensor-core one, on the same inputs.
      for (int tc = 0; tc < 2; ++tc) {
        p.tensor_cores = tc == 1;
        if (p.tensor_cores && !pagekv::cuda::TensorCorePrefillShape(p)) break;
        CHECK_CUDA(cudaMemset(dev.out, 0xff, k.q.size() * 4));  // NaN everywhere
        CHECK_CUDA(cudaMemset(lse, 0xff, ref_lse.size() * 4));
        CHECK_CUDA(pagekv::cuda::PagedPrefillAttention(p, nullptr));
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<float> got(k.q.size()), got_lse(ref_lse.size());
        CHECK_CUDA(cudaMemcpy(got.data(), dev.out, got.size() * 4, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(got_lse.data(), lse, got_lse.size() * 4, cudaMemcpyDeviceToHost));
        double worst = 0, worst_lse = 0;
        for (size_t row = 0; row < got.size() / s.d; ++row) {
          double big = 1e-30;
          for (int j = 0; j < s.d; ++j) big = std::max(big, std::fabs(ref[row * s.d + j]));
          for (int j = 0; j < s.d; ++j) {
            const double g = got[row * s.d + j], r = ref[row * s.d + j];
            const double e = std::isnan(g) ? INFINITY : big > 1e-29 ? std::fabs(g - r) / big : std::fabs(g);
            worst = std::max(worst, e);
          }
          const double gl = got_lse[row], rl = ref_lse[row];
          const double el = std::isinf(rl) ? (std::isinf(gl) && gl < 0 ? 0.0 : INFINITY)
                                           : std::isnan(gl) ? INFINITY : std::fabs(gl - rl) / std::max(1.0, std::fabs(rl));
          worst_lse = std::max(worst_lse, el);
        }
        ++checked;
        if (!(worst <= 2e-5) || !(worst_lse <= 1e-5)) {
          ++failures;
          std::printf("FAIL prefill (%s) %s q/kv %d/%d d %d bl %d variant %d: max row-relative error %.3g, lse %.3g\n",
                      tc ? "tensor cores" : "CUDA cores", Name(s.type), s.q_heads, s.kv_heads, s.d, s.bl, variant, worst,
                      worst_lse);
        }
      }
      cudaFree(qlens);
      cudaFree(qstarts);
      cudaFree(wins);
      cudaFree(lse);
    }
  }
  {
    pagekv::cuda::PrefillParams p;
    if (pagekv::cuda::PagedPrefillAttention(p, nullptr) != cudaErrorInvalidValue) {
      ++failures;
      std::printf("FAIL: an empty prefill shape was not refused\n");
    }
    cudaGetLastError();
  }
  std::printf("prefill: %d of %d checks passed\n", checked - failures, checked);
  return failures == 0 ? 0 : 1;
}

// --- Benchmark ---------------------------------------------------------------

__global__ void ReadKernel(const float4* p, int64_t n, float* sink) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = p[i];
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 12345.678f) *sink = acc;  // keeps the loads
}

double ReadBandwidth() {
  const int64_t bytes = int64_t{4} << 30;
  float4* buf = nullptr;
  float* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, bytes));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMemset(buf, 0, bytes));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  double best = 0;
  for (int rep = 0; rep < 6; ++rep) {
    cudaEventRecord(a);
    ReadKernel<<<sms * 8, 512>>>(buf, bytes / 16, sink);
    cudaEventRecord(b);
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (rep > 0) best = std::max(best, bytes / (ms * 1e6));
  }
  cudaFree(buf);
  cudaFree(sink);
  return best;
}

// The dense bf16 matrix product rate (cuBLAS, f32 accumulation, n^3 with
// n = 8192 on random data): what prefill on the tensor cores is judged by.
double DenseBf16Tflops() {
  const int n = 8192;
  __nv_bfloat16 *a = nullptr, *b = nullptr;
  float* c = nullptr;
  CHECK_CUDA(cudaMalloc(&a, size_t{2} * n * n));
  CHECK_CUDA(cudaMalloc(&b, size_t{2} * n * n));
  CHECK_CUDA(cudaMalloc(&c, size_t{4} * n * n));
  std::vector<__nv_bfloat16> host(size_t{n} * n);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : host) x = __float2bfloat16_rn(u(rng));
  CHECK_CUDA(cudaMemcpy(a, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 0;
  const float one = 1.0f, zero = 0.0f;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> rates;
  for (int rep = 0; rep < 8; ++rep) {
    cudaEventRecord(e0);
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &zero, c, CUDA_R_32F, n,
                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(e1);
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (rep >= 3) rates.push_back(2.0 * n * n * static_cast<double>(n) / (ms * 1e-3) / 1e12);
  }
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// Prefill chunks of 2048 queries (a whole 2048-token prompt, and a chunk
// after a 2048-token prefix) through both kernels, in useful TFLOP/s (4 *
// head_dim per query head and cached position it sees) and as a share of
// the dense bf16 product rate.
int RunPrefillBench() {
  const double dense = DenseBf16Tflops();
  std::printf("\nprefill, head_dim 128, block_len 16; dense bf16 product (cuBLAS): %.0f TFLOP/s\n", dense);
  std::printf("%6s %6s %6s %5s %-13s %10s %8s %8s\n", "ctx", "chunk", "q/kv", "dtype", "kernel", "ms", "TFLOP/s", "of dense");
  const int d = 128, bl = 16;
  for (KvType t : {KvType::kBF16, KvType::kF16}) {
    for (auto [q, kv] : {std::pair{32, 8}, std::pair{32, 32}}) {
      for (auto [ctx, chunk] : {std::pair{2048, 2048}, std::pair{4096, 2048}}) {
        const int blocks = (ctx + bl - 1) / bl;
        const int64_t row_bytes = RowBytesNeeded(t, d), slab = bl * row_bytes;
        const int64_t head_stride = blocks * slab, plane = kv * head_stride;
        void* arena = nullptr;
        CHECK_CUDA(cudaMalloc(&arena, 2 * plane));
        std::vector<unsigned char> host(static_cast<size_t>(2 * plane));
        std::mt19937 rng(5);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (size_t i = 0; i + 1 < host.size(); i += 2) Store(t, u(rng), host.data() + i);
        CHECK_CUDA(cudaMemcpy(arena, host.data(), host.size(), cudaMemcpyHostToDevice));
        std::vector<int32_t> table(static_cast<size_t>(blocks));
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng);
        int32_t *d_table = nullptr, *d_len = nullptr, *d_ql = nullptr, *d_start = nullptr;
        float *d_q = nullptr, *d_out = nullptr;
        const int32_t len = ctx, ql = chunk, start = 0;
        CHECK_CUDA(cudaMalloc(&d_table, table.size() * 4));
        CHECK_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMalloc(&d_len, 4));
        CHECK_CUDA(cudaMemcpy(d_len, &len, 4, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMalloc(&d_ql, 4));
        CHECK_CUDA(cudaMemcpy(d_ql, &ql, 4, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMalloc(&d_start, 4));
        CHECK_CUDA(cudaMemcpy(d_start, &start, 4, cudaMemcpyHostToDevice));
        std::vector<float> qh(static_cast<size_t>(chunk) * q * d);
        for (float& x : qh) x = u(rng);
        CHECK_CUDA(cudaMalloc(&d_q, qh.size() * 4));
        CHECK_CUDA(cudaMemcpy(d_q, qh.data(), qh.size() * 4, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMalloc(&d_out, qh.size() * 4));
        pagekv::cuda::PrefillParams p;
        p.type = t;
        p.num_seqs = 1;
        p.q_heads = q;
        p.kv_heads = kv;
        p.head_dim = d;
        p.block_len = bl;
        p.k_plane = arena;
        p.v_plane = static_cast<char*>(arena) + plane;
        p.head_stride = head_stride;
        p.slab_stride = slab;
        p.row_bytes = row_bytes;
        p.block_tables = d_table;
        p.max_blocks = blocks;
        p.context_lens = d_len;
        p.query_lens = d_ql;
        p.query_starts = d_start;
        p.max_query_len = chunk;
        p.q = d_q;
        p.out = d_out;
        // Keys seen: query j of the chunk at position ctx - chunk + j sees that many + 1.
        double seen = 0;
        for (int j = 0; j < chunk; ++j) seen += ctx - chunk + j + 1;
        const double flops = 4.0 * d * q * seen;
        for (const bool tc : {false, true}) {
          p.tensor_cores = tc;
          cudaEvent_t e0, e1;
          cudaEventCreate(&e0);
          cudaEventCreate(&e1);
          std::vector<double> ms_all;
          for (int rep = 0; rep < 6; ++rep) {
            cudaEventRecord(e0);
            CHECK_CUDA(pagekv::cuda::PagedPrefillAttention(p, nullptr));
            cudaEventRecord(e1);
            CHECK_CUDA(cudaEventSynchronize(e1));
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            if (rep > 0) ms_all.push_back(ms);
          }
          std::sort(ms_all.begin(), ms_all.end());
          const double ms = ms_all[ms_all.size() / 2], tflops = flops / (ms * 1e-3) / 1e12;
          std::printf("%6d %6d %3d/%-2d %5s %-13s %10.3f %8.1f %8.3f\n", ctx, chunk, q, kv, Name(t),
                      tc ? "tensor cores" : "CUDA cores", ms, tflops, dense > 0 ? tflops / dense : 0.0);
          std::printf("JSON {\"prefill\":true,\"ctx\":%d,\"chunk\":%d,\"q_heads\":%d,\"kv_heads\":%d,\"dtype\":\"%s\","
                      "\"kernel\":\"%s\",\"ms\":%.4f,\"tflops\":%.2f,\"dense_tflops\":%.1f}\n",
                      ctx, chunk, q, kv, Name(t), tc ? "tensor_cores" : "cuda_cores", ms, tflops, dense);
        }
        cudaFree(arena);
        cudaFree(d_table);
        cudaFree(d_len);
        cudaFree(d_ql);
        cudaFree(d_start);
        cudaFree(d_q);
        cudaFree(d_out);
      }
    }
  }
  return 0;
}

int RunBench() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double bw = ReadBandwidth();
  std::printf("device: %s, %d SMs; streaming read %.0f GB/s\n", prop.name, prop.multiProcessorCount, bw);
  std::printf("%5s %6s %6s %5s %5s %-12s %10s %8s %7s\n", "batch", "ctx", "q/kv", "block", "dtype", "kernel", "us/call", "GB/s",
              "of read");
  std::mt19937 rng(11);
  struct B {
    int batch, ctx, q, kv, bl;
    KvType t;
    bool tc;  // the tensor-core kernel
  };
  std::vector<B> rows;
  for (KvType t : {KvType::kF16, KvType::kBF16, KvType::kInt8})
    for (int bl : {16, 128})
      for (auto [q, kv] : {std::pair{32, 32}, std::pair{32, 8}, std::pair{64, 8}})
        for (auto [batch, ctx] : {std::pair{8, 4096}, std::pair{32, 4096}, std::pair{8, 16384}})
          for (bool tc : {false, true})
            if (!tc || t != KvType::kInt8) rows.push_back({batch, ctx, q, kv, bl, t, tc});
  for (const B& r : rows) {
    // The cache: a shuffled pool of exactly the blocks the batch holds; values are
    // not checked here, so the bytes are left as cudaMalloc gives them (zeroed).
    const int d = 128;
    const int blocks_per_seq = (r.ctx + r.bl - 1) / r.bl;
    const int num_blocks = r.batch * blocks_per_seq;
    const int64_t row_bytes = RowBytesNeeded(r.t, d), slab = ((int64_t)r.bl * row_bytes + 63) / 64 * 64;
    const int64_t head_stride = num_blocks * slab, plane = r.kv * head_stride;
    Device dev;
    CHECK_CUDA(cudaMalloc(&dev.arena, 2 * plane));
    CHECK_CUDA(cudaMemset(dev.arena, 0, 2 * plane));
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    CHECK_CUDA(cudaMalloc(&dev.tables, ids.size() * 4));
    CHECK_CUDA(cudaMemcpy(dev.tables, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(r.batch, r.ctx);
    CHECK_CUDA(cudaMalloc(&dev.lens, lens.size() * 4));
    CHECK_CUDA(cudaMemcpy(dev.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    const size_t qn = static_cast<size_t>(r.batch) * r.q * d;
    CHECK_CUDA(cudaMalloc(&dev.q, qn * 4));
    CHECK_CUDA(cudaMemset(dev.q, 0, qn * 4));
    CHECK_CUDA(cudaMalloc(&dev.out, qn * 4));
    DecodeParams p;
    p.type = r.t;
    p.num_seqs = r.batch;
    p.q_heads = r.q;
    p.kv_heads = r.kv;
    p.head_dim = d;
    p.block_len = r.bl;
    p.k_plane = dev.arena;
    p.v_plane = static_cast<char*>(dev.arena) + plane;
    p.head_stride = head_stride;
    p.slab_stride = slab;
    p.row_bytes = row_bytes;
    p.block_tables = dev.tables;
    p.max_blocks = blocks_per_seq;
    p.context_lens = dev.lens;
    p.q = dev.q;
    p.out = dev.out;
    p.tensor_cores = r.tc;
    const char* kernel = r.tc ? "tensor_cores" : "cuda_cores";
    // The chosen splits, and twice as many (what more parallelism buys).
    const int chosen = pagekv::cuda::Splits(p, r.ctx, prop.multiProcessorCount);
    double us = 0, gbps = 0;
    int splits = chosen;
    double first = 0;
    for (int variant = 0; variant < 2; ++variant) {
      const int s = variant == 0 ? chosen : std::min(2 * chosen, blocks_per_seq);
      DecodeParams pv = p;
      pv.blocks_per_split = (blocks_per_seq + s - 1) / s;
      const int used = (blocks_per_seq + pv.blocks_per_split - 1) / pv.blocks_per_split;
      cudaFree(dev.scratch);
      CHECK_CUDA(cudaMalloc(&dev.scratch, pagekv::cuda::ScratchBytes(pv, used)));
      pv.scratch = dev.scratch;
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      CHECK_CUDA(pagekv::cuda::PagedDecodeAttention(pv, used, nullptr));
      CHECK_CUDA(cudaDeviceSynchronize());
      const int iters = 20;
      cudaEventRecord(a);
      for (int i = 0; i < iters; ++i) pagekv::cuda::PagedDecodeAttention(pv, used, nullptr);
      cudaEventRecord(b);
      CHECK_CUDA(cudaEventSynchronize(b));
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      const double u = 1e3 * ms / iters;
      const double g = 2.0 * r.batch * r.ctx * r.kv * row_bytes / (u * 1e3);
      if (variant == 0) first = g;
      if (variant == 0 || g > gbps) {
        us = u;
        gbps = g;
        splits = used;
      }
      if (variant == 1) std::printf("      (splits %d: %.0f GB/s; splits %d: %.0f GB/s)\n", chosen, first, used, g);
    }
    std::printf("%5d %6d %3d/%-2d %5d %5s %-12s %10.1f %8.0f %7.2f   (splits %d)\n", r.batch, r.ctx, r.q, r.kv, r.bl, Name(r.t),
                kernel, us, gbps, gbps / bw, splits);
    std::printf("JSON {\"batch\":%d,\"ctx\":%d,\"q_heads\":%d,\"kv_heads\":%d,\"block_len\":%d,\"dtype\":\"%s\",\"kernel\":\"%s\","
                "\"us\":%.2f,\"gbps\":%.1f,\"read_gbps\":%.1f,\"ratio\":%.3f}\n",
                r.batch, r.ctx, r.q, r.kv, r.bl, Name(r.t), kernel, us, gbps, bw, gbps / bw);
  }
  return RunPrefillBench();
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device here: the GPU kernel tests are skipped (they run on a machine with an NVIDIA GPU)\n");
    return 77;
  }
  const bool bench = argc > 1 && std::string(argv[1]) == "--bench";
  if (bench) return RunBench();
  const int decode = RunTests();
  const int prefill = RunPrefillTests();
  return decode != 0 || prefill != 0 ? 1 : 0;
}
