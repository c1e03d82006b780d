// Tiered KV storage: where a prefix-cache block goes when it leaves the pool,
// and where a later request finds it again.
//
//   pool (KvCache) --evicted / published--> host RAM --> local disk --> Redis
//        ^                                                             |
//        `----- loaded into a fresh pool block on a prefix hit <--------'
//
// A BlockStore keeps whole blocks under their prefix-cache key. Every stored
// payload carries a header (docs/KV_LAYOUT.md, "Tier payloads"): format
// version, key, parent key, token ids, cache geometry, sizes, and a seal
// over all of it and the KV bytes: an HMAC-SHA-256 under the tier key
// (TierOptions::payload_key; only its holders can write a block another
// process will load) or, without a key, an xxh3-64 checksum (accidents
// only). A get checks the seal, then every field against
// what the caller asked for, so a corrupt, truncated, foreign (other model,
// other salt, other shape) or colliding payload is a miss, counted, and the
// entry is dropped; wrong KV is never returned.
//
// Stores:
//   host   a preallocated arena of fixed-size slots with its own LRU
//   disk   one preallocated file of slots (direct I/O when the file system
//          allows it) and an index file written atomically (temp + fsync +
//          rename, checksummed), so blocks survive a restart
//   redis  hiredis to a redis-server: SET/GET/EXISTS/DEL on keys
//          "<namespace>:<key hex>", pipelined for many blocks; a down or slow
//          server is marked unhealthy and retried with exponential backoff
//
// BlockTiers joins the configured stores in order (host, disk, redis) behind
// the prefix cache's LowerTiers interface and moves blocks between them with
// worker threads fed by bounded queues: the caller copies a block's bytes
// into the queue and goes on; a full queue drops the copy (counted) rather
// than stall a decode step. The workers also run the prefix cache's
// background moves: loads into reserved pool blocks (StartLoads, ahead of
// every other job, never dropped) and copies of cached pool blocks ahead of
// their eviction (StartOffloads), so that neither happens on the thread that
// allocates and runs the forward pass. Loads on the request path read the host tier (a
// memcpy) or, for blocks no prefetch brought up, the slower tier directly.
// A prefetched block waits in a staging area as its whole payload, and its
// load passes the same check as a store's get, against the request that
// loads it (not the one that asked for the prefetch). Every change to a
// store's contents can be recorded (RecordChanges) for the KV event stream.
//
// Thread safety: every BlockStore and BlockTiers may be called from any
// thread (each store serialises its own state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagekv/prefix_cache.h"
#include "pagekv/status.h"

