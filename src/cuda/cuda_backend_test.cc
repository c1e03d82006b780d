// The CUDA backend against the CPU backend, call for call, on the same
// inputs: block transfers and copies on write byte for byte, K / V encoding
// bit for bit, the layer ops and weight products within f32 rounding (and a
// double-precision product), decode and prefill attention over shuffled
// tables, contexts around block boundaries, G = 1..8, windows, soft-capping,
// partial tables and chunked prefill at every position of a block. Outputs
// are poisoned with NaN first. Without a GPU every test that needs one is
// skipped with the reason (never passed); the refusal to start without one
// is checked everywhere.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/weight_formats.h"
#include "layout/float16.h"

namespace pagekv {
namespace {

TEST(CudaBackendStartTest, WithoutADeviceItSaysSoAndNamesTheFix) {
  std::string why;
  if (CudaDeviceAvailable(&why)) GTEST_SKIP() << "a CUDA device is present: the no-device refusal cannot be seen here";
  auto be = CudaBackend::Create();
  ASSERT_FALSE(be.ok());
  EXPECT_EQ(be.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(be.status().message().find("--device cpu"), std::string::npos) << be.status().message();
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) {
      GTEST_SKIP() << "no CUDA device here (" << why << "): the CUDA backend's tests run on a machine with an NVIDIA GPU";
    }
    auto be = CudaBackend::Create();
    ASSERT_TRUE(be.ok()) << be.status().message();
    gpu_ = std::move(*be);
  }
  void TearDown() override {
    if (gpu_ != nullptr) {
      for (float* p : owned_) gpu_->Free(p);
      EXPECT_TRUE(gpu_->Finish().ok());
    }
  }

  // A device copy of `host`.
  float* Up(const std::vector<float>& host) {
    auto p = gpu_->AllocateFloats(static_cast<int64_t>(std::max<size_t>(host.size(), 1)));
    EXPECT_TRUE(p.ok());
    owned_.push_back(*p);
    EXPECT_TRUE(gpu_->ToDevice(host.data(), static_cast<int64_t>(host.size()), *p).ok());
    return *p;
  }
  // n device floats, every one NaN.
  float* Poisoned(size_t n) {
    return Up(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
  }
  std::vector<float> Down(const float* p, size_t n) {
    std::vector<float> host(n);
    EXPECT_TRUE(gpu_->ToHost(p, static_cast<int64_t>(n), host.data()).ok());
    return host;
  }
  // Bytes are moved as floats' worth of bytes.
  std::vector<std::byte> DownBytes(const std::byte* p, size_t n) {
    std::vector<float> f((n + 3) / 4);
    EXPECT_TRUE(gpu_->ToHost(reinterpret_cast<const float*>(p), static_cast<int64_t>(f.size()), f.data()).ok());
    std::vector<std::byte> b(n);
    std::memcpy(b.data(), f.data(), n);
    return b;
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::vector<float*> owned_;
};

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// max |a - b| / max(1, |b|) over the elements; NaN in a counts as infinite.
double WorstError(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    if (std::isnan(b[i])) continue;
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]) / std::max(1.0, std::fabs(static_cast<double>(b[i]))));
  }
  return worst;
}

KvLayout Layout(KvFormat format, int32_t q_heads = 4, int32_t kv_heads = 2, int32_t head_dim = 64, int32_t block_len = 16,
                int64_t blocks = 6, int32_t layers = 2) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_q_heads = q_heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.block_len = block_len;
  c.format = format;
  c.num_blocks = blocks;
  return *KvLayout::Create(c);
}

int64_t PayloadBytes(const KvLayout& l) { return l.bytes_per_block() - l.padding_bytes_per_block(); }

// A host arena and a device arena holding the same bytes (every slab
// through the payload path).
struct TwinArenas {
  std::unique_ptr<KvArena> host, device;
};
TwinArenas Twins(const CudaBackend& gpu, const KvLayout& layout, uint32_t seed) {
  TwinArenas t;
  t.host = *CpuBackend().AllocateArena({.size_bytes = layout.total_bytes()});
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < layout.total_bytes(); ++i) t.host->data()[i] = static_cast<std::byte>(rng());
  t.device = *gpu.AllocateArena({.size_bytes = layout.total_bytes()});
  std::vector<std::byte> payload(static_cast<size_t>(PayloadBytes(layout)));
  for (int64_t b = 0; b < layout.num_blocks(); ++b) {
    CpuBackend().BlockToHost(layout, t.host->data(), BlockId{static_cast<int32_t>(b)}, payload);
    gpu.HostToBlock(layout, t.device->data(), BlockId{static_cast<int32_t>(b)}, payload);
  }
  return t;
}

