// `pagekv generate --kv-events-endpoint`: a real ZeroMQ SUB socket connects
// to the running CLI and decodes its msgpack batches: BlockStored events for
// the shared prompt blocks, in sequence order, in vLLM's current layout
// (tagged maps in a [ts, events, rank] batch) under the default topic.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "testing/child_process.h"

namespace {

const msgpack::object& Field(const msgpack::object& map, const std::string& name) {
  static const msgpack::object kNil;
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    if (map.via.map.ptr[i].key.as<std::string>() == name) return map.via.map.ptr[i].val;
  }
  ADD_FAILURE() << "no field " << name;
  return kNil;
}

TEST(KvEventsCliTest, ASubscriberDecodesTheBatchesGenerateSends) {
  // A port the kernel just handed out (a random one could be another
  // test's, run beside this one).
  const int port = pagekv::testing::FreeLoopbackPort();
  ASSERT_GT(port, 0);
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  const std::string cmd = std::string(PAGEKV_CLI_PATH) +
                          " generate --model ../shared/models/stories260K/stories260K.gguf"
                          " --prompt 'Once upon a time there was a little girl named Lily. She'"
                          " --prompt 'Once upon a time there was a little girl named Lily. One day'"
                          " -n 24 --block-len 8 --json --kv-events-wait-ms 10000 --kv-events-endpoint " + endpoint;
  FILE* proc = popen(cmd.c_str(), "r");
  ASSERT_NE(proc, nullptr);
  zmq::context_t ctx(1);
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "");
  sub.set(zmq::sockopt::rcvtimeo, 10000);
  sub.connect(endpoint);  // ZeroMQ retries until the CLI has bound
  int64_t stored_blocks = 0, batches = 0;
  uint64_t expect_seq = 0;
  for (;;) {
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(sub, std::back_inserter(parts)).has_value()) break;  // timeout: the CLI is done
    ASSERT_EQ(parts.size(), 3u);
    // The default topic: kv@<hostname>:<pid>@<model file>.
    EXPECT_EQ(parts[0].to_string().rfind("kv@", 0), 0u) << parts[0].to_string();
    EXPECT_NE(parts[0].to_string().find("@stories260K.gguf"), std::string::npos) << parts[0].to_string();
    uint64_t seq = 0;
    for (int i = 0; i < 8; ++i) seq = seq << 8 | static_cast<const uint8_t*>(parts[1].data())[i];
    EXPECT_EQ(seq, expect_seq++);
    msgpack::object_handle oh = msgpack::unpack(static_cast<const char*>(parts[2].data()), parts[2].size());
    ASSERT_EQ(oh.get().via.array.size, 3u);  // [ts, events, data_parallel_rank]
    const msgpack::object& events = oh.get().via.array.ptr[1];
    for (uint32_t e = 0; e < events.via.array.size; ++e) {
      const msgpack::object& ev = events.via.array.ptr[e];
      ASSERT_EQ(ev.type, msgpack::type::MAP);
      if (Field(ev, "type").as<std::string>() != "BlockStored") continue;
      const uint32_t n = Field(ev, "block_hashes").via.array.size;
      stored_blocks += n;
      EXPECT_EQ(Field(ev, "token_ids").via.array.size, n * 8) << "8 token ids per stored block";
      EXPECT_EQ(Field(ev, "block_size").as<int>(), 8);
      EXPECT_EQ(Field(ev, "extra_keys").via.array.size, n) << "one list of extra keys per block";
    }
    ++batches;
    sub.set(zmq::sockopt::rcvtimeo, 2000);
  }
  std::string out;
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof(buf), proc)) > 0) out.append(buf, got);
  ASSERT_EQ(pclose(proc), 0) << out;
  EXPECT_GT(batches, 0);
  EXPECT_GT(stored_blocks, 4);
  EXPECT_NE(out.find("\"kv_event_batches\":" + std::to_string(batches)), std::string::npos) << out;
}

}  // namespace
