// KvCache: the paged KV cache. One preallocated arena cut into fixed-size
// blocks, handed to sequences on demand through per-sequence block tables.
//
// A sequence is a growing list of token positions. Its block table maps
// position p to (block = table[p / block_len], slot = p % block_len); the
// rows of that token live at KvLayout::RowOffset(layer, plane, head, block,
// slot) in the arena (docs/KV_LAYOUT.md).
//
//   positions   0 .. 127 | 128 .. 255 | 256 .. 300
//   table       [ B17   ,   B3       ,  B42 (45 of 128 slots filled) ]
//
// The write path (Append): if the last block has room, write there; else take
// a new block; write every row at its layout position; then update the
// sequence's length. Fork shares every block (reference counts rise, nothing
// is copied); the first Append to either side copies the shared, partly
// filled last block first (copy-on-write). Full shared blocks are never
// copied: appends go to a fresh block. Truncate returns blocks that became
// empty; Free returns all of a sequence's blocks at once.
//
// Ask, then act: BlocksNeeded() tells what an Append would take and mutates
// nothing. An Append that cannot get its blocks returns false and changes
// nothing; running out of blocks is an ordinary outcome, not an error. Bad
// input (unknown sequence, wrong sizes) is a Status error and changes nothing.
//
// Invariants (CheckInvariants): every block's reference count equals the
// number of block tables holding it; free + used == total; a sequence of
// length n has exactly ceil(n / block_len) table entries, its first
// `released` kNoBlock (ReleaseBefore) and the rest blocks; no block appears
// twice in one table.
//
// Thread safety: not thread-safe; one thread (the engine loop) owns a KvCache,
// or the caller serialises every call. Ownership: the cache owns its arena;
// views and pointers it returns stay valid until the next call that mutates
// the sequence they came from.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pagekv/ids.h"
#include "pagekv/kv_layout.h"
#include "pagekv/status.h"

