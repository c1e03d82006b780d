// The KV-tier flags shared by `pagekv generate`, `serve` and `bench serve`.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "pagekv/tiers.h"

namespace pagekv::cli {

struct TierArgs {
  std::string host_cache, disk_cache, disk_cache_size, redis, redis_cluster, redis_namespace;
  std::string redis_password_env = "PAGEKV_REDIS_PASSWORD";
  std::string redis_password_file;
  std::string tier_key_env, tier_key_file;  // empty env: PAGEKV_TIER_KEY when set
  bool write_back = false;
};

// --host-cache, --disk-cache, --disk-cache-size, --redis,
// --redis-password-env, --redis-password-file, --tier-key-env,
// --tier-key-file, --tier-write-back.
void AddTierFlags(CLI::App* cmd, TierArgs& args);

// Fills o (sizes parsed, the Redis password and the tier key read from an
// environment variable or a file, never from the command line); false after
// printing an error that names the flag.
bool ToTierOptions(const TierArgs& args, TierOptions& o);

}  // namespace pagekv::cli
