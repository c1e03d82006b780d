// Hashing a BlockKey for unordered containers (its bytes are already a hash).
#pragma once

#include <cstring>

#include "pagekv/prefix_cache.h"

namespace pagekv::tiers {

struct KeyHash {
  size_t operator()(const BlockKey& k) const {
    uint64_t h;
    std::memcpy(&h, k.bytes.data(), 8);
    return static_cast<size_t>(h ^ k.size);
  }
};

}  // namespace pagekv::tiers