namespace pagekv {

class Backend;  // kernels/backend.h

struct KvCacheOptions {
  CacheConfig config;
  // Where the arena lives and what moves its blocks (null: the CPU backend);
  // must outlive the cache.
  const Backend* backend = nullptr;
  bool huge_pages = true;  // request transparent huge pages for the arena
  bool prefault = true;    // touch every arena page at Create, not on the decode path
  // Called from the destructor with LeakReport() when blocks are still
  // referenced at shutdown; unset = say nothing.
  std::function<void(const std::string&)> leak_sink;
  // Context parallel (a sequence's tokens spread over processes): every
  // block of config.block_len tokens is cut into `slices` consecutive
  // slices of block_len / slices tokens, and this cache's arena holds only
  // slice `slice` of every block: 1 / slices of the bytes. Block ids,
  // tables, lengths and every count are the whole pool's, the same in each
  // process of the split (they allocate in step); writes, reads, block
  // copies and block payloads touch only this slice's tokens (the others
  // are skipped). 1 = the whole block. Requires a per-head or MLA cache
  // without int4 KIVI layers and block_len / slices a power of two >= 8.
  int32_t slices = 1;
  int32_t slice = 0;
  // Mixed into GeometryTag: tells apart shards whose blocks have the same
  // shape but hold different KV (tensor parallel ranks' heads, pipeline
  // stages' layers), so a tier shared by them never serves one shard's
  // bytes to another. 0 = not a shard. Context slices are told apart
  // without it.
  uint64_t shard_tag = 0;
};

// Rows of `num_tokens` consecutive tokens, in the cache's storage format.
//   k: [num_layers][num_tokens][num_heads][row_bytes]  (layer after layer,
//      each with its own row_bytes(layer) when the layers' formats differ)
//   v: same shape; must be null for an MLA cache (its latent row is in k)
// where num_heads and row_bytes are the KvLayout's (num_kv_heads and
// head_dim * element size for per-head caches; 1 and (rank + rope) * element
// size for MLA).
struct KvTokens {
  int64_t num_tokens = 0;
  const void* k = nullptr;
  const void* v = nullptr;
};

// Destination for Read, same shapes as KvTokens.
struct KvTokensOut {
  int64_t num_tokens = 0;
  void* k = nullptr;
  void* v = nullptr;
};

// A sequence's block table (of one cache group), for kernels. Valid until
// the sequence is next mutated or freed.
struct SequenceView {
  SeqId id{};
  int64_t num_tokens = 0;
  std::span<const BlockId> blocks;  // [ceil(num_tokens / block_len)]
  // Leading entries of `blocks` that are kNoBlock (ReleaseBefore: a sliding
  // window has passed them); the kernels read such a table with the window.
  int64_t released_blocks = 0;
  // Tokens dropped by Compact (token eviction): the next token's position
  // (for rotary embeddings and the context limit) is num_tokens + evicted.
  int64_t evicted = 0;
  int32_t group = 0;   // the cache group whose table this is (KvLayout::num_groups)
  int32_t window = 0;  // its layers' sliding window (0: full attention)
  // INT4 KIVI layers: the sequence's f16 tail (KvLayout::TailOffset) holding
  // its last num_tokens % G tokens of each such layer; null when none.
  const std::byte* tail = nullptr;
};

// Token eviction's row moves for one (layer, head): the kept slots end up in
// slots [0, keep.size()). A kept slot below that stays where it is; the kept
// slots at or above it fill the holes below it, both in ascending order, so
// at most one row moves per evicted token. Returns (from, to) pairs.
// REQUIRES: keep holds distinct slots.
std::vector<std::pair<int32_t, int32_t>> CompactionMoves(std::span<const int32_t> keep);

// A block table of a cache (KvCache::View) as the blocks of its arena
// (KvCache::arena_layout()): for a context slice (slice `slice` of
// `slices`), entry j of ceil(num_tokens / (block_len / slices)) is the
// block holding tokens [j * slice_len, (j + 1) * slice_len) when this slice
// holds them (block table[j / slices], when j % slices == slice) and
// kNoBlock when another slice does; for slices = 1 the table itself. Kernels
// read such a table with AttentionOptions::partial. REQUIRES: 1 <= slices,
// 0 <= slice < slices, block_len a multiple of slices.
void ArenaTable(std::span<const BlockId> table, int64_t num_tokens, int32_t block_len, int32_t slices, int32_t slice,
                std::vector<BlockId>& out);

// What an Append of n tokens would take.
// A hybrid cache counts every group's table.
struct AppendNeed {
  int64_t new_blocks = 0;  // blocks for positions past the current last block
  bool copy_on_write = false;  // a shared, partly filled last block must be copied first
  int64_t copies = 0;          // how many (one per group at most)
  int64_t total() const { return new_blocks + copies; }
};

// What one Reserve changed in a sequence, to put it back exactly
// (KvCache::Unreserve).
struct ReserveUndo {
  SeqId seq{};
  int64_t num_tokens = 0;          // the length before
  struct Group {
    size_t num_blocks = 0;         // block-table entries before
    bool copied = false;           // a copy-on-write replaced the last block:
    BlockId shared{};              //   the shared block it replaced
  };
  std::vector<Group> groups;       // per cache group
  bool copied = false;             // any group's last block was copied
  // INT4 KIVI layers' f16 tail before, saved when the reservation reaches a
  // group's end (sealing it overwrites rows the sequence had); else the
  // rows it had are not touched and nothing is saved.
  bool tail_saved = false;
  std::vector<std::byte> tail;
};

struct SequenceStats {
  SeqId id{};
  std::string label;
  int64_t num_tokens = 0;
  int64_t num_blocks = 0;
  int64_t num_shared_blocks = 0;     // blocks also held by another sequence
  int64_t bytes_allocated = 0;       // num_blocks * bytes_per_block
  int64_t bytes_holding_tokens = 0;  // num_tokens * bytes_per_token
};

struct CacheStats {
  int64_t blocks_total = 0;
  int64_t blocks_free = 0;          // free, cached ones included (they are evictable)
  int64_t blocks_cached_free = 0;   // of blocks_free: still holding prefix-cache KV
  int64_t blocks_used = 0;
  int64_t blocks_shared = 0;         // used blocks with more than one holder
  int64_t num_sequences = 0;
  int64_t tokens_logical = 0;        // sum of sequence lengths
  int64_t tokens_physical = 0;       // distinct token slots holding data (shared once)
  int64_t bytes_pool = 0;            // the whole arena
  int64_t bytes_allocated = 0;       // blocks_used * bytes_per_block
  int64_t bytes_holding_tokens = 0;  // tokens_physical * bytes_per_token
  // 1 - bytes_holding_tokens / bytes_allocated: empty slots in partly filled
  // last blocks plus slab alignment padding. 0 when nothing is allocated.
  double internal_fragmentation = 0;
  double utilization = 0;  // blocks_used / blocks_total
};

// The OOM doctor's view of memory: what the stored tokens need in theory,
// what the pool holds, and what is handed out.
struct MemoryReport {
  int64_t bytes_per_token = 0;
  int64_t bytes_per_block = 0;
  int64_t need_unshared_bytes = 0;  // tokens_logical * bytes_per_token (a contiguous, unshared cache)
  int64_t need_bytes = 0;           // tokens_physical * bytes_per_token (shared tokens once)
  int64_t allocated_bytes = 0;      // used blocks
  int64_t pool_bytes = 0;           // the arena
  int64_t free_bytes = 0;           // free blocks
  int64_t padding_bytes_per_block = 0;  // slab alignment padding inside one block

