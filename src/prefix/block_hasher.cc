#include "prefix/block_hasher.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <cstring>
#include <random>

#include "base/check.h"

namespace pagekv::prefix {
namespace {

constexpr char kDomain[] = "pagekv-block-v1";

void PutU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void PutBytes(std::vector<uint8_t>& out, const void* data, size_t n) {
  if (n == 0) return;
  const size_t at = out.size();
  out.resize(at + n);
  std::memcpy(out.data() + at, data, n);
}

void PutField(std::vector<uint8_t>& out, uint8_t tag, const void* data, size_t n) {
  out.push_back(tag);
  PutU32(out, static_cast<uint32_t>(n));
  PutBytes(out, data, n);
}

}  // namespace

BlockKey Sha256Key(std::span<const uint8_t> in) {
  BlockKey key;
  key.size = 32;
  unsigned int len = 0;
  // EVP_Digest: one-shot SHA-256; fails only on allocation failure inside OpenSSL.
  PAGEKV_CHECK(EVP_Digest(in.data(), in.size(), key.bytes.data(), &len, EVP_sha256(), nullptr) == 1 && len == 32);
  return key;
}

void EncodeBlock(const BlockKey* parent, std::span<const int32_t> tokens, const ExtraKeys& extra,
                 std::vector<uint8_t>& out) {
  out.clear();
  PutBytes(out, kDomain, sizeof(kDomain) - 1);
  out.push_back(parent != nullptr ? 1 : 0);
  static constexpr uint8_t kZeros[32] = {};
  PutBytes(out, parent != nullptr ? parent->bytes.data() : kZeros, 32);
  PutU32(out, static_cast<uint32_t>(tokens.size()));
  for (int32_t t : tokens) PutU32(out, static_cast<uint32_t>(t));
  const bool salted = parent == nullptr && extra.cache_salt.has_value();
  const size_t fields = (salted ? 1 : 0) + 1 + (extra.model_fingerprint.empty() ? 0 : 1) + extra.extra.size();
  out.push_back(static_cast<uint8_t>(fields));
  if (salted) PutField(out, 1, extra.cache_salt->data(), extra.cache_salt->size());
  uint8_t adapter[8];
  for (int i = 0; i < 8; ++i) adapter[i] = static_cast<uint8_t>(static_cast<uint64_t>(extra.adapter_id) >> (8 * i));
  PutField(out, 2, adapter, 8);
  if (!extra.model_fingerprint.empty()) PutField(out, 3, extra.model_fingerprint.data(), extra.model_fingerprint.size());
  for (const std::string& e : extra.extra) PutField(out, 4, e.data(), e.size());
}

void EncodeGroupKey(const BlockKey& key, int32_t group, std::vector<uint8_t>& out) {
  static constexpr char kGroupDomain[] = "pagekv-group-v1";
  out.clear();
  PutBytes(out, kGroupDomain, sizeof(kGroupDomain) - 1);
  PutU32(out, static_cast<uint32_t>(group));
  out.push_back(key.size);
  PutBytes(out, key.bytes.data(), key.size);
}

std::function<BlockKey(std::span<const uint8_t>)> MakeHasher(const BlockHasherOptions& options) {
  if (options.custom) return options.custom;
  if (options.kind == BlockHashKind::kSha256) return Sha256Key;
  const uint64_t seed = options.seed.has_value() ? *options.seed : std::random_device{}() * 0x100000001ull ^ std::random_device{}();
  return [seed](std::span<const uint8_t> in) {
    const XXH128_hash_t h = XXH3_128bits_withSeed(in.data(), in.size(), seed);
    BlockKey key;
    key.size = 16;
    std::memcpy(key.bytes.data(), &h.low64, 8);
    std::memcpy(key.bytes.data() + 8, &h.high64, 8);
    return key;
  };
}

}  // namespace pagekv::prefix

namespace pagekv {

BlockKey Sha256BlockKey(const BlockKey* parent, std::span<const int32_t> tokens, const ExtraKeys& extra) {
  std::vector<uint8_t> bytes;
  prefix::EncodeBlock(parent, tokens, extra, bytes);
  return prefix::Sha256Key(bytes);
}

}  // namespace pagekv
