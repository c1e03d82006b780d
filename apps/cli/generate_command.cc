// `pagekv generate`: text from a llama-family model on the paged cache, then
// what the cache did.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kv_event_flags.h"
#include "tier_flags.h"
#include "tp_flags.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

struct GenerateArgs {
  std::string model, tokenizer, prompts_file, kv_dtype = "f32", kv_layer_dtypes, kv_cache = "auto";
  std::vector<std::string> prompts;
  int32_t n = -1, top_k = 0, block_len = 16, dump_logits = 0;  // n: -1 = the default (64; chat: until the turn ends)
  float temp = 0.0f, top_p = 1.0f, repeat_penalty = 1.0f;
  std::optional<uint64_t> seed;
  bool chat = false, stop_at_eos = false;
  std::string chat_template, system;
  int64_t blocks = 0;
  int threads = 0, tp = 1, pp = 1, cp = 1;
  bool block_len_given = false;
  bool json = false, truncate = false, prefix_cache = false;
  std::string cache_salt;
  bool salt_given = false;
  KvEventArgs kv_events;
  TierArgs tiers;
  std::string kv_policy = "none", kv_rotate = "none";
  double kv_keep = 1.0;
  std::string device = "cpu";
  bool exact_products = false;
  bool tensor_cores = false;
  bool cuda_graphs = false;
};

