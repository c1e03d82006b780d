// Strong integer ids, so a block id, a sequence id and a position can never be
// mixed up silently.
//
//   BlockId: index of a block in the pool, in [0, num_blocks). A block id
//            names all of the block's slabs: one per (layer, K/V plane, head).
//   SeqId:   a sequence in a KvCache, assigned by the cache, never reused
//            within one cache's lifetime.
#pragma once

#include <cstdint>

namespace pagekv {

enum class BlockId : int32_t {};
enum class SeqId : int64_t {};

// A block-table entry that names no block: a sliding-window layer's block
// that fell wholly outside every future query's window and was freed.
inline constexpr BlockId kNoBlock{-1};

constexpr int32_t ToInt(BlockId id) { return static_cast<int32_t>(id); }
constexpr int64_t ToInt(SeqId id) { return static_cast<int64_t>(id); }

}  // namespace pagekv