  std::string ToString() const;  // a small readable table
};

// One block still referenced, and by whom (the leak report).
struct BlockHolders {
  BlockId block{};
  int32_t ref_count = 0;
  std::vector<SeqId> holders;  // sorted by id
};

class KvCache {
 public:
  // Validates the config, resolves the layout and maps the arena. Errors:
  // every CacheConfig validation error; Unimplemented for a quantized format
  // (only f32, f16 and bf16 are stored today); ResourceExhausted when the OS
  // refuses the arena.
  static Result<std::unique_ptr<KvCache>> Create(const KvCacheOptions& options);
  // Whether blocks of block_len tokens split into `slices` context slices
  // (KvCacheOptions::slices): a power of two of slices of at least 8 tokens.
  static Status CheckSlices(int32_t block_len, int32_t slices);

  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // The cache's geometry: block_len, num_blocks and every count of tables
  // and positions are read here.
  const KvLayout& layout() const { return layout_; }
  // The arena's own placement, what kernels index arena() with: layout()
  // itself, except for a context slice (KvCacheOptions::slices > 1), whose
  // arena holds block_len / slices tokens of every block; tables for it come
  // from ArenaTable.
  const KvLayout& arena_layout() const { return arena_layout_; }
  int32_t slices() const { return slices_; }
  int32_t slice() const { return slice_; }

  // --- sequences -----------------------------------------------------------

  // A new, empty sequence holding no blocks. `label` names it in reports.
  SeqId AddSequence(std::string label = {});

  bool Contains(SeqId id) const;
  int64_t num_sequences() const;

  // Ask: what an Append of n tokens to `id` would take. Mutates nothing.
  // Errors: unknown id, n < 0.
  Result<AppendNeed> BlocksNeeded(SeqId id, int64_t n) const;

  // Act: appends tokens.num_tokens tokens through the write path. Returns
  // true when written, false (and nothing changed) when the pool lacks the
  // blocks. Errors (nothing changed): unknown id, negative count, null k, a v
  // that is null for a per-head cache or set for an MLA cache.
  Result<bool> Append(SeqId id, const KvTokens& tokens);

