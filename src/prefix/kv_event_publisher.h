// Publishes KV events over ZeroMQ in the wire format vLLM uses, so existing
// KV-aware routers can consume PageKV's (docs/KV_EVENTS.md):
//   multipart message [topic, sequence (u64 big-endian), payload]
//   payload = msgpack [timestamp (f64 seconds), [event, ...]]
//   event   = ["BlockStored", [key bytes...], parent bytes | nil, [token ids],
//              block_len, adapter id | nil, tier, nil, [extra keys]]
//           | ["BlockRemoved", [key bytes...], tier]
//           | ["AllBlocksCleared"]
// The socket is an XPUB (SUB peers see an ordinary PUB) so the publisher can
// wait for its first subscriber instead of dropping early batches.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "pagekv/prefix_cache.h"
#include "pagekv/status.h"

namespace pagekv {

class KvEventPublisher {
 public:
  // endpoint: a ZeroMQ address the publisher binds, e.g. tcp://*:5557 or
  // tcp://127.0.0.1:5557 (port * picks a free one); subscribers connect.
  static Result<std::unique_ptr<KvEventPublisher>> Create(const std::string& endpoint, std::string topic = {});
  ~KvEventPublisher();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Waits up to timeout_ms for a subscription; true when one arrived.
  bool WaitForSubscriber(int timeout_ms);

  // One batch (nothing is sent for an empty span).
  Status Publish(std::span<const KvEvent> events);

  uint64_t batches_sent() const;
  std::string endpoint() const;  // the bound address, with the real port

  // The msgpack payload of one batch (exposed for tests and other transports).
  static std::string EncodeBatch(std::span<const KvEvent> events, double timestamp);

 private:
  struct Impl;
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagekv
