// `pagekv chat`: an interactive conversation in the terminal. Each turn the
// whole conversation is rendered through the chat template and submitted to
// the engine; the previous turns' KV (prompt and answer) is still in the
// prefix cache, so only the new message is computed. After each answer a
// line on stderr says how many prompt tokens came from the cache and how
// fast the answer was written.
//
// Input: one message per line (a line ending in '\' continues on the next);
// /reset forgets the conversation, /exit (or end of input) ends. Ctrl-C stops
// the answer being written; at the prompt it ends the chat.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {
namespace {

std::atomic<int> g_interrupts{0};
void OnInterrupt(int) { g_interrupts.fetch_add(1); }

struct ChatArgs {
  std::string model, tokenizer, system, chat_template, kv_budget, kv_dtype = "f32";
  int32_t n = 0, top_k = 0, block_len = 16;
  float temp = 0.7f, top_p = 0.9f, repeat_penalty = 1.0f;
  std::optional<uint64_t> seed;
  int64_t blocks = 0;
  int threads = 0;
  bool no_stats = false;
};

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// One message from stdin (continuation lines joined); nullopt at the end.
std::optional<std::string> ReadMessage(bool tty) {
  std::string message, line;
  if (tty) std::fputs("> ", stdout), std::fflush(stdout);
  while (std::getline(std::cin, line)) {
    if (!line.empty() && line.back() == '\\') {
      line.pop_back();
      message += line + "\n";
      if (tty) std::fputs(". ", stdout), std::fflush(stdout);
      continue;
    }
    return message + line;
  }
  if (!message.empty()) return message;
  return std::nullopt;
}

int RunChat(const ChatArgs& a) {
  EngineOptions o;
  o.model_path = a.model;
  o.tokenizer_path = a.tokenizer;
  o.block_len = a.block_len;
  o.threads = a.threads;
  o.chat_template = a.chat_template;
  o.prefix_cache = true;
  o.max_running = 1;
  Result<DType> dt = ParseDType(a.kv_dtype);
  if (!dt.ok()) {
    std::fprintf(stderr, "error: --kv-dtype: %s\n", dt.status().message().c_str());
    return kExitBadInput;
  }
  o.kv_dtype = *dt;
  if (a.blocks > 0) {
    o.num_blocks = a.blocks;
  } else if (!a.kv_budget.empty()) {
    Result<int64_t> budget = ParseByteSize(a.kv_budget);
    if (!budget.ok()) {
      std::fprintf(stderr, "error: --kv-budget: %s\n", budget.status().message().c_str());
      return kExitBadInput;
    }
    o.kv_budget_bytes = *budget;
  }  // neither: the engine's pool holds one full context
  Result<std::unique_ptr<Engine>> created = Engine::Create(o);
  if (!created.ok()) {
    std::fprintf(stderr, "error: %s\n", created.status().message().c_str());
    const StatusCode c = created.status().code();
    return c == StatusCode::kInternal || c == StatusCode::kIoError ? kExitFailed : kExitBadInput;
  }
  Engine& engine = **created;
  // A conversation needs a template that renders: check it once, now.
  if (Result<std::vector<int32_t>> probe = engine.EncodeChat(R"([{"role":"user","content":"hi"}])"); !probe.ok()) {
    std::fprintf(stderr, "error: the chat template does not render: %s (override it with --chat-template)\n",
                 probe.status().message().c_str());
    return kExitBadInput;
  }
  SamplingOptions sampling{.temperature = a.temp, .top_k = a.top_k, .top_p = a.top_p, .repetition_penalty = a.repeat_penalty, .seed = a.seed};
  if (Status s = ValidateSampling(sampling); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.message().c_str());
    return kExitBadInput;
  }
  const bool tty = ::isatty(STDIN_FILENO) != 0;
  std::fprintf(stderr,
               "pagekv chat: %s, chat template %s, context %d tokens. /reset forgets the conversation; /exit or end of "
               "input ends%s.\n",
               a.model.c_str(), engine.chat_template_name().c_str(), engine.context_len(),
               tty ? "; Ctrl-C stops an answer" : "");
  // No SA_RESTART: Ctrl-C at the prompt interrupts the read, which ends the chat.
  struct sigaction sa {};
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);

  nlohmann::json history = nlohmann::json::array();
  if (!a.system.empty()) history.push_back({{"role", "system"}, {"content", a.system}});
  const size_t first_turn = history.size();  // the system message is never dropped
  int turn = 0;
  for (;;) {
    g_interrupts = 0;
    std::optional<std::string> in = ReadMessage(tty);
    if (!in || g_interrupts.load() > 0) break;
    const std::string text = Trim(*in);
    if (text.empty()) continue;
    if (text == "/exit" || text == "/quit") break;
    if (text == "/reset") {
      history.erase(history.begin() + static_cast<std::ptrdiff_t>(first_turn), history.end());
      std::fprintf(stderr, "(conversation forgotten)\n");
      continue;
    }
    nlohmann::json next = history;
    next.push_back({{"role", "user"}, {"content", *in}});
    // Render; when the conversation outgrows the context (or the pool),
    // the oldest exchanges go first, the system message stays.
    EngineRequest r;
    r.sampling = sampling;
    Status refused;
    size_t dropped = 0;
    for (;;) {
      Result<std::vector<int32_t>> ids = engine.EncodeChat(next.dump());
      if (!ids.ok()) {
        refused = ids.status();
        break;
      }
      r.prompt = std::move(*ids);
      const int64_t room = engine.context_len() - static_cast<int64_t>(r.prompt.size());
      r.max_tokens = static_cast<int32_t>(a.n > 0 ? std::min<int64_t>(a.n, room) : room);
      if (room >= 1) break;
      // Drop the oldest message after the system one, and its answer.
      if (next.size() <= first_turn + 1) {
        refused = OutOfRangeError("the message alone has " + std::to_string(r.prompt.size()) +
                                  " tokens with the template; the context holds " + std::to_string(engine.context_len()));
        break;
      }
      const size_t drop = next.size() - first_turn >= 3 ? 2 : 1;
      next.erase(next.begin() + static_cast<std::ptrdiff_t>(first_turn),
                 next.begin() + static_cast<std::ptrdiff_t>(first_turn + drop));
      ++dropped;
    }
    if (!refused.ok()) {
      std::fprintf(stderr, "error: %s\n", refused.message().c_str());
      continue;
    }
    if (dropped > 0) std::fprintf(stderr, "(the oldest %zu exchange(s) dropped to fit the context)\n", dropped);
    r.on_update = [](const TokenUpdate& u) {
      if (!u.text.empty()) {
        std::fwrite(u.text.data(), 1, u.text.size(), stdout);
        std::fflush(stdout);
      }
    };
    const auto start = std::chrono::steady_clock::now();
    Result<RequestId> id = engine.Submit(std::move(r));
    if (!id.ok()) {
      std::fprintf(stderr, "error: %s (/reset starts over; a larger --kv-budget holds more)\n",
                   id.status().message().c_str());
      continue;
    }
    std::optional<RequestResult> result;
    bool cancelled = false;
    while (!(result = engine.TryResult(*id))) {
      if (g_interrupts.load() > 0 && !cancelled) cancelled = engine.Cancel(*id);
      Result<bool> worked = engine.Step();
      if (!worked.ok()) {
        std::fprintf(stderr, "\nerror: %s\n", worked.status().message().c_str());
        return kExitFailed;
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("\n");
    std::fflush(stdout);
    if (result->finish == FinishReason::kError) {
      std::fprintf(stderr, "error: %s\n", result->error.message().c_str());
      continue;
    }
    ++turn;
    history = std::move(next);
    history.push_back({{"role", "assistant"}, {"content", result->text}});
    if (!a.no_stats) {
      double decode = 0;
      for (double t : result->inter_token) decode += t;
      const int64_t generated = static_cast<int64_t>(result->tokens.size());
      const double rate = decode > 0 ? static_cast<double>(result->inter_token.size()) / decode : 0.0;
      std::fprintf(stderr,
                   "[turn %d: %ld prompt tokens, %ld from the prefix cache; %ld generated, %.1f tokens/s; first token "
                   "%.0f ms; %.2f s in all%s]\n",
                   turn, static_cast<long>(result->prompt_tokens), static_cast<long>(result->cached_prompt_tokens),
                   static_cast<long>(generated), rate, result->time_to_first_token * 1e3, seconds,
                   result->finish == FinishReason::kCancelled ? "; stopped"
                   : result->finish == FinishReason::kLength  ? "; cut at the token limit"
                                                              : "");
    }
  }
  if (tty) std::printf("\n");
  return kExitOk;
}

}  // namespace

