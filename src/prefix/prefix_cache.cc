// PrefixCache (include/pagekv/prefix_cache.h): a key index over blocks of a
// KvCache's pool, per-sequence key chains, statistics and the event queue.
#include "pagekv/prefix_cache.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "base/check.h"
#include "prefix/block_hasher.h"

namespace pagekv {

const char* TierName(Tier t) {
  switch (t) {
    case Tier::kPool: return "pool";
    case Tier::kHost: return "host";
    case Tier::kDisk: return "disk";
    case Tier::kRedis: return "redis";
  }
  return "pool";
}

std::string BlockKey::Hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < size; ++i) {
    out.push_back(kDigits[bytes[i] >> 4]);
    out.push_back(kDigits[bytes[i] & 15]);
  }
  return out;
}

namespace {

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
};

bool SameExtra(const ExtraKeys& a, const ExtraKeys& b, bool first) {
  return (!first || a.cache_salt == b.cache_salt) && a.adapter_id == b.adapter_id &&
         a.model_fingerprint == b.model_fingerprint && a.extra == b.extra;
}

std::vector<std::string> EventExtraKeys(const ExtraKeys& e, bool first) {
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
  size_t first = 0;                          // block index of entries[0]
  std::vector<Entry> entries;                // to publish, in order, once loaded
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

}  // namespace

struct PrefixCache::State {
  KvCache* cache = nullptr;
  PrefixCacheOptions options;
  std::function<BlockKey(std::span<const uint8_t>)> hash;
  bool sha256_keys = false;  // keys are their own digests
  int32_t block_len = 0;
  std::unordered_map<BlockKey, BlockId, KeyHash> index;
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
    ev.keys.push_back(e.key);
    ev.parent = e.parent;
    ev.token_ids = e.tokens;
    ev.block_len = block_len;
    ev.adapter_id = e.extra.adapter_id;
    ev.extra_keys = EventExtraKeys(e.extra, i == 0);
    Insert(block, std::move(e));
    Emit(std::move(ev));
    stats.tier_hit_blocks[static_cast<size_t>(from)] += 1;
  }

  BlockMeta MetaOf(const Entry& e) const {
    return BlockMeta{e.key,    e.parent,           e.tokens,
                     geometry, e.digest,           e.extra.adapter_id,
                     EventExtraKeys(e.extra, !e.parent.has_value())};
  }

  // Publishes `block` under entry e (the index, the pool's cached mark).
  void Insert(BlockId block, Entry e) {
    index.emplace(e.key, block);
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
           SameExtra(e.extra, extra, parent == nullptr);
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
      if (e->below && options.tiers->StillHolds(e->key, *e->below)) {
        ++stats.evictions_precopied;
      } else if (cache->ReadBlock(block, block_bytes).ok()) {
        // Its bytes are intact until the caller writes it. Where the copy
        // lands is announced by the tier itself (TakeChanges).
        ++stats.evictions_copied;
        options.tiers->Evicted(MetaOf(*e), block_bytes);
      }
    }
    index.erase(e->key);
    KvEvent ev;
    ev.type = KvEvent::Type::kBlockRemoved;
    ev.keys.push_back(e->key);
    Emit(std::move(ev));
    e.reset();
    ++stats.evicted;
  }
};

PrefixCache::PrefixCache(std::unique_ptr<State> state) : state_(std::move(state)) {}

PrefixCache::~PrefixCache() {
  // The tiers' threads call back into this state: let every move finish.
  for (auto& [seq, l] : state_->loading) state_->WaitLoads(seq);
  while (state_->offloads_in_flight > 0) state_->WaitAndCollect(std::chrono::milliseconds(50));
  state_->cache->SetEvictionListener(nullptr);
  state_->cache->SetCutListener(nullptr);
  if (state_->options.tiers != nullptr) state_->options.tiers->RecordChanges(false);
  for (size_t b = 0; b < state_->entries.size(); ++b) {
    if (state_->entries[b]) state_->cache->SetBlockCached(BlockId{static_cast<int32_t>(b)}, false).IgnoreError();
  }
}

