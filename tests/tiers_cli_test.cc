// KV tiers through the `pagekv` binary: separate processes share prefixes
// through a real redis-server and a disk cache file, and every fault (Redis
// killed, a flipped byte in Redis or on disk, a truncated cache file, another
// model at the same Redis) ends with the same tokens and a counted, logged
// fallback.
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/redis_server.h"

namespace {

using json = nlohmann::json;
constexpr const char* kGguf = "../shared/models/stories260K/stories260K.gguf";
constexpr const char* kBin = "../shared/models/stories260K/stories260K.bin";
constexpr const char* kTok = "../shared/models/stories260K/tok512.bin";
constexpr const char* kPrompt =
    "Once upon a time there was a little girl named Lily. She liked to play outside with her friends in the park";

struct CliRun {
  int exit_code = -1;
  std::string out;  // stdout and stderr
  std::vector<int> ids;
  json stats;
};

CliRun Generate(const std::string& tier_flags, const std::string& model = std::string("--model ") + kGguf) {
  const std::string cmd = std::string(PAGEKV_CLI_PATH) + " generate " + model + " --prompt '" + kPrompt +
                          "' -n 24 --block-len 8 --json " + tier_flags + " 2>&1";
  CliRun r;
  FILE* pipe = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), pipe)) > 0;) r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    const json j = json::parse(line);
    if (j.contains("generated_ids")) r.ids = j["generated_ids"].get<std::vector<int>>();
    if (j.contains("stats")) r.stats = j["stats"];
  }
  return r;
}

// The tokens without any tier: the reference.
const std::vector<int>& Want() {
  static const std::vector<int> ids = Generate("").ids;
  return ids;
}

// Every "pagekv:..." key in the server.
std::vector<std::string> Keys(const pagekv::testing::RedisServer& redis) {
  std::vector<std::string> keys;
  std::istringstream in(*redis.Command("KEYS pagekv:*"));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.rfind("pagekv:", 0) == 0) keys.push_back(line);
  }
  return keys;
}

class TiersCliTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(redis_.Start().ok()); }
  void TearDown() override {
    std::filesystem::remove(disk_);
    std::filesystem::remove(disk_ + ".index");
  }
  std::string RedisFlags() const { return "--redis " + redis_.url(); }
  std::string DiskFlags() const { return "--disk-cache " + disk_ + " --disk-cache-size 4MiB"; }
  pagekv::testing::RedisServer redis_;
  std::string disk_ = (std::filesystem::temp_directory_path() / ("pagekv-cli-disk-" + std::to_string(::getpid()))).string();
};

TEST_F(TiersCliTest, ASecondProcessHitsWhatTheFirstPutInRedis) {
  ASSERT_FALSE(Want().empty());
  const CliRun first = Generate(RedisFlags());
  ASSERT_EQ(first.exit_code, 0) << first.out;
  EXPECT_EQ(first.ids, Want());
  EXPECT_EQ(first.stats["redis_hit_blocks"], 0);
  EXPECT_FALSE(Keys(redis_).empty());
  const CliRun second = Generate(RedisFlags());
  ASSERT_EQ(second.exit_code, 0) << second.out;
  EXPECT_EQ(second.ids, Want());
  EXPECT_GE(second.stats["redis_hit_blocks"].get<int>(), 3) << second.out;
  EXPECT_EQ(second.stats["tier_errors"], 0);
}

TEST_F(TiersCliTest, AnotherModelFileAtTheSameRedisNeverHits) {
  ASSERT_EQ(Generate(RedisFlags()).exit_code, 0);
  const CliRun other = Generate(RedisFlags(), std::string("--model ") + kBin + " --tokenizer " + kTok);
  ASSERT_EQ(other.exit_code, 0) << other.out;
  EXPECT_EQ(other.stats["redis_hit_blocks"], 0);
  EXPECT_EQ(other.ids, Want());  // the same weights in the other format
}

TEST_F(TiersCliTest, FlippedBytesInRedisAreMissesCountedAndLogged) {
  ASSERT_EQ(Generate(RedisFlags()).exit_code, 0);
  const auto keys = Keys(redis_);
  ASSERT_FALSE(keys.empty());
  for (const std::string& k : keys) ASSERT_TRUE(redis_.Command("SETRANGE " + k + " 300 X").ok());
  const CliRun r = Generate(RedisFlags());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.ids, Want());
  EXPECT_EQ(r.stats["redis_hit_blocks"], 0);
  EXPECT_GE(r.stats["tier_errors"].get<int>(), 1);
  EXPECT_NE(r.out.find("failed its checks"), std::string::npos) << "the fallback is logged:\n" << r.out;
}

