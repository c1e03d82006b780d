#include "pagekv/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "base/check.h"
#include "base/checked_math.h"
#include "kvcache/kivi_rows.h"
#include "kvcache/kv_cache_state.h"

namespace pagekv {

namespace {

std::string SeqName(SeqId id) { return "sequence " + std::to_string(ToInt(id)); }

// The sequence's KIVI tail, allocated on first use (none without KIVI layers).
std::byte* TailOf(const KvLayout& layout, std::vector<std::byte>& tail) {
  if (tail.empty() && layout.tail_bytes_per_sequence() > 0) {
    tail.resize(static_cast<size_t>(layout.tail_bytes_per_sequence()));
  }
  return tail.data();
}

}  // namespace

Status KvCache::CheckSlices(int32_t block_len, int32_t slices) {
  if (slices < 1) return InvalidArgumentError("cache: " + std::to_string(slices) + " context slices: at least 1");
  if (slices == 1) return Status::Ok();
  if ((slices & (slices - 1)) != 0) {
    return InvalidArgumentError("cache: " + std::to_string(slices) + " context slices: a block and its slices are a "
                                "power of two tokens long, so the slices must be 2, 4, 8, ... (context parallel over a "
                                "power of two of ranks)");
  }
  if (block_len % slices != 0 || block_len / slices < 8) {
    return InvalidArgumentError("cache: block_len " + std::to_string(block_len) + " does not split into " +
                                std::to_string(slices) + " context slices of at least 8 tokens: use a block_len of " +
                                std::to_string(8 * slices) + " or more, a multiple of " + std::to_string(slices));
  }
  return Status::Ok();
}

Result<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheOptions& options) {
  const int32_t slices = options.slices;
  if (slices < 1 || options.slice < 0 || options.slice >= slices) {
    return InvalidArgumentError("cache: context slice " + std::to_string(options.slice) + " of " + std::to_string(slices) +
                                ": slices must be >= 1 and the slice in [0, slices)");
  }
  CacheConfig arena_config = options.config;
  if (slices > 1) {
    const int32_t bl = options.config.block_len;
    PAGEKV_RETURN_IF_ERROR(CheckSlices(bl, slices));
    for (int32_t l = 0; l < options.config.num_layers; ++l) {
      if (options.config.FormatOf(l).IsKivi()) {
        return UnimplementedError("cache: int4 KIVI layers are not split into context slices (a key group's "
                                  "parameters span the block): use f16, bf16, int8 or fp8");
      }
    }
    arena_config.block_len = bl / slices;
  }
  // The arena's geometry first (a byte budget is this process's, for its
  // slices), then the whole blocks' with the same block count.
  PAGEKV_ASSIGN_OR_RETURN(KvLayout arena_layout, KvLayout::Create(arena_config));
  CacheConfig whole = options.config;
  whole.num_blocks = arena_layout.num_blocks();
  whole.budget_bytes = 0;
  KvLayout layout = arena_layout;
  if (slices > 1) {
    PAGEKV_ASSIGN_OR_RETURN(layout, KvLayout::Create(whole));
  }
  for (int32_t l = 0; l < layout.num_layers(); ++l) {
    const KvFormat& f = layout.format(l);
    if (!f.IsPlainFloat() && !f.IsStoredQuantized(layout.row_elems()) && !f.IsKivi()) {
      return UnimplementedError("KV format " + f.ToString() + (layout.uniform() ? "" : " (layer " + std::to_string(l) + ")") +
                                " is not stored by the cache yet: use f32, f16, bf16, or int8 / fp8 with one f16 "
                                "scale per row (KvFormat::Int8(head_dim), KvFormat::Fp8(dtype, head_dim)), or int4 KIVI (KvFormat::Int4Kivi)");
    }
  }
  const Backend& backend = options.backend != nullptr ? *options.backend : CpuBackend();
  PAGEKV_RETURN_IF_ERROR(backend.CheckLayout(arena_layout));
  PAGEKV_ASSIGN_OR_RETURN(auto arena, backend.AllocateArena({.size_bytes = arena_layout.total_bytes(),
                                                             .huge_pages = options.huge_pages,
                                                             .prefault = options.prefault}));
  auto state = std::make_unique<State>(backend, std::move(arena), static_cast<int32_t>(layout.num_blocks()));
  state->leak_sink = options.leak_sink;
  auto cache = std::unique_ptr<KvCache>(new KvCache(std::move(layout), std::move(arena_layout), std::move(state)));
  cache->slices_ = slices;
  cache->slice_ = options.slice;
  cache->shard_tag_ = options.shard_tag;
  return cache;
}

KvCache::KvCache(KvLayout layout, KvLayout arena_layout, std::unique_ptr<State> state)
    : layout_(std::move(layout)), arena_layout_(std::move(arena_layout)), state_(std::move(state)) {}

void ArenaTable(std::span<const BlockId> table, int64_t num_tokens, int32_t block_len, int32_t slices, int32_t slice,
                std::vector<BlockId>& out) {
  out.clear();
  if (slices == 1) {
    out.assign(table.begin(), table.end());
    return;
  }
  const int32_t slice_len = block_len / slices;
  const int64_t n = CeilDiv(num_tokens, int64_t{slice_len});
  out.resize(static_cast<size_t>(n), kNoBlock);
  for (int64_t j = slice; j < n; j += slices) out[static_cast<size_t>(j)] = table[static_cast<size_t>(j / slices)];
}

KvCache::~KvCache() {
  if (state_->leak_sink && state_->pool.num_used() > 0) state_->leak_sink(LeakReport());
}

SeqId KvCache::AddSequence(std::string label) {
  const int64_t id = state_->next_seq_id++;
  Sequence& s = state_->sequences[id];
  s.label = std::move(label);
  s.tables.resize(static_cast<size_t>(layout_.num_groups()));
  return SeqId{id};
}

bool KvCache::Contains(SeqId id) const { return state_->sequences.count(ToInt(id)) != 0; }

int64_t KvCache::num_sequences() const { return static_cast<int64_t>(state_->sequences.size()); }

Result<AppendNeed> KvCache::BlocksNeeded(SeqId id, int64_t n) const {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError(SeqName(id) + " does not exist");
  if (n < 0) return InvalidArgumentError("token count " + std::to_string(n) + " is negative");
  const Sequence& s = it->second;
  const int64_t bl = layout_.block_len();
  AppendNeed need;
  if (n == 0) return need;
  auto end = CheckedAdd(s.num_tokens, n);
  if (!end) return InvalidArgumentError("token count " + std::to_string(n) + " overflows");
  for (const Sequence::Table& t : s.tables) {
    need.new_blocks += CeilDiv(*end, bl) - static_cast<int64_t>(t.blocks.size());
    // A partly filled last block that is shared, or that a prefix cache has
    // published (a truncation can leave one), is copied before it is written.
    if (s.num_tokens % bl != 0 &&
        (state_->pool.RefCount(t.blocks.back()) > 1 || state_->pool.IsCached(t.blocks.back()))) {
      ++need.copies;
    }
  }
  need.copy_on_write = need.copies > 0;
  return need;
}

Result<bool> KvCache::Append(SeqId id, const KvTokens& tokens) {
  const bool per_head = layout_.num_planes() == 2;
  if (!state_->backend.host_memory() && tokens.num_tokens > 0) {
    return FailedPreconditionError("append: the arena is in " + state_->backend.name() +
                                   " memory, where host rows are not copied token by token: a device cache is "
                                   "written by the model's steps (WriteLayer) and moved by block (WriteBlock, ReadBlock)");
  }
  if (tokens.num_tokens > 0) {
    if (tokens.k == nullptr) return InvalidArgumentError("append: k is null");
    if (per_head && tokens.v == nullptr) return InvalidArgumentError("append: v is null");
    if (!per_head && tokens.v != nullptr) {
      return InvalidArgumentError("append: v must be null for an MLA cache (the latent row is k)");
    }
  }
  const int64_t old_len = Contains(id) ? state_->sequences.at(ToInt(id)).num_tokens : 0;
  PAGEKV_ASSIGN_OR_RETURN(bool fit, Reserve(id, tokens.num_tokens));
  if (!fit || tokens.num_tokens == 0) return fit;
  Sequence& s = state_->sequences.at(ToInt(id));
  WriteRows(s, old_len, tokens);
  return true;
}

Result<bool> KvCache::Reserve(SeqId id, int64_t n) { return Reserve(id, n, nullptr); }

Result<bool> KvCache::Reserve(SeqId id, int64_t n, ReserveUndo* undo) {
  PAGEKV_ASSIGN_OR_RETURN(AppendNeed need, BlocksNeeded(id, n));
  Sequence& s = state_->sequences.at(ToInt(id));
  if (undo != nullptr) {
    *undo = ReserveUndo{};
    undo->seq = id;
    undo->num_tokens = s.num_tokens;
    for (const Sequence::Table& t : s.tables) undo->groups.push_back({t.blocks.size(), false, BlockId{}});
    for (int32_t l = 0; l < layout_.num_layers() && !undo->tail_saved; ++l) {
      const int64_t g = layout_.kivi(l) ? layout_.config().FormatOf(l).group_size : 0;
      if (g > 0 && s.num_tokens % g + n >= g) {
        undo->tail_saved = true;
        undo->tail = s.tail;
      }
    }
  }
  if (n == 0) return true;
  if (!state_->pool.CanAllocate(need.total())) return false;

  std::vector<BlockId>& fresh = state_->scratch;
  fresh.clear();
  PAGEKV_CHECK(state_->pool.Allocate(static_cast<int32_t>(need.total()), fresh));
  std::byte* base = state_->arena->data();
  size_t next = 0;
  const int64_t bl = layout_.block_len();
  const int64_t grown = CeilDiv(s.num_tokens + n, bl);
  for (size_t g = 0; g < s.tables.size(); ++g) {
    std::vector<BlockId>& blocks = s.tables[g].blocks;
    if (s.num_tokens % bl != 0 &&
        (state_->pool.RefCount(blocks.back()) > 1 || state_->pool.IsCached(blocks.back()))) {
      // Copy the filled slots of every slab of the shared last block, then
      // swap it for the private copy.
      const BlockId shared = blocks.back();
      const BlockId copy = fresh[next++];
      const BlockCopy c{shared, copy, FilledHere(static_cast<int32_t>(s.num_tokens % bl))};
      if (c.filled > 0) state_->backend.CopyBlocks(arena_layout_, base, {&c, 1});
      PAGEKV_CHECK(state_->pool.Release(shared).ok());
      blocks.back() = copy;
      ++state_->copies_on_write;
      if (undo != nullptr) {
        undo->copied = true;
        undo->groups[g].copied = true;
        undo->groups[g].shared = shared;
      }
    }
    while (static_cast<int64_t>(blocks.size()) < grown) blocks.push_back(fresh[next++]);
  }
  PAGEKV_CHECK(next == fresh.size());
  s.num_tokens += n;
  return true;
}

Status KvCache::WriteLayer(SeqId id, int32_t layer, int64_t pos, const KvTokens& rows) {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError("write: " + SeqName(id) + " does not exist");
  Sequence& s = it->second;
  const bool per_head = layout_.num_planes() == 2;
  if (layer < 0 || layer >= layout_.num_layers()) {
    return OutOfRangeError("write: layer " + std::to_string(layer) + " outside [0, " +
                           std::to_string(layout_.num_layers()) + ")");
  }
  if (pos < 0 || rows.num_tokens < 0 || pos > s.num_tokens || rows.num_tokens > s.num_tokens - pos) {
    return OutOfRangeError("write: tokens [" + std::to_string(pos) + ", +" + std::to_string(rows.num_tokens) +
                           ") outside " + SeqName(id) + " of length " + std::to_string(s.num_tokens) +
                           " (Reserve the positions first)");
  }
  if (rows.num_tokens == 0) return Status::Ok();
  if (rows.k == nullptr || (per_head && rows.v == nullptr) || (!per_head && rows.v != nullptr)) {
    return InvalidArgumentError("write: k (and v for a per-head cache) must be set; v must be null for MLA");
  }
  const int64_t bl = layout_.block_len();
  const Sequence::Table& t = s.tables[static_cast<size_t>(layout_.group_of(layer))];
  if (pos < t.released * bl) {
    return FailedPreconditionError("write: position " + std::to_string(pos) + " of " + SeqName(id) +
                                   " is in a block released by ReleaseBefore");
  }
  for (int64_t b = pos / bl; b <= (pos + rows.num_tokens - 1) / bl; ++b) {
    const BlockId block = t.blocks[static_cast<size_t>(b)];
    if (state_->pool.RefCount(block) > 1 || state_->pool.IsCached(block)) {
      return FailedPreconditionError("write: position " + std::to_string(std::max(pos, b * bl)) + " of " +
                                     SeqName(id) + " is in a block shared with another sequence or published to "
                                     "the prefix cache; only positions added by Reserve or Append since can be written");
    }
  }
  std::byte* base = state_->arena->data();
  const int64_t row = layout_.row_bytes(layer);
  const int64_t heads = layout_.num_heads();
  if (layout_.kivi(layer)) {
    kivi::WriteRows(layout_, base, t.blocks, TailOf(layout_, s.tail), layer, pos, rows.num_tokens,
                    static_cast<const std::byte*>(rows.k), static_cast<const std::byte*>(rows.v), heads * row);
    return Status::Ok();
  }
  // Slot mapping (the arena's blocks and slots; -1: another context
  // slice's token), then the backend stores the rows where its arena is.
  std::vector<int64_t>& slots = state_->slots;
  slots.resize(static_cast<size_t>(rows.num_tokens));
  const int64_t arena_bl = arena_layout_.block_len();
  for (int64_t i = 0; i < rows.num_tokens; ++i) {
    int64_t b;
    int32_t slot;
    slots[static_cast<size_t>(i)] = Locate(t.blocks, pos + i, b, slot) ? b * arena_bl + slot : -1;
  }
  state_->backend.StoreKvRows(arena_layout_, base, layer, slots, static_cast<const std::byte*>(rows.k),
                              static_cast<const std::byte*>(rows.v));
  return Status::Ok();
}

void KvCache::WriteRows(Sequence& s, int64_t first_pos, const KvTokens& tokens) {
  // Source [layer][token][head][row]; destination per layout. Slab-outer, so
  // the rows of consecutive tokens land next to each other within a block.
  std::byte* base = state_->arena->data();
  const int64_t n = tokens.num_tokens;
  const int64_t heads = layout_.num_heads();
  const int shift = __builtin_ctz(static_cast<unsigned>(layout_.block_len()));
  const int64_t mask = layout_.block_len() - 1;
  const void* src_planes[2] = {tokens.k, tokens.v};
  int64_t src_layer_offset = 0;  // layers follow each other, each with its own row size
  for (int32_t l = 0; l < layout_.num_layers(); ++l) {
    const std::vector<BlockId>& blocks = s.tables[static_cast<size_t>(layout_.group_of(l))].blocks;
    const int64_t row = layout_.row_bytes(l);
    const int64_t token_stride = heads * row;
    if (layout_.kivi(l)) {
      kivi::WriteRows(layout_, base, blocks, TailOf(layout_, s.tail), l, first_pos, n,
                      static_cast<const std::byte*>(tokens.k) + src_layer_offset,
                      static_cast<const std::byte*>(tokens.v) + src_layer_offset, token_stride);
      src_layer_offset += n * token_stride;
      continue;
    }
    for (int32_t p = 0; p < layout_.num_planes(); ++p) {
      const auto* src = static_cast<const std::byte*>(src_planes[p]) + src_layer_offset;
      for (int32_t h = 0; h < heads; ++h) {
        const std::byte* src_h = src + h * row;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = first_pos + i;
          if (slices_ == 1) {
            const BlockId b = blocks[static_cast<size_t>(pos >> shift)];
            std::memcpy(base + layout_.RowOffset(l, p, h, ToInt(b), static_cast<int32_t>(pos & mask)),
                        src_h + i * token_stride, static_cast<size_t>(row));
            continue;
          }
          int64_t b;
          int32_t slot;
          if (!Locate(blocks, pos, b, slot)) continue;  // another context slice's token
          std::memcpy(base + arena_layout_.RowOffset(l, p, h, b, slot), src_h + i * token_stride,
                      static_cast<size_t>(row));
        }
      }
    }
    src_layer_offset += n * token_stride;
  }
}

Result<SeqId> KvCache::AddSequenceSharing(std::span<const BlockId> blocks, std::string label) {
  if (layout_.num_groups() > 1) {
    return FailedPreconditionError("add sequence: the cache has " + std::to_string(layout_.num_groups()) +
                                   " groups (a hybrid cache): use AddSequenceSharingGroups with one table per group");
  }
  std::vector<int32_t> seen;
  for (BlockId b : blocks) {
    if (!state_->pool.IsValid(b)) {
      return InvalidArgumentError("add sequence: block id " + std::to_string(ToInt(b)) + " is not in the pool [0, " +
                                  std::to_string(layout_.num_blocks()) + ")");
    }
    seen.push_back(ToInt(b));
  }
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
    return InvalidArgumentError("add sequence: a block appears twice in the shared prefix");
  }
  // Validated: claim each block (a free one comes off its free list, a used
  // one gains a reference). Nothing below can fail.
  for (BlockId b : blocks) {
    PAGEKV_CHECK((state_->pool.RefCount(b) == 0 ? state_->pool.Reclaim(b) : state_->pool.IncRef(b)).ok());
  }
  const int64_t id = state_->next_seq_id++;
  Sequence s;
  s.tables.resize(1);
  s.tables[0].blocks.assign(blocks.begin(), blocks.end());
  s.num_tokens = static_cast<int64_t>(blocks.size()) * layout_.block_len();
  s.label = std::move(label);
  state_->sequences.emplace(id, std::move(s));
  return SeqId{id};
}

