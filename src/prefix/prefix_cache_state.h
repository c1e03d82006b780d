// The state behind PrefixCache (include/pagekv/prefix_cache.h), shared by
// its two translation units: prefix_cache.cc (the index, chains, lookups,
// publishing, events) and background_moves.cc (prefetch, loads from the
// lower tiers and offloads ahead of eviction, which the tiers' threads
// report back). Private to the prefix module.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/check.h"
#include "pagekv/prefix_cache.h"
#include "prefix/block_hasher.h"

namespace pagekv {
namespace prefix {

struct KeyHash {
  size_t operator()(const BlockKey& k) const {
    uint64_t h;
    std::memcpy(&h, k.bytes.data(), 8);
    return static_cast<size_t>(h ^ k.size);
  }
};

// A block's place in a chain: its key (the index key, from the configured
// hash) and its prefix digest (SHA-256 chained over digests, so equal
// digests mean equal whole prefixes whatever the key hash; the key itself
// when the key hash is SHA-256).
struct Link {
  BlockKey key;
  BlockKey digest;
};

// What a published block holds besides its KV: enough to verify a hit
// without trusting the key hash, and to describe it in events.
struct Entry {
  BlockKey key;
  BlockKey digest;
  std::optional<BlockKey> parent;
  std::vector<int32_t> tokens;
  ExtraKeys extra;  // salt kept only on a first block
  std::optional<Tier> below;  // where an offload ahead of eviction put a copy
  int32_t group = 0;          // the cache group the block belongs to (a hybrid cache)
};

inline bool SameExtra(const ExtraKeys& a, const ExtraKeys& b, bool first) {
  return (!first || a.cache_salt == b.cache_salt) && a.adapter_id == b.adapter_id &&
         a.model_fingerprint == b.model_fingerprint && a.extra == b.extra;
}

inline std::vector<std::string> EventExtraKeys(const ExtraKeys& e, bool first) {
  std::vector<std::string> out;
  if (first && e.cache_salt) out.push_back("salt:" + *e.cache_salt);
  if (!e.model_fingerprint.empty()) out.push_back("model:" + e.model_fingerprint);
  for (const std::string& x : e.extra) out.push_back(x);
  return out;
}

struct SeqChain {
  ExtraKeys extra;
  std::vector<Link> links;  // of the sequence's leading full blocks known so far
  bool stopped = false;     // a collision (or a compaction) ended publishing for this sequence
};

struct WindowEntry {
  int64_t requested_tokens, hit_tokens, requested_blocks, hit_blocks;
};

// One sequence's lower-tier blocks loading in the background.
struct Loading {
  size_t first = 0;                          // block index of entries[0] (a uniform cache)
  std::vector<Entry> entries;                // to publish, in order, once loaded
  bool groups = false;                       // a hybrid cache's: entries of any group and position
  std::vector<int64_t> positions;            // groups: each entry's block position
  int64_t hit_blocks = 0;                    // groups: the hit's length in blocks, if every load succeeds
  std::vector<std::optional<Tier>> results;  // per entry, as the workers report
  size_t remaining = 0;                      // entries not reported yet
  int64_t requested_tokens = 0;              // the admitted prompt's length
};

// What the tiers' threads report; taken by the owner's thread.
struct LoadDone {
  int64_t seq;
  size_t index;
  std::optional<Tier> from;
};
struct OffloadDone {
  int32_t block;
  std::optional<Tier> to;
};

}  // namespace prefix

struct PrefixCache::State {
  using Entry = prefix::Entry;
  using Link = prefix::Link;
  using Loading = prefix::Loading;
  using SeqChain = prefix::SeqChain;
  using WindowEntry = prefix::WindowEntry;
  using LoadDone = prefix::LoadDone;
  using OffloadDone = prefix::OffloadDone;

