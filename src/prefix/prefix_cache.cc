// PrefixCache (include/pagekv/prefix_cache.h): a key index over blocks of a
// KvCache's pool, per-sequence key chains, statistics and the event queue.
#include "pagekv/prefix_cache.h"

#include <algorithm>

#include "prefix/prefix_cache_state.h"

namespace pagekv {

using prefix::Entry;
using prefix::EventExtraKeys;
using prefix::Link;
using prefix::Loading;
using prefix::SeqChain;

const char* TierName(Tier t) {
  switch (t) {
    case Tier::kPool: return "pool";
    case Tier::kHost: return "host";
    case Tier::kDisk: return "disk";
    case Tier::kRedis: return "redis";
  }
  return "pool";
}

std::vector<BlockId> PrefixMatch::AllBlocks() const {
  if (group_blocks.empty()) return blocks;
  std::vector<BlockId> all;
  for (const std::vector<BlockId>& t : group_blocks) {
    for (BlockId b : t) {
      if (b != kNoBlock) all.push_back(b);
    }
  }
  return all;
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
  if (cache.HasCutListener()) {
    // A second one would take the first's listeners: its cached blocks
    // would then be reused with their keys still indexed (wrong KV).
    return FailedPreconditionError(
        "prefix cache: this KvCache already has a prefix cache bound to it (one per KvCache): share that "
        "one, or destroy it before making another");
  }
  auto state = std::make_unique<State>();
  state->cache = &cache;
  state->side_index.resize(static_cast<size_t>(cache.layout().num_groups() - 1));
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

Result<std::vector<BlockMeta>> PrefixCache::BlockMetas(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                                       int64_t max_blocks) const {
  PAGEKV_RETURN_IF_ERROR(ValidateExtraKeys(extra));
  const int64_t bl = state_->block_len;
  int64_t n = static_cast<int64_t>(tokens.size()) / bl;
  if (max_blocks >= 0) n = std::min(n, max_blocks);
  std::vector<BlockMeta> metas;
  metas.reserve(static_cast<size_t>(n));
  std::optional<Link> prev;
  for (int64_t i = 0; i < n; ++i) {
    Entry e;
    const Link l = state_->LinkOf(prev ? &*prev : nullptr, tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl)), extra);
    e.key = l.key;
    e.digest = l.digest;
    if (prev) e.parent = prev->key;
    e.tokens.assign(tokens.begin() + i * bl, tokens.begin() + (i + 1) * bl);
    e.extra = extra;
    metas.push_back(state_->MetaOf(e));
    prev = l;
  }
  return metas;
}

Result<std::vector<BlockKey>> PrefixCache::Keys(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                                int64_t max_blocks) const {
  PAGEKV_ASSIGN_OR_RETURN(std::vector<BlockMeta> metas, BlockMetas(tokens, extra, max_blocks));
  std::vector<BlockKey> keys;
  keys.reserve(metas.size());
  for (const BlockMeta& m : metas) keys.push_back(m.key);
  return keys;
}

