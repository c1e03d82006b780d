// `pagekv replay`: a real serving trace through the real prefix cache and
// block pool (semantics in include/pagekv/replay.h).
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

struct ReplayArgs {
  std::string trace, format = "auto", hash = "sha256";
  int32_t block_len = 512;
  int64_t capacity = 0;
  int32_t sliding_window = 0, sliding_pattern = 6;
  bool json = false;
};

int RunReplay(const ReplayArgs& a) {
  ReplayOptions o;
  o.trace_path = a.trace;
  o.block_len = a.block_len;
  o.capacity_blocks = a.capacity;
  o.sliding_window = a.sliding_window;
  o.sliding_pattern = a.sliding_pattern;
  Result<TraceFormat> format = ParseTraceFormat(a.format);
  if (!format.ok()) {
    std::fprintf(stderr, "error: --format: %s\n", format.status().message().c_str());
    return kExitBadInput;
  }
  o.format = *format;
  if (a.hash == "xxh3") {
    o.hash = BlockHashKind::kXxh3_128;
  } else if (a.hash != "sha256") {
    std::fprintf(stderr, "error: --hash '%s': use sha256 or xxh3\n", a.hash.c_str());
    return kExitBadInput;
  }
  Result<ReplayReport> r = ReplayTrace(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    return r.status().code() == StatusCode::kInternal ? kExitFailed : kExitBadInput;
  }
  if (a.json) {
    nlohmann::ordered_json j;
    j["format"] = r->format;
    j["block_len"] = a.block_len;
    j["capacity_blocks"] = a.capacity > 0 ? nlohmann::ordered_json(a.capacity) : nlohmann::ordered_json("unlimited");
    j["sliding_window"] = a.sliding_window;
    j["kv_groups"] = r->kv_groups;
    j["requests"] = r->requests;
    j["rejected"] = r->rejected;
    j["total_blocks"] = r->total_blocks;
    j["hit_blocks"] = r->hit_blocks;
    j["block_hit_rate"] = r->block_hit_rate;
    j["hit_tokens"] = r->hit_tokens;
    j["token_hit_rate"] = r->token_hit_rate;
    j["evicted_blocks"] = r->evicted_blocks;
    j["peak_blocks_cached"] = r->peak_blocks_cached;
    j["seconds"] = r->seconds;
    j["lookups_per_second"] = r->lookups_per_second;
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("replay of %s (%s): %ld requests, block_len %d, capacity %s blocks\n", a.trace.c_str(),
              r->format.c_str(), static_cast<long>(r->requests), a.block_len,
              a.capacity > 0 ? std::to_string(a.capacity).c_str() : "unlimited");
  if (a.sliding_window > 0) {
    std::printf("  hybrid cache      %d groups (6 layers, every %dth full, the rest sliding over %d tokens)\n",
                r->kv_groups, a.sliding_pattern, a.sliding_window);
  }
  std::printf("  rejected          %ld\n", static_cast<long>(r->rejected));
  std::printf("  full blocks       %ld, %ld hit (%.2f%%)\n", static_cast<long>(r->total_blocks),
              static_cast<long>(r->hit_blocks), 100 * r->block_hit_rate);
  std::printf("  tokens            %ld, %ld hit (%.2f%%)\n", static_cast<long>(r->total_tokens),
              static_cast<long>(r->hit_tokens), 100 * r->token_hit_rate);
  std::printf("  evicted blocks    %ld; at most %ld blocks cached\n", static_cast<long>(r->evicted_blocks),
              static_cast<long>(r->peak_blocks_cached));
  std::printf("  time              %.2f s, %.0f requests (lookup + admit + publish + free) per second\n", r->seconds,
              r->lookups_per_second);
  return kExitOk;
}

}  // namespace

CLI::App* AddReplayCommand(CLI::App& app, int& exit_code) {
  static ReplayArgs args;
  CLI::App* cmd = app.add_subcommand("replay", "Replay a serving trace through the real prefix cache and block pool");
  cmd->add_option("--trace", args.trace, "Trace file: Mooncake JSON lines or an Azure CSV")->required();
  cmd->add_option("--format", args.format, "mooncake, azure or auto (default: by extension)");
  cmd->add_option("--block-len", args.block_len, "Tokens per block (default 512, the Mooncake chunk)");
  cmd->add_option("--capacity-blocks", args.capacity, "Pool size in blocks (default: unlimited)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--hash", args.hash, "Block key hash: sha256 (default) or xxh3");
  cmd->add_option("--sliding-window", args.sliding_window,
                  "A hybrid cache: 6 layers, every --sliding-pattern-th full, the rest sliding over this many tokens");
  cmd->add_option("--sliding-pattern", args.sliding_pattern, "With --sliding-window: every Nth layer full (default 6)");
  cmd->add_flag("--json", args.json, "Print one JSON object");
  cmd->callback([&exit_code] { exit_code = RunReplay(args); });
  return cmd;
}

}  // namespace pagekv::cli
