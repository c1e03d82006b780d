// The GPU's KV writes and block copies against the host's: StoreKv must
// leave the arena byte for byte as the host encoders (layout/quantize.cc,
// layout/float16.h: the normative ones) would, touching nothing but the
// slots it was given; CopyBlocks as a host memcpy of the same slabs; and
// rows written by StoreKv read back through the decode attention as the
// host decoders read them. Needs the CUDA toolkit and the layout module's
// plain C++ encoders only; exits 77 (skipped) where no GPU is present.
//
// Cases: every KV type; head_dim 8, 64, 80, 128 and an odd 7 (the 8-bit
// rows' scale then sits at an odd address); rows with an outlier, all-zero
// rows, rows so small the f16 scale is subnormal, rows whose largest value
// overflows the 8-bit grid's top code; shuffled slots with padding (-1) and
// slots past the arena (counted, not written); block copies between
// shuffled blocks of several planes, with out-of-range pairs counted.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/kv_store.h"
#include "cuda/paged_attention.h"
#include "layout/float16.h"
#include "layout/quantize.h"

namespace {

using namespace pagekv::cuda;

#define CHECK_CUDA(x)                                                                           \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));  \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

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

// The host's encoding of one row.
void HostEncode(KvType t, const float* x, int d, unsigned char* row) {
  auto* b = reinterpret_cast<std::byte*>(row);
  switch (t) {
    case KvType::kF32:
      std::memcpy(row, x, static_cast<size_t>(d) * 4);
      return;
    case KvType::kF16:
      for (int j = 0; j < d; ++j) {
        const uint16_t h = pagekv::F32ToF16(x[j]);
        std::memcpy(row + 2 * j, &h, 2);
      }
      return;
    case KvType::kBF16:
      for (int j = 0; j < d; ++j) {
        const uint16_t h = pagekv::F32ToBF16(x[j]);
        std::memcpy(row + 2 * j, &h, 2);
      }
      return;
    case KvType::kInt8:
      pagekv::quant::EncodeInt8Row(x, d, b);
      return;
    case KvType::kFp8E4M3:
    case KvType::kFp8E5M2:
      pagekv::quant::EncodeFp8Row(x, d, t == KvType::kFp8E4M3, b);
      return;
  }
}

// What the host reads back from a row.
void HostDecode(KvType t, const unsigned char* row, int d, float* x) {
  const auto* b = reinterpret_cast<const std::byte*>(row);
  for (int j = 0; j < d && !ScaledRows(t); ++j) {
    uint16_t h = 0;
    if (t == KvType::kF32) {
      std::memcpy(&x[j], row + 4 * j, 4);
      continue;
    }
    std::memcpy(&h, row + 2 * j, 2);
    x[j] = t == KvType::kF16 ? pagekv::F16ToF32(h) : pagekv::BF16ToF32(h);
  }
  if (t == KvType::kInt8) pagekv::quant::DecodeInt8Row(b, d, x);
  if (t == KvType::kFp8E4M3 || t == KvType::kFp8E5M2) pagekv::quant::DecodeFp8Row(b, d, t == KvType::kFp8E4M3, x);
}

// A row of test values of one of several kinds.
void FillRow(std::mt19937& rng, int kind, int d, float* x) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int j = 0; j < d; ++j) x[j] = u(rng);
  switch (kind % 5) {
    case 1:
      x[rng() % d] = 40.0f * (rng() % 2 ? 1.0f : -1.0f);  // an outlier channel
      break;
    case 2:
      for (int j = 0; j < d; ++j) x[j] = 0.0f;  // all zero: scale 0
      break;
    case 3:
      for (int j = 0; j < d; ++j) x[j] *= 1e-6f;  // the 8-bit scale is a subnormal f16
      break;
    case 4:
      for (int j = 0; j < d; ++j) x[j] = std::nearbyint(x[j] * 127.0f) * 0.01f;  // values on a grid, ties
      break;
    default:
      break;
  }
}