PrefixMatch PrefixCache::State::WalkGroups(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                           int64_t max_tokens, std::vector<Link>& links, bool use_tiers,
                                           const std::vector<std::pair<int32_t, int64_t>>* exclude) {
  const KvLayout& layout = cache->layout();
  const int32_t groups = layout.num_groups();
  const int64_t bl = block_len;
  const auto len = static_cast<int64_t>(tokens.size());
  const int64_t limit = max_tokens < 0 ? std::max<int64_t>(0, len - 1) : std::min(max_tokens, len);
  const int64_t max_blocks = limit / bl;
  LowerTiers* tiers = use_tiers ? options.tiers : nullptr;
  auto block = [&](int64_t i) { return tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl)); };
  // Where each group's block of each prompt block is: a verified pool
  // block, a lower tier, nowhere, or not asked yet (a tier is asked only
  // where the pool misses).
  enum : int8_t { kUnknown, kNowhere, kInPool, kInTier };
  struct Place {
    int8_t at = kUnknown;
    BlockId block = kNoBlock;
    Tier tier = Tier::kPool;
  };
  std::vector<std::vector<Place>> place(static_cast<size_t>(groups));
  // Asks the tiers for group g's blocks at `positions` (ascending; each
  // missing from the pool): the answered prefix is there, the first after
  // it nowhere, the rest still unknown. True when all were found.
  auto ask_tiers = [&](int32_t g, const std::vector<int64_t>& positions) {
    if (positions.empty()) return true;
    std::vector<Place>& p = place[static_cast<size_t>(g)];
    if (tiers == nullptr) {
      p[static_cast<size_t>(positions[0])].at = kNowhere;
      return false;
    }
    std::vector<BlockKey> keys;
    for (int64_t i : positions) keys.push_back(TierKey(links[static_cast<size_t>(i)].key, g));
    const std::vector<Tier> found = tiers->LocatePrefix(keys);
    for (size_t k = 0; k < found.size(); ++k) {
      p[static_cast<size_t>(positions[k])].at = kInTier;
      p[static_cast<size_t>(positions[k])].tier = found[k];
    }
    if (found.size() < positions.size()) p[static_cast<size_t>(positions[found.size()])].at = kNowhere;
    return found.size() == positions.size();
  };
  // 1. The links and every group's pool blocks, as far as every full group
  // has its blocks (in the pool, or in a tier), a chunk at a time: a hit
  // needs a full group's every block. With no full group, all the way.
  links.clear();
  constexpr int64_t kChunk = 16;
  int64_t full_end = max_blocks;  // the full groups hold [0, full_end)
  for (int64_t from = 0; from < max_blocks && full_end == max_blocks; from += kChunk) {
    const int64_t to = std::min(max_blocks, from + kChunk);
    for (int64_t i = from; i < to; ++i) {
      const Link* parent = links.empty() ? nullptr : &links.back();
      const Link link = LinkOf(parent, block(i), extra);
      for (int32_t g = 0; g < groups; ++g) {
        Place p;
        auto& idx = IndexOf(g);
        if (auto it = idx.find(link.key); it != idx.end()) {
          if (Matches(*entries[static_cast<size_t>(ToInt(it->second))], link, parent, block(i), extra)) {
            p.at = kInPool;
            p.block = it->second;
          } else {
            ++stats.collisions;  // another prefix holds the key in this group: no load may publish under it
            p.at = kNowhere;
          }
        }
        if (p.at == kUnknown && exclude != nullptr &&
            std::find(exclude->begin(), exclude->end(), std::pair<int32_t, int64_t>(g, i)) != exclude->end()) {
          p.at = kNowhere;  // its load failed just now
        }
        place[static_cast<size_t>(g)].push_back(p);
      }
      links.push_back(link);
    }
    for (int32_t g = 0; g < groups; ++g) {
      if (layout.group_window(g) != 0) continue;
      std::vector<Place>& p = place[static_cast<size_t>(g)];
      std::vector<int64_t> missing;
      for (int64_t i = from; i < to; ++i) {
        if (p[static_cast<size_t>(i)].at == kNowhere) break;
        if (p[static_cast<size_t>(i)].at == kUnknown) missing.push_back(i);
      }
      ask_tiers(g, missing);
      for (int64_t i = from; i < to; ++i) {
        const int8_t at = p[static_cast<size_t>(i)].at;
        if (at != kInPool && at != kInTier) {
          full_end = std::min(full_end, i);
          break;
        }
      }
    }
  }
  // 2. The longest N <= full_end whose sliding windows are all there, from
  // the pool or a tier. A block found nowhere rules out every N whose window
  // holds it, so the search goes down past it at once.
  auto window_first = [&](int32_t g, int64_t n) {  // first block the query at n * bl reads
    const int32_t w = layout.group_window(g);
    return w == 0 ? 0 : std::max<int64_t>(0, n * bl - w + 1) / bl;
  };
  int64_t n = full_end;
  while (n > 0) {
    int64_t blocked = -1;  // the highest block found nowhere in some window of n
    for (int32_t g = 0; g < groups; ++g) {
      if (layout.group_window(g) == 0) continue;
      std::vector<Place>& p = place[static_cast<size_t>(g)];
      std::vector<int64_t> missing;
      for (int64_t j = window_first(g, n); j < n; ++j) {
        if (p[static_cast<size_t>(j)].at == kNowhere) blocked = std::max(blocked, j);
        if (p[static_cast<size_t>(j)].at == kUnknown) missing.push_back(j);
      }
      if (blocked >= 0 || ask_tiers(g, missing)) continue;  // asked only while n may still hold
      for (int64_t j : missing) {
        if (p[static_cast<size_t>(j)].at == kNowhere) {
          blocked = j;
          break;
        }
      }
    }
    if (blocked < 0) break;
    n = blocked;  // every N > blocked whose window reaches it fails too
  }
  PrefixMatch m;
  links.resize(static_cast<size_t>(n));
  for (int32_t g = 0; g < groups; ++g) {
    std::vector<BlockId> t(static_cast<size_t>(n), kNoBlock);
    for (int64_t j = window_first(g, n); j < n; ++j) t[static_cast<size_t>(j)] = place[static_cast<size_t>(g)][static_cast<size_t>(j)].block;
    m.group_blocks.push_back(std::move(t));
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int32_t g = 0; g < groups; ++g) {
      const Place& p = place[static_cast<size_t>(g)][static_cast<size_t>(j)];
      if (j < window_first(g, n) || p.at != kInTier) continue;
      m.group_loads.push_back({g, j, p.tier});
      m.lower.push_back(p.tier);
    }
  }
  m.blocks = m.group_blocks[0];
  for (const Link& l : links) m.keys.push_back(l.key);
  m.num_tokens = n * bl;
  return m;
}

