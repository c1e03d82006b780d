// KV events over a real ZeroMQ SUB socket, decoded with msgpack: the
// batches a PrefixCache queued arrive in order, in vLLM's wire shape.
#include "prefix/kv_event_publisher.h"

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

TEST(KvEventPublisherTest, ASubscriberReceivesAndDecodesTheBatches) {
  auto pub = KvEventPublisher::Create("tcp://127.0.0.1:*", "kv");
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
    uint64_t seq = 0;
    for (int i = 0; i < 8; ++i) seq = seq << 8 | static_cast<const uint8_t*>(parts[1].data())[i];
    EXPECT_EQ(seq, batch);
    msgpack::object_handle oh = msgpack::unpack(static_cast<const char*>(parts[2].data()), parts[2].size());
    const msgpack::object& root = oh.get();
    ASSERT_EQ(root.type, msgpack::type::ARRAY);
    ASSERT_EQ(root.via.array.size, 2u);
    EXPECT_EQ(root.via.array.ptr[0].type, msgpack::type::FLOAT64);
    const msgpack::object& evs = root.via.array.ptr[1];
    if (batch == 0) {
      ASSERT_EQ(evs.via.array.size, 1u);
      const msgpack::object& e = evs.via.array.ptr[0];
      EXPECT_EQ(e.via.array.ptr[0].as<std::string>(), "BlockStored");
      const msgpack::object& hashes = e.via.array.ptr[1];
      ASSERT_EQ(hashes.via.array.size, 2u);
      const msgpack::object& h1 = hashes.via.array.ptr[1];
      ASSERT_EQ(h1.type, msgpack::type::BIN);
      EXPECT_EQ(std::string(h1.via.bin.ptr, h1.via.bin.size),
                std::string(reinterpret_cast<const char*>(keys[1].bytes.data()), 32));
      EXPECT_EQ(e.via.array.ptr[2].type, msgpack::type::NIL);  // no parent: a first block
      EXPECT_EQ(e.via.array.ptr[3].as<std::vector<int32_t>>(), std::vector<int32_t>(tokens.begin(), tokens.begin() + 16));
      EXPECT_EQ(e.via.array.ptr[4].as<int32_t>(), 8);
      EXPECT_EQ(e.via.array.ptr[6].as<std::string>(), "pool");
      EXPECT_EQ(e.via.array.ptr[8].as<std::vector<std::string>>(), std::vector<std::string>{"salt:tenant"});
    } else {
      ASSERT_EQ(evs.via.array.size, 3u);
      EXPECT_EQ(evs.via.array.ptr[0].via.array.ptr[0].as<std::string>(), "BlockRemoved");
      EXPECT_EQ(evs.via.array.ptr[1].via.array.ptr[0].as<std::string>(), "BlockRemoved");
      EXPECT_EQ(evs.via.array.ptr[2].via.array.ptr[0].as<std::string>(), "AllBlocksCleared");
      EXPECT_EQ(evs.via.array.ptr[2].via.array.size, 1u);
    }
  }
  EXPECT_EQ((*pub)->batches_sent(), 2u);
}

TEST(KvEventPublisherTest, ABadEndpointIsNamed) {
  auto pub = KvEventPublisher::Create("nonsense://x");
  ASSERT_FALSE(pub.ok());
  EXPECT_NE(pub.status().message().find("nonsense://x"), std::string::npos);
  EXPECT_FALSE(KvEventPublisher::Create("").ok());
}

}  // namespace
}  // namespace pagekv
