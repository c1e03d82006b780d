// The peer for `pagekv bench attention`: ggml's CPU flash attention
// (`ggml_flash_attn_ext`, what llama.cpp runs for decode with -fa) over a
// contiguous head-major f16 cache, [batch][kv_head][token][dim], ggml's
// best case, timed the way the PageKV benchmark times its own kernel: one
// query token per sequence, the calls rotating over copies of K and V that
// together hold at least 256 MiB (so every call reads DRAM), the first call
// dropped, the median of at least five calls and 0.3 s. Built against a
// llama.cpp / ggml build beside the project by scripts/ggml-attention-peer.sh
// (nothing of ggml is committed here). Prints one JSON object per shape,
// with the largest error of the first copy's output (a quarter of the heads)
// against a double-precision reference.
//
//   ggml_attention_peer --threads 2 --ctx 4096 --batch 1,8 --heads 32/32,32/8,64/8
#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int64_t kHeadDim = 128;
constexpr int64_t kRotationBytes = int64_t{256} << 20;

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t at = 0;
  while (true) {
    const size_t next = s.find(sep, at);
    out.push_back(s.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (next == std::string::npos) return out;
    at = next + 1;
  }
}

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "ggml_attention_peer: %s\nusage: ggml_attention_peer [--threads N] [--ctx N] [--batch B,..] "
               "[--heads Q/KV,..]\n",
               why);
  std::exit(2);
}