namespace pagekv {

// Counters of one store; monotonic except the *_now fields.
struct TierStats {
  std::string name;           // "host", "disk", "redis"
  int64_t puts = 0;           // blocks stored
  int64_t gets = 0;           // lookups that read a payload
  int64_t hits = 0;           // verified and returned
  int64_t misses = 0;         // not held (or dropped as below)
  int64_t evictions = 0;      // dropped to make room (LRU)
  int64_t corrupt = 0;        // failed a check: MAC or checksum, size, key, tokens, geometry
  int64_t unauthenticated = 0;  // of those, failed the MAC (forged, altered, another key, or unkeyed
                                // where a key is required) or keyed where this store has no key;
                                // redis leaves them for their key's holders
  int64_t errors = 0;         // I/O or connection failures (and calls refused while unhealthy)
  int64_t blocks_now = 0;     // held now (redis: distinct keys put by this process and not since
                              // removed, dropped as corrupt or found gone)
  int64_t bytes_now = 0;      // host and disk: slots held; redis: payload bytes of those keys
  int64_t capacity_bytes = 0; // 0 = bounded by the server (redis)
  bool healthy = true;
  // A Redis Cluster: MOVED and ASK redirections followed, slot maps loaded
  // (CLUSTER SLOTS), nodes met.
  int64_t moved = 0, asked = 0, slot_map_loads = 0, nodes = 0;
};

// Told of every change to a store's contents, under the store's lock (so
// per key in the order they happened): a key it newly holds (a re-put of a
// key it holds is no change), a key dropped for room, as corrupt, by
// Remove, or (redis) found gone from the server. Must not call the store.
using TierChangeSink = std::function<void(const TierChange&)>;

// One storage tier. Get fills `kv` only with a payload whose header matches
// `meta` exactly and whose checksum holds.
class BlockStore {
 public:
  virtual ~BlockStore() = default;
  virtual Tier tier() const = 0;
  // Stores (or replaces) the block; may evict older ones. Errors: I/O, a
  // payload larger than a slot, the tier down.
  virtual Status Put(const BlockMeta& meta, std::span<const std::byte> kv) = 0;
  // true: kv holds the block; false: a miss (including a payload that failed
  // a check, which is then removed). Errors: I/O, the tier down.
  virtual Result<bool> Get(const BlockMeta& meta, std::span<std::byte> kv) = 0;
  virtual Result<bool> Contains(const BlockKey& key) = 0;
  // For keys in order, whether each is held (one round trip for redis).
  virtual Result<std::vector<bool>> ContainsMany(std::span<const BlockKey> keys);
  // Many blocks at once (redis: one pipelined round trip); the default does
  // one call per block. PutMany stops at the first error; GetMany's
  // result[i] says whether kvs[i] was filled (a bad payload is a miss).
  virtual Status PutMany(std::span<const BlockMeta> metas, std::span<const std::span<const std::byte>> kvs);
  virtual Result<std::vector<bool>> GetMany(std::span<const BlockMeta> metas, std::span<const std::span<std::byte>> kvs);
  virtual Status Remove(const BlockKey& key) = 0;
  virtual int64_t capacity_bytes() const = 0;
  virtual TierStats Stats() const = 0;
  // Makes what was stored durable (disk: writes the index). Default: nothing.
  virtual Status Flush() { return Status::Ok(); }
  // Aborts with a message when the store's index, LRU and free slots
  // disagree (host, disk); a remote store (redis) keeps none to check.
  virtual void CheckInvariants() const {}
};

// Bytes one stored block takes (header, token ids, KV), before any rounding.
int64_t TierPayloadBytes(int32_t block_len, int64_t kv_bytes);

// A second arena in RAM: capacity / payload slots, least recently used out.
// `on_evict` (optional) hears each block dropped for room, with its bytes,
// before the slot is reused (BlockTiers uses it to push the block down).
struct HostStoreOptions {
  int64_t capacity_bytes = 0;  // > 0
  int32_t block_len = 0;       // of the cache whose blocks it holds
  int64_t kv_bytes = 0;        // KvCache::block_payload_bytes()
  std::function<void(const BlockMeta&, std::span<const std::byte>)> on_evict;
  TierChangeSink on_change;
  std::string payload_key;     // HMAC-SHA-256 key sealing its payloads; empty: the xxh3 checksum only
};
Result<std::unique_ptr<BlockStore>> CreateHostStore(const HostStoreOptions& options);

struct DiskStoreOptions {
  std::string path;            // the data file; the index is path + ".index"
  int64_t capacity_bytes = 0;  // > 0: the file is preallocated to this size (rounded down to whole slots)
  int32_t block_len = 0;
  int64_t kv_bytes = 0;
  bool direct_io = true;       // O_DIRECT when the file system supports it
  int64_t index_every_puts = 64;  // rewrite the index after this many puts (and on Flush)
  // Blocks found in the index at open are not announced (only their keys
  // are known without reading every slot).
  TierChangeSink on_change;
  std::string payload_key;     // as HostStoreOptions (blocks survive a restart only under the same key)
};
// Opens (or creates) the file. A new file is created 0600 (O_EXCL); an
// existing one is used only if it is a regular file of this user, closed to
// others (no group / other bits), and carries the disk cache's header with
// this geometry (slot size and count, block length, KV bytes); an empty one
// is initialised. A symbolic link, a foreign file (a model given by
// mistake), another geometry or a file another process holds open as a
// store (flock) are errors (kFailedPrecondition) naming the file and the
// fix, and the file is left untouched. An index that is missing or fails its
// checksum starts the store empty. Errors also: the file cannot be created
// or preallocated (no space: named).
Result<std::unique_ptr<BlockStore>> CreateDiskStore(const DiskStoreOptions& options);

struct RedisStoreOptions {
  std::string url;             // redis://host[:port][/db]; a url with credentials is refused (they would show in ps and logs)
  // A Redis Cluster instead of one server: host:port[,host:port...], any of
  // its nodes (the rest are found from CLUSTER SLOTS); url is then unset.
  // Keys spread over the primaries by hash slot; a node that fails is a
  // miss for its slots until the cluster promotes a replica.
  std::string cluster_nodes;
  std::string password;        // AUTH. Never logged.
  std::string key_namespace = "pagekv";  // keys are "<namespace>:<key hex>"
  int timeout_ms = 500;        // connect and per-command
  int backoff_initial_ms = 100;  // after a failure, calls fail fast until this passes
  int backoff_max_ms = 5000;     // doubling up to this
  int64_t ttl_seconds = 0;     // 0 = no expiry (let the server's maxmemory policy evict)
  // Keys the server drops by itself (maxmemory eviction, expiry) are
  // reported when this process next finds them gone (a GET or EXISTS).
  TierChangeSink on_change;
  std::string payload_key;     // as HostStoreOptions; every process sharing the namespace needs the same key
};
// Does not connect yet (the first call does; a server that is down is a
// tier marked unhealthy, not an error). Errors: a malformed url.
Result<std::unique_ptr<BlockStore>> CreateRedisStore(const RedisStoreOptions& options);

// A content fingerprint of a file (32 hex digits of xxh3-128 over its bytes
// and size), for ExtraKeys::model_fingerprint and Redis namespaces: blocks
// of different weights never meet. Errors: the file cannot be read.
Result<std::string> FileFingerprint(const std::string& path);

// What sealing costs a tier move: one payload of block_len tokens and
// kv_bytes KV bytes encoded (sealed) and decoded (checked), with the xxh3
// checksum and with the HMAC-SHA-256 MAC, in GB/s of payload, and a plain
// memcpy of the KV for scale; each timed for at least `seconds`.
struct SealSpeed {
  int64_t payload_bytes = 0;
  double checksum_seal_gbps = 0, checksum_check_gbps = 0;
  double mac_seal_gbps = 0, mac_check_gbps = 0;
  double memcpy_gbps = 0;
};
Result<SealSpeed> MeasureSealSpeed(int32_t block_len, int64_t kv_bytes, double seconds = 0.5);

// The tiers under one prefix cache.
struct TierOptions {
  int64_t host_bytes = 0;          // 0 = no host tier
  std::string disk_path;           // empty = no disk tier
  int64_t disk_bytes = 0;
  bool disk_direct_io = true;
  std::string redis_url;           // empty = no redis tier
  std::string redis_cluster;       // or a Redis Cluster: host:port[,host:port...] (RedisStoreOptions::cluster_nodes)
  std::string redis_password;      // from an environment variable or a file, never a flag
  std::string redis_namespace;     // e.g. "pagekv:<model fingerprint>"
  int redis_timeout_ms = 500;
  int64_t redis_ttl_seconds = 0;   // 0 = keys never expire
  // true: every published block is also written to disk and redis (other
  // processes and restarts find it); false: blocks go down only when evicted.
  bool write_through = true;
  // Seals disk and Redis payloads with HMAC-SHA-256 (16 bytes or more; from
  // an environment variable or a file, never a flag): a block written by
  // anyone without it is refused (TierStats::unauthenticated). Empty: they
  // carry the xxh3 checksum only, and a warning is logged. The host tier is
  // always checksummed only: it is this process's memory, and a MAC would
  // cost every eviction ~6x the checksum (docs/PERFORMANCE.md).
  std::string payload_key;
  int64_t queue_blocks = 1024;     // pending puts/prefetches; beyond this new ones are dropped (counted)
  int workers = 1;
  // Faults and fallbacks are reported here, one line each (default: dropped).
  std::function<void(const std::string&)> log;
  // Tests: called on a worker thread before each background load (may block
  // to hold a load in flight).
  std::function<void(const BlockMeta&)> before_background_load;
};

bool TiersConfigured(const TierOptions& o);  // any of host, disk, redis

struct TiersStats {
  std::vector<TierStats> tiers;   // configured stores, in order
  int64_t queued_now = 0;
  int64_t dropped = 0;            // puts/prefetches refused by a full queue
  int64_t prefetched = 0;         // blocks brought up ahead of their load
  int64_t load_hits[kNumTiers]{}; // blocks loaded for a request, by tier
  int64_t load_failures = 0;      // located but not loaded (counted as misses, recomputed)
  int64_t staged_mismatches = 0;  // prefetched blocks refused at load: fetched for other tokens or parent
  int64_t dropped_changes = 0;    // changes not recorded: more than queue_blocks * 16 waiting
  int64_t background_loads = 0;   // loads run on the workers (StartLoads)
  int64_t offloads = 0;           // copies ahead of eviction run on the workers (StartOffloads)
};

class BlockTiers final : public LowerTiers {
 public:
  // block_len and kv_bytes: the cache's (KvCache::block_payload_bytes()).
  // Errors: no tier configured, invalid sizes, a disk file that cannot be
  // made, a malformed redis url.
  static Result<std::unique_ptr<BlockTiers>> Create(const TierOptions& options, int32_t block_len, int64_t kv_bytes);
  ~BlockTiers() override;  // finishes queued work, flushes

  std::vector<Tier> LocatePrefix(std::span<const BlockKey> keys) override;
  std::optional<Tier> Load(const BlockMeta& meta, std::span<std::byte> kv) override;
  bool write_through() const override;
  void Published(const BlockMeta& meta, std::span<const std::byte> kv) override;
  std::optional<Tier> Evicted(const BlockMeta& meta, std::span<const std::byte> kv) override;
  void Prefetch(std::vector<BlockMeta> metas) override;
  void StartLoads(std::vector<TierLoadJob> jobs) override;
  void StartOffloads(std::vector<TierOffloadJob> jobs) override;
  bool StillHolds(const BlockKey& key, Tier tier) override;
  void RecordChanges(bool on) override;
  std::vector<TierChange> TakeChanges() override;

  // Blocks until every queued put and prefetch is done; flushes the stores.
  void Drain();
  TiersStats Stats() const;
  // Every store's CheckInvariants (BlockStore).
  void CheckInvariants() const;
  BlockStore* store(Tier t);  // nullptr when not configured

 private:
  struct State;
  explicit BlockTiers(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace pagekv
