// `pagekv bench attention`: decode attention against the roofline measured in
// the same run (on the CPU, or a GPU with --device); a readable table, or one
// JSON object with --json. Registered under `bench` (bench_command.cc).
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "machine_output.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

struct BenchArgs {
  bool json = false, quick = false, full = false, no_scalar = false, weights = false;
  int threads = 0;
  std::vector<int64_t> batches, contexts;
  std::vector<int32_t> block_lens;
  std::vector<std::string> heads, dtypes;
  std::string peer_layout;
  bool mla = false;
  std::string device = "cpu";
  bool tensor_cores = false;
};

nlohmann::ordered_json ToJson(const AttentionBenchReport& r) {
  nlohmann::ordered_json j;
  j["machine"] = MachineJson();
  j["device"] = r.device;
  j["simd_target"] = r.simd_target;
  j["threads"] = r.threads;
  j["stream_read_gbps"] = r.stream_read_gbps;
  j["fma_gflops"] = r.fma_gflops;
  j["results"] = nlohmann::ordered_json::array();
  for (const AttentionBenchResult& x : r.results) {
    nlohmann::ordered_json e;
    e["batch"] = x.batch;
    e["ctx"] = x.ctx;
    e["q_heads"] = x.q_heads;
    e["kv_heads"] = x.kv_heads;
    e["head_dim"] = x.head_dim;
    e["block_len"] = x.block_len;
    e["dtype"] = std::string(DTypeName(x.dtype));
    e["threads"] = x.threads;
    e["seconds_per_call"] = x.seconds_per_call;
    e["kv_bytes"] = x.kv_bytes;
    e["gbps"] = x.gbps;
    e["ratio_to_stream"] = x.ratio_to_stream;
    e["ratio_to_roofline"] = x.ratio_to_roofline;
    e["bound"] = x.bound;
    e["floor_seconds"] = x.floor_seconds;
    e["flops"] = x.flops;
    e["calls"] = x.calls;
    e["attention_weights"] = x.attention_weights;
    e["rotation_bytes"] = x.rotation_bytes;
    e["row_stream_read_gbps"] = x.stream_read_gbps;
    e["row_fma_gflops"] = x.fma_gflops;
    if (x.head_major_seconds > 0) {
      e["head_major_seconds"] = x.head_major_seconds;
      e["ratio_to_head_major"] = x.ratio_to_head_major;
    }
    if (x.mla) {
      e["mla"] = true;
      e["mla_total_seconds"] = x.mla_total_seconds;  // with the W_UK / W_UV products
    }
    if (x.scalar_seconds > 0) {
      e["scalar_contiguous_seconds"] = x.scalar_seconds;
      e["speedup_vs_scalar"] = x.speedup_vs_scalar;
    }
    j["results"].push_back(e);
  }
  j["skipped"] = r.skipped;
  return j;
}

void PrintRow(const AttentionBenchResult& x) {
  std::printf("%5ld %6ld %4d/%-3d %5d %5s %3d %10.3f %7.1f %7.2f %9.2f %-8s %8s %10s\n", x.batch, x.ctx, x.q_heads,
              x.kv_heads, x.block_len, std::string(DTypeName(x.dtype)).c_str(), x.threads,
              x.seconds_per_call * 1e3, x.gbps, x.ratio_to_stream, x.ratio_to_roofline, x.bound.c_str(),
              x.scalar_seconds > 0 ? fmt::format("{:.1f}x", x.speedup_vs_scalar).c_str() : "-",
              x.head_major_seconds > 0 ? fmt::format("{:.2f}", x.ratio_to_head_major).c_str() : "-");
  if (x.mla) std::printf("      absorbed MLA with its W_UK / W_UV products: %.3f ms/call\n", x.mla_total_seconds * 1e3);
  std::fflush(stdout);
}

