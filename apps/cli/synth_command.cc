// `pagekv synth-model`: a deterministic random-weight GGUF (llama, qwen2 or
// deepseek2) at a preset's shape, for benchmarks and tests that need a model
// of real size.
#include <cstdio>
#include <string>

#include "commands.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

struct SynthArgs {
  std::string preset, out, weight_type = "f32";
  uint64_t seed = 0;
  bool list = false;
  // Variants of the preset's architecture (SynthModelSpec); empty / zero
  // keeps the preset's.
  std::string arch, rope_scaling;
  int32_t rope_dims = 0, rope_orig_context = 0;
  double rope_factor = 1.0;
  bool rope_freqs = false;
};

int RunSynth(const SynthArgs& a) {
  if (a.list) {
    for (const SynthModelSpec& s : SynthModelPresets()) {
      if (s.arch == "deepseek2") {
        std::printf("%-20s %3d layers, dim %4d, %2d heads over one latent row of %d + %d, %d experts (%d used, %d shared), "
                    "vocab %5d, context %5d: %.2fM parameters\n",
                    s.name.c_str(), s.num_layers, s.dim, s.num_heads, s.kv_lora_rank, s.qk_rope_dim, s.num_experts,
                    s.experts_used, s.shared_experts, s.vocab_size, s.context_len,
                    static_cast<double>(s.ParameterCount()) / 1e6);
        continue;
      }
      std::printf("%-20s %3d layers, dim %4d, %2d heads / %d KV heads, FFN %4d, vocab %5d, context %5d: %.2fM parameters\n",
                  s.name.c_str(), s.num_layers, s.dim, s.num_heads, s.num_kv_heads, s.hidden_dim, s.vocab_size,
                  s.context_len, static_cast<double>(s.ParameterCount()) / 1e6);
    }
    return kExitOk;
  }
  if (a.preset.empty() || a.out.empty()) {
    std::fprintf(stderr, "error: synth-model needs --preset NAME and --out FILE.gguf (--list shows the presets)\n");
    return kExitBadInput;
  }
  Result<SynthModelSpec> spec = FindSynthModelPreset(a.preset);
  if (!spec.ok()) {
    std::fprintf(stderr, "error: %s\n", spec.status().message().c_str());
    return kExitBadInput;
  }
  if (!a.arch.empty()) {
    if (spec->arch == "deepseek2" || a.arch == "deepseek2") {
      if (a.arch != spec->arch) {
        std::fprintf(stderr, "error: --arch %s does not fit preset %s (%s); deepseek2 shapes come from the "
                             "tiny-deepseek2 presets\n", a.arch.c_str(), spec->name.c_str(), spec->arch.c_str());
        return kExitBadInput;
      }
    }
    spec->arch = a.arch;
  }
  if (a.rope_dims != 0) spec->rope_dims = a.rope_dims;
  if (!a.rope_scaling.empty()) {
    spec->rope_scaling = a.rope_scaling;
    spec->rope_factor = a.rope_factor;
    spec->rope_orig_context = a.rope_orig_context;
  }
  spec->rope_freqs |= a.rope_freqs;
  const Status s = WriteSynthModel(*spec, a.seed, a.weight_type, a.out);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.message().c_str());
    return s.code() == StatusCode::kInvalidArgument ? kExitBadInput : kExitFailed;
  }
  std::printf("wrote %s: synthetic %s, %.1fM parameters, %s weights, seed %llu\n", a.out.c_str(), spec->name.c_str(),
              static_cast<double>(spec->ParameterCount()) / 1e6, a.weight_type.c_str(),
              static_cast<unsigned long long>(a.seed));
  return kExitOk;
}

}  // namespace

CLI::App* AddSynthModelCommand(CLI::App& app, int& exit_code) {
  static SynthArgs args;
  CLI::App* cmd = app.add_subcommand("synth-model", "Write a deterministic random-weight GGUF (llama, qwen2, deepseek2) at a preset's shape");
  cmd->add_option("--preset", args.preset, "Shape: tiny, llama-110m, tiny-deepseek2 (--list shows them)");
  cmd->add_option("--out", args.out, "Output .gguf path (written atomically)");
  cmd->add_option("--seed", args.seed, "Weight seed (default 0): same seed, same file");
  cmd->add_option("--weight-type", args.weight_type, "Matrix storage: f32 (default), f16, bf16, q8_0");
  cmd->add_option("--arch", args.arch,
                  "Architecture of a llama-shaped preset: llama (its default) or qwen2 (q/k/v biases, rotary on halves)")
      ->check(CLI::IsMember({"llama", "qwen2", "deepseek2"}));
  cmd->add_option("--rope-dims", args.rope_dims, "Dimensions of each head that rotate (default: all)");
  cmd->add_option("--rope-scaling", args.rope_scaling, "Rope scaling written to the file: linear, yarn or llama3")
      ->check(CLI::IsMember({"linear", "yarn", "llama3"}));
  cmd->add_option("--rope-factor", args.rope_factor, "Rope scaling factor (default 1)");
  cmd->add_option("--rope-orig-context", args.rope_orig_context, "Rope scaling's original context length");
  cmd->add_flag("--rope-freqs", args.rope_freqs, "Write a rope_freqs tensor of random per-frequency divisors");
  cmd->add_flag("--list", args.list, "List the presets");
  cmd->callback([&exit_code] { exit_code = RunSynth(args); });
  return cmd;
}

}  // namespace pagekv::cli
