// Publishes KV events over ZeroMQ in the wire format current vLLM sends, so
// KV-aware routers written for it (Dynamo's ZMQ listener, llm-d's KV cache
// manager, vLLM's own subscriber) consume PageKV's (docs/KV_EVENTS.md):
//   multipart message [topic, sequence (u64 big-endian, from 0), payload]
//   payload = msgpack [timestamp (f64 seconds), [event, ...], data_parallel_rank]
//   event   = a map tagged by "type": BlockStored {block_hashes,
//             parent_block_hash, token_ids, block_size, lora_id, medium,
//             lora_name, extra_keys (one list per block), group_idx,
//             kv_cache_spec_kind} | BlockRemoved {block_hashes, medium,
//             group_idx} | AllBlocksCleared {}
// Block hashes are 64-bit unsigned integers by default (the last 8 bytes of
// the key, big-endian, as vLLM derives them) or the whole key as bytes.
// With a replay endpoint, a ROUTER socket answers a request carrying a start
// sequence number (8 bytes big-endian) with every buffered batch from it,
// then an end marker (sequence -1, empty payload), as vLLM's publisher does.
// The publishing socket is an XPUB (SUB peers see an ordinary PUB) so the
// publisher can wait for its first subscriber instead of dropping batches.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "pagekv/prefix_cache.h"
#include "pagekv/status.h"

namespace pagekv {

struct KvEventWire {
  std::string topic;               // the first frame of every message
  bool hash_bytes = false;         // block hashes as the whole key (bytes) instead of u64
  int32_t data_parallel_rank = 0;  // the batch's third element
  std::string replay_endpoint;     // a ZeroMQ address to bind a ROUTER at; empty: no replay
  int64_t buffer_batches = 10000;  // batches kept for replay
  std::string spec_kind = "full_attention";  // kv_cache_spec_kind of the (single) group
};

// The medium vLLM's consumers know for a tier of ours: the pool is "GPU"
// (vLLM's name for the engine's own KV cache, whatever device holds it);
// host RAM "CPU", disk "DISK", Redis "REDIS".
std::string EventMedium(const std::string& tier);

// kv@<instance>@<model>: the instance <hostname>:<pid> unless given, the
// model the file's name (without directories) unless given.
std::string DefaultKvEventsTopic(const KvEventsOptions& o, const std::string& model_path);

class KvEventPublisher {
 public:
  // endpoint: a ZeroMQ address the publisher binds, e.g. tcp://*:5557 or
  // tcp://127.0.0.1:5557 (port * picks a free one); subscribers connect.
  static Result<std::unique_ptr<KvEventPublisher>> Create(const std::string& endpoint, KvEventWire wire = {});
  ~KvEventPublisher();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Waits up to timeout_ms for a subscription; true when one arrived.
  bool WaitForSubscriber(int timeout_ms);

  // One batch (nothing is sent for an empty span).
  Status Publish(std::span<const KvEvent> events);

  uint64_t batches_sent() const;
  std::string endpoint() const;         // the bound address, with the real port
  std::string replay_endpoint() const;  // likewise; empty without replay
  const std::string& topic() const;

  // The msgpack payload of one batch (exposed for tests and other transports).
  static std::string EncodeBatch(std::span<const KvEvent> events, double timestamp, const KvEventWire& wire = {});

 private:
  struct Impl;
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagekv
