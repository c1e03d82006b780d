// KvCache accounting: statistics, the memory report (the library side of the
// OOM doctor) and the leak report. Read-only, computed on demand from the
// block tables: O(blocks + table entries) per call.
#include <algorithm>
#include <map>
#include <string>

#include <fmt/format.h>

#include "base/checked_math.h"
#include "kvcache/kv_cache_state.h"
#include "pagekv/units.h"

namespace pagekv {

CacheStats KvCache::Stats() const {
  const BlockPool& pool = state_->pool;
  const int64_t bl = layout_.block_len();
  // fill[b] = the most slots of block b that any holder has written.
  std::vector<int32_t> fill(static_cast<size_t>(pool.num_blocks()), 0);
  CacheStats st;
  for (const auto& [id, s] : state_->sequences) {
    st.tokens_logical += s.num_tokens;
    for (const Sequence::Table& t : s.tables) {
      for (size_t i = static_cast<size_t>(t.released); i < t.blocks.size(); ++i) {
        const auto in_block = static_cast<int32_t>(std::min<int64_t>(bl, s.num_tokens - static_cast<int64_t>(i) * bl));
        int32_t& f = fill[ToInt(t.blocks[i])];
        f = std::max(f, in_block);
      }
    }
  }
  for (int32_t b = 0; b < pool.num_blocks(); ++b) {
    st.tokens_physical += FilledHere(fill[b]);  // a context slice holds its part of each block
    if (pool.RefCount(BlockId{b}) > 1) ++st.blocks_shared;
  }
  st.blocks_total = pool.num_blocks();
  st.blocks_free = pool.num_free();
  st.blocks_cached_free = pool.num_cached_free();
  st.blocks_used = pool.num_used();
  st.num_sequences = static_cast<int64_t>(state_->sequences.size());
  st.bytes_pool = arena_layout_.total_bytes();
  st.bytes_allocated = st.blocks_used * arena_layout_.bytes_per_block();
  st.bytes_holding_tokens = st.tokens_physical * layout_.bytes_per_block_token();
  st.internal_fragmentation =
      st.bytes_allocated == 0 ? 0.0
                              : 1.0 - static_cast<double>(st.bytes_holding_tokens) /
                                          static_cast<double>(st.bytes_allocated);
  st.utilization = static_cast<double>(st.blocks_used) / static_cast<double>(st.blocks_total);
  return st;
}

Result<SequenceStats> KvCache::StatsFor(SeqId id) const {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) {
    return NotFoundError("sequence " + std::to_string(ToInt(id)) + " does not exist");
  }
  const Sequence& s = it->second;
  SequenceStats st;
  st.id = id;
  st.label = s.label;
  st.num_tokens = s.num_tokens;
  int64_t slots = 0;  // token slots held over every group's table
  for (const Sequence::Table& t : s.tables) {
    st.num_blocks += static_cast<int64_t>(t.blocks.size()) - t.released;
    for (BlockId b : t.blocks) {
      if (b != kNoBlock && state_->pool.RefCount(b) > 1) ++st.num_shared_blocks;
    }
    slots += s.num_tokens - t.released * layout_.block_len();
  }
  // A context slice's share: its blocks' bytes here, its part of the slots.
  st.bytes_allocated = st.num_blocks * arena_layout_.bytes_per_block();
  st.bytes_holding_tokens = slots * layout_.bytes_per_block_token() / slices_;
  return st;
}

std::vector<SequenceStats> KvCache::AllSequenceStats() const {
  std::vector<SequenceStats> out;
  out.reserve(state_->sequences.size());
  for (const auto& entry : state_->sequences) out.push_back(*StatsFor(SeqId{entry.first}));
  std::sort(out.begin(), out.end(),
            [](const SequenceStats& a, const SequenceStats& b) { return ToInt(a.id) < ToInt(b.id); });
  return out;
}

MemoryReport KvCache::Memory() const {
  const CacheStats st = Stats();
  MemoryReport r;
  // A context slice: this process's bytes (its blocks' slices; a token's
  // rows are held by one slice, so a contiguous cache's need is shared out).
  r.bytes_per_token = layout_.bytes_per_token();
  r.bytes_per_block = arena_layout_.bytes_per_block();
  r.need_unshared_bytes = st.tokens_logical * r.bytes_per_token / slices_;
  r.need_bytes = st.tokens_physical * layout_.bytes_per_block_token();
  r.allocated_bytes = st.bytes_allocated;
  r.pool_bytes = st.bytes_pool;
  r.free_bytes = st.blocks_free * r.bytes_per_block;
  r.padding_bytes_per_block = arena_layout_.padding_bytes_per_block();
  return r;
}

std::string MemoryReport::ToString() const {
  auto pct = [&](int64_t v) {
    return pool_bytes == 0 ? 0.0 : 100.0 * static_cast<double>(v) / static_cast<double>(pool_bytes);
  };
  std::string out;
  out += fmt::format("  {:<40} {:>12} {:>7}\n", "pool (arena)", FormatBytes(pool_bytes), "100.0%");
  out += fmt::format("  {:<40} {:>12} {:>6.1f}%\n", "allocated to sequences (whole blocks)",
                     FormatBytes(allocated_bytes), pct(allocated_bytes));
  out += fmt::format("  {:<40} {:>12} {:>6.1f}%\n", "needed by stored tokens (shared once)",
                     FormatBytes(need_bytes), pct(need_bytes));
  out += fmt::format("  {:<40} {:>12} {:>6.1f}%\n", "needed without sharing (contiguous)",
                     FormatBytes(need_unshared_bytes), pct(need_unshared_bytes));
  out += fmt::format("  {:<40} {:>12} {:>6.1f}%\n", "free", FormatBytes(free_bytes), pct(free_bytes));
  out += fmt::format("  {:<40} {:>12}\n", "bytes per token", FormatBytes(bytes_per_token));
  out += fmt::format("  {:<40} {:>12}\n", "bytes per block", FormatBytes(bytes_per_block));
  if (padding_bytes_per_block > 0) {
    out += fmt::format("  {:<40} {:>12}\n", "alignment padding per block",
                       FormatBytes(padding_bytes_per_block));
  }
  return out;
}

std::vector<BlockHolders> KvCache::ReferencedBlocks() const {
  std::map<int32_t, BlockHolders> by_block;
  for (const auto& [id, s] : state_->sequences) {
    for (const Sequence::Table& t : s.tables) {
      for (BlockId b : t.blocks) {
        if (b == kNoBlock) continue;
        BlockHolders& h = by_block[ToInt(b)];
        h.block = b;
        h.ref_count = state_->pool.RefCount(b);
        h.holders.push_back(SeqId{id});
      }
    }
  }
  std::vector<BlockHolders> out;
  out.reserve(by_block.size());
  for (auto& [b, h] : by_block) {
    std::sort(h.holders.begin(), h.holders.end(),
              [](SeqId x, SeqId y) { return ToInt(x) < ToInt(y); });
    out.push_back(std::move(h));
  }
  return out;
}

std::string KvCache::LeakReport() const {
  const BlockPool& pool = state_->pool;
  if (pool.num_used() == 0) return "no blocks referenced\n";
  std::string out = fmt::format("{} of {} blocks ({}) still referenced by {} sequence(s):\n",
                                pool.num_used(), pool.num_blocks(),
                                FormatBytes(pool.num_used() * layout_.bytes_per_block()),
                                state_->sequences.size());
  for (const SequenceStats& s : AllSequenceStats()) {
    if (s.num_blocks == 0) continue;
    const Sequence& seq = state_->sequences.at(ToInt(s.id));
    std::string ids;
    for (size_t g = 0; g < seq.tables.size(); ++g) {
      const std::vector<BlockId>& blocks = seq.tables[g].blocks;
      if (g > 0) ids += " | ";  // a hybrid cache's groups
      const size_t shown = std::min<size_t>(blocks.size(), 16);
      for (size_t i = 0; i < shown; ++i) {
        if (i) ids += ",";
        ids += blocks[i] == kNoBlock ? std::string("-") : std::to_string(ToInt(blocks[i]));
      }
      if (shown < blocks.size()) ids += fmt::format(",... (+{})", blocks.size() - shown);
    }
    out += fmt::format("  sequence {}{}: {} tokens in {} blocks ({} shared): [{}]\n", ToInt(s.id),
                       s.label.empty() ? "" : " '" + s.label + "'", s.num_tokens, s.num_blocks,
                       s.num_shared_blocks, ids);
  }
  return out;
}

}  // namespace pagekv