int RunGenerate(const GenerateArgs& a) {
  GenerateOptions o;
  const ParallelJoin join = JoinParallel(a.tp, a.pp, a.cp, "generate");
  if (join.exit_code >= 0) return join.exit_code;
  o.parallel = join.parallel;
  const int rank = join.rank;
  o.model_path = a.model;
  o.tokenizer_path = a.tokenizer;
  o.prompts = a.prompts;
  if (!a.prompts_file.empty()) {
    std::ifstream in(a.prompts_file);
    if (!in) {
      std::fprintf(stderr, "error: cannot open --prompts-file '%s'\n", a.prompts_file.c_str());
      return kExitBadInput;
    }
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) o.prompts.push_back(line);
    }
  }
  o.chat = a.chat || !a.chat_template.empty() || !a.system.empty();
  o.chat_template = a.chat_template;
  o.system_prompt = a.system;
  o.stop_at_eos = a.stop_at_eos;
  o.max_new_tokens = a.n >= 0 ? a.n : (o.chat ? 0 : 64);
  o.sampling = {.temperature = a.temp, .top_k = a.top_k, .top_p = a.top_p, .repetition_penalty = a.repeat_penalty, .seed = a.seed};
  // Context parallel: each rank holds block_len / cp tokens of every block;
  // without --block-len the block grows so that each rank's part is 16.
  o.block_len = a.cp > 1 && !a.block_len_given ? a.block_len * a.cp : a.block_len;
  o.num_blocks = a.blocks;
  o.top_logits = a.dump_logits;
  // Ranks on one machine share its cores.
  o.threads = RankThreads(a.threads, a.tp * a.pp * a.cp);
  o.device = a.device;
  o.exact_products = a.exact_products;
  o.tensor_cores = a.tensor_cores;
  o.cuda_graphs = a.cuda_graphs;
  o.truncate_prompts = a.truncate;
  o.kv_events = ToKvEventsOptions(a.kv_events);
  o.prefix_cache = a.prefix_cache || a.salt_given || !o.kv_events.endpoint.empty();
  if (a.salt_given) o.extra_keys.cache_salt = a.cache_salt;
  if (!ToTierOptions(a.tiers, o.tiers)) return kExitBadInput;
  if (TiersConfigured(o.tiers)) o.prefix_cache = true;
  Result<DType> dt = ParseDType(a.kv_dtype);
  if (!dt.ok()) {
    std::fprintf(stderr, "error: --kv-dtype: %s\n", dt.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_dtype = *dt;
  Result<KvGroups> groups = ParseKvGroups(a.kv_cache);
  if (!groups.ok()) {
    std::fprintf(stderr, "error: --kv-cache: %s\n", groups.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_groups = *groups;
  Result<EvictionOptions> ev = ParseEvictionPolicy(a.kv_policy, a.kv_keep);
  if (!ev.ok()) {
    std::fprintf(stderr, "error: --kv-policy / --kv-keep: %s\n", ev.status().message().c_str());
    return kExitBadInput;
  }
  o.eviction = *ev;
  o.kv_layer_dtypes = a.kv_layer_dtypes;
  o.kv_hadamard = a.kv_rotate == "hadamard";
  const bool stream = !a.json && o.prompts.size() == 1;
  bool streamed = false;  // the prompt is printed with the first token, so an error prints alone
  if (stream) {
    o.on_token = [&streamed, prompt = o.chat ? std::string() : o.prompts[0]](size_t, const std::string& piece) {
      if (!streamed) std::printf("%s", prompt.c_str());
      streamed = true;
      std::printf("%s", piece.c_str());
      std::fflush(stdout);
    };
  }
  Result<GenerateReport> r = Generate(o);
  if (!r.ok()) {
    if (streamed) std::printf("\n");
    if (a.tp * a.pp * a.cp > 1) {
      std::fprintf(stderr, "error: rank %d: %s\n", rank, r.status().message().c_str());
    } else {
      std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    }
    const StatusCode c = r.status().code();
    return c == StatusCode::kInternal || c == StatusCode::kIoError ? kExitFailed : kExitBadInput;
  }
  const GenerateStats& s = r->stats;
  if (a.json) {
    for (const GenerateOutput& out : r->outputs) {
      nlohmann::ordered_json j;
      j["prompt"] = out.prompt;
      j["prompt_ids"] = out.prompt_ids;
      j["generated_ids"] = out.generated_ids;
      j["text"] = out.text;
      j["completion"] = out.completion;
      j["finish_reason"] = out.stopped ? "stop" : "length";
      if (!out.step_top.empty()) {
        nlohmann::ordered_json steps = nlohmann::ordered_json::array();
        for (const auto& step : out.step_top) {
          nlohmann::ordered_json ids = nlohmann::ordered_json::array(), logits = nlohmann::ordered_json::array();
          for (auto [id, logit] : step) {
            ids.push_back(id);
            logits.push_back(logit);
          }
          steps.push_back({{"ids", ids}, {"logits", logits}});
        }
        j["top_logits"] = steps;
      }
      // Generated text may end inside a UTF-8 sequence or hold byte-fallback
      // tokens that form none: such bytes become U+FFFD, the ids stay exact.
      std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    }
    nlohmann::ordered_json st;
    st["blocks_total"] = s.blocks_total;
    st["peak_blocks_used"] = s.peak_blocks_used;
    st["bytes_per_block"] = s.bytes_per_block;
    st["kv_bytes_per_token"] = s.kv_bytes_per_token;
    if (s.per_head_bytes_per_token > 0) st["per_head_bytes_per_token"] = s.per_head_bytes_per_token;
    st["peak_bytes"] = s.peak_bytes;
    st["peak_utilization"] = s.peak_utilization;
    st["shared_prefix_tokens"] = s.shared_prefix_tokens;
    st["copy_on_write_blocks"] = s.copy_on_write_blocks;
    st["contiguous_bytes"] = s.contiguous_bytes;
    st["contiguous_max_len_bytes"] = s.contiguous_max_len_bytes;
    st["prefill_seconds"] = s.prefill_seconds;
    st["decode_seconds"] = s.decode_seconds;
    st["decode_tokens"] = s.decode_tokens;
    st["decode_attention_seconds"] = s.decode_attention_seconds;
    st["decode_matmul_seconds"] = s.decode_matmul_seconds;
    st["truncated_prompts"] = s.truncated_prompts;
    st["prefill_tokens_computed"] = s.prefill_tokens_computed;
    st["prefix_hit_tokens"] = s.prefix_hit_tokens;
    st["prefix_hit_blocks"] = s.prefix_hit_blocks;
    st["prefix_blocks_published"] = s.prefix_blocks_published;
    st["kv_event_batches"] = s.kv_event_batches;
    st["host_hit_blocks"] = s.host_hit_blocks;
    st["disk_hit_blocks"] = s.disk_hit_blocks;
    st["redis_hit_blocks"] = s.redis_hit_blocks;
    st["tier_errors"] = s.tier_errors;
    st["tokens_evicted"] = s.tokens_evicted;
    st["final_cached_tokens"] = s.final_cached_tokens;
    std::printf("%s\n", nlohmann::ordered_json{{"stats", st}}.dump().c_str());
    return kExitOk;
  }
  if (stream) {
    std::printf("\n");
  } else {
    for (size_t i = 0; i < r->outputs.size(); ++i) {
      const GenerateOutput& out = r->outputs[i];
      if (o.chat) {
        std::printf("[%zu] user: %s\n    assistant: %s\n\n", i + 1, out.prompt.c_str(), out.completion.c_str());
      } else {
        std::printf("[%zu] %s\n\n", i + 1, out.text.c_str());
      }
    }
  }
  if (s.truncated_prompts > 0) {
    std::printf("(%ld prompt(s) truncated to fit the model's context)\n", static_cast<long>(s.truncated_prompts));
  }
  std::printf("\nKV cache: %ld prompt(s), block_len %d, %s KV\n", static_cast<long>(r->outputs.size()), a.block_len,
              a.kv_dtype.c_str());
  std::printf("  peak blocks used        %ld of %ld (%.0f%%), %s\n", s.peak_blocks_used, s.blocks_total,
              100 * s.peak_utilization, FormatBytes(s.peak_bytes).c_str());
  if (o.eviction.policy != EvictionPolicy::kNone) {
    std::printf("  token eviction          %s at %.0f%%: %ld tokens dropped, %ld held at the end\n", a.kv_policy.c_str(),
                100 * a.kv_keep, static_cast<long>(s.tokens_evicted), static_cast<long>(s.final_cached_tokens));
  }
  if (o.prefix_cache) {
    std::printf("  prefix cache            %ld prompt tokens (%ld blocks) found cached, %ld computed; %ld blocks published\n",
                static_cast<long>(s.prefix_hit_tokens), static_cast<long>(s.prefix_hit_blocks),
                static_cast<long>(s.prefill_tokens_computed), static_cast<long>(s.prefix_blocks_published));
    if (TiersConfigured(o.tiers)) {
      std::printf("  lower tiers             blocks loaded: %ld from RAM, %ld from disk, %ld from Redis; %ld tier error(s)\n",
                  static_cast<long>(s.host_hit_blocks), static_cast<long>(s.disk_hit_blocks),
                  static_cast<long>(s.redis_hit_blocks), static_cast<long>(s.tier_errors));
    }
  } else if (o.eviction.policy == EvictionPolicy::kNone) {
    std::printf("  shared prompt prefix    %ld tokens prefilled once, forked to every prompt (%ld copy-on-write block%s)\n",
                s.shared_prefix_tokens, s.copy_on_write_blocks, s.copy_on_write_blocks == 1 ? "" : "s");
  }
  auto times = [&](int64_t bytes) {
    return s.peak_bytes > 0 ? static_cast<double>(bytes) / static_cast<double>(s.peak_bytes) : 0.0;
  };
  std::printf("  contiguous reservation  %s at the model's full context per sequence (%.1fx the paged peak);\n"
              "                          %s even if each reserved exactly prompt + max tokens (%.1fx)\n",
              FormatBytes(s.contiguous_max_len_bytes).c_str(), times(s.contiguous_max_len_bytes),
              FormatBytes(s.contiguous_bytes).c_str(), times(s.contiguous_bytes));
  if (s.per_head_bytes_per_token > 0) {
    std::printf("  latent (MLA) rows       %s per token; per-head K and V of every query head would be %s (%.1fx)\n",
                FormatBytes(s.kv_bytes_per_token).c_str(), FormatBytes(s.per_head_bytes_per_token).c_str(),
                static_cast<double>(s.per_head_bytes_per_token) / static_cast<double>(std::max<int64_t>(1, s.kv_bytes_per_token)));
  }
  std::printf("  speed                   prefill %.1f ms, decode %.1f tokens/s\n", s.prefill_seconds * 1e3,
              s.decode_seconds > 0 ? static_cast<double>(s.decode_tokens) / s.decode_seconds : 0.0);
  return kExitOk;
}

}  // namespace

CLI::App* AddGenerateCommand(CLI::App& app, int& exit_code) {
  static GenerateArgs args;
  CLI::App* cmd = app.add_subcommand("generate", "Generate text with a llama-family model on the paged KV cache");
  cmd->add_option("--model", args.model, "Model: a .gguf file, or a llama2.c .bin (with --tokenizer)")->required();
  cmd->add_option("--tokenizer", args.tokenizer, "llama2.c tokenizer.bin (for .bin checkpoints)");
  cmd->add_option("--prompt", args.prompts, "A prompt (repeatable: all are generated as one batch)");
  cmd->add_option("--prompts-file", args.prompts_file, "A file with one prompt per line");
  cmd->add_option("-n,--max-tokens", args.n,
                  "Tokens to generate per prompt (default 64; with --chat: until the turn ends; 0: until a stop token or "
                  "the context's end)")
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_flag("--chat", args.chat,
                "Each prompt is a user message rendered through the model's chat template; stops at the end of the turn");
  cmd->add_option("--chat-template", args.chat_template,
                  "Override the model's template: chatml, llama3, llama2, mistral, gemma, phi3, zephyr, or a Jinja file "
                  "(implies --chat)");
  cmd->add_option("--system", args.system, "A system message before each prompt (implies --chat)");
  cmd->add_flag("--stop-at-eos", args.stop_at_eos, "End a sequence at the end-of-sequence / end-of-turn tokens");
  cmd->add_option("--temp", args.temp, "Temperature; 0 = greedy (default)");
  cmd->add_option("--top-k", args.top_k, "Keep the k most likely tokens (0 = off)");
  cmd->add_option("--top-p", args.top_p, "Nucleus sampling mass in (0, 1] (1 = off)");
  cmd->add_option("--repeat-penalty", args.repeat_penalty, "Repetition penalty >= 1 (1 = off)");
  cmd->add_option("--seed", args.seed, "Sampling seed (default: a fresh one from the OS each run)");
  cmd->add_option("--block-len", args.block_len, "Tokens per KV block (default 16; with --cp, 16 x cp)")
      ->each([](const std::string&) { args.block_len_given = true; });
  cmd->add_option("--blocks", args.blocks, "KV blocks in the pool (default: enough for the batch)")->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  cmd->add_option("--kv-cache", args.kv_cache,
                  "Sliding-window models: auto (default: hybrid), hybrid or uniform");
  cmd->add_option("--kv-dtype", args.kv_dtype,
                  "KV storage: f32 (default), f16, bf16, int8, fp8_e4m3, fp8_e5m2 (one f16 scale per row), int4 (KIVI; --block-len a multiple of 32)");
  cmd->add_option("--kv-layer-dtypes", args.kv_layer_dtypes,
                  "Per-layer overrides of --kv-dtype: LAYERS=DTYPE,... (index, -1 = last, or a:b), e.g. 0=f16,-1=f16");
  cmd->add_option("--kv-rotate", args.kv_rotate,
                  "none (default) or hadamard: int8 / fp8 rows stored rotated by the Hadamard transform")
      ->check(CLI::IsMember({"none", "hadamard"}));
  cmd->add_option("--kv-policy", args.kv_policy, "Token eviction: none (default), streaming, h2o, snapkv");
  cmd->add_option("--kv-keep", args.kv_keep, "Fraction of each sequence's tokens kept by --kv-policy, (0, 1] (default 1)");
  cmd->add_option("--dump-logits", args.dump_logits, "With --json: the top-K ids and logits of every step");
  cmd->add_option("--tp", args.tp,
                  "Tensor parallel: this many ranks hold the heads and their KV (run under mpirun -np N; default 1)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--pp", args.pp,
                  "Pipeline parallel: this many ranks each hold a contiguous range of the layers and their KV (with --tp: "
                  "tp x pp ranks under mpirun; default 1)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--cp", args.cp,
                  "Context parallel: this many ranks each hold one slice of every KV block, so a sequence's KV is "
                  "spread over them (with --tp / --pp: tp x pp x cp ranks under mpirun; default 1)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--device", args.device,
                  "Where the KV cache lives and the model runs: cpu (default), cuda or cuda:N (an NVIDIA GPU; "
                  "llama / qwen2 and gemma3 models)");
  cmd->add_flag("--exact-products", args.exact_products,
               "Weight products in f32 throughout (slower; the fast path rounds activations to int16 / bf16 on the "
               "CPU, f16 on a GPU)");
  cmd->add_flag("--tensor-cores", args.tensor_cores, "On a CUDA device: attention of f16 / bf16 caches (head_dim a multiple of 16 up to 128) on the tensor cores, " "prompt chunks and decode steps (not yet the default: not yet run on a GPU)");
  cmd->add_flag("--cuda-graphs", args.cuda_graphs, "On a CUDA device: decode steps launched as CUDA graphs, one launch per step, "
                "replayed while the launches repeat (not yet the default: not yet run on a GPU)");
  cmd->add_option("--threads", args.threads, "Threads for the kernels (default: every hardware thread; with --tp, "
                                             "divided among the ranks on this machine)")
      ->check(CLI::Range(0, 4096));
  cmd->add_flag("--truncate-prompt", args.truncate,
                "Cut a prompt that does not fit the context to its first token and its most recent ones");
  cmd->add_flag("--prefix-cache", args.prefix_cache,
                "Share prompt blocks through the content-addressed prefix cache (instead of forking the common prefix)");
  cmd->add_option("--cache-salt", args.cache_salt, "Prefix-cache salt (a tenant id); implies --prefix-cache")
      ->each([](const std::string&) { args.salt_given = true; });
  AddKvEventFlags(cmd, args.kv_events);
  AddTierFlags(cmd, args.tiers);
  cmd->add_flag("--json", args.json, "One JSON object per prompt, then one with the statistics");
  cmd->callback([&exit_code] { exit_code = RunGenerate(args); });
  return cmd;
}

}  // namespace pagekv::cli