// Every block's payload equal on both sides.
void ExpectSamePayloads(const CudaBackend& gpu, const KvLayout& layout, const TwinArenas& t) {
  std::vector<std::byte> a(static_cast<size_t>(PayloadBytes(layout))), b(a.size());
  for (int64_t blk = 0; blk < layout.num_blocks(); ++blk) {
    CpuBackend().BlockToHost(layout, t.host->data(), BlockId{static_cast<int32_t>(blk)}, a);
    gpu.BlockToHost(layout, t.device->data(), BlockId{static_cast<int32_t>(blk)}, b);
    EXPECT_EQ(a, b) << "block " << blk;
  }
}

TEST_F(CudaBackendTest, BlockTransfersAndCopiesOnWriteMatchTheCpuByteForByte) {
  for (const KvFormat& format : {KvFormat::Plain(DType::kF16), KvFormat::Int8(64), KvFormat::Int4Kivi(16)}) {
    const KvLayout layout = Layout(format);
    TwinArenas t = Twins(*gpu_, layout, 3);
    ExpectSamePayloads(*gpu_, layout, t);
    // A chain (2 -> 5, then 5 -> 1) and partial fills: the order matters.
    const BlockCopy copies[] = {{BlockId{2}, BlockId{5}, 5}, {BlockId{5}, BlockId{1}, 16}, {BlockId{0}, BlockId{3}, 1}};
    CpuBackend().CopyBlocks(layout, t.host->data(), copies);
    gpu_->CopyBlocks(layout, t.device->data(), copies);
    ExpectSamePayloads(*gpu_, layout, t);
  }
  EXPECT_TRUE(gpu_->Finish().ok());
}

TEST_F(CudaBackendTest, KvRowsAreEncodedBitForBitAsOnTheHost) {
  const int32_t d = 128;
  const int64_t rows = 37;
  std::vector<float> x = Random(static_cast<size_t>(rows * d), 5, 3.0f);
  x[7] = 0.0f;  // zeros, a row of zeros, large values
  std::fill(x.begin() + d, x.begin() + 2 * d, 0.0f);
  x[5 * d + 3] = 4000.0f;
  const float* src = Up(x);
  for (const KvFormat& f : {KvFormat::Plain(DType::kF32), KvFormat::Plain(DType::kF16), KvFormat::Plain(DType::kBF16),
                            KvFormat::Int8(d), KvFormat::Fp8(DType::kFP8E4M3, d), KvFormat::Fp8(DType::kFP8E5M2, d),
                            KvFormat::Int4Kivi(32), KvFormat::Int8(d).WithHadamard()}) {
    const int64_t row_bytes = EncodedRowBytes(f, d);
    std::vector<std::byte> want(static_cast<size_t>(rows * row_bytes));
    CpuBackend().EncodeKvRows(f, d, x.data(), rows, want.data());
    float* dst = Poisoned(static_cast<size_t>((rows * row_bytes + 3) / 4));
    const int64_t fallbacks = gpu_->host_fallbacks();
    gpu_->EncodeKvRows(f, d, src, rows, reinterpret_cast<std::byte*>(dst));
    EXPECT_EQ(DownBytes(reinterpret_cast<std::byte*>(dst), want.size()), want) << "dtype " << static_cast<int>(f.dtype);
    EXPECT_EQ(gpu_->host_fallbacks() - fallbacks, f.hadamard ? 1 : 0);
  }
  EXPECT_TRUE(gpu_->Finish().ok());
}

