// libFuzzer target: tier payloads as a store hands them back (a disk file
// or a Redis value that anyone with write access to the store may have
// changed). The input describes a block (key, parent, tokens, geometry,
// prefix digest, KV bytes, keyed or unkeyed seal); the real encoder seals
// it; then the input's edits change it: bytes flipped, the payload cut or
// extended, the block it is loaded for altered. What must hold: the
// untouched payload (bytes past its end are a slot's padding) loads its own
// KV bit for bit; after any edit of its bytes or of the block it is loaded
// for, the load is an error (never wrong KV); a payload sealed one way never loads under the
// other; nothing crashes or leaks. Built in the asan build; `make fuzz`
// runs it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "tiers/block_payload.h"

namespace {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t Byte() { return at_ < size_ ? data_[at_++] : 0; }
  uint64_t Bytes(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{Byte()} << (8 * i);
    return v;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

pagekv::BlockKey Key(Input& in, uint8_t size) {
  pagekv::BlockKey k;
  k.size = size;
  for (uint8_t i = 0; i < size; ++i) k.bytes[i] = in.Byte();
  return k;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagekv;
  Input in(data, size);
  const uint8_t flags = in.Byte();
  const tiers::PayloadSeal keyed(std::string(16, 'k')), unkeyed;
  const tiers::PayloadSeal& seal = (flags & 1) ? keyed : unkeyed;
  const tiers::PayloadSeal& other = (flags & 1) ? unkeyed : keyed;
  const uint8_t key_size = (flags & 2) ? 16 : 32;
  BlockMeta meta;
  meta.key = Key(in, key_size);
  if (flags & 4) meta.parent = Key(in, key_size);
  meta.tokens.resize(1 + in.Byte() % 16);
  for (int32_t& t : meta.tokens) t = static_cast<int32_t>(in.Bytes(4));
  meta.geometry = in.Bytes(8);
  meta.digest = Key(in, 32);
  std::vector<std::byte> kv(in.Byte() % 256);
  for (std::byte& b : kv) b = std::byte{in.Byte()};

  std::vector<std::byte> payload;
  tiers::EncodePayload(meta, kv, seal, payload);
  if (payload.size() != tiers::PayloadBytes(meta.tokens.size(), kv.size())) std::abort();
  std::vector<std::byte> out(kv.size());
  if (!tiers::DecodePayload(payload, meta, out, seal).ok() || out != kv) std::abort();  // its own KV
  if (tiers::DecodePayload(payload, meta, out, other).ok()) std::abort();                // the other seal

  BlockMeta want = meta;
  const std::vector<std::byte> sealed = payload;
  for (int edits = in.Byte() % 8; edits > 0; --edits) {
    switch (in.Byte() % 6) {
      case 0: {  // a flipped byte
        if (payload.empty()) break;
        const size_t at = in.Bytes(3) % payload.size();
        payload[at] ^= std::byte{static_cast<uint8_t>(in.Byte() | 1)};
        break;
      }
      case 1:  // cut short
        if (payload.empty()) break;
        payload.resize(in.Bytes(3) % payload.size());
        break;
      case 2:  // extended: a store's slot may be padded past the payload, and that is no change
        payload.resize(payload.size() + 1 + in.Byte() % 64, std::byte{in.Byte()});
        break;
      case 3:  // loaded for another token
        want.tokens[in.Byte() % want.tokens.size()] ^= static_cast<int32_t>(in.Bytes(4) | 1);
        break;
      case 4:  // another key, parent or digest
        switch (in.Byte() % 3) {
          case 0: want.key.bytes[in.Byte() % want.key.size] ^= static_cast<uint8_t>(in.Byte() | 1); break;
          case 1: want.parent = want.parent ? std::nullopt : std::optional<BlockKey>(Key(in, key_size)); break;
          default: want.digest.bytes[in.Byte() % 32] ^= static_cast<uint8_t>(in.Byte() | 1); break;
        }
        break;
      default:  // another geometry, or one token more or fewer
        if (in.Byte() % 2 == 0) {
          want.geometry ^= in.Bytes(8) | 1;
        } else if (want.tokens.size() > 1 && in.Byte() % 2 == 0) {
          want.tokens.pop_back();
        } else {
          want.tokens.push_back(static_cast<int32_t>(in.Bytes(4)));
        }
        break;
    }
  }
  // Edits may undo each other: what counts is whether the payload's bytes
  // (past them: padding) or the block it is loaded for differ in the end.
  const bool changed = payload.size() < sealed.size() ||
                       !std::equal(sealed.begin(), sealed.end(), payload.begin()) || !(want.key == meta.key) ||
                       want.parent != meta.parent || want.tokens != meta.tokens || want.geometry != meta.geometry ||
                       !(want.digest == meta.digest);
  BlockKey peeked;
  (void)tiers::PeekKey(payload, peeked);
  const Status s = tiers::DecodePayload(payload, want, out, seal);
  if (changed && s.ok()) std::abort();  // an edited block loaded: wrong KV
  if (!changed && (!s.ok() || out != kv)) std::abort();
  return 0;
}
