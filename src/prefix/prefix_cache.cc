// PrefixCache (include/pagekv/prefix_cache.h): a key index over blocks of a
// KvCache's pool, per-sequence key chains, statistics and the event queue.
#include "pagekv/prefix_cache.h"

#include <algorithm>
#include <cstring>
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

// What a published block holds besides its KV: enough to verify a hit
// without trusting the hash, and to describe it in events.
struct Entry {
  BlockKey key;
  std::optional<BlockKey> parent;
  std::vector<int32_t> tokens;
  ExtraKeys extra;  // salt kept only on a first block
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
  std::vector<BlockKey> keys;  // of the sequence's leading full blocks known so far
  bool stopped = false;        // a collision ended publishing for this sequence
};

struct WindowEntry {
  int64_t requested_tokens, hit_tokens, requested_blocks, hit_blocks;
};

}  // namespace

struct PrefixCache::State {
  KvCache* cache = nullptr;
  PrefixCacheOptions options;
  std::function<BlockKey(std::span<const uint8_t>)> hash;
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

  BlockMeta MetaOf(const Entry& e) const { return BlockMeta{e.key, e.parent, e.tokens, geometry}; }

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

  void Emit(KvEvent e) {
    if (!options.record_events) return;
    e.sequence = next_event++;
    if (static_cast<int64_t>(events.size()) >= options.max_queued_events) {
      events.pop_front();
      ++dropped_events;
    }
    events.push_back(std::move(e));
  }

  void OnEvict(BlockId block) {
    std::optional<Entry>& e = entries[static_cast<size_t>(ToInt(block))];
    if (!e) return;
    std::optional<Tier> down;
    if (options.tiers != nullptr && cache->ReadBlock(block, block_bytes).ok()) {
      down = options.tiers->Evicted(MetaOf(*e), block_bytes);  // its bytes are intact until the caller writes it
    }
    index.erase(e->key);
    KvEvent ev;
    ev.type = KvEvent::Type::kBlockRemoved;
    ev.keys.push_back(e->key);
    Emit(std::move(ev));
    if (down) {
      KvEvent st;
      st.type = KvEvent::Type::kBlockStored;
      st.keys.push_back(e->key);
      st.parent = e->parent;
      st.token_ids = e->tokens;
      st.block_len = block_len;
      st.adapter_id = e->extra.adapter_id;
      st.extra_keys = EventExtraKeys(e->extra, !e->parent.has_value());
      st.tier = TierName(*down);
      Emit(std::move(st));
    }
    e.reset();
    ++stats.evicted;
  }
};

PrefixCache::PrefixCache(std::unique_ptr<State> state) : state_(std::move(state)) {}

PrefixCache::~PrefixCache() {
  state_->cache->SetEvictionListener(nullptr);
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
  state->block_len = cache.layout().block_len();
  state->entries.resize(static_cast<size_t>(cache.layout().num_blocks()));
  state->geometry = cache.GeometryTag();
  if (options.tiers != nullptr) state->block_bytes.resize(static_cast<size_t>(cache.block_payload_bytes()));
  State* raw = state.get();
  cache.SetEvictionListener([raw](BlockId b) { raw->OnEvict(b); });
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

Result<PrefixMatch> PrefixCache::Lookup(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                        int64_t max_tokens) const {
  PAGEKV_RETURN_IF_ERROR(ValidateExtraKeys(extra));
  const int64_t bl = state_->block_len;
  const auto len = static_cast<int64_t>(tokens.size());
  const int64_t limit = max_tokens < 0 ? std::max<int64_t>(0, len - 1) : std::min(max_tokens, len);
  const int64_t max_blocks = limit / bl;
  PrefixMatch m;
  for (int64_t i = 0; i < max_blocks; ++i) {
    const auto block_tokens = tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl));
    const BlockKey* parent = i == 0 ? nullptr : &m.keys.back();
    const BlockKey key = state_->KeyOf(parent, block_tokens, extra);
    auto it = state_->index.find(key);
    if (it == state_->index.end()) break;
    const Entry& e = *state_->entries[static_cast<size_t>(ToInt(it->second))];
    const bool same = std::equal(e.tokens.begin(), e.tokens.end(), block_tokens.begin(), block_tokens.end()) &&
                      e.parent.has_value() == (parent != nullptr) && (parent == nullptr || *e.parent == *parent) &&
                      SameExtra(e.extra, extra, i == 0);
    if (!same) {
      ++state_->stats.collisions;  // counted even by an Ask: it is a fact about the index
      break;
    }
    m.blocks.push_back(it->second);
    m.keys.push_back(key);
  }
  if (state_->options.tiers != nullptr && static_cast<int64_t>(m.blocks.size()) < max_blocks &&
      state_->index.count(state_->KeyOf(m.keys.empty() ? nullptr : &m.keys.back(),
                                        tokens.subspan(m.blocks.size() * static_cast<size_t>(bl), static_cast<size_t>(bl)), extra)) == 0) {
    // The pool's part ended on a miss (not a collision): the prefix may go on
    // in the lower tiers. Keys are made and asked for a chunk at a time, so
    // a long prompt whose chain ends early costs a few keys, not all of them.
    constexpr int64_t kChunk = 16;
    for (auto i = static_cast<int64_t>(m.blocks.size()); i < max_blocks;) {
      std::vector<BlockKey> chunk;
      for (; i < max_blocks && static_cast<int64_t>(chunk.size()) < kChunk; ++i) {
        const BlockKey* parent = chunk.empty() ? (m.keys.empty() ? nullptr : &m.keys.back()) : &chunk.back();
        chunk.push_back(state_->KeyOf(parent, tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl)), extra));
      }
      const std::vector<Tier> found = state_->options.tiers->LocatePrefix(chunk);
      m.lower.insert(m.lower.end(), found.begin(), found.end());
      m.keys.insert(m.keys.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(found.size()));
      if (found.size() < chunk.size()) break;
    }
  }
  m.num_tokens = static_cast<int64_t>(m.blocks.size() + m.lower.size()) * bl;
  return m;
}