PrefixMatch PrefixCache::State::Walk(std::span<const int32_t> tokens, const ExtraKeys& extra, int64_t max_tokens,
                                     std::vector<Link>& links) {
  if (cache->layout().hybrid()) return WalkGroups(tokens, extra, max_tokens, links);
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

bool PrefixCache::CanAdmit(const PrefixMatch& match, int64_t new_tokens) const {
  int64_t claimed_free = 0;
  const std::vector<BlockId> hit = match.AllBlocks();
  for (BlockId b : hit) claimed_free += state_->cache->BlockRefCount(b) == 0 ? 1 : 0;
  // Every group's blocks for the whole prompt in one step (a sliding
  // group's window of it), less those the hit gives.
  const int64_t need = std::max<int64_t>(0, state_->cache->layout().BlocksHeld(match.num_tokens + new_tokens, new_tokens) -
                                                static_cast<int64_t>(hit.size()));
  return state_->cache->FreeBlockCount() - claimed_free >= need;
}

Result<PrefixCache::Admitted> PrefixCache::AddSequence(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                                       std::string label, int64_t max_tokens, bool background_loads) {
  PAGEKV_RETURN_IF_ERROR(ValidateExtraKeys(extra));
  std::vector<Link> links;
  PrefixMatch match = state_->Walk(tokens, extra, max_tokens, links);
  if (!match.group_loads.empty()) {
    return state_->AdmitGroups(tokens, extra, std::move(label), max_tokens, background_loads, std::move(match),
                               std::move(links));
  }
  PAGEKV_ASSIGN_OR_RETURN(SeqId seq, match.group_blocks.empty()
                                         ? state_->cache->AddSequenceSharing(match.blocks, std::move(label))
                                         : state_->cache->AddSequenceSharingGroups(match.group_blocks, std::move(label)));
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

Result<PrefixCache::Admitted> PrefixCache::State::AdmitGroups(std::span<const int32_t> tokens, const ExtraKeys& extra,
                                                              std::string label, int64_t max_tokens,
                                                              bool background_loads, PrefixMatch match,
                                                              std::vector<Link> links) {
  // A load that fails (a block the tier lost or found corrupt) is excluded
  // and the hit looked up again: the blocks loaded so far are in the pool
  // by then. A few times at most; then the hit is cut back.
  std::vector<std::pair<int32_t, int64_t>> failed;
  for (int attempt = 0;; ++attempt) {
    // New pool blocks for the tier blocks, all at once with the shared ones.
    std::vector<std::vector<BlockId>> tables = match.group_blocks;
    for (const PrefixMatch::GroupLoad& l : match.group_loads) {
      tables[static_cast<size_t>(l.group)][static_cast<size_t>(l.index)] = KvCache::kNewBlock;
    }
    int64_t claimed_free = 0;
    for (BlockId b : match.AllBlocks()) claimed_free += cache->BlockRefCount(b) == 0 ? 1 : 0;
    if (cache->FreeBlockCount() - claimed_free < static_cast<int64_t>(match.group_loads.size())) {
      // No room to load into: the pool's part of the hit only.
      match = WalkGroups(tokens, extra, max_tokens, links, /*use_tiers=*/false);
      tables = match.group_blocks;
    }
    const std::vector<BlockId> hit = match.AllBlocks();
    PAGEKV_ASSIGN_OR_RETURN(SeqId seq, cache->AddSequenceSharingGroups(tables, label));
    const int64_t bl = block_len;
    const auto hit_blocks = static_cast<int64_t>(links.size());
    std::vector<Entry> loads;
    std::vector<BlockId> into;
    for (const PrefixMatch::GroupLoad& l : match.group_loads) {
      Entry e = EntryOf(tokens, static_cast<size_t>(l.index), links, extra);
      e.group = l.group;
      loads.push_back(std::move(e));
      into.push_back((*cache->View(seq, l.group)).blocks[static_cast<size_t>(l.index)]);
    }
    SeqChain chain;
    chain.extra = extra;
    chain.links = links;
    chains.emplace(ToInt(seq), std::move(chain));
    if (background_loads && !loads.empty()) {
      Loading l;
      l.groups = true;
      l.hit_blocks = hit_blocks;
      l.requested_tokens = static_cast<int64_t>(tokens.size());
      std::vector<TierLoadJob> jobs;
      for (size_t j = 0; j < loads.size(); ++j) {
        TierLoadJob job;
        job.meta = MetaOf(loads[j]);
        KvCache* c = cache;
        const BlockId block = into[j];
        job.store = [c, block](std::span<const std::byte> kv) { PAGEKV_CHECK(c->FillBlock(block, kv).ok()); };
        const int64_t id = ToInt(seq);
        job.done = [this, id, j](std::optional<Tier> from) {
          std::lock_guard lock(done_mu);  // notified under the lock, as for a uniform cache's loads
          loads_done.push_back({id, j, from});
          done_cv.notify_all();
        };
        jobs.push_back(std::move(job));
        l.positions.push_back(match.group_loads[j].index);
      }
      l.entries = std::move(loads);
      l.results.resize(jobs.size());
      l.remaining = jobs.size();
      const auto n = static_cast<int64_t>(jobs.size());
      loading.emplace(ToInt(seq), std::move(l));
      stats.tier_hit_blocks[0] += static_cast<int64_t>(hit.size());
      stats.background_loads += n;
      options.tiers->StartLoads(std::move(jobs));
      return Admitted{seq, PrefixMatch{}, n};
    }
    // Load in position order; a failure cuts the hit back to the longest one
    // the blocks before it allow (each loaded block is published either way:
    // its KV is right for its key).
    int64_t failed_at = hit_blocks;
    std::vector<PrefixMatch::GroupLoad> kept;
    for (size_t j = 0; j < loads.size(); ++j) {
      const PrefixMatch::GroupLoad& l = match.group_loads[j];
      if (l.index >= failed_at) break;
      const std::optional<Tier> from = options.tiers->Load(MetaOf(loads[j]), block_bytes);
      if (!from || !cache->FillBlock(into[j], block_bytes).ok()) {
        ++stats.tier_load_failures;
        failed_at = l.index;
        failed.emplace_back(l.group, l.index);
        continue;
      }
      PublishLoaded(into[j], std::move(loads[j]), static_cast<size_t>(l.index), *from);
      kept.push_back({l.group, l.index, *from});
    }
    if (failed_at < hit_blocks && attempt < 3) {
      PAGEKV_CHECK(cache->Free(seq).ok());  // its loaded blocks stay cached; the cut listener drops its chain
      match = WalkGroups(tokens, extra, max_tokens, links, /*use_tiers=*/true, &failed);
      continue;
    }
    stats.tier_hit_blocks[0] += static_cast<int64_t>(hit.size());
    int64_t n = hit_blocks;
    if (failed_at < hit_blocks) n = CutBack(seq, failed_at);  // the cut listener shortens the chain
    std::erase_if(kept, [&](const PrefixMatch::GroupLoad& l) { return l.index >= n; });
    PrefixMatch out;
    for (int32_t g = 0; g < cache->layout().num_groups(); ++g) {
      const SequenceView v = *cache->View(seq, g);
      out.group_blocks.emplace_back(v.blocks.begin(), v.blocks.end());
    }
    out.blocks = out.group_blocks[0];
    out.keys.assign(match.keys.begin(), match.keys.begin() + n);
    out.group_loads = std::move(kept);
    for (const PrefixMatch::GroupLoad& l : out.group_loads) out.lower.push_back(l.from);
    out.num_tokens = n * bl;
    RecordLookup({static_cast<int64_t>(tokens.size()), out.num_tokens, static_cast<int64_t>(tokens.size()) / bl, n});
    return Admitted{seq, std::move(out), 0};
  }
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
  // Stored events, one batch per group of consecutive newly published
  // blocks (a hybrid cache's groups each announce their own).
  struct Batch {
    std::vector<BlockKey> keys;
    std::vector<int32_t> tokens;
    std::optional<BlockKey> parent;
  };
  const KvLayout& layout = state_->cache->layout();
  std::vector<Batch> batches(static_cast<size_t>(layout.num_groups()));
  auto flush_group = [&](int32_t g) {
    Batch& b = batches[static_cast<size_t>(g)];
    if (b.keys.empty()) return;
    KvEvent ev;
    ev.type = KvEvent::Type::kBlockStored;
    ev.keys = std::move(b.keys);
    ev.parent = b.parent;
    ev.token_ids = std::move(b.tokens);
    ev.block_len = bl;
    ev.adapter_id = chain.extra.adapter_id;
    ev.extra_keys = EventExtraKeys(chain.extra, !b.parent.has_value());
    ev.group = g;
    ev.window = layout.group_window(g);
    state_->Emit(std::move(ev));
    b.keys.clear();
    b.tokens.clear();
  };
  auto flush = [&] { flush_group(0); };
  auto add_stored = [&](int32_t g, int64_t i) {
    Batch& b = batches[static_cast<size_t>(g)];
    if (b.keys.empty()) b.parent = i == 0 ? std::nullopt : std::optional<BlockKey>(chain.links[static_cast<size_t>(i - 1)].key);
    b.keys.push_back(chain.links[static_cast<size_t>(i)].key);
    const auto t = tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl));
    b.tokens.insert(b.tokens.end(), t.begin(), t.end());
  };
  LowerTiers* tiers = state_->options.tiers;
  auto write_through = [&](BlockId b, const Entry& e) {
    if (tiers != nullptr && tiers->write_through() && state_->cache->ReadBlock(b, state_->block_bytes).ok()) {
      tiers->Published(state_->MetaOf(e), state_->block_bytes);
    }
  };
  // A hybrid cache: the other groups' blocks of block i are published under
  // the same key in their own index (called once link i is in the chain).
  std::vector<SequenceView> side;
  for (int32_t g = 1; g < state_->cache->layout().num_groups(); ++g) {
    PAGEKV_ASSIGN_OR_RETURN(SequenceView v, state_->cache->View(seq, g));
    side.push_back(v);
  }
  auto publish_groups = [&](int64_t i) {
    for (size_t s = 0; s < side.size(); ++s) {
      const auto g = static_cast<int32_t>(s + 1);
      const BlockId b = side[s].blocks[static_cast<size_t>(i)];
      if (b == kNoBlock || state_->entries[static_cast<size_t>(ToInt(b))].has_value() ||
          state_->IndexOf(g).count(chain.links[static_cast<size_t>(i)].key) > 0) {
        flush_group(g);  // a batch is a run of consecutive blocks
        continue;
      }
      Entry e = state_->EntryOf(tokens, static_cast<size_t>(i), chain.links, chain.extra);
      e.group = g;
      write_through(b, e);
      state_->Insert(b, std::move(e));
      add_stored(g, i);
    }
  };
  for (auto i = static_cast<int64_t>(chain.links.size()); i < full; ++i) {
    const auto block_tokens = tokens.subspan(static_cast<size_t>(i * bl), static_cast<size_t>(bl));
    const Link* parent = i == 0 ? nullptr : &chain.links.back();
    const Link link = state_->LinkOf(parent, block_tokens, chain.extra);
    const BlockId block = view.blocks[static_cast<size_t>(i)];
    if (block == kNoBlock) {  // a sliding group 0 released it unpublished: the others may still publish
      flush();
      chain.links.push_back(link);
      publish_groups(i);
      continue;
    }
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
      publish_groups(i);
      continue;
    }
    if (state_->entries[static_cast<size_t>(ToInt(block))].has_value()) {
      // The block already holds another key (shared through a fork of a
      // published chain under other extra keys): leave it.
      flush();
      chain.links.push_back(link);
      publish_groups(i);
      continue;
    }
    chain.links.push_back(link);  // `parent` is not used past here
    Entry e = state_->EntryOf(tokens, static_cast<size_t>(i), chain.links, chain.extra);
    write_through(block, e);
    state_->Insert(block, std::move(e));
    add_stored(0, i);
    publish_groups(i);
  }
  for (int32_t g = 0; g < layout.num_groups(); ++g) flush_group(g);
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
  for (auto& side : state_->side_index) side.clear();
  for (auto& [id, chain] : state_->chains) chain.stopped = true;  // their blocks are no longer published
  KvEvent ev;
  ev.type = KvEvent::Type::kAllBlocksCleared;
  state_->Emit(std::move(ev));
}

PrefixCacheStats PrefixCache::Stats() const {
  PrefixCacheStats st = state_->stats;
  st.cached_blocks = static_cast<int64_t>(state_->index.size());  // group 0's (the keys held)
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
    auto& idx = state_->IndexOf(state_->entries[b]->group);
    auto it = idx.find(state_->entries[b]->key);
    PAGEKV_CHECK_MSG(it != idx.end() && it->second == id, "a published block is missing from the index");
  }
  size_t indexed = state_->index.size();
  for (const auto& side : state_->side_index) indexed += side.size();
  PAGEKV_CHECK_MSG(with_entry == indexed, "the index holds keys of no block");
}

}  // namespace pagekv
