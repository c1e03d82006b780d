// The host-memory tier (include/pagekv/tiers.h): a preallocated arena of
// payload-sized slots, a key index and an LRU list.
#include <list>
#include <mutex>
#include <unordered_map>

#include "base/check.h"
#include "pagekv/tiers.h"
#include "tiers/block_payload.h"
#include "tiers/key_hash.h"

namespace pagekv {
namespace {

class HostStore final : public BlockStore {
 public:
  HostStore(const HostStoreOptions& o, size_t slot_bytes, size_t slots)
      : o_(o), slot_bytes_(slot_bytes), arena_(slot_bytes * slots), metas_(slots) {
    for (size_t i = slots; i-- > 0;) free_.push_back(i);
  }

  Tier tier() const override { return Tier::kHost; }

  Status Put(const BlockMeta& meta, std::span<const std::byte> kv) override {
    if (tiers::PayloadBytes(meta.tokens.size(), kv.size()) > slot_bytes_) {
      return InvalidArgumentError("host tier: a block of " + std::to_string(kv.size()) +
                                  " KV bytes does not fit its slots of " + std::to_string(slot_bytes_));
    }
    std::lock_guard lock(mu_);
    size_t slot;
    bool replaced = false;
    if (auto it = index_.find(meta.key); it != index_.end()) {
      slot = it->second.slot;
      lru_.erase(it->second.at);
      index_.erase(it);
      replaced = true;
    } else if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slot = lru_.front();  // least recently used
      lru_.pop_front();
      const BlockMeta& old = metas_[slot];
      if (o_.on_evict) o_.on_evict(old, Kv(slot, old.tokens.size()));
      index_.erase(old.key);
      Changed(TierChange::Kind::kRemoved, old);
      ++stats_.evictions;
    }
    tiers::EncodePayloadInto(meta, kv, seal_, Slot(slot));
    metas_[slot] = meta;
    lru_.push_back(slot);
    index_[meta.key] = Where{slot, std::prev(lru_.end())};
    ++stats_.puts;
    if (!replaced) Changed(TierChange::Kind::kStored, meta);
    return Status::Ok();
  }

  Result<bool> Get(const BlockMeta& meta, std::span<std::byte> kv) override {
    std::lock_guard lock(mu_);
    ++stats_.gets;
    auto it = index_.find(meta.key);
    if (it == index_.end()) {
      ++stats_.misses;
      return false;
    }
    const size_t slot = it->second.slot;
    if (const Status d = tiers::DecodePayload(Slot(slot), meta, kv, seal_); !d.ok()) {
      ++stats_.corrupt;
      if (tiers::IsNotAuthentic(d)) ++stats_.unauthenticated;
      ++stats_.misses;
      Drop(it);
      return false;
    }
    lru_.splice(lru_.end(), lru_, it->second.at);  // most recently used
    ++stats_.hits;
    return true;
  }

  Result<bool> Contains(const BlockKey& key) override {
    std::lock_guard lock(mu_);
    return index_.count(key) > 0;
  }

  // Every slot is free or held, once; the LRU holds exactly the indexed
  // slots; each index entry names its slot's key.
  void CheckInvariants() const override {
    std::lock_guard lock(mu_);
    std::vector<int> seen(metas_.size(), 0);
    for (size_t s : free_) {
      PAGEKV_CHECK_MSG(s < seen.size() && seen[s]++ == 0, "host tier: a free slot is out of range or listed twice");
    }
    PAGEKV_CHECK_MSG(lru_.size() == index_.size(), "host tier: the LRU and the index differ in size");
    PAGEKV_CHECK_MSG(free_.size() + index_.size() == metas_.size(), "host tier: free + held slots != slots");
    for (const auto& [key, where] : index_) {
      PAGEKV_CHECK_MSG(*where.at == where.slot, "host tier: an index entry's LRU node names another slot");
      PAGEKV_CHECK_MSG(seen[where.slot]++ == 0, "host tier: a slot is both free and held, or held twice");
      PAGEKV_CHECK_MSG(metas_[where.slot].key == key, "host tier: a slot holds another key than its index entry");
    }
  }

  Status Remove(const BlockKey& key) override {
    std::lock_guard lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) Drop(it);
    return Status::Ok();
  }

  int64_t capacity_bytes() const override { return static_cast<int64_t>(arena_.size()); }

  TierStats Stats() const override {
    std::lock_guard lock(mu_);
    TierStats s = stats_;
    s.name = "host";
    s.blocks_now = static_cast<int64_t>(index_.size());
    s.bytes_now = s.blocks_now * static_cast<int64_t>(slot_bytes_);
    s.capacity_bytes = capacity_bytes();
    return s;
  }

 private:
  struct Where {
    size_t slot;
    std::list<size_t>::iterator at;
  };
  using Index = std::unordered_map<BlockKey, Where, tiers::KeyHash>;

  std::span<std::byte> Slot(size_t s) { return std::span(arena_).subspan(s * slot_bytes_, slot_bytes_); }
  std::span<const std::byte> Kv(size_t s, size_t tokens) {
    return Slot(s).subspan(tiers::kHeaderBytes + 4 * tokens, static_cast<size_t>(o_.kv_bytes));
  }
  void Drop(Index::iterator it) {
    lru_.erase(it->second.at);
    free_.push_back(it->second.slot);
    Changed(TierChange::Kind::kRemoved, metas_[it->second.slot]);
    index_.erase(it);
  }
  // REQUIRES: mu_ held.
  void Changed(TierChange::Kind kind, const BlockMeta& meta) {
    if (o_.on_change) o_.on_change(TierChange{kind, Tier::kHost, meta});
  }

  const HostStoreOptions o_;
  const tiers::PayloadSeal seal_{o_.payload_key};
  const size_t slot_bytes_;
  mutable std::mutex mu_;
  std::vector<std::byte> arena_;  // [slots][slot_bytes]
  std::vector<BlockMeta> metas_;  // [slots], of held slots
  std::vector<size_t> free_;
  std::list<size_t> lru_;         // least recently used first
  Index index_;
  TierStats stats_;
};

}  // namespace

Result<std::unique_ptr<BlockStore>> CreateHostStore(const HostStoreOptions& o) {
  if (o.block_len < 1 || o.kv_bytes < 1) return InvalidArgumentError("host tier: block_len and kv_bytes must be positive");
  const size_t slot = tiers::PayloadBytes(static_cast<size_t>(o.block_len), static_cast<size_t>(o.kv_bytes));
  if (o.capacity_bytes < static_cast<int64_t>(slot)) {
    return InvalidArgumentError("host tier: " + std::to_string(o.capacity_bytes) + " bytes hold no block; one takes " +
                                std::to_string(slot) + " (raise --host-cache)");
  }
  const size_t slots = static_cast<size_t>(o.capacity_bytes) / slot;
  try {
    return std::unique_ptr<BlockStore>(new HostStore(o, slot, slots));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("host tier: cannot allocate " + std::to_string(slot * slots) + " bytes");
  }
}

}  // namespace pagekv
