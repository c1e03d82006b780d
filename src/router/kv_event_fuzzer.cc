// libFuzzer target: KV event batches as a router receives them from a
// socket. A leading even byte: the rest is a raw payload for the decoder;
// odd: the rest drives well-formed batches (the real encoder's) of stored,
// removed and cleared events over a few backends, into the index, with
// lookups between. Any crash, sanitizer report, leak or allocation past
// libFuzzer's limit is a bug; so is an index whose block count goes
// negative or disagrees with its backends'. Built in the asan build;
// `make test` runs it for 60 s.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "prefix/kv_event_publisher.h"
#include "router/kv_events.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagekv;
  if (size == 0) return 0;
  router::KvIndex index(2);
  if (data[0] % 2 == 0) {
    Result<router::DecodedBatch> b = router::DecodeKvEventBatch({reinterpret_cast<const char*>(data + 1), size - 1});
    if (b.ok()) index.Apply(0, *b);
  } else {
    size_t at = 1;
    auto next = [&]() -> uint8_t { return at < size ? data[at++] : 0; };
    auto key = [&](uint8_t v) {
      BlockKey k;
      k.bytes[31] = v;  // few distinct keys: parents and removals meet
      return k;
    };
    while (at < size) {
      std::vector<KvEvent> events(1 + next() % 3);
      for (KvEvent& e : events) {
        const uint8_t kind = next() % 5;
        e.type = kind < 3 ? KvEvent::Type::kBlockStored : kind == 3 ? KvEvent::Type::kBlockRemoved : KvEvent::Type::kAllBlocksCleared;
        const int blocks = next() % 4;
        for (int i = 0; i < blocks; ++i) e.keys.push_back(key(next() % 16));
        if (next() % 2 == 1) e.parent = key(next() % 16);
        e.block_len = next() % 4 == 0 ? 3 : 2;
        for (int i = 0; i < blocks * e.block_len; ++i) e.token_ids.push_back(next() % 4);
        e.tier = next() % 3 == 0 ? "host" : "pool";
        e.window = next() % 5 == 0 ? 8 : 0;
      }
      const std::string payload = KvEventPublisher::EncodeBatch(events, 1.0);
      Result<router::DecodedBatch> b = router::DecodeKvEventBatch(payload);
      if (!b.ok()) std::abort();  // the real encoder's batches always decode
      const int backend = next() % 3;
      index.Apply(backend, *b);
      if (next() % 4 == 0) index.Forget(next() % 3);
      std::vector<int32_t> prompt;
      for (int i = 0; i < 9; ++i) prompt.push_back(next() % 4);
      const auto hits = index.Match(prompt, std::nullopt, 0, 3);
      for (const auto& h : hits) {
        if (h.blocks < 0 || h.blocks > 4 || h.pool_blocks > h.blocks) std::abort();
      }
      int64_t sum = 0;
      for (int k = 0; k < 3; ++k) sum += index.BackendBlocks(k);
      if (index.Stats().blocks != sum) std::abort();
    }
  }
  return 0;
}