Result<SeqId> KvCache::AddSequenceSharingGroups(std::span<const std::vector<BlockId>> tables, std::string label) {
  if (static_cast<int32_t>(tables.size()) != layout_.num_groups()) {
    return InvalidArgumentError("add sequence: " + std::to_string(tables.size()) + " tables for a cache of " +
                                std::to_string(layout_.num_groups()) + " groups: give one per group");
  }
  const size_t n = tables[0].size();
  const int64_t bl = layout_.block_len();
  const auto len = static_cast<int64_t>(n) * bl;
  std::vector<int32_t> seen;
  std::vector<int64_t> released(tables.size(), 0);
  int32_t fresh = 0;
  for (size_t g = 0; g < tables.size(); ++g) {
    if (tables[g].size() != n) {
      return InvalidArgumentError("add sequence: group " + std::to_string(g) + "'s table has " +
                                  std::to_string(tables[g].size()) + " entries, group 0's " + std::to_string(n) +
                                  ": every group covers the same tokens");
    }
    const int32_t w = layout_.group_window(static_cast<int32_t>(g));
    // The next query (position len) reads from len - w + 1 on.
    const int64_t may_release = w == 0 ? 0 : std::max<int64_t>(0, len - w + 1) / bl;
    while (released[g] < static_cast<int64_t>(n) && tables[g][static_cast<size_t>(released[g])] == kNoBlock) ++released[g];
    if (released[g] > may_release) {
      return InvalidArgumentError("add sequence: group " + std::to_string(g) + " (window " + std::to_string(w) +
                                  ") lacks block " + std::to_string(released[g] - 1) +
                                  ", which the next query's window reads");
    }
    for (size_t i = static_cast<size_t>(released[g]); i < n; ++i) {
      const BlockId b = tables[g][i];
      if (b == kNewBlock) {
        ++fresh;
        continue;
      }
      if (!state_->pool.IsValid(b)) {
        return InvalidArgumentError("add sequence: block id " + std::to_string(ToInt(b)) + " (group " +
                                    std::to_string(g) + ") is not in the pool [0, " +
                                    std::to_string(layout_.num_blocks()) + ")");
      }
      seen.push_back(ToInt(b));
    }
  }
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
    return InvalidArgumentError("add sequence: a block appears twice in the shared prefix");
  }
  if (fresh > 0) {
    int64_t claimed_free = 0;
    for (int32_t b : seen) claimed_free += state_->pool.RefCount(BlockId{b}) == 0 ? 1 : 0;
    if (state_->pool.num_free() - claimed_free < fresh) {
      return FailedPreconditionError("add sequence: the pool has " +
                                     std::to_string(state_->pool.num_free() - claimed_free) +
                                     " free blocks besides the shared ones; the new ones need " + std::to_string(fresh));
    }
  }
  Sequence s;
  s.tables.resize(tables.size());
  for (size_t g = 0; g < tables.size(); ++g) {
    for (size_t i = static_cast<size_t>(released[g]); i < n; ++i) {
      const BlockId b = tables[g][i];
      if (b == kNewBlock) continue;
      PAGEKV_CHECK((state_->pool.RefCount(b) == 0 ? state_->pool.Reclaim(b) : state_->pool.IncRef(b)).ok());
    }
    s.tables[g].blocks = tables[g];
    s.tables[g].released = released[g];
  }
  // The shared blocks are claimed: taking the new ones cannot evict them.
  if (fresh > 0) {
    std::vector<BlockId> got;
    PAGEKV_CHECK(state_->pool.Allocate(fresh, got));
    size_t next = 0;
    for (Sequence::Table& t : s.tables) {
      for (BlockId& b : t.blocks) {
        if (b == kNewBlock) b = got[next++];
      }
    }
  }
  const int64_t id = state_->next_seq_id++;
  s.num_tokens = len;
  s.label = std::move(label);
  state_->sequences.emplace(id, std::move(s));
  return SeqId{id};
}

Status KvCache::SetBlockCached(BlockId block, bool cached) { return state_->pool.SetCached(block, cached); }

bool KvCache::IsBlockCached(BlockId block) const { return state_->pool.IsCached(block); }

int32_t KvCache::BlockRefCount(BlockId block) const {
  return state_->pool.IsValid(block) ? state_->pool.RefCount(block) : 0;
}

int64_t KvCache::FreeBlockCount() const { return state_->pool.num_free(); }

int64_t KvCache::CachedFreeBlockCount() const { return state_->pool.num_cached_free(); }
int64_t KvCache::CopyOnWriteCount() const { return state_->copies_on_write; }

std::vector<BlockId> KvCache::FreeBlocks() const { return state_->pool.FreeListOrder(); }

std::vector<BlockId> KvCache::CachedEvictionOrder(int64_t skip, int64_t count) const {
  return state_->pool.CachedOrder(std::max<int64_t>(0, skip), std::max<int64_t>(0, count));
}

void KvCache::SetEvictionListener(std::function<void(BlockId)> listener) {
  state_->pool.SetEvictionListener(std::move(listener));
}

void KvCache::SetCutListener(std::function<void(const SequenceCut&)> listener) { state_->on_cut = std::move(listener); }

bool KvCache::HasCutListener() const { return static_cast<bool>(state_->on_cut); }

