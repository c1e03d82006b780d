#include "prefix/kv_event_publisher.h"

#include <unistd.h>

#include <cstdio>

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <msgpack.hpp>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "base/utf8.h"

namespace pagekv {
namespace {

using Packer = msgpack::packer<std::stringstream>;

void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// vLLM's integer form of a block hash: the key's last 8 bytes, big-endian.
uint64_t KeyAsU64(const BlockKey& k) {
  uint64_t v = 0;
  for (size_t i = k.size >= 8 ? k.size - 8 : 0; i < k.size; ++i) v = v << 8 | k.bytes[i];
  return v;
}

void PackKey(Packer& pk, const BlockKey& k, bool as_bytes) {
  if (!as_bytes) {
    pk.pack_uint64(KeyAsU64(k));
    return;
  }
  pk.pack_bin(static_cast<uint32_t>(k.size));
  pk.pack_bin_body(reinterpret_cast<const char*>(k.bytes.data()), static_cast<uint32_t>(k.size));
}

void PackKeys(Packer& pk, const std::vector<BlockKey>& keys, bool as_bytes) {
  pk.pack_array(static_cast<uint32_t>(keys.size()));
  for (const BlockKey& k : keys) PackKey(pk, k, as_bytes);
}

// An extra key as a msgpack string: as it is when it is UTF-8 (decoders
// that read strings strictly would fail on anything else), else its name
// and the hex of its value ("salt:<bytes>" -> "salt-hex:<hex>").
std::string WireExtraKey(const std::string& s) {
  if (IsValidUtf8(s)) return s;
  const size_t colon = s.find(':');
  const size_t from = colon == std::string::npos ? 0 : colon + 1;
  std::string out = colon == std::string::npos ? "hex:" : s.substr(0, colon) + "-hex:";
  static constexpr char kDigits[] = "0123456789abcdef";
  for (size_t i = from; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

// One list of extra keys per block, as vLLM sends them: the salt enters
// only a chain's first block (the event's first block when it has no parent).
void PackExtraKeys(Packer& pk, const KvEvent& e) {
  std::vector<std::string> first, rest;
  for (const std::string& k : e.extra_keys) {
    first.push_back(WireExtraKey(k));
    if (k.rfind("salt:", 0) != 0) rest.push_back(first.back());
  }
  pk.pack_array(static_cast<uint32_t>(e.keys.size()));
  for (size_t i = 0; i < e.keys.size(); ++i) {
    const std::vector<std::string>& keys = i == 0 && !e.parent ? first : rest;
    if (keys.empty()) {
      pk.pack_nil();
      continue;
    }
    pk.pack_array(static_cast<uint32_t>(keys.size()));
    for (const std::string& k : keys) PackStr(pk, k);
  }
}

void PackEvent(Packer& pk, const KvEvent& e, const KvEventWire& wire) {
  switch (e.type) {
    case KvEvent::Type::kBlockStored:
      pk.pack_map(e.window > 0 ? 12 : 11);
      PackStr(pk, "type"), PackStr(pk, "BlockStored");
      PackStr(pk, "block_hashes"), PackKeys(pk, e.keys, wire.hash_bytes);
      PackStr(pk, "parent_block_hash");
      if (e.parent) {
        PackKey(pk, *e.parent, wire.hash_bytes);
      } else {
        pk.pack_nil();
      }
      PackStr(pk, "token_ids"), pk.pack(e.token_ids);
      PackStr(pk, "block_size"), pk.pack(e.block_len);
      PackStr(pk, "lora_id");
      if (e.adapter_id != 0) {
        pk.pack(e.adapter_id);
      } else {
        pk.pack_nil();
      }
      PackStr(pk, "medium"), PackStr(pk, EventMedium(e.tier));
      PackStr(pk, "lora_name"), pk.pack_nil();  // adapters are ids here, without names
      PackStr(pk, "extra_keys"), PackExtraKeys(pk, e);
      PackStr(pk, "group_idx"), pk.pack(e.group);
      if (e.window > 0) {  // a hybrid cache's sliding group (vLLM's SlidingWindowSpec)
        PackStr(pk, "kv_cache_spec_kind"), PackStr(pk, "sliding_window");
        PackStr(pk, "kv_cache_spec_sliding_window"), pk.pack(e.window);
      } else {
        PackStr(pk, "kv_cache_spec_kind"), PackStr(pk, wire.spec_kind);
      }
      break;
    case KvEvent::Type::kBlockRemoved:
      pk.pack_map(4);
      PackStr(pk, "type"), PackStr(pk, "BlockRemoved");
      PackStr(pk, "block_hashes"), PackKeys(pk, e.keys, wire.hash_bytes);
      PackStr(pk, "medium"), PackStr(pk, EventMedium(e.tier));
      PackStr(pk, "group_idx"), pk.pack(e.group);
      break;
    case KvEvent::Type::kAllBlocksCleared:
      pk.pack_map(1);
      PackStr(pk, "type"), PackStr(pk, "AllBlocksCleared");
      break;
  }
}

std::string SeqBytes(int64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>(static_cast<uint64_t>(n) >> (56 - 8 * i));
  return s;
}

}  // namespace

std::string DefaultKvEventsTopic(const KvEventsOptions& o, const std::string& model_path) {
  std::string instance = o.instance;
  if (instance.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
    instance = std::string(host) + ":" + std::to_string(::getpid());
  }
  std::string model = o.model;
  if (model.empty()) {
    const size_t slash = model_path.find_last_of('/');
    model = slash == std::string::npos ? model_path : model_path.substr(slash + 1);
  }
  return "kv@" + instance + "@" + model;
}

std::string EventMedium(const std::string& tier) {
  if (tier == "pool") return "GPU";
  if (tier == "host") return "CPU";
  if (tier == "disk") return "DISK";
  if (tier == "redis") return "REDIS";
  return tier;
}

struct KvEventPublisher::Impl {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::xpub};
  KvEventWire wire;
  uint64_t sequence = 0;
  std::string replay_bound;
  // Replay: the ROUTER socket belongs to its thread; the buffer is shared.
  std::mutex mu;
  std::deque<std::pair<uint64_t, std::string>> buffer;
  std::atomic<bool> stop{false};
  std::thread replay_thread;

  void ServeReplay(zmq::socket_t router) {
    zmq::pollitem_t item{router.handle(), 0, ZMQ_POLLIN, 0};
    while (!stop.load()) {
      if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) <= 0) continue;
      std::vector<zmq::message_t> req;
      try {
        if (!zmq::recv_multipart(router, std::back_inserter(req), zmq::recv_flags::dontwait)) continue;
      } catch (const zmq::error_t&) {
        continue;
      }
      // [identity, "", start sequence]; anything else is ignored.
      if (req.size() != 3 || req[2].size() != 8) continue;
      uint64_t start = 0;
      for (int i = 0; i < 8; ++i) start = start << 8 | static_cast<const uint8_t*>(req[2].data())[i];
      std::vector<std::pair<uint64_t, std::string>> batches;
      {
        std::lock_guard lock(mu);
        for (const auto& b : buffer) {
          if (b.first >= start) batches.push_back(b);
        }
      }
      const std::string identity = req[0].to_string();
      try {
        for (const auto& [seq, payload] : batches) {
          const std::string sb = SeqBytes(static_cast<int64_t>(seq));
          const std::array<zmq::const_buffer, 4> parts = {zmq::buffer(identity), zmq::const_buffer(), zmq::buffer(sb),
                                                          zmq::buffer(payload)};
          zmq::send_multipart(router, parts);
        }
        const std::string end = SeqBytes(-1);
        std::array<zmq::const_buffer, 4> last = {zmq::buffer(identity), zmq::const_buffer(), zmq::buffer(end),
                                                 zmq::const_buffer()};
        zmq::send_multipart(router, last);
      } catch (const zmq::error_t&) {
        // The requester went away: nothing to answer.
      }
    }
  }
};

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvEventPublisher::~KvEventPublisher() {
  impl_->stop = true;
  if (impl_->replay_thread.joinable()) impl_->replay_thread.join();
}

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Create(const std::string& endpoint, KvEventWire wire) {
  if (endpoint.empty()) return InvalidArgumentError("KV events endpoint is empty: give e.g. tcp://127.0.0.1:5557");
  if (wire.buffer_batches < 1) return InvalidArgumentError("KV events: the replay buffer needs at least one batch");
  auto impl = std::make_unique<Impl>();
  impl->wire = std::move(wire);
  auto bind = [](zmq::socket_t& s, const std::string& at, const char* what) -> Status {
    try {
      s.bind(at);
    } catch (const zmq::error_t& e) {
      return InvalidArgumentError(std::string("KV events ") + what + " '" + at + "': " + e.what() +
                                  " (expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557, free to bind)");
    }
    return Status::Ok();
  };
  impl->socket.set(zmq::sockopt::linger, 2000);  // flush queued batches at exit
  impl->socket.set(zmq::sockopt::sndhwm, 100000);
  PAGEKV_RETURN_IF_ERROR(bind(impl->socket, endpoint, "endpoint"));
  if (!impl->wire.replay_endpoint.empty()) {
    zmq::socket_t router(impl->context, zmq::socket_type::router);
    router.set(zmq::sockopt::linger, 0);
    PAGEKV_RETURN_IF_ERROR(bind(router, impl->wire.replay_endpoint, "replay endpoint"));
    impl->replay_bound = router.get(zmq::sockopt::last_endpoint);
    Impl* raw = impl.get();
    impl->replay_thread = std::thread([raw, r = std::move(router)]() mutable { raw->ServeReplay(std::move(r)); });
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

std::string KvEventPublisher::EncodeBatch(std::span<const KvEvent> events, double timestamp, const KvEventWire& wire) {
  std::stringstream buffer;
  Packer pk(buffer);
  pk.pack_array(3);
  pk.pack_double(timestamp);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvEvent& e : events) PackEvent(pk, e, wire);
  pk.pack(wire.data_parallel_rank);
  return buffer.str();
}

Status KvEventPublisher::Publish(std::span<const KvEvent> events) {
  if (events.empty()) return Status::Ok();
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string payload = EncodeBatch(events, now, impl_->wire);
  const uint64_t n = impl_->sequence++;
  const std::string seq = SeqBytes(static_cast<int64_t>(n));
  Status sent = Status::Ok();
  try {
    impl_->socket.send(zmq::buffer(impl_->wire.topic), zmq::send_flags::sndmore);
    impl_->socket.send(zmq::buffer(seq), zmq::send_flags::sndmore);
    impl_->socket.send(zmq::buffer(payload), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    sent = IoError(std::string("KV events: send failed: ") + e.what());
  }
  if (impl_->replay_thread.joinable()) {
    // Kept whether or not the send went out: a subscriber that missed it
    // asks for exactly these.
    std::lock_guard lock(impl_->mu);
    impl_->buffer.emplace_back(n, std::move(payload));
    while (static_cast<int64_t>(impl_->buffer.size()) > impl_->wire.buffer_batches) impl_->buffer.pop_front();
  }
  return sent;
}

uint64_t KvEventPublisher::batches_sent() const { return impl_->sequence; }

std::string KvEventPublisher::endpoint() const { return impl_->socket.get(zmq::sockopt::last_endpoint); }

std::string KvEventPublisher::replay_endpoint() const { return impl_->replay_bound; }

const std::string& KvEventPublisher::topic() const { return impl_->wire.topic; }

}  // namespace pagekv
