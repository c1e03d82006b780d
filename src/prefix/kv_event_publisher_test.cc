// KV events over a real ZeroMQ SUB socket, decoded with msgpack: the
// batches a PrefixCache queued arrive in order, in vLLM's wire shape.
#include "prefix/kv_event_publisher.h"

#include <array>

#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <gtest/gtest.h>

namespace pagekv {
namespace {

std::unique_ptr<KvCache> MakeCache() {
  CacheConfig c;
  c.num_layers = 1;
  c.num_q_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.block_len = 8;
  c.format = KvFormat::Plain(DType::kF16);
  c.num_blocks = 4;
  return std::move(*KvCache::Create({.config = c, .prefault = false}));
}

// The field of a msgpack map (a test failure when it is missing).
const msgpack::object& Field(const msgpack::object& map, const std::string& name) {
  static const msgpack::object kNil;
  if (map.type != msgpack::type::MAP) {
    ADD_FAILURE() << "not a map";
    return kNil;
  }
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    if (map.via.map.ptr[i].key.as<std::string>() == name) return map.via.map.ptr[i].val;
  }
  ADD_FAILURE() << "no field " << name;
  return kNil;
}

uint64_t Last8(const BlockKey& k) {
  uint64_t v = 0;
  for (size_t i = k.size - 8; i < k.size; ++i) v = v << 8 | k.bytes[i];
  return v;
}

uint64_t Seq(const zmq::message_t& m) {
  uint64_t seq = 0;
  for (size_t i = 0; i < m.size(); ++i) seq = seq << 8 | static_cast<const uint8_t*>(m.data())[i];
  return seq;
}

// Two batches from a prefix cache: stored (2 blocks), then removed x2 and
// cleared, checked field by field in vLLM's current layout.
TEST(KvEventPublisherTest, ASubscriberReceivesAndDecodesTheBatches) {
  KvEventWire wire;
  wire.topic = "kv";
  wire.data_parallel_rank = 3;
  auto pub = KvEventPublisher::Create("tcp://127.0.0.1:*", wire);
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  zmq::context_t ctx(1);
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "");
  sub.set(zmq::sockopt::rcvtimeo, 5000);
  sub.connect((*pub)->endpoint());
  ASSERT_TRUE((*pub)->WaitForSubscriber(5000));

  auto cache = MakeCache();
  PrefixCacheOptions o;
  o.record_events = true;
  auto pc = std::move(*PrefixCache::Create(*cache, o));
  std::vector<int32_t> tokens(17);
  for (int i = 0; i < 17; ++i) tokens[static_cast<size_t>(i)] = 100 + i;
  ExtraKeys extra;
  extra.cache_salt = "tenant";
  extra.model_fingerprint = "m1";
  auto a = pc->AddSequence(tokens, extra);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(*cache->Reserve(a->seq, 17));
  ASSERT_TRUE(pc->Publish(a->seq, tokens).ok());
  ASSERT_TRUE(pc->Free(a->seq).ok());
  // Fill the pool with plain sequences: both cached blocks get evicted.
  const SeqId filler = cache->AddSequence();
  ASSERT_TRUE(*cache->Reserve(filler, 32));
  pc->Clear();
  const std::vector<KvEvent> events = pc->DrainEvents();
  ASSERT_EQ(events.size(), 4u);  // stored (2 blocks), removed, removed, cleared
  ASSERT_TRUE((*pub)->Publish({events.data(), 1}).ok());
  ASSERT_TRUE((*pub)->Publish({events.data() + 1, 3}).ok());

