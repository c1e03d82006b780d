// Prefix caching: full KV blocks published under a content key, found again
// by later requests whose prompts start with the same tokens, and shared by
// reference count instead of recomputed.
//
//   key(block 0) = H("root", tokens[0, L),  salt, extra keys)
//   key(block i) = H(key(block i-1), tokens[iL, (i+1)L), extra keys)
//
// H is SHA-256 (OpenSSL) by default, or xxh3-128 (libxxhash) seeded per
// process (randomly unless a seed is configured). Because every key chains
// from the first, the cache salt (a tenant) and the extra keys (adapter id,
// model fingerprint) separate whole chains: different salts never share a
// block. A hit is accepted only when the stored block's token ids, parent key
// and extra keys equal the request's and so does its prefix digest (SHA-256
// chained over the whole prefix; the key itself when keys are SHA-256), in
// the pool and in every lower tier: a hash alone never decides, even one
// that collides (xxh3 with a known seed, or an injected one).
//
// A sequence's chain (the keys of its leading full blocks) follows the
// sequence: when it is truncated (speculative rollback), compacted or freed
// through the KvCache, the cache's cut listener cuts the chain too, so the
// blocks it grows back are published under their own prefix.
//
// Lifetime of a cached block (it lives in the KvCache's pool):
//   in use (referenced)  --last holder frees-->  cached free (LRU, evictable)
//   cached free  --hit-->  in use again        (claimed before any allocation)
//   cached free  --pool needs a block and no plain free block is left-->
//                evicted: its key is dropped (a BlockRemoved event), the
//                block is reused with no key
// Blocks released together age deepest first, so eviction takes a chain from
// its end and the cached set stays a prefix-closed tree.
//
// Trust boundary: the salt is part of the request, so whoever may set it
// decides who shares with whom. It must come from the serving layer's
// authenticated identity (tenant or user id), never from unauthenticated
// request fields; requests with equal salts (or none) can detect each
// other's cached prompts by timing, as in CVE-2025-46570.
//
// Thread safety: none; the owner serialises calls (with the KvCache's).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pagekv/ids.h"
#include "pagekv/kv_cache.h"
#include "pagekv/status.h"

namespace pagekv {

enum class BlockHashKind : uint8_t { kSha256, kXxh3_128 };

// A block's content key: 32 bytes for SHA-256, 16 (then zeros) for xxh3-128.
struct BlockKey {
  std::array<uint8_t, 32> bytes{};
  uint8_t size = 32;