Result<std::unique_ptr<PrefixCache>> PrefixCache::Create(KvCache& cache, const PrefixCacheOptions& options) {
  if (options.stats_window < 1) return InvalidArgumentError("prefix cache: stats_window must be at least 1");
  if (options.max_queued_events < 1) return InvalidArgumentError("prefix cache: max_queued_events must be at least 1");
  auto state = std::make_unique<State>();
  state->cache = &cache;
  state->options = options;
  state->hash = prefix::MakeHasher(options.hasher);
  state->sha256_keys = !options.hasher.custom && options.hasher.kind == BlockHashKind::kSha256;
  state->block_len = cache.layout().block_len();
  state->entries.resize(static_cast<size_t>(cache.layout().num_blocks()));
  state->geometry = cache.GeometryTag();
  if (options.tiers != nullptr) state->block_bytes.resize(static_cast<size_t>(cache.block_payload_bytes()));
  state->offloading.resize(static_cast<size_t>(cache.layout().num_blocks()));
  State* raw = state.get();
  cache.SetEvictionListener([raw](BlockId b) { raw->OnEvict(b); });
  cache.SetCutListener([raw](const KvCache::SequenceCut& cut) { raw->OnCut(cut); });
  if (options.tiers != nullptr) options.tiers->RecordChanges(options.record_events);
  return std::unique_ptr<PrefixCache>(new PrefixCache(std::move(state)));
}

Status PrefixCache::ValidateExtraKeys(const ExtraKeys& e) {
  if (e.cache_salt.has_value() && e.cache_salt->empty()) {
    return InvalidArgumentError("cache salt is empty: leave it unset for no salt, or give 1 to 256 bytes");
  }
  if (e.cache_salt.has_value() && e.cache_salt->size() > 256) {
    return InvalidArgumentError("cache salt has " + std::to_string(e.cache_salt->size()) +
                                " bytes; the limit is 256 (hash a longer identity first)");
  }
  if (e.model_fingerprint.size() > 256) {
    return InvalidArgumentError("model fingerprint has " + std::to_string(e.model_fingerprint.size()) +
                                " bytes; the limit is 256");
  }
  if (e.extra.size() > 16) {
    return InvalidArgumentError(std::to_string(e.extra.size()) + " extra keys; the limit is 16");
  }
  for (const std::string& x : e.extra) {
    if (x.size() > 1024) {
      return InvalidArgumentError("an extra key has " + std::to_string(x.size()) + " bytes; the limit is 1024");
    }
  }
  return Status::Ok();
}

Result<std::vector<BlockKey>> PrefixCache::Keys(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                                int64_t max_blocks) const {
  PAGEKV_RETURN_IF_ERROR(ValidateExtraKeys(extra));
  const int64_t bl = state_->block_len;
  int64_t n = static_cast<int64_t>(tokens.size()) / bl;
  if (max_blocks >= 0) n = std::min(n, max_blocks);
  std::vector<BlockKey> keys;
  keys.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    keys.push_back(state_->KeyOf(i == 0 ? nullptr : &keys.back(), tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl)), extra));
  }
  return keys;
}

