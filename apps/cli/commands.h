// Subcommands of the `pagekv` CLI. Each registers its options on a CLI11 app
// and runs after parsing; Run* returns the process exit code: 0 success,
// 1 the work failed, 2 bad input (the message names the problem and the fix).
#pragma once

#include <CLI/CLI.hpp>

namespace pagekv::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitBadInput = 2;

// `pagekv plan`: bytes a model's KV cache needs; see plan_command.cc.
CLI::App* AddPlanCommand(CLI::App& app, int& exit_code);
// `pagekv demo`: the core at work on random sequences; see demo_command.cc.
CLI::App* AddDemoCommand(CLI::App& app, int& exit_code);
// `pagekv bench attention | generate`: against the measured roofline; see bench_command.cc.
CLI::App* AddBenchCommand(CLI::App& app, int& exit_code);
// `pagekv bench attention`, registered under `bench`; see bench_attention_command.cc.
void AddBenchAttentionCommand(CLI::App& bench, int& exit_code);
// `pagekv bench collectives`, registered under `bench`; see bench_collectives_command.cc.
void AddBenchCollectivesCommand(CLI::App& bench, int& exit_code);
// `pagekv generate`: text from a llama model on the paged cache; see generate_command.cc.
CLI::App* AddGenerateCommand(CLI::App& app, int& exit_code);
// `pagekv synth-model`: a random-weight llama GGUF; see synth_command.cc.
CLI::App* AddSynthModelCommand(CLI::App& app, int& exit_code);
// `pagekv replay`: a serving trace through the prefix cache; see replay_command.cc.
CLI::App* AddReplayCommand(CLI::App& app, int& exit_code);
// `pagekv serve`: the OpenAI-compatible HTTP server; see serve_command.cc.
CLI::App* AddServeCommand(CLI::App& app, int& exit_code);
// `pagekv route`: the KV-aware router; see route_command.cc.
CLI::App* AddRouteCommand(CLI::App& app, int& exit_code);
// `pagekv chat`: an interactive conversation, KV kept across turns; see chat_command.cc.
CLI::App* AddChatCommand(CLI::App& app, int& exit_code);
// `pagekv eval kv`: a KV format's fidelity cost on a real model; see eval_command.cc.
CLI::App* AddEvalCommand(CLI::App& app, int& exit_code);

}  // namespace pagekv::cli