  // The write path in two halves, for a model that produces K and V one
  // layer at a time. Reserve extends the sequence by n positions (taking
  // blocks, copying a shared partial last block first) exactly as Append
  // would, without writing them: false and no change when the pool is short.
  // WriteLayer then writes one layer's rows for positions [pos, pos + n):
  //   rows.k, rows.v: [n][num_heads][row_bytes] (v null for MLA)
  // Errors (nothing written): unknown id, layer out of range, positions
  // outside the sequence, or positions in a block shared with another
  // sequence (only positions added since the last fork are writable).
  Result<bool> Reserve(SeqId id, int64_t n);
  // Reserve, recording in *undo what it changed (when it returns true).
  Result<bool> Reserve(SeqId id, int64_t n, ReserveUndo* undo);
  // Puts the sequence back exactly as it was before the Reserve that filled
  // `undo`, whatever WriteLayer wrote since: its block table (the shared
  // block a copy-on-write replaced, its reference restored), its length and
  // its KIVI tail; the blocks the reservation took go back to the free list.
  // Unlike Truncate it tells no cut listener (the tokens the sequence had
  // are untouched). A cached block the reservation took stays evicted.
  // Undo several reservations in the reverse of their order. REQUIRES: the
  // sequence changed only through WriteLayer since that Reserve.
  Status Unreserve(const ReserveUndo& undo);
  Status WriteLayer(SeqId id, int32_t layer, int64_t pos, const KvTokens& rows);

  // Whole blocks as bytes, for moving them to and from other storage tiers:
  // a block's slabs in layout order (layer, plane, head), each slab_bytes
  // long, with no padding: [slabs_per_block][block_len][row_bytes] (a
  // context slice's: its block_len / slices tokens of the block).
  int64_t block_payload_bytes() const {
    return (arena_layout_.bytes_per_block() - arena_layout_.padding_bytes_per_block());
  }
  // A 64-bit tag of everything that shapes a block's bytes (layers, planes,
  // heads, row elements, block_len, every layer's format and row bytes, a
  // context slice, KvCacheOptions::shard_tag): blocks of caches with
  // different tags are never interchangeable.
  uint64_t GeometryTag() const;
  // What holds the arena and moves its blocks (KvCacheOptions::backend).
  const Backend& backend() const;
  // Copies block `block` of the pool into out. Errors: an id outside the
  // pool, out not exactly block_payload_bytes() long.
  Status ReadBlock(BlockId block, std::span<std::byte> out) const;
  // Overwrites block `index` of sequence id's table with data (every slot
  // of it, full or not). Same writability rule as WriteLayer: the block must
  // not be shared or published. Errors (nothing written): unknown id, index
  // out of range, a shared block, data of the wrong size.
  Status WriteBlock(SeqId id, int64_t index, std::span<const std::byte> data, int32_t group = 0);
  // Overwrites pool block `block` with data without reading or changing any
  // bookkeeping, so a background mover may call it (and ReadBlock) from its
  // own thread while the owner works on other blocks. The caller guarantees
  // that nothing else reads or writes the block meanwhile (a block reserved
  // for a load that nothing runs on until the load is done). Errors: an id
  // outside the pool, data of the wrong size.
  Status FillBlock(BlockId block, std::span<const std::byte> data);

  // A new sequence sharing all of `parent`'s blocks. Never allocates.
  Result<SeqId> Fork(SeqId parent, std::string label = {});

  // A new sequence whose first blocks are `blocks`, all full (its length is
  // blocks.size() * block_len): a prefix-cache hit. Each block is claimed:
  // a used one gains a reference, a free (cached) one comes off its free
  // list, so allocations that follow can never evict it. Errors (nothing
  // changed): an id outside the pool, a block listed twice.
  Result<SeqId> AddSequenceSharing(std::span<const BlockId> blocks, std::string label = {});
  // The same for a hybrid cache: one table per group (KvLayout::num_groups),
  // each of the same length n (the sequence's length is n * block_len). A
  // sliding group's table may start with kNoBlock entries, but only before
  // the window of the next query (position n * block_len). An entry
  // kNewBlock takes a fresh block (as Reserve does: plain free blocks first,
  // then cached ones, evicted) that the caller fills (FillBlock) before the
  // sequence is read: a hit partly loaded from a lower tier. Errors (nothing
  // changed): a wrong group count or table length, an id outside the pool, a
  // block listed twice, a kNoBlock where a window or a full group needs KV,
  // FailedPrecondition when the pool is short of the new blocks.
  static constexpr BlockId kNewBlock{-2};
  Result<SeqId> AddSequenceSharingGroups(std::span<const std::vector<BlockId>> tables, std::string label = {});