PrefixMatch PrefixCache::State::Walk(std::span<const int32_t> tokens, const ExtraKeys& extra, int64_t max_tokens,
                                     std::vector<Link>& links) {
  const int64_t bl = block_len;
  const auto len = static_cast<int64_t>(tokens.size());
  const int64_t limit = max_tokens < 0 ? std::max<int64_t>(0, len - 1) : std::min(max_tokens, len);
  const int64_t max_blocks = limit / bl;
  auto block = [&](int64_t i) { return tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl)); };
  PrefixMatch m;
  links.clear();
  bool collided = false;
  for (int64_t i = 0; i < max_blocks; ++i) {
    const Link* parent = links.empty() ? nullptr : &links.back();
    const Link link = LinkOf(parent, block(i), extra);
    auto it = index.find(link.key);
    if (it == index.end()) break;
    if (!Matches(*entries[static_cast<size_t>(ToInt(it->second))], link, parent, block(i), extra)) {
      ++stats.collisions;  // counted even by an Ask: it is a fact about the index
      collided = true;
      break;
    }
    m.blocks.push_back(it->second);
    links.push_back(link);
  }
  if (options.tiers != nullptr && !collided && static_cast<int64_t>(m.blocks.size()) < max_blocks) {
    // The pool's part ended on a miss: the prefix may go on in the lower
    // tiers. Keys are made and asked for a chunk at a time, so a long
    // prompt whose chain ends early costs a few keys, not all of them.
    constexpr int64_t kChunk = 16;
    for (auto i = static_cast<int64_t>(m.blocks.size()); i < max_blocks;) {
      std::vector<Link> chunk;
      std::vector<BlockKey> keys;
      for (; i < max_blocks && static_cast<int64_t>(chunk.size()) < kChunk; ++i) {
        const Link* parent = chunk.empty() ? (links.empty() ? nullptr : &links.back()) : &chunk.back();
        chunk.push_back(LinkOf(parent, block(i), extra));
        keys.push_back(chunk.back().key);
      }
      const std::vector<Tier> found = options.tiers->LocatePrefix(keys);
      m.lower.insert(m.lower.end(), found.begin(), found.end());
      links.insert(links.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(found.size()));
      if (found.size() < chunk.size()) break;
    }
  }
  for (const Link& l : links) m.keys.push_back(l.key);
  m.num_tokens = static_cast<int64_t>(m.blocks.size() + m.lower.size()) * bl;
  return m;
}

Result<PrefixMatch> PrefixCache::Lookup(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                        int64_t max_tokens) const {
  PAGEKV_RETURN_IF_ERROR(ValidateExtraKeys(extra));
  std::vector<Link> links;
  return state_->Walk(tokens, extra, max_tokens, links);
}

void PrefixCache::Prefetch(std::span<const int32_t> tokens, const ExtraKeys& extra) {
  if (state_->options.tiers == nullptr || !ValidateExtraKeys(extra).ok()) return;
  std::vector<Link> links;
  const PrefixMatch m = state_->Walk(tokens, extra, -1, links);
  std::vector<BlockMeta> metas;
  for (size_t j = 0; j < m.lower.size(); ++j) {
    if (m.lower[j] == Tier::kHost) continue;  // already in memory
    metas.push_back(state_->MetaOf(state_->EntryOf(tokens, m.blocks.size() + j, links, extra)));
  }
  if (!metas.empty()) state_->options.tiers->Prefetch(std::move(metas));
}

bool PrefixCache::CanAdmit(const PrefixMatch& match, int64_t new_tokens) const {
  int64_t claimed_free = 0;
  for (BlockId b : match.blocks) claimed_free += state_->cache->BlockRefCount(b) == 0 ? 1 : 0;
  const int64_t bl = state_->block_len;
  const int64_t need = (match.num_tokens + new_tokens + bl - 1) / bl - static_cast<int64_t>(match.blocks.size());
  return state_->cache->FreeBlockCount() - claimed_free >= need;
}