  KvCache* cache = nullptr;
  PrefixCacheOptions options;
  std::function<BlockKey(std::span<const uint8_t>)> hash;
  bool sha256_keys = false;  // keys are their own digests
  int32_t block_len = 0;
  std::unordered_map<BlockKey, BlockId, prefix::KeyHash> index;  // group 0's blocks
  // A hybrid cache's other groups: group g's blocks in side_index[g - 1]
  // (the same keys: a key names a token block, each group holds its own
  // rows of it).
  std::vector<std::unordered_map<BlockKey, BlockId, prefix::KeyHash>> side_index;
  std::unordered_map<BlockKey, BlockId, prefix::KeyHash>& IndexOf(int32_t group) {
    return group == 0 ? index : side_index[static_cast<size_t>(group - 1)];
  }
  std::vector<std::optional<Entry>> entries;  // [num_blocks]
  std::unordered_map<int64_t, SeqChain> chains;
  PrefixCacheStats stats;
  std::deque<WindowEntry> window;
  WindowEntry window_sum{0, 0, 0, 0};
  std::deque<KvEvent> events;
  uint64_t next_event = 1;
  int64_t dropped_events = 0;
  mutable std::vector<uint8_t> scratch;
  uint64_t geometry = 0;
  std::vector<std::byte> block_bytes;  // [block_payload_bytes], a block on its way to or from a tier

  // Background moves (owner's thread): sequences loading, blocks whose
  // offload is in flight (by block id).
  std::unordered_map<int64_t, Loading> loading;
  std::vector<uint8_t> offloading;  // [num_blocks]
  int64_t offloads_in_flight = 0;
  // Reports from the tiers' threads.
  std::mutex done_mu;
  std::condition_variable done_cv;
  std::vector<LoadDone> loads_done;
  std::vector<OffloadDone> offloads_done;

  // Moves the workers' reports into `loading` and the entries; true when
  // there was any.
  bool Collect() {
    std::vector<LoadDone> loads;
    std::vector<OffloadDone> offloads;
    {
      std::lock_guard lock(done_mu);
      loads.swap(loads_done);
      offloads.swap(offloads_done);
    }
    for (const LoadDone& d : loads) {
      Loading& l = loading.at(d.seq);
      l.results[d.index] = d.from;
      --l.remaining;
    }
    for (const OffloadDone& d : offloads) {
      offloading[static_cast<size_t>(d.block)] = 0;
      --offloads_in_flight;
      std::optional<Entry>& e = entries[static_cast<size_t>(d.block)];
      if (e && d.to) e->below = d.to;
    }
    return !loads.empty() || !offloads.empty();
  }

  // Blocks until a report arrives (or the timeout passes), then collects.
  bool WaitAndCollect(std::chrono::milliseconds timeout) {
    {
      std::unique_lock lock(done_mu);
      done_cv.wait_for(lock, timeout, [&] { return !loads_done.empty() || !offloads_done.empty(); });
    }
    return Collect();
  }

  void WaitLoads(int64_t seq) {
    for (;;) {
      Collect();
      if (loading.at(seq).remaining == 0) return;
      WaitAndCollect(std::chrono::milliseconds(50));
    }
  }

  void WaitOffload(BlockId block) {
    while (offloading[static_cast<size_t>(ToInt(block))] != 0) {
      if (!Collect()) WaitAndCollect(std::chrono::milliseconds(50));
    }
  }

  void RecordLookup(const WindowEntry& w) {
    ++stats.lookups;
    stats.requested_tokens += w.requested_tokens;
    stats.hit_tokens += w.hit_tokens;
    stats.requested_blocks += w.requested_blocks;
    stats.hit_blocks += w.hit_blocks;
    window.push_back(w);
    auto add = [](WindowEntry& sum, const WindowEntry& x, int64_t sign) {
      sum.requested_tokens += sign * x.requested_tokens;
      sum.hit_tokens += sign * x.hit_tokens;
      sum.requested_blocks += sign * x.requested_blocks;
      sum.hit_blocks += sign * x.hit_blocks;
    };
    add(window_sum, w, 1);
    if (static_cast<int64_t>(window.size()) > options.stats_window) {
      add(window_sum, window.front(), -1);
      window.pop_front();
    }
  }

  // Publishes a block loaded from a lower tier as block i of its sequence.
  void PublishLoaded(BlockId block, Entry e, size_t i, Tier from) {
    KvEvent ev;
    ev.type = KvEvent::Type::kBlockStored;
    ev.group = e.group;
    ev.window = cache->layout().group_window(e.group);
    ev.keys.push_back(e.key);
    ev.parent = e.parent;
    ev.token_ids = e.tokens;
    ev.block_len = block_len;
    ev.adapter_id = e.extra.adapter_id;
    ev.extra_keys = prefix::EventExtraKeys(e.extra, i == 0);
    Insert(block, std::move(e));
    Emit(std::move(ev));
    stats.tier_hit_blocks[static_cast<size_t>(from)] += 1;
  }