struct Geometry {
  KvType type;
  int kv_heads, d, bl, num_blocks;
  int64_t row_bytes, slab_stride, head_stride, plane_bytes;
};

Geometry MakeGeometry(KvType t, int kv_heads, int d, int bl, int num_blocks) {
  Geometry g{t, kv_heads, d, bl, num_blocks, 0, 0, 0, 0};
  g.row_bytes = RowBytesNeeded(t, d);
  if (!ScaledRows(t)) g.row_bytes = (g.row_bytes + 15) / 16 * 16;
  g.slab_stride = (bl * g.row_bytes + 63) / 64 * 64;
  g.head_stride = g.num_blocks * g.slab_stride;
  g.plane_bytes = kv_heads * g.head_stride;
  return g;
}

int failures = 0, checked = 0;

void Expect(bool ok, const std::string& what) {
  ++checked;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// Stores `tokens` rows by a shuffled slot mapping (with padding and slots
// past the arena), compares the whole arena with the host's, then reads the
// rows back through the decode attention (one sequence over the slots
// written, in order) against a double reference of the host-decoded rows.
void StoreCase(std::mt19937& rng, KvType t, int kv_heads, int d, int bl, int tokens) {
  const Geometry g = MakeGeometry(t, kv_heads, d, bl, (tokens + bl - 1) / bl + 3);
  const std::string tag = std::string(Name(t)) + " kv " + std::to_string(kv_heads) + " d " + std::to_string(d) + " bl " +
                          std::to_string(bl) + " tokens " + std::to_string(tokens);
  std::vector<unsigned char> host(static_cast<size_t>(2 * g.plane_bytes), 0xA5);
  // Slots: blocks drawn from a shuffled pool, in order within a block.
  std::vector<int32_t> pool(static_cast<size_t>(g.num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  const int used_blocks = (tokens + bl - 1) / bl;
  std::vector<int64_t> slots;
  int pos = 0;
  for (int i = 0; i < tokens; ++i) {
    slots.push_back(static_cast<int64_t>(pool[static_cast<size_t>(pos / bl)]) * bl + pos % bl);
    ++pos;
    if (i % 7 == 3) slots.push_back(-1);  // padding between real tokens
  }
  slots.push_back(static_cast<int64_t>(g.num_blocks) * bl);  // one past the arena
  slots.push_back(static_cast<int64_t>(g.num_blocks) * bl + 12345);
  const int n = static_cast<int>(slots.size());
  std::vector<float> k(static_cast<size_t>(n) * kv_heads * d), v(k.size());
  for (int i = 0; i < n * kv_heads; ++i) {
    FillRow(rng, i, d, k.data() + static_cast<size_t>(i) * d);
    FillRow(rng, i + 2, d, v.data() + static_cast<size_t>(i) * d);
  }
  for (int i = 0; i < n; ++i) {
    const int64_t slot = slots[static_cast<size_t>(i)];
    if (slot < 0 || slot >= static_cast<int64_t>(g.num_blocks) * bl) continue;
    for (int h = 0; h < kv_heads; ++h) {
      const int64_t off = h * g.head_stride + (slot / bl) * g.slab_stride + (slot % bl) * g.row_bytes;
      const size_t src = (static_cast<size_t>(i) * kv_heads + h) * d;
      HostEncode(t, k.data() + src, d, host.data() + off);
      HostEncode(t, v.data() + src, d, host.data() + g.plane_bytes + off);
    }
  }
  void* arena = nullptr;
  int64_t* dslots = nullptr;
  float *dk = nullptr, *dv = nullptr;
  int32_t* bad = nullptr;
  CHECK_CUDA(cudaMalloc(&arena, host.size()));
  CHECK_CUDA(cudaMemset(arena, 0xA5, host.size()));
  CHECK_CUDA(cudaMalloc(&dslots, slots.size() * 8));
  CHECK_CUDA(cudaMemcpy(dslots, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dk, k.size() * 4));
  CHECK_CUDA(cudaMalloc(&dv, v.size() * 4));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), k.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&bad, 4));
  CHECK_CUDA(cudaMemset(bad, 0, 4));
  StoreParams p;
  p.type = t;
  p.num_tokens = n;
  p.kv_heads = kv_heads;
  p.head_dim = d;
  p.block_len = bl;
  p.num_blocks = g.num_blocks;
  p.k_plane = arena;
  p.v_plane = static_cast<char*>(arena) + g.plane_bytes;
  p.head_stride = g.head_stride;
  p.slab_stride = g.slab_stride;
  p.row_bytes = g.row_bytes;
  p.slots = dslots;
  p.k = dk;
  p.v = dv;
  p.bad_slots = bad;
  CHECK_CUDA(StoreKv(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> got(host.size());
  CHECK_CUDA(cudaMemcpy(got.data(), arena, got.size(), cudaMemcpyDeviceToHost));
  int32_t bad_count = 0;
  CHECK_CUDA(cudaMemcpy(&bad_count, bad, 4, cudaMemcpyDeviceToHost));
  size_t first_diff = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != host[i]) {
      first_diff = i;
      break;
    }
  }
  Expect(first_diff == got.size(), "store " + tag + ": arena differs from the host encoder's at byte " + std::to_string(first_diff));
  Expect(bad_count == 2 * kv_heads, "store " + tag + ": slots past the arena counted " + std::to_string(bad_count) +
                                        ", want " + std::to_string(2 * kv_heads));

  // The rows read back through the decode attention (one sequence, G = 2).
  const int seq_len = pos, G = 2, q_heads = kv_heads * G;
  if (d % 8 == 0 && d <= 256 && (ScaledRows(t) || g.row_bytes % 16 == 0)) {
    std::vector<int32_t> table(pool.begin(), pool.begin() + used_blocks);
    std::vector<float> q(static_cast<size_t>(q_heads) * d);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : q) x = u(rng);
    std::vector<float> krow(d), vrow(d);
    std::vector<double> ref(q.size(), 0.0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (int qh = 0; qh < q_heads; ++qh) {
      const int h = qh / G;
      std::vector<double> s(static_cast<size_t>(seq_len));
      double m = -INFINITY, l = 0;
      for (int tok = 0; tok < seq_len; ++tok) {
        const int64_t off = h * g.head_stride + static_cast<int64_t>(table[static_cast<size_t>(tok / bl)]) * g.slab_stride +
                            (tok % bl) * g.row_bytes;
        HostDecode(t, host.data() + off, d, krow.data());
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += static_cast<double>(q[static_cast<size_t>(qh) * d + j]) * krow[static_cast<size_t>(j)];
        s[static_cast<size_t>(tok)] = dot * scale;
        m = std::max(m, s[static_cast<size_t>(tok)]);
      }
      for (double& x : s) l += (x = std::exp(x - m));
      for (int tok = 0; tok < seq_len; ++tok) {
        const int64_t off = h * g.head_stride + static_cast<int64_t>(table[static_cast<size_t>(tok / bl)]) * g.slab_stride +
                            (tok % bl) * g.row_bytes;
        HostDecode(t, host.data() + g.plane_bytes + off, d, vrow.data());
        for (int j = 0; j < d; ++j) ref[static_cast<size_t>(qh) * d + j] += s[static_cast<size_t>(tok)] / l * vrow[static_cast<size_t>(j)];
      }
    }
    int32_t *dtable = nullptr, *dlen = nullptr;
    float *dq = nullptr, *dout = nullptr;
    CHECK_CUDA(cudaMalloc(&dtable, table.size() * 4));
    CHECK_CUDA(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&dlen, 4));
    CHECK_CUDA(cudaMemcpy(dlen, &seq_len, 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&dq, q.size() * 4));
    CHECK_CUDA(cudaMemcpy(dq, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&dout, q.size() * 4));
    CHECK_CUDA(cudaMemset(dout, 0xff, q.size() * 4));
    DecodeParams a;
    a.type = t;
    a.num_seqs = 1;
    a.q_heads = q_heads;
    a.kv_heads = kv_heads;
    a.head_dim = d;
    a.block_len = bl;
    a.k_plane = arena;
    a.v_plane = static_cast<char*>(arena) + g.plane_bytes;
    a.head_stride = g.head_stride;
    a.slab_stride = g.slab_stride;
    a.row_bytes = g.row_bytes;
    a.block_tables = dtable;
    a.max_blocks = used_blocks;
    a.context_lens = dlen;
    a.q = dq;
    a.out = dout;
    CHECK_CUDA(PagedDecodeAttention(a, 1, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> out(q.size());
    CHECK_CUDA(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int row = 0; row < q_heads; ++row) {
      double big = 1e-30;
      for (int j = 0; j < d; ++j) big = std::max(big, std::fabs(ref[static_cast<size_t>(row) * d + j]));
      for (int j = 0; j < d; ++j) {
        const double o = out[static_cast<size_t>(row) * d + j];
        worst = std::max(worst, std::isnan(o) ? INFINITY : std::fabs(o - ref[static_cast<size_t>(row) * d + j]) / big);
      }
    }
    Expect(worst <= 2e-5, "stored rows through the decode attention " + tag + ": row-relative error " + std::to_string(worst));
    cudaFree(dtable);
    cudaFree(dlen);
    cudaFree(dq);
    cudaFree(dout);
  }
  cudaFree(arena);
  cudaFree(dslots);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(bad);
}

// Block copies over several planes against the host's memcpy of the same slabs.
void CopyCase(std::mt19937& rng, KvType t, int kv_heads, int d, int bl, int planes) {
  const Geometry g = MakeGeometry(t, kv_heads, d, bl, 24);
  const std::string tag = std::string(Name(t)) + " kv " + std::to_string(kv_heads) + " d " + std::to_string(d) + " bl " +
                          std::to_string(bl) + " planes " + std::to_string(planes);
  std::vector<unsigned char> host(static_cast<size_t>(planes * g.plane_bytes));
  for (auto& b : host) b = static_cast<unsigned char>(rng());
  std::vector<int32_t> ids(static_cast<size_t>(g.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  // Sources from the first half of the shuffle, destinations from the second:
  // no destination is also a source. Plus a copy onto itself and two out of range.
  std::vector<BlockCopy> pairs;
  for (int i = 0; i < 8; ++i) pairs.push_back({ids[static_cast<size_t>(i)], ids[static_cast<size_t>(12 + i)]});
  pairs.push_back({ids[0], ids[0]});
  pairs.push_back({ids[1], g.num_blocks});
  pairs.push_back({-1, ids[20]});
  const int64_t slab_bytes = static_cast<int64_t>(bl) * g.row_bytes;
  std::vector<unsigned char> want = host;
  for (const BlockCopy& pc : pairs) {
    if (pc.src < 0 || pc.dst < 0 || pc.src >= g.num_blocks || pc.dst >= g.num_blocks) continue;
    for (int pl = 0; pl < planes; ++pl)
      for (int h = 0; h < kv_heads; ++h) {
        const int64_t base = pl * g.plane_bytes + h * g.head_stride;
        std::memcpy(want.data() + base + pc.dst * g.slab_stride, host.data() + base + pc.src * g.slab_stride,
                    static_cast<size_t>(slab_bytes));
      }
  }
  void* arena = nullptr;
  void** dplanes = nullptr;
  BlockCopy* dpairs = nullptr;
  int32_t* bad = nullptr;
  CHECK_CUDA(cudaMalloc(&arena, host.size()));
  CHECK_CUDA(cudaMemcpy(arena, host.data(), host.size(), cudaMemcpyHostToDevice));
  std::vector<void*> bases;
  for (int pl = 0; pl < planes; ++pl) bases.push_back(static_cast<char*>(arena) + pl * g.plane_bytes);
  CHECK_CUDA(cudaMalloc(&dplanes, bases.size() * sizeof(void*)));
  CHECK_CUDA(cudaMemcpy(dplanes, bases.data(), bases.size() * sizeof(void*), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&dpairs, pairs.size() * sizeof(BlockCopy)));
  CHECK_CUDA(cudaMemcpy(dpairs, pairs.data(), pairs.size() * sizeof(BlockCopy), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&bad, 4));
  CHECK_CUDA(cudaMemset(bad, 0, 4));
  CopyParams c;
  c.planes = dplanes;
  c.num_planes = planes;
  c.kv_heads = kv_heads;
  c.head_stride = g.head_stride;
  c.slab_stride = g.slab_stride;
  c.slab_bytes = slab_bytes;
  c.num_blocks = g.num_blocks;
  c.pairs = dpairs;
  c.num_pairs = static_cast<int32_t>(pairs.size());
  c.bad_pairs = bad;
  CHECK_CUDA(CopyBlocks(c, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> got(host.size());
  CHECK_CUDA(cudaMemcpy(got.data(), arena, got.size(), cudaMemcpyDeviceToHost));
  int32_t bad_count = 0;
  CHECK_CUDA(cudaMemcpy(&bad_count, bad, 4, cudaMemcpyDeviceToHost));
  Expect(got == want, "copy " + tag + ": arena differs from the host's copy");
  Expect(bad_count == 2, "copy " + tag + ": out-of-range pairs counted " + std::to_string(bad_count) + ", want 2");
  cudaFree(arena);
  cudaFree(dplanes);
  cudaFree(dpairs);
  cudaFree(bad);
}

void Refusals() {
  StoreParams p;
  Expect(StoreKv(p, nullptr) == cudaErrorInvalidValue, "an empty store shape is refused");
  p.kv_heads = 1;
  p.head_dim = 128;
  p.block_len = 16;
  p.num_blocks = 4;
  p.type = KvType::kInt8;
  p.row_bytes = 128;  // int8 rows need head_dim + 2
  p.slab_stride = 16 * 130;
  p.head_stride = 4 * p.slab_stride;
  Expect(StoreKv(p, nullptr) == cudaErrorInvalidValue, "int8 rows without room for the scale are refused");
  cudaGetLastError();
  CopyParams c;
  Expect(CopyBlocks(c, nullptr) == cudaErrorInvalidValue, "an empty copy shape is refused");
  cudaGetLastError();
}

int RunTests() {
  std::mt19937 rng(23);
  for (KvType t : {KvType::kF32, KvType::kF16, KvType::kBF16, KvType::kInt8, KvType::kFp8E4M3, KvType::kFp8E5M2}) {
    StoreCase(rng, t, 1, 8, 16, 37);
    StoreCase(rng, t, 2, 64, 16, 100);
    StoreCase(rng, t, 4, 128, 32, 70);
    StoreCase(rng, t, 2, 80, 128, 300);
    StoreCase(rng, t, 3, 128, 128, 129);
    if (ScaledRows(t)) StoreCase(rng, t, 2, 7, 16, 40);  // odd head_dim: the scale at an odd address
    CopyCase(rng, t, 2, 64, 16, 4);
    CopyCase(rng, t, 1, 7 + (ScaledRows(t) ? 0 : 1), 16, 2);
  }
  Refusals();
  std::printf("%d of %d checks passed\n", checked - failures, checked);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device here: the GPU KV store tests are skipped (they run on a machine with an NVIDIA GPU)\n");
    return 77;
  }
  return RunTests();
}