Result<PrefixCache::Admitted> PrefixCache::AddSequence(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                                       std::string label, int64_t max_tokens, bool background_loads) {
  PAGEKV_RETURN_IF_ERROR(ValidateExtraKeys(extra));
  std::vector<Link> links;
  PrefixMatch match = state_->Walk(tokens, extra, max_tokens, links);
  PAGEKV_ASSIGN_OR_RETURN(SeqId seq, state_->cache->AddSequenceSharing(match.blocks, std::move(label)));
  const size_t in_pool = match.blocks.size();
  PrefixCacheStats& st = state_->stats;
  st.tier_hit_blocks[0] += static_cast<int64_t>(in_pool);
  const int64_t bl = state_->block_len;
  int64_t loading_blocks = 0;
  if (!match.lower.empty() && background_loads) {
    // Pool blocks for the lower tiers' part now, their bytes from the tiers'
    // threads; TakeLoaded publishes them once every load has answered.
    Loading l;
    l.first = in_pool;
    l.requested_tokens = static_cast<int64_t>(tokens.size());
    std::vector<TierLoadJob> jobs;
    for (size_t j = 0; j < match.lower.size(); ++j) {
      const size_t i = in_pool + j;
      std::optional<Entry> reserved = state_->ReserveFor(seq, tokens, i, links, extra);
      if (!reserved) break;
      Entry e = std::move(*reserved);
      const BlockId block = (*state_->cache->View(seq)).blocks[i];
      TierLoadJob job;
      job.meta = state_->MetaOf(e);
      KvCache* cache = state_->cache;
      job.store = [cache, block](std::span<const std::byte> kv) { PAGEKV_CHECK(cache->FillBlock(block, kv).ok()); };
      State* raw = state_.get();
      const int64_t id = ToInt(seq);
      job.done = [raw, id, j](std::optional<Tier> from) {
        // Notified under the lock: once the owner sees the report, this
        // thread no longer touches the state (which may then go).
        std::lock_guard lock(raw->done_mu);
        raw->loads_done.push_back({id, j, from});
        raw->done_cv.notify_all();
      };
      jobs.push_back(std::move(job));
      l.entries.push_back(std::move(e));
    }
    links.resize(in_pool);
    match.keys.resize(in_pool);
    match.lower.clear();
    match.num_tokens = static_cast<int64_t>(in_pool) * bl;
    if (!jobs.empty()) {
      loading_blocks = static_cast<int64_t>(jobs.size());
      l.results.resize(jobs.size());
      l.remaining = jobs.size();
      state_->loading.emplace(ToInt(seq), std::move(l));
      st.background_loads += loading_blocks;
      state_->options.tiers->StartLoads(std::move(jobs));
    }
  } else if (!match.lower.empty()) {
    // Load the lower tiers' part into new pool blocks, in order, and publish
    // each; the first block that cannot be had ends the match there. Every
    // load is checked against this request's key, digest, parent, tokens
    // and geometry, wherever its bytes come from.
    std::vector<Tier> loaded;
    for (size_t j = 0; j < match.lower.size(); ++j) {
      const size_t i = in_pool + j;
      std::optional<Entry> reserved = state_->ReserveFor(seq, tokens, i, links, extra);
      if (!reserved) break;
      Entry e = std::move(*reserved);
      const std::optional<Tier> from = state_->options.tiers->Load(state_->MetaOf(e), state_->block_bytes);
      if (!from || !state_->cache->WriteBlock(seq, static_cast<int64_t>(i), state_->block_bytes).ok()) {
        ++st.tier_load_failures;
        PAGEKV_CHECK(state_->cache->Truncate(seq, static_cast<int64_t>(i) * bl).ok());
        break;
      }
      state_->PublishLoaded((*state_->cache->View(seq)).blocks[i], std::move(e), i, *from);
      loaded.push_back(*from);
    }
    links.resize(in_pool + loaded.size());
    match.keys.resize(in_pool + loaded.size());
    match.lower = std::move(loaded);
    for (size_t j = 0; j < match.lower.size(); ++j) match.blocks.push_back((*state_->cache->View(seq)).blocks[in_pool + j]);
    match.num_tokens = static_cast<int64_t>(match.blocks.size()) * bl;
  }
  SeqChain chain;
  chain.extra = extra;
  chain.links = std::move(links);
  state_->chains.emplace(ToInt(seq), std::move(chain));
  // Statistics: a lookup of this prompt's tokens and full blocks (when the
  // loads finish, for a sequence still loading).
  if (loading_blocks == 0) {
    state_->RecordLookup({static_cast<int64_t>(tokens.size()), match.num_tokens,
                          static_cast<int64_t>(tokens.size()) / bl, static_cast<int64_t>(match.blocks.size())});
  }
  return Admitted{seq, std::move(match), loading_blocks};
}

