// Tier payload encode/decode (block_payload.h).
#include "tiers/block_payload.h"

#include <cstring>

#include <xxhash.h>

namespace pagekv::tiers {
namespace {

constexpr char kMagic[4] = {'P', 'K', 'V', 'B'};

template <typename T>
void Put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);  // the supported targets are little-endian
}
template <typename T>
T Get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

uint64_t Checksum(std::span<const std::byte> payload) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, payload.data(), 96);
  XXH3_64bits_update(st, payload.data() + 104, payload.size() - 104);
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

}  // namespace

size_t PayloadBytes(size_t num_tokens, size_t kv_bytes) { return kHeaderBytes + 4 * num_tokens + kv_bytes; }

void EncodePayloadInto(const BlockMeta& meta, std::span<const std::byte> kv, std::span<std::byte> out) {
  std::byte* p = out.data();
  std::memset(p, 0, kHeaderBytes);
  std::memcpy(p, kMagic, 4);
  Put<uint16_t>(p + 4, kVersion);
  Put<uint8_t>(p + 6, meta.key.size);
  Put<uint8_t>(p + 7, meta.parent ? 1 : 0);
  std::memcpy(p + 8, meta.key.bytes.data(), 32);
  if (meta.parent) std::memcpy(p + 40, meta.parent->bytes.data(), 32);
  Put<uint64_t>(p + 72, meta.geometry);
  Put<uint32_t>(p + 80, static_cast<uint32_t>(meta.tokens.size()));
  Put<uint64_t>(p + 88, kv.size());
  std::memcpy(p + 104, meta.digest.bytes.data(), 32);
  std::memcpy(p + kHeaderBytes, meta.tokens.data(), 4 * meta.tokens.size());
  std::memcpy(p + kHeaderBytes + 4 * meta.tokens.size(), kv.data(), kv.size());
  Put<uint64_t>(p + 96, Checksum(out.first(PayloadBytes(meta.tokens.size(), kv.size()))));
}

void EncodePayload(const BlockMeta& meta, std::span<const std::byte> kv, std::vector<std::byte>& out) {
  out.resize(PayloadBytes(meta.tokens.size(), kv.size()));
  EncodePayloadInto(meta, kv, out);
}

Status DecodePayload(std::span<const std::byte> payload, const BlockMeta& meta, std::span<std::byte> kv) {
  const size_t want = PayloadBytes(meta.tokens.size(), kv.size());
  if (payload.size() < kHeaderBytes) {
    return DataLossError("tier payload truncated: " + std::to_string(payload.size()) + " bytes, less than its header");
  }
  const std::byte* p = payload.data();
  if (std::memcmp(p, kMagic, 4) != 0) return DataLossError("tier payload: bad magic (not a PageKV block)");
  if (Get<uint16_t>(p + 4) != kVersion) {
    return DataLossError("tier payload: format version " + std::to_string(Get<uint16_t>(p + 4)) + ", expected " +
                         std::to_string(kVersion));
  }
  const uint64_t kv_len = Get<uint64_t>(p + 88);
  const uint32_t n = Get<uint32_t>(p + 80);
  if (n != meta.tokens.size() || kv_len != kv.size()) {
    return DataLossError("tier payload: shape " + std::to_string(n) + " tokens / " + std::to_string(kv_len) +
                         " KV bytes, expected " + std::to_string(meta.tokens.size()) + " / " + std::to_string(kv.size()));
  }
  if (payload.size() < want) {
    return DataLossError("tier payload truncated: " + std::to_string(payload.size()) + " of " + std::to_string(want) +
                         " bytes");
  }
  payload = payload.first(want);  // slots may be padded past the payload
  if (Get<uint64_t>(p + 96) != Checksum(payload)) return DataLossError("tier payload: checksum mismatch");
  if (Get<uint8_t>(p + 6) != meta.key.size || std::memcmp(p + 8, meta.key.bytes.data(), 32) != 0) {
    return DataLossError("tier payload: stored under another key");
  }
  const bool has_parent = Get<uint8_t>(p + 7) & 1;
  if (has_parent != meta.parent.has_value() ||
      (has_parent && std::memcmp(p + 40, meta.parent->bytes.data(), 32) != 0)) {
    return DataLossError("tier payload: another parent block");
  }
  if (std::memcmp(p + 104, meta.digest.bytes.data(), 32) != 0) {
    return DataLossError("tier payload: computed after another prefix (same key and parent key, a hash collision)");
  }
  if (Get<uint64_t>(p + 72) != meta.geometry) {
    return DataLossError("tier payload: another cache geometry (layers, heads, dtype or block length)");
  }
  if (std::memcmp(p + kHeaderBytes, meta.tokens.data(), 4 * n) != 0) {
    return DataLossError("tier payload: other token ids under the same key (a hash collision)");
  }
  std::memcpy(kv.data(), p + kHeaderBytes + 4 * n, kv.size());
  return Status::Ok();
}

bool PeekKey(std::span<const std::byte> payload, BlockKey& key) {
  if (payload.size() < kHeaderBytes || std::memcmp(payload.data(), kMagic, 4) != 0) return false;
  key.size = Get<uint8_t>(payload.data() + 6);
  std::memcpy(key.bytes.data(), payload.data() + 8, 32);
  return true;
}

}  // namespace pagekv::tiers
