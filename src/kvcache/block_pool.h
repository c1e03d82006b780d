// BlockPool: the bookkeeping of which blocks are free and how many block
// tables reference each used block. Metadata only: the bytes live in KvArena.
//
// Free blocks sit on two intrusive doubly linked lists, each ordered by the
// time its blocks were freed (head: freed longest ago; Release appends to the
// tail):
//
//   plain:   free blocks whose contents nobody will look up again
//   cached:  free blocks that still hold a prefix cache's published KV
//            (marked with SetCached); an LRU order, evicted head first
//
// Allocate takes plain blocks first and evicts cached ones only when no
// plain block is left, telling the eviction listener before a cached block
// changes hands (so the prefix cache drops its key). A prefix-cache hit pulls
// a specific free block out of either list in O(1) (Reclaim).
//
// Invariants (CheckInvariants):
//   * num_free + num_used == num_blocks;
//   * a block is on a free list exactly when its reference count is 0, and
//     on the cached list exactly when it is also marked cached;
//   * the lists have no cycles or duplicates, and prev/next links agree.
//
// Every operation is O(1) per block. Failed calls change nothing.
// Thread safety: none; the owner (KvCache) serialises access.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "pagekv/ids.h"
#include "pagekv/status.h"

namespace pagekv {

class BlockPool {
 public:
  // REQUIRES: 0 < num_blocks < 2^31 - 1.
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_.size()); }
  int32_t num_free() const { return lists_[0].size + lists_[1].size; }
  int32_t num_used() const { return num_blocks() - num_free(); }
  // Free blocks that still hold cached KV (evictable, not yet evicted).
  int32_t num_cached_free() const { return lists_[1].size; }

  // Ask: would Allocate(n) succeed (evicting cached blocks if it must)?
  bool CanAllocate(int64_t n) const { return n >= 0 && n <= num_free(); }

  // Act: takes n free blocks, plain ones first, then cached ones (each
  // least recently freed first, the listener told of each eviction), each
  // with reference count 1, and appends their ids to `out`. All or nothing:
  // when fewer than n blocks are free, returns false and changes neither the
  // pool nor `out` (and evicts nothing).
  bool Allocate(int32_t n, std::vector<BlockId>& out);

  // Marks a block as holding (or no longer holding) published KV. A free
  // block moves to the tail of the matching list. An evicted or reclaimed
  // block stays marked until its owner clears it; Allocate clears the mark
  // of what it evicts.
  Status SetCached(BlockId id, bool cached);
  bool IsCached(BlockId id) const { return IsValid(id) && cached_[ToInt(id)] != 0; }

  // Called with every cached block Allocate is about to hand out, before it
  // does (the block's mark is already cleared).
  void SetEvictionListener(std::function<void(BlockId)> listener) { on_evict_ = std::move(listener); }

  // One block, or nullopt when none is free.
  std::optional<BlockId> AllocateOne();

  // Takes one specific free block off the free list (reference count 0 -> 1).
  // Error if the id is unknown or the block is in use.
  Status Reclaim(BlockId id);

  // Adds a reference to a used block (a fork sharing it). Error if the id is
  // unknown or the block is free.
  Status IncRef(BlockId id);

  // Drops one reference; at zero the block goes to the tail of the free list.
  // Error, and no change, if the id is unknown or the block is already free
  // (a double free).
  Status Release(BlockId id);

  bool IsValid(BlockId id) const { return ToInt(id) >= 0 && ToInt(id) < num_blocks(); }
  // REQUIRES: IsValid(id).
  int32_t RefCount(BlockId id) const { return ref_[ToInt(id)]; }

  // Free blocks in the order Allocate would take them: the plain list, then
  // the cached list, each head to tail. O(num_free).
  std::vector<BlockId> FreeListOrder() const;
  // Positions [skip, skip + count) of the cached free list, head first.
  std::vector<BlockId> CachedOrder(int64_t skip, int64_t count) const;

  // Aborts with a message when an invariant above is broken. O(num_blocks).
  void CheckInvariants() const;

 private:
  static constexpr int32_t kNil = -1;

  struct List {
    int32_t head = kNil;
    int32_t tail = kNil;
    int32_t size = 0;
  };

  Status CheckId(BlockId id, const char* op) const;
  // The free list a block belongs on: 1 (cached) or 0 (plain).
  List& ListOf(int32_t b) { return lists_[cached_[b] != 0 ? 1 : 0]; }
  void PushTail(int32_t b);
  void Unlink(int32_t b);
  int32_t TakeHead();

  std::vector<int32_t> ref_;     // [num_blocks] reference counts
  std::vector<int32_t> prev_;    // [num_blocks] free-list links (kNil at the ends / when used)
  std::vector<int32_t> next_;    // [num_blocks]
  std::vector<uint8_t> cached_;  // [num_blocks] holds published KV
  List lists_[2];                // plain, cached
  std::function<void(BlockId)> on_evict_;
};

}  // namespace pagekv
