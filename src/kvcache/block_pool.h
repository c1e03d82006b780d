// BlockPool: the bookkeeping of which blocks are free and how many block
// tables reference each used block. Metadata only: the bytes live in KvArena.
//
// Free blocks sit on one intrusive doubly linked list, ordered by the time
// they were freed: Allocate takes from the head (the block freed longest ago),
// Release appends to the tail. A prefix cache can therefore treat the list as
// an LRU order, and can pull a specific free block out of the middle in O(1)
// (Reclaim) when a cached block is hit.
//
//   free list:  head -> [freed longest ago] <-> ... <-> [freed last] <- tail
//
// Invariants (CheckInvariants):
//   * num_free + num_used == num_blocks;
//   * a block is on the free list exactly when its reference count is 0;
//   * the list has no cycles or duplicates, and prev/next links agree.
//
// Every operation is O(1) per block. Failed calls change nothing.
// Thread safety: none; the owner (KvCache) serialises access.
#pragma once

#include <cstdint>
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
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks() - num_free_; }

  // Ask: would Allocate(n) succeed? Mutates nothing.
  bool CanAllocate(int64_t n) const { return n >= 0 && n <= num_free_; }

  // Act: takes n free blocks (oldest-freed first), each with reference count
  // 1, and appends their ids to `out`. All or nothing: when fewer than n
  // blocks are free, returns false and changes neither the pool nor `out`.
  bool Allocate(int32_t n, std::vector<BlockId>& out);

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

  // Free blocks from head (next to be allocated) to tail. O(num_free).
  std::vector<BlockId> FreeListOrder() const;

  // Aborts with a message when an invariant above is broken. O(num_blocks).
  void CheckInvariants() const;

 private:
  static constexpr int32_t kNil = -1;

  Status CheckId(BlockId id, const char* op) const;
  void PushTail(int32_t b);
  void Unlink(int32_t b);

  std::vector<int32_t> ref_;   // [num_blocks] reference counts
  std::vector<int32_t> prev_;  // [num_blocks] free-list links (kNil at the ends / when used)
  std::vector<int32_t> next_;  // [num_blocks]
  int32_t head_ = kNil;
  int32_t tail_ = kNil;
  int32_t num_free_ = 0;
};

}  // namespace pagekv