TEST_F(CudaBackendTest, LayerOpsMatchTheCpu) {
  const int64_t rows = 9;
  const int32_t width = 384;
  const size_t n = static_cast<size_t>(rows * width);
  const std::vector<float> x = Random(n, 1), y = Random(n, 2, 4.0f), w = Random(static_cast<size_t>(width), 3);
  auto run = [&](const char* what, auto cpu, auto gpu) {
    std::vector<float> want = x;
    cpu(want.data());
    float* dx = Up(x);
    gpu(dx);
    EXPECT_LE(WorstError(Down(dx, n), want), 2e-6) << what;
  };
  const float* dy = Up(y);
  const float* dw = Up(w);
  run("rmsnorm", [&](float* p) { CpuBackend().RmsNormRows(p, w.data(), rows, width, 1e-5f, p); },
      [&](float* p) { gpu_->RmsNormRows(p, dw, rows, width, 1e-5f, p); });
  run("bias", [&](float* p) { CpuBackend().AddBiasRows(p, w.data(), rows, width); },
      [&](float* p) { gpu_->AddBiasRows(p, dw, rows, width); });
  run("add", [&](float* p) { CpuBackend().AddInPlace(p, y.data(), static_cast<int64_t>(n)); },
      [&](float* p) { gpu_->AddInPlace(p, dy, static_cast<int64_t>(n)); });
  run("swiglu", [&](float* p) { CpuBackend().SwiGluInPlace(p, y.data(), static_cast<int64_t>(n)); },
      [&](float* p) { gpu_->SwiGluInPlace(p, dy, static_cast<int64_t>(n)); });
  run("geglu", [&](float* p) { CpuBackend().GeluGluInPlace(p, y.data(), static_cast<int64_t>(n)); },
      [&](float* p) { gpu_->GeluGluInPlace(p, dy, static_cast<int64_t>(n)); });
  run("scale", [&](float* p) { CpuBackend().ScaleInPlace(p, 0.37f, static_cast<int64_t>(n)); },
      [&](float* p) { gpu_->ScaleInPlace(p, 0.37f, static_cast<int64_t>(n)); });
  for (const bool halves : {false, true}) {
    RopeParams rp;
    rp.head_dim = 64;
    rp.rope_dims = halves ? 64 : 32;  // partial rotation too
    rp.halves = halves;
    rp.theta = 500000.0f;
    const Rope rope(rp);
    std::vector<int64_t> pos(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) pos[static_cast<size_t>(r)] = r * 977 + 3;
    std::vector<float> cos(static_cast<size_t>(rows * rp.rope_dims)), sin(cos.size());
    CpuBackend().RopeTables(rope, pos, cos.data(), sin.data());
    float* dcos = Poisoned(cos.size());
    float* dsin = Poisoned(sin.size());
    gpu_->RopeTables(rope, pos, dcos, dsin);
    EXPECT_EQ(Down(dcos, cos.size()), cos);
    EXPECT_EQ(Down(dsin, sin.size()), sin);
    run(halves ? "rope halves" : "rope pairs", [&](float* p) { CpuBackend().RopeApply(rope, p, rows, width, cos.data(), sin.data()); },
        [&](float* p) { gpu_->RopeApply(rope, p, rows, width, dcos, dsin); });
  }
  EXPECT_TRUE(gpu_->Finish().ok());
}

// Random weights of `type` (block formats: random bits under finite f16
// scales at the offsets `halves` lists).
std::vector<std::byte> RandomWeights(WeightType type, int64_t rows, int64_t cols, std::vector<int> halves, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<std::byte> bytes(static_cast<size_t>(rows * WeightRowBytes(type, cols)));
  if (!IsBlockQuantized(type)) {
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = normal(rng) * 20.0f;
      if (type == WeightType::kF32) std::memcpy(bytes.data() + 4 * i, &v, 4);
      const uint16_t h = type == WeightType::kF16 ? F32ToF16(v) : F32ToBF16(v);
      if (type != WeightType::kF32) std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
    return bytes;
  }
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  const WeightFormat& f = FormatOf(type);
  for (size_t at = 0; at < bytes.size(); at += static_cast<size_t>(f.block_bytes)) {
    for (int off : halves) {
      const uint16_t h = F32ToF16(normal(rng));
      std::memcpy(bytes.data() + at + off, &h, 2);
    }
  }
  return bytes;
}

TEST_F(CudaBackendTest, WeightProductsMatchADoubleProductOfTheDecodedWeights) {
  const int64_t rows = 96, cols = 512;
  struct Case {
    WeightType type;
    std::vector<int> halves;
  };
  for (const Case& c : {Case{WeightType::kF32, {}}, Case{WeightType::kF16, {}}, Case{WeightType::kBF16, {}},
                        Case{WeightType::kQ8_0, {0}}, Case{WeightType::kQ4_0, {0}}, Case{WeightType::kQ4_K, {0, 2}},
                        Case{WeightType::kQ6_K, {208}}}) {
    const std::vector<std::byte> bytes = RandomWeights(c.type, rows, cols, c.halves, 9);
    std::vector<float> values(static_cast<size_t>(rows * cols));
    DecodeWeights(c.type, bytes.data(), rows * cols, values.data());
    const WeightMatrix w{bytes.data(), c.type, rows, cols};
    for (const int64_t tokens : {int64_t{1}, int64_t{7}, int64_t{64}}) {
      const std::vector<float> x = Random(static_cast<size_t>(tokens * cols), 11);
      std::vector<double> ref(static_cast<size_t>(tokens * rows));
      double norm = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t r = 0; r < rows; ++r) {
          double s = 0, a = 0;
          for (int64_t k = 0; k < cols; ++k) {
            const double p = static_cast<double>(x[static_cast<size_t>(t * cols + k)]) * values[static_cast<size_t>(r * cols + k)];
            s += p;
            a += std::fabs(p);
          }
          ref[static_cast<size_t>(t * rows + r)] = s;
          norm = std::max(norm, a);
        }
      }
      const float* dx = Up(x);
      for (const Activations act : {Activations::kF32, Activations::kFast}) {
        float* dy = Poisoned(ref.size());
        ASSERT_TRUE(gpu_->MatMul(w, dx, tokens, dy, 0, act).ok());
        const std::vector<float> got = Down(dy, ref.size());
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::isnan(got[i]) ? INFINITY : std::fabs(got[i] - ref[i]));
        // Relative to the sum of |products|: f32 accumulation ~1e-6; 16-bit
        // activations (and weights) ~2^-8 for bf16.
        const bool exact = act == Activations::kF32 || c.type == WeightType::kF32;
        EXPECT_LE(worst / norm, exact ? 1e-5 : 8e-3)
            << FormatOf(c.type).name << " tokens " << tokens << (exact ? " f32" : " fast");
      }
    }
  }
  EXPECT_GT(gpu_->weight_bytes(), 0);
  EXPECT_TRUE(gpu_->Finish().ok());
}

