// The KV-tier flags shared by `pagekv generate`, `serve` and `bench serve`.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "pagekv/tiers.h"

namespace pagekv::cli {

struct TierArgs {
  std::string host_cache, disk_cache, disk_cache_size, redis;
  std::string redis_password_env = "PAGEKV_REDIS_PASSWORD";
  std::string redis_password_file;
  bool write_back = false;
};

// --host-cache, --disk-cache, --disk-cache-size, --redis,
// --redis-password-env, --redis-password-file, --tier-write-back.
void AddTierFlags(CLI::App* cmd, TierArgs& args);

// Fills o (sizes parsed, the Redis password read from the environment
// variable or file, never from the command line); false after printing an
// error that names the flag.
bool ToTierOptions(const TierArgs& args, TierOptions& o);

}  // namespace pagekv::cli
