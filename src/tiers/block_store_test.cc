// Round trips and faults of each BlockStore, against real files and a real
// redis-server.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "pagekv/tiers.h"
#include "testing/redis_server.h"
#include "tiers/block_payload.h"

namespace pagekv {
namespace {

constexpr int32_t kBlockLen = 8;
constexpr int64_t kKvBytes = 3000;  // not a multiple of anything on purpose

BlockKey KeyOf(uint64_t i) {
  BlockKey k;
  std::mt19937_64 rng(i * 7919 + 1);
  for (auto& b : k.bytes) b = static_cast<uint8_t>(rng());
  return k;
}

BlockMeta Meta(uint64_t i) {
  BlockMeta m;
  m.key = KeyOf(i);
  if (i % 2 == 1) m.parent = KeyOf(i + 1000);
  for (int t = 0; t < kBlockLen; ++t) m.tokens.push_back(static_cast<int32_t>(i * 100 + t));
  m.geometry = 0xfeedULL;
  return m;
}

std::vector<std::byte> Kv(uint64_t i) {
  std::vector<std::byte> kv(kKvBytes);
  std::mt19937 rng(static_cast<uint32_t>(i));
  for (auto& b : kv) b = static_cast<std::byte>(rng());
  return kv;
}

// Put then Get returns the same bytes; the wrong meta never does.
void ExpectRoundTrip(BlockStore& s, uint64_t i) {
  ASSERT_TRUE(s.Put(Meta(i), Kv(i)).ok());
  EXPECT_TRUE(*s.Contains(Meta(i).key));
  std::vector<std::byte> out(kKvBytes);
  ASSERT_TRUE(*s.Get(Meta(i), out));
  EXPECT_EQ(out, Kv(i));
  s.CheckInvariants();
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("pagekv-tier-" + std::to_string(::getpid()) + "-" + name)).string();
}

class TierPayloadTest : public ::testing::TestWithParam<bool> {
 protected:
  tiers::PayloadSeal seal_ = GetParam() ? tiers::PayloadSeal(std::string(32, 'k')) : tiers::PayloadSeal();
};

TEST_P(TierPayloadTest, EveryFieldIsCheckedOnDecode) {
  const tiers::PayloadSeal& seal = seal_;
  std::vector<std::byte> p;
  tiers::EncodePayload(Meta(3), Kv(3), seal, p);
  EXPECT_EQ(p.size(), tiers::PayloadBytes(kBlockLen, kKvBytes));
  std::vector<std::byte> out(kKvBytes);
  ASSERT_TRUE(tiers::DecodePayload(p, Meta(3), out, seal).ok());
  EXPECT_EQ(out, Kv(3));
  // Another key, parent, tokens or geometry than asked: refused.
  BlockMeta other = Meta(3);
  other.key = KeyOf(4);
  EXPECT_EQ(tiers::DecodePayload(p, other, out, seal).code(), StatusCode::kDataLoss);
  other = Meta(3);
  other.parent.reset();
  EXPECT_EQ(tiers::DecodePayload(p, other, out, seal).code(), StatusCode::kDataLoss);
  other = Meta(3);
  other.tokens[5] += 1;  // a colliding key with other tokens
  EXPECT_EQ(tiers::DecodePayload(p, other, out, seal).code(), StatusCode::kDataLoss);
  other = Meta(3);
  other.geometry += 1;
  EXPECT_EQ(tiers::DecodePayload(p, other, out, seal).code(), StatusCode::kDataLoss);
  other = Meta(3);
  other.digest.bytes[31] ^= 1;  // same key, parent and tokens after another prefix (colliding keys)
  EXPECT_EQ(tiers::DecodePayload(p, other, out, seal).code(), StatusCode::kDataLoss);
  // Any flipped byte fails the checksum (or an earlier check); truncation too.
  for (size_t at : {size_t{0}, size_t{9}, size_t{100}, tiers::kHeaderBytes + 3, p.size() - 1}) {
    std::vector<std::byte> bad = p;
    bad[at] ^= std::byte{0x10};
    EXPECT_EQ(tiers::DecodePayload(bad, Meta(3), out, seal).code(), StatusCode::kDataLoss) << "byte " << at;
  }
  EXPECT_EQ(tiers::DecodePayload(std::span(p).first(p.size() - 1), Meta(3), out, seal).code(), StatusCode::kDataLoss);
  EXPECT_EQ(tiers::DecodePayload(std::span(p).first(50), Meta(3), out, seal).code(), StatusCode::kDataLoss);
}

INSTANTIATE_TEST_SUITE_P(Seals, TierPayloadTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Keyed" : "Checksum"; });

// What someone who can write a store (the disk file, the Redis namespace)
// but lacks the key can make: an altered block re-sealed with the checksum,
// one sealed under their own key, a valid one replayed under another key.
// A keyed store refuses each as not authentic; an unkeyed one accepts the
// re-sealed one, which is why disk and Redis want a key.
TEST(TierPayloadAuthTest, ForgedAlteredAndForeignKeyBlocksAreNotAuthentic) {
  const tiers::PayloadSeal mine(std::string("0123456789abcdef-mine"));
  const tiers::PayloadSeal theirs(std::string("0123456789abcdef-theirs"));
  const tiers::PayloadSeal unkeyed;
  std::vector<std::byte> forged, out(kKvBytes);
  std::vector<std::byte> poison = Kv(3);
  poison[17] ^= std::byte{0x55};
  tiers::EncodePayload(Meta(3), poison, unkeyed, forged);  // altered KV, a valid checksum
  EXPECT_TRUE(tiers::DecodePayload(forged, Meta(3), out, unkeyed).ok()) << "without a key, the forgery passes";
  const Status s1 = tiers::DecodePayload(forged, Meta(3), out, mine);
  EXPECT_TRUE(tiers::IsNotAuthentic(s1)) << s1.ToString();
  tiers::EncodePayload(Meta(3), poison, theirs, forged);
  const Status s2 = tiers::DecodePayload(forged, Meta(3), out, mine);
  EXPECT_TRUE(tiers::IsNotAuthentic(s2)) << s2.ToString();
  // A keyed payload whose flag is cleared and checksum recomputed by hand is
  // still refused by the keyed store (it demands the MAC).
  std::vector<std::byte> good;
  tiers::EncodePayload(Meta(3), Kv(3), mine, good);
  ASSERT_TRUE(tiers::DecodePayload(good, Meta(3), out, mine).ok());
  EXPECT_EQ(out, Kv(3));
  const Status s3 = tiers::DecodePayload(good, Meta(3), out, unkeyed);
  EXPECT_FALSE(s3.ok());
  // A configuration mismatch, named as such, and counted as not authentic:
  // a shared tier leaves the block for the key's holders.
  EXPECT_TRUE(tiers::IsNotAuthentic(s3));
  EXPECT_NE(s3.message().find("--tier-key"), std::string::npos) << s3.ToString();
  // Every single-bit change anywhere in a keyed payload fails the MAC.
  for (size_t at = 0; at < good.size(); at += 97) {
    std::vector<std::byte> bad = good;
    bad[at] ^= std::byte{0x01};
    EXPECT_FALSE(tiers::DecodePayload(bad, Meta(3), out, mine).ok()) << "byte " << at;
  }
}

// "+<i>" for a block newly held, "-<i>" for one dropped, by KeyOf index.
std::string Describe(const std::vector<TierChange>& changes) {
  std::string out;
  for (const TierChange& c : changes) {
    for (uint64_t i = 0; i < 64; ++i) {
      if (c.meta.key == KeyOf(i)) out += (c.kind == TierChange::Kind::kStored ? " +" : " -") + std::to_string(i);
    }
  }
  return out;
}

TEST(HostStoreTest, RoundTripsAndEvictsLeastRecentlyUsedToItsListener) {
  std::vector<BlockKey> evicted;
  std::vector<TierChange> changes;
  HostStoreOptions o;
  o.on_change = [&](const TierChange& c) {
    EXPECT_EQ(c.tier, Tier::kHost);
    changes.push_back(c);
  };
  o.block_len = kBlockLen;
  o.kv_bytes = kKvBytes;
  o.capacity_bytes = 3 * TierPayloadBytes(kBlockLen, kKvBytes) + 10;
  o.on_evict = [&](const BlockMeta& m, std::span<const std::byte> kv) {
    evicted.push_back(m.key);
    EXPECT_TRUE(std::equal(kv.begin(), kv.end(), Kv(m.tokens[0] / 100).begin()));
  };
  auto s = std::move(*CreateHostStore(o));
  for (uint64_t i = 0; i < 3; ++i) ExpectRoundTrip(*s, i);
  std::vector<std::byte> out(kKvBytes);
  ASSERT_TRUE(*s->Get(Meta(0), out));  // 0 is now the most recent: 1 goes first
  ExpectRoundTrip(*s, 3);
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_EQ(evicted[0], KeyOf(1));
  EXPECT_FALSE(*s->Get(Meta(1), out));
  EXPECT_FALSE(*s->Contains(KeyOf(1)));
  ASSERT_TRUE(s->Remove(KeyOf(0)).ok());
  EXPECT_FALSE(*s->Contains(KeyOf(0)));
  const TierStats st = s->Stats();
  EXPECT_EQ(st.blocks_now, 2);
  EXPECT_EQ(st.evictions, 1);
  EXPECT_EQ(st.puts, 4);
  // Wrong tokens under a held key: a miss, counted as corrupt, dropped.
  BlockMeta wrong = Meta(2);
  wrong.tokens[0] = -5;
  EXPECT_FALSE(*s->Get(wrong, out));
  EXPECT_EQ(s->Stats().corrupt, 1);
  EXPECT_FALSE(*s->Contains(KeyOf(2)));
  ASSERT_TRUE(s->Put(Meta(3), Kv(3)).ok());  // a re-put changes nothing held
  EXPECT_EQ(Describe(changes), " +0 +1 +2 -1 +3 -0 -2");
}

TEST(HostStoreTest, BadSizesAreNamedErrors) {
  HostStoreOptions o;
  o.block_len = kBlockLen;
  o.kv_bytes = kKvBytes;
  o.capacity_bytes = 100;
  EXPECT_EQ(CreateHostStore(o).status().code(), StatusCode::kInvalidArgument);
  o.capacity_bytes = 1 << 20;
  auto s = std::move(*CreateHostStore(o));
  std::vector<std::byte> big(kKvBytes * 2);
  EXPECT_EQ(s->Put(Meta(1), big).code(), StatusCode::kInvalidArgument);
}

class DiskStoreTest : public ::testing::Test {
 protected:
  void TearDown() override {
    std::filesystem::remove(path_);
    std::filesystem::remove(path_ + ".index");
  }
  std::unique_ptr<BlockStore> Open(int64_t slots = 4, const std::string& key = "") {
    DiskStoreOptions o;
    o.payload_key = key;
    o.on_change = [this](const TierChange& c) {
      EXPECT_EQ(c.tier, Tier::kDisk);
      changes_.push_back(c);
    };
    o.path = path_;
    o.block_len = kBlockLen;
    o.kv_bytes = kKvBytes;
    o.capacity_bytes = slots * 4096;
    auto s = CreateDiskStore(o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return std::move(*s);
  }
  std::string path_ = TempPath("disk");
  std::vector<TierChange> changes_;
};

TEST_F(DiskStoreTest, RoundTripsAndSurvivesARestart) {
  {
    auto s = Open();
    for (uint64_t i = 0; i < 3; ++i) ExpectRoundTrip(*s, i);
    EXPECT_EQ(std::filesystem::file_size(path_), 4096u + 4u * 4096);  // the header, then the slots
  }  // closing writes the index
  auto s = Open();
  std::vector<std::byte> out(kKvBytes);
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(*s->Get(Meta(i), out)) << i;
    EXPECT_EQ(out, Kv(i));
  }
  EXPECT_EQ(s->Stats().blocks_now, 3);
}

TEST_F(DiskStoreTest, FillingItEvictsTheLeastRecentlyUsed) {
  auto s = Open(2);
  for (uint64_t i = 0; i < 5; ++i) ExpectRoundTrip(*s, i);
  std::vector<std::byte> out(kKvBytes);
  EXPECT_FALSE(*s->Get(Meta(0), out));
  EXPECT_TRUE(*s->Get(Meta(4), out));
  EXPECT_EQ(s->Stats().evictions, 3);
  EXPECT_EQ(s->Stats().blocks_now, 2);
  ASSERT_TRUE(s->Remove(KeyOf(4)).ok());
  ASSERT_TRUE(s->Remove(KeyOf(4)).ok());
  EXPECT_EQ(Describe(changes_), " +0 +1 -0 +2 -1 +3 -2 +4 -4");
}

TEST_F(DiskStoreTest, AFlippedByteOnDiskIsAMissNeverWrongKv) {
  auto s = Open();
  ExpectRoundTrip(*s, 1);
  ExpectRoundTrip(*s, 2);
  ASSERT_TRUE(s->Flush().ok());
  // Flip one KV byte of every slot in the file.
  const int fd = ::open(path_.c_str(), O_RDWR);
  for (off_t slot = 0; slot < 4; ++slot) {
    char c;
    const off_t at = 4096 + slot * 4096 + static_cast<off_t>(tiers::kHeaderBytes) + 4 * kBlockLen + 77;
    ASSERT_EQ(::pread(fd, &c, 1, at), 1);
    c = static_cast<char>(c ^ 1);
    ASSERT_EQ(::pwrite(fd, &c, 1, at), 1);
  }
  ::close(fd);
  std::vector<std::byte> out(kKvBytes);
  EXPECT_FALSE(*s->Get(Meta(1), out));
  EXPECT_FALSE(*s->Get(Meta(2), out));
  EXPECT_EQ(s->Stats().corrupt, 2);
  EXPECT_FALSE(*s->Contains(KeyOf(1)));  // dropped
}

TEST_F(DiskStoreTest, ATruncatedFileIsAMissAndKeepsWhatIsIntactOnReopen) {
  {
    auto s = Open();
    ExpectRoundTrip(*s, 1);
    ExpectRoundTrip(*s, 2);
    ASSERT_TRUE(s->Flush().ok());
    std::filesystem::resize_file(path_, 4096 + 4096 + 100);  // slot 1 cut short
    std::vector<std::byte> out(kKvBytes);
    int hits = 0;
    for (uint64_t i : {1, 2}) hits += *s->Get(Meta(i), out) ? 1 : 0;
    EXPECT_EQ(hits, 1);
    EXPECT_EQ(s->Stats().corrupt, 1);
  }
  auto s = Open();  // its own header: grown back to size, the intact block kept, nothing stale served
  EXPECT_EQ(std::filesystem::file_size(path_), 4096u + 4u * 4096);
  std::vector<std::byte> out(kKvBytes);
  int hits = 0;
  for (uint64_t i : {1, 2}) {
    if (*s->Get(Meta(i), out)) {
      ++hits;
      EXPECT_EQ(out, Kv(i));
    }
  }
  EXPECT_EQ(hits, 1);
}

// The file is private, never followed through a link, never a foreign file
// overwritten, and one process's alone.
TEST_F(DiskStoreTest, TheFileIsPrivateAndNoOtherFileIsEverOverwritten) {
  {
    auto s = Open();
    ExpectRoundTrip(*s, 1);
    ASSERT_TRUE(s->Flush().ok());
    struct stat st {};
    ASSERT_EQ(::stat(path_.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    ASSERT_EQ(::stat((path_ + ".index").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    // A second store on the same file (another process, here another open).
    DiskStoreOptions o;
    o.path = path_;
    o.block_len = kBlockLen;
    o.kv_bytes = kKvBytes;
    o.capacity_bytes = 4 * 4096;
    auto second = CreateDiskStore(o);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(second.status().message().find("in use by another process"), std::string::npos) << second.status().ToString();
    // Another geometry: refused, the cache intact.
    o.capacity_bytes = 8 * 4096;
    s.reset();
    auto other = CreateDiskStore(o);
    ASSERT_FALSE(other.ok());
    EXPECT_NE(other.status().message().find("another shape"), std::string::npos) << other.status().ToString();
  }
  auto again = Open();
  std::vector<std::byte> out(kKvBytes);
  EXPECT_TRUE(*again->Get(Meta(1), out));  // nothing was reset
  again.reset();

  DiskStoreOptions o;
  o.block_len = kBlockLen;
  o.kv_bytes = kKvBytes;
  o.capacity_bytes = 4 * 4096;
  auto contents = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  // A foreign file (a model given by mistake), of any size: refused, untouched.
  const std::string foreign = TempPath("foreign");
  for (size_t size : {size_t{100}, size_t{4096 + 4 * 4096}, size_t{1} << 20}) {
    {
      std::ofstream f(foreign, std::ios::binary | std::ios::trunc);
      for (size_t i = 0; i < size; ++i) f.put(static_cast<char>(i * 7));
    }
    std::filesystem::permissions(foreign, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    const std::string before = contents(foreign);
    o.path = foreign;
    auto r = CreateDiskStore(o);
    ASSERT_FALSE(r.ok()) << size;
    EXPECT_NE(r.status().message().find("not a PageKV disk cache"), std::string::npos) << r.status().ToString();
    EXPECT_EQ(contents(foreign), before) << size;
  }
  // Open to other users: refused, naming the mode.
  std::filesystem::permissions(foreign, std::filesystem::perms::others_read, std::filesystem::perm_options::add);
  auto open_to_others = CreateDiskStore(o);
  ASSERT_FALSE(open_to_others.ok());
  EXPECT_NE(open_to_others.status().message().find("mode 0604"), std::string::npos) << open_to_others.status().ToString();
  // A planted symbolic link: refused, its target untouched.
  const std::string link = TempPath("link");
  std::filesystem::remove(link);
  std::filesystem::create_symlink(foreign, link);
  const std::string before = contents(foreign);
  o.path = link;
  auto through_link = CreateDiskStore(o);
  ASSERT_FALSE(through_link.ok());
  EXPECT_NE(through_link.status().message().find("symbolic link"), std::string::npos) << through_link.status().ToString();
  EXPECT_EQ(contents(foreign), before);
  // A dangling link is not followed to create its target either.
  const std::string target = TempPath("target");
  std::filesystem::remove(target);
  std::filesystem::remove(link);
  std::filesystem::create_symlink(target, link);
  EXPECT_FALSE(CreateDiskStore(o).ok());
  EXPECT_FALSE(std::filesystem::exists(target));
  // An empty private file (mktemp's) is initialised.
  std::filesystem::remove(foreign);
  { std::ofstream f(foreign); }
  std::filesystem::permissions(foreign, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write,
                               std::filesystem::perm_options::replace);
  o.path = foreign;
  auto empty = CreateDiskStore(o);
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  empty->reset();
  for (const std::string& p : {foreign, foreign + ".index", link}) std::filesystem::remove(p);
}

// Someone who can write the file but lacks the key rewrites a block with
// poisoned KV and a valid checksum: a keyed store refuses it (counted as
// unauthenticated, dropped); an unkeyed one would load it.
TEST_F(DiskStoreTest, ABlockRewrittenWithoutTheKeyIsRefused) {
  const std::string key = "disk-test-key-0123456789";
  for (const bool keyed : {true, false}) {
    std::filesystem::remove(path_);
    std::filesystem::remove(path_ + ".index");
    auto s = Open(4, keyed ? key : "");
    ExpectRoundTrip(*s, 1);
    ASSERT_TRUE(s->Flush().ok());
    std::vector<std::byte> poison = Kv(1), forged;
    poison[3] ^= std::byte{0x7f};
    tiers::EncodePayload(Meta(1), poison, tiers::PayloadSeal(), forged);
    const int fd = ::open(path_.c_str(), O_RDWR);
    ASSERT_EQ(::pwrite(fd, forged.data(), forged.size(), 4096), static_cast<ssize_t>(forged.size()));  // slot 0
    ::close(fd);
    std::vector<std::byte> out(kKvBytes);
    if (keyed) {
      EXPECT_FALSE(*s->Get(Meta(1), out));
      EXPECT_EQ(s->Stats().unauthenticated, 1);
      EXPECT_EQ(s->Stats().corrupt, 1);
      EXPECT_FALSE(*s->Contains(KeyOf(1)));
    } else {
      ASSERT_TRUE(*s->Get(Meta(1), out));
      EXPECT_EQ(out, poison) << "the unkeyed checksum does not stop a deliberate rewrite";
    }
  }
  // Reopened under another key, the blocks of the first are refused.
  std::filesystem::remove(path_);
  std::filesystem::remove(path_ + ".index");
  { ExpectRoundTrip(*Open(4, key), 2); }
  auto other = Open(4, key + "-rotated");
  std::vector<std::byte> out(kKvBytes);
  EXPECT_FALSE(*other->Get(Meta(2), out));
  EXPECT_EQ(other->Stats().unauthenticated, 1);
}

TEST_F(DiskStoreTest, ACorruptIndexStartsEmpty) {
  {
    auto s = Open();
    ExpectRoundTrip(*s, 1);
  }
  {
    std::fstream f(path_ + ".index", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    f.put('\x7f');
  }
  auto s = Open();
  EXPECT_FALSE(*s->Contains(KeyOf(1)));
  ExpectRoundTrip(*s, 2);
}

TEST_F(DiskStoreTest, BadConfigurationIsNamed) {
  DiskStoreOptions o;
  o.block_len = kBlockLen;
  o.kv_bytes = kKvBytes;
  o.capacity_bytes = 1 << 20;
  EXPECT_EQ(CreateDiskStore(o).status().code(), StatusCode::kInvalidArgument);  // no path
  o.path = "/nonexistent-dir/x/cache";
  EXPECT_EQ(CreateDiskStore(o).status().code(), StatusCode::kUnavailable);
  o.path = path_;
  o.capacity_bytes = 100;
  EXPECT_EQ(CreateDiskStore(o).status().code(), StatusCode::kInvalidArgument);
}

class RedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(server_.Start().ok()); }
  std::unique_ptr<BlockStore> Open(const std::string& ns = "test", const std::string& payload_key = "") {
    RedisStoreOptions o;
    o.url = server_.url();
    o.key_namespace = ns;
    o.payload_key = payload_key;
    o.timeout_ms = 300;
    o.backoff_initial_ms = 50;
    return std::move(*CreateRedisStore(o));
  }
  testing::RedisServer server_;
};

TEST_F(RedisStoreTest, RoundTripsAndPipelinesLookups) {
  auto s = Open();
  for (uint64_t i = 0; i < 4; ++i) ExpectRoundTrip(*s, i);
  const std::vector<BlockKey> keys = {KeyOf(0), KeyOf(9), KeyOf(2)};
  EXPECT_EQ(*s->ContainsMany(keys), (std::vector<bool>{true, false, true}));
  ASSERT_TRUE(s->Remove(KeyOf(0)).ok());
  EXPECT_FALSE(*s->Contains(KeyOf(0)));
  EXPECT_EQ(*server_.Command("DBSIZE"), ":3\r\n");
  // Namespaces keep stores apart (model fingerprints).
  auto other = Open("another-model");
  EXPECT_FALSE(*other->Contains(KeyOf(1)));
}

TEST_F(RedisStoreTest, AFlippedByteInRedisIsAMissAndTheKeyIsDropped) {
  auto s = Open();
  ExpectRoundTrip(*s, 5);
  const std::string key = "test:" + KeyOf(5).Hex();
  ASSERT_EQ(*server_.Command("SETRANGE " + key + " 200 Z"), ":" + std::to_string(tiers::PayloadBytes(kBlockLen, kKvBytes)) + "\r\n");
  std::vector<std::byte> out(kKvBytes);
  EXPECT_FALSE(*s->Get(Meta(5), out));
  EXPECT_EQ(s->Stats().corrupt, 1);
  EXPECT_FALSE(*s->Contains(KeyOf(5)));
  // A truncated value, too.
  ExpectRoundTrip(*s, 6);
  ASSERT_TRUE(server_.Command("SET test:" + KeyOf(6).Hex() + " short").ok());
  EXPECT_FALSE(*s->Get(Meta(6), out));
}

// A process of the namespace without the key (or with another) cannot use
// the keyed blocks, and must not delete them either: they are left for the
// processes that hold the key, and counted as unauthenticated.
TEST_F(RedisStoreTest, AProcessWithoutTheKeyLeavesKeyedBlocksAlone) {
  const std::string key = "redis-test-key-0123456789";
  auto keyed = Open("test", key);
  ExpectRoundTrip(*keyed, 7);
  std::vector<std::byte> out(kKvBytes);
  for (const std::string& other_key : {std::string(), key + "-rotated"}) {
    auto stranger = Open("test", other_key);
    EXPECT_FALSE(*stranger->Get(Meta(7), out)) << "key '" << other_key << "'";
    EXPECT_EQ(stranger->Stats().unauthenticated, 1);
    EXPECT_TRUE(*stranger->Contains(KeyOf(7))) << "still there for the key's holders";
  }
  ASSERT_TRUE(*keyed->Get(Meta(7), out));
  EXPECT_EQ(out, Kv(7));
}

TEST_F(RedisStoreTest, AServerThatDiesIsUnhealthyFailsFastAndRecoversAfterARestart) {
  auto s = Open();
  ExpectRoundTrip(*s, 1);
  server_.Kill();
  std::vector<std::byte> out(kKvBytes);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s->Get(Meta(1), out).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(s->Put(Meta(2), Kv(2)).code(), StatusCode::kUnavailable);  // backing off: no connect attempt
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_FALSE(s->Stats().healthy);
  EXPECT_GE(s->Stats().errors, 2);
  ASSERT_TRUE(server_.Start().ok());  // restarted empty
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // past the backoff
  Result<bool> got = s->Get(Meta(1), out);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_FALSE(*got);  // the data died with the server: a miss
  EXPECT_TRUE(s->Stats().healthy);
  ExpectRoundTrip(*s, 3);
}

TEST_F(RedisStoreTest, ManyBlocksGoInOneRoundTripAndABadOneIsAMiss) {
  auto s = Open();
  std::vector<BlockMeta> metas;
  std::vector<std::vector<std::byte>> data;
  for (uint64_t i = 0; i < 6; ++i) {
    metas.push_back(Meta(i));
    data.push_back(Kv(i));
  }
  std::vector<std::span<const std::byte>> in(data.begin(), data.end());
  ASSERT_TRUE(s->PutMany(metas, in).ok());
  EXPECT_EQ(s->Stats().puts, 6);
  ASSERT_TRUE(server_.Command("SETRANGE test:" + KeyOf(3).Hex() + " 150 Q").ok());
  metas.push_back(Meta(40));  // never stored
  std::vector<std::vector<std::byte>> out(7, std::vector<std::byte>(kKvBytes));
  std::vector<std::span<std::byte>> spans(out.begin(), out.end());
  const std::vector<bool> got = *s->GetMany(metas, spans);
  EXPECT_EQ(got, (std::vector<bool>{true, true, true, false, true, true, false}));
  for (size_t i : {0, 1, 2, 4, 5}) EXPECT_EQ(out[i], Kv(i));
  EXPECT_EQ(s->Stats().corrupt, 1);
  EXPECT_FALSE(*s->Contains(KeyOf(3)));  // the bad one is gone
}

TEST_F(RedisStoreTest, AHungServerTimesOutInsteadOfHanging) {
  auto s = Open();  // 300 ms timeout
  ExpectRoundTrip(*s, 1);
  server_.Pause();
  std::vector<std::byte> out(kKvBytes);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s->Get(Meta(1), out).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(s->Put(Meta(2), Kv(2)).code(), StatusCode::kUnavailable);  // backing off: immediate
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_FALSE(s->Stats().healthy);
  server_.Resume();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Result<bool> got = s->Get(Meta(1), out);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got);
  EXPECT_EQ(out, Kv(1));
}

TEST_F(RedisStoreTest, PasswordsAndUrlsAreChecked) {
  server_.Stop();
  ASSERT_TRUE(server_.Start("--requirepass sesame").ok());
  RedisStoreOptions o;
  o.url = server_.url();
  o.key_namespace = "t";
  auto no_pass = std::move(*CreateRedisStore(o));
  EXPECT_EQ(no_pass->Put(Meta(1), Kv(1)).code(), StatusCode::kUnavailable);
  o.password = "sesame";
  auto with_pass = std::move(*CreateRedisStore(o));
  ExpectRoundTrip(*with_pass, 1);
  o.password.clear();
  // A password in the url is refused, and the error does not repeat it.
  o.url = "redis://:sesame@127.0.0.1:" + std::to_string(server_.port()) + "/2";
  const Status in_url = CreateRedisStore(o).status();
  EXPECT_EQ(in_url.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(in_url.message().find("sesame"), std::string::npos) << in_url.message();
  EXPECT_NE(in_url.message().find("--redis-password-env"), std::string::npos) << in_url.message();
  for (const char* bad : {"http://x", "redis://h:99999", "redis://h:1/x"}) {
    o.url = bad;
    EXPECT_EQ(CreateRedisStore(o).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace pagekv
