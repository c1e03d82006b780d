// The lower KV tiers of one rank of a sharded engine, made to answer as the
// whole job does. Every rank runs the same scheduler on the same inputs and
// must therefore take the same decisions; a decision that rests on a tier's
// answer (how far a prefix continues below the pool, whether a block could
// be loaded, whether an offloaded copy is still there) would split the ranks
// wherever one rank's tiers differ from another's (a RAM tier that holds
// fewer blocks of a wider shard, a Redis key evicted for one shard only, a
// disk read that fails on one machine). AgreedTiers asks this rank's tiers,
// then takes the job's answer: the shortest prefix any rank has, a load that
// succeeded on every rank. A rank whose load succeeded where another's failed
// recomputes the block like the others (the prefix cache counts it as a
// failed load).
//
// Each call is a collective over `all`: every rank reaches the same calls in
// the same order (they follow the agreed steps). A collective that fails
// mid-job ends every rank (Communicator::Abort): a rank that went on alone
// would step on KV the others do not hold.
//
// Background moves (StartLoads / StartOffloads) finish on the tiers' threads
// at times no two ranks share: a sharded engine moves blocks in line.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "pagekv/dist.h"
#include "pagekv/prefix_cache.h"

namespace pagekv {

class AgreedTiers final : public LowerTiers {
 public:
  // `inner` (this rank's tiers) must outlive this.
  AgreedTiers(LowerTiers& inner, std::shared_ptr<Communicator> all);

  std::vector<Tier> LocatePrefix(std::span<const BlockKey> keys) override;
  std::optional<Tier> Load(const BlockMeta& meta, std::span<std::byte> kv) override;
  bool write_through() const override { return inner_.write_through(); }
  void Published(const BlockMeta& meta, std::span<const std::byte> kv) override { inner_.Published(meta, kv); }
  // Where this rank's copy went; no decision rests on it (the block is found
  // again, or not, through LocatePrefix).
  std::optional<Tier> Evicted(const BlockMeta& meta, std::span<const std::byte> kv) override {
    return inner_.Evicted(meta, kv);
  }
  void Prefetch(std::vector<BlockMeta> metas) override { inner_.Prefetch(std::move(metas)); }
  // Never called: the engine moves blocks in line under sharding (aborts).
  void StartLoads(std::vector<TierLoadJob> jobs) override;
  void StartOffloads(std::vector<TierOffloadJob> jobs) override;
  bool StillHolds(const BlockKey& key, Tier tier) override;
  void RecordChanges(bool on) override { inner_.RecordChanges(on); }
  std::vector<TierChange> TakeChanges() override { return inner_.TakeChanges(); }

  // Answers where this rank's tiers and the job's differed (this rank had
  // more of a prefix, or loaded a block another rank could not).
  int64_t overruled() const { return overruled_; }

 private:
  // The least of every rank's value.
  int64_t AgreeMin(int64_t value);

  LowerTiers& inner_;
  std::shared_ptr<Communicator> all_;
  int64_t overruled_ = 0;
};

}  // namespace pagekv
