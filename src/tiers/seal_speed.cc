// MeasureSealSpeed (include/pagekv/tiers.h): sealing and checking one tier
// payload with the checksum and with the MAC, timed on this machine.
#include <chrono>
#include <cstring>

#include "base/check.h"
#include "pagekv/tiers.h"
#include "tiers/block_payload.h"

namespace pagekv {
namespace {

// Seconds per call of f, over at least `seconds` and 3 calls.
template <typename F>
double SecondsPerCall(F&& f, double seconds) {
  using Clock = std::chrono::steady_clock;
  f();  // warm: pages touched, code loaded
  int64_t calls = 0;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  do {
    f();
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds || calls < 3);
  return elapsed / static_cast<double>(calls);
}

}  // namespace

Result<SealSpeed> MeasureSealSpeed(int32_t block_len, int64_t kv_bytes, double seconds) {
  if (block_len < 1 || kv_bytes < 1 || kv_bytes > (int64_t{1} << 32) || !(seconds > 0)) {
    return InvalidArgumentError("seal speed: block_len and kv_bytes must be positive (kv_bytes at most 4 GiB) and "
                                "seconds positive");
  }
  BlockMeta meta;
  meta.key.size = 32;
  for (int i = 0; i < 32; ++i) meta.key.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
  meta.tokens.resize(static_cast<size_t>(block_len));
  for (int32_t i = 0; i < block_len; ++i) meta.tokens[static_cast<size_t>(i)] = i;
  std::vector<std::byte> kv(static_cast<size_t>(kv_bytes)), out(kv.size()), payload;
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<std::byte>(i * 131);
  SealSpeed s;
  s.payload_bytes = static_cast<int64_t>(tiers::PayloadBytes(meta.tokens.size(), kv.size()));
  const tiers::PayloadSeal checksum, mac(std::string(32, 'k'));
  auto gbps = [&](double sec) { return static_cast<double>(s.payload_bytes) / sec / 1e9; };
  for (const tiers::PayloadSeal* seal : {&checksum, &mac}) {
    const double put = SecondsPerCall([&] { tiers::EncodePayload(meta, kv, *seal, payload); }, seconds);
    const double get = SecondsPerCall(
        [&] { PAGEKV_CHECK(tiers::DecodePayload(payload, meta, out, *seal).ok()); }, seconds);
    (seal == &checksum ? s.checksum_seal_gbps : s.mac_seal_gbps) = gbps(put);
    (seal == &checksum ? s.checksum_check_gbps : s.mac_check_gbps) = gbps(get);
  }
  const double copy = SecondsPerCall([&] { std::memcpy(out.data(), kv.data(), kv.size()); }, seconds);
  s.memcpy_gbps = static_cast<double>(kv.size()) / copy / 1e9;
  return s;
}

}  // namespace pagekv
