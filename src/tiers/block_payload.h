// The byte format of a block outside the pool, shared by every tier
// (docs/KV_LAYOUT.md, "Tier payloads"). Little-endian:
//
//   offset  size  field
//        0     4  magic "PKVB"
//        4     2  format version (1)
//        6     1  key size (16 or 32)
//        8    32  key (zero padded)
//       40    32  parent key (zeros when none)
//       72     8  geometry tag (KvCache::GeometryTag)
//       80     4  token count (block_len)
//       84     4  zero
//       88     8  KV byte count
//        7     1  flags: bit 0 = has a parent key, bit 1 = sealed with a key
//       96     8  unkeyed: xxh3-64 of bytes [0, 96) and [104, end); keyed: zero
//      104    32  prefix digest (BlockMeta::digest: SHA-256 over the whole prefix)
//      136  4*n  token ids (int32)
//        .     .  KV bytes (KvCache::ReadBlock order)
//      end-32 32  keyed: HMAC-SHA-256 of bytes [0, end-32) under the tier key; unkeyed: zero
//
// A keyed seal authenticates the whole payload (header, tokens, KV): without
// the key nobody can forge a block, alter one, or re-seal it after altering
// it, and a block sealed under another key is refused. The unkeyed checksum
// catches accidents only (anyone who can write the store can re-seal it).
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
inline constexpr size_t kTagBytes = 32;
inline constexpr uint16_t kVersion = 3;

// How a store seals its payloads: keyed (HMAC-SHA-256 under a secret) or
// unkeyed (the xxh3-64 checksum). Copyable; the key never leaves it.
class PayloadSeal {
 public:
  PayloadSeal() = default;                            // unkeyed
  explicit PayloadSeal(std::string key) : key_(std::move(key)) {}  // keyed when non-empty
  static PayloadSeal Random();                        // a fresh 32-byte key from the OS (this process only)
  bool keyed() const { return !key_.empty(); }
  // HMAC-SHA-256 of data under the key (REQUIRES: keyed()).
  void Tag(std::span<const std::byte> data, std::span<std::byte, kTagBytes> out) const;

 private:
  std::string key_;
};

size_t PayloadBytes(size_t num_tokens, size_t kv_bytes);

// Writes the payload of (meta, kv) into out (resized).
void EncodePayload(const BlockMeta& meta, std::span<const std::byte> kv, const PayloadSeal& seal,
                   std::vector<std::byte>& out);
// The same into a buffer of exactly PayloadBytes(...) bytes.
void EncodePayloadInto(const BlockMeta& meta, std::span<const std::byte> kv, const PayloadSeal& seal,
                       std::span<std::byte> out);

// Checks `payload` against `meta` (its seal first: the MAC under seal's key,
// or the checksum; then every header field, the prefix digest, the token
// ids, the size) and copies its KV into kv. Errors (kDataLoss) name the
// first failed check: truncated, bad magic, version, not authentic, sealed
// with / without a key, checksum, key, parent, prefix, tokens, geometry, size.
Status DecodePayload(std::span<const std::byte> payload, const BlockMeta& meta, std::span<std::byte> kv,
                     const PayloadSeal& seal);
// Whether a DecodePayload error is a failed authentication (a forged or
// altered block, one sealed under another key, or an unkeyed one where a
// key is required): counted apart from accidental corruption.
bool IsNotAuthentic(const Status& s);

// The key stored in a payload header (no other check); for indexes rebuilt
// from data.
bool PeekKey(std::span<const std::byte> payload, BlockKey& key);

}  // namespace pagekv::tiers