int64_t Positive(const std::string& s, const char* what) {
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (end == s.c_str() || *end != '\0' || v <= 0) Usage(what);
  return v;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Shape {
  int64_t batch, ctx, q_heads, kv_heads;
};

void Run(const Shape& s, int threads, ggml_threadpool* pool) {
  const int64_t kv_bytes = s.batch * s.ctx * s.kv_heads * kHeadDim * 2 * 2;  // K and V, f16
  const int64_t copies = std::max<int64_t>(2, (kRotationBytes + kv_bytes - 1) / kv_bytes);
  const size_t q_bytes = static_cast<size_t>(s.batch * s.q_heads * kHeadDim * 4);
  const size_t mem = static_cast<size_t>(copies * kv_bytes) + q_bytes * (copies + 1) +
                     static_cast<size_t>(copies + 2) * (ggml_tensor_overhead() * 4 + ggml_graph_overhead()) +
                     (size_t{16} << 20);
  ggml_init_params params{mem, nullptr, false};
  ggml_context* ctx = ggml_init(params);
  if (ctx == nullptr) {
    std::fprintf(stderr, "ggml_init of %zu bytes failed\n", mem);
    std::exit(1);
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, kHeadDim, 1, s.q_heads, s.batch);
  for (int64_t i = 0; i < ggml_nelements(q); ++i) static_cast<float*>(q->data)[i] = u(rng);
  std::vector<float> row(static_cast<size_t>(kHeadDim * s.ctx));
  std::vector<ggml_cgraph*> graphs;
  std::vector<ggml_cplan> plans;
  std::vector<std::vector<uint8_t>> work;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (int64_t c = 0; c < copies; ++c) {
    ggml_tensor* k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, kHeadDim, s.ctx, s.kv_heads, s.batch);
    ggml_tensor* v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, kHeadDim, s.ctx, s.kv_heads, s.batch);
    for (ggml_tensor* t : {k, v}) {
      const int64_t slabs = s.kv_heads * s.batch;
      for (int64_t h = 0; h < slabs; ++h) {
        for (float& x : row) x = u(rng);
        ggml_fp32_to_fp16_row(row.data(), static_cast<ggml_fp16_t*>(t->data) + h * kHeadDim * s.ctx,
                              kHeadDim * s.ctx);
      }
    }
    ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, nullptr, scale, 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    ggml_cgraph* gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_cplan plan = ggml_graph_plan(gf, threads, pool);
    work.emplace_back(plan.work_size);
    plan.work_data = work.back().data();
    graphs.push_back(gf);
    plans.push_back(plan);
  }
  // The first copy's result against a double-precision reference, so that
  // the time below is the time of the whole attention.
  if (ggml_graph_compute(graphs[0], &plans[0]) != GGML_STATUS_SUCCESS) {
    std::fprintf(stderr, "ggml_graph_compute failed\n");
    std::exit(1);
  }
  double max_err = 0;
  {
    const ggml_tensor* out = ggml_graph_node(graphs[0], -1);
    const ggml_tensor* k = out->src[1];
    const ggml_tensor* v = out->src[2];
    const int64_t group = s.q_heads / s.kv_heads;
    std::vector<double> p(static_cast<size_t>(s.ctx));
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.q_heads; h += std::max<int64_t>(1, s.q_heads / 4)) {
        const float* qh = static_cast<const float*>(q->data) + kHeadDim * (h + s.q_heads * b);
        const int64_t slab = kHeadDim * s.ctx * (h / group + s.kv_heads * b);
        const auto* kh = static_cast<const ggml_fp16_t*>(k->data) + slab;
        const auto* vh = static_cast<const ggml_fp16_t*>(v->data) + slab;
        double m = -INFINITY, sum = 0;
        for (int64_t t = 0; t < s.ctx; ++t) {
          double dot = 0;
          for (int64_t j = 0; j < kHeadDim; ++j) dot += double(qh[j]) * ggml_fp16_to_fp32(kh[t * kHeadDim + j]);
          p[t] = dot * scale;
          m = std::max(m, p[t]);
        }
        for (double& x : p) sum += (x = std::exp(x - m));
        const float* o = static_cast<const float*>(out->data) + kHeadDim * (h + s.q_heads * b);
        for (int64_t j = 0; j < kHeadDim; ++j) {
          double acc = 0;
          for (int64_t t = 0; t < s.ctx; ++t) acc += p[t] * ggml_fp16_to_fp32(vh[t * kHeadDim + j]);
          max_err = std::max(max_err, std::fabs(acc / sum - o[j]));
        }
      }
    }
  }
  using Clock = std::chrono::steady_clock;
  std::vector<double> times;
  double total = 0;
  for (int64_t call = 0; call < 1000 && (times.size() < 5 || total < 0.3); ++call) {
    const size_t i = static_cast<size_t>((call + 1) % copies);
    const auto t0 = Clock::now();
    if (ggml_graph_compute(graphs[i], &plans[i]) != GGML_STATUS_SUCCESS) {
      std::fprintf(stderr, "ggml_graph_compute failed\n");
      std::exit(1);
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (call == 0) continue;
    times.push_back(dt);
    total += dt;
  }
  const double seconds = Median(times);
  std::printf(
      "{\"peer\": \"ggml_flash_attn_ext\", \"layout\": \"head-major\", \"dtype\": \"f16\", \"batch\": %lld, \"ctx\": "
      "%lld, \"q_heads\": %lld, \"kv_heads\": %lld, \"head_dim\": %lld, \"threads\": %d, \"copies\": %lld, "
      "\"calls\": %zu, \"seconds_per_call\": %.9g, \"kv_bytes\": %lld, \"gbps\": %.4f, \"max_abs_error\": %.3g}\n",
      static_cast<long long>(s.batch), static_cast<long long>(s.ctx), static_cast<long long>(s.q_heads),
      static_cast<long long>(s.kv_heads), static_cast<long long>(kHeadDim), threads,
      static_cast<long long>(copies), times.size(), seconds, static_cast<long long>(kv_bytes),
      static_cast<double>(kv_bytes) / seconds / 1e9, max_err);
  std::fflush(stdout);
  ggml_free(ctx);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  std::vector<int64_t> ctxs = {4096}, batches = {1, 8};
  std::vector<std::pair<int64_t, int64_t>> heads = {{32, 32}, {32, 8}, {64, 8}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) Usage(("missing value after " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--threads") {
      threads = static_cast<int>(Positive(v, "--threads needs a positive integer"));
    } else if (a == "--ctx" || a == "--batch") {
      std::vector<int64_t>& dst = a == "--ctx" ? ctxs : batches;
      dst.clear();
      for (const std::string& x : Split(v, ',')) dst.push_back(Positive(x, "--ctx / --batch need positive integers"));
    } else if (a == "--heads") {
      heads.clear();
      for (const std::string& x : Split(v, ',')) {
        const std::vector<std::string> qk = Split(x, '/');
        if (qk.size() != 2) Usage("--heads takes Q/KV pairs, e.g. 32/8");
        const int64_t qh = Positive(qk[0], "--heads: bad Q"), kh = Positive(qk[1], "--heads: bad KV");
        if (qh % kh != 0) Usage("--heads: Q must be a multiple of KV");
        heads.emplace_back(qh, kh);
      }
    } else {
      Usage(("unknown option " + a).c_str());
    }
  }
  ggml_cpu_init();
  ggml_threadpool_params tp = ggml_threadpool_params_default(threads);
  ggml_threadpool* pool = ggml_threadpool_new(&tp);
  for (const auto& [qh, kh] : heads)
    for (int64_t ctx : ctxs)
      for (int64_t b : batches) Run({b, ctx, qh, kh}, threads, pool);
  ggml_threadpool_free(pool);
  return 0;
}
