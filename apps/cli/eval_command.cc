// `pagekv eval kv`: what a smaller KV format costs on a real model.
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

struct EvalArgs {
  std::string model, tokenizer, goldens = "../shared/goldens/stories260K.json", kv_dtype = "int8", policy = "none",
      layer_dtypes;
  double budget = 1.0, prompt_fraction = 0.5;
  int32_t continuations = 4, block_len = 32;
  int64_t max_len = 0;
  int threads = 0;
  bool json = false, no_speed = false, table = false;
  std::string rotate = "none";
};

nlohmann::ordered_json ReportJson(const KvEvalReport& r) {
  return nlohmann::ordered_json{{"kv_dtype", r.kv_dtype},
                                {"policy", r.policy},
                                {"budget", r.budget},
                                {"positions", r.positions},
                                {"kl_mean", r.kl_mean},
                                {"kl_max", r.kl_max},
                                {"top1_agreement", r.top1_agreement},
                                {"nll_ref", r.nll_ref},
                                {"nll", r.nll},
                                {"nll_change_rel", r.nll_change_rel},
                                {"bytes_per_token", r.bytes_per_token},
                                {"bytes_per_token_f16", r.bytes_per_token_f16},
                                {"bytes_ratio_vs_f16", r.bytes_ratio_vs_f16},
                                {"kept_fraction", r.kept_fraction},
                                {"effective_bytes_ratio_vs_f16", r.effective_bytes_ratio_vs_f16},
                                {"decode_speedup_vs_f16", r.decode_speedup_vs_f16},
                                {"speed_shape", r.speed_shape}};
}