  // Prefix-cache hooks. A block marked cached keeps its KV when freed: it
  // waits on an LRU list of evictable blocks, reused only when no unmarked
  // free block is left, and `listener` hears of it just before it is reused
  // (its mark already cleared). A marked block is never written in place:
  // appending to a partly filled one copies it first.
  Status SetBlockCached(BlockId block, bool cached);
  bool IsBlockCached(BlockId block) const;
  int32_t BlockRefCount(BlockId block) const;  // 0 when free or unknown
  int64_t FreeBlockCount() const;        // O(1); Stats() walks every block
  int64_t CachedFreeBlockCount() const;  // O(1): free blocks still holding prefix-cache KV
  int64_t CopyOnWriteCount() const;      // O(1): shared, partly filled blocks copied so far (Reserve / Append)
  // Free blocks in the order allocations would take them (plain, then
  // cached least recently freed first). O(free blocks).
  std::vector<BlockId> FreeBlocks() const;
  // The free cached blocks at positions [skip, skip + count) of the order
  // evictions take them (least recently freed first). O(skip + count).
  std::vector<BlockId> CachedEvictionOrder(int64_t skip, int64_t count) const;
  void SetEvictionListener(std::function<void(BlockId)> listener);

  // A sequence lost tokens, had rows moved, or was freed. `kept_tokens` is
  // how many of its leading positions still hold exactly the rows they held
  // before the call (Truncate: the new length; Compact: the first slot any
  // row moved into, or the new length; Free: 0). The prefix cache cuts the
  // sequence's key chain here, so a rolled-back sequence never publishes new
  // blocks under the keys of the ones it dropped (and a compacted one, whose
  // slots no longer follow its tokens, publishes nothing more).
  struct SequenceCut {
    enum class Kind : uint8_t { kTruncated, kCompacted, kFreed };
    SeqId id{};
    Kind kind = Kind::kTruncated;
    int64_t kept_tokens = 0;
  };
  // Called after the change, from the thread that made it; one listener
  // (replaced by the next call; an empty function removes it).
  void SetCutListener(std::function<void(const SequenceCut&)> listener);
  // Whether a cut listener is installed (a prefix cache is bound).
  bool HasCutListener() const;

  // Shortens `id` to new_len tokens (speculative-decoding rollback); blocks
  // that hold no remaining token go back to the pool. Error: unknown id,
  // new_len outside [0, length].
  Status Truncate(SeqId id, int64_t new_len);

  // Token eviction: keeps keep_count tokens of `id` per (layer, head), a
  // different set for each if the policy wants, and drops the rest.
  //   keep: [num_layers][num_heads][keep_count] distinct slots < length
  // Rows move as CompactionMoves says (K and V of a head together), the
  // length becomes keep_count, blocks past it go back to the pool, and
  // evicted grows by the dropped count (positions of later tokens continue
  // where they were). Errors (nothing changed): unknown id, keep_count
  // outside [0, length], a wrong-sized or out-of-range or repeated keep list,
  // a row that would move into a block shared with another sequence or
  // published to the prefix cache (their content must not change).
  Status Compact(SeqId id, std::span<const int32_t> keep, int64_t keep_count);

