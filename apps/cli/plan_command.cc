// `pagekv plan`: how many bytes a model's KV cache needs, from a preset or
// from flags, and what to change when it does not fit.
#include <cstdio>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {

struct PlanArgs {
  std::string preset;
  int64_t layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0, block_len = 0, max_blocks = 0;
  int64_t mla_rank = 0, rope_dim = 0, seq_len = 0, batch = 0;
  int64_t sliding_window = 0, sliding_pattern = 6;
  std::string dtype, budget, layer_dtypes, kv_cache = "auto";
  bool json = false, explain = false;
  int tp = 1, pp = 1, cp = 1;
};

namespace {

// 16374562816 -> "16,374,562,816"
std::string Group(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

// Builds the request: preset first, then every flag the user gave
// (ResolvePlanRequest: the rules the Python module shares).
Result<PlanRequest> BuildRequest(const PlanArgs& a, const CLI::App& cmd, std::string& title) {
  GeometrySpec g;
  auto given = [&](const char* flag) { return cmd.count(flag) > 0; };
  if (!a.preset.empty()) g.preset = a.preset;
  if (given("--layers")) g.num_layers = a.layers;
  if (given("--q-heads")) g.num_q_heads = a.q_heads;
  if (given("--kv-heads")) g.num_kv_heads = a.kv_heads;
  if (given("--head-dim")) g.head_dim = a.head_dim;
  if (given("--mla-rank")) g.kv_lora_rank = a.mla_rank;
  if (given("--rope-dim")) g.rope_dim = a.rope_dim;
  if (given("--block-len")) g.block_len = a.block_len;
  if (given("--dtype")) g.dtype = a.dtype;
  if (!a.layer_dtypes.empty()) g.layer_dtypes = a.layer_dtypes;
  if (given("--max-blocks")) g.num_blocks = a.max_blocks;
  if (given("--budget")) {
    PAGEKV_ASSIGN_OR_RETURN(int64_t budget, ParseByteSize(a.budget));
    g.budget_bytes = budget;
  }
  if (given("--seq-len")) g.seq_len = a.seq_len;
  if (given("--batch")) g.batch = a.batch;
  if (given("--sliding-window")) g.sliding_window = a.sliding_window;
  if (given("--sliding-pattern")) g.sliding_pattern = a.sliding_pattern;
  if (a.kv_cache != "auto" && a.kv_cache != "hybrid" && a.kv_cache != "uniform") {
    return InvalidArgumentError("--kv-cache " + a.kv_cache + ": use auto, hybrid or uniform");
  }
  g.uniform = a.kv_cache == "uniform";
  GeometryNames names;
  names.preset = "--preset";
  names.num_layers = "--layers";
  names.num_kv_heads = "--kv-heads";
  names.head_dim = "--head-dim";
  names.kv_lora_rank = "--mla-rank";
  names.num_blocks = "--max-blocks";
  names.budget = "--budget";
  names.seq_len = "--seq-len";
  names.batch = "--batch";
  PAGEKV_ASSIGN_OR_RETURN(ResolvedPlanRequest r, ResolvePlanRequest(g, names));
  title = r.title;
  if (r.one_full_context) {
    title += fmt::format(" (pool sized for one {}-token sequence; set --budget, --max-blocks or --batch)",
                         r.request.seq_len);
  }
  return r.request;
}

nlohmann::ordered_json ToJson(const Plan& p, const std::string& preset) {
  const CacheConfig& c = p.config;
  nlohmann::ordered_json j;
  if (!preset.empty()) j["preset"] = preset;
  j["attention"] = std::string(AttentionKindName(p.attention));
  j["layers"] = c.num_layers;
  j["q_heads"] = c.num_q_heads;
  if (c.kind == CacheKind::kMla) {
    j["kv_lora_rank"] = c.kv_lora_rank;
    j["rope_dim"] = c.rope_dim;
  } else {
    j["kv_heads"] = c.num_kv_heads;
  }
  j["head_dim"] = c.head_dim;
  j["block_len"] = c.block_len;
  j["dtype"] = std::string(DTypeName(c.format.dtype));
  if (!c.layer_formats.empty()) {
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (const KvFormat& f : c.layer_formats) layers.push_back(std::string(DTypeName(f.dtype)));
    j["layer_dtypes"] = layers;
  }
  j["row_bytes"] = p.row_bytes;
  if (p.tail_bytes_per_sequence > 0) j["tail_bytes_per_sequence"] = p.tail_bytes_per_sequence;
  j["bytes_per_token_per_layer"] = p.bytes_per_token_per_layer;
  j["bytes_per_token"] = p.bytes_per_token;
  j["bytes_per_block"] = p.bytes_per_block;
  j["padding_bytes_per_block"] = p.padding_bytes_per_block;
  j["num_blocks"] = p.num_blocks;
  j["total_bytes"] = p.total_bytes;
  j["tokens_capacity"] = p.tokens_capacity;
  if (p.budget_bytes > 0) {
    j["budget_bytes"] = p.budget_bytes;
    j["fits_budget"] = p.fits_budget;
  }
  if (p.seq_len > 0) {
    j["seq_len"] = p.seq_len;
    j["blocks_per_sequence"] = p.blocks_per_sequence;
    j["bytes_per_sequence"] = p.bytes_per_sequence;
    j["max_sequences"] = p.max_sequences;
  }
  if (p.batch > 0) {
    j["batch"] = p.batch;
    j["fits_batch"] = p.fits_batch;
  }
  if (!p.groups.empty()) {
    nlohmann::ordered_json groups = nlohmann::ordered_json::array();
    for (const Plan::Group& g : p.groups) {
      groups.push_back({{"window", g.window}, {"kind", g.window > 0 ? "sliding_window" : "full_attention"},
                        {"layers", g.layers}, {"bytes_per_token", g.bytes_per_token}});
    }
    j["layers_per_block"] = p.layers_per_block;
    j["groups"] = groups;
    nlohmann::ordered_json savings = nlohmann::ordered_json::array();
    for (const Plan::Saving& s : p.savings) {
      savings.push_back({{"tokens", s.tokens}, {"uniform_bytes", s.uniform_bytes}, {"hybrid_bytes", s.hybrid_bytes},
                         {"ratio", static_cast<double>(s.uniform_bytes) / static_cast<double>(s.hybrid_bytes)}});
    }
    j["per_sequence_vs_uniform"] = savings;
  }
  if (p.per_head_bytes_per_token > 0) {
    j["per_head_bytes_per_token"] = p.per_head_bytes_per_token;
    j["mla_reduction"] = p.mla_reduction;
  }
  j["advice"] = p.advice;
  return j;
}

void PrintRow(const std::string& name, const std::string& value) {
  std::printf("  %-22s %s\n", name.c_str(), value.c_str());
}

std::string Bytes(int64_t b) { return fmt::format("{} B ({})", Group(b), FormatBytes(b)); }

void PrintTable(const Plan& p, const std::string& title) {
  const CacheConfig& c = p.config;
  std::printf("PageKV plan: %s\n\n", title.c_str());
  if (c.kind == CacheKind::kMla) {
    PrintRow("attention", fmt::format("MLA: one latent row per token and layer ({} compressed kv + {} rope key)",
                                      c.kv_lora_rank, c.rope_dim));
  } else {
    PrintRow("attention", fmt::format("{}: {} query heads over {} KV heads (group of {})",
                                      AttentionKindName(p.attention), c.num_q_heads, c.num_kv_heads,
                                      c.num_q_heads / c.num_kv_heads));
    PrintRow("head_dim", std::to_string(c.head_dim));
  }
  PrintRow("layers", std::to_string(c.num_layers));
  PrintRow("dtype", c.format.IsPlainFloat()
                        ? fmt::format("{} ({} bytes per element)", DTypeName(c.format.dtype), DTypeBits(c.format.dtype) / 8)
                    : c.format.IsKivi()
                        ? fmt::format("int4 KIVI (4 bits per element; keys: f16 scale and min per channel over {} "
                                      "tokens, values: f16 scale and min per row)",
                                      c.format.group_size)
                        : fmt::format("{} (1 byte per element, one f16 scale per row)", DTypeName(c.format.dtype)));
  if (!c.layer_formats.empty()) {
    std::string layers;
    for (size_t i = 0; i < c.layer_formats.size(); ++i) {
      layers += (i == 0 ? "" : " ") + std::string(DTypeName(c.layer_formats[i].dtype));
    }
    PrintRow("per layer", layers);
  }
  PrintRow("block_len", fmt::format("{} tokens", c.block_len));
  std::printf("\n");
  PrintRow("per token, one layer", Bytes(p.bytes_per_token_per_layer));
  PrintRow("per token", Bytes(p.bytes_per_token));
  PrintRow("per block", Bytes(p.bytes_per_block));
  if (p.tail_bytes_per_sequence > 0) {
    PrintRow("f16 tail per sequence", Bytes(p.tail_bytes_per_sequence) + " (the not-yet-full KIVI group, beside the pool)");
  }
  PrintRow("blocks", Group(p.num_blocks));
  PrintRow("total", Bytes(p.total_bytes));
  PrintRow("token capacity", Group(p.tokens_capacity));
  if (p.budget_bytes > 0) {
    PrintRow("budget", Bytes(p.budget_bytes) + (p.fits_budget ? ": fits" : ": DOES NOT FIT"));
  }
  if (p.seq_len > 0) {
    PrintRow("per sequence", fmt::format("{} tokens -> {} blocks, {}", Group(p.seq_len),
                                         p.blocks_per_sequence, FormatBytes(p.bytes_per_sequence)));
    PrintRow("max sequences", fmt::format("{} at {} tokens{}", Group(p.max_sequences), Group(p.seq_len),
                                          p.batch > 0 ? (p.fits_batch ? fmt::format(" (batch {} fits)", p.batch)
                                                                      : fmt::format(" (batch {} DOES NOT FIT)", p.batch))
                                                      : std::string()));
  }
  if (!p.groups.empty()) {
    std::printf("\n");
    int32_t sliding = 0, full = 0;
    for (const Plan::Group& g : p.groups) (g.window > 0 ? sliding : full)++;
    PrintRow("hybrid cache", fmt::format("{} groups of {} layers (one block table each, one pool): {} full-attention, "
                                         "{} sliding", p.groups.size(), p.layers_per_block, full, sliding));
    for (size_t i = 0; i < p.groups.size(); ++i) {
      const Plan::Group& g = p.groups[i];
      std::string layers;
      for (int32_t l : g.layers) layers += (layers.empty() ? "" : ",") + std::to_string(l);
      PrintRow(fmt::format("group {}", i), fmt::format("{} layers {}: {} per token", g.window > 0 ? fmt::format("window {},", g.window) : std::string("full,"),
                                                       layers, FormatBytes(g.bytes_per_token)));
    }
    std::printf("\n  %-10s %16s %16s %8s\n", "tokens", "uniform cache", "hybrid cache", "saving");
    for (const Plan::Saving& s : p.savings) {
      std::printf("  %-10s %16s %16s %7.1fx\n", Group(s.tokens).c_str(), FormatBytes(s.uniform_bytes).c_str(),
                  FormatBytes(s.hybrid_bytes).c_str(), static_cast<double>(s.uniform_bytes) / static_cast<double>(s.hybrid_bytes));
    }
    std::printf("  (one sequence; a sliding group keeps ceil((W - 1) / block_len) + 1 blocks while decoding)\n");
  }
  if (p.per_head_bytes_per_token > 0) {
    std::printf("\n");
    PrintRow("MLA vs per-head", fmt::format("{} per token instead of {} for K and V of {} query heads: {:.1f}x smaller",
                                            FormatBytes(p.bytes_per_token), FormatBytes(p.per_head_bytes_per_token),
                                            c.num_q_heads, p.mla_reduction));
  }
  for (const std::string& a : p.advice) std::printf("  to fit: %s\n", a.c_str());
}

void PrintExplain(const Plan& p, const PlanArgs& a) {
  const CacheConfig& c = p.config;
  const int64_t elem = std::max(1, DTypeBits(c.format.dtype) / 8);
  const bool mla = c.kind == CacheKind::kMla;
  const int64_t planes = mla ? 1 : 2, heads = mla ? 1 : c.num_kv_heads;
  const int64_t row_elems = mla ? c.kv_lora_rank + c.rope_dim : c.head_dim;
  std::printf("\nHow each number is derived:\n");
  std::printf("  row_bytes        = %s x %ld bytes%s = %ld\n",
              mla ? fmt::format("(kv_lora_rank {} + rope_dim {})", c.kv_lora_rank, c.rope_dim).c_str()
                  : fmt::format("head_dim {}", c.head_dim).c_str(),
              elem, c.format.IsPlainFloat() ? "" : " + a 2-byte f16 scale", p.row_bytes);
  std::printf("  slab             = block_len %d x row_bytes %ld = %ld bytes, padded to a 64-byte multiple: %ld\n",
              c.block_len, p.row_bytes, p.slab_bytes, p.slab_stride);
  std::printf("  bytes_per_token  = layers %d x planes %ld (%s) x heads %ld x row_bytes %ld = %s\n", c.num_layers,
              planes, mla ? "latent" : "K and V", heads, p.row_bytes, Group(p.bytes_per_token).c_str());
  std::printf("  bytes_per_block  = layers %d x planes %ld x heads %ld x slab %ld = %s\n",
              p.layers_per_block > 0 ? p.layers_per_block : c.num_layers, planes,
              heads, p.slab_stride, Group(p.bytes_per_block).c_str());
  if (a.max_blocks > 0) {
    std::printf("  num_blocks       = --max-blocks = %ld\n", p.num_blocks);
  } else if (!a.budget.empty()) {
    std::printf("  num_blocks       = floor(budget %s / bytes_per_block %s) = %ld\n", Group(p.budget_bytes).c_str(),
                Group(p.bytes_per_block).c_str(), p.num_blocks);
  } else if (p.config.num_blocks > 0 && a.batch == 0) {
    std::printf("  num_blocks       = the preset's %ld\n", p.num_blocks);
  } else {
    std::printf("  num_blocks       = batch %ld x ceil(seq_len %ld / block_len %d) = %ld\n", p.batch, p.seq_len,
                c.block_len, p.num_blocks);
  }
  std::printf("  total_bytes      = num_blocks %ld x bytes_per_block %s = %s\n", p.num_blocks,
              Group(p.bytes_per_block).c_str(), Group(p.total_bytes).c_str());
  if (p.seq_len > 0) {
    std::printf("  max_sequences    = floor(num_blocks %ld / ceil(seq_len %ld / block_len %d) = %ld) = %ld\n",
                p.num_blocks, p.seq_len, c.block_len, p.blocks_per_sequence, p.max_sequences);
    std::printf("  last-block slack = %ld empty slots per sequence (%s)\n", p.slack_tokens_per_sequence,
                FormatBytes(p.slack_tokens_per_sequence * p.bytes_per_token).c_str());
  }
  (void)row_elems;
  std::printf("\nWhat to change when it does not fit:\n");
  if (!p.advice.empty()) {
    for (const std::string& line : p.advice) std::printf("  - %s\n", line.c_str());
  } else {
    std::printf("  - it fits as planned; each lever below scales the bytes:\n");
  }
  std::printf("  - fewer blocks: total_bytes falls by %s per block\n", FormatBytes(p.bytes_per_block).c_str());
  if (elem == 4) std::printf("  - a smaller dtype: f16 or bf16 halve every byte count\n");
  std::printf("  - a shorter block_len: less slack in each sequence's last block, more block-table entries\n");
  if (!mla && c.num_kv_heads == c.num_q_heads && c.num_kv_heads > 1) {
    std::printf("  - a model with grouped-query attention stores fewer KV heads per token\n");
  }
}

int RunPlan(const PlanArgs& a, const CLI::App& cmd) {
  std::string title;
  Result<PlanRequest> req = BuildRequest(a, cmd, title);
  if (!req.ok()) {
    std::fprintf(stderr, "error: %s\n", req.status().message().c_str());
    return kExitBadInput;
  }
  // Tensor parallel: the plan of one rank (each holds its heads' KV; a
  // budget is per rank).
  std::optional<HeadShard> shard;
  if (a.tp > 1) {
    CacheConfig& c = req->config;
    if (c.kind != CacheKind::kPerHead) {
      std::fprintf(stderr, "error: --tp %d: an MLA (latent) cache has one row per token for every head, so it is not "
                           "split by head\n", a.tp);
      return kExitBadInput;
    }
    Result<HeadShard> s = ShardHeads(c.num_q_heads, c.num_kv_heads, 0, a.tp);
    if (!s.ok()) {
      std::fprintf(stderr, "error: --tp: %s\n", s.status().message().c_str());
      return kExitBadInput;
    }
    shard = *s;
    c.num_q_heads = s->q_heads;
    c.num_kv_heads = s->kv_heads;
    title += fmt::format(", per rank of --tp {}", a.tp);
  }
  // Pipeline parallel: the largest stage's layers (stage s holds layers
  // [L*s/P, L*(s+1)/P)), their formats and windows as the model's.
  int32_t stage_layers = req->config.num_layers;
  if (a.pp > 1) {
    CacheConfig& c = req->config;
    if (a.pp > c.num_layers) {
      std::fprintf(stderr, "error: --pp %d exceeds the model's %d layers: use at most %d stages\n", a.pp, c.num_layers,
                   c.num_layers);
      return kExitBadInput;
    }
    int32_t best = 0, first = 0;
    for (int s = 0; s < a.pp; ++s) {
      const int32_t l0 = c.num_layers * s / a.pp, l1 = c.num_layers * (s + 1) / a.pp;
      if (l1 - l0 > best) {
        best = l1 - l0;
        first = l0;
      }
    }
    auto keep = [&](auto& per_layer) {
      if (!per_layer.empty()) per_layer = {per_layer.begin() + first, per_layer.begin() + first + best};
    };
    keep(c.layer_formats);
    keep(c.layer_windows);
    c.num_layers = best;
    stage_layers = best;
    title += fmt::format(", per stage of --pp {} (the largest: layers {}-{})", a.pp, first, first + best - 1);
  }
  // Context parallel: one rank holds block_len / cp tokens of every block;
  // its pool has the group's block count, so a sequence of seq_len tokens
  // takes ceil(seq_len / block_len) of its blocks.
  const int32_t whole_block_len = req->config.block_len;
  const int64_t seq_len = req->seq_len;
  if (a.cp > 1) {
    CacheConfig& c = req->config;
    if (c.block_len % a.cp != 0 || c.block_len / a.cp < 8) {
      std::fprintf(stderr, "error: --cp %d: block_len %d does not split into %d slices of at least 8 tokens: use "
                           "--block-len %d or more, a multiple of %d\n", a.cp, c.block_len, a.cp, 8 * a.cp, a.cp);
      return kExitBadInput;
    }
    c.block_len /= a.cp;
    if (seq_len > 0) req->seq_len = ((seq_len + whole_block_len - 1) / whole_block_len) * c.block_len;
    title += fmt::format(", per rank of --cp {} (each holds {} tokens of every {}-token block)", a.cp, c.block_len,
                         whole_block_len);
  }
  Result<Plan> plan = MakePlan(*req);
  if (!plan.ok()) {
    std::fprintf(stderr, "error: %s\n", plan.status().message().c_str());
    return kExitBadInput;
  }
  if (a.cp > 1 && seq_len > 0) {
    plan->seq_len = seq_len;
    plan->slack_tokens_per_sequence = plan->blocks_per_sequence * whole_block_len - seq_len;
  }
  // The longest sequence the group holds: every block of every rank.
  const int64_t group_tokens = plan->num_blocks * whole_block_len;
  if (a.json) {
    nlohmann::ordered_json j = ToJson(*plan, a.preset);
    if (shard) {
      j["tensor_parallel"] = {{"ranks", a.tp}, {"q_heads_per_rank", shard->q_heads}, {"kv_heads_per_rank", shard->kv_heads},
                              {"kv_replicas", shard->kv_replicas}};
    }
    if (a.pp > 1) j["pipeline_parallel"] = {{"stages", a.pp}, {"layers_per_rank", stage_layers}};
    if (a.cp > 1) {
      j["context_parallel"] = {{"ranks", a.cp}, {"block_len", whole_block_len}, {"tokens_per_block_per_rank", whole_block_len / a.cp},
                               {"group_tokens_capacity", group_tokens}, {"bytes_per_rank", plan->total_bytes}};
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    PrintTable(*plan, title);
    if (a.pp > 1) {
      std::printf("\npipeline parallel: %d stages, the largest holding %d layers: the figures above are its rank's\n", a.pp,
                  stage_layers);
    }
    if (a.cp > 1) {
      std::printf("\ncontext parallel: %d ranks, each holding %d tokens of every block of %d: the figures above are one "
                  "rank's (a sequence takes ceil(tokens / %d) of its blocks); the group holds %lld blocks x %d = %lld "
                  "tokens, %d x one rank's %lld\n",
                  a.cp, whole_block_len / a.cp, whole_block_len, whole_block_len, static_cast<long long>(plan->num_blocks),
                  whole_block_len, static_cast<long long>(group_tokens), a.cp, static_cast<long long>(plan->tokens_capacity));
    }
    if (shard) {
      std::printf("\ntensor parallel: %d ranks, each holding %d query heads over %d KV head%s%s: the figures above are "
                  "one rank's\n",
                  a.tp, shard->q_heads, shard->kv_heads, shard->kv_heads == 1 ? "" : "s",
                  shard->kv_replicas > 1 ? fmt::format(" (each KV head replicated on {} ranks)", shard->kv_replicas).c_str() : "");
    }
  }
  if (a.explain) PrintExplain(*plan, a);
  return kExitOk;
}

}  // namespace

CLI::App* AddPlanCommand(CLI::App& app, int& exit_code) {
  static PlanArgs storage;  // the CLI11 app, and so its bound options, lives as long as main
  PlanArgs* args = &storage;
  CLI::App* cmd = app.add_subcommand("plan", "How many bytes a model's KV cache needs, and what fits");
  std::string presets;
  for (const ModelPreset& p : ModelPresets()) presets += (presets.empty() ? "" : ", ") + std::string(p.name);
  cmd->add_option("--preset", args->preset, "Model geometry: " + presets);
  cmd->add_option("--layers", args->layers, "Transformer layers");
  cmd->add_option("--q-heads", args->q_heads, "Query heads (default: = --kv-heads, i.e. MHA)");
  cmd->add_option("--kv-heads", args->kv_heads, "KV heads");
  cmd->add_option("--head-dim", args->head_dim, "Elements per K and V row");
  cmd->add_option("--mla-rank", args->mla_rank, "MLA: compressed kv elements per token (makes the cache MLA)");
  cmd->add_option("--rope-dim", args->rope_dim, "MLA: decoupled rope-key elements per token");
  cmd->add_option("--block-len", args->block_len, "Tokens per block: a power of two in [8, 1024] (default 128)");
  cmd->add_option("--max-blocks", args->max_blocks, "Blocks in the pool");
  cmd->add_option("--dtype", args->dtype, "Element type: f32, f16, bf16, int8, fp8_e4m3, fp8_e5m2 (default f16)");
  cmd->add_option("--layer-dtypes", args->layer_dtypes,
                  "Per-layer overrides of --dtype: LAYERS=DTYPE,... (index, -1 = last, or a:b), e.g. 0=f16,-1=f16");
  cmd->add_option("--budget", args->budget, "Byte budget for the pool, e.g. 24GiB, 512MiB, 1073741824");
  cmd->add_option("--seq-len", args->seq_len, "Tokens per sequence (default with --batch: the model's context)");
  cmd->add_option("--batch", args->batch, "Sequences wanted at once");
  cmd->add_option("--sliding-window", args->sliding_window,
                  "Sliding-window layers: tokens each sees (a hybrid cache: sliding groups keep only their window)");
  cmd->add_option("--sliding-pattern", args->sliding_pattern,
                  "With --sliding-window: every Nth layer attends fully (default 6, as Gemma 3; 1 = every layer slides)");
  cmd->add_option("--kv-cache", args->kv_cache, "auto (default), hybrid, or uniform: every layer keeps every token");
  cmd->add_option("--tp", args->tp,
                  "Tensor parallel ranks: plan one rank's pool (its share of the KV heads; --budget is per rank)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--pp", args->pp,
                  "Pipeline parallel stages: plan the largest stage's pool (its layers; --budget is per rank)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--cp", args->cp,
                  "Context parallel ranks: plan one rank's pool (its slice of every block; --budget is per rank)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->add_flag("--explain", args->explain, "Show how each number is derived and what to change");
  cmd->callback([args, cmd, &exit_code] { exit_code = RunPlan(*args, *cmd); });
  return cmd;
}

}  // namespace pagekv::cli