std::vector<PrefixCache::Loaded> PrefixCache::TakeLoaded() {
  State& st = *state_;
  std::vector<Loaded> out;
  if (st.loading.empty()) return out;
  st.Collect();
  const int64_t bl = st.block_len;
  for (auto it = st.loading.begin(); it != st.loading.end();) {
    Loading& l = it->second;
    if (l.remaining > 0) {
      ++it;
      continue;
    }
    const SeqId seq{static_cast<int32_t>(it->first)};
    SeqChain& chain = st.chains.at(it->first);
    size_t ok = 0;
    for (; ok < l.entries.size() && l.results[ok].has_value(); ++ok) {
      const size_t i = l.first + ok;
      const BlockId block = (*st.cache->View(seq)).blocks[i];
      chain.links.push_back(Link{l.entries[ok].key, l.entries[ok].digest});
      if (st.index.count(l.entries[ok].key) > 0) {
        // Loaded twice (another sequence published the same block while
        // this one loaded): this copy stays private, the first stays cached.
        st.stats.tier_hit_blocks[static_cast<size_t>(*l.results[ok])] += 1;
        continue;
      }
      st.PublishLoaded(block, std::move(l.entries[ok]), i, *l.results[ok]);
    }
    if (ok < l.entries.size()) {
      ++st.stats.tier_load_failures;
      PAGEKV_CHECK(st.cache->Truncate(seq, static_cast<int64_t>(l.first + ok) * bl).ok());
    }
    const int64_t num_tokens = static_cast<int64_t>(l.first + ok) * bl;
    st.RecordLookup({l.requested_tokens, num_tokens, l.requested_tokens / bl, static_cast<int64_t>(l.first + ok)});
    out.push_back({seq, num_tokens});
    it = st.loading.erase(it);
  }
  return out;
}

int64_t PrefixCache::loading() const { return static_cast<int64_t>(state_->loading.size()); }

void PrefixCache::WaitForBackground(std::chrono::milliseconds timeout) { state_->WaitAndCollect(timeout); }

int64_t PrefixCache::OffloadAhead(int64_t skip, int64_t count) {
  State& st = *state_;
  if (st.options.tiers == nullptr || count <= 0) return 0;
  st.Collect();
  std::vector<TierOffloadJob> jobs;
  for (BlockId block : st.cache->CachedEvictionOrder(skip, count)) {
    const auto b = static_cast<size_t>(ToInt(block));
    std::optional<Entry>& e = st.entries[b];
    if (!e || e->below || st.offloading[b] != 0) continue;
    TierOffloadJob job;
    job.meta = st.MetaOf(*e);
    const KvCache* cache = st.cache;
    job.read = [cache, block](std::span<std::byte> kv) { PAGEKV_CHECK(cache->ReadBlock(block, kv).ok()); };
    State* raw = &st;
    job.done = [raw, block](std::optional<Tier> to) {
      std::lock_guard lock(raw->done_mu);  // notified under the lock, as for loads
      raw->offloads_done.push_back({ToInt(block), to});
      raw->done_cv.notify_all();
    };
    st.offloading[b] = 1;
    ++st.offloads_in_flight;
    jobs.push_back(std::move(job));
  }
  const auto started = static_cast<int64_t>(jobs.size());
  st.stats.offloads_ahead += started;
  if (!jobs.empty()) st.options.tiers->StartOffloads(std::move(jobs));
  return started;
}

