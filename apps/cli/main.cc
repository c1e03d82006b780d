// pagekv: the PageKV command line.
//
//   pagekv plan   --preset llama3-8b --budget 24GiB --seq-len 8192 [--json] [--explain]
//   pagekv demo   [--sequences 300] [--seed 1]
//   pagekv bench attention [--json] [--quick | --full] [--threads N]
//   pagekv generate --model stories260K.gguf --prompt "Once upon a time" [-n 64] [--json]
//   pagekv chat     --model SmolLM2-135M-Instruct.Q4_1.gguf [--system "..."]
//
// Exit codes: 0 success, 1 the work failed, 2 bad input.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "pagekv/version.h"

int main(int argc, char** argv) {
  CLI::App app{"PageKV: a paged KV-cache engine for LLM inference", "pagekv"};
  app.require_subcommand(1);
  app.set_version_flag("--version", PAGEKV_VERSION);
  int exit_code = pagekv::cli::kExitOk;
  pagekv::cli::AddPlanCommand(app, exit_code);
  pagekv::cli::AddDemoCommand(app, exit_code);
  pagekv::cli::AddBenchCommand(app, exit_code);
  pagekv::cli::AddGenerateCommand(app, exit_code);
  pagekv::cli::AddSynthModelCommand(app, exit_code);
  pagekv::cli::AddReplayCommand(app, exit_code);
  pagekv::cli::AddServeCommand(app, exit_code);
  pagekv::cli::AddRouteCommand(app, exit_code);
  pagekv::cli::AddChatCommand(app, exit_code);
  pagekv::cli::AddEvalCommand(app, exit_code);
  if (argc > 1 && argv[1][0] != '-') {
    // Name an unknown command rather than CLI11's generic "subcommand required".
    std::string known;
    bool found = false;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      found = found || sub->get_name() == argv[1];
      known += (known.empty() ? "" : ", ") + sub->get_name();
    }
    if (!found) {
      std::fprintf(stderr, "error: unknown command '%s': use one of %s\n", argv[1], known.c_str());
      return pagekv::cli::kExitBadInput;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "error: %s (see pagekv --help)\n", e.what());
    return pagekv::cli::kExitBadInput;
  }
  return exit_code;
}
