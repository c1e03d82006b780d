// KvCache::Compact, token eviction's row moves (CompactionMoves): the kept
// slots of every (layer, head) move down, the emptied blocks go back.
#include <algorithm>
#include <cstring>
#include <string>

#include "base/check.h"
#include "kvcache/kv_cache_state.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

std::string SeqName(SeqId id) { return "sequence " + std::to_string(ToInt(id)); }

}  // namespace

std::vector<std::pair<int32_t, int32_t>> CompactionMoves(std::span<const int32_t> keep) {
  const auto k = static_cast<int32_t>(keep.size());
  std::vector<char> kept_below(static_cast<size_t>(k), 0);
  std::vector<int32_t> sources;
  for (int32_t slot : keep) {
    if (slot < k) {
      kept_below[static_cast<size_t>(slot)] = 1;
    } else {
      sources.push_back(slot);
    }
  }
  std::sort(sources.begin(), sources.end());
  std::vector<std::pair<int32_t, int32_t>> moves;
  moves.reserve(sources.size());
  size_t next = 0;
  for (int32_t hole = 0; hole < k && next < sources.size(); ++hole) {
    if (kept_below[static_cast<size_t>(hole)] == 0) moves.emplace_back(sources[next++], hole);
  }
  return moves;
}

Status KvCache::Compact(SeqId id, std::span<const int32_t> keep, int64_t keep_count) {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError("compact: " + SeqName(id) + " does not exist");
  if (!state_->backend.host_memory()) {
    return FailedPreconditionError("compact: token eviction rewrites rows in place on the host; the arena is in " +
                                   state_->backend.name() + " memory: run eviction on the CPU backend");
  }
  Sequence& s = it->second;
  if (keep_count < 0 || keep_count > s.num_tokens) {
    return OutOfRangeError("compact: keep_count " + std::to_string(keep_count) + " of " + SeqName(id) +
                           " must be in [0, " + std::to_string(s.num_tokens) + "]");
  }
  if (slices_ > 1) {
    return UnimplementedError("compact: the cache holds one context slice of each block; token eviction moves rows "
                              "across slices, which live in other processes");
  }
  if (layout_.hybrid() || s.tables[0].released > 0) {
    return FailedPreconditionError("compact: " + SeqName(id) + (layout_.hybrid() ? " is in a hybrid (sliding-window) cache"
                                   : " released blocks to a sliding window") + "; token eviction and sliding windows do not combine");
  }
  for (int32_t l = 0; l < layout_.num_layers(); ++l) {
    if (layout_.kivi(l)) {
      return UnimplementedError("compact: layer " + std::to_string(l) + " is int4 KIVI, whose keys share scales "
                                "across a group of tokens; token eviction needs self-contained rows (f16, bf16, "
                                "f32, int8, fp8)");
    }
  }
  const int64_t lists = int64_t{layout_.num_layers()} * layout_.num_heads();
  if (static_cast<int64_t>(keep.size()) != lists * keep_count) {
    return InvalidArgumentError("compact: keep has " + std::to_string(keep.size()) + " slots; expected " +
                                std::to_string(lists) + " (layer, head) lists of " + std::to_string(keep_count));
  }
  // Validate every list and collect the moves before touching anything.
  const int64_t bl = layout_.block_len();
  std::vector<std::vector<std::pair<int32_t, int32_t>>> moves(static_cast<size_t>(lists));
  std::vector<char> seen(static_cast<size_t>(s.num_tokens));
  for (int64_t li = 0; li < lists; ++li) {
    const std::span<const int32_t> list = keep.subspan(static_cast<size_t>(li * keep_count), static_cast<size_t>(keep_count));
    std::fill(seen.begin(), seen.end(), 0);
    for (int32_t slot : list) {
      if (slot < 0 || slot >= s.num_tokens || seen[static_cast<size_t>(slot)] != 0) {
        return InvalidArgumentError("compact: (layer " + std::to_string(li / layout_.num_heads()) + ", head " +
                                    std::to_string(li % layout_.num_heads()) + ") keeps slot " + std::to_string(slot) +
                                    (slot >= 0 && slot < s.num_tokens ? " twice" : " outside [0, " +
                                     std::to_string(s.num_tokens) + ")"));
      }
      seen[static_cast<size_t>(slot)] = 1;
    }
    moves[static_cast<size_t>(li)] = CompactionMoves(list);
    for (const auto& [from, to] : moves[static_cast<size_t>(li)]) {
      const BlockId b = s.tables[0].blocks[static_cast<size_t>(to / bl)];
      if (state_->pool.RefCount(b) > 1 || state_->pool.IsCached(b)) {
        return FailedPreconditionError("compact: " + SeqName(id) + " would rewrite slot " + std::to_string(to) +
                                       " in a block shared with another sequence or published to the prefix cache;"
                                       " evict only from sequences that own their blocks (no fork, no prefix caching)");
      }
    }
  }
  int64_t unchanged = keep_count;  // leading positions whose rows stay where they are
  for (const auto& list_moves : moves) {
    if (!list_moves.empty()) unchanged = std::min<int64_t>(unchanged, list_moves.front().second);
  }
  std::byte* base = state_->arena->data();
  const std::vector<BlockId>& blocks = s.tables[0].blocks;
  for (int64_t li = 0; li < lists; ++li) {
    const auto layer = static_cast<int32_t>(li / layout_.num_heads());
    const auto head = static_cast<int32_t>(li % layout_.num_heads());
    const auto row = static_cast<size_t>(layout_.row_bytes(layer));
    for (const auto& [from, to] : moves[static_cast<size_t>(li)]) {
      for (int32_t p = 0; p < layout_.num_planes(); ++p) {
        std::memcpy(base + layout_.RowOffset(layer, p, head, ToInt(blocks[static_cast<size_t>(to / bl)]),
                                             static_cast<int32_t>(to % bl)),
                    base + layout_.RowOffset(layer, p, head, ToInt(blocks[static_cast<size_t>(from / bl)]),
                                             static_cast<int32_t>(from % bl)),
                    row);
      }
    }
  }
  const int64_t dropped = s.num_tokens - keep_count;
  PAGEKV_RETURN_IF_ERROR(Shorten(id, keep_count));
  s.evicted += dropped;
  if (dropped > 0) state_->Cut(id, SequenceCut::Kind::kCompacted, unchanged);
  return Status::Ok();
}

}  // namespace pagekv