Result<SeqId> KvCache::Fork(SeqId parent, std::string label) {
  auto it = state_->sequences.find(ToInt(parent));
  if (it == state_->sequences.end()) return NotFoundError("fork: " + SeqName(parent) + " does not exist");
  for (const Sequence::Table& t : it->second.tables) {
    for (BlockId b : t.blocks) {
      if (b != kNoBlock) PAGEKV_CHECK(state_->pool.IncRef(b).ok());
    }
  }
  const int64_t id = state_->next_seq_id++;
  Sequence child;
  child.tables = it->second.tables;
  child.num_tokens = it->second.num_tokens;
  child.evicted = it->second.evicted;
  child.tail = it->second.tail;
  child.label = std::move(label);
  state_->sequences.emplace(id, std::move(child));
  return SeqId{id};
}

Status KvCache::Shorten(SeqId id, int64_t new_len) {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError("truncate: " + SeqName(id) + " does not exist");
  Sequence& s = it->second;
  if (new_len < 0 || new_len > s.num_tokens) {
    return OutOfRangeError("truncate: new length " + std::to_string(new_len) + " of " + SeqName(id) +
                           " must be in [0, " + std::to_string(s.num_tokens) + "]");
  }
  const int64_t bl = layout_.block_len();
  for (size_t g = 0; g < s.tables.size(); ++g) {
    const int64_t released = s.tables[g].released;
    if (new_len > 0 && CeilDiv(new_len, bl) <= released) {
      return FailedPreconditionError("truncate: " + SeqName(id) + " released its first " + std::to_string(released) +
                                     " blocks (a sliding window passed them); it cannot end inside them (new length " +
                                     std::to_string(new_len) + "): free it and prefill again");
    }
    const int32_t w = layout_.group_window(static_cast<int32_t>(g));
    if (w > 0 && new_len > 0 && new_len < s.num_tokens && new_len - w + 1 < released * bl) {
      return FailedPreconditionError("truncate: the next query of " + SeqName(id) + " at position " +
                                     std::to_string(new_len) + " would read positions from " +
                                     std::to_string(std::max<int64_t>(0, new_len - w + 1)) + " on (window " +
                                     std::to_string(w) + "), which its sliding group released: roll back at most to " +
                                     std::to_string(released * bl + w - 1) + " tokens, or to 0 and prefill again");
    }
  }
  if (layout_.tail_bytes_per_sequence() > 0 && new_len < s.num_tokens) {
    for (int32_t l = 0; l < layout_.num_layers(); ++l) {
      if (layout_.kivi(l)) {
        kivi::RefillTail(layout_, state_->arena->data(), s.tables[static_cast<size_t>(layout_.group_of(l))].blocks,
                         TailOf(layout_, s.tail), l, s.num_tokens, new_len);
      }
    }
  }
  const auto keep = static_cast<size_t>(CeilDiv(new_len, bl));
  for (Sequence::Table& t : s.tables) {
    // Deepest block first: blocks released together age in chain order, so
    // an LRU over freed blocks evicts a chain from its end.
    for (size_t i = t.blocks.size(); i > keep; --i) {
      if (t.blocks[i - 1] != kNoBlock) PAGEKV_CHECK(state_->pool.Release(t.blocks[i - 1]).ok());
    }
    t.blocks.resize(keep);
    t.released = std::min<int64_t>(t.released, static_cast<int64_t>(keep));
  }
  s.num_tokens = new_len;
  return Status::Ok();
}

Result<int64_t> KvCache::ReleaseBefore(SeqId id, int64_t first_pos, int32_t group) {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError("release: " + SeqName(id) + " does not exist");
  Sequence& s = it->second;
  if (first_pos < 0 || first_pos > s.num_tokens) {
    return OutOfRangeError("release: position " + std::to_string(first_pos) + " of " + SeqName(id) +
                           " must be in [0, " + std::to_string(s.num_tokens) + "]");
  }
  if (group < -1 || group >= layout_.num_groups()) {
    return OutOfRangeError("release: group " + std::to_string(group) + " outside the cache's " +
                           std::to_string(layout_.num_groups()) + " (or -1 for all)");
  }
  const int64_t before = first_pos / layout_.block_len();  // blocks wholly before first_pos
  int64_t released = 0;
  for (size_t g = 0; g < s.tables.size(); ++g) {
    if (group >= 0 && static_cast<int32_t>(g) != group) continue;
    Sequence::Table& t = s.tables[g];
    for (int64_t i = t.released; i < before; ++i) {  // oldest first: the LRU of freed blocks evicts them first
      PAGEKV_CHECK(state_->pool.Release(t.blocks[static_cast<size_t>(i)]).ok());
      t.blocks[static_cast<size_t>(i)] = kNoBlock;
      ++released;
    }
    t.released = std::max(t.released, before);
  }
  return released;
}

