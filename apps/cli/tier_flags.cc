// KV-tier flags (tier_flags.h).
#include "tier_flags.h"

#include <cstdio>
#include <cstdlib>

#include "pagekv/units.h"
#include "secrets.h"

namespace pagekv::cli {

void AddTierFlags(CLI::App* cmd, TierArgs& a) {
  cmd->add_option("--host-cache", a.host_cache,
                  "RAM tier for KV blocks evicted from the pool, e.g. 2GiB (default: none)");
  cmd->add_option("--disk-cache", a.disk_cache, "Disk tier: a cache file (kept across restarts; needs --disk-cache-size)");
  cmd->add_option("--disk-cache-size", a.disk_cache_size, "Size of the --disk-cache file, e.g. 20GiB");
  cmd->add_option("--redis", a.redis,
                  "Shared Redis tier: redis://HOST[:PORT][/DB]; the password comes from --redis-password-env "
                  "or --redis-password-file, never the command line");
  cmd->add_option("--redis-cluster", a.redis_cluster,
                  "Shared Redis Cluster tier: HOST:PORT[,HOST:PORT...], any of its nodes (the rest are found from "
                  "CLUSTER SLOTS); instead of --redis; the same password flags");
  cmd->add_option("--redis-namespace", a.redis_namespace,
                  "Key prefix in Redis (default pagekv:<model file fingerprint>: processes serving the same model share)");
  cmd->add_option("--redis-password-env", a.redis_password_env,
                  "Environment variable holding the Redis password (default PAGEKV_REDIS_PASSWORD)");
  cmd->add_option("--redis-password-file", a.redis_password_file, "File holding the Redis password");
  cmd->add_option("--tier-key-env", a.tier_key_env,
                  "Environment variable holding the tier key (16+ bytes) that authenticates disk and Redis blocks "
                  "with HMAC-SHA-256 (default: PAGEKV_TIER_KEY when set; without a key they are only checksummed)");
  cmd->add_option("--tier-key-file", a.tier_key_file, "File holding the tier key (instead of --tier-key-env)");
  cmd->add_flag("--tier-write-back", a.write_back,
                "Copy blocks down only when evicted (default: write-through to disk and Redis as blocks fill)");
}

bool ToTierOptions(const TierArgs& a, TierOptions& o) {
  auto bytes = [](const std::string& flag, const std::string& text, int64_t& out) {
    if (text.empty()) return true;
    Result<int64_t> v = ParseByteSize(text);
    if (!v.ok() || *v <= 0) {
      std::fprintf(stderr, "error: %s '%s': %s\n", flag.c_str(), text.c_str(),
                   v.ok() ? "must be positive" : v.status().message().c_str());
      return false;
    }
    out = *v;
    return true;
  };
  if (!bytes("--host-cache", a.host_cache, o.host_bytes) || !bytes("--disk-cache-size", a.disk_cache_size, o.disk_bytes)) {
    return false;
  }
  o.disk_path = a.disk_cache;
  if (!o.disk_path.empty() && o.disk_bytes == 0) {
    std::fprintf(stderr, "error: --disk-cache needs --disk-cache-size (e.g. --disk-cache-size 8GiB)\n");
    return false;
  }
  if (o.disk_path.empty() && o.disk_bytes > 0) {
    std::fprintf(stderr, "error: --disk-cache-size without --disk-cache PATH\n");
    return false;
  }
  o.redis_url = a.redis;
  o.redis_cluster = a.redis_cluster;
  o.redis_namespace = a.redis_namespace;
  if (!o.redis_url.empty() && !o.redis_cluster.empty()) {
    std::fprintf(stderr, "error: give --redis (one server) or --redis-cluster (a cluster), not both\n");
    return false;
  }
  if (!a.redis_password_file.empty()) {
    if (!ReadSecretFile("--redis-password-file", a.redis_password_file, o.redis_password)) return false;
  } else if (!a.redis_password_env.empty()) {
    if (const char* pw = std::getenv(a.redis_password_env.c_str())) o.redis_password = pw;
  }
  if (!a.tier_key_file.empty() && !a.tier_key_env.empty()) {
    std::fprintf(stderr, "error: give --tier-key-env or --tier-key-file, not both\n");
    return false;
  }
  if (!a.tier_key_file.empty()) {
    if (!ReadSecretFile("--tier-key-file", a.tier_key_file, o.payload_key)) return false;
  } else if (!a.tier_key_env.empty()) {
    if (!ReadSecretEnv("--tier-key-env", a.tier_key_env, o.payload_key)) return false;
  } else if (const char* k = std::getenv("PAGEKV_TIER_KEY"); k != nullptr && *k != '\0') {
    o.payload_key = k;
  }
  o.write_through = !a.write_back;
  o.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  return true;
}

}  // namespace pagekv::cli