int RunBench(const BenchArgs& a) {
  if (a.quick && a.full) {
    std::fprintf(stderr, "error: --quick and --full exclude each other: pick one (or neither for the default set)\n");
    return kExitBadInput;
  }
  if (a.threads < 0) {
    std::fprintf(stderr, "error: --threads %d: must be positive (0 or absent = all cores)\n", a.threads);
    return kExitBadInput;
  }
  AttentionBenchOptions o;
  o.batches = a.batches;
  o.contexts = a.contexts;
  o.block_lens = a.block_lens;
  for (const std::string& h : a.heads) {
    int q = 0, kv = 0;
    char extra = 0;
    if (std::sscanf(h.c_str(), "%d/%d%c", &q, &kv, &extra) != 2 || q <= 0 || kv <= 0 || q % kv != 0) {
      std::fprintf(stderr, "error: --heads %s: use Q/KV with Q a multiple of KV, e.g. 32/8\n", h.c_str());
      return kExitBadInput;
    }
    o.heads.push_back({q, kv});
  }
  for (const std::string& d : a.dtypes) {
    Result<DType> dt = ParseDType(d);
    if (!dt.ok()) {
      std::fprintf(stderr, "error: --dtype %s: use f32, f16, bf16, int8, fp8_e4m3, fp8_e5m2 or int4\n", d.c_str());
      return kExitBadInput;
    }
    o.dtypes.push_back(*dt);
  }
  for (int64_t v : a.batches) if (v <= 0) { std::fprintf(stderr, "error: --batch must be positive\n"); return kExitBadInput; }
  for (int64_t v : a.contexts) if (v <= 0) { std::fprintf(stderr, "error: --ctx must be positive\n"); return kExitBadInput; }
  for (int32_t v : a.block_lens) {
    if (v < 8 || v > 1024 || (v & (v - 1)) != 0) {
      std::fprintf(stderr, "error: --block-len %d: must be a power of two in [8, 1024]\n", v);
      return kExitBadInput;
    }
  }
  o.set = a.quick ? BenchSet::kQuick : (a.full ? BenchSet::kFull : BenchSet::kDefault);
  o.num_threads = a.threads;
  o.scalar_baseline = !a.no_scalar;
  o.attention_weights = a.weights;
  if (!a.peer_layout.empty() && a.peer_layout != "head-major") {
    std::fprintf(stderr, "error: --peer-layout '%s': the one peer layout is head-major\n", a.peer_layout.c_str());
    return kExitBadInput;
  }
  o.peer_head_major = a.peer_layout == "head-major";
  o.mla = a.mla;
  o.device = a.device;
  o.tensor_cores = a.tensor_cores;
  if (a.mla) {
    for (const auto& [q, kv] : o.heads) {
      if (kv != 1) {
        std::fprintf(stderr, "error: --mla --heads %d/%d: a latent cache has one row per token: use Q/1\n", q, kv);
        return kExitBadInput;
      }
    }
  }
  // The header with the first row, so that a run that cannot start (no
  // such device) prints its one-line error alone.
  bool header_printed = false;
  auto print_header = [&] {
    if (header_printed || a.json) return;
    header_printed = true;
    PrintMachine();
    std::printf(a.mla ? "decode MLA attention, DeepSeek-V3 latent rows (rank 512 + rope 64), block tables shuffled; "
                        "ratios against ceilings measured now\n"
                      : "decode attention, head_dim 128, block tables shuffled; ratios against ceilings measured now\n");
    std::printf("%5s %6s %8s %5s %5s %3s %10s %7s %7s %9s %-8s %8s %10s\n", "batch", "ctx", "q/kv", "block", "dtype",
                "thr", "ms/call", "GB/s", "stream", "roofline", "bound", "vs scalar", "head-major");
  };
  if (!a.json) {
    o.on_result = [&](const AttentionBenchResult& row) {
      print_header();
      PrintRow(row);
    };
  }
  Result<AttentionBenchReport> r = RunAttentionBench(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    const StatusCode c = r.status().code();
    return c == StatusCode::kInvalidArgument || c == StatusCode::kUnavailable ? kExitBadInput : kExitFailed;
  }
  if (a.json) {
    std::printf("%s\n", ToJson(*r).dump(2).c_str());
  } else {
    print_header();
    if (r->device != "cpu") {
      std::printf("ceiling (%s): device read %.1f GB/s (a streaming read kernel; rows judged by memory)\n",
                  r->device.c_str(), r->stream_read_gbps);
    } else {
      std::printf("ceilings (%d threads, %s): stream read %.1f GB/s, fp32 FMA %.1f GFLOP/s\n", r->threads,
                  r->simd_target.c_str(), r->stream_read_gbps, r->fma_gflops);
    }
    for (const std::string& why : r->skipped) std::printf("skipped: %s\n", why.c_str());
  }
  return kExitOk;
}

}  // namespace

void AddBenchAttentionCommand(CLI::App& bench, int& exit_code) {
  static BenchArgs args;
  CLI::App* attn = bench.add_subcommand("attention", "Paged decode attention vs the memory/FMA roofline");
  attn->add_flag("--json", args.json, "Print one JSON object");
  attn->add_flag("--quick", args.quick, "A seconds-long smoke run");
  attn->add_flag("--full", args.full, "The whole grid (batch, context, block_len, threads)");
  attn->add_flag("--no-scalar", args.no_scalar, "Skip the contiguous scalar baseline");
  attn->add_flag("--weights", args.weights, "The kernel also reports every token's attention weight (H2O's input)");
  attn->add_option("--threads", args.threads, "Threads (default: all cores)");
  attn->add_option("--batch", args.batches, "Batch sizes to run instead of the set's")->delimiter(',');
  attn->add_option("--ctx", args.contexts, "Context lengths instead of the set's")->delimiter(',');
  attn->add_option("--block-len", args.block_lens, "Block lengths instead of the set's")->delimiter(',');
  attn->add_option("--heads", args.heads, "Head configs Q/KV instead of the set's, e.g. 32/8")->delimiter(',');
  attn->add_option("--dtype", args.dtypes, "KV dtypes instead of the set's (f16, bf16, int8; also f32, fp8_e4m3, fp8_e5m2, int4)")->delimiter(',');
  attn->add_flag("--mla", args.mla,
                 "Multi-head latent attention on DeepSeek-V3's latent cache (128 query heads over one 512 + 64 row "
                 "per token; --heads Q/1 to change the heads)");
  attn->add_option("--device", args.device,
                   "cpu (default), or cuda / cuda:N: the same shapes in GPU memory through the CUDA backend, against "
                   "the device's read bandwidth measured in the same run");
  attn->add_flag("--tensor-cores", args.tensor_cores, "On a CUDA device: attention of f16 / bf16 caches (head_dim a multiple of 16 up to 128) on the tensor cores, " "prompt chunks and decode steps (not yet the default: not yet run on a GPU)");
  attn->add_option("--peer-layout", args.peer_layout,
                   "Also time each shape on a contiguous cache: head-major (the same kernel, every (sequence, head) "
                   "one run); the column is its time over the paged one");
  attn->callback([&exit_code] { exit_code = RunBench(args); });
}

}  // namespace pagekv::cli
