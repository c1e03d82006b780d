// The router's side of KV events (docs/KV_EVENTS.md): a batch as a backend
// publishes it (vLLM's msgpack wire format, KvEventPublisher in
// src/prefix/), decoded from untrusted bytes, and the global index built
// from every backend's batches.
//
// The index keys blocks by content, not by the backends' hashes: a block's
// key is SHA-256 over its parent's key, its token ids and, for a chain's
// first block, the cache salt the event names ("salt:..." in its extra
// keys) and its adapter (Sha256BlockKey). A request's keys are computed the
// same way from its tokens and salt, so the router needs neither the
// backends' hash kind (SHA-256 or seeded xxh3), nor their u64 truncation,
// nor their model fingerprints; a backend's hash only finds its block's
// content key again when a later event names it (as a parent, or removed).
// Only full-attention groups are indexed (a hybrid backend's sliding
// groups' blocks say nothing the full group's do not).
//
// Thread safety: KvIndex is not thread-safe; the router serialises calls.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pagekv/prefix_cache.h"
#include "pagekv/status.h"

namespace pagekv::router {

struct DecodedEvent {
  enum class Type : uint8_t { kStored, kRemoved, kCleared };
  Type type = Type::kStored;
  std::vector<std::string> hashes;     // each a u64 as 8 bytes big-endian, or the key's bytes
  std::optional<std::string> parent;   // stored: the first block's parent hash
  std::vector<int32_t> token_ids;      // stored: every block's, in order
  int32_t block_size = 0;              // stored
  int64_t lora_id = 0;                 // stored
  std::string medium = "GPU";          // GPU (the pool), CPU, DISK, REDIS, ...
  std::vector<std::vector<std::string>> extra_keys;  // stored: per block (may be empty)
  int32_t group = 0;
  bool sliding = false;                // kv_cache_spec_kind "sliding_window"
};

struct DecodedBatch {
  double timestamp = 0;
  std::vector<DecodedEvent> events;
  int32_t data_parallel_rank = 0;
};

// Decodes one payload ([timestamp, [event, ...], rank]); any malformed
// piece is an error naming it, never a crash (the bytes come off a socket).
Result<DecodedBatch> DecodeKvEventBatch(std::string_view payload);

// Where a backend holds a block: one bit per medium.
enum MediumBit : uint8_t { kGpu = 1, kCpu = 2, kDisk = 4, kRedis = 8, kOtherMedium = 16 };
uint8_t MediumOf(std::string_view medium);

struct KvIndexStats {
  int64_t blocks = 0;           // content keys held by some backend
  int64_t stored = 0;           // blocks indexed from stored events
  int64_t removed = 0;          // medium copies removed
  int64_t unknown_parent = 0;   // stored events whose parent the index never saw (published before it listened)
  int64_t other_block_size = 0; // stored events of another block length than the router's (not indexed)
  int64_t unknown_removals = 0; // removals of hashes never indexed
};

class KvIndex {
 public:
  explicit KvIndex(int32_t block_len) : block_len_(block_len) {}

  // A backend's batch, in its publishing order.
  void Apply(int backend, const DecodedBatch& batch);
  // Forgets everything a backend held (it died or restarted).
  void Forget(int backend);

  struct Hit {
    int64_t blocks = 0;       // leading full blocks held in any medium
    int64_t pool_blocks = 0;  // of those, leading blocks in its pool (GPU)
  };
  // For backends [0, num_backends): how much of `tokens`' leading full
  // blocks (at most (tokens.size() - 1) / block_len: the last token is
  // always computed) each holds, for a request of this salt and adapter.
  std::vector<Hit> Match(std::span<const int32_t> tokens, const std::optional<std::string>& salt, int64_t adapter,
                         int num_backends) const;

  int32_t block_len() const { return block_len_; }
  KvIndexStats Stats() const;
  int64_t BackendBlocks(int backend) const;

 private:
  struct KeyHasher {
    size_t operator()(const BlockKey& k) const;
  };
  struct Held {
    std::array<int32_t, 5> copies{};  // per medium bit index
    uint8_t media() const;
  };
  struct Backend {
    std::unordered_map<std::string, BlockKey> by_hash;  // its hash -> content key
    std::unordered_map<BlockKey, Held, KeyHasher> held;
  };
  Backend& Of(int backend);
  void Store(Backend& b, const DecodedEvent& e);
  void Remove(Backend& b, const DecodedEvent& e);
  void ClearPool(Backend& b);

  int32_t block_len_;
  std::vector<Backend> backends_;
  KvIndexStats stats_;
};

}  // namespace pagekv::router