  bool operator==(const BlockKey& o) const { return size == o.size && bytes == o.bytes; }
  std::string Hex() const;
};

// What changes the KV of the same tokens, per request.
struct ExtraKeys {
  std::optional<std::string> cache_salt;  // a tenant; enters the first block's key; if set, 1..256 bytes
  int64_t adapter_id = 0;                 // LoRA or other adapter; 0 = the base model
  std::string model_fingerprint;          // e.g. a hash of the weights file; up to 256 bytes
  std::vector<std::string> extra;         // anything else, each up to 1024 bytes, at most 16
};

// Where a block's KV lives. The pool is where attention reads it; the others
// are the lower tiers of include/pagekv/tiers.h.
enum class Tier : int8_t { kPool = 0, kHost = 1, kDisk = 2, kRedis = 3 };
inline constexpr int kNumTiers = 4;
const char* TierName(Tier t);  // "pool", "host", "disk", "redis"

// What a block that leaves the pool claims to be; a lower tier stores it
// beside the KV bytes and a load checks all of it, so a payload is accepted
// only for exactly the request that asked (never on the key alone).
struct BlockMeta {
  BlockKey key;
  std::optional<BlockKey> parent;  // none for a chain's first block
  std::vector<int32_t> tokens;     // the block's token ids [block_len]
  uint64_t geometry = 0;           // the cache's shape and dtype (KvCache::GeometryTag)
  // SHA-256 chained over the whole prefix (salt, extra keys and every
  // token up to this block's end); the key itself when keys are SHA-256.
  // Equal digests mean equal prefixes even when keys collide (an xxh3 or
  // injected hash), so a load never takes a block computed after another
  // prefix whose key and parent key happen to match.
  BlockKey digest;
  // For KV events only (a tier that stores the block describes it with
  // these); neither stored in payloads nor checked, since they entered the key.
  int64_t adapter_id = 0;
  std::vector<std::string> event_extra_keys;
  // A hybrid cache's group (KvLayout::num_groups) whose rows the block
  // holds, for events only: it entered the key. Group 0's block goes down
  // under the chain's key; group g > 0's under a key, parent and digest
  // derived from the chain's and g (so no group's bytes ever load as
  // another's).
  int32_t group = 0;
};

// A change to a lower tier's contents, reported as it happens (per tier and
// key in the order it happened), so that the KV event stream follows every
// medium and not only the pool.
struct TierChange {
  enum class Kind : uint8_t { kStored, kRemoved };
  Kind kind = Kind::kStored;
  Tier tier = Tier::kHost;
  BlockMeta meta;  // kRemoved: only meta.key is meaningful
};

// A block to load in the background (LowerTiers::StartLoads). On a tiers
// worker, `store` gets the block's verified bytes and writes them into its
// pool block, which nothing else reads or writes until `done`; then `done`
// gets the tier they came from, or nullopt on a miss (store not called).
struct TierLoadJob {
  BlockMeta meta;
  std::function<void(std::span<const std::byte>)> store;
  std::function<void(std::optional<Tier>)> done;
};

// A cached pool block to copy down ahead of its eviction
// (LowerTiers::StartOffloads). On a tiers worker, `read` fills the span with
// the block's bytes (the block is free and cached: nobody writes it until
// `done`); then `done` gets the tier that took the copy (nullopt: none).
struct TierOffloadJob {
  BlockMeta meta;
  std::function<void(std::span<std::byte>)> read;
  std::function<void(std::optional<Tier>)> done;
};

// The lower tiers as the prefix cache sees them (implemented by BlockTiers
// in include/pagekv/tiers.h). Calls come from the thread that owns the
// prefix cache; byte spans are valid only during the call. The jobs of
// StartLoads and StartOffloads run later, on the tiers' own threads, and
// call back from there.
class LowerTiers {
 public:
  virtual ~LowerTiers() = default;
  // For keys[0], keys[1], ...: the tier that holds each, stopping at the
  // first key no tier holds. A tier that fails answers "not here".
  virtual std::vector<Tier> LocatePrefix(std::span<const BlockKey> keys) = 0;
  // Fills kv with the block's verified bytes and returns the tier they came
  // from; nullopt on a miss (a failed check or an I/O error is a miss,
  // counted and logged by the tiers).
  virtual std::optional<Tier> Load(const BlockMeta& meta, std::span<std::byte> kv) = 0;
  // Write-through: every published block is copied down (Published);
  // otherwise only evicted ones are.
  virtual bool write_through() const = 0;
  virtual void Published(const BlockMeta& meta, std::span<const std::byte> kv) = 0;
  // A cached block is being evicted from the pool: the tier it is copied to
  // (nullopt: dropped, e.g. every tier is full of newer blocks or down).
  virtual std::optional<Tier> Evicted(const BlockMeta& meta, std::span<const std::byte> kv) = 0;
  // Hint: these blocks will be loaded soon; fetch them from slow tiers now.
  virtual void Prefetch(std::vector<BlockMeta> metas) = 0;
  // Background moves, off the caller's thread: loads (each job's done is
  // called exactly once, loads are never dropped) and copies ahead of
  // eviction (Evicted's work, done in advance; a full queue answers done
  // with nullopt at once).
  virtual void StartLoads(std::vector<TierLoadJob> jobs) = 0;
  virtual void StartOffloads(std::vector<TierOffloadJob> jobs) = 0;
  // At the eviction of a block an earlier offload stored in `tier`: whether
  // the copy can be counted on without copying again (host RAM may have
  // dropped it for room since; the slower tiers are trusted as Evicted's
  // answer is).
  virtual bool StillHolds(const BlockKey& key, Tier tier) = 0;
  // While on, every block a tier comes to hold or stops holding (stored,
  // dropped for room, dropped as corrupt, removed, found gone) is recorded;
  // TakeChanges hands the records over in order. The prefix cache turns
  // them into BlockStored / BlockRemoved events with the tier as medium.
  // Tiers that never change on their own may keep the defaults.
  virtual void RecordChanges(bool /*on*/) {}
  virtual std::vector<TierChange> TakeChanges() { return {}; }
};

// Computes block keys. The default hashers are SHA-256 and xxh3-128; tests
// may inject another function (e.g. one that collides on purpose).
struct BlockHasherOptions {
  BlockHashKind kind = BlockHashKind::kSha256;
  std::optional<uint64_t> seed;  // xxh3 only; unset = random per process
  // Replaces the hash: called with the exact bytes H would digest.
  std::function<BlockKey(std::span<const uint8_t>)> custom;
};

// The SHA-256 key of one block after `parent` (nullptr: a chain's first
// block) under `extra`: what a PrefixCache with SHA-256 keys computes (the
// encoding in src/prefix/block_hasher.h). For indexes outside a cache that
// must agree across processes, such as a router's over many instances'
// KV events.
BlockKey Sha256BlockKey(const BlockKey* parent, std::span<const int32_t> tokens, const ExtraKeys& extra);

struct PrefixCacheOptions {
  BlockHasherOptions hasher;
  int64_t stats_window = 1000;   // lookups in the "recent" statistics
  bool record_events = false;    // queue KV events (DrainEvents)
  int64_t max_queued_events = 1 << 20;  // beyond this the oldest are dropped (counted)
  // Lower tiers (not owned; must outlive the prefix cache): evicted blocks
  // go down, and a prefix continues from the pool into them. Keys must be
  // stable across processes for disk and Redis: SHA-256, or xxh3 with a seed.
  LowerTiers* tiers = nullptr;
};

// The longest cached prefix of a prompt, in whole blocks.
// With lower tiers, a Lookup's match may continue past the pool: `lower`
// lists the tiers of the blocks after `blocks` (their keys follow in
// `keys`), which AddSequence loads into fresh pool blocks. The match ends
// at the first block that neither the pool (before its first miss) nor a
// tier (after it) holds, and at a block past the pool's first miss that the
// pool does hold (a load cannot publish a second block under its key): such
// a block is recomputed. (A hole arises when two requests computed the same
// block, one copy was published, the other's next block chains to it, and
// the older copy was evicted first.)
struct PrefixMatch {
  std::vector<BlockId> blocks;    // in the pool
  std::vector<BlockKey> keys;     // of blocks, then of the lower-tier blocks
  std::vector<Tier> lower;        // Lookup: blocks to load from lower tiers; AddSequence: where loaded blocks came from
  int64_t num_tokens = 0;         // (blocks.size() + lower.size()) * block_len after Lookup; blocks.size() * block_len after AddSequence
  // A hybrid cache (KvLayout::hybrid): every group's table of the hit,
  // num_tokens / block_len entries each; a sliding group's start with
  // kNoBlock up to the window of the first query after the hit. `blocks`
  // is group 0's. Empty for a uniform cache.
  std::vector<std::vector<BlockId>> group_blocks;
  // A hybrid cache with lower tiers: the groups' blocks the hit takes from
  // a tier, by position then group. After Lookup their group_blocks entries
  // are kNoBlock (no pool block yet) and `lower` lists their tiers in the
  // same order; AddSequence loads each into a new pool block and lists
  // those it loaded. Unlike a uniform cache's, a hybrid hit may mix pool
  // and tier blocks anywhere in [0, num_tokens).
  struct GroupLoad {
    int32_t group = 0;
    int64_t index = 0;  // block position in the sequence
    Tier from = Tier::kHost;
  };
  std::vector<GroupLoad> group_loads;
  // Every pool block the hit holds, once (blocks, or every group's).
  std::vector<BlockId> AllBlocks() const;
};

struct PrefixCacheStats {
  int64_t lookups = 0;
  int64_t requested_tokens = 0;  // prompt tokens looked up
  int64_t requested_blocks = 0;  // full prompt blocks looked up
  int64_t hit_tokens = 0;
  int64_t hit_blocks = 0;
  int64_t inserted = 0;          // blocks published
  int64_t evicted = 0;           // cached blocks reused for other data
  int64_t collisions = 0;        // equal keys, different tokens: treated as misses
  int64_t cached_blocks = 0;     // keys held now
  // hit_blocks by where they were found: [pool, host, disk, redis]
  std::array<int64_t, kNumTiers> tier_hit_blocks{};
  int64_t tier_load_failures = 0;  // located in a tier but not loaded (miss, corrupt, I/O): recomputed
  int64_t background_loads = 0;    // lower-tier blocks loaded off the admitting thread (AddSequence's background_loads)
  int64_t offloads_ahead = 0;      // cached blocks copied down before their eviction (OffloadAhead)
  int64_t evictions_precopied = 0; // evictions that found their copy already down: nothing copied then
  int64_t evictions_copied = 0;    // evictions that copied the block down themselves (on the allocation path)
  int64_t eviction_waits = 0;      // evictions that waited for the block's offload still in flight
  double token_hit_rate = 0;     // hit_tokens / requested_tokens
  double block_hit_rate = 0;     // hit_blocks / requested_blocks
  // The same rates over the last stats_window lookups.
  double recent_token_hit_rate = 0;
  double recent_block_hit_rate = 0;
};

// KV events for KV-aware routers (the shape vLLM publishes; docs/KV_EVENTS.md).
struct KvEvent {
  enum class Type : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Type type = Type::kBlockStored;
  uint64_t sequence = 0;               // consecutive from 1 per cache
  std::vector<BlockKey> keys;          // stored / removed
  std::optional<BlockKey> parent;      // stored: the first block's parent
  std::vector<int32_t> token_ids;      // stored: all blocks' tokens, in order
  int32_t block_len = 0;               // stored
  int64_t adapter_id = 0;              // stored
  std::vector<std::string> extra_keys; // stored: salt (first block of a chain), fingerprint, extras
  std::string tier = "pool";           // where the block lives
  // A hybrid cache's group (KvLayout::num_groups) whose blocks these are,
  // and its window (0: full attention); 0 and 0 for a uniform cache.
  int32_t group = 0;
  int32_t window = 0;
};

// Publishing a prefix cache's KV events over ZeroMQ in vLLM's wire format
// (docs/KV_EVENTS.md); EngineOptions and GenerateOptions carry one.
struct KvEventsOptions {
  std::string endpoint;  // the ZeroMQ address to bind, e.g. tcp://127.0.0.1:5557; empty: no events
  int wait_ms = 0;       // wait this long for a first subscriber before the first step
  // The first frame of every message; unset: kv@<instance>@<model>.
  std::optional<std::string> topic;
  std::string instance;  // in the default topic; empty: <hostname>:<pid>
  std::string model;     // in the default topic; empty: the model file's name
  bool hash_bytes = false;  // block hashes as the whole key (bytes) instead of vLLM's u64
  std::string replay_endpoint;  // a ROUTER for missed batches; empty: no replay
  int64_t buffer_batches = 10000;  // batches kept for replay
  int32_t data_parallel_rank = 0;
};

class PrefixCache {
 public:
  // Binds to `cache` (which must outlive it) and installs itself as the
  // cache's eviction and cut listener (one prefix cache per KvCache). With
  // record_events and tiers, asks the tiers to record their changes.
  // Errors: invalid options.
  static Result<std::unique_ptr<PrefixCache>> Create(KvCache& cache, const PrefixCacheOptions& options = {});
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Checks a request's extra keys (empty salt, oversize keys: named).
  static Status ValidateExtraKeys(const ExtraKeys& extra);

