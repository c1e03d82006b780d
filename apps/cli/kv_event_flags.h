// The KV-event flags shared by `pagekv generate` and `pagekv serve`.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "pagekv/prefix_cache.h"

namespace pagekv::cli {

struct KvEventArgs {
  KvEventsOptions options;
  std::string hash = "int";
};

// --kv-events-endpoint, --kv-events-wait-ms, --kv-events-topic,
// --kv-events-instance, --kv-events-hash, --kv-events-replay-endpoint,
// --kv-events-buffer.
void AddKvEventFlags(CLI::App* cmd, KvEventArgs& args);

// The options the flags name (their values are checked by CLI11).
KvEventsOptions ToKvEventsOptions(const KvEventArgs& args);

}  // namespace pagekv::cli