Result<int64_t> KvCache::ReleaseOutOfWindow(SeqId id) {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError("release: " + SeqName(id) + " does not exist");
  const int64_t len = it->second.num_tokens;
  int64_t released = 0;
  for (int32_t g = 0; g < layout_.num_groups(); ++g) {
    const int32_t w = layout_.group_window(g);
    if (w == 0 || len - w + 1 <= 0) continue;
    PAGEKV_ASSIGN_OR_RETURN(const int64_t n, ReleaseBefore(id, len - w + 1, g));
    released += n;
  }
  return released;
}

Status KvCache::Unreserve(const ReserveUndo& undo) {
  auto it = state_->sequences.find(ToInt(undo.seq));
  if (it == state_->sequences.end()) return NotFoundError("unreserve: " + SeqName(undo.seq) + " does not exist");
  Sequence& s = it->second;
  if (undo.num_tokens > s.num_tokens || undo.groups.size() != s.tables.size()) {
    return FailedPreconditionError("unreserve: " + SeqName(undo.seq) + " changed since the reservation");
  }
  for (size_t g = 0; g < s.tables.size(); ++g) {
    const ReserveUndo::Group& u = undo.groups[g];
    const Sequence::Table& t = s.tables[g];
    if (u.num_blocks > t.blocks.size() || static_cast<int64_t>(u.num_blocks) < t.released ||
        (u.copied && (u.num_blocks == 0 || state_->pool.RefCount(u.shared) == 0))) {
      return FailedPreconditionError("unreserve: " + SeqName(undo.seq) + " changed since the reservation");
    }
  }
  for (size_t g = 0; g < s.tables.size(); ++g) {
    const ReserveUndo::Group& u = undo.groups[g];
    std::vector<BlockId>& blocks = s.tables[g].blocks;
    // Deepest first, as Truncate releases.
    for (size_t i = blocks.size(); i > u.num_blocks; --i) PAGEKV_CHECK(state_->pool.Release(blocks[i - 1]).ok());
    blocks.resize(u.num_blocks);
    if (u.copied) {
      PAGEKV_CHECK(state_->pool.IncRef(u.shared).ok());  // still held by its other owner
      PAGEKV_CHECK(state_->pool.Release(blocks.back()).ok());  // the private copy
      blocks.back() = u.shared;
    }
  }
  s.num_tokens = undo.num_tokens;
  if (undo.tail_saved) s.tail = undo.tail;
  return Status::Ok();
}

Status KvCache::Truncate(SeqId id, int64_t new_len) {
  PAGEKV_RETURN_IF_ERROR(Shorten(id, new_len));
  state_->Cut(id, SequenceCut::Kind::kTruncated, new_len);
  return Status::Ok();
}

Status KvCache::Free(SeqId id) {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) {
    return NotFoundError("free: " + SeqName(id) + " does not exist (never added, or already freed)");
  }
  for (const Sequence::Table& t : it->second.tables) {
    for (auto b = t.blocks.rbegin(); b != t.blocks.rend(); ++b) {  // deepest first
      if (*b != kNoBlock) PAGEKV_CHECK(state_->pool.Release(*b).ok());
    }
  }
  state_->sequences.erase(it);
  state_->Cut(id, SequenceCut::Kind::kFreed, 0);
  return Status::Ok();
}

Result<SequenceView> KvCache::View(SeqId id) const { return View(id, 0); }

Result<SequenceView> KvCache::View(SeqId id, int32_t group) const {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError(SeqName(id) + " does not exist");
  if (group < 0 || group >= layout_.num_groups()) {
    return OutOfRangeError("view: group " + std::to_string(group) + " outside the cache's " +
                           std::to_string(layout_.num_groups()));
  }
  const Sequence& s = it->second;
  const Sequence::Table& t = s.tables[static_cast<size_t>(group)];
  SequenceView v;
  v.id = id;
  v.num_tokens = s.num_tokens;
  v.blocks = t.blocks;
  v.released_blocks = t.released;
  v.group = group;
  v.window = layout_.group_window(group);
  v.evicted = s.evicted;
  v.tail = s.tail.empty() ? nullptr : s.tail.data();
  return v;
}

const Backend& KvCache::backend() const { return state_->backend; }