  // The keys of the first `max_blocks` full blocks of `tokens` (all full
  // blocks when negative).
  Result<std::vector<BlockKey>> Keys(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                     int64_t max_blocks = -1) const;

  // What a lower tier stores the first `max_blocks` full blocks of `tokens`
  // under (all full blocks when negative): each block's key, parent key,
  // tokens, this cache's geometry tag and prefix digest, as Publish and
  // eviction hand them to the tiers. For moving blocks to and from a
  // BlockStore by hand (KvCache::ReadBlock / WriteBlock give the bytes).
  Result<std::vector<BlockMeta>> BlockMetas(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                            int64_t max_blocks = -1) const;

  // Ask: the longest cached prefix of `tokens` within its first max_tokens
  // tokens (negative: tokens.size() - 1, so the last prompt token is always
  // computed). Changes nothing, statistics included.
  Result<PrefixMatch> Lookup(std::span<const int32_t> tokens, const ExtraKeys& extra, int64_t max_tokens = -1) const;

  // Hands the lower tiers the blocks a later AddSequence of these tokens
  // would load, so slow tiers can fetch them while other work runs.
  void Prefetch(std::span<const int32_t> tokens, const ExtraKeys& extra);

  // Would admitting `match` and then `new_tokens` more tokens fit, counting
  // the cached free blocks the match itself would claim?
  bool CanAdmit(const PrefixMatch& match, int64_t new_tokens) const;