  const std::vector<BlockKey> keys = *pc->Keys(tokens, extra);
  for (uint64_t batch = 0; batch < 2; ++batch) {
    std::vector<zmq::message_t> parts;
    ASSERT_TRUE(zmq::recv_multipart(sub, std::back_inserter(parts)).has_value());
    ASSERT_EQ(parts.size(), 3u);
    EXPECT_EQ(parts[0].to_string(), "kv");
    ASSERT_EQ(parts[1].size(), 8u);
    EXPECT_EQ(Seq(parts[1]), batch);
    msgpack::object_handle oh = msgpack::unpack(static_cast<const char*>(parts[2].data()), parts[2].size());
    const msgpack::object& root = oh.get();
    ASSERT_EQ(root.type, msgpack::type::ARRAY);
    ASSERT_EQ(root.via.array.size, 3u);  // [ts, events, data_parallel_rank]
    EXPECT_EQ(root.via.array.ptr[0].type, msgpack::type::FLOAT64);
    EXPECT_EQ(root.via.array.ptr[2].as<int>(), 3);
    const msgpack::object& evs = root.via.array.ptr[1];
    if (batch == 0) {
      ASSERT_EQ(evs.via.array.size, 1u);
      const msgpack::object& e = evs.via.array.ptr[0];
      EXPECT_EQ(Field(e, "type").as<std::string>(), "BlockStored");
      const msgpack::object& hashes = Field(e, "block_hashes");
      ASSERT_EQ(hashes.via.array.size, 2u);
      EXPECT_EQ(hashes.via.array.ptr[0].type, msgpack::type::POSITIVE_INTEGER);
      EXPECT_EQ(hashes.via.array.ptr[0].as<uint64_t>(), Last8(keys[0]));
      EXPECT_EQ(hashes.via.array.ptr[1].as<uint64_t>(), Last8(keys[1]));
      EXPECT_EQ(Field(e, "parent_block_hash").type, msgpack::type::NIL);  // a chain's first block
      EXPECT_EQ(Field(e, "token_ids").as<std::vector<int32_t>>(), std::vector<int32_t>(tokens.begin(), tokens.begin() + 16));
      EXPECT_EQ(Field(e, "block_size").as<int32_t>(), 8);
      EXPECT_EQ(Field(e, "lora_id").type, msgpack::type::NIL);
      EXPECT_EQ(Field(e, "lora_name").type, msgpack::type::NIL);
      EXPECT_EQ(Field(e, "medium").as<std::string>(), "GPU");
      EXPECT_EQ(Field(e, "group_idx").as<int>(), 0);
      EXPECT_EQ(Field(e, "kv_cache_spec_kind").as<std::string>(), "full_attention");
      // One list per block; the salt only on the chain's first.
      const auto extra_keys = Field(e, "extra_keys").as<std::vector<std::vector<std::string>>>();
      ASSERT_EQ(extra_keys.size(), 2u);
      EXPECT_EQ(extra_keys[0], (std::vector<std::string>{"salt:tenant", "model:m1"}));
      EXPECT_EQ(extra_keys[1], (std::vector<std::string>{"model:m1"}));
    } else {
      ASSERT_EQ(evs.via.array.size, 3u);
      for (int i = 0; i < 2; ++i) {
        const msgpack::object& e = evs.via.array.ptr[i];
        EXPECT_EQ(Field(e, "type").as<std::string>(), "BlockRemoved");
        EXPECT_EQ(Field(e, "medium").as<std::string>(), "GPU");
        EXPECT_EQ(Field(e, "block_hashes").via.array.size, 1u);
      }
      const msgpack::object& cleared = evs.via.array.ptr[2];
      EXPECT_EQ(Field(cleared, "type").as<std::string>(), "AllBlocksCleared");
      EXPECT_EQ(cleared.via.map.size, 1u);
    }
  }
  EXPECT_EQ((*pub)->batches_sent(), 2u);
}

// Bytes hashes on request; an extra key that is not UTF-8 (a binary
// salt) goes out as hex, never as an invalid msgpack string.
TEST(KvEventPublisherTest, HashesAsBytesAndBinarySaltsAsHex) {
  KvEvent e;
  e.type = KvEvent::Type::kBlockStored;
  BlockKey k;
  k.size = 32;
  for (size_t i = 0; i < 32; ++i) k.bytes[i] = static_cast<uint8_t>(i);
  e.keys = {k};
  e.token_ids = {1, 2};
  e.block_len = 2;
  e.tier = "disk";
  e.extra_keys = {std::string("salt:\xff\x01", 7), "model:\xc3\xa9"};
  KvEventWire wire;
  wire.hash_bytes = true;
  const std::string payload = KvEventPublisher::EncodeBatch({&e, 1}, 1.5, wire);
  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& ev = oh.get().via.array.ptr[1].via.array.ptr[0];
  const msgpack::object& h = Field(ev, "block_hashes").via.array.ptr[0];
  ASSERT_EQ(h.type, msgpack::type::BIN);
  EXPECT_EQ(std::string(h.via.bin.ptr, h.via.bin.size), std::string(reinterpret_cast<const char*>(k.bytes.data()), 32));
  EXPECT_EQ(Field(ev, "medium").as<std::string>(), "DISK");
  const auto extra_keys = Field(ev, "extra_keys").as<std::vector<std::vector<std::string>>>();
  ASSERT_EQ(extra_keys.size(), 1u);
  EXPECT_EQ(extra_keys[0], (std::vector<std::string>{"salt-hex:ff01", "model:\xc3\xa9"}));
  EXPECT_EQ(EventMedium("host"), "CPU");
  EXPECT_EQ(EventMedium("redis"), "REDIS");
}