// A cache whose rows are real encodings of random values, on both sides.
struct AttentionSetup {
  KvLayout layout;
  TwinArenas arenas;
  std::vector<std::vector<BlockId>> tables;
};
AttentionSetup MakeAttention(const CudaBackend& gpu, KvFormat format, int32_t q_heads, int32_t kv_heads, int32_t d,
                             int32_t bl, const std::vector<int64_t>& lens, uint32_t seed) {
  int64_t blocks = 0;
  for (int64_t n : lens) blocks += (n + bl - 1) / bl;
  const KvLayout layout = Layout(format, q_heads, kv_heads, d, bl, blocks + 3, 1);
  auto host = *CpuBackend().AllocateArena({.size_bytes = layout.total_bytes()});
  const int64_t row_bytes = EncodedRowBytes(format, d);
  std::vector<float> values = Random(static_cast<size_t>(d), seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::byte> row(static_cast<size_t>(row_bytes));
  for (int32_t p = 0; p < 2; ++p)
    for (int32_t h = 0; h < kv_heads; ++h)
      for (int64_t b = 0; b < layout.num_blocks(); ++b)
        for (int32_t s = 0; s < bl; ++s) {
          for (float& v : values) v = normal(rng);
          CpuBackend().EncodeKvRows(format, d, values.data(), 1, row.data());
          std::memcpy(host->data() + layout.RowOffset(0, p, h, b, s), row.data(), row.size());
        }
  AttentionSetup a{layout, {}, {}};
  a.arenas.host = std::move(host);
  a.arenas.device = *gpu.AllocateArena({.size_bytes = layout.total_bytes()});
  std::vector<std::byte> payload(static_cast<size_t>(PayloadBytes(layout)));
  for (int64_t b = 0; b < layout.num_blocks(); ++b) {
    CpuBackend().BlockToHost(layout, a.arenas.host->data(), BlockId{static_cast<int32_t>(b)}, payload);
    gpu.HostToBlock(layout, a.arenas.device->data(), BlockId{static_cast<int32_t>(b)}, payload);
  }
  std::vector<int32_t> ids(static_cast<size_t>(layout.num_blocks()));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  for (int64_t n : lens) {
    std::vector<BlockId> t;
    for (int64_t i = 0; i < (n + bl - 1) / bl; ++i) t.push_back(BlockId{ids[next++]});
    a.tables.push_back(std::move(t));
  }
  return a;
}

TEST_F(CudaBackendTest, DecodeAttentionMatchesTheCpu) {
  auto tc = CudaBackend::Create({.tensor_core_decode = true});
  ASSERT_TRUE(tc.ok()) << tc.status().message();
  struct Shape {
    int32_t q_heads, kv_heads, d, bl;
  };
  for (const KvFormat& format : {KvFormat::Plain(DType::kF32), KvFormat::Plain(DType::kF16), KvFormat::Plain(DType::kBF16),
                                 KvFormat::Int8(128), KvFormat::Fp8(DType::kFP8E4M3, 128)}) {
    for (const Shape s : {Shape{8, 8, 128, 16}, Shape{8, 2, 128, 16}, Shape{16, 2, 128, 32}, Shape{4, 1, 128, 128}}) {
      const std::vector<int64_t> lens = {1, s.bl - 1, s.bl, s.bl + 1, 5 * s.bl + 3, 700};
      const KvFormat& f = format;  // every shape has head_dim 128, the 8-bit formats' row
      AttentionSetup a = MakeAttention(*gpu_, f, s.q_heads, s.kv_heads, s.d, s.bl, lens, 21);
      const size_t n = lens.size() * static_cast<size_t>(s.q_heads * s.d);
      const std::vector<float> q = Random(n, 4);
      const float* dq = Up(q);
      for (int variant = 0; variant < 4; ++variant) {
        std::vector<DecodeSeq> seqs;
        for (size_t i = 0; i < lens.size(); ++i) {
          DecodeSeq ds{a.tables[i], lens[i]};
          if (variant == 1) ds.window = 9;
          seqs.push_back(ds);
        }
        AttentionOptions o;
        if (variant == 2) o.softcap = 3.0f;
        if (variant == 3) o.split_tokens = 2 * s.bl;
        std::vector<float> want(n), want_lse(lens.size() * static_cast<size_t>(s.q_heads));
        AttentionOptions co = o;
        if (variant == 2) co.lse = want_lse.data();
        ASSERT_TRUE(CpuBackend().DecodeAttention({&a.layout, a.arenas.host->data(), 0}, seqs, q.data(), want.data(), co).ok());
        float* out = Poisoned(n);
        float* lse = Poisoned(want_lse.size());
        if (variant == 2) o.lse = lse;
        ASSERT_TRUE(gpu_->DecodeAttention({&a.layout, a.arenas.device->data(), 0}, seqs, dq, out, o).ok());
        EXPECT_LE(WorstError(Down(out, n), want), 2e-5) << "dtype " << static_cast<int>(f.dtype) << " G "
                                                        << s.q_heads / s.kv_heads << " bl " << s.bl << " variant " << variant;
        if (variant == 2) {
          EXPECT_LE(WorstError(Down(lse, want_lse.size()), want_lse), 2e-6);
        }
        // The tensor-core decode kernel (f16 / bf16, the fast path's variants).
        if ((f.dtype == DType::kF16 || f.dtype == DType::kBF16) && (variant == 0 || variant == 3)) {
          float* tc_out = Poisoned(n);
          ASSERT_TRUE(gpu_->Finish().ok());  // the inputs are in place before another backend's stream reads them
          ASSERT_TRUE((*tc)->DecodeAttention({&a.layout, a.arenas.device->data(), 0}, seqs, dq, tc_out, o).ok());
          ASSERT_TRUE((*tc)->Finish().ok());
          EXPECT_LE(WorstError(Down(tc_out, n), want), 2e-5) << "dtype " << static_cast<int>(f.dtype) << " G "
                                                             << s.q_heads / s.kv_heads << " bl " << s.bl << " variant "
                                                             << variant << " (tensor cores)";
        }
      }
    }
  }
  EXPECT_TRUE(gpu_->Finish().ok());
}

TEST_F(CudaBackendTest, ChunkedPrefillAtEveryPositionOfABlockMatchesTheCpu) {
  const int32_t q_heads = 8, kv_heads = 2, d = 64, bl = 16;
  const std::vector<int64_t> lens = {40, 17, 64};
  // The tensor-core prefill (f16 / bf16 rows) on a second backend.
  auto tc = CudaBackend::Create({.tensor_core_prefill = true});
  ASSERT_TRUE(tc.ok()) << tc.status().message();
  for (const auto& [format, be] : {std::pair{KvFormat::Plain(DType::kF16), gpu_.get()}, std::pair{KvFormat::Int8(d), gpu_.get()},
                                   std::pair{KvFormat::Plain(DType::kF16), tc->get()},
                                   std::pair{KvFormat::Plain(DType::kBF16), tc->get()}}) {
    AttentionSetup a = MakeAttention(*be, format, q_heads, kv_heads, d, bl, lens, 8);
    for (int64_t chunk = 1; chunk <= bl + 1; ++chunk) {
      for (const int64_t window : {int64_t{0}, int64_t{5}}) {
        std::vector<PrefillSeq> seqs;
        int64_t rows = 0;
        for (size_t i = 0; i < lens.size(); ++i) {
          PrefillSeq ps{a.tables[i], lens[i], std::min(lens[i], chunk + static_cast<int64_t>(i))};
          ps.window = window;
          rows += ps.num_queries;
          seqs.push_back(ps);
        }
        const size_t n = static_cast<size_t>(rows * q_heads * d);
        const std::vector<float> q = Random(n, static_cast<uint32_t>(chunk));
        std::vector<float> want(n);
        ASSERT_TRUE(CpuBackend().PrefillAttention({&a.layout, a.arenas.host->data(), 0}, seqs, q.data(), want.data(), {}).ok());
        const float* dq = Up(q);
        float* out = Poisoned(n);
        ASSERT_TRUE(gpu_->Finish().ok());  // the inputs are in place before another backend's stream reads them
        ASSERT_TRUE(be->PrefillAttention({&a.layout, a.arenas.device->data(), 0}, seqs, dq, out, {}).ok());
        ASSERT_TRUE(be->Finish().ok());
        EXPECT_LE(WorstError(Down(out, n), want), 2e-5)
            << "chunk " << chunk << " window " << window << (be == gpu_.get() ? "" : " (tensor cores)");
      }
    }
  }
  EXPECT_TRUE(gpu_->Finish().ok());
}

TEST_F(CudaBackendTest, PartialTablesGiveTheCpuOutputsAndLogSumExps) {
  const int32_t q_heads = 4, kv_heads = 4, d = 64, bl = 16;
  const std::vector<int64_t> lens = {50, 33};
  AttentionSetup a = MakeAttention(*gpu_, KvFormat::Plain(DType::kF16), q_heads, kv_heads, d, bl, lens, 12);
  for (auto& t : a.tables) t[1] = kNoBlock;  // held elsewhere
  std::vector<DecodeSeq> seqs;
  for (size_t i = 0; i < lens.size(); ++i) seqs.push_back({a.tables[i], lens[i]});
  const size_t n = lens.size() * static_cast<size_t>(q_heads * d);
  const std::vector<float> q = Random(n, 2);
  std::vector<float> want(n), want_lse(lens.size() * q_heads);
  AttentionOptions o;
  o.partial = true;
  o.lse = want_lse.data();
  ASSERT_TRUE(CpuBackend().DecodeAttention({&a.layout, a.arenas.host->data(), 0}, seqs, q.data(), want.data(), o).ok());
  float* out = Poisoned(n);
  float* lse = Poisoned(want_lse.size());
  o.lse = lse;
  ASSERT_TRUE(gpu_->DecodeAttention({&a.layout, a.arenas.device->data(), 0}, seqs, Up(q), out, o).ok());
  EXPECT_LE(WorstError(Down(out, n), want), 2e-5);
  EXPECT_LE(WorstError(Down(lse, want_lse.size()), want_lse), 2e-6);
}

// A step's layers share their block tables and lengths: they cross to the
// device once per distinct set, and a changed set (a longer sequence, a
// set evicted by others) is read, never a stale one.
TEST_F(CudaBackendTest, TablesCrossOncePerDistinctSetAndChangesAreRead) {
  const int32_t q_heads = 8, kv_heads = 2, d = 64, bl = 16;
  const std::vector<int64_t> lens = {60, 17, 64};
  AttentionSetup a = MakeAttention(*gpu_, KvFormat::Plain(DType::kF16), q_heads, kv_heads, d, bl, lens, 31);
  const size_t n = lens.size() * static_cast<size_t>(q_heads * d);
  const std::vector<float> q = Random(n, 6);
  const float* dq = Up(q);
  auto check = [&](int64_t shorter, const char* what) {
    std::vector<DecodeSeq> seqs;
    for (size_t i = 0; i < lens.size(); ++i) seqs.push_back({a.tables[i], lens[i] - shorter});
    std::vector<float> want(n);
    ASSERT_TRUE(CpuBackend().DecodeAttention({&a.layout, a.arenas.host->data(), 0}, seqs, q.data(), want.data(), {}).ok());
    float* out = Poisoned(n);
    ASSERT_TRUE(gpu_->DecodeAttention({&a.layout, a.arenas.device->data(), 0}, seqs, dq, out, {}).ok());
    EXPECT_LE(WorstError(Down(out, n), want), 2e-5) << what << " (" << shorter << " tokens shorter)";
  };
  const int64_t before = gpu_->table_uploads();
  for (int layer = 0; layer < 3; ++layer) check(0, "three layers of one step");
  EXPECT_EQ(gpu_->table_uploads() - before, 1);
  for (int64_t shorter = 1; shorter <= 6; ++shorter) check(shorter, "a new set each call");
  EXPECT_EQ(gpu_->table_uploads() - before, 7);
  check(0, "the first set again, after others took its place");
  check(3, "a recent set again");
  EXPECT_TRUE(gpu_->Finish().ok());
}

// Decode steps recorded and run as CUDA graphs give what the same calls give
// one by one: per step, each sequence's new K / V rows encoded and stored by
// slot mapping, decode attention over contexts that grow across block
// boundaries (shuffled tables), a layer op and a weight product, the result
// back to the host (which runs the recorded step) and once more after it
// (call by call). One graph serves every step: a recorded step's tables are
// padded to 256 tokens, which the 73-token contexts stay within.
TEST_F(CudaBackendTest, RecordedStepsRunAsGraphsWithTheCallByCallResults) {
  auto made = CudaBackend::Create({.cuda_graphs = true});
  ASSERT_TRUE(made.ok()) << made.status().message();
  const CudaBackend& graphed = **made;
  const int32_t q_heads = 8, kv_heads = 2, d = 64, bl = 16, steps = 40;
  const std::vector<int64_t> start = {5, 20, 33};
  std::vector<int64_t> lens;
  for (int64_t n : start) lens.push_back(n + steps);
  const KvFormat format = KvFormat::Plain(DType::kF16);
  // The same bytes and tables on both (same seed).
  AttentionSetup eager = MakeAttention(*gpu_, format, q_heads, kv_heads, d, bl, lens, 41);
  AttentionSetup replay = MakeAttention(graphed, format, q_heads, kv_heads, d, bl, lens, 41);
  ASSERT_EQ(eager.tables, replay.tables);
  const int64_t seqs_n = static_cast<int64_t>(start.size()), out_rows = 48;
  const std::vector<float> norm = Random(static_cast<size_t>(d), 9, 0.5f);
  std::vector<uint16_t> w16(static_cast<size_t>(out_rows * d));
  {
    const std::vector<float> w = Random(w16.size(), 10, 0.1f);
    for (size_t i = 0; i < w.size(); ++i) w16[i] = F32ToF16(w[i]);
  }
  const WeightMatrix w{reinterpret_cast<const std::byte*>(w16.data()), WeightType::kF16, out_rows, d};
  const size_t kv_floats = static_cast<size_t>(seqs_n * kv_heads * d), q_floats = static_cast<size_t>(seqs_n * q_heads * d);
  const size_t row_bytes = static_cast<size_t>(EncodedRowBytes(format, d));
  const size_t y_floats = static_cast<size_t>(seqs_n * q_heads * out_rows);
  struct Buffers {
    float *k, *v, *q, *out, *normed, *y, *ek, *ev;
  };
  auto buffers = [&](const CudaBackend& be) {
    auto alloc = [&](size_t n) {
      auto p = be.AllocateFloats(static_cast<int64_t>(n));
      EXPECT_TRUE(p.ok());
      return *p;
    };
    const size_t encoded = (static_cast<size_t>(seqs_n * kv_heads) * row_bytes + 3) / 4;
    return Buffers{alloc(kv_floats), alloc(kv_floats), alloc(q_floats), alloc(q_floats), alloc(q_floats),
                   alloc(y_floats), alloc(encoded), alloc(encoded)};
  };
  const Buffers bufs[2] = {buffers(*gpu_), buffers(graphed)};
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> k = Random(kv_floats, 100 + step), v = Random(kv_floats, 200 + step), q = Random(q_floats, 300 + step);
    std::vector<int64_t> slots;
    std::vector<DecodeSeq> seqs;
    for (size_t i = 0; i < start.size(); ++i) {
      const int64_t pos = start[i] + step;
      slots.push_back(ToInt(eager.tables[i][static_cast<size_t>(pos / bl)]) * int64_t{bl} + pos % bl);
      seqs.push_back({eager.tables[i], pos + 1});
    }
    std::vector<float> y[2], again[2];
    for (const int which : {0, 1}) {
      const CudaBackend& be = which == 0 ? *gpu_ : graphed;
      AttentionSetup& a = which == 0 ? eager : replay;
      const Buffers& b = bufs[which];
      be.BeginReplayableStep();
      ASSERT_TRUE(be.ToDevice(k.data(), static_cast<int64_t>(k.size()), b.k).ok());
      ASSERT_TRUE(be.ToDevice(v.data(), static_cast<int64_t>(v.size()), b.v).ok());
      ASSERT_TRUE(be.ToDevice(q.data(), static_cast<int64_t>(q.size()), b.q).ok());
      be.EncodeKvRows(format, d, b.k, seqs_n * kv_heads, reinterpret_cast<std::byte*>(b.ek));
      be.EncodeKvRows(format, d, b.v, seqs_n * kv_heads, reinterpret_cast<std::byte*>(b.ev));
      be.StoreKvRows(a.layout, a.arenas.device->data(), 0, slots, reinterpret_cast<const std::byte*>(b.ek),
                     reinterpret_cast<const std::byte*>(b.ev));
      ASSERT_TRUE(be.DecodeAttention({&a.layout, a.arenas.device->data(), 0}, seqs, b.q, b.out, {}).ok());
      be.RmsNormRows(b.out, norm.data(), seqs_n * q_heads, d, 1e-5f, b.normed);
      ASSERT_TRUE(be.MatMul(w, b.normed, seqs_n * q_heads, b.y, 1, Activations::kFast).ok());
      y[which] = Down(b.y, y_floats);
      be.AddInPlace(b.y, b.y, static_cast<int64_t>(y_floats));  // after the flush: call by call
      again[which] = Down(b.y, y_floats);
      ASSERT_TRUE(be.EndReplayableStep().ok());
    }
    // The same kernels on the same inputs; cuBLAS may pick another
    // algorithm with a workspace of its own (graphs), so f32 rounding apart.
    ASSERT_LE(WorstError(y[1], y[0]), 2e-5) << "step " << step;
    ASSERT_LE(WorstError(again[1], again[0]), 2e-5) << "step " << step;
  }
  // The rows stored: the same bytes as the call-by-call backend's.
  std::vector<std::byte> a(static_cast<size_t>(PayloadBytes(eager.layout))), b(a.size());
  for (int64_t blk = 0; blk < eager.layout.num_blocks(); ++blk) {
    gpu_->BlockToHost(eager.layout, eager.arenas.device->data(), BlockId{static_cast<int32_t>(blk)}, a);
    graphed.BlockToHost(replay.layout, replay.arenas.device->data(), BlockId{static_cast<int32_t>(blk)}, b);
    EXPECT_EQ(a, b) << "block " << blk;
  }
  const CudaBackend::GraphCounts c = graphed.graph_counts();
  EXPECT_EQ(c.launches, steps);
  EXPECT_EQ(c.uncaptured, 0);
  // Contexts cross block boundaries within one 256-token bucket: the first
  // step's graph (or the second's, once the step's memory has settled).
  EXPECT_LE(c.captures, 2);
  EXPECT_EQ(gpu_->graph_counts().launches, 0);  // no graphs without the option
  for (const Buffers& bb : bufs) {
    const CudaBackend& be = &bb == &bufs[0] ? *gpu_ : graphed;
    for (float* p : {bb.k, bb.v, bb.q, bb.out, bb.normed, bb.y, bb.ek, bb.ev}) be.Free(p);
  }
  EXPECT_TRUE(graphed.Finish().ok());
}

