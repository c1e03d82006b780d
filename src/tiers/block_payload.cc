// Tier payload encode/decode (block_payload.h).
#include "tiers/block_payload.h"

#include <cstring>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <xxhash.h>

#include "base/check.h"

namespace pagekv::tiers {
namespace {

constexpr char kMagic[4] = {'P', 'K', 'V', 'B'};
constexpr uint8_t kHasParent = 1, kKeyed = 2;
constexpr char kNotAuthentic[] = "tier payload: not authentic";

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

PayloadSeal PayloadSeal::Random() {
  std::string key(32, '\0');
  PAGEKV_CHECK_MSG(RAND_bytes(reinterpret_cast<unsigned char*>(key.data()), static_cast<int>(key.size())) == 1,
                   "tiers: the OS gave no random bytes for the payload key");
  return PayloadSeal(std::move(key));
}

void PayloadSeal::Tag(std::span<const std::byte> data, std::span<std::byte, kTagBytes> out) const {
  PAGEKV_CHECK(keyed());
  unsigned int len = 0;
  PAGEKV_CHECK(HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()),
                    reinterpret_cast<const unsigned char*>(data.data()), data.size(),
                    reinterpret_cast<unsigned char*>(out.data()), &len) != nullptr &&
               len == kTagBytes);
}

bool IsNotAuthentic(const Status& s) {
  return s.code() == StatusCode::kDataLoss && s.message().rfind(kNotAuthentic, 0) == 0;
}

size_t PayloadBytes(size_t num_tokens, size_t kv_bytes) {
  return kHeaderBytes + 4 * num_tokens + kv_bytes + kTagBytes;
}

void EncodePayloadInto(const BlockMeta& meta, std::span<const std::byte> kv, const PayloadSeal& seal,
                       std::span<std::byte> out) {
  std::byte* p = out.data();
  std::memset(p, 0, kHeaderBytes);
  std::memcpy(p, kMagic, 4);
  Put<uint16_t>(p + 4, kVersion);
  Put<uint8_t>(p + 6, meta.key.size);
  Put<uint8_t>(p + 7, static_cast<uint8_t>((meta.parent ? kHasParent : 0) | (seal.keyed() ? kKeyed : 0)));
  std::memcpy(p + 8, meta.key.bytes.data(), 32);
  if (meta.parent) std::memcpy(p + 40, meta.parent->bytes.data(), 32);
  Put<uint64_t>(p + 72, meta.geometry);
  Put<uint32_t>(p + 80, static_cast<uint32_t>(meta.tokens.size()));
  Put<uint64_t>(p + 88, kv.size());
  std::memcpy(p + 104, meta.digest.bytes.data(), 32);
  if (!meta.tokens.empty()) std::memcpy(p + kHeaderBytes, meta.tokens.data(), 4 * meta.tokens.size());
  if (!kv.empty()) std::memcpy(p + kHeaderBytes + 4 * meta.tokens.size(), kv.data(), kv.size());
  const size_t n = PayloadBytes(meta.tokens.size(), kv.size());
  std::span<std::byte, kTagBytes> tag = out.subspan(n - kTagBytes).first<kTagBytes>();
  std::memset(tag.data(), 0, kTagBytes);
  if (seal.keyed()) {
    seal.Tag(out.first(n - kTagBytes), tag);
  } else {
    Put<uint64_t>(p + 96, Checksum(out.first(n)));
  }
}

void EncodePayload(const BlockMeta& meta, std::span<const std::byte> kv, const PayloadSeal& seal,
                   std::vector<std::byte>& out) {
  out.resize(PayloadBytes(meta.tokens.size(), kv.size()));
  EncodePayloadInto(meta, kv, seal, out);
}

Status DecodePayload(std::span<const std::byte> payload, const BlockMeta& meta, std::span<std::byte> kv,
                     const PayloadSeal& seal) {
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
  const bool keyed = (Get<uint8_t>(p + 7) & kKeyed) != 0;
  if (seal.keyed()) {
    // Before any other field is trusted: a forged header could say anything.
    if (!keyed) {
      return DataLossError(std::string(kNotAuthentic) + ": sealed without a key where this store requires one");
    }
    std::byte tag[kTagBytes];
    seal.Tag(payload.first(want - kTagBytes), std::span<std::byte, kTagBytes>(tag));
    if (CRYPTO_memcmp(tag, payload.data() + want - kTagBytes, kTagBytes) != 0) {
      return DataLossError(std::string(kNotAuthentic) + ": its MAC fails (altered, forged, or sealed under another key)");
    }
  } else {
    if (keyed) {
      // Not ours to judge: counted as unauthenticated, so a shared tier
      // (Redis) leaves it for the processes that hold the key.
      return DataLossError(std::string(kNotAuthentic) +
                           ": sealed with a key and this process has none (give the same --tier-key-env or "
                           "--tier-key-file as the process that stored it)");
    }
    if (Get<uint64_t>(p + 96) != Checksum(payload)) return DataLossError("tier payload: checksum mismatch");
  }
  if (Get<uint8_t>(p + 6) != meta.key.size || std::memcmp(p + 8, meta.key.bytes.data(), 32) != 0) {
    return DataLossError("tier payload: stored under another key");
  }
  const bool has_parent = (Get<uint8_t>(p + 7) & kHasParent) != 0;
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
  if (!kv.empty()) std::memcpy(kv.data(), p + kHeaderBytes + 4 * n, kv.size());
  return Status::Ok();
}

bool PeekKey(std::span<const std::byte> payload, BlockKey& key) {
  if (payload.size() < kHeaderBytes || std::memcmp(payload.data(), kMagic, 4) != 0) return false;
  key.size = Get<uint8_t>(payload.data() + 6);
  std::memcpy(key.bytes.data(), payload.data() + 8, 32);
  return true;
}

}  // namespace pagekv::tiers