  // What the lower tiers store entry e under (BlockMeta::group: group g >
  // 0 under keys derived from the chain's and g).
  BlockMeta MetaOf(const Entry& e) const {
    BlockMeta m{e.key,    e.parent,           e.tokens,
                geometry, e.digest,           e.extra.adapter_id,
                prefix::EventExtraKeys(e.extra, !e.parent.has_value()), e.group};
    if (e.group != 0) {
      m.key = TierKey(e.key, e.group);
      if (m.parent) m.parent = TierKey(*m.parent, e.group);
      prefix::EncodeGroupKey(e.digest, e.group, scratch);
      m.digest = prefix::Sha256Key(scratch);
    }
    return m;
  }

  BlockKey TierKey(const BlockKey& key, int32_t group) const {
    if (group == 0) return key;
    prefix::EncodeGroupKey(key, group, scratch);
    return hash(scratch);
  }

  // Publishes `block` under entry e (the index, the pool's cached mark).
  void Insert(BlockId block, Entry e) {
    IndexOf(e.group).emplace(e.key, block);
    entries[static_cast<size_t>(ToInt(block))] = std::move(e);
    PAGEKV_CHECK(cache->SetBlockCached(block, true).ok());
    ++stats.inserted;
  }

  BlockKey KeyOf(const BlockKey* parent, std::span<const int32_t> tokens, const ExtraKeys& extra) const {
    prefix::EncodeBlock(parent, tokens, extra, scratch);
    return hash(scratch);
  }

  Link LinkOf(const Link* parent, std::span<const int32_t> tokens, const ExtraKeys& extra) const {
    Link l;
    l.key = KeyOf(parent != nullptr ? &parent->key : nullptr, tokens, extra);
    if (sha256_keys) {
      l.digest = l.key;
    } else {
      prefix::EncodeBlock(parent != nullptr ? &parent->digest : nullptr, tokens, extra, scratch);
      l.digest = prefix::Sha256Key(scratch);
    }
    return l;
  }

  // Whether entry e is block `l` of a request: the same whole prefix (the
  // digest), and, checked directly, the same tokens, parent and extra keys.
  static bool Matches(const Entry& e, const Link& l, const Link* parent, std::span<const int32_t> tokens,
                      const ExtraKeys& extra) {
    return e.digest == l.digest && std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end()) &&
           e.parent.has_value() == (parent != nullptr) && (parent == nullptr || *e.parent == parent->key) &&
           prefix::SameExtra(e.extra, extra, parent == nullptr);
  }

  // A hybrid cache's lookup: the longest N (whole blocks) for which every
  // full group holds blocks [0, N) and every sliding group of window W the
  // blocks covering [N - W + 1, N), all verified; also the matched links.
  // With lower tiers (and use_tiers), a block the pool lacks may come from
  // a tier (PrefixMatch::group_loads).
  PrefixMatch WalkGroups(std::span<const int32_t> tokens, const ExtraKeys& extra, int64_t max_tokens,
                         std::vector<Link>& links, bool use_tiers = true,
                         const std::vector<std::pair<int32_t, int64_t>>* exclude = nullptr);
  // AddSequence for a hybrid hit with blocks to load (match.group_loads).
  Result<Admitted> AdmitGroups(std::span<const int32_t> tokens, const ExtraKeys& extra, std::string label,
                               int64_t max_tokens, bool background_loads, PrefixMatch match, std::vector<Link> links);
  // Cuts a hybrid sequence back to the longest hit of at most `blocks`
  // blocks it can continue from (every sliding window still held); returns
  // its length in blocks.
  int64_t CutBack(SeqId seq, int64_t blocks) {
    for (int64_t n = blocks; n > 0; --n) {
      if (cache->Truncate(seq, n * block_len).ok()) return n;
    }
    PAGEKV_CHECK(cache->Truncate(seq, 0).ok());
    return 0;
  }
  // Lookup, also returning every matched block's link.
  PrefixMatch Walk(std::span<const int32_t> tokens, const ExtraKeys& extra, int64_t max_tokens,
                   std::vector<Link>& links);