// Tier moves run on the copy stream while attention runs on the compute
// stream: a thread moving blocks in and out (the tiers' mover) beside
// another running decode attention over other blocks; both stay exact.
TEST_F(CudaBackendTest, BlockTransfersBesideAttentionStayExact) {
  const int32_t q_heads = 8, kv_heads = 2, d = 128, bl = 16;
  const std::vector<int64_t> lens = {300, 200};
  AttentionSetup a = MakeAttention(*gpu_, KvFormat::Plain(DType::kF16), q_heads, kv_heads, d, bl, lens, 5);
  // The blocks no table names: the mover's.
  std::vector<bool> used(static_cast<size_t>(a.layout.num_blocks()), false);
  for (const auto& t : a.tables)
    for (BlockId b : t) used[static_cast<size_t>(ToInt(b))] = true;
  std::vector<int32_t> spare;
  for (size_t b = 0; b < used.size(); ++b) {
    if (!used[b]) spare.push_back(static_cast<int32_t>(b));
  }
  ASSERT_FALSE(spare.empty());
  std::vector<DecodeSeq> seqs;
  for (size_t i = 0; i < lens.size(); ++i) seqs.push_back({a.tables[i], lens[i]});
  const size_t n = lens.size() * static_cast<size_t>(q_heads * d);
  const std::vector<float> q = Random(n, 3);
  std::vector<float> want(n);
  ASSERT_TRUE(CpuBackend().DecodeAttention({&a.layout, a.arenas.host->data(), 0}, seqs, q.data(), want.data(), {}).ok());
  const float* dq = Up(q);
  float* out = Poisoned(n);
  std::atomic<int> moved_wrong{0};
  std::thread mover([&] {
    std::mt19937 rng(9);
    std::vector<std::byte> payload(static_cast<size_t>(PayloadBytes(a.layout))), back(payload.size());
    for (int i = 0; i < 200; ++i) {
      for (auto& x : payload) x = static_cast<std::byte>(rng());
      const BlockId b{spare[static_cast<size_t>(i) % spare.size()]};
      gpu_->HostToBlock(a.layout, a.arenas.device->data(), b, payload);
      gpu_->BlockToHost(a.layout, a.arenas.device->data(), b, back);
      if (back != payload) ++moved_wrong;
    }
  });
  int wrong = 0;
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(gpu_->DecodeAttention({&a.layout, a.arenas.device->data(), 0}, seqs, dq, out, {}).ok());
    if (WorstError(Down(out, n), want) > 2e-5) ++wrong;
  }
  mover.join();
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(moved_wrong.load(), 0);
  EXPECT_TRUE(gpu_->Finish().ok());
}

