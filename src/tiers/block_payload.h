// The byte format of a block outside the pool, shared by every tier
// (docs/KV_LAYOUT.md, "Tier payloads"). Little-endian:
//
//   offset  size  field
//        0     4  magic "PKVB"
//        4     2  format version (1)
//        6     1  key size (16 or 32)
//        7     1  flags: bit 0 = has a parent key
//        8    32  key (zero padded)
//       40    32  parent key (zeros when none)
//       72     8  geometry tag (KvCache::GeometryTag)
//       80     4  token count (block_len)
//       84     4  zero
//       88     8  KV byte count
//       96     8  xxh3-64 of bytes [0, 96) and [104, end)
//      104    32  prefix digest (BlockMeta::digest: SHA-256 over the whole prefix)
//      136  4*n  token ids (int32)
//        .     .  KV bytes (KvCache::ReadBlock order)
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pagekv/prefix_cache.h"
#include "pagekv/status.h"

namespace pagekv::tiers {

inline constexpr size_t kHeaderBytes = 136;
inline constexpr uint16_t kVersion = 2;

size_t PayloadBytes(size_t num_tokens, size_t kv_bytes);

// Writes the payload of (meta, kv) into out (resized).
void EncodePayload(const BlockMeta& meta, std::span<const std::byte> kv, std::vector<std::byte>& out);
// The same into a buffer of exactly PayloadBytes(...) bytes.
void EncodePayloadInto(const BlockMeta& meta, std::span<const std::byte> kv, std::span<std::byte> out);

// Checks `payload` against `meta` (every header field, the prefix digest,
// the token ids, the checksum, the size) and copies its KV into kv. Errors
// (kDataLoss) name the first failed check: truncated, bad magic, version,
// checksum, key, parent, prefix, tokens, geometry, size.
Status DecodePayload(std::span<const std::byte> payload, const BlockMeta& meta, std::span<std::byte> kv);

// The key stored in a payload header (no other check); for indexes rebuilt
// from data.
bool PeekKey(std::span<const std::byte> payload, BlockKey& key);

}  // namespace pagekv::tiers