// A hybrid cache's sliding group: its group_idx, vLLM's "sliding_window"
// kind and the window; a full group keeps the wire's kind and no window.
TEST(KvEventWireTest, HybridCacheGroupsCarryTheirIndexKindAndWindow) {
  KvEvent stored;
  BlockKey k;
  k.bytes[31] = 7;
  stored.keys = {k};
  stored.token_ids = {1, 2};
  stored.block_len = 2;
  stored.group = 3;
  stored.window = 512;
  KvEvent removed;
  removed.type = KvEvent::Type::kBlockRemoved;
  removed.keys = {k};
  removed.group = 3;
  KvEvent full = stored;
  full.group = 0;
  full.window = 0;
  const KvEvent events[] = {stored, removed, full};
  const std::string payload = KvEventPublisher::EncodeBatch(events, 1.0, {});
  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& evs = oh.get().via.array.ptr[1];
  ASSERT_EQ(evs.via.array.size, 3u);
  EXPECT_EQ(Field(evs.via.array.ptr[0], "group_idx").as<int>(), 3);
  EXPECT_EQ(Field(evs.via.array.ptr[0], "kv_cache_spec_kind").as<std::string>(), "sliding_window");
  EXPECT_EQ(Field(evs.via.array.ptr[0], "kv_cache_spec_sliding_window").as<int>(), 512);
  EXPECT_EQ(Field(evs.via.array.ptr[1], "group_idx").as<int>(), 3);
  EXPECT_EQ(Field(evs.via.array.ptr[2], "group_idx").as<int>(), 0);
  EXPECT_EQ(Field(evs.via.array.ptr[2], "kv_cache_spec_kind").as<std::string>(), "full_attention");
  EXPECT_EQ(evs.via.array.ptr[2].via.map.size, 11u);  // no window field
}

// A subscriber that missed batches asks the replay socket for them from a
// sequence number: every buffered batch from there, then the end marker.
TEST(KvEventPublisherTest, TheReplaySocketResendsMissedBatches) {
  KvEventWire wire;
  wire.replay_endpoint = "tcp://127.0.0.1:*";
  wire.buffer_batches = 3;
  auto pub = KvEventPublisher::Create("tcp://127.0.0.1:*", wire);
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  ASSERT_FALSE((*pub)->replay_endpoint().empty());
  KvEvent cleared;
  cleared.type = KvEvent::Type::kAllBlocksCleared;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*pub)->Publish({&cleared, 1}).ok());  // nobody listens
  zmq::context_t ctx(1);
  zmq::socket_t req(ctx, zmq::socket_type::dealer);
  req.set(zmq::sockopt::rcvtimeo, 5000);
  req.connect((*pub)->replay_endpoint());
  auto ask = [&](uint64_t from) {
    std::string start(8, '\0');
    for (int i = 0; i < 8; ++i) start[static_cast<size_t>(i)] = static_cast<char>(from >> (56 - 8 * i));
    const std::array<zmq::const_buffer, 2> q = {zmq::const_buffer(), zmq::buffer(start)};
    zmq::send_multipart(req, q);
    std::vector<uint64_t> got;
    for (;;) {
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(req, std::back_inserter(parts)).has_value()) {
        ADD_FAILURE() << "no end marker";
        return got;
      }
      EXPECT_EQ(parts.size(), 3u);  // "", sequence, payload
      if (parts.size() != 3) return got;
      if (Seq(parts[1]) == ~uint64_t{0}) {
        EXPECT_EQ(parts[2].size(), 0u);
        return got;
      }
      msgpack::object_handle oh = msgpack::unpack(static_cast<const char*>(parts[2].data()), parts[2].size());
      EXPECT_EQ(oh.get().via.array.size, 3u);
      got.push_back(Seq(parts[1]));
    }
  };
  EXPECT_EQ(ask(3), (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(ask(0), (std::vector<uint64_t>{2, 3, 4}));  // the buffer keeps the last 3
  EXPECT_EQ(ask(9), (std::vector<uint64_t>{}));
}

TEST(KvEventPublisherTest, ABadEndpointIsNamed) {
  auto pub = KvEventPublisher::Create("nonsense://x");
  ASSERT_FALSE(pub.ok());
  EXPECT_NE(pub.status().message().find("nonsense://x"), std::string::npos);
  EXPECT_FALSE(KvEventPublisher::Create("").ok());
}

}  // namespace
}  // namespace pagekv