void PrefixCache::Prefetch(std::span<const int32_t> tokens, const ExtraKeys& extra) {
  if (state_->options.tiers == nullptr) return;
  Result<PrefixMatch> m = Lookup(tokens, extra);
  if (!m.ok() || m->lower.empty()) return;
  const int64_t bl = state_->block_len;
  std::vector<BlockMeta> metas;
  for (size_t j = 0; j < m->lower.size(); ++j) {
    if (m->lower[j] == Tier::kHost) continue;  // already in memory
    const size_t i = m->blocks.size() + j;
    BlockMeta meta;
    meta.key = m->keys[i];
    if (i > 0) meta.parent = m->keys[i - 1];
    const auto t = tokens.subspan(i * static_cast<size_t>(bl), static_cast<size_t>(bl));
    meta.tokens.assign(t.begin(), t.end());
    meta.geometry = state_->geometry;
    metas.push_back(std::move(meta));
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
                                                       std::string label, int64_t max_tokens) {
  PAGEKV_ASSIGN_OR_RETURN(PrefixMatch match, Lookup(tokens, extra, max_tokens));
  PAGEKV_ASSIGN_OR_RETURN(SeqId seq, state_->cache->AddSequenceSharing(match.blocks, std::move(label)));
  const size_t in_pool = match.blocks.size();
  PrefixCacheStats& st = state_->stats;
  st.tier_hit_blocks[0] += static_cast<int64_t>(in_pool);
  if (!match.lower.empty()) {
    // Load the lower tiers' part into new pool blocks, in order, and publish
    // each; the first block that cannot be had ends the match there.
    const int64_t bl = state_->block_len;
    std::vector<Tier> loaded;
    for (size_t j = 0; j < match.lower.size(); ++j) {
      const size_t i = in_pool + j;
      Entry e;
      e.key = match.keys[i];
      if (i > 0) e.parent = match.keys[i - 1];
      const auto t = tokens.subspan(i * static_cast<size_t>(bl), static_cast<size_t>(bl));
      e.tokens.assign(t.begin(), t.end());
      e.extra = extra;
      if (i > 0) e.extra.cache_salt.reset();
      if (state_->index.count(e.key) > 0) break;  // cannot happen between Lookup and here; stay safe
      Result<bool> room = state_->cache->Reserve(seq, bl);
      if (!room.ok() || !*room) break;
      const std::optional<Tier> from = state_->options.tiers->Load(state_->MetaOf(e), state_->block_bytes);
      if (!from || !state_->cache->WriteBlock(seq, static_cast<int64_t>(i), state_->block_bytes).ok()) {
        ++st.tier_load_failures;
        PAGEKV_CHECK(state_->cache->Truncate(seq, static_cast<int64_t>(i) * bl).ok());
        break;
      }
      const BlockId block = (*state_->cache->View(seq)).blocks[i];
      KvEvent ev;
      ev.type = KvEvent::Type::kBlockStored;
      ev.keys.push_back(e.key);
      ev.parent = e.parent;
      ev.token_ids = e.tokens;
      ev.block_len = static_cast<int32_t>(bl);
      ev.adapter_id = extra.adapter_id;
      ev.extra_keys = EventExtraKeys(extra, i == 0);
      state_->Insert(block, std::move(e));
      state_->Emit(std::move(ev));
      st.tier_hit_blocks[static_cast<size_t>(*from)] += 1;
      loaded.push_back(*from);
    }
    match.keys.resize(in_pool + loaded.size());
    match.lower = std::move(loaded);
    for (size_t j = 0; j < match.lower.size(); ++j) match.blocks.push_back((*state_->cache->View(seq)).blocks[in_pool + j]);
    match.num_tokens = static_cast<int64_t>(match.blocks.size()) * bl;
  }
  SeqChain chain;
  chain.extra = extra;
  chain.keys = match.keys;
  state_->chains.emplace(ToInt(seq), std::move(chain));
  // Statistics: a lookup of this prompt's tokens and full blocks.
  const WindowEntry w{static_cast<int64_t>(tokens.size()), match.num_tokens,
                      static_cast<int64_t>(tokens.size()) / state_->block_len, static_cast<int64_t>(match.blocks.size())};
  ++st.lookups;
  st.requested_tokens += w.requested_tokens;
  st.hit_tokens += w.hit_tokens;
  st.requested_blocks += w.requested_blocks;
  st.hit_blocks += w.hit_blocks;
  state_->window.push_back(w);
  auto add = [](WindowEntry& sum, const WindowEntry& x, int64_t sign) {
    sum.requested_tokens += sign * x.requested_tokens;
    sum.hit_tokens += sign * x.hit_tokens;
    sum.requested_blocks += sign * x.requested_blocks;
    sum.hit_blocks += sign * x.hit_blocks;
  };
  add(state_->window_sum, w, 1);
  if (static_cast<int64_t>(state_->window.size()) > state_->options.stats_window) {
    add(state_->window_sum, state_->window.front(), -1);
    state_->window.pop_front();
  }
  return Admitted{seq, std::move(match)};
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
  for (auto i = static_cast<int64_t>(chain.keys.size()); i < full; ++i) {
    const auto block_tokens = tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl));
    const BlockKey* parent = i == 0 ? nullptr : &chain.keys.back();
    const BlockKey key = state_->KeyOf(parent, block_tokens, chain.extra);
    const BlockId block = view.blocks[static_cast<size_t>(i)];
    auto found = state_->index.find(key);
    if (found != state_->index.end()) {
      const Entry& e = *state_->entries[static_cast<size_t>(ToInt(found->second))];
      if (!std::equal(e.tokens.begin(), e.tokens.end(), block_tokens.begin(), block_tokens.end())) {
        ++state_->stats.collisions;
        chain.stopped = true;
        break;
      }
      // Computed twice (no hit at admission): the first copy stays the cached one.
      flush();
      chain.keys.push_back(key);
      continue;
    }
    if (state_->entries[static_cast<size_t>(ToInt(block))].has_value()) {
      // The block already holds another key (shared through a fork of a
      // published chain under other extra keys): leave it.
      flush();
      chain.keys.push_back(key);
      continue;
    }
    Entry e;
    e.key = key;
    if (parent != nullptr) e.parent = *parent;
    e.tokens.assign(block_tokens.begin(), block_tokens.end());
    e.extra = chain.extra;
    if (i > 0) e.extra.cache_salt.reset();
    LowerTiers* tiers = state_->options.tiers;
    if (tiers != nullptr && tiers->write_through() && state_->cache->ReadBlock(block, state_->block_bytes).ok()) {
      tiers->Published(state_->MetaOf(e), state_->block_bytes);
    }
    state_->Insert(block, std::move(e));
    if (stored.empty()) stored_parent = parent != nullptr ? std::optional<BlockKey>(*parent) : std::nullopt;
    stored.push_back(key);
    stored_tokens.insert(stored_tokens.end(), block_tokens.begin(), block_tokens.end());
    chain.keys.push_back(key);
  }
  flush();
  return Status::Ok();
}

Status PrefixCache::Free(SeqId seq) {
  PAGEKV_RETURN_IF_ERROR(state_->cache->Free(seq));
  state_->chains.erase(ToInt(seq));
  return Status::Ok();
}

void PrefixCache::Clear() {
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
    if (!has) continue;
    ++with_entry;
    auto it = state_->index.find(state_->entries[b]->key);
    PAGEKV_CHECK_MSG(it != state_->index.end() && it->second == id, "a published block is missing from the index");
  }
  PAGEKV_CHECK_MSG(with_entry == state_->index.size(), "the index holds keys of no block");
}

}  // namespace pagekv