  // Act: a new sequence in the cache starting with the longest cached prefix
  // (its blocks claimed), counted in the statistics. Blocks found in lower
  // tiers are loaded into new pool blocks (taken like any allocation) and
  // published; loading stops at the first block that fails, or when the
  // pool has no block for it. The caller computes the rest from
  // match.num_tokens on. max_tokens as for Lookup.
  //
  // background_loads: the lower tiers' blocks get their pool blocks now and
  // are loaded by the tiers' threads (LowerTiers::StartLoads) while the
  // caller goes on; `loading_blocks` says how many. The sequence must not
  // be read, written, forked or run until TakeLoaded names it; match covers
  // the pool's part only (the statistics wait for TakeLoaded too); a hybrid
  // cache's match is then empty (num_tokens 0), its pool and tier blocks
  // being mixed.
  //
  // A hybrid cache: the hit's tier blocks (match.group_loads) get new pool
  // blocks all at once with the shared ones (nothing is loaded when the
  // pool is short of them: the hit is then the pool's part); a load that
  // fails cuts the hit back to the longest one its blocks still allow.
  struct Admitted {
    SeqId seq{};
    PrefixMatch match;
    int64_t loading_blocks = 0;
  };
  Result<Admitted> AddSequence(std::span<const int32_t> tokens, const ExtraKeys& extra, std::string label = {},
                               int64_t max_tokens = -1, bool background_loads = false);

