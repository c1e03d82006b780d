// The private state behind pagekv::KvCache, shared by kv_cache.cc (the write
// path) and kv_cache_report.cc (statistics and reports). Internal only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvcache/block_pool.h"
#include "kernels/backend.h"
#include "kernels/kv_arena.h"
#include "pagekv/kv_cache.h"

namespace pagekv {

struct KvCache::Sequence {
  struct Table {
    std::vector<BlockId> blocks;  // [ceil(num_tokens / block_len)]; the first `released` are kNoBlock
    int64_t released = 0;         // leading blocks given back by ReleaseBefore (a sliding window passed them)
  };
  std::vector<Table> tables;      // one per cache group (KvLayout::num_groups)
  int64_t num_tokens = 0;
  int64_t evicted = 0;  // tokens dropped by Compact
  std::string label;
  // INT4 KIVI layers: the f16 rows of the not-yet-full group
  // ([KvLayout::tail_bytes_per_sequence()], allocated on first use).
  std::vector<std::byte> tail;
};

struct KvCache::State {
  State(const Backend& b, std::unique_ptr<KvArena> a, int32_t num_blocks)
      : backend(b), arena(std::move(a)), pool(num_blocks) {}

  const Backend& backend;  // the arena's, and every block move's
  std::unique_ptr<KvArena> arena;
  BlockPool pool;
  std::unordered_map<int64_t, Sequence> sequences;  // by SeqId value; ids never reused
  int64_t next_seq_id = 0;
  std::vector<BlockId> scratch;  // reused by Append so the hot path does not allocate
  std::vector<int64_t> slots;    // WriteLayer's slot mapping, reused likewise
  int64_t copies_on_write = 0;   // shared partly filled blocks copied by Reserve
  std::function<void(const std::string&)> leak_sink;
  std::function<void(const SequenceCut&)> on_cut;

  void Cut(SeqId id, SequenceCut::Kind kind, int64_t kept) {
    if (on_cut) on_cut(SequenceCut{id, kind, kept});
  }
};

}  // namespace pagekv