Status PrefixCache::Publish(SeqId seq, std::span<const int32_t> tokens) {
  auto it = state_->chains.find(ToInt(seq));
  if (it == state_->chains.end()) {
    return NotFoundError("publish: sequence " + std::to_string(ToInt(seq)) +
                         " was not added through the prefix cache (or was freed)");
  }
  SeqChain& chain = it->second;
  PAGEKV_ASSIGN_OR_RETURN(SequenceView view, state_->cache->View(seq));
  if (static_cast<int64_t>(tokens.size()) < view.num_tokens) {
    return InvalidArgumentError("publish: " + std::to_string(tokens.size()) + " token ids for a sequence of " +
                                std::to_string(view.num_tokens) + " cached tokens");
  }
  if (chain.stopped) return Status::Ok();
  const int64_t bl = state_->block_len;
  const int64_t full = view.num_tokens / bl;
  // The cut listener keeps the chain within the sequence's unchanged full
  // blocks; a chain longer than the sequence means someone else took the
  // listener, and nothing published from it could be trusted.
  if (static_cast<int64_t>(chain.links.size()) > full) {
    chain.stopped = true;
    return FailedPreconditionError("publish: sequence " + std::to_string(ToInt(seq)) + " holds " +
                                   std::to_string(full) + " full blocks but its key chain " +
                                   std::to_string(chain.links.size()) +
                                   "; the KvCache's cut listener was replaced, so nothing more is published for it");
  }
  std::vector<BlockKey> stored;
  std::vector<int32_t> stored_tokens;
  std::optional<BlockKey> stored_parent;
  auto flush = [&] {
    if (stored.empty()) return;
    KvEvent ev;
    ev.type = KvEvent::Type::kBlockStored;
    ev.keys = std::move(stored);
    ev.parent = stored_parent;
    ev.token_ids = std::move(stored_tokens);
    ev.block_len = bl;
    ev.adapter_id = chain.extra.adapter_id;
    ev.extra_keys = EventExtraKeys(chain.extra, !stored_parent.has_value());
    state_->Emit(std::move(ev));
    stored.clear();
    stored_tokens.clear();
  };
  for (auto i = static_cast<int64_t>(chain.links.size()); i < full; ++i) {
    const auto block_tokens = tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl));
    const Link* parent = i == 0 ? nullptr : &chain.links.back();
    const Link link = state_->LinkOf(parent, block_tokens, chain.extra);
    const BlockId block = view.blocks[static_cast<size_t>(i)];
    auto found = state_->index.find(link.key);
    if (found != state_->index.end()) {
      if (!State::Matches(*state_->entries[static_cast<size_t>(ToInt(found->second))], link, parent, block_tokens,
                          chain.extra)) {
        // Same key, another prefix: nothing after this block can be
        // published under a chain the index already gives to another one.
        ++state_->stats.collisions;
        chain.stopped = true;
        break;
      }
      // Computed twice (no hit at admission): the first copy stays the cached one.
      flush();
      chain.links.push_back(link);
      continue;
    }
    if (state_->entries[static_cast<size_t>(ToInt(block))].has_value()) {
      // The block already holds another key (shared through a fork of a
      // published chain under other extra keys): leave it.
      flush();
      chain.links.push_back(link);
      continue;
    }
    if (stored.empty()) stored_parent = parent != nullptr ? std::optional<BlockKey>(parent->key) : std::nullopt;
    chain.links.push_back(link);  // `parent` is not used past here
    Entry e = state_->EntryOf(tokens, static_cast<size_t>(i), chain.links, chain.extra);
    LowerTiers* tiers = state_->options.tiers;
    if (tiers != nullptr && tiers->write_through() && state_->cache->ReadBlock(block, state_->block_bytes).ok()) {
      tiers->Published(state_->MetaOf(e), state_->block_bytes);
    }
    state_->Insert(block, std::move(e));
    stored.push_back(link.key);
    stored_tokens.insert(stored_tokens.end(), block_tokens.begin(), block_tokens.end());
  }
  flush();
  return Status::Ok();
}

