#include "engine/agreed_tiers.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "base/check.h"

namespace pagekv {

AgreedTiers::AgreedTiers(LowerTiers& inner, std::shared_ptr<Communicator> all) : inner_(inner), all_(std::move(all)) {
  PAGEKV_CHECK(all_ != nullptr);
}

int64_t AgreedTiers::AgreeMin(int64_t value) {
  std::vector<int64_t> every(static_cast<size_t>(all_->size()));
  if (Status s = all_->AllGather(&value, sizeof value, every.data()); !s.ok()) {
    std::fprintf(stderr, "pagekv: rank %d could not agree on a KV tier answer with the other ranks: %s; aborting every rank\n",
                 all_->rank(), s.message().c_str());
    all_->Abort(3);
  }
  return *std::min_element(every.begin(), every.end());
}

std::vector<Tier> AgreedTiers::LocatePrefix(std::span<const BlockKey> keys) {
  std::vector<Tier> found = inner_.LocatePrefix(keys);
  const int64_t agreed = AgreeMin(static_cast<int64_t>(found.size()));
  if (agreed < static_cast<int64_t>(found.size())) {
    ++overruled_;
    found.resize(static_cast<size_t>(agreed));
  }
  return found;
}

std::optional<Tier> AgreedTiers::Load(const BlockMeta& meta, std::span<std::byte> kv) {
  const std::optional<Tier> from = inner_.Load(meta, kv);
  if (AgreeMin(from.has_value() ? 1 : 0) == 1) return from;
  if (from) ++overruled_;
  return std::nullopt;
}

bool AgreedTiers::StillHolds(const BlockKey& key, Tier tier) {
  const bool here = inner_.StillHolds(key, tier);
  const bool everywhere = AgreeMin(here ? 1 : 0) == 1;
  if (here && !everywhere) ++overruled_;
  return everywhere;
}

void AgreedTiers::StartLoads(std::vector<TierLoadJob> /*jobs*/) {
  PAGEKV_CHECK_MSG(false, "AgreedTiers: background tier loads under sharding (the engine moves blocks in line)");
}

void AgreedTiers::StartOffloads(std::vector<TierOffloadJob> /*jobs*/) {
  PAGEKV_CHECK_MSG(false, "AgreedTiers: background tier offloads under sharding (the engine moves blocks in line)");
}

}  // namespace pagekv