  // Sequences whose background loads have all finished since the last call.
  // Their loaded blocks are published, in order, up to the first that
  // failed; the sequence is cut back to there (the caller computes the rest
  // from num_tokens, its cached length now).
  struct Loaded {
    SeqId seq{};
    int64_t num_tokens = 0;
  };
  std::vector<Loaded> TakeLoaded();
  // Sequences still loading (TakeLoaded has not named them).
  int64_t loading() const;
  // Waits until a background load or offload finishes or `timeout` passes.
  void WaitForBackground(std::chrono::milliseconds timeout);

  // Copies down, in the background, the free cached blocks the pool would
  // evict next: positions [skip, skip + count) of its eviction order, those
  // not copied yet. Their evictions then copy nothing (an eviction that
  // comes first waits for the copy). Returns how many were started; 0
  // without tiers.
  int64_t OffloadAhead(int64_t skip, int64_t count);

  // Publishes every block of `seq` that has become full since the last call.
  // `tokens` are the sequence's token ids, at least as many as its cached
  // length. A block whose key is already cached (computed twice) is left
  // unpublished; a collision stops publishing for this sequence.
  Status Publish(SeqId seq, std::span<const int32_t> tokens);

  // A new sequence sharing every block of `seq` (KvCache::Fork) that
  // publishes its own later blocks as children of the same chain.
  Result<SeqId> Fork(SeqId seq, std::string label = {});

  // Frees the sequence in the cache (its published blocks stay cached,
  // evictable) and forgets its chain; a sequence still loading first waits
  // for its loads (and publishes none of them). KvCache::Free, Truncate and Compact
  // called directly on the cache are also seen (through its cut listener):
  // the chain keeps only the full blocks whose rows are unchanged, so blocks
  // that grow back with other tokens get keys of their own prefix.
  Status Free(SeqId seq);

  // Drops every key (an AllBlocksCleared event); blocks in use are untouched.
  void Clear();

  PrefixCacheStats Stats() const;
  std::vector<KvEvent> DrainEvents();
  int64_t dropped_events() const;

  // The cached block holding `key`, if any (for tests and tiers).
  std::optional<BlockId> Find(const BlockKey& key) const;

  void CheckInvariants() const;

 private:
  struct State;
  explicit PrefixCache(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace pagekv