  // Entry i of a request's chain, and a fresh pool block for it at the end
  // of `seq`; nullopt when the pool has none (or, which cannot happen
  // between Walk and here, the key is already published).
  std::optional<Entry> ReserveFor(SeqId seq, std::span<const int32_t> tokens, size_t i, const std::vector<Link>& links,
                                  const ExtraKeys& extra) {
    Entry e = EntryOf(tokens, i, links, extra);
    if (index.count(e.key) > 0) return std::nullopt;
    Result<bool> room = cache->Reserve(seq, block_len);
    if (!room.ok() || !*room) return std::nullopt;
    return e;
  }

  // Entry for block i of `tokens` after links[0, i].
  Entry EntryOf(std::span<const int32_t> tokens, size_t i, const std::vector<Link>& links, const ExtraKeys& extra) const {
    Entry e;
    e.key = links[i].key;
    e.digest = links[i].digest;
    if (i > 0) e.parent = links[i - 1].key;
    const auto t = tokens.subspan(i * static_cast<size_t>(block_len), static_cast<size_t>(block_len));
    e.tokens.assign(t.begin(), t.end());
    e.extra = extra;
    if (i > 0) e.extra.cache_salt.reset();
    return e;
  }

  void Emit(KvEvent e) {
    if (!options.record_events) return;
    PullTierChanges();  // what the tiers did before this event comes before it
    Queue(std::move(e));
  }

  void Queue(KvEvent e) {
    e.sequence = next_event++;
    if (static_cast<int64_t>(events.size()) >= options.max_queued_events) {
      events.pop_front();
      ++dropped_events;
    }
    events.push_back(std::move(e));
  }

  // The tiers' own changes (stored into RAM on eviction, written through to
  // disk and Redis, dropped for room or as corrupt) as events of their medium.
  void PullTierChanges() {
    if (options.tiers == nullptr || !options.record_events) return;
    for (TierChange& c : options.tiers->TakeChanges()) {
      KvEvent ev;
      ev.keys.push_back(c.meta.key);
      ev.tier = TierName(c.tier);
      if (c.meta.group > 0 && c.meta.group < cache->layout().num_groups()) {
        ev.group = c.meta.group;  // a removal from disk or Redis knows only the key it stored
        ev.window = cache->layout().group_window(c.meta.group);
      }
      if (c.kind == TierChange::Kind::kStored) {
        ev.type = KvEvent::Type::kBlockStored;
        ev.parent = c.meta.parent;
        ev.token_ids = std::move(c.meta.tokens);
        ev.block_len = block_len;
        ev.adapter_id = c.meta.adapter_id;
        ev.extra_keys = std::move(c.meta.event_extra_keys);
      } else {
        ev.type = KvEvent::Type::kBlockRemoved;
      }
      Queue(std::move(ev));
    }
  }

  // KvCache's cut listener: the chain keeps the full blocks whose rows are
  // unchanged; a freed sequence's chain goes.
  void OnCut(const KvCache::SequenceCut& cut) {
    auto it = chains.find(ToInt(cut.id));
    if (it == chains.end()) return;
    if (cut.kind == KvCache::SequenceCut::Kind::kFreed) {
      chains.erase(it);
      return;
    }
    const auto keep = static_cast<size_t>(cut.kept_tokens / block_len);
    if (it->second.links.size() > keep) it->second.links.resize(keep);
    if (cut.kind == KvCache::SequenceCut::Kind::kCompacted) it->second.stopped = true;
  }

  void OnEvict(BlockId block) {
    std::optional<Entry>& e = entries[static_cast<size_t>(ToInt(block))];
    if (!e) return;
    if (options.tiers != nullptr) {
      if (offloading[static_cast<size_t>(ToInt(block))] != 0) {
        ++stats.eviction_waits;  // its copy is being made: the caller may write it only after
        WaitOffload(block);
      }
      if (e->below && options.tiers->StillHolds(TierKey(e->key, e->group), *e->below)) {
        ++stats.evictions_precopied;
      } else if (cache->ReadBlock(block, block_bytes).ok()) {
        // Its bytes are intact until the caller writes it. Where the copy
        // lands is announced by the tier itself (TakeChanges).
        ++stats.evictions_copied;
        options.tiers->Evicted(MetaOf(*e), block_bytes);
      }
    }
    IndexOf(e->group).erase(e->key);
    KvEvent ev;
    ev.type = KvEvent::Type::kBlockRemoved;
    ev.keys.push_back(e->key);
    ev.group = e->group;
    Emit(std::move(ev));
    e.reset();
    ++stats.evicted;
  }
};

}  // namespace pagekv
