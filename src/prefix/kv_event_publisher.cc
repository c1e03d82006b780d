#include "prefix/kv_event_publisher.h"

#include <chrono>
#include <msgpack.hpp>
#include <sstream>
#include <zmq.hpp>

namespace pagekv {
namespace {

void PackKey(msgpack::packer<std::stringstream>& pk, const BlockKey& k) {
  pk.pack_bin(k.size);
  pk.pack_bin_body(reinterpret_cast<const char*>(k.bytes.data()), k.size);
}

void PackKeys(msgpack::packer<std::stringstream>& pk, const std::vector<BlockKey>& keys) {
  pk.pack_array(static_cast<uint32_t>(keys.size()));
  for (const BlockKey& k : keys) PackKey(pk, k);
}

}  // namespace

struct KvEventPublisher::Impl {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::xpub};
  std::string topic;
  uint64_t sequence = 0;
};

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvEventPublisher::~KvEventPublisher() = default;

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Create(const std::string& endpoint, std::string topic) {
  if (endpoint.empty()) return InvalidArgumentError("KV events endpoint is empty: give e.g. tcp://127.0.0.1:5557");
  auto impl = std::make_unique<Impl>();
  impl->topic = std::move(topic);
  try {
    impl->socket.set(zmq::sockopt::linger, 2000);  // flush queued batches at exit
    impl->socket.set(zmq::sockopt::sndhwm, 100000);
    impl->socket.bind(endpoint);
  } catch (const zmq::error_t& e) {
    return InvalidArgumentError("KV events endpoint '" + endpoint + "': " + e.what() +
                                " (expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557)");
  }
  return std::unique_ptr<KvEventPublisher>(new KvEventPublisher(std::move(impl)));
}

bool KvEventPublisher::WaitForSubscriber(int timeout_ms) {
  impl_->socket.set(zmq::sockopt::rcvtimeo, timeout_ms);
  zmq::message_t msg;
  try {
    const auto got = impl_->socket.recv(msg, zmq::recv_flags::none);
    return got.has_value() && msg.size() > 0 && static_cast<const uint8_t*>(msg.data())[0] == 1;
  } catch (const zmq::error_t&) {
    return false;
  }
}

std::string KvEventPublisher::EncodeBatch(std::span<const KvEvent> events, double timestamp) {
  std::stringstream buffer;
  msgpack::packer<std::stringstream> pk(buffer);
  pk.pack_array(2);
  pk.pack_double(timestamp);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvEvent& e : events) {
    switch (e.type) {
      case KvEvent::Type::kBlockStored:
        pk.pack_array(9);
        pk.pack(std::string("BlockStored"));
        PackKeys(pk, e.keys);
        if (e.parent) {
          PackKey(pk, *e.parent);
        } else {
          pk.pack_nil();
        }
        pk.pack(e.token_ids);
        pk.pack(e.block_len);
        if (e.adapter_id != 0) {
          pk.pack(e.adapter_id);
        } else {
          pk.pack_nil();
        }
        pk.pack(e.tier);
        pk.pack_nil();  // lora_name in recent vLLM versions
        pk.pack(e.extra_keys);
        break;
      case KvEvent::Type::kBlockRemoved:
        pk.pack_array(3);
        pk.pack(std::string("BlockRemoved"));
        PackKeys(pk, e.keys);
        pk.pack(e.tier);
        break;
      case KvEvent::Type::kAllBlocksCleared:
        pk.pack_array(1);
        pk.pack(std::string("AllBlocksCleared"));
        break;
    }
  }
  return buffer.str();
}

Status KvEventPublisher::Publish(std::span<const KvEvent> events) {
  if (events.empty()) return Status::Ok();
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string payload = EncodeBatch(events, now);
  uint8_t seq[8];
  const uint64_t n = impl_->sequence++;
  for (int i = 0; i < 8; ++i) seq[i] = static_cast<uint8_t>(n >> (56 - 8 * i));
  try {
    impl_->socket.send(zmq::buffer(impl_->topic), zmq::send_flags::sndmore);
    impl_->socket.send(zmq::buffer(seq, 8), zmq::send_flags::sndmore);
    impl_->socket.send(zmq::buffer(payload), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    return IoError(std::string("KV events: send failed: ") + e.what());
  }
  return Status::Ok();
}

uint64_t KvEventPublisher::batches_sent() const { return impl_->sequence; }

std::string KvEventPublisher::endpoint() const { return impl_->socket.get(zmq::sockopt::last_endpoint); }

}  // namespace pagekv
