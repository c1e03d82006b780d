#include "kvcache/block_pool.h"

#include <string>

#include "base/check.h"

namespace pagekv {

BlockPool::BlockPool(int32_t num_blocks)
    : ref_(static_cast<size_t>(num_blocks), 0),
      prev_(static_cast<size_t>(num_blocks), kNil),
      next_(static_cast<size_t>(num_blocks), kNil) {
  PAGEKV_CHECK(num_blocks > 0);
  for (int32_t b = 0; b < num_blocks; ++b) PushTail(b);
}

void BlockPool::PushTail(int32_t b) {
  prev_[b] = tail_;
  next_[b] = kNil;
  if (tail_ == kNil) {
    head_ = b;
  } else {
    next_[tail_] = b;
  }
  tail_ = b;
  ++num_free_;
}

void BlockPool::Unlink(int32_t b) {
  const int32_t p = prev_[b];
  const int32_t n = next_[b];
  if (p == kNil) head_ = n; else next_[p] = n;
  if (n == kNil) tail_ = p; else prev_[n] = p;
  prev_[b] = next_[b] = kNil;
  --num_free_;
}

bool BlockPool::Allocate(int32_t n, std::vector<BlockId>& out) {
  if (!CanAllocate(n)) return false;
  out.reserve(out.size() + static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = head_;
    Unlink(b);
    ref_[b] = 1;
    out.push_back(BlockId{b});
  }
  return true;
}

std::optional<BlockId> BlockPool::AllocateOne() {
  if (num_free_ == 0) return std::nullopt;
  const int32_t b = head_;
  Unlink(b);
  ref_[b] = 1;
  return BlockId{b};
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
  out.reserve(static_cast<size_t>(num_free_));
  for (int32_t b = head_; b != kNil; b = next_[b]) out.push_back(BlockId{b});
  return out;
}

void BlockPool::CheckInvariants() const {
  const int32_t n = num_blocks();
  int32_t zero_refs = 0;
  for (int32_t b = 0; b < n; ++b) {
    PAGEKV_CHECK_MSG(ref_[b] >= 0, "negative reference count");
    if (ref_[b] == 0) ++zero_refs;
  }
  PAGEKV_CHECK_MSG(zero_refs == num_free_, "free count differs from blocks with no reference");
  int32_t walked = 0;
  int32_t prev = kNil;
  for (int32_t b = head_; b != kNil; b = next_[b]) {
    PAGEKV_CHECK_MSG(b >= 0 && b < n, "free list holds an id outside the pool");
    PAGEKV_CHECK_MSG(ref_[b] == 0, "a block on the free list is referenced");
    PAGEKV_CHECK_MSG(prev_[b] == prev, "free list links disagree");
    PAGEKV_CHECK_MSG(++walked <= num_free_, "free list longer than num_free (cycle or duplicate)");
    prev = b;
  }
  PAGEKV_CHECK_MSG(prev == tail_, "free list tail is wrong");
  PAGEKV_CHECK_MSG(walked == num_free_, "free list shorter than num_free");
}

}  // namespace pagekv
