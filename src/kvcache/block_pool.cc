#include "kvcache/block_pool.h"

#include <string>

#include "base/check.h"

namespace pagekv {

BlockPool::BlockPool(int32_t num_blocks)
    : ref_(static_cast<size_t>(num_blocks), 0),
      prev_(static_cast<size_t>(num_blocks), kNil),
      next_(static_cast<size_t>(num_blocks), kNil),
      cached_(static_cast<size_t>(num_blocks), 0) {
  PAGEKV_CHECK(num_blocks > 0);
  for (int32_t b = 0; b < num_blocks; ++b) PushTail(b);
}

void BlockPool::PushTail(int32_t b) {
  List& l = ListOf(b);
  prev_[b] = l.tail;
  next_[b] = kNil;
  if (l.tail == kNil) {
    l.head = b;
  } else {
    next_[l.tail] = b;
  }
  l.tail = b;
  ++l.size;
}

void BlockPool::Unlink(int32_t b) {
  List& l = ListOf(b);
  const int32_t p = prev_[b];
  const int32_t n = next_[b];
  if (p == kNil) l.head = n; else next_[p] = n;
  if (n == kNil) l.tail = p; else prev_[n] = p;
  prev_[b] = next_[b] = kNil;
  --l.size;
}

int32_t BlockPool::TakeHead() {
  const bool evict = lists_[0].size == 0;
  const int32_t b = lists_[evict ? 1 : 0].head;
  Unlink(b);
  ref_[b] = 1;
  if (evict) {
    cached_[b] = 0;
    if (on_evict_) on_evict_(BlockId{b});
  }
  return b;
}

bool BlockPool::Allocate(int32_t n, std::vector<BlockId>& out) {
  if (!CanAllocate(n)) return false;
  out.reserve(out.size() + static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out.push_back(BlockId{TakeHead()});
  return true;
}

std::optional<BlockId> BlockPool::AllocateOne() {
  if (num_free() == 0) return std::nullopt;
  return BlockId{TakeHead()};
}

Status BlockPool::SetCached(BlockId id, bool cached) {
  PAGEKV_RETURN_IF_ERROR(CheckId(id, "set cached"));
  const int32_t b = ToInt(id);
  if ((cached_[b] != 0) == cached) return Status::Ok();
  const bool is_free = ref_[b] == 0;
  if (is_free) Unlink(b);
  cached_[b] = cached ? 1 : 0;
  if (is_free) PushTail(b);
  return Status::Ok();
}

Status BlockPool::CheckId(BlockId id, const char* op) const {
  if (!IsValid(id)) {
    return InvalidArgumentError(std::string(op) + ": block id " + std::to_string(ToInt(id)) +
                                " is not in the pool [0, " + std::to_string(num_blocks()) + ")");
  }
  return Status::Ok();
}

Status BlockPool::Reclaim(BlockId id) {
  PAGEKV_RETURN_IF_ERROR(CheckId(id, "reclaim"));
  if (ref_[ToInt(id)] != 0) {
    return FailedPreconditionError("reclaim: block " + std::to_string(ToInt(id)) +
                                   " is in use, not free");
  }
  Unlink(ToInt(id));
  ref_[ToInt(id)] = 1;
  return Status::Ok();
}

Status BlockPool::IncRef(BlockId id) {
  PAGEKV_RETURN_IF_ERROR(CheckId(id, "share"));
  if (ref_[ToInt(id)] == 0) {
    return FailedPreconditionError("share: block " + std::to_string(ToInt(id)) +
                                   " is free; only a block in use can gain a reference");
  }
  ++ref_[ToInt(id)];
  return Status::Ok();
}

Status BlockPool::Release(BlockId id) {
  PAGEKV_RETURN_IF_ERROR(CheckId(id, "free"));
  const int32_t b = ToInt(id);
  if (ref_[b] == 0) {
    return FailedPreconditionError("free: block " + std::to_string(b) +
                                   " is already free (double free)");
  }
  if (--ref_[b] == 0) PushTail(b);
  return Status::Ok();
}

std::vector<BlockId> BlockPool::FreeListOrder() const {
  std::vector<BlockId> out;
  out.reserve(static_cast<size_t>(num_free()));
  for (const List& l : lists_) {
    for (int32_t b = l.head; b != kNil; b = next_[b]) out.push_back(BlockId{b});
  }
  return out;
}

std::vector<BlockId> BlockPool::CachedOrder(int64_t skip, int64_t count) const {
  std::vector<BlockId> out;
  int32_t b = lists_[1].head;
  for (int64_t i = 0; i < skip && b != kNil; ++i) b = next_[b];
  for (; b != kNil && static_cast<int64_t>(out.size()) < count; b = next_[b]) out.push_back(BlockId{b});
  return out;
}

void BlockPool::CheckInvariants() const {
  const int32_t n = num_blocks();
  int32_t zero_refs = 0;
  for (int32_t b = 0; b < n; ++b) {
    PAGEKV_CHECK_MSG(ref_[b] >= 0, "negative reference count");
    if (ref_[b] == 0) ++zero_refs;
  }
  PAGEKV_CHECK_MSG(zero_refs == num_free(), "free count differs from blocks with no reference");
  for (int which = 0; which < 2; ++which) {
    const List& l = lists_[which];
    int32_t walked = 0;
    int32_t prev = kNil;
    for (int32_t b = l.head; b != kNil; b = next_[b]) {
      PAGEKV_CHECK_MSG(b >= 0 && b < n, "free list holds an id outside the pool");
      PAGEKV_CHECK_MSG(ref_[b] == 0, "a block on the free list is referenced");
      PAGEKV_CHECK_MSG((cached_[b] != 0) == (which == 1), "a block is on the wrong free list");
      PAGEKV_CHECK_MSG(prev_[b] == prev, "free list links disagree");
      PAGEKV_CHECK_MSG(++walked <= l.size, "free list longer than its size (cycle or duplicate)");
      prev = b;
    }
    PAGEKV_CHECK_MSG(prev == l.tail, "free list tail is wrong");
    PAGEKV_CHECK_MSG(walked == l.size, "free list shorter than its size");
  }
}

}  // namespace pagekv