// The results table: every stored format with every token kept, then every
// eviction policy at the budget (f16 storage), one row each.
int RunEvalTable(const EvalArgs& a, KvEvalOptions o) {
  struct Row {
    DType dtype;
    const char* policy;
    const char* layers = "";
    bool hadamard = false;
  };
  const double budget = a.budget < 1 ? a.budget : 0.2;
  std::vector<Row> rows = {{DType::kF16, "none"},          {DType::kBF16, "none"},          {DType::kInt8, "none"},
                           {DType::kInt8, "none", "", true},
                           {DType::kInt8, "none", "0=f16,-1=f16"}, {DType::kInt4, "none"},
                           {DType::kFP8E4M3, "none"},      {DType::kFP8E5M2, "none"},       {DType::kF16, "streaming"},
                           {DType::kF16, "h2o"},           {DType::kF16, "snapkv"}};
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  if (!a.json) {
    std::printf("| format | policy | budget | bytes/token (x f16) | kept | effective bytes (x f16) | decode speed (x f16) "
                "| top-1 agreement | KL mean (nats) | NLL change |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  }
  for (const Row& row : rows) {
    o.kv_dtype = row.dtype;
    o.layer_dtypes = row.layers;
    o.hadamard = row.hadamard;
    o.policy = row.policy;
    o.budget = std::string(row.policy) == "none" ? 1.0 : budget;
    Result<KvEvalReport> r = EvalKv(o);
    if (!r.ok()) {
      std::fprintf(stderr, "error: %s / %s: %s\n", DTypeName(row.dtype).data(), row.policy, r.status().message().c_str());
      return r.status().code() == StatusCode::kInternal ? kExitFailed : kExitBadInput;
    }
    if (a.json) {
      all.push_back(ReportJson(*r));
      continue;
    }
    std::printf("| %s | %s | %.0f%% | %ld (%.3f) | %.3f | %.3f | %s | %.2f%% | %.3g | %+.2f%% |\n", r->kv_dtype.c_str(),
                r->policy.c_str(), 100 * r->budget, static_cast<long>(r->bytes_per_token), r->bytes_ratio_vs_f16,
                r->kept_fraction, r->effective_bytes_ratio_vs_f16,
                r->decode_speedup_vs_f16 > 0 ? (std::to_string(r->decode_speedup_vs_f16).substr(0, 4) + "x").c_str() : "-",
                100 * r->top1_agreement, r->kl_mean, 100 * r->nll_change_rel);
    std::fflush(stdout);
  }
  if (a.json) std::printf("%s\n", all.dump(2).c_str());
  return kExitOk;
}

int RunEvalKv(const EvalArgs& a) {
  KvEvalOptions o;
  o.model_path = a.model;
  o.tokenizer_path = a.tokenizer;
  o.goldens_path = a.goldens;
  Result<DType> dt = ParseDType(a.kv_dtype);
  if (!dt.ok()) {
    std::fprintf(stderr, "error: --kv-dtype: %s\n", dt.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_dtype = *dt;
  o.layer_dtypes = a.layer_dtypes;
  o.hadamard = a.rotate == "hadamard";
  o.policy = a.policy;
  o.budget = a.budget;
  o.continuations = a.continuations;
  o.max_len = a.max_len;
  o.block_len = a.block_len;
  o.threads = a.threads;
  o.measure_speed = !a.no_speed;
  o.prompt_fraction = a.prompt_fraction;
  if (a.table) return RunEvalTable(a, o);
  Result<KvEvalReport> r = EvalKv(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    return r.status().code() == StatusCode::kInternal ? kExitFailed : kExitBadInput;
  }
  if (a.json) {
    std::printf("%s\n", ReportJson(*r).dump(2).c_str());
    return kExitOk;
  }
  std::printf("KV %s, policy %s (budget %.0f%%), against the f32 cache over %ld positions\n", r->kv_dtype.c_str(),
              r->policy.c_str(), 100 * r->budget, static_cast<long>(r->positions));
  std::printf("  next-token KL divergence  mean %.3g nats, max %.3g\n", r->kl_mean, r->kl_max);
  std::printf("  top-1 agreement           %.2f%%\n", 100 * r->top1_agreement);
  std::printf("  golden text NLL           %.6f -> %.6f nats (%+.3f%%)\n", r->nll_ref, r->nll, 100 * r->nll_change_rel);
  std::printf("  KV bytes per token        %ld (%.3fx f16's %ld)\n", static_cast<long>(r->bytes_per_token),
              r->bytes_ratio_vs_f16, static_cast<long>(r->bytes_per_token_f16));
  if (r->policy != "none") {
    std::printf("  tokens kept               %.1f%% on average (%.3fx f16's bytes in all)\n", 100 * r->kept_fraction,
                r->effective_bytes_ratio_vs_f16);
  }
  if (r->decode_speedup_vs_f16 > 0) {
    std::printf("  decode attention          %.2fx f16's speed (%s)\n", r->decode_speedup_vs_f16, r->speed_shape.c_str());
  }
  return kExitOk;
}

}  // namespace

CLI::App* AddEvalCommand(CLI::App& app, int& exit_code) {
  static EvalArgs args;
  CLI::App* eval = app.add_subcommand("eval", "Measure what a compressed KV cache costs in fidelity");
  eval->require_subcommand(1);
  CLI::App* kv = eval->add_subcommand("kv", "A KV format against the f32 cache: KL, top-1 agreement, NLL, bytes, speed");
  kv->add_option("--model", args.model, "Model: a .gguf file, or a llama2.c .bin (with --tokenizer)")->required();
  kv->add_option("--tokenizer", args.tokenizer, "llama2.c tokenizer.bin (for .bin checkpoints)");
  kv->add_option("--goldens", args.goldens, "Goldens JSON with prompts and the NLL text: ../shared's layout (the default, "
                 "../shared/goldens/stories260K.json) or tools/reference.py's (tests/data/smollm2-goldens.json)");
  kv->add_option("--kv-dtype", args.kv_dtype, "KV format under test: int8 (default), int4 (KIVI), fp8_e4m3, fp8_e5m2, f16, bf16, f32");
  kv->add_option("--kv-layer-dtypes", args.layer_dtypes,
                 "Per-layer overrides of --kv-dtype: LAYERS=DTYPE,... (index, -1 = last, or a:b), e.g. 0=f16,-1=f16");
  kv->add_option("--kv-rotate", args.rotate,
                 "none (default) or hadamard: int8 / fp8 rows stored rotated by the Hadamard transform")
      ->check(CLI::IsMember({"none", "hadamard"}));
  kv->add_option("--policy", args.policy, "Token eviction: none (default), streaming, h2o, snapkv");
  kv->add_option("--budget", args.budget, "Fraction of tokens kept, (0, 1] (default 1; the table's policies: 0.2)");
  kv->add_option("--prompt-fraction", args.prompt_fraction,
                 "Share of each sequence prefilled as the prompt; the rest is decoded and scored (default 0.5)");
  kv->add_flag("--table", args.table,
               "The whole results table: f16, bf16, int8 (and with f16 ends), int4, fp8 with every token kept, then streaming, h2o and snapkv "
               "at --budget (0.2 unless given) on f16");
  kv->add_option("--continuations", args.continuations, "Sampled sequences to the full context (default 4)")
      ->check(CLI::Range(0, 64));
  kv->add_option("--max-len", args.max_len,
                 "End each sequence and the NLL text at this many tokens (default: the model's trained context)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  kv->add_option("--block-len", args.block_len, "Tokens per KV block (default 32; int4 needs a multiple of its 32-token groups)");
  kv->add_option("--threads", args.threads, "Threads (default: all cores)")->check(CLI::Range(0, 4096));
  kv->add_flag("--no-speed", args.no_speed, "Skip the decode-kernel speed comparison");
  kv->add_flag("--json", args.json, "One JSON object");
  kv->callback([&exit_code] { exit_code = RunEvalKv(args); });
  return eval;
}

}  // namespace pagekv::cli