TEST_F(CudaBackendTest, WhatTheDeviceDoesNotDoIsRefusedWithTheFix) {
  const std::vector<int64_t> lens = {20};
  AttentionSetup a = MakeAttention(*gpu_, KvFormat::Plain(DType::kF16), 4, 2, 64, 16, lens, 1);
  const float* q = Up(Random(4 * 64, 1));
  float* out = Poisoned(4 * 64);
  std::vector<float> scores(2 * 20);
  DecodeSeq with_scores{a.tables[0], 20, scores.data()};
  Status s = gpu_->DecodeAttention({&a.layout, a.arenas.device->data(), 0}, {&with_scores, 1}, q, out, {});
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("CPU backend"), std::string::npos) << s.message();
  std::vector<BlockId> bad = {BlockId{999}, BlockId{0}};
  DecodeSeq outside{bad, 20};
  s = gpu_->DecodeAttention({&a.layout, a.arenas.device->data(), 0}, {&outside, 1}, q, out, {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  const KvLayout kivi = Layout(KvFormat::Int4Kivi(16), 4, 2, 64, 16, 4, 1);
  auto arena = *gpu_->AllocateArena({.size_bytes = kivi.total_bytes()});
  DecodeSeq plain{a.tables[0], 20};
  s = gpu_->DecodeAttention({&kivi, arena->data(), 0}, {&plain, 1}, q, out, {});
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.message();
  EXPECT_TRUE(gpu_->Finish().ok());
}

}  // namespace
}  // namespace pagekv
