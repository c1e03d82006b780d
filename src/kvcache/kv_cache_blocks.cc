// A KvCache's blocks as whole payloads (what the tiers store and the
// prefix cache loads): the geometry tag that tells caches' blocks apart,
// and a block's bytes out of and into the arena.
#include <string>
#include <vector>

#include "kvcache/kv_cache_state.h"
#include "pagekv/kv_cache.h"

namespace pagekv {
namespace {

std::string SeqName(SeqId id) { return "sequence " + std::to_string(ToInt(id)); }

}  // namespace

uint64_t KvCache::GeometryTag() const {
  std::vector<int64_t> fields = {layout_.num_layers(), layout_.num_planes(), layout_.num_heads(), layout_.row_elems(),
                                 layout_.block_len()};
  for (int32_t l = 0; l < layout_.num_layers(); ++l) {  // every layer's format and row size
    const KvFormat& f = layout_.format(l);
    fields.insert(fields.end(), {layout_.row_bytes(l), static_cast<int64_t>(f.dtype), static_cast<int64_t>(f.scale_axis),
                                 f.group_size, static_cast<int64_t>(f.scale_dtype), f.hadamard ? 1 : 0});
  }
  if (layout_.hybrid()) {  // the groups' layers and windows (a uniform cache's tag is as before)
    for (int32_t g = 0; g < layout_.num_groups(); ++g) {
      fields.push_back(-1 - layout_.group_window(g));
      for (int32_t l : layout_.group_layers(g)) fields.push_back(l);
    }
  }
  if (slices_ > 1 || shard_tag_ != 0) {  // a shard's blocks (an unsplit cache's tag is as before)
    fields.insert(fields.end(), {-1000, slices_, slice_, static_cast<int64_t>(shard_tag_)});
  }
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (int64_t v : fields) {  // splitmix64 over the fields
    h += static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ULL;
    uint64_t z = h;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    h = z ^ (z >> 31);
  }
  return h;
}

Status KvCache::ReadBlock(BlockId block, std::span<std::byte> out) const {
  if (ToInt(block) < 0 || ToInt(block) >= layout_.num_blocks()) {
    return OutOfRangeError("read block: block " + std::to_string(ToInt(block)) + " outside the pool of " +
                           std::to_string(layout_.num_blocks()));
  }
  if (static_cast<int64_t>(out.size()) != block_payload_bytes()) {
    return InvalidArgumentError("read block: the buffer has " + std::to_string(out.size()) + " bytes; a block has " +
                                std::to_string(block_payload_bytes()));
  }
  state_->backend.BlockToHost(arena_layout_, state_->arena->data(), block, out);
  return Status::Ok();
}

Status KvCache::WriteBlock(SeqId id, int64_t index, std::span<const std::byte> data, int32_t group) {
  auto it = state_->sequences.find(ToInt(id));
  if (it == state_->sequences.end()) return NotFoundError("write block: " + SeqName(id) + " does not exist");
  if (group < 0 || group >= layout_.num_groups()) {
    return OutOfRangeError("write block: group " + std::to_string(group) + " outside the cache's " +
                           std::to_string(layout_.num_groups()));
  }
  const Sequence::Table& s = it->second.tables[static_cast<size_t>(group)];
  if (index < 0 || index >= static_cast<int64_t>(s.blocks.size())) {
    return OutOfRangeError("write block: block " + std::to_string(index) + " outside " + SeqName(id) + "'s " +
                           std::to_string(s.blocks.size()) + " blocks");
  }
  if (index < s.released) {
    return FailedPreconditionError("write block: block " + std::to_string(index) + " of " + SeqName(id) +
                                   " was released by ReleaseBefore");
  }
  if (static_cast<int64_t>(data.size()) != block_payload_bytes()) {
    return InvalidArgumentError("write block: " + std::to_string(data.size()) + " bytes; a block has " +
                                std::to_string(block_payload_bytes()));
  }
  const BlockId block = s.blocks[static_cast<size_t>(index)];
  if (state_->pool.RefCount(block) > 1 || state_->pool.IsCached(block)) {
    return FailedPreconditionError("write block: block " + std::to_string(index) + " of " + SeqName(id) +
                                   " is shared or published to the prefix cache");
  }
  state_->backend.HostToBlock(arena_layout_, state_->arena->data(), block, data);
  return Status::Ok();
}

Status KvCache::FillBlock(BlockId block, std::span<const std::byte> data) {
  if (ToInt(block) < 0 || ToInt(block) >= layout_.num_blocks()) {
    return OutOfRangeError("fill block: block " + std::to_string(ToInt(block)) + " outside the pool of " +
                           std::to_string(layout_.num_blocks()));
  }
  if (static_cast<int64_t>(data.size()) != block_payload_bytes()) {
    return InvalidArgumentError("fill block: " + std::to_string(data.size()) + " bytes; a block has " +
                                std::to_string(block_payload_bytes()));
  }
  state_->backend.HostToBlock(arena_layout_, state_->arena->data(), block, data);
  return Status::Ok();
}

}  // namespace pagekv
