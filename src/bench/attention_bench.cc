// `pagekv bench attention`: decode attention over the paged layout, timed
// against the machine's roofline measured in the same run, and against a
// straightforward scalar loop over a contiguous cache.
//
// Cold runs: each shape gets an arena with enough layers that the calls,
// rotating over the layers, read a KV footprint of at least kRotationBytes
// (several times the ~32 MiB effective last-level cache), so every call
// streams from DRAM.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "base/checked_math.h"
#include "base/thread_pool.h"
#include "engine/forward_step.h"
#include "kernels/backend.h"
#include "kernels/machine_ceilings.h"
#include "kernels/kv_arena.h"
#include "layout/float16.h"
#include "layout/quantize.h"
#include "pagekv/attention.h"
#include "pagekv/bench.h"
#include "pagekv/kv_layout.h"

namespace pagekv {
namespace {

constexpr int64_t kRotationBytes = int64_t{256} << 20;
constexpr int64_t kQuickRotationBytes = int64_t{64} << 20;
constexpr int64_t kMaxFootprint = int64_t{6} << 30;  // per shape, under the 8 GiB limit

struct HeadConfig {
  int32_t q_heads, kv_heads;
};

struct Shape {
  int64_t batch, ctx;
  HeadConfig heads;
  int32_t block_len;
  DType dtype;
  int threads;
};

std::vector<Shape> Grid(const AttentionBenchOptions& o, int all_threads) {
  const BenchSet set = o.set;
  std::vector<int64_t> batches, ctxs;
  std::vector<int32_t> block_lens;
  std::vector<HeadConfig> heads = {{32, 32}, {32, 8}, {64, 8}};
  std::vector<int> threads = {all_threads};
  if (o.mla) heads = {{set == BenchSet::kQuick ? 16 : 128, 1}};
  switch (set) {
    case BenchSet::kQuick:
      batches = {2};
      ctxs = {1024};
      block_lens = {16, 128};
      if (!o.mla) heads = {{8, 2}};
      break;
    case BenchSet::kDefault:
      batches = {8};
      ctxs = {4096, 16384};
      block_lens = {128};
      break;
    case BenchSet::kFull:
      batches = {1, 8, 32};
      ctxs = {512, 4096, 16384};
      block_lens = {16, 64, 128};
      if (all_threads > 1) threads = {1, all_threads};
      break;
  }
  if (o.mla && set == BenchSet::kDefault) batches = {1, 8};
  std::vector<DType> dtypes = {DType::kF16, DType::kBF16, DType::kInt8};  // fp8 on request (--dtype)
  if (!o.batches.empty()) batches = o.batches;
  if (!o.contexts.empty()) ctxs = o.contexts;
  if (!o.block_lens.empty()) block_lens = o.block_lens;
  if (!o.dtypes.empty()) dtypes = o.dtypes;
  if (!o.heads.empty()) {
    heads.clear();
    for (auto [qh, kvh] : o.heads) heads.push_back({qh, kvh});
  }
  std::vector<Shape> out;
  for (int t : threads)
    for (int32_t bl : block_lens)
      for (DType d : dtypes)
        for (HeadConfig h : heads)
          for (int64_t b : batches)
            for (int64_t c : ctxs) out.push_back({b, c, h, bl, d, t});
  return out;
}

uint16_t Encode(DType d, float x) { return d == DType::kF16 ? F32ToF16(x) : F32ToBF16(x); }
float Decode(DType d, uint16_t h) { return d == DType::kF16 ? F16ToF32(h) : BF16ToF32(h); }

// Straightforward decode attention over contiguous K and V
// ([seq][kv_head][ctx][head_dim]), scalar code, three passes per head.
void ScalarContiguous(const Shape& s, int32_t d, const uint16_t* k, const uint16_t* v, const float* q, float* out) {
  const int32_t group = s.heads.q_heads / s.heads.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ThreadPool::Shared().ParallelFor(s.batch * s.heads.q_heads, s.threads, [&](int64_t item) {
    {
      const int64_t b = item / s.heads.q_heads;
      const auto qh = static_cast<int32_t>(item % s.heads.q_heads);
      std::vector<float> logits(static_cast<size_t>(s.ctx));
      const int32_t kh = qh / group;
      const float* qv = q + (b * s.heads.q_heads + qh) * d;
      const uint16_t* kb = k + (b * s.heads.kv_heads + kh) * s.ctx * d;
      const uint16_t* vb = v + (b * s.heads.kv_heads + kh) * s.ctx * d;
      float mx = -INFINITY;
      for (int64_t t = 0; t < s.ctx; ++t) {
        float dot = 0;
        for (int32_t x = 0; x < d; ++x) dot += qv[x] * Decode(s.dtype, kb[t * d + x]);
        logits[static_cast<size_t>(t)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      float sum = 0;
      for (auto& l : logits) sum += (l = std::exp(l - mx));
      float* o = out + (b * s.heads.q_heads + qh) * d;
      std::fill(o, o + d, 0.0f);
      for (int64_t t = 0; t < s.ctx; ++t) {
        const float w = logits[static_cast<size_t>(t)] / sum;
        for (int32_t x = 0; x < d; ++x) o[x] += w * Decode(s.dtype, vb[t * d + x]);
      }
    }
  });
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The ceilings next to one row: probed before and after it, the better of
// the two kept (a ratio is never inflated by a slow moment of the probe).
struct Ceilings {
  double stream_gbps = 0;
  double fma_gflops = 0;
};

class CeilingProbe {
 public:
  CeilingProbe(int threads, int64_t bytes) : threads_(threads), stream_(kernels::StreamProbe::Create(bytes, threads)) {}
  // A device's: its streaming read rate, no FMA ceiling (rows are judged by memory).
  CeilingProbe(const Backend* device, int64_t bytes) : device_(device), device_bytes_(bytes) {}
  bool ok() const { return device_ != nullptr || stream_ != nullptr; }
  Ceilings Measure() const {
    if (device_ != nullptr) {
      Result<double> gbps = device_->DeviceReadGbps(device_bytes_);
      return {gbps.ok() ? *gbps : 0.0, 0.0};
    }
    return {stream_->MeasureGbps(), kernels::MeasureFmaGflops(threads_, 2)};
  }

 private:
  int threads_ = 0;
  std::unique_ptr<kernels::StreamProbe> stream_;
  const Backend* device_ = nullptr;
  int64_t device_bytes_ = 0;
};

// DeepSeek-V3's latent attention: rank and rope per cached token, the
// per-head dims of the unabsorbed query / key and value.
constexpr int32_t kMlaRank = 512, kMlaRope = 64, kMlaNope = 128, kMlaV = 128;

Result<AttentionBenchResult> RunShape(const Shape& s, const CeilingProbe& probe, bool quick, bool scalar_baseline,
                                      bool weights, bool peer_head_major, bool mla, const Backend* device) {
  if (device != nullptr && (mla || weights)) {
    return UnimplementedError(mla ? "MLA latent caches are not read on " + device->name()
                                  : "attention weights are not computed on " + device->name());
  }
  // Elements per cached row: a head's K or V, or MLA's latent row.
  const int32_t kHeadDim = mla ? kMlaRank + kMlaRope : 128;
  const int64_t blocks_per_seq = CeilDiv(s.ctx, s.block_len);
  CacheConfig c;
  c.num_q_heads = s.heads.q_heads;
  c.num_kv_heads = s.heads.kv_heads;
  c.head_dim = kHeadDim;
  if (mla) {
    if (s.dtype == DType::kInt4) return UnimplementedError("int4 KIVI is not read on MLA latent rows");
    c.kind = CacheKind::kMla;
    c.num_kv_heads = 0;
    c.head_dim = kMlaNope;
    c.kv_lora_rank = kMlaRank;
    c.rope_dim = kMlaRope;
  }
  c.block_len = s.block_len;
  c.format = KvFormat::ForDType(s.dtype, kHeadDim);
  const bool scaled = !c.format.IsPlainFloat();
  c.num_blocks = s.batch * blocks_per_seq;
  c.num_layers = 1;
  PAGEKV_ASSIGN_OR_RETURN(KvLayout one_layer, KvLayout::Create(c));
  const int64_t layer_bytes = one_layer.total_bytes();
  const int64_t target = quick ? kQuickRotationBytes : kRotationBytes;
  // (At most the layout's 4096 layers: tiny shapes then rotate over less.)
  c.num_layers = static_cast<int32_t>(std::clamp<int64_t>(CeilDiv(target, layer_bytes), 1, 4096));
  if (layer_bytes * c.num_layers > kMaxFootprint) {
    return ResourceExhaustedError("needs " + std::to_string(layer_bytes >> 20) +
                                  " MiB of KV per layer, over the 6 GiB per-shape limit");
  }
  PAGEKV_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::Create(c));
  PAGEKV_ASSIGN_OR_RETURN(auto arena, KvArena::Create({.size_bytes = layout.total_bytes()}));

  // Random K/V values in [-1, 1], written as a repeating 1 MiB pattern.
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> pattern(1 << 19);
  if (c.format.IsKivi()) {
    // Valid key groups and value rows (codes and f16 parameters), one K and
    // one V slab's worth, in every slab of their plane.
    const int32_t g = c.format.group_size;
    std::vector<std::byte> k_slab(static_cast<size_t>(layout.slab_bytes(0, 0))), v_slab(static_cast<size_t>(layout.slab_bytes(0, 1)));
    std::vector<float> x(static_cast<size_t>(g) * kHeadDim);
    for (int32_t grp = 0; grp < s.block_len / g; ++grp) {
      for (float& e : x) e = u(rng);
      quant::EncodeInt4KeyGroup(x.data(), g, kHeadDim, k_slab.data() + grp * quant::Int4KeyGroupBytes(g, kHeadDim));
    }
    for (int32_t t = 0; t < s.block_len; ++t) {
      for (int32_t i = 0; i < kHeadDim; ++i) x[static_cast<size_t>(i)] = u(rng);
      quant::EncodeInt4ValueRow(x.data(), kHeadDim, v_slab.data() + t * quant::Int4ValueRowBytes(kHeadDim));
    }
    for (int32_t l = 0; l < layout.num_layers(); ++l) {
      for (int32_t h = 0; h < layout.num_heads(); ++h) {
        for (int64_t b = 0; b < layout.num_blocks(); ++b) {
          std::memcpy(arena->data() + layout.SlabOffset(l, 0, h, b), k_slab.data(), k_slab.size());
          std::memcpy(arena->data() + layout.SlabOffset(l, 1, h, b), v_slab.data(), v_slab.size());
        }
      }
    }
  } else if (scaled) {
    // Whole quantized rows (values and a valid f16 scale), one slab's worth, in every slab.
    std::vector<std::byte> slab(static_cast<size_t>(layout.slab_stride()));
    std::vector<float> row(kHeadDim);
    for (int32_t t = 0; t < s.block_len; ++t) {
      for (float& x : row) x = u(rng);
      std::byte* dst = slab.data() + t * layout.row_bytes();
      if (s.dtype == DType::kInt8) {
        quant::EncodeInt8Row(row.data(), kHeadDim, dst);
      } else {
        quant::EncodeFp8Row(row.data(), kHeadDim, s.dtype == DType::kFP8E4M3, dst);
      }
    }
    for (int64_t off = 0; off + layout.slab_stride() <= layout.total_bytes(); off += layout.slab_stride()) {
      std::memcpy(arena->data() + off, slab.data(), slab.size());
    }
  } else {
    for (auto& x : pattern) x = Encode(s.dtype, u(rng));
    const int64_t pattern_bytes = static_cast<int64_t>(pattern.size() * 2);
    for (int64_t off = 0; off < layout.total_bytes(); off += pattern_bytes) {
      std::memcpy(arena->data() + off, pattern.data(),
                  static_cast<size_t>(std::min(pattern_bytes, layout.total_bytes() - off)));
    }
  }
  // A device: the same bytes in its arena (block by block, in payload
  // order), q there too.
  std::unique_ptr<KvArena> device_arena;
  std::span<std::byte> device_q, device_out;
  if (device != nullptr) {
    PAGEKV_RETURN_IF_ERROR(device->CheckLayout(layout));
    PAGEKV_ASSIGN_OR_RETURN(device_arena, device->AllocateArena({.size_bytes = layout.total_bytes()}));
    std::vector<std::byte> payload(static_cast<size_t>(layout.bytes_per_block() - layout.padding_bytes_per_block()));
    for (int64_t b = 0; b < layout.num_blocks(); ++b) {
      CpuBackend().BlockToHost(layout, arena->data(), BlockId{static_cast<int32_t>(b)}, payload);
      device->HostToBlock(layout, device_arena->data(), BlockId{static_cast<int32_t>(b)}, payload);
    }
    PAGEKV_RETURN_IF_ERROR(device->Finish());
  }
  // Block tables: the pool's ids shuffled, as a fragmented pool hands them out.
  std::vector<BlockId> ids(static_cast<size_t>(c.num_blocks));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = BlockId{static_cast<int32_t>(i)};
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<DecodeSeq> seqs;
  for (int64_t b = 0; b < s.batch; ++b) {
    seqs.push_back({std::span<const BlockId>(ids).subspan(static_cast<size_t>(b * blocks_per_seq),
                                                          static_cast<size_t>(blocks_per_seq)),
                    s.ctx});
  }
  std::vector<float> weight_buf(weights ? static_cast<size_t>(s.batch * s.heads.kv_heads * s.ctx) : 0);
  if (weights) {
    for (int64_t b = 0; b < s.batch; ++b) seqs[static_cast<size_t>(b)].scores = weight_buf.data() + b * s.heads.kv_heads * s.ctx;
  }
  std::vector<float> q(static_cast<size_t>(s.batch * s.heads.q_heads * kHeadDim));
  for (auto& x : q) x = u(rng);
  std::vector<float> out(q.size());
  AttentionOptions opts;
  opts.num_threads = s.threads;
  if (device != nullptr) {
    device_q = device->Scratch(0, 0, q.size() * sizeof(float));
    device_out = device->Scratch(0, 1, out.size() * sizeof(float));
    if (device_q.empty() || device_out.empty()) return ResourceExhaustedError("no device memory for q and the output");
    device->FromHost(q.data(), device_q.size(), device_q.data());
    PAGEKV_RETURN_IF_ERROR(device->Finish());
  }

  using Clock = std::chrono::steady_clock;
  const Ceilings before = probe.Measure();
  std::vector<double> times;
  // Median seconds per call over the tables in `table` order, into `times`.
  auto time_calls = [&](std::span<const DecodeSeq> calls_seqs) -> Result<double> {
    times.clear();
    double total = 0;
    const int64_t min_calls = quick ? 3 : 5;
    for (int64_t call = 0; call < 1000 && (static_cast<int64_t>(times.size()) < min_calls || total < 0.3); ++call) {
      const PagedKv kv{&layout, device != nullptr ? device_arena->data() : arena->data(),
                       static_cast<int32_t>((call + 1) % c.num_layers)};
      const auto t0 = Clock::now();
      constexpr int kDeviceCalls = 8;
      if (device != nullptr) {
        // Calls back to back as a server's steps enqueue them (each its
        // tables' upload included), then their completion: the time per call.
        for (int i = 0; i < kDeviceCalls; ++i) {
          const PagedKv layer{kv.layout, kv.arena, static_cast<int32_t>((call * kDeviceCalls + i + 1) % c.num_layers)};
          PAGEKV_RETURN_IF_ERROR(device->DecodeAttention(layer, calls_seqs,
                                                         reinterpret_cast<const float*>(device_q.data()),
                                                         reinterpret_cast<float*>(device_out.data()), opts));
        }
        PAGEKV_RETURN_IF_ERROR(device->Finish());
      } else {
        PAGEKV_RETURN_IF_ERROR(PagedDecodeAttention(kv, calls_seqs, q.data(), out.data(), opts));
      }
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count() / (device != nullptr ? kDeviceCalls : 1);
      if (call == 0) continue;  // warm-up: thread pool start, page walk caches
      times.push_back(dt);
      total += dt;
    }
    return Median(times);
  };
  PAGEKV_ASSIGN_OR_RETURN(const double seconds, time_calls(seqs));
  const auto calls = static_cast<int64_t>(times.size());
  double head_major_seconds = 0;
  if (peer_head_major) {
    // The same pool with each sequence's blocks in order: sequence b owns
    // slabs [b * blocks_per_seq, (b + 1) * blocks_per_seq) of every (layer,
    // head), one contiguous run per (sequence, head).
    std::vector<BlockId> in_order(ids.size());
    for (size_t i = 0; i < in_order.size(); ++i) in_order[i] = BlockId{static_cast<int32_t>(i)};
    std::vector<DecodeSeq> peer = seqs;
    for (int64_t b = 0; b < s.batch; ++b) {
      peer[static_cast<size_t>(b)].blocks = std::span<const BlockId>(in_order).subspan(
          static_cast<size_t>(b * blocks_per_seq), static_cast<size_t>(blocks_per_seq));
    }
    PAGEKV_ASSIGN_OR_RETURN(head_major_seconds, time_calls(peer));
  }

  double mla_total_seconds = 0;
  if (mla) {
    // The whole absorbed attention: the per-head query in, the latent
    // kernel, W_UV out (random f32 weights, as a model keeps them dequantized).
    std::normal_distribution<float> wn(0.0f, 0.05f);
    std::vector<float> w_uk(static_cast<size_t>(s.heads.q_heads) * kMlaNope * kMlaRank);
    std::vector<float> w_uv(static_cast<size_t>(s.heads.q_heads) * kMlaV * kMlaRank);
    for (float& x : w_uk) x = wn(rng);
    for (float& x : w_uv) x = wn(rng);
    const MlaWeights w{w_uk.data(), w_uv.data(), kMlaNope, kMlaV};
    std::vector<float> q_head(static_cast<size_t>(s.batch * s.heads.q_heads * (kMlaNope + kMlaRope)));
    for (float& x : q_head) x = u(rng);
    std::vector<float> o_head(static_cast<size_t>(s.batch * s.heads.q_heads * kMlaV));
    std::vector<double> total;
    for (int64_t call = 0; call < 1000 && (static_cast<int64_t>(total.size()) < (quick ? 3 : 5) ||
                                            std::accumulate(total.begin(), total.end(), 0.0) < 0.3);
         ++call) {
      const PagedKv kv{&layout, arena->data(), static_cast<int32_t>((call + 1) % c.num_layers)};
      const auto t0 = Clock::now();
      PAGEKV_RETURN_IF_ERROR(MlaDecodeAttention(kv, seqs, q_head.data(), w, o_head.data(), opts));
      if (call > 0) total.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    mla_total_seconds = Median(total);
  }
  const Ceilings after = probe.Measure();
  const Ceilings ceilings{std::max(before.stream_gbps, after.stream_gbps), std::max(before.fma_gflops, after.fma_gflops)};
  AttentionBenchResult r;
  r.stream_read_gbps = ceilings.stream_gbps;
  r.fma_gflops = ceilings.fma_gflops;
  r.batch = s.batch;
  r.ctx = s.ctx;
  r.q_heads = s.heads.q_heads;
  r.kv_heads = s.heads.kv_heads;
  r.head_dim = kHeadDim;
  r.block_len = s.block_len;
  r.dtype = s.dtype;
  r.threads = s.threads;
  r.calls = calls;
  r.seconds_per_call = seconds;
  if (head_major_seconds > 0) {
    r.head_major_seconds = head_major_seconds;
    r.ratio_to_head_major = head_major_seconds / seconds;
  }
  const int64_t group = s.heads.q_heads / s.heads.kv_heads;
  // K and V of one layer, scales (and KIVI's key-group parameters) included.
  r.kv_bytes = s.batch * s.ctx * (layout.bytes_per_token() / layout.num_layers());
  r.flops = static_cast<double>(s.batch * s.ctx * s.heads.kv_heads) * 2.0 * (2.0 * group * kHeadDim);
  r.gbps = static_cast<double>(r.kv_bytes) / r.seconds_per_call / 1e9;
  r.ratio_to_stream = r.gbps / ceilings.stream_gbps;
  const double mem_floor = static_cast<double>(r.kv_bytes) / (ceilings.stream_gbps * 1e9);
  const double fma_floor = ceilings.fma_gflops > 0 ? r.flops / (ceilings.fma_gflops * 1e9) : 0.0;
  r.floor_seconds = std::max(mem_floor, fma_floor);
  r.bound = mem_floor >= fma_floor ? "memory" : "compute";
  r.ratio_to_roofline = r.floor_seconds / r.seconds_per_call;
  r.rotation_bytes = layout.total_bytes();
  r.attention_weights = weights;
  r.mla = mla;
  r.mla_total_seconds = mla_total_seconds;

  if (scalar_baseline && !scaled && !mla && device == nullptr) {  // the scalar loop reads 16-bit values
    // The same values, contiguous per (sequence, head), read by a plain loop.
    const size_t n = static_cast<size_t>(s.batch * s.heads.kv_heads * s.ctx * kHeadDim);
    std::vector<uint16_t> k(n), v(n);
    for (size_t i = 0; i < n; ++i) k[i] = pattern[i % pattern.size()];
    for (size_t i = 0; i < n; ++i) v[i] = pattern[(i * 7 + 3) % pattern.size()];
    const auto t0 = Clock::now();
    ScalarContiguous(s, kHeadDim, k.data(), v.data(), q.data(), out.data());
    r.scalar_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    r.speedup_vs_scalar = r.scalar_seconds / r.seconds_per_call;
  }
  return r;
}

}  // namespace

Result<AttentionBenchReport> RunAttentionBench(const AttentionBenchOptions& options) {
  AttentionBenchReport report;
  PAGEKV_ASSIGN_OR_RETURN(const std::unique_ptr<Backend> device, MakeDeviceBackend(options.device, {.tensor_cores = options.tensor_cores}));
  report.device = device != nullptr ? device->name() : "cpu";
  report.threads = options.num_threads > 0 ? options.num_threads : ThreadPool::Shared().num_threads();
  report.simd_target = device != nullptr ? "CUDA" : AttentionSimdTarget();
  const bool quick = options.set == BenchSet::kQuick;
  // The stream buffer: many times the last-level cache (~32 MiB effective;
  // a GPU's L2, 50-60 MiB on Hopper, likewise).
  const int64_t probe_bytes = quick ? (int64_t{256} << 20) : (int64_t{1} << 30);
  CeilingProbe all = device != nullptr ? CeilingProbe(device.get(), probe_bytes) : CeilingProbe(report.threads, probe_bytes);
  if (!all.ok()) return ResourceExhaustedError("could not map the bandwidth probe buffer");
  const Ceilings start = all.Measure();
  report.stream_read_gbps = start.stream_gbps;
  report.fma_gflops = start.fma_gflops;
  // Rows with fewer threads are judged against ceilings of that many threads.
  std::unique_ptr<CeilingProbe> single;
  for (const Shape& s : Grid(options, report.threads)) {
    if (device != nullptr && s.threads != report.threads) continue;  // threads are the host's
    if (s.threads != report.threads && single == nullptr) {
      single = std::make_unique<CeilingProbe>(s.threads, probe_bytes);
      if (!single->ok()) return ResourceExhaustedError("could not map the bandwidth probe buffer");
    }
    const CeilingProbe& probe = s.threads == report.threads ? all : *single;
    Result<AttentionBenchResult> r =
        RunShape(s, probe, quick, options.scalar_baseline, options.attention_weights, options.peer_head_major,
                 options.mla, device.get());
    if (!r.ok()) {
      const StatusCode code = r.status().code();
      if (code != StatusCode::kResourceExhausted && code != StatusCode::kUnimplemented) return r.status();
      report.skipped.push_back("batch " + std::to_string(s.batch) + " ctx " + std::to_string(s.ctx) + " heads " +
                               std::to_string(s.heads.q_heads) + "/" + std::to_string(s.heads.kv_heads) +
                               " block_len " + std::to_string(s.block_len) + " " + std::string(DTypeName(s.dtype)) +
                               ": " + r.status().message());
      continue;
    }
    if (options.on_result) options.on_result(*r);
    report.results.push_back(*r);
  }
  return report;
}

}  // namespace pagekv