Status KvCache::Read(SeqId id, int64_t begin, const KvTokensOut& out) const {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError("read: " + SeqName(id) + " does not exist");
  if (!state_->backend.host_memory() && out.num_tokens > 0) {
    return FailedPreconditionError("read: the arena is in " + state_->backend.name() +
                                   " memory, where rows are not read token by token: read whole blocks (ReadBlock)");
  }
  const Sequence& s = it->second;
  if (begin < 0 || out.num_tokens < 0 || begin > s.num_tokens || out.num_tokens > s.num_tokens - begin) {
    return OutOfRangeError("read: tokens [" + std::to_string(begin) + ", +" +
                           std::to_string(out.num_tokens) + ") outside " + SeqName(id) +
                           " of length " + std::to_string(s.num_tokens));
  }
  const bool per_head = layout_.num_planes() == 2;
  if (out.num_tokens == 0) return Status::Ok();
  if (out.k == nullptr || (per_head && out.v == nullptr)) return InvalidArgumentError("read: null output");
  for (const Sequence::Table& t : s.tables) {
    if (begin < t.released * layout_.block_len()) {
      return FailedPreconditionError("read: position " + std::to_string(begin) + " of " + SeqName(id) +
                                     " is in a block released by ReleaseBefore");
    }
  }
  if (slices_ > 1) {
    // Only this slice's tokens are here.
    const int64_t bl = layout_.block_len(), slice_len = arena_layout_.block_len();
    for (int64_t pos = begin; pos < begin + out.num_tokens; ++pos) {
      if ((pos % bl) / slice_len != slice_) {
        return FailedPreconditionError("read: position " + std::to_string(pos) + " of " + SeqName(id) +
                                       " is held by context slice " + std::to_string((pos % bl) / slice_len) +
                                       ", not this cache's slice " + std::to_string(slice_));
      }
    }
  }
  const std::byte* base = state_->arena->data();
  const int64_t n = out.num_tokens;
  const int64_t heads = layout_.num_heads();
  void* planes[2] = {out.k, out.v};
  int64_t dst_layer_offset = 0;  // layers follow each other, each with its own row size
  for (int32_t l = 0; l < layout_.num_layers(); ++l) {
    const std::vector<BlockId>& blocks = s.tables[static_cast<size_t>(layout_.group_of(l))].blocks;
    const int64_t row = layout_.row_bytes(l);
    if (layout_.kivi(l)) {
      kivi::ReadRows(layout_, base, blocks, s.tail.data(), l, s.num_tokens, begin, n,
                     static_cast<std::byte*>(out.k) + dst_layer_offset, static_cast<std::byte*>(out.v) + dst_layer_offset,
                     heads * row);
      dst_layer_offset += n * heads * row;
      continue;
    }
    for (int32_t p = 0; p < layout_.num_planes(); ++p) {
      auto* dst = static_cast<std::byte*>(planes[p]) + dst_layer_offset;
      for (int64_t i = 0; i < n; ++i) {
        int64_t b;
        int32_t slot;
        PAGEKV_CHECK(Locate(blocks, begin + i, b, slot));  // checked above
        for (int32_t h = 0; h < heads; ++h) {
          std::memcpy(dst + (i * heads + h) * row, base + arena_layout_.RowOffset(l, p, h, b, slot),
                      static_cast<size_t>(row));
        }
      }
    }
    dst_layer_offset += n * heads * row;
  }
  return Status::Ok();
}

const std::byte* KvCache::arena() const { return state_->arena->data(); }

void KvCache::CheckInvariants() const {
  const BlockPool& pool = state_->pool;
  pool.CheckInvariants();
  std::vector<int32_t> refs(static_cast<size_t>(pool.num_blocks()), 0);
  std::vector<int64_t> seen_in(static_cast<size_t>(pool.num_blocks()), -1);
  for (const auto& [id, s] : state_->sequences) {
    PAGEKV_CHECK_MSG(s.num_tokens >= 0, "negative sequence length");
    PAGEKV_CHECK_MSG(static_cast<int32_t>(s.tables.size()) == layout_.num_groups(),
                     "a sequence holds a table count other than the cache's groups");
    for (const Sequence::Table& t : s.tables) {
      PAGEKV_CHECK_MSG(static_cast<int64_t>(t.blocks.size()) == CeilDiv(s.num_tokens, layout_.block_len()),
                       "a sequence holds a block count other than ceil(length / block_len)");
      PAGEKV_CHECK_MSG(t.released >= 0 && t.released <= static_cast<int64_t>(t.blocks.size()),
                       "a sequence's released count is outside its table");
      for (size_t i = 0; i < t.blocks.size(); ++i) {
        const BlockId b = t.blocks[i];
        if (static_cast<int64_t>(i) < t.released) {
          PAGEKV_CHECK_MSG(b == kNoBlock, "a released table entry names a block");
          continue;
        }
        PAGEKV_CHECK_MSG(pool.IsValid(b), "a block table holds an id outside the pool");
        PAGEKV_CHECK_MSG(seen_in[ToInt(b)] != id, "a block appears twice in one sequence's tables");
        seen_in[ToInt(b)] = id;
        ++refs[ToInt(b)];
      }
    }
  }
  for (int32_t b = 0; b < pool.num_blocks(); ++b) {
    PAGEKV_CHECK_MSG(refs[b] == pool.RefCount(BlockId{b}),
                     "a block's reference count differs from the number of tables holding it");
  }
}

}  // namespace pagekv