  // Sliding-window layers: gives back every block of `id` that lies wholly
  // before position first_pos (no future query's window reaches it), oldest
  // first; their table entries become kNoBlock and the sequence keeps its
  // length. A block another sequence shares only loses this reference; a
  // published one waits on the prefix cache's evictable list. Returns how
  // many blocks were released by this call. Afterwards the released
  // positions cannot be read, written, forked into a compaction or
  // truncated into (FailedPrecondition naming them). Errors: unknown id,
  // first_pos outside [0, length], a group outside the cache's. `group`:
  // one cache group's table, or -1 for every group's.
  Result<int64_t> ReleaseBefore(SeqId id, int64_t first_pos, int32_t group = -1);
  // Hybrid caches: every sliding group of window W releases the blocks
  // wholly before the next query's window (positions < length - W + 1);
  // full groups keep everything. The engine calls this after each step, so
  // a sliding group holds at most ceil(W / block_len) + 1 blocks between
  // steps. Returns how many blocks were released. Error: unknown id.
  Result<int64_t> ReleaseOutOfWindow(SeqId id);

  // Releases all of the sequence's blocks and forgets it. Error: unknown id
  // (including a sequence already freed).
  Status Free(SeqId id);

  // --- reading ------------------------------------------------------------

  // Group 0's table (the only one of a uniform cache; a full-attention
  // group's when the cache has one), or one group's.
  Result<SequenceView> View(SeqId id) const;
  Result<SequenceView> View(SeqId id, int32_t group) const;

  // Copies tokens [begin, begin + out.num_tokens) of `id` out of the arena.
  Status Read(SeqId id, int64_t begin, const KvTokensOut& out) const;

  // The arena, [layout().total_bytes()], for kernels that index it with
  // KvLayout offsets and a SequenceView.
  const std::byte* arena() const;

  // --- accounting ---------------------------------------------------------

  CacheStats Stats() const;
  Result<SequenceStats> StatsFor(SeqId id) const;
  std::vector<SequenceStats> AllSequenceStats() const;  // sorted by id
  MemoryReport Memory() const;

  // Every block with a non-zero reference count and the sequences holding it.
  std::vector<BlockHolders> ReferencedBlocks() const;
  // Readable form of ReferencedBlocks(), grouped by sequence; "no blocks
  // referenced" when clean.
  std::string LeakReport() const;

  // Aborts with a message naming the broken invariant. O(blocks + table entries).
  void CheckInvariants() const;

 private:
  struct Sequence;
  struct State;

  KvCache(KvLayout layout, KvLayout arena_layout, std::unique_ptr<State> state);
  // Copies tokens' rows to positions [first_pos, first_pos + n). REQUIRES:
  // the blocks exist and none of them is shared.
  void WriteRows(Sequence& s, int64_t first_pos, const KvTokens& tokens);
  // Truncate without telling the cut listener (Compact tells it once).
  Status Shorten(SeqId id, int64_t new_len);

  // Where position `pos` of a table lives in this arena: false when another
  // context slice holds it; else its arena block and slot.
  bool Locate(std::span<const BlockId> blocks, int64_t pos, int64_t& block, int32_t& slot) const {
    const int64_t bl = layout_.block_len();
    block = ToInt(blocks[static_cast<size_t>(pos / bl)]);
    const auto in_block = static_cast<int32_t>(pos % bl);
    if (slices_ == 1) {
      slot = in_block;
      return true;
    }
    const int32_t slice_len = arena_layout_.block_len();
    slot = in_block % slice_len;
    return in_block / slice_len == slice_;
  }
  // Of a block's first `filled` slots, how many lie in this slice.
  int32_t FilledHere(int32_t filled) const {
    if (slices_ == 1) return filled;
    const int32_t slice_len = arena_layout_.block_len();
    return std::clamp(filled - slice_ * slice_len, 0, slice_len);
  }

  KvLayout layout_;
  KvLayout arena_layout_;
  int32_t slices_ = 1, slice_ = 0;
  uint64_t shard_tag_ = 0;
  std::unique_ptr<State> state_;
};

}  // namespace pagekv