TEST_F(TiersCliTest, AFullDiskTierEvictsAndChangesNoToken) {
  // Room for two blocks: every run evicts, and whatever is found still checks out.
  const std::string flags = "--disk-cache " + disk_ + " --disk-cache-size 24KiB";
  for (int run = 0; run < 3; ++run) {
    const CliRun r = Generate(flags);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(r.ids, Want());
    EXPECT_LE(r.stats["disk_hit_blocks"].get<int>(), 2);
    EXPECT_EQ(r.stats["tier_errors"], 0);
  }
}

TEST_F(TiersCliTest, RedisDownOrRestartedEmptyChangesNoToken) {
  ASSERT_EQ(Generate(RedisFlags()).exit_code, 0);
  redis_.Kill();
  const CliRun down = Generate(RedisFlags());
  ASSERT_EQ(down.exit_code, 0) << down.out;
  EXPECT_EQ(down.ids, Want());
  EXPECT_GE(down.stats["tier_errors"].get<int>(), 1);
  EXPECT_NE(down.out.find("tiers: redis"), std::string::npos) << "the fallback is logged:\n" << down.out;
  ASSERT_TRUE(redis_.Start().ok());  // back, empty
  const CliRun empty = Generate(RedisFlags());
  ASSERT_EQ(empty.exit_code, 0) << empty.out;
  EXPECT_EQ(empty.ids, Want());
  EXPECT_EQ(empty.stats["redis_hit_blocks"], 0);
  EXPECT_GE(Generate(RedisFlags()).stats["redis_hit_blocks"].get<int>(), 3);  // refilled
}

TEST_F(TiersCliTest, DiskCacheSurvivesRestartsAndCorruptionNeverServesWrongKv) {
  ASSERT_EQ(Generate(DiskFlags()).exit_code, 0);
  const auto file_size = std::filesystem::file_size(disk_);  // whole slots of the 4 MiB
  EXPECT_LE(file_size, 4u << 20);
  const CliRun again = Generate(DiskFlags());
  ASSERT_EQ(again.exit_code, 0) << again.out;
  EXPECT_EQ(again.ids, Want());
  EXPECT_GE(again.stats["disk_hit_blocks"].get<int>(), 3);
  // A flipped byte in every slot's KV.
  {
    std::fstream f(disk_, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(std::filesystem::file_size(disk_));
    for (std::streamoff at = 104 + 4 * 8 + 9; at < size; at += 4096) {
      f.seekg(at);
      const char c = static_cast<char>(f.get());
      f.seekp(at);
      f.put(static_cast<char>(c ^ 0x5a));
    }
  }
  const CliRun flipped = Generate(DiskFlags());
  ASSERT_EQ(flipped.exit_code, 0) << flipped.out;
  EXPECT_EQ(flipped.ids, Want());
  EXPECT_EQ(flipped.stats["disk_hit_blocks"], 0);
  EXPECT_GE(flipped.stats["tier_errors"].get<int>(), 1);
  EXPECT_NE(flipped.out.find("tiers: disk get"), std::string::npos) << "the fallback is logged:\n" << flipped.out;
  // A truncated file: recreated, no hit, same tokens.
  std::filesystem::resize_file(disk_, 5000);
  const CliRun cut = Generate(DiskFlags());
  ASSERT_EQ(cut.exit_code, 0) << cut.out;
  EXPECT_EQ(cut.ids, Want());
  EXPECT_EQ(cut.stats["disk_hit_blocks"], 0);
  EXPECT_EQ(std::filesystem::file_size(disk_), file_size);
}

TEST_F(TiersCliTest, BadTierFlagsAreNamed) {
  CliRun r = Generate("--disk-cache " + disk_);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--disk-cache-size"), std::string::npos) << r.out;
  r = Generate("--host-cache lots");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--host-cache"), std::string::npos) << r.out;
  r = Generate("--redis localhost:6379");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("redis://"), std::string::npos) << r.out;
  r = Generate("--redis " + redis_.url() + " --redis-password-file /nonexistent/pw");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--redis-password-file"), std::string::npos) << r.out;
}

}  // namespace
