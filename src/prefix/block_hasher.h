// Block keys (include/pagekv/prefix_cache.h): the exact bytes hashed, and
// the two hash functions.
//
// Input of H for one block, all integers little-endian:
//   "pagekv-block-v1"            15 bytes, a domain tag
//   u8 has_parent, then 32 bytes of the parent key (zeros for the first block)
//   u32 token count, then each token id as i32
//   u8 number of extra fields, then per field: u8 tag, u32 length, bytes
//     tag 1: cache salt (first block only), 2: adapter id (i64), 3: model
//     fingerprint, 4: an extra key
// Equal inputs give equal keys on every platform (xxh3 with the same seed).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "pagekv/prefix_cache.h"

namespace pagekv::prefix {

void EncodeBlock(const BlockKey* parent, std::span<const int32_t> tokens, const ExtraKeys& extra,
                 std::vector<uint8_t>& out);

// What a hybrid cache's group g > 0 stores a block's key (or digest) under
// in the lower tiers: H("pagekv-group-v1" || u32 g || u8 size || key bytes).
void EncodeGroupKey(const BlockKey& key, int32_t group, std::vector<uint8_t>& out);

// SHA-256 of `in` as a 32-byte key (the default hash, and every prefix
// digest whatever the key hash is).
BlockKey Sha256Key(std::span<const uint8_t> in);

// A ready hash function for `options` (the xxh3 seed drawn here if unset).
std::function<BlockKey(std::span<const uint8_t>)> MakeHasher(const BlockHasherOptions& options);

}  // namespace pagekv::prefix