CLI::App* AddChatCommand(CLI::App& app, int& exit_code) {
  static ChatArgs args;
  CLI::App* cmd = app.add_subcommand(
      "chat", "Chat in the terminal: the conversation's KV stays cached across turns (tokens/s after each answer)");
  cmd->add_option("--model", args.model, "Model: a .gguf file (an instruct model with a chat template)")->required();
  cmd->add_option("--tokenizer", args.tokenizer, "llama2.c tokenizer.bin (for .bin checkpoints)");
  cmd->add_option("--system", args.system, "A system message that opens the conversation");
  cmd->add_option("--chat-template", args.chat_template,
                  "Override the model's template: chatml, llama3, llama2, mistral, gemma, phi3, zephyr, or a Jinja file");
  cmd->add_option("-n,--max-tokens", args.n, "Most tokens per answer (default: until the turn ends)")
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--temp", args.temp, "Temperature (default 0.7; 0 = greedy)");
  cmd->add_option("--top-k", args.top_k, "Keep the k most likely tokens (0 = off, the default)");
  cmd->add_option("--top-p", args.top_p, "Nucleus sampling mass in (0, 1] (default 0.9)");
  cmd->add_option("--repeat-penalty", args.repeat_penalty, "Repetition penalty >= 1 (1 = off, the default)");
  cmd->add_option("--seed", args.seed, "Sampling seed (default: a fresh one from the OS)");
  cmd->add_option("--kv-budget", args.kv_budget, "KV pool size, e.g. 512MiB (default: one full context)");
  cmd->add_option("--blocks", args.blocks, "KV pool size in blocks (instead of --kv-budget)")->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  cmd->add_option("--block-len", args.block_len, "Tokens per KV block (default 16)")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--kv-dtype", args.kv_dtype, "KV storage: f32 (default), f16, bf16, int8, fp8_e4m3, fp8_e5m2, int4");
  cmd->add_option("--threads", args.threads, "Threads for the kernels (default: every hardware thread)")
      ->check(CLI::Range(0, 4096));
  cmd->add_flag("--no-stats", args.no_stats, "No statistics line after each answer");
  cmd->callback([&exit_code] { exit_code = RunChat(args); });
  return cmd;
}

}  // namespace pagekv::cli