Result<SeqId> PrefixCache::Fork(SeqId seq, std::string label) {
  auto it = state_->chains.find(ToInt(seq));
  if (it == state_->chains.end()) {
    return NotFoundError("fork: sequence " + std::to_string(ToInt(seq)) +
                         " was not added through the prefix cache (or was freed)");
  }
  PAGEKV_ASSIGN_OR_RETURN(SeqId child, state_->cache->Fork(seq, std::move(label)));
  SeqChain copy = it->second;  // `it` may not survive the emplace
  state_->chains.emplace(ToInt(child), std::move(copy));
  return child;
}

Status PrefixCache::Free(SeqId seq) {
  if (auto it = state_->loading.find(ToInt(seq)); it != state_->loading.end()) {
    state_->WaitLoads(ToInt(seq));  // the workers write its blocks until then
    state_->loading.erase(it);
  }
  PAGEKV_RETURN_IF_ERROR(state_->cache->Free(seq));
  state_->chains.erase(ToInt(seq));
  return Status::Ok();
}

void PrefixCache::Clear() {
  // Unpublished blocks may be reused at once: no offload may still read one.
  while (state_->offloads_in_flight > 0) state_->WaitAndCollect(std::chrono::milliseconds(50));
  for (size_t b = 0; b < state_->entries.size(); ++b) {
    if (!state_->entries[b]) continue;
    PAGEKV_CHECK(state_->cache->SetBlockCached(BlockId{static_cast<int32_t>(b)}, false).ok());
    state_->entries[b].reset();
  }
  state_->index.clear();
  for (auto& [id, chain] : state_->chains) chain.stopped = true;  // their blocks are no longer published
  KvEvent ev;
  ev.type = KvEvent::Type::kAllBlocksCleared;
  state_->Emit(std::move(ev));
}

PrefixCacheStats PrefixCache::Stats() const {
  PrefixCacheStats st = state_->stats;
  st.cached_blocks = static_cast<int64_t>(state_->index.size());
  auto rate = [](int64_t hit, int64_t total) { return total > 0 ? static_cast<double>(hit) / static_cast<double>(total) : 0.0; };
  st.token_hit_rate = rate(st.hit_tokens, st.requested_tokens);
  st.block_hit_rate = rate(st.hit_blocks, st.requested_blocks);
  st.recent_token_hit_rate = rate(state_->window_sum.hit_tokens, state_->window_sum.requested_tokens);
  st.recent_block_hit_rate = rate(state_->window_sum.hit_blocks, state_->window_sum.requested_blocks);
  return st;
}

std::vector<KvEvent> PrefixCache::DrainEvents() {
  state_->PullTierChanges();
  std::vector<KvEvent> out(std::make_move_iterator(state_->events.begin()), std::make_move_iterator(state_->events.end()));
  state_->events.clear();
  return out;
}

int64_t PrefixCache::dropped_events() const { return state_->dropped_events; }

std::optional<BlockId> PrefixCache::Find(const BlockKey& key) const {
  auto it = state_->index.find(key);
  if (it == state_->index.end()) return std::nullopt;
  return it->second;
}

void PrefixCache::CheckInvariants() const {
  size_t with_entry = 0;
  for (size_t b = 0; b < state_->entries.size(); ++b) {
    const BlockId id{static_cast<int32_t>(b)};
    const bool has = state_->entries[b].has_value();
    PAGEKV_CHECK_MSG(has == state_->cache->IsBlockCached(id), "a block's cached mark disagrees with the key index");
    PAGEKV_CHECK_MSG(has || state_->offloading[b] == 0, "an offload is in flight for a block that is not published");
    if (!has) continue;
    ++with_entry;
    auto it = state_->index.find(state_->entries[b]->key);
    PAGEKV_CHECK_MSG(it != state_->index.end() && it->second == id, "a published block is missing from the index");
  }
  PAGEKV_CHECK_MSG(with_entry == state_->index.size(), "the index holds keys of no block");
}

}  // namespace pagekv
