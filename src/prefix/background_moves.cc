// PrefixCache's background moves (include/pagekv/prefix_cache.h): prefetch
// of a prompt's lower-tier blocks, the loads admitted sequences wait for
// (collected and published here, on the owner's thread), and offloads of
// cached blocks ahead of their eviction. The tiers' threads only report
// into State's done lists; everything else runs on the owner's thread.
#include <algorithm>

#include "prefix/prefix_cache_state.h"

namespace pagekv {

using prefix::Entry;
using prefix::Link;
using prefix::Loading;
using prefix::SeqChain;

void PrefixCache::Prefetch(std::span<const int32_t> tokens, const ExtraKeys& extra) {
  if (state_->options.tiers == nullptr || !ValidateExtraKeys(extra).ok()) return;
  std::vector<Link> links;
  const PrefixMatch m = state_->Walk(tokens, extra, -1, links);
  std::vector<BlockMeta> metas;
  for (const PrefixMatch::GroupLoad& l : m.group_loads) {  // a hybrid cache's
    if (l.from == Tier::kHost) continue;
    Entry e = state_->EntryOf(tokens, static_cast<size_t>(l.index), links, extra);
    e.group = l.group;
    metas.push_back(state_->MetaOf(e));
  }
  for (size_t j = 0; j < m.lower.size() && m.group_loads.empty(); ++j) {
    if (m.lower[j] == Tier::kHost) continue;  // already in memory
    metas.push_back(state_->MetaOf(state_->EntryOf(tokens, m.blocks.size() + j, links, extra)));
  }
  if (!metas.empty()) state_->options.tiers->Prefetch(std::move(metas));
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
    if (l.groups) {
      // A hybrid hit: publish what loaded (each is right for its key), then
      // cut back before the first block that did not.
      int64_t failed_at = l.hit_blocks;
      for (size_t j = 0; j < l.entries.size(); ++j) {
        if (!l.results[j]) {
          failed_at = std::min(failed_at, l.positions[j]);
          continue;
        }
        const int32_t g = l.entries[j].group;
        const BlockId block = (*st.cache->View(seq, g)).blocks[static_cast<size_t>(l.positions[j])];
        if (st.IndexOf(g).count(l.entries[j].key) > 0) {
          st.stats.tier_hit_blocks[static_cast<size_t>(*l.results[j])] += 1;  // loaded twice: this copy stays private
          continue;
        }
        st.PublishLoaded(block, std::move(l.entries[j]), static_cast<size_t>(l.positions[j]), *l.results[j]);
      }
      int64_t n = l.hit_blocks;
      if (failed_at < l.hit_blocks) {
        ++st.stats.tier_load_failures;
        n = st.CutBack(seq, failed_at);
      }
      st.RecordLookup({l.requested_tokens, n * bl, l.requested_tokens / bl, n});
      out.push_back({seq, n * bl});
      it = st.loading.erase(it);
      continue;
    }
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

}  // namespace pagekv
